"""Streams that survive (DESIGN §10, issue 13 items 1-3), through the real
server: every SSE event carries its run seq as `id`; a caller that lost its
stream re-attaches with `Last-Event-ID` on either door and misses nothing and
sees nothing twice, also after a restart; a silent stream sends keepalive
comments; a subscription to a paused A2A task stays open through the answer;
a message naming a task that is not paused is refused.

The provider is played by hand over the link (`support.raw_provider`), so
the test decides exactly which events exist before and after a drop. Callers
are httpx (raw SSE lines, to see ids and comments) and a2a-sdk's own client.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import UnsupportedOperationError
from support import http_client, raw_provider, running_server, user_input
from test_a2a_door import (
    a2a_client,
    broker_with_agents,
    send_blocking,
    send_request,
    user_message,
)

from funduq_trio.config import Settings
from funduq_trio.identity import Identity
from funduq_trio.web.sse import KEEPALIVE, StreamCut, read_cursor, with_keepalive

S = pb.TaskState
V1 = {"A2A-Version": "1.0"}


# ------------------------------------------------------------------ helpers


async def sse_items(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """What the stream's bytes say, item by item: an event as
    {"id": str | None, "data": parsed JSON}, a comment as {"comment": text}."""
    fields: dict[str, str] = {}
    async for line in response.aiter_lines():
        if line == "":
            if fields:
                yield {"id": fields.get("id"), "data": json.loads(fields["data"])}
                fields = {}
        elif line.startswith(":"):
            yield {"comment": line[1:].strip()}
        else:
            name, _, value = line.partition(":")
            fields[name] = value[1:] if value.startswith(" ") else value


async def events_of(response: httpx.Response) -> list[tuple[int, Any]]:
    """The whole stream's events as (id, data); every event must carry an id."""
    out = []
    async for item in sse_items(response):
        if "comment" not in item:
            assert item["id"] is not None, item
            out.append((int(item["id"]), item["data"]))
    return out


async def recorded(http: httpx.AsyncClient, run_id: str, count: int) -> dict[str, Any]:
    """The run's record once it holds `count` events (read again until then:
    waiting on a condition, never on a clock)."""
    while True:
        record = (await http.get(f"/runs/{run_id}")).json()
        if len(record["events"]) >= count:
            return record
        await trio.sleep(0)


def started(run: dict[str, Any]) -> dict[str, Any]:
    return {"type": "RUN_STARTED", "threadId": run["threadId"], "runId": run["runId"]}


def finished(run: dict[str, Any]) -> dict[str, Any]:
    return {"type": "RUN_FINISHED", "threadId": run["threadId"], "runId": run["runId"]}


def chunks(message_id: str, *deltas: str) -> list[dict[str, Any]]:
    return [{"type": "TEXT_MESSAGE_CONTENT", "messageId": message_id, "delta": d} for d in deltas]


def text_start(message_id: str) -> dict[str, Any]:
    return {"type": "TEXT_MESSAGE_START", "messageId": message_id, "role": "assistant"}


def v1_message(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "message": {
            "messageId": f"m-{text}",
            "role": "ROLE_USER",
            "parts": [{"text": text}],
            **extra,
        }
    }


