"""The AG-UI door end to end: a real server on a loopback port, httpx as the
caller reading the SSE stream, a provider on the real WebSocket link."""

from __future__ import annotations

from typing import Any

import httpx
import stores
import trio
from support import (
    RawProvider,
    chain,
    http_client,
    operator_headers,
    post_sse,
    raw_provider,
    running_server,
    sdk_provider,
    sse_events,
    user_input,
)

from funduq_trio.config import Settings
from funduq_trio.server import serve

RUN_STARTED, RUN_FINISHED, RUN_ERROR = "RUN_STARTED", "RUN_FINISHED", "RUN_ERROR"


def started(run: dict[str, Any]) -> dict[str, Any]:
    return {"type": RUN_STARTED, "threadId": run["threadId"], "runId": run["runId"]}


def finished(run: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": RUN_FINISHED, "threadId": run["threadId"], "runId": run["runId"], **extra}


def text_events(message_id: str, text: str) -> list[dict[str, Any]]:
    return [
        {"type": "TEXT_MESSAGE_START", "messageId": message_id, "role": "assistant"},
        {"type": "TEXT_MESSAGE_CONTENT", "messageId": message_id, "delta": text},
        {"type": "TEXT_MESSAGE_END", "messageId": message_id},
    ]


class Caller:
    """One AG-UI POST running in the background; its response and events land here."""

    def __init__(self) -> None:
        self.done = trio.Event()
        self.response = None
        self.events: list[dict[str, Any]] = []

    async def post(self, http, url: str, body: Any) -> None:
        self.response, self.events = await post_sse(http, url, body)
        self.done.set()


async def serve_one(provider: RawProvider, events_for) -> dict[str, Any]:
    """Accept the next offer and play `events_for(run)` on it; return the run."""
    run = await provider.next_offer()
    await provider.answer(run, "accepted")
    await provider.play(run, events_for(run))
    return run


async def test_stream_relays_the_run_end_to_end(tmp_path):
    unknown = {"type": "SOMETHING_NEWER", "payload": {"a": [1, None]}, "note": None}
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        caller = Caller()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                caller.post,
                http,
                f"/agui/{provider.fingerprint}/echo",
                user_input("hello", thread_id="my-thread"),
            )
            run = await serve_one(
                provider,
                lambda run: [
                    started(run),
                    *text_events("m-1", "hello back"),
                    unknown,
                    finished(run),
                ],
            )

    assert caller.response.status_code == 200
    assert caller.response.headers["content-type"].startswith("text/event-stream")
    # funduq's ids, never the caller's, ride the stream.
    assert run["threadId"].startswith("thread_") and run["runId"].startswith("run_")
    assert caller.events == [
        {"type": RUN_STARTED, "threadId": run["threadId"], "runId": run["runId"]},
        *text_events("m-1", "hello back"),
        unknown,  # an unknown type is relayed untouched, its nulls included
        {"type": RUN_FINISHED, "threadId": run["threadId"], "runId": run["runId"]},
    ]
    # The provider was offered funduq's ids too.
    assert run["runInput"]["threadId"] == run["threadId"]
    assert run["runInput"]["runId"] == run["runId"]


async def test_example_echo_provider_over_agui_across_two_turns(tmp_path):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        sdk_provider(info) as provider,
    ):
        url = info.agui_url(provider.identity.fingerprint, "echo")
        response, first = await post_sse(http, url, user_input("hello world"))
        assert response.status_code == 200
        assert [e["type"] for e in first][:2] == [RUN_STARTED, "TEXT_MESSAGE_START"]
        assert first[-1]["type"] == RUN_FINISHED
        said = "".join(e["delta"] for e in first if e["type"] == "TEXT_MESSAGE_CONTENT")
        assert said == "hello world"

        # The second turn names funduq's thread and continues it.
        thread_id = first[0]["threadId"]
        response, second = await post_sse(http, url, user_input("again", thread_id=thread_id))
        assert [e["threadId"] for e in second if "threadId" in e] == [thread_id, thread_id]
        assert second[0]["runId"] != first[0]["runId"]
        thread = (await http.get(f"/threads/{thread_id}")).json()
        assert [r["runId"] for r in thread["runs"]] == [first[0]["runId"], second[0]["runId"]]
        assert all(r["status"] == "completed" for r in thread["runs"])


