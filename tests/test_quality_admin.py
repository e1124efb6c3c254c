"""`funduq-trio quality list | reset` on the record `serve` opens, server
stopped: the SQLite file, or the PostgreSQL database (each test runs on both
stores, see conftest.py)."""

from __future__ import annotations

import json
import sys

import pytest
import stores
import trio
from support import raw_provider, running_server
from test_cli import cli_env


def where(tmp_path) -> list[str]:
    """The flags that name this test's record, as for serve."""
    if stores.database_url is None:
        return ["--data-dir", str(tmp_path)]
    return ["--database-url", stores.database_url]


async def quality(*argv: str, cwd=None, env=None):
    return await trio.run_process(
        [sys.executable, "-m", "funduq_trio", "quality", *argv],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env={**cli_env(), **(env or {})},
        cwd=cwd,
    )


def strike(tmp_path, key: str, **counts: int) -> None:
    """Strikes recorded while it served (what the broker's count() writes),
    written from outside funduq."""
    columns = ", ".join(f"{name}=?" for name in counts)
    with stores.record_connection(tmp_path / "funduq.sqlite3") as conn:
        conn.execute(f"UPDATE providers SET {columns} WHERE key=?", (*counts.values(), key))


async def test_list_and_reset_a_providers_counters(tmp_path):
    async with running_server(tmp_path) as info, raw_provider(info, ["echo"]) as provider:
        key, fingerprint = provider.key, provider.fingerprint
    strike(tmp_path, key, unanswered=3, abandoned=1)

    listed = await quality("list", "--json", *where(tmp_path))
    assert listed.returncode == 0, listed.stderr.decode()
    [row] = json.loads(listed.stdout)["providers"]
    assert row == {
        "provider": key,
        "fingerprint": fingerprint,
        "misdeclared": 0,
        "unanswered": 3,
        "abandoned": 1,
        "undelivered": 0,
    }
    table = await quality("list", *where(tmp_path))
    assert fingerprint in table.stdout.decode() and "unanswered" in table.stdout.decode()

    reset = await quality("reset", fingerprint, *where(tmp_path))
    assert reset.returncode == 0, reset.stderr.decode()
    assert reset.stdout.decode() == f"reset the quality counters of provider {key}\n"

    # The next start reads the reset counters.
    async with running_server(tmp_path) as info:
        [seen] = info.funduq.provider_quality()
        assert seen["counters"] == {
            "misdeclared": 0,
            "unanswered": 0,
            "abandoned": 0,
            "undelivered": 0,
        }


async def test_the_record_may_be_named_by_the_environment(tmp_path):
    """FUNDUQ_DATABASE_URL (or FUNDUQ_DATA_DIR) names the record as for serve."""
    async with running_server(tmp_path) as info, raw_provider(info, ["echo"]) as provider:
        key = provider.key
    strike(tmp_path, key, misdeclared=2)
    if stores.database_url is None:
        env = {"FUNDUQ_DATA_DIR": str(tmp_path)}
    else:
        env = {"FUNDUQ_DATABASE_URL": stores.database_url}
    reset = await quality("reset", key.upper(), env=env)
    assert reset.returncode == 0, reset.stderr.decode()
    listed = await quality("list", "--json", env=env)
    [row] = json.loads(listed.stdout)["providers"]
    assert row["provider"] == key and row["misdeclared"] == 0


async def test_a_reset_under_a_running_server_is_undone_by_its_next_strike(tmp_path):
    """What the docstring warns of: the reset is in the record at once, but
    a running funduq (each node, on PostgreSQL) counts on from what it holds
    and writes that count back at its next strike."""
    async with running_server(tmp_path) as info, raw_provider(info, ["echo"]) as provider:
        key = provider.key
        providers = info.funduq.providers
        await providers.count(key, "unanswered")
        await providers.count(key, "unanswered")
        reset = await quality("reset", key, *where(tmp_path))
        assert reset.returncode == 0, reset.stderr.decode()
        listed = await quality("list", "--json", *where(tmp_path))
        assert json.loads(listed.stdout)["providers"][0]["unanswered"] == 0
        await providers.count(key, "unanswered")
    listed = await quality("list", "--json", *where(tmp_path))
    assert json.loads(listed.stdout)["providers"][0]["unanswered"] == 3


async def test_quality_errors_are_one_line_and_create_nothing(tmp_path):
    missing = await quality("list", "--data-dir", str(tmp_path / "nope"))
    assert missing.returncode == 1
    assert missing.stderr.decode().startswith("funduq-trio quality: error: no record at ")
    assert not (tmp_path / "nope").exists()
    async with running_server(tmp_path):
        pass
    unknown = await quality("reset", "0" * 16, *where(tmp_path))
    assert unknown.returncode == 1
    assert f"no provider {'0' * 16}" in unknown.stderr.decode()
    bad = await quality("reset", "not-a-key", *where(tmp_path))
    assert bad.returncode == 1 and "neither a 64-hex" in bad.stderr.decode()


@pytest.mark.sqlite_only
async def test_a_file_without_funduq_tables_is_no_record(tmp_path):
    empty = tmp_path / "funduq.sqlite3"
    empty.write_bytes(b"")
    listed = await quality("list", "--data-dir", str(tmp_path))
    assert listed.returncode == 1
    assert "no record at " in listed.stderr.decode()
    assert "holds no funduq tables" in listed.stderr.decode()
    assert empty.read_bytes() == b""
    foreign = await quality("list", "--database-url", "sqlite:///nope/x.sqlite3", cwd=tmp_path)
    assert foreign.returncode == 1 and "no record at nope/x.sqlite3" in foreign.stderr.decode()
    assert not (tmp_path / "nope").exists()


@pytest.mark.parametrize("store", ["postgres"], indirect=True)
async def test_a_postgres_database_without_funduq_schema_is_no_record(tmp_path):
    """On PostgreSQL a database (here: this test's fresh schema) that funduq
    never opened is refused, and left without funduq's tables."""
    import psycopg

    listed = await quality("list", "--database-url", stores.database_url)
    assert listed.returncode == 1
    message = listed.stderr.decode()
    assert message.startswith("funduq-trio quality: error: no record in PostgreSQL database ")
    assert "no funduq schema there" in message and message.count("\n") == 1
    reset = await quality("reset", "0" * 64, "--database-url", stores.database_url)
    assert reset.returncode == 1 and "no funduq schema there" in reset.stderr.decode()
    with psycopg.connect(stores.database_url) as conn:
        [(tables,)] = conn.execute(
            "SELECT count(*) FROM pg_tables WHERE schemaname = current_schema()"
        ).fetchall()
    assert tables == 0


@pytest.mark.parametrize("store", ["postgres"], indirect=True)
async def test_a_postgres_database_that_does_not_answer_is_one_line(tmp_path):
    url = "postgresql://nobody:secret@127.0.0.1:1/none?connect_timeout=2"
    listed = await quality("list", "--database-url", url)
    assert listed.returncode == 1
    message = listed.stderr.decode()
    assert message.startswith("funduq-trio quality: error: PostgreSQL database none on 127.0.0.1:1")
    assert "secret" not in message and message.count("\n") == 1