def rpc(method: str, params: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": "r-1", "method": method, "params": params}


def payload(frame: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """A 1.0 StreamResponse frame's (kind, body): task, statusUpdate or artifactUpdate."""
    ((kind, body),) = frame["result"].items()
    return kind, body


# ------------------------------------------------------------------ AG-UI re-attach


async def test_agui_reattach_from_the_last_id_misses_and_repeats_nothing(tmp_path) -> None:
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        url = f"/agui/{provider.fingerprint}/echo"
        first: list[tuple[int, Any]] = []
        async with trio.open_nursery() as nursery:
            left = trio.Event()

            async def caller_that_drops() -> None:
                async with http.stream("POST", url, json=user_input()) as response:
                    async for item in sse_items(response):
                        first.append((int(item["id"]), item["data"]))
                        if len(first) == 3:
                            break  # the connection closes mid-run
                left.set()

            nursery.start_soon(caller_that_drops)
            run = await provider.next_offer()
            await provider.answer(run, "accepted")
            for event in [started(run), text_start("m"), *chunks("m", "ab")]:
                await provider.report(run["runId"], event)
            await left.wait()

        # While nobody listens the run goes on: these are only in the record.
        run_id = run["runId"]
        for event in chunks("m", "cd", "ef"):
            await provider.report(run_id, event)
        await recorded(http, run_id, 5)

        cursor = str(first[-1][0])
        async with http.stream(
            "GET", f"/agui/runs/{run_id}/events", headers={"Last-Event-ID": cursor}
        ) as response:
            assert response.status_code == 200
            items = sse_items(response)
            second = [await anext(items), await anext(items)]  # replayed from the record
            second = [(int(i["id"]), i["data"]) for i in second]
            for event in [*chunks("m", "gh"), finished(run)]:  # then live
                await provider.report(run_id, event)
            await provider.finish(run_id)
            second += [(int(i["id"]), i["data"]) async for i in items]

        record = (await http.get(f"/runs/{run_id}")).json()
        assert record["status"] == "completed"
        assert first + second == [(e["seq"], e["event"]) for e in record["events"]]
        assert [seq for seq, _ in first + second] == list(range(1, 8))


async def test_agui_cursor_rules_and_the_synthesized_run_started(tmp_path) -> None:
    """An offline agent's run is only its RUN_ERROR (seq 1); the door opens the
    stream with a RUN_STARTED that is in no record: it carries id 0, the
    position it stands for, so re-attaching from it repeats nothing."""
    async with running_server(tmp_path) as info, http_client(info) as http:
        async with raw_provider(info, ["echo"]) as provider:
            fp = provider.fingerprint
        while any(a["online"] for a in (await http.get("/agents")).json()["agents"]):
            await trio.sleep(0)  # until funduq has seen the link go

        async with http.stream("POST", f"/agui/{fp}/echo", json=user_input()) as response:
            posted = await events_of(response)
        assert [(i, e["type"]) for i, e in posted] == [(0, "RUN_STARTED"), (1, "RUN_ERROR")]
        run_id = posted[0][1]["runId"]
        path = f"/agui/runs/{run_id}/events"

        async def reattach(**kwargs: Any) -> list[tuple[int, Any]]:
            async with http.stream("GET", path, **kwargs) as response:
                assert response.status_code == 200
                return await events_of(response)

        assert await reattach() == posted  # no cursor: the whole stream, opened as POST's
        assert await reattach(headers={"Last-Event-ID": "0"}) == posted[1:]
        assert await reattach(params={"after": "0"}) == posted[1:]
        assert await reattach(params={"after": "1"}) == []
        # The header (what an EventSource sends on reconnecting) wins over ?after=.
        assert await reattach(headers={"Last-Event-ID": "1"}, params={"after": "0"}) == []

        for bad in ("abc", "-1", "1.5", "9" * 40):
            response = await http.get(path, headers={"Last-Event-ID": bad})
            assert response.status_code == 400, bad
            assert response.json()["error"]["code"] == "invalid_cursor"
        response = await http.get(path, params={"after": "2"})  # past the run's last event
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "invalid_cursor"
        response = await http.get("/agui/runs/run_nope/events")
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "run_not_found"


# ------------------------------------------------------------------ A2A re-attach


async def test_a2a_subscribe_from_the_last_id_misses_and_repeats_nothing(tmp_path) -> None:
    async with (
        running_server(tmp_path) as info,
        httpx.AsyncClient(timeout=30, headers=V1) as http,
        http_client(info) as reads,
        raw_provider(info, ["echo"]) as provider,
    ):
        url = info.a2a_url(provider.fingerprint, "echo")
        first: list[tuple[int, dict[str, Any]]] = []
        async with trio.open_nursery() as nursery:
            left = trio.Event()

            async def caller_that_drops() -> None:
                body = rpc("SendStreamingMessage", v1_message("hello"))
                async with http.stream("POST", url, json=body) as response:
                    async for item in sse_items(response):
                        first.append((int(item["id"]), item["data"]))
                        if len(first) == 4:  # the Task, RUN_STARTED, the start, "ab"
                            break
                left.set()

            nursery.start_soon(caller_that_drops)
            run = await provider.next_offer()
            await provider.answer(run, "accepted")
            for event in [started(run), text_start("m"), *chunks("m", "ab")]:
                await provider.report(run["runId"], event)
            await left.wait()

        task_id = run["runId"]
        for event in chunks("m", "cd", "ef"):
            await provider.report(task_id, event)
        await recorded(reads, task_id, 5)

        body = rpc("SubscribeToTask", {"id": task_id})
        headers = {"Last-Event-ID": str(first[-1][0])}
        async with http.stream("POST", url, json=body, headers=headers) as response:
            items = sse_items(response)
            second = [await anext(items), await anext(items)]
            for event in [*chunks("m", "gh"), finished(run)]:
                await provider.report(task_id, event)
            await provider.finish(task_id)
            second += [item async for item in items]
        second = [(int(i["id"]), i["data"]) for i in second]

    frames = first + second
    assert [i for i, _ in frames] == [0, 1, 2, 3, 4, 5, 6, 7]  # the final status: seq 7
    kinds = [payload(f)[0] for _, f in frames]
    assert kinds[0] == "task"  # only the first connection opens with the snapshot
    assert kinds[-1] == "statusUpdate"
    assert payload(frames[-1][1])[1]["status"]["state"] == "TASK_STATE_COMPLETED"
    text = "".join(
        body["artifact"]["parts"][0]["text"]
        for kind, body in map(payload, (f for _, f in frames))
        if kind == "artifactUpdate"
    )
    assert text == "abcdefgh"  # every chunk exactly once


async def test_a2a_cursor_is_checked(tmp_path) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        url = info.a2a_url(agents.provider.fingerprint, "echo")
        async with a2a_client(info, agents.provider.fingerprint, "echo", streaming=False) as c:
            task = await send_blocking(c, send_request("done"))
        async with httpx.AsyncClient(timeout=30, headers=V1) as http:
            body = rpc("SubscribeToTask", {"id": task.id})
            for bad in ("x", "999"):
                answer = (await http.post(url, json=body, headers={"Last-Event-ID": bad})).json()
                assert answer["error"]["code"] == -32602, bad
            answer = (
                await http.post(
                    url,
                    json=rpc("SubscribeToTask", {"id": "run_nope"}),
                    headers={"Last-Event-ID": "1"},
                )
            ).json()
            assert answer["error"]["code"] == -32001  # TaskNotFoundError
            # Without a cursor an ended task is refused, as A2A says; with one, the
            # caller that missed the end gets it.
            answer = (await http.post(url, json=body)).json()
            assert answer["error"]["code"] == -32004
            async with http.stream(
                "POST", url, json=body, headers={"Last-Event-ID": "3"}
            ) as response:
                frames = await events_of(response)
            record = (await http.get(f"{info.url}/runs/{task.id}")).json()
            last = record["events"][-1]["seq"]
            assert frames[-1][0] == last
            assert payload(frames[-1][1])[1]["status"]["state"] == "TASK_STATE_COMPLETED"
            assert all(i > 3 for i, _ in frames)
        # The 0.3 name honours the cursor the same way.
        async with (
            httpx.AsyncClient(timeout=30) as http,
            http.stream(
                "POST",
                url,
                json=rpc("tasks/resubscribe", {"id": task.id}),
                headers={"Last-Event-ID": "3"},
            ) as response,
        ):
            old = await events_of(response)
        assert [i for i, _ in old] == [i for i, _ in frames]
        assert old[-1][1]["result"]["kind"] == "status-update"
        assert old[-1][1]["result"]["status"]["state"] == "completed"


# ------------------------------------------------------------------ across a restart


async def test_reattach_after_a_restart_replays_from_the_record(tmp_path) -> None:
    """The run was held when funduq stopped; the restart settles it (a RUN_ERROR
    appended). Both doors pick the stream up from the last id the caller had."""
    identity = Identity.generate()
    async with running_server(tmp_path) as info, http_client(info) as http:
        async with raw_provider(info, ["echo"], identity=identity) as provider:
            seen: list[tuple[int, Any]] = []
            async with trio.open_nursery() as nursery:
                left = trio.Event()

                async def caller_that_drops() -> None:
                    url = f"/agui/{provider.fingerprint}/echo"
                    async with http.stream("POST", url, json=user_input()) as response:
                        async for item in sse_items(response):
                            seen.append((int(item["id"]), item["data"]))
                            if len(seen) == 2:
                                break
                    left.set()

                nursery.start_soon(caller_that_drops)
                run = await provider.next_offer()
                await provider.answer(run, "accepted")
                for event in [started(run), text_start("m")]:
                    await provider.report(run["runId"], event)
                await left.wait()
            await provider.report(run["runId"], chunks("m", "unseen")[0])
            await recorded(http, run["runId"], 3)

    run_id = run["runId"]
    async with running_server(tmp_path) as info, http_client(info) as http:
        async with http.stream(
            "GET", f"/agui/runs/{run_id}/events", headers={"Last-Event-ID": "2"}
        ) as response:
            rest = await events_of(response)
        assert [(i, e["type"]) for i, e in rest] == [(3, "TEXT_MESSAGE_CONTENT"), (4, "RUN_ERROR")]
        assert rest[0][1]["delta"] == "unseen"

        url = info.a2a_url(identity.fingerprint, "echo")
        body = rpc("SubscribeToTask", {"id": run_id})
        async with http.stream(
            "POST", url, json=body, headers={**V1, "Last-Event-ID": "2"}
        ) as response:
            frames = await events_of(response)
        assert [(i, payload(f)[0]) for i, f in frames] == [
            (3, "artifactUpdate"),
            (4, "statusUpdate"),
        ]
        final = payload(frames[-1][1])[1]
        assert final["status"]["state"] == "TASK_STATE_FAILED"


# ------------------------------------------------------------------ the A2A defects


async def test_a_message_naming_a_task_that_is_not_paused_is_refused(tmp_path) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        fp = agents.provider.fingerprint
        async with (
            a2a_client(info, fp, "echo", streaming=False) as echo,
            a2a_client(info, fp, "slow", streaming=False) as slow,
            http_client(info) as http,
        ):
            ended = await send_blocking(echo, send_request("done"))
            assert ended.status.state == S.TASK_STATE_COMPLETED
            working = await send_blocking(slow, send_request("busy", immediately=True))
            await agents.slow_started_any.wait()
            # The provider's accept and first report are only on their way when
            # its agent starts: the task is working once funduq recorded that
            # report (a store that writes through a worker thread takes longer).
            async with contextlib.aclosing(info.funduq.follow(working.id)) as bursts:
                await anext(bursts)

            cases = (
                (echo, ended, "is in terminal state: TASK_STATE_COMPLETED"),
                (slow, working, "is not waiting for input (TASK_STATE_WORKING)"),
            )
            for client, task, why in cases:
                again = pb.SendMessageRequest(
                    message=user_message("more", task_id=task.id, context_id=task.context_id)
                )
                with pytest.raises(UnsupportedOperationError) as err:
                    await send_blocking(client, again)
                assert f"Task {task.id} {why}" in err.value.message
                thread = (await http.get(f"/threads/{task.context_id}")).json()
                assert [r["runId"] for r in thread["runs"]] == [task.id]  # nothing started
            assert (await http.get(f"/runs/{ended.id}")).json()["status"] == "completed"
            assert (await http.get(f"/runs/{working.id}")).json()["status"] == "running"


async def test_a_subscription_to_a_paused_task_stays_open_through_the_answer(tmp_path) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        fp = agents.provider.fingerprint
        async with (
            a2a_client(info, fp, "asker", streaming=False) as plain,
            a2a_client(info, fp, "asker") as streaming,
        ):
            paused = await send_blocking(plain, send_request("deploy please"))
            assert paused.status.state == S.TASK_STATE_INPUT_REQUIRED

            seen: list[pb.StreamResponse] = []
            attached = trio.Event()

            async def subscribe() -> None:
                async for event in streaming.subscribe(pb.SubscribeToTaskRequest(id=paused.id)):
                    seen.append(event)
                    attached.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(subscribe)
                await attached.wait()
                assert seen[0].task.status.state == S.TASK_STATE_INPUT_REQUIRED
                answer = pb.SendMessageRequest(
                    message=pb.Message(
                        message_id="answer-1",
                        role=pb.Role.ROLE_USER,
                        task_id=paused.id,
                        context_id=paused.context_id,
                        parts=[pb.Part(text="yes")],
                    )
                )
                done = await send_blocking(plain, answer)
                assert done.status.state == S.TASK_STATE_COMPLETED

            # The subscriber saw the answered turn and the task's real end.
            assert seen[-1].status_update.status.state == S.TASK_STATE_COMPLETED
            texts = "".join(
                part.text
                for e in seen
                if e.HasField("artifact_update")
                for part in e.artifact_update.artifact.parts
            )
            assert texts.startswith("resumed with")


async def test_a_subscription_from_a_cursor_at_the_pause_waits_for_the_answer(tmp_path) -> None:
    """A caller whose cursor is the pause's last seq gets only what follows the
    answer, and keepalive comments while it waits (A2A streams have them too)."""
    async with broker_with_agents(tmp_path, sse_keepalive_seconds=0.01) as (info, agents):
        fp = agents.provider.fingerprint
        url = info.a2a_url(fp, "asker")
        async with a2a_client(info, fp, "asker", streaming=False) as plain:
            paused = await send_blocking(plain, send_request("deploy please"))
            async with httpx.AsyncClient(timeout=30, headers=V1) as http:
                record = (await http.get(f"{info.url}/runs/{paused.id}")).json()
                at_pause = str(record["events"][-1]["seq"])
                body = rpc("SubscribeToTask", {"id": paused.id})
                async with http.stream(
                    "POST", url, json=body, headers={"Last-Event-ID": at_pause}
                ) as response:
                    items = sse_items(response)
                    assert await anext(items) == {"comment": "keepalive"}  # still waiting
                    answer = pb.SendMessageRequest(
                        message=pb.Message(
                            message_id="answer-2",
                            role=pb.Role.ROLE_USER,
                            task_id=paused.id,
                            parts=[pb.Part(text="ok")],
                        )
                    )
                    assert (
                        await send_blocking(plain, answer)
                    ).status.state == S.TASK_STATE_COMPLETED
                    frames = [(int(i["id"]), i["data"]) async for i in items if "comment" not in i]
        ids = [i for i, _ in frames]
        assert ids == sorted(ids) and ids[0] > int(at_pause)  # only what followed the pause
        assert payload(frames[-1][1])[1]["status"]["state"] == "TASK_STATE_COMPLETED"


async def test_a_subscription_at_a_pause_closes_when_the_task_pauses_again(tmp_path) -> None:
    interrupt = {"type": "interrupt", "interrupts": [{"id": "ok?", "reason": "approval"}]}
    async with (
        running_server(tmp_path) as info,
        httpx.AsyncClient(timeout=30, headers=V1) as http,
        raw_provider(info, ["asker"]) as provider,
        trio.open_nursery() as nursery,
    ):
        url = info.a2a_url(provider.fingerprint, "asker")

        async def asks_every_turn() -> None:
            while True:
                run = await provider.next_offer()
                await provider.answer(run, "accepted")
                await provider.play(run, [started(run), {**finished(run), "outcome": interrupt}])

        nursery.start_soon(asks_every_turn)
        sent = (await http.post(url, json=rpc("SendMessage", v1_message("go")))).json()
        task = sent["result"]["task"]
        assert task["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"

        async with http.stream(
            "POST", url, json=rpc("SubscribeToTask", {"id": task["id"]})
        ) as response:
            items = sse_items(response)
            opening = await anext(items)
            assert payload(opening["data"])[1]["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"
            answer = v1_message("yes", taskId=task["id"])
            again = (await http.post(url, json=rpc("SendMessage", answer))).json()
            assert again["result"]["task"]["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"
            rest = [(int(i["id"]), i["data"]) async for i in items]  # the stream closes
        nursery.cancel_scope.cancel()
    # The second turn's RUN_STARTED (seq 3), then its pause (seq 4) as the end.
    assert [(i, payload(f)[1]["status"]["state"]) for i, f in rest] == [
        (3, "TASK_STATE_WORKING"),
        (4, "TASK_STATE_INPUT_REQUIRED"),
    ]


# ------------------------------------------------------------------ keepalive


async def test_a_silent_stream_gets_keepalive_comments(autojump_clock) -> None:
    """`with_keepalive` under MockClock: a comment per interval of silence,
    counted from the last write; the source's chunks pass through in order;
    closing the stream closes the source."""
    more = trio.Event()
    source_closed = trio.Event()

    async def source() -> AsyncIterator[bytes]:
        try:
            yield b"one"
            await more.wait()
            yield b"two"
            await trio.sleep_forever()
        finally:
            source_closed.set()

    async with trio.open_nursery() as nursery:
        start = trio.current_time()
        stream = with_keepalive(source(), 15, nursery)
        got = []

        async def release_at(t: float) -> None:
            await trio.sleep_until(start + t)
            more.set()

        nursery.start_soon(release_at, 40)
        async for chunk in stream:
            got.append((chunk, trio.current_time() - start))
            if len(got) == 6:
                break
        await stream.aclose()
        await source_closed.wait()
    assert got == [
        (b"one", 0),
        (KEEPALIVE, 15),
        (KEEPALIVE, 30),
        (b"two", 40),
        (KEEPALIVE, 55),
        (KEEPALIVE, 70),
    ]


async def test_with_keepalive_raises_what_the_source_raises(autojump_clock) -> None:
    async def source() -> AsyncIterator[bytes]:
        yield b"one"
        raise RuntimeError("broken source")

    async with trio.open_nursery() as nursery:
        stream = with_keepalive(source(), 15, nursery)
        assert await anext(stream) == b"one"
        with pytest.raises(RuntimeError, match="broken source"):
            await anext(stream)


async def test_a_reader_cancelled_under_the_stream_cuts_it(autojump_clock) -> None:
    """The app's nursery cancelled (shutdown) is not a complete stream: the
    response is cut, so a caller cannot mistake it for the run's end."""

    async def source() -> AsyncIterator[bytes]:
        yield b"one"
        await trio.sleep_forever()

    async def hold(task_status: trio.TaskStatus[trio.Nursery]) -> None:
        async with trio.open_nursery() as nursery:
            task_status.started(nursery)
            await trio.sleep_forever()

    async with trio.open_nursery() as outer:
        readers: trio.Nursery = await outer.start(hold)
        stream = with_keepalive(source(), 15, readers)
        assert await anext(stream) == b"one"
        readers.cancel_scope.cancel()
        with pytest.raises(StreamCut):
            await anext(stream)


async def test_a_queued_run_stream_is_kept_alive_over_the_real_server(tmp_path) -> None:
    """A run waiting for its provider's answer says nothing; its stream sends
    keepalive comments meanwhile (the provider answers only after one came)."""
    async with (
        running_server(tmp_path, sse_keepalive_seconds=0.01) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        url = f"/agui/{provider.fingerprint}/echo"
        async with http.stream("POST", url, json=user_input()) as response:
            items = sse_items(response)
            run = await provider.next_offer()  # left unanswered for now
            assert await anext(items) == {"comment": "keepalive"}
            await provider.answer(run, "accepted")
            await provider.play(run, [started(run), finished(run)])
            rest = [item async for item in items if "comment" not in item]
        assert [(i["id"], i["data"]["type"]) for i in rest] == [
            ("1", "RUN_STARTED"),
            ("2", "RUN_FINISHED"),
        ]


def test_keepalive_setting_and_cursor_parsing() -> None:
    assert Settings().sse_keepalive_seconds == 15
    assert Settings(sse_keepalive_seconds=0).problems() == []
    for bad in (-1.0, math.nan, math.inf):
        (problem,) = Settings(sse_keepalive_seconds=bad).problems()
        assert "FUNDUQ_SSE_KEEPALIVE_SECONDS" in problem
    assert read_cursor(None) is None and read_cursor("") is None
    assert read_cursor("42") == 42
    for bad in ("-1", "4 2", "٣", "1" * 16):
        with pytest.raises(ValueError):
            read_cursor(bad)
