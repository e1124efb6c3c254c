"""`batch` frames over the real link: a real server, a hand-played provider
over a real websocket, an AG-UI caller over httpx. A batch must mean exactly
its frames sent one after another (docs/provider-link.md, "Batches")."""

from __future__ import annotations

import json
from typing import Any

import trio
from support import http_client, post_sse, raw_provider, running_server, user_input
from trio_websocket import ConnectionClosed

START, FINISH = "RUN_STARTED", "RUN_FINISHED"


def events_of(run: dict[str, Any], text: str) -> list[dict[str, Any]]:
    ids = {"threadId": run["threadId"], "runId": run["runId"]}
    return [
        {"type": START, **ids},
        {"type": "TEXT_MESSAGE_START", "messageId": "m", "role": "assistant"},
        *({"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": c} for c in text),
        {"type": "TEXT_MESSAGE_END", "messageId": "m"},
        {"type": FINISH, **ids},
    ]


def accepted(run: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "ok", "id": run["offerId"], "verdict": "accepted", "reason": None,
            "payload": None}


def reports(run: dict[str, Any], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"kind": "report", "runId": run["runId"], "event": e, "seq": i}
        for i, e in enumerate(events, 1)
    ]


async def test_a_whole_run_in_one_batch_reaches_the_caller_and_the_record(tmp_path):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        assert provider.hello["extensions"] == ["batch"]
        result: dict[str, Any] = {}

        async def call() -> None:
            url = f"/agui/{provider.key}/echo"
            result["response"], result["events"] = await post_sse(http, url, user_input())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            run = await provider.next_offer()
            events = events_of(run, "hello")
            frames = [accepted(run), *reports(run, events), {"kind": "finish", "runId": run["runId"]}]
            await provider.send({"kind": "batch", "frames": frames})
        record = (await http.get(f"/runs/{run['runId']}")).json()
    assert result["response"].status_code == 200
    assert result["events"] == events
    assert record["status"] == "completed"
    assert [e["event"] for e in record["events"]] == events


async def test_a_bad_item_with_an_id_is_answered_err_and_the_batch_goes_on(tmp_path):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(post_sse, http, f"/agui/{provider.key}/echo", user_input())
            run = await provider.next_offer()
            events = events_of(run, "ok")
            await provider.send(
                {
                    "kind": "batch",
                    "frames": [
                        accepted(run),
                        {"kind": "register", "id": "bad-register", "agents": "lots"},
                        *reports(run, events),
                        {"kind": "finish", "runId": run["runId"]},
                    ],
                }
            )
            with trio.fail_after(10):
                while "bad-register" not in provider._replies:
                    await provider._replied.wait()
        err = provider._replies["bad-register"]
        record = (await http.get(f"/runs/{run['runId']}")).json()
    assert err["kind"] == "err" and err["reason"].startswith("batch item 1: ")
    assert record["status"] == "completed"
    assert [e["event"] for e in record["events"]] == events


async def test_a_violation_mid_batch_closes_the_link_and_nothing_after_it_counts(tmp_path):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        caller: dict[str, Any] = {}

        async def call() -> None:
            url = f"/agui/{provider.key}/echo"
            caller["response"], caller["events"] = await post_sse(http, url, user_input())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            run = await provider.next_offer()
            events = events_of(run, "x")
            frames = [
                accepted(run),
                *reports(run, events[:1]),
                {"kind": "report", "runId": run["runId"]},  # no event, no id: a violation
                *reports(run, events[1:]),
                {"kind": "finish", "runId": run["runId"]},
            ]
            await provider.send({"kind": "batch", "frames": frames})
            with trio.fail_after(10):
                try:
                    while True:
                        await provider.ws.get_message()
                except ConnectionClosed as closed:
                    reason = closed.reason
        record = (await http.get(f"/runs/{run['runId']}")).json()
    assert reason.code == 1008 and "batch item 2" in reason.reason
    assert record["status"] == "failed"
    assert record["metadata"]["failureReason"] == "provider_left_holding_it"
    # What came before the violation is recorded; what came after never happened.
    assert [e["event"] for e in record["events"]][:1] == events[:1]
    assert all(e["event"]["type"] != "TEXT_MESSAGE_CONTENT" for e in record["events"])
    assert [e["type"] for e in caller["events"]][0] == START
    assert json.dumps(caller["events"]).count("TEXT_MESSAGE_CONTENT") == 0