async def test_stream_is_the_record(tmp_path):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        caller = Caller()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller.post, http, f"/agui/{provider.key}/echo", user_input())
            run = await serve_one(provider, lambda run: [started(run), finished(run)])
        record = (await http.get(f"/runs/{run['runId']}")).json()
    assert record["status"] == "completed"
    assert [e["event"] for e in record["events"]] == caller.events


async def test_offline_agent_streams_run_started_then_run_error(tmp_path):
    async with running_server(tmp_path) as info, http_client(info) as http:
        async with raw_provider(info, ["echo"]) as provider:
            pass  # published, then gone: the agent is known and offline
        response, events = await post_sse(http, f"/agui/{provider.fingerprint}/echo", user_input())
        assert response.status_code == 200
        assert [e["type"] for e in events] == [RUN_STARTED, RUN_ERROR]
        assert events[1]["code"] == "agent_offline"
        run_id, thread_id = events[0]["runId"], events[0]["threadId"]
        assert run_id.startswith("run_") and thread_id.startswith("thread_")
        record = (await http.get(f"/runs/{run_id}")).json()
        assert record["threadId"] == thread_id
        assert record["status"] == "failed"
        assert record["metadata"]["failureReason"] == "agent_offline"


async def test_unknown_provider_or_agent_is_404_json(tmp_path):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        for url in (f"/agui/{provider.fingerprint}/nobody", "/agui/0123456789abcdef/echo"):
            response = await http.post(url, json=user_input())
            assert response.status_code == 404
            assert response.json()["error"]["code"] == "agent_not_found"
        assert await info.funduq.list_runs() == []


async def test_invalid_json_and_invalid_input_are_400_and_record_nothing(tmp_path):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        url = f"/agui/{provider.fingerprint}/echo"
        response = await http.post(
            url, content=b'{"threadId": ', headers={"content-type": "application/json"}
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "invalid_json"
        assert "not valid JSON" in error["message"]

        response = await http.post(url, json={"threadId": "t", "runId": "r"})
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["code"] == "invalid_run_input"
        assert error["message"].startswith("input does not validate as RunAgentInput")
        assert [d["loc"] for d in error["details"]] == [["messages"]]

        response = await http.post(url, json=["not", "an", "object"])
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "invalid_run_input"

        # A lone surrogate is valid JSON text but nothing the link can carry:
        # refused as such (before validation), the error still answers in JSON.
        response = await http.post(
            url,
            content=b'{"threadId": "t", "\\ud800": 1}',
            headers={"content-type": "application/json"},
        )
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "invalid_json"

        # Absurd nesting is refused before anything walks it.
        for depth in (150, 5000):
            deep = b"[" * depth + b"]" * depth
            response = await http.post(
                url, content=deep, headers={"content-type": "application/json"}
            )
            assert response.status_code == 400
            assert response.json()["error"]["code"] == "invalid_json"

        assert await info.funduq.list_runs() == []
        roster = (await http.get("/agents")).json()["agents"]
        assert [a["online"] for a in roster] == [True]


async def pause_then_resume(http, provider: RawProvider, interrupt: dict[str, Any]):
    """A run that pauses on `interrupt`; returns (run, first stream's events)."""
    caller = Caller()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(caller.post, http, f"/agui/{provider.fingerprint}/echo", user_input())
        run = await serve_one(
            provider,
            lambda run: [
                started(run),
                finished(run, outcome={"type": "interrupt", "interrupts": [interrupt]}),
            ],
        )
    return run, caller.events


async def test_resume_answers_the_paused_run(tmp_path):
    interrupt = {
        "id": "int-1",
        "reason": "approval",
        "message": "ship it?",
        "expiresAt": "2030-01-01T00:00:00Z",
    }
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        run, first = await pause_then_resume(http, provider, interrupt)
        assert [e["type"] for e in first] == [RUN_STARTED, RUN_FINISHED]
        assert first[-1]["outcome"]["interrupts"] == [interrupt]
        paused = (await http.get(f"/runs/{run['runId']}")).json()
        assert paused["status"] == "input-required"
        assert paused["metadata"]["interrupts"] == [interrupt]

        answer = user_input(
            "yes",
            thread_id=run["threadId"],
            resume=[{"interruptId": "int-1", "status": "resolved", "payload": {"ok": True}}],
        )
        caller = Caller()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller.post, http, f"/agui/{provider.fingerprint}/echo", answer)
            again = await provider.next_offer()
            # The same run, offered again with the answer.
            assert again["runId"] == run["runId"]
            assert again["runInput"]["resume"][0]["interruptId"] == "int-1"
            await provider.answer(again, "accepted")
            await provider.play(
                again, [started(again), *text_events("m-2", "shipped"), finished(again)]
            )

        assert caller.response.status_code == 200
        # Only what followed the answer: the first segment is not replayed.
        assert [e["type"] for e in caller.events] == [
            RUN_STARTED,
            "TEXT_MESSAGE_START",
            "TEXT_MESSAGE_CONTENT",
            "TEXT_MESSAGE_END",
            RUN_FINISHED,
        ]
        assert all(e.get("runId", run["runId"]) == run["runId"] for e in caller.events)
        record = (await http.get(f"/runs/{run['runId']}")).json()
        assert record["status"] == "completed"
        assert [e["event"] for e in record["events"]] == first + caller.events
        thread = (await http.get(f"/threads/{run['threadId']}")).json()
        assert thread["runs"] == [{"runId": run["runId"], "status": "completed"}]


