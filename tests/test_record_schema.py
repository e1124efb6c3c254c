"""The record's schema has a version and is upgraded in place at start
(issue #12 item 2): the migration list's logic, the upgrade on real files,
and a record made by the code before versions (tests/data/record-v1.sqlite3,
made by tests/data/make_record_v1.py on commit d2191a5) opened by this build
without losing anything."""

from __future__ import annotations

import json
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
from broker_support import (
    Provider,
    broker,
    events_of,
    last_offer_for,
    offered_runs,
    quiet,
    record_of,
    reply,
    resume_input,
    status_of,
)
from support import http_client, running_server
from test_cli import cli_env

from funduq_trio.broker import schema
from funduq_trio.broker.record import SqliteStore, run_store
from funduq_trio.broker.schema import Migration, SchemaTooNew
from funduq_trio.identity import Identity
from funduq_trio.provider import Provider as SdkProvider
from funduq_trio.provider import echo

DATA = Path(__file__).parent / "data"
OLD_IDS = json.loads((DATA / "record-v1.json").read_text())
TABLES = ("providers", "agents", "threads", "runs", "events", "messages")
ORPHANED = {"type": "RUN_ERROR", "message": "orphaned_by_restart", "code": "orphaned_by_restart"}


def old_record(tmp_path: Path) -> Path:
    """A copy of the file the d2191a5 code left, where a Funduq on tmp_path opens it."""
    path = tmp_path / "funduq.sqlite3"
    shutil.copyfile(DATA / "record-v1.sqlite3", path)
    return path


def rows(path: Path) -> dict[str, list[tuple[Any, ...]]]:
    with sqlite3.connect(path) as conn:
        return {t: sorted(conn.execute(f"SELECT * FROM {t}").fetchall(), key=repr) for t in TABLES}


def version_of(path: Path) -> int:
    with sqlite3.connect(path) as conn:
        return conn.execute("PRAGMA user_version").fetchone()[0]


# -- the list's logic (pure) -------------------------------------------------------------------

STEPS = (
    Migration(1, "one", "CREATE TABLE a (x)"),
    Migration(2, "two", "CREATE TABLE b (y)"),
    Migration(3, "three", "ALTER TABLE a ADD COLUMN z"),
)


def test_plan_takes_a_file_from_where_it_is_to_the_latest_in_order():
    assert schema.plan(0, STEPS) == list(STEPS)
    assert schema.plan(1, STEPS) == list(STEPS[1:])
    assert schema.plan(3, STEPS) == []
    assert schema.latest(STEPS) == 3


def test_plan_refuses_a_file_newer_than_it_knows():
    with pytest.raises(SchemaTooNew, match=r"schema version 4, newer .* \(up to 3\)"):
        schema.plan(4, STEPS)


@pytest.mark.parametrize("numbers", [(1, 3), (2,), (1, 1), (2, 1)])
def test_a_misnumbered_list_is_refused(numbers):
    with pytest.raises(ValueError, match="numbered"):
        schema.plan(0, tuple(Migration(n, "", "SELECT 1") for n in numbers))


def test_a_file_with_tables_and_no_mark_is_version_1():
    assert schema.found_version(0, has_tables=False) == 0
    assert schema.found_version(0, has_tables=True) == 1
    assert schema.found_version(2, has_tables=True) == 2


def test_statements_keep_a_trigger_body_whole():
    sql = """CREATE TABLE t (x);
    -- a comment; with a semicolon
    CREATE TRIGGER t_x AFTER INSERT ON t BEGIN UPDATE t SET x = 1; SELECT 2; END;
    INSERT INTO t VALUES ('a;b')"""
    found = schema.statements(sql)
    assert len(found) == 3
    assert found[1].startswith("-- a comment") and found[1].endswith("END;")
    assert found[2] == "INSERT INTO t VALUES ('a;b');"


def test_the_shipped_list_is_well_formed():
    schema.check(schema.MIGRATIONS)
    for step in schema.MIGRATIONS:
        assert step.why and schema.statements(step.sql)


# -- the upgrade on real files ------------------------------------------------------------------


def connect(path: Path) -> sqlite3.Connection:
    return sqlite3.connect(path, isolation_level=None)


