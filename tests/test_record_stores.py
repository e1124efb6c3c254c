"""The record's two stores, seen from outside (issue #12): the PostgreSQL URL
puts the record in PostgreSQL; text neither store can keep is refused at the
door or found nowhere, alike on both; a PostgreSQL connection the server
dropped costs nothing; and the suite cannot pass under CI by skipping
PostgreSQL. (Every other behaviour test runs on both stores: conftest.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import psycopg
import pytest
import stores
import trio
from broker_support import AGENT, Provider, accepted, broker, record_of, reply
from reliability_support import A2A_V1, TASK_NOT_FOUND
from support import http_client, post_sse, running_server, sdk_provider, user_input

from funduq_trio.broker import postgres, schema
from funduq_trio.config import Settings

ROOT = Path(__file__).resolve().parent.parent


def test_a_postgresql_url_is_a_setting_and_other_urls_are_refused():
    for good in (
        "postgresql://funduq@db.example:5432/funduq",
        "postgres://u:p@h/d",
        "postgresql://u@h/d?sslmode=require",
        "sqlite:///tmp/x.sqlite3",
    ):
        assert Settings(database_url=good).problems() == [], good
    for bad in ("mysql://u@h/d", "postgresql://u@h/d?bogus=1", "sqlite://relative"):
        (problem,) = Settings(database_url=bad).problems()
        assert "FUNDUQ_DATABASE_URL" in problem, bad


def test_a_database_password_is_never_shown():
    """The banner's settings line and every refusal show the URL with its
    password masked."""
    from funduq_trio.server import changed_settings

    settings = Settings(database_url="postgresql://funduq:hunter2@db.example:5432/records")
    assert (
        "FUNDUQ_DATABASE_URL=postgresql://funduq:***@db.example:5432/records"
        in changed_settings(settings)
    )
    bad = Settings(database_url="postgresql://funduq:hunter2@db.example/records?bogus=1")
    (problem,) = bad.problems()
    assert "hunter2" not in problem and "funduq:***@" in problem


async def test_runs_are_recorded_in_the_store_the_url_names(tmp_path, store):
    """With a postgresql:// URL the record is in PostgreSQL (and no SQLite file
    appears); without one, in the data directory's SQLite file."""
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        sdk_provider(info) as provider,
    ):
        url = info.agui_url(provider.identity.fingerprint, "echo")
        response, events = await post_sse(http, url, user_input("hello"))
        assert response.status_code == 200 and events[-1]["type"] == "RUN_FINISHED"
        run_id = events[0]["runId"]
    sqlite_file = tmp_path / "funduq.sqlite3"
    if store == "postgres":
        assert not sqlite_file.exists()
        with psycopg.connect(stores.database_url) as conn:
            rows = conn.execute("SELECT id, status FROM runs").fetchall()
            events_kept = conn.execute(
                "SELECT count(*) FROM events WHERE run_id = %s", (run_id,)
            ).fetchone()[0]
        assert rows == [(run_id, "completed")]
        assert events_kept == len(events)
    else:
        assert sqlite_file.exists()


async def test_text_no_store_can_keep_is_refused_or_found_nowhere(tmp_path):
    """A NUL or a lone surrogate in a message id (PostgreSQL's text refuses the
    first, neither database's UTF-8 holds the second) is a 400 at the door, not
    a failed write; looked up as an id it finds nothing, not a 500. Alike on
    both stores, and funduq serves on."""
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        sdk_provider(info) as provider,
    ):
        url = info.agui_url(provider.identity.fingerprint, "echo")
        a2a_url = info.a2a_url(provider.identity.fingerprint, "echo")

        async def post(to: str, body: dict, **headers: str) -> httpx.Response:
            # ASCII-escaped JSON, as a caller sends a lone surrogate ("\\ud800").
            return await http.post(
                to,
                content=json.dumps(body),
                headers={"Content-Type": "application/json", **headers},
            )

        async def a2a(method: str, params: dict) -> dict:
            body = {"jsonrpc": "2.0", "id": 1, "method": method, "params": params}
            response = await post(a2a_url, body, **A2A_V1)
            assert response.status_code == 200, response.text
            return response.json()

        for hostile in ("a\x00b", "a\ud800b"):
            body = user_input("hello")
            body["messages"][0]["id"] = hostile
            refused = await post(url, body)
            assert refused.status_code == 400, (hostile, refused.text)
            # (The door may refuse a lone surrogate as JSON the link cannot carry.)
            assert refused.json()["error"]["code"] in ("invalid_run_input", "invalid_json")
            listing = await http.get(
                "/runs",
                params={"agent": "a\x00b"},
                headers={"Authorization": f"Bearer {info.funduq.operator_token}"},
            )
            assert listing.status_code == 200 and listing.json()["runs"] == []
            # Not found, or refused by the A2A layer first: never an internal error.
            assert (await a2a("GetTask", {"id": f"run_{hostile}"}))["error"]["code"] in (
                TASK_NOT_FOUND,
                -32602,
            )
            sent = await a2a(
                "SendMessage",
                {
                    "message": {
                        "messageId": hostile,
                        "role": "ROLE_USER",
                        "parts": [{"text": "hello"}],
                    }
                },
            )
            assert sent["error"]["code"] == -32602, sent  # invalid params
        # A NUL reaches the read routes percent-encoded (a lone surrogate cannot).
        assert (await http.get("/runs/run_%00")).status_code == 404
        assert (await http.get("/threads/thread_%00")).status_code == 404
        response, events = await post_sse(http, url, user_input("hello"))
        assert response.status_code == 200 and events[-1]["type"] == "RUN_FINISHED"
        assert (await http.get("/readyz")).status_code == 200