async def test_resume_without_a_paused_run_answers_the_thread_snapshot(tmp_path):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        caller = Caller()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                caller.post, http, f"/agui/{provider.fingerprint}/echo", user_input()
            )
            run = await serve_one(provider, lambda run: [started(run), finished(run)])

        answer = user_input(
            "late",
            thread_id=run["threadId"],
            resume=[{"interruptId": "int-1", "status": "resolved"}],
        )
        response = await http.post(f"/agui/{provider.fingerprint}/echo", json=answer)
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("application/json")
        snapshot = response.json()
        assert snapshot == (await http.get(f"/threads/{run['threadId']}")).json()
        # Never a new run.
        assert snapshot["runs"] == [{"runId": run["runId"], "status": "completed"}]
        assert len(await info.funduq.list_runs()) == 1

        # A resume naming a thread funduq never minted has no snapshot: 404.
        response = await http.post(
            f"/agui/{provider.fingerprint}/echo",
            json={**answer, "threadId": "thread_000000000000000000000000"},
        )
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "thread_not_found"


async def test_caller_disconnect_ends_only_its_stream(tmp_path):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        url = f"/agui/{provider.fingerprint}/echo"
        async with trio.open_nursery() as nursery:
            seen_first = trio.Event()

            async def caller_that_leaves():
                async with http.stream("POST", url, json=user_input()) as response:
                    async for event in sse_events(response):
                        assert event["type"] == RUN_STARTED
                        break  # leave after the first event: the connection closes
                seen_first.set()

            nursery.start_soon(caller_that_leaves)
            run = await provider.next_offer()
            await provider.answer(run, "accepted")
            await provider.report(run["runId"], started(run))
            await seen_first.wait()
            # The caller is gone; the provider keeps going and the run completes.
            for event in [*text_events("m-1", "still here"), finished(run)]:
                await provider.report(run["runId"], event)
            await provider.finish(run["runId"])

        record = await info.funduq.wait_run(run["runId"])
        assert record["status"] == "completed"
        assert [e["event"]["type"] for e in record["events"]] == [
            RUN_STARTED,
            "TEXT_MESSAGE_START",
            "TEXT_MESSAGE_CONTENT",
            "TEXT_MESSAGE_END",
            RUN_FINISHED,
        ]
        assert (await http.get(f"/runs/{run['runId']}")).json()["status"] == "completed"


