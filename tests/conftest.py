"""Every test that touches the record runs on both stores: SQLite and
PostgreSQL (``store`` is ``sqlite`` or ``postgres``; tests/stores.py has the
URL). A test opts in by taking ``tmp_path`` (where the SQLite record lives);
the modules below, whose tests never reach the record or are about SQLite
itself, run once on SQLite.

PostgreSQL is FUNDUQ_TEST_POSTGRES_URL (default
postgresql://postgres@127.0.0.1:5432/test); each test gets a schema of its own,
dropped after it. Where no PostgreSQL answers those tests are skipped with one
reason -- except under CI (the ``CI`` variable set), where that is a failure:
CI cannot pass by skipping.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import stores
from hypothesis import settings

# No wall-clock deadline on any property test: an example's time is the
# host's load, not the code's (a loaded CI host failed one at 325 ms of 200).
settings.register_profile("funduq", deadline=None)
settings.load_profile("funduq")

#: Modules run on SQLite only: pure logic and the link's own behaviour (the
#: record is not what they test), and tests of the SQLite file itself.
ONE_STORE = {
    "test_a2a_mapping",
    "test_cli",
    "test_identity",
    "test_link_machine",
    "test_run_machine",
    "test_provider_sdk",
    "test_provider_link",
    "test_link_batches",
    "test_broker_record",
    "test_crash_restart",
    "test_record_schema",
    "test_kyok_units",
    "test_kyok_forwarder",
    "test_a2a_signed_card",
    "test_provider_link_asgi",
    "test_startup",
    "test_cors",
    "test_operator_page",
    "test_provider_cli",
    "test_runs_cli",
    "test_a2a_conformance",
}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "sqlite_only: runs on the SQLite store alone")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "tmp_path" not in metafunc.fixturenames or "store" not in metafunc.fixturenames:
        return
    if metafunc.module.__name__.rsplit(".", 1)[-1] in ONE_STORE:
        return
    if metafunc.definition.get_closest_marker("sqlite_only"):
        return
    if any("store" in str(m.args[0]) for m in metafunc.definition.iter_markers("parametrize")):
        return  # the test names its stores itself
    metafunc.parametrize("store", ["sqlite", "postgres"], indirect=True)


@pytest.fixture(autouse=True)
def store(request: pytest.FixtureRequest) -> Iterator[str]:
    """The store this test's record lives in."""
    kind = getattr(request, "param", "sqlite")
    if kind == "sqlite":
        stores.database_url = None
        yield kind
        return
    why = stores.postgres_unavailable()
    if why is not None:
        if os.environ.get("CI"):
            pytest.fail(f"CI needs PostgreSQL: {why}")
        pytest.skip(why)
    schema, stores.database_url = stores.new_schema()
    try:
        yield kind
    finally:
        stores.database_url = None
        stores.drop_schema(schema)