def test_upgrade_applies_each_missing_step_once_and_marks_it(tmp_path):
    path = tmp_path / "r.sqlite3"
    conn = connect(path)
    assert schema.upgrade(conn, migrations=STEPS[:1]) == [1]
    conn.execute("INSERT INTO a VALUES (7)")
    assert schema.upgrade(conn, migrations=STEPS) == [2, 3]
    assert schema.upgrade(conn, migrations=STEPS) == []
    assert conn.execute("SELECT x, z FROM a").fetchall() == [(7, None)]
    assert version_of(path) == 3


def test_a_file_made_before_versions_is_marked_1_then_upgraded(tmp_path):
    path = tmp_path / "r.sqlite3"
    conn = connect(path)
    conn.execute("CREATE TABLE runs (id)")  # what version 1 holds, with no mark
    conn.execute("CREATE TABLE a (x)")
    assert schema.upgrade(conn, migrations=STEPS) == [2, 3]
    assert version_of(path) == 3


def test_a_failing_step_leaves_the_file_at_the_step_before(tmp_path):
    path = tmp_path / "r.sqlite3"
    conn = connect(path)
    bad = (*STEPS[:2], Migration(3, "bad", "CREATE TABLE c (x); ALTER TABLE nowhere ADD y"))
    with pytest.raises(sqlite3.OperationalError, match="nowhere") as failed:
        schema.upgrade(conn, migrations=bad)
    assert failed.value.__notes__ == [
        "the record: schema migration 3 (bad) failed at: ALTER TABLE nowhere ADD y;"
    ]
    assert version_of(path) == 2
    assert not conn.in_transaction
    # Step 3's first statement was rolled back with it: a fixed step 3 applies whole.
    assert conn.execute("SELECT name FROM sqlite_master WHERE name='c'").fetchone() is None
    assert schema.upgrade(conn, migrations=STEPS) == [3]


def test_a_step_applied_by_another_process_meanwhile_is_not_applied_again(tmp_path):
    path = tmp_path / "r.sqlite3"
    ours, theirs = connect(path), connect(path)
    schema.upgrade(ours, migrations=STEPS[:1])

    def they_get_there_first(step: Migration) -> None:
        if step.version == 2:
            schema.upgrade(theirs, migrations=STEPS[:2])

    # Without the second look under the write lock, step 2 fails: "table b already exists".
    assert schema.upgrade(ours, migrations=STEPS, before_step=they_get_there_first) == [3]
    assert version_of(path) == 3


def test_step_7_replaces_the_two_listing_indexes_with_one_and_keeps_every_run(tmp_path):
    path = tmp_path / "r.sqlite3"
    conn = connect(path)
    assert schema.upgrade(conn, migrations=schema.MIGRATIONS[:6]) == [1, 2, 3, 4, 5, 6]
    conn.executemany(
        "INSERT INTO runs (arrival, id, thread_id, provider_key, agent_name, status, input,"
        " created_at, started_at, completed_at) VALUES (?,?,'t','k','echo',?,'{}',?,?,?)",
        [(1, "run_a", "completed", 1.0, 2.0, 3.0), (2, "run_b", "running", 1.5, 1.6, None)],
    )
    before = conn.execute("SELECT * FROM runs ORDER BY arrival").fetchall()
    assert schema.upgrade(conn) == list(range(7, schema.latest() + 1))
    indexes = {
        r[0]
        for r in conn.execute(
            "SELECT name FROM sqlite_master WHERE type='index' AND tbl_name='runs'"
        )
    }
    assert "runs_agent_listing" in indexes
    assert not indexes & {"runs_agent", "runs_agent_status_time"}
    assert conn.execute("SELECT * FROM runs ORDER BY arrival").fetchall() == before


def test_step_10_keeps_only_bound_threads_in_the_segment_head_index(tmp_path):
    path = tmp_path / "r.sqlite3"
    conn = connect(path)
    assert schema.upgrade(conn, migrations=schema.MIGRATIONS[:9]) == list(range(1, 10))
    conn.executemany(
        "INSERT INTO threads (id, provider_key, agent_name, segment_head, created_at) "
        "VALUES (?,'k','echo',?,1.0)",
        [("thread_a", None), ("thread_b", "head"), ("thread_c", None)],
    )
    assert schema.upgrade(conn) == list(range(10, schema.latest() + 1))
    (sql,) = conn.execute(
        "SELECT sql FROM sqlite_master WHERE name='threads_segment_head'"
    ).fetchone()
    assert "WHERE segment_head IS NOT NULL" in sql
    lookup = "SELECT id FROM threads WHERE segment_head=?"
    plan = " ".join(r[-1] for r in conn.execute("EXPLAIN QUERY PLAN " + lookup, ("head",)))
    assert "USING INDEX threads_segment_head" in plan
    assert conn.execute(lookup, ("head",)).fetchall() == [("thread_b",)]
    assert conn.execute("SELECT COUNT(*) FROM threads").fetchone() == (3,)
    # An unbound thread's row has no entry in it.
    assert conn.execute(
        "SELECT COUNT(*) FROM threads INDEXED BY threads_segment_head WHERE segment_head IS NOT NULL"
    ).fetchone() == (1,)


