"""Which store the record of the current test lives in (see conftest.py).

``database_url`` is what ``running_server`` and ``broker`` pass as
``FUNDUQ_DATABASE_URL`` unless a test names one: None for the SQLite file in
the test's data directory, or a PostgreSQL URL whose ``search_path`` is a
schema made for this test alone.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

#: The PostgreSQL the tests use (their own schema per test in it).
POSTGRES_URL = os.environ.get(
    "FUNDUQ_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)

database_url: str | None = None

_unavailable: list[str] = []  # why PostgreSQL does not answer (checked once)
_checked = False


def postgres_unavailable() -> str | None:
    """Why the tests' PostgreSQL cannot be used, or None when it answers."""
    global _checked
    if not _checked:
        _checked = True
        try:
            import psycopg

            psycopg.connect(POSTGRES_URL, connect_timeout=3).close()
        except Exception as exc:  # noqa: BLE001 -- any reason is the reason
            _unavailable.append(
                f"no PostgreSQL answers at {POSTGRES_URL} (FUNDUQ_TEST_POSTGRES_URL): {exc}".strip()
            )
    return _unavailable[0] if _unavailable else None


def new_schema() -> tuple[str, str]:
    """A fresh schema for one test: (its name, the URL that uses it)."""
    import psycopg

    name = "funduq_test_" + secrets.token_hex(6)
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
    options = quote(f"-c search_path={name}")
    joiner = "&" if "?" in POSTGRES_URL else "?"
    # The application name marks this test's connections (see drop_connections).
    return name, f"{POSTGRES_URL}{joiner}options={options}&application_name={name}"


def drop_connections(url: str) -> int:
    """Have the server drop every connection of the test whose URL this is
    (as a restarted or failed-over server would); how many it dropped."""
    import psycopg

    name = url.rsplit("application_name=", 1)[1]
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        return sum(
            1
            for (ok,) in conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name = %s",
                (name,),
            )
            if ok
        )


def drop_schema(name: str) -> None:
    import psycopg

    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


@contextlib.contextmanager
def writes_held(data_dir: Path) -> Iterator[None]:
    """Another connection holds the current test's record against writes
    until the block ends: SQLite's write lock on the file, or PostgreSQL's
    locks on the run tables. funduq's writer waits meanwhile (well inside its
    busy timeout)."""
    if database_url is None:
        blocker = sqlite3.connect(data_dir / "funduq.sqlite3", isolation_level=None, timeout=5)
        try:
            blocker.execute("BEGIN IMMEDIATE")
            yield
        finally:
            blocker.execute("ROLLBACK")
            blocker.close()
        return
    import psycopg

    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute("BEGIN")
        conn.execute("LOCK TABLE runs, events, messages IN EXCLUSIVE MODE")
        try:
            yield
        finally:
            conn.execute("ROLLBACK")


@contextlib.contextmanager
def record_connection(path: Path) -> Iterator[Any]:
    """A connection to the current test's record from outside funduq (as an
    operator's shell or an older build would touch it): ``execute`` takes the
    record's shared SQL (``?`` placeholders) on either store; what it wrote
    is committed when the block ends. ``path`` is the SQLite file."""
    if database_url is None:
        conn = sqlite3.connect(path)
        try:
            with conn:
                yield conn
        finally:
            conn.close()
        return
    import psycopg

    from funduq_trio.broker.postgres import PgConnection

    with psycopg.connect(database_url) as raw:  # commits at the end of the block
        yield PgConnection(raw)


def lapse_leases(thread_ids: list[str]) -> None:
    """The threads' leases run out (as a dead node's would), on the database's clock."""
    import psycopg

    assert database_url is not None
    with psycopg.connect(database_url, autocommit=True) as conn:
        conn.execute(
            "UPDATE thread_leases SET expires_at = now() - interval '1 second' "
            "WHERE thread_id = ANY(%s)",
            (thread_ids,),
        )
