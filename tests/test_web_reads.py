"""The read routes and the app's error policy, through a real server on a
loopback port with httpx as the caller."""

from __future__ import annotations

import trio
from support import http_client, post_sse, raw_provider, running_server, user_input


def assert_json_error(response, status: int, code: str) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error = response.json()["error"]
    assert error["status"] == status
    assert error["code"] == code
    assert error["message"]
    return error


async def test_healthz_and_readyz(tmp_path):
    async with running_server(tmp_path) as info, http_client(info) as http:
        live = await http.get("/healthz")
        assert live.status_code == 200
        assert live.json() == {"status": "ok"}
        ready = await http.get("/readyz")
        assert ready.status_code == 200
        assert ready.json() == {"status": "ready"}


async def test_unknown_ids_and_routes_are_json_404s(tmp_path):
    async with running_server(tmp_path) as info, http_client(info) as http:
        assert_json_error(
            await http.get("/runs/run_000000000000000000000000"), 404, "run_not_found"
        )
        assert_json_error(
            await http.get("/threads/thread_000000000000000000000000"), 404, "thread_not_found"
        )
        assert_json_error(await http.get("/no/such/route"), 404, "not_found")
        assert_json_error(await http.post("/agents"), 405, "method_not_allowed")


async def test_agents_roster_shows_who_serves_what(tmp_path):
    async with running_server(tmp_path) as info, http_client(info) as http:
        assert (await http.get("/agents")).json() == {"agents": []}
        async with raw_provider(info, ["echo", "poet"]) as provider:
            roster = (await http.get("/agents")).json()["agents"]
            assert sorted(a["name"] for a in roster) == ["echo", "poet"]
            for agent in roster:
                assert agent["provider"] == provider.key
                assert agent["fingerprint"] == provider.fingerprint
                assert agent["online"] is True
        # Detached: the agents stay known, offline.
        roster = (await http.get("/agents")).json()["agents"]
        assert sorted(a["name"] for a in roster) == ["echo", "poet"]
        assert all(a["online"] is False for a in roster)


async def test_body_over_the_limit_is_413_json(tmp_path):
    async with (
        running_server(tmp_path, max_body_bytes=2048) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        url = f"/agui/{provider.fingerprint}/echo"
        body = user_input("x" * 4096)
        error = assert_json_error(await http.post(url, json=body), 413, "body_too_large")
        assert "2048" in error["message"]

        # Without a Content-Length (chunked) the limit still holds.
        async def chunks():
            yield b'{"threadId":"t","runId":"r","messages":[{"id":"m","role":"user",'
            yield b'"content":"' + b"y" * 4096 + b'"}]}'

        assert_json_error(
            await http.post(url, content=chunks(), headers={"content-type": "application/json"}),
            413,
            "body_too_large",
        )
        # Nothing was recorded for either.
        assert await info.funduq.list_runs() == []


async def test_run_and_thread_records_have_the_design_shapes(tmp_path):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        async with trio.open_nursery() as nursery:
            result = {}

            async def caller():
                result["response"], result["events"] = await post_sse(
                    http, f"/agui/{provider.fingerprint}/echo", user_input("hello")
                )

            nursery.start_soon(caller)
            run = await provider.next_offer()
            await provider.answer(run, "accepted")
            await provider.play(
                run,
                [
                    {"type": "RUN_STARTED", "threadId": run["threadId"], "runId": run["runId"]},
                    {"type": "RUN_FINISHED", "threadId": run["threadId"], "runId": run["runId"]},
                ],
            )

        record = (await http.get(f"/runs/{run['runId']}")).json()
        assert set(record) == {
            "runId",
            "threadId",
            "agent",
            "status",
            "metadata",
            "createdAt",
            "startedAt",
            "completedAt",
            "events",
        }
        assert record["runId"] == run["runId"]
        assert record["threadId"] == run["threadId"]
        assert record["agent"]["name"] == "echo"
        assert record["agent"]["provider"] in (provider.key, provider.fingerprint)
        assert record["status"] == "completed"
        assert [e["seq"] for e in record["events"]] == [1, 2]
        assert [e["event"]["type"] for e in record["events"]] == ["RUN_STARTED", "RUN_FINISHED"]
        assert record["createdAt"] and record["startedAt"] and record["completedAt"]

        thread = (await http.get(f"/threads/{run['threadId']}")).json()
        assert set(thread) >= {"threadId", "agent", "segmentHead", "messages", "runs"}
        assert thread["threadId"] == run["threadId"]
        assert thread["segmentHead"] is None
        assert thread["runs"] == [{"runId": run["runId"], "status": "completed"}]
        assert [m["content"] for m in thread["messages"] if m["role"] == "user"] == ["hello"]