class _TracedStore(SqliteStore):
    """The SQLite store, noting every SELECT its readers run."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self.selects: list[str] = []

    def _connect(self) -> sqlite3.Connection:
        conn = super()._connect()
        conn.set_trace_callback(
            lambda sql: self.selects.append(sql) if sql.lstrip().startswith("SELECT") else None
        )
        return conn


async def test_both_listings_page_from_the_one_index(tmp_path):
    """GET /runs (by arrival) and ListTasks (by status time) find an agent's
    runs through runs_agent_listing, never a scan of the table; ListTasks
    reads nothing but the index (its sort keeps one page, LIMIT)."""
    key = "k" * 64
    async with run_store(_TracedStore(tmp_path / "r.sqlite3")) as store:
        assert isinstance(store, _TracedStore)
        await store.list_runs(thread_id=None, provider_key=key, agent="echo", limit=10)
        await store.list_runs(
            thread_id=None, provider_key=key, agent="echo", limit=10, before="run_x"
        )
        await store.task_ids(
            key,
            "echo",
            thread_id=None,
            bound_to=None,
            status=None,
            status_after=None,
            limit=10,
            after_run=None,
        )
        await store.task_ids(
            key,
            "echo",
            thread_id=None,
            bound_to=None,
            status=None,
            status_after=5.0,
            limit=10,
            after_run="run_x",
        )
        plans = {}
        for sql in dict.fromkeys(store.selects):
            plan = await store.read(
                lambda c, sql=sql: c.execute("EXPLAIN QUERY PLAN " + sql).fetchall()
            )
            plans[sql] = [row[3] for row in plan]
    listings = {sql: plan for sql, plan in plans.items() if "FROM runs r WHERE" in sql}
    assert len(listings) == 6  # two pages of GET /runs, two counts and two pages of ListTasks
    for sql, plan in listings.items():
        assert any("INDEX runs_agent_listing" in step for step in plan), (sql, plan)
        assert not any(step.startswith("SCAN") for step in plan), (sql, plan)
        if sql.startswith("SELECT r.id FROM") or sql.startswith("SELECT COUNT(*)"):
            assert any("COVERING INDEX runs_agent_listing" in step for step in plan), (sql, plan)


# -- a Funduq on the files ----------------------------------------------------------------------


async def test_a_new_record_is_made_at_the_latest_version(tmp_path, mock_clock):
    async with broker(tmp_path):
        pass
    path = tmp_path / "funduq.sqlite3"
    assert version_of(path) == schema.latest() >= 1
    assert set(rows(path)) == set(TABLES)


async def test_a_record_newer_than_this_build_is_refused_and_left_as_it_was(tmp_path, mock_clock):
    path = old_record(tmp_path)
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version={schema.latest() + 1}")
    before = rows(path)
    with pytest.raises(SchemaTooNew, match=f"{path}: schema version {schema.latest() + 1}"):
        async with broker(tmp_path):
            pytest.fail("a newer record was opened")
    assert rows(path) == before
    assert version_of(path) == schema.latest() + 1


def test_serve_refuses_a_newer_record_in_one_line(tmp_path):
    path = old_record(tmp_path)
    with sqlite3.connect(path) as conn:
        conn.execute(f"PRAGMA user_version={schema.latest() + 1}")
    done = subprocess.run(
        [sys.executable, "-m", "funduq_trio", "serve", "--port", "0", "--data-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=60,
    )
    assert done.returncode == 2  # a start-up error (docs/operator.md)
    assert "Traceback" not in done.stderr
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert errors == [
        f"funduq-trio serve: error: {path}: schema version "
        f"{schema.latest() + 1}, newer than this build of funduq-trio knows "
        f"(up to {schema.latest()}); refusing to open it: run a build at least "
        "as new as the one that wrote it"
    ]


async def test_a_record_made_before_versions_upgrades_without_loss(tmp_path, mock_clock):
    path = old_record(tmp_path)
    before = rows(path)
    assert version_of(path) == 0
    ids = OLD_IDS
    orphans = (ids["running"], ids["offering"])
    async with broker(tmp_path) as funduq:
        assert version_of(path) == schema.latest()
        after = rows(path)
        # Every provider (and its counters), agent, thread and message is kept as it was.
        for table in ("providers", "agents", "threads", "messages"):
            assert after[table] == before[table], table
        assert [r[2] for r in after["providers"]] == [1]  # misdeclared, from the old file
        # Every event is kept; the runs the restart rules fail get their RUN_ERROR after.
        kept = [r for r in after["events"] if r in before["events"]]
        assert kept == before["events"]
        added = sorted(
            (r[0], json.loads(r[2])) for r in after["events"] if r not in before["events"]
        )
        assert added == sorted((run, ORPHANED) for run in orphans)
        runs_before = {r[1]: r for r in before["runs"]}
        for run in after["runs"]:
            if run[1] not in orphans:
                assert run == runs_before[run[1]]
        for run_id in orphans:
            assert await status_of(funduq, run_id) == "failed"
        completed = await record_of(funduq, ids["completed"])
        assert completed["status"] == "completed"
        assert [e["seq"] for e in completed["events"]] == [1, 2, 3, 4, 5]

        # The provider comes back: the queued runs are offered again, in order.
        p = await Provider(
            funduq, identity=Identity.from_private_hex(ids["provider_private_key"])
        ).attach()
        await quiet()
        assert sorted(offered_runs(p.link)) == sorted([ids["queued"][0], ids["declined"]])
        for run_id in (ids["queued"][0], ids["declined"], ids["queued"][1]):
            p.session.answer(last_offer_for(p.link, run_id), "accepted")
            await quiet()
            thread = (await record_of(funduq, run_id))["threadId"]
            p.stream(run_id, *reply(run_id, thread))
            assert await status_of(funduq, run_id) == "completed"
        # The paused run is still answerable, and its log continues.
        paused = await record_of(funduq, ids["paused"])
        assert paused["status"] == "input-required"
        assert await funduq.paused_run(ids["threads"]["done_then_paused"]) == ids["paused"]
        await funduq.answer_pause(ids["paused"], resume_input("ask-1"))
        await quiet()
        p.session.answer(last_offer_for(p.link, ids["paused"]), "accepted")
        more = reply(ids["paused"], paused["threadId"], text="resumed")
        p.stream(ids["paused"], *more)
        record = await record_of(funduq, ids["paused"])
        assert record["status"] == "completed"
        assert events_of(record) == events_of(paused) + more
        assert [e["seq"] for e in record["events"]] == list(range(1, len(record["events"]) + 1))
    assert version_of(path) == schema.latest()


async def test_the_real_server_serves_an_upgraded_record(tmp_path):
    """Through the doors: what the old file held reads back over HTTP, and the
    SDK provider with the old key finishes the runs that were queued."""
    old_record(tmp_path)
    ids = OLD_IDS
    async with running_server(tmp_path) as info, http_client(info) as http:
        run = (await http.get(f"/runs/{ids['completed']}")).json()
        assert run["status"] == "completed"
        paused = (await http.get(f"/runs/{ids['paused']}")).json()
        assert paused["status"] == "input-required"
        assert [i["id"] for i in paused["metadata"]["interrupts"]] == ["ask-1"]
        running = (await http.get(f"/runs/{ids['running']}")).json()
        assert running["status"] == "failed"
        assert running["metadata"]["failureReason"] == "orphaned_by_restart"
        provider = SdkProvider(
            Identity.from_private_hex(ids["provider_private_key"]), info.provider_url
        )
        provider.add_agent(echo, name="echo")
        async with trio.open_nursery() as nursery:
            await nursery.start(provider.run)
            for run_id in (*ids["queued"], ids["declined"]):
                with trio.fail_after(30):  # a safety net, not a behaviour clock
                    await info.funduq.wait_run(run_id)
                assert (await http.get(f"/runs/{run_id}")).json()["status"] == "completed"
            nursery.cancel_scope.cancel()
        thread = (await http.get(f"/threads/{ids['threads']['busy']}")).json()
        assert thread["messages"]