async def test_full_thread_is_429(tmp_path):
    async with (
        running_server(tmp_path, thread_queue_limit=1) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        url = f"/agui/{provider.fingerprint}/echo"
        first = Caller()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(first.post, http, url, user_input("one"))
            run = await provider.next_offer()  # left unanswered: still pending

            response = await http.post(url, json=user_input("two", thread_id=run["threadId"]))
            assert response.status_code == 429
            error = response.json()["error"]
            assert error["code"] == "thread_queue_full"

            await provider.answer(run, "accepted")
            await provider.play(run, [started(run), finished(run)])

        assert [e["type"] for e in first.events] == [RUN_STARTED, RUN_FINISHED]
        thread = (await http.get(f"/threads/{run['threadId']}")).json()
        assert thread["runs"] == [{"runId": run["runId"], "status": "completed"}]


async def test_shutdown_ends_open_streams_and_restart_settles_the_run(tmp_path):
    settings = Settings(
        host="127.0.0.1", port=0, data_dir=tmp_path, database_url=stores.database_url
    )
    seen: list[dict[str, Any]] = []
    first_seen, stream_ended = trio.Event(), trio.Event()
    server_scope = trio.CancelScope()

    async def server(task_status=trio.TASK_STATUS_IGNORED):
        with server_scope:
            await serve(settings, task_status=task_status)

    async def caller(url: str):
        try:
            async with (
                httpx.AsyncClient(timeout=30) as http,
                http.stream("POST", url, json=user_input()) as response,
            ):
                async for event in sse_events(response):
                    seen.append(event)
                    first_seen.set()
        except httpx.HTTPError:
            pass  # the server went away mid-stream
        stream_ended.set()

    async with trio.open_nursery() as nursery:
        info = await nursery.start(server)
        async with raw_provider(info, ["echo"]) as provider:
            nursery.start_soon(caller, info.agui_url(provider.fingerprint, "echo"))
            run = await provider.next_offer()
            await provider.answer(run, "accepted")
            await provider.report(run["runId"], started(run))
            await first_seen.wait()
            server_scope.cancel()  # shut down under the open stream and the held run
            await stream_ended.wait()
    assert seen == [started(run)]

    # The record is consistent: the next start settles the held run.
    async with running_server(tmp_path) as info, http_client(info) as http:
        record = (await http.get(f"/runs/{run['runId']}")).json()
    assert record["status"] == "failed"
    assert record["metadata"]["failureReason"] == "orphaned_by_restart"
    assert [e["event"]["type"] for e in record["events"]] == [RUN_STARTED, RUN_ERROR]


async def test_authority_rides_in_forwarded_props(tmp_path):
    import time

    from funduq_trio.identity import Identity, resolve_payload

    alice, mallory = Identity.generate(), Identity.generate()
    interrupt = {"id": "int-1", "reason": "approval"}
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        url = f"/agui/{provider.fingerprint}/echo"
        response = await http.post(url, json=user_input(forwardedProps={"actorChain": ["x.y.z"]}))
        assert response.status_code == 403
        assert response.json()["error"]["code"] == "invalid_actor_chain"

        # Alice's chain binds the thread; the run pauses on a question.
        caller = Caller()
        bound = user_input(forwardedProps={"actorChain": chain(alice), "app": 1})
        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller.post, http, url, bound)
            run = await serve_one(
                provider,
                lambda run: [
                    started(run),
                    finished(run, outcome={"type": "interrupt", "interrupts": [interrupt]}),
                ],
            )
        # forwardedProps reach the agent (with funduq's dispatch hop appended).
        assert run["runInput"]["forwardedProps"]["app"] == 1
        assert len(run["runInput"]["forwardedProps"]["actorChain"]) == 2
        operator = operator_headers(info)  # a bound thread's reads need authority
        thread = (await http.get(f"/threads/{run['threadId']}", headers=operator)).json()
        assert thread["segmentHead"] == alice.public_key_hex

        # Writing to the bound thread takes its head's chain.
        for props in ({}, {"actorChain": chain(mallory)}):
            response = await http.post(
                url, json=user_input("me too", thread_id=run["threadId"], forwardedProps=props)
            )
            assert response.status_code == 403
            assert response.json()["error"]["code"] == "not_authorized"

        # Answering the pause takes a resolution signed by the head.
        resume = [{"interruptId": "int-1", "status": "resolved", "payload": "yes"}]
        now = int(time.time())
        forged = {
            "publicKey": mallory.public_key_hex,
            "timestamp": now,
            "signature": mallory.sign(resolve_payload(run["runId"], now)),
        }
        response = await http.post(
            url,
            json=user_input(
                thread_id=run["threadId"], resume=resume, forwardedProps={"resolution": forged}
            ),
        )
        assert response.status_code == 404  # refused as an unknown thread: says nothing
        assert response.json()["error"]["code"] == "thread_not_found"
        record = (await http.get(f"/runs/{run['runId']}", headers=operator)).json()
        assert record["status"] == "input-required"

        signed = {
            "publicKey": alice.public_key_hex,
            "timestamp": now,
            "signature": alice.sign(resolve_payload(run["runId"], now)),
        }
        caller = Caller()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                caller.post,
                http,
                url,
                user_input(
                    thread_id=run["threadId"], resume=resume, forwardedProps={"resolution": signed}
                ),
            )
            again = await serve_one(provider, lambda run: [started(run), finished(run)])
        assert again["runId"] == run["runId"]
        assert [e["type"] for e in caller.events] == [RUN_STARTED, RUN_FINISHED]
        record = (await http.get(f"/runs/{run['runId']}", headers=operator)).json()
        assert record["status"] == "completed"
        assert record["metadata"]["funduq"]["answeredBy"] == alice.public_key_hex