@pytest.mark.parametrize("store", ["postgres"], indirect=True)
async def test_connections_the_postgresql_server_dropped_are_replaced(
    tmp_path, store, autojump_clock
):
    """The server drops every connection funduq holds (a restart, a failover,
    an operator's pg_terminate_backend): the next read and the next writes go
    through on new connections, and the run in flight settles as if nothing
    happened."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        t = await accepted(funduq, p)
        events = reply(t.run_id, t.thread_id)
        p.stream(t.run_id, *events[:2], finish=False)
        assert len((await record_of(funduq, t.run_id))["events"]) == 2
        assert stores.drop_connections(stores.database_url) >= 2  # the writer and a reader
        assert (await funduq.get_run(t.run_id))["status"] == "running"
        p.stream(t.run_id, *events[2:])
        run = await record_of(funduq, t.run_id)
        assert run["status"] == "completed"
        assert [e["event"] for e in run["events"]] == events
        assert await funduq.ready()
        u = await accepted(funduq, p)
        assert (await record_of(funduq, u.run_id))["status"] == "running"
        assert p.session.agents and AGENT in p.session.agents


def test_the_two_stores_have_the_same_schema_versions():
    """Step n of the PostgreSQL schema is step n of the SQLite one: a table
    added to one store and not the other fails here."""
    assert [(m.version, m.why) for m in postgres.MIGRATIONS] == [
        (m.version, m.why) for m in schema.MIGRATIONS
    ]


def _too_new(exc: BaseException) -> bool:
    if isinstance(exc, BaseExceptionGroup):
        return any(_too_new(e) for e in exc.exceptions)
    return isinstance(exc, schema.SchemaTooNew)


@pytest.mark.parametrize("store", ["postgres"], indirect=True)
async def test_a_postgresql_record_upgrades_in_place_and_a_newer_one_is_refused(
    tmp_path, store, autojump_clock
):
    with psycopg.connect(stores.database_url, autocommit=True) as raw:
        conn = postgres.PgConnection(raw)
        assert postgres.upgrade(conn, "test", postgres.MIGRATIONS[:1]) == [1]
        conn.execute("INSERT INTO threads VALUES ('thread_1', 'k', 'echo', NULL, 1.0)")
        conn.execute(
            "INSERT INTO runs (arrival, id, thread_id, provider_key, agent_name, status,"
            " input, created_at, completed_at) VALUES "
            "(1, 'run_1', 'thread_1', 'k', 'echo', 'completed', '{}', 1.0, 2.0)"
        )
        conn.execute("INSERT INTO events VALUES ('run_1', 1, '{\"type\":\"RUN_STARTED\"}')")
    async with broker(tmp_path) as funduq:
        run = await funduq.get_run("run_1")
        assert run["status"] == "completed" and len(run["events"]) == 1
        assert (await funduq.list_runs(agent="echo"))[0]["runId"] == "run_1"  # migration 2
        assert await funduq.record.task_ids(  # migration 7's index
            "k",
            "echo",
            thread_id=None,
            bound_to=None,
            status=None,
            status_after=None,
            limit=5,
            after_run=None,
        ) == (1, ["run_1"])
        assert funduq.kyok.roster() == []  # migration 3's tables answer
    with psycopg.connect(stores.database_url, autocommit=True) as raw:
        assert raw.execute("SELECT version FROM schema_version").fetchall() == [
            (len(schema.MIGRATIONS),)
        ]
        raw.execute("UPDATE schema_version SET version = version + 1")
    with pytest.raises(BaseException) as refused:
        async with broker(tmp_path):
            pass
    assert _too_new(refused.value), refused.value
    with psycopg.connect(stores.database_url, autocommit=True) as raw:
        assert raw.execute("SELECT count(*) FROM runs").fetchone() == (1,)  # nothing touched


async def _suite_without_postgres(ci: bool) -> subprocess.CompletedProcess[bytes]:
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env["FUNDUQ_TEST_POSTGRES_URL"] = "postgresql://postgres@127.0.0.1:1/none"
    if ci:
        env["CI"] = "1"
    return await trio.run_process(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "-rs",
            "tests/test_broker_smoke.py",
        ],
        cwd=ROOT,
        env=env,
        capture_stdout=True,
        capture_stderr=True,
        check=False,
    )


async def test_without_postgresql_its_tests_skip_with_one_reason_but_fail_under_ci():
    runs: dict[bool, subprocess.CompletedProcess[bytes]] = {}

    async def run(ci: bool) -> None:
        runs[ci] = await _suite_without_postgres(ci)

    async with trio.open_nursery() as nursery:  # the two at once: each is mostly start-up
        nursery.start_soon(run, False)
        nursery.start_soon(run, True)
    alone, under_ci = (runs[ci].stdout.decode() for ci in (False, True))
    assert runs[False].returncode == 0, alone
    assert "1 passed, 1 skipped" in alone
    assert "no PostgreSQL answers at postgresql://postgres@127.0.0.1:1/none" in alone
    assert runs[True].returncode != 0, under_ci
    assert "CI needs PostgreSQL" in under_ci
    assert "1 failed, 1 passed" in under_ci or "1 passed, 1 error" in under_ci
