"""Hostile bytes (issue 10, items 1 and 9): what the provider link cannot carry
-- a lone surrogate anywhere, NaN/Infinity, nesting past the limit -- is
refused at both doors with nothing recorded; a run the link cannot encode
anyway (an older record's) fails alone; a provider's event carrying a lone
surrogate fails its run as malformed and never leaves it `running`.

Everything runs against the real server on a loopback port: httpx callers,
a hand-played provider on the real WebSocket, the real SQLite file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import stores
import trio
from support import http_client, post_sse, raw_provider, running_server, user_input

from funduq_trio.config import Settings
from funduq_trio.identity import Identity

SURROGATE = "\ud800"
JSON_HEADERS = {"content-type": "application/json"}
V1 = {"A2A-Version": "1.0", **JSON_HEADERS}
# A safety net against a hung test (the base code drops the link), never a behaviour clock.
LIMIT = 20


def deep(levels: int) -> Any:
    """A value whose containers nest `levels` deep."""
    value: Any = 1
    for i in range(levels):
        value = {"k": value} if i % 2 else [value]
    return value


def poisoned_agui_bodies() -> list[tuple[str, bytes]]:
    """(what, body) for AG-UI bodies the link cannot carry. Serialized with
    json.dumps: surrogates come out as valid `\\ud800` escapes, NaN as `NaN`."""

    def body(**changes: Any) -> dict[str, Any]:
        return {**user_input("hi", thread_id="poison-thread"), **changes}

    message = {"id": "m1", "role": "user", "content": "hi"}
    cases: list[tuple[str, Any]] = [
        ("content", body(messages=[{**message, "content": "hi " + SURROGATE}])),
        ("message id", body(messages=[{**message, "id": "m" + SURROGATE}])),
        ("thread id", body(threadId="t" + SURROGATE)),
        ("forwardedProps key", body(forwardedProps={"a": {"b" + SURROGATE: 1}})),
        ("state", body(state={"deep": [{"x": SURROGATE}]})),
        ("tools", body(tools=[{"name": "t", "description": SURROGATE, "parameters": {}}])),
        ("NaN", body(state={"n": float("nan")})),
        ("Infinity", body(forwardedProps={"n": float("inf")})),
        ("-Infinity", body(state={"n": [float("-inf")]})),
        ("nesting", body(state={"n": deep(100)})),
    ]
    return [(what, json.dumps(value).encode()) for what, value in cases]


async def assert_nothing_recorded(http: Any, info: Any) -> None:
    assert await info.funduq.list_runs() == []
    assert (await http.get("/threads/poison-thread")).status_code == 404


async def test_the_agui_door_refuses_what_the_link_cannot_carry(tmp_path):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        url = f"/agui/{provider.fingerprint}/echo"
        for what, body in poisoned_agui_bodies():
            response = await http.post(url, content=body, headers=JSON_HEADERS)
            assert response.status_code == 400, (what, response.text)
            error = response.json()["error"]
            assert error["code"] == "invalid_json", what
            assert "cannot be carried" in error["message"] or "not JSON" in error["message"]
        await assert_nothing_recorded(http, info)
        # The door is still the door: a clean body runs, on the same link.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(post_sse, http, url, user_input("fine"))
            with trio.fail_after(LIMIT):
                run = await provider.next_offer()
            assert run["runInput"]["messages"][-1]["content"] == "fine"
            await provider.answer(run, "refused", "just checking")


def v1_send(message_extra: dict[str, Any], **params: Any) -> dict[str, Any]:
    message = {"messageId": "m1", "role": "ROLE_USER", "parts": [{"text": "x"}], **message_extra}
    return {
        "jsonrpc": "2.0",
        "id": 5,
        "method": "SendMessage",
        "params": {"message": message, **params},
    }


def v03_send(message_extra: dict[str, Any], **params: Any) -> dict[str, Any]:
    message = {
        "kind": "message",
        "messageId": "m1",
        "role": "user",
        "parts": [{"kind": "text", "text": "x"}],
        **message_extra,
    }
    return {
        "jsonrpc": "2.0",
        "id": 5,
        "method": "message/send",
        "params": {"message": message, **params},
    }


async def test_the_a2a_door_refuses_what_the_link_cannot_carry(tmp_path):
    cases = [
        ("NaN in message metadata", {"metadata": {"n": float("nan")}}, {}),
        ("Infinity in request metadata", {}, {"metadata": {"n": float("inf")}}),
        ("surrogate key in request metadata", {}, {"metadata": {"k" + SURROGATE: 1}}),
        ("surrogate in a data part", {"parts": [{"data": {"v": SURROGATE}}]}, {}),
        ("nesting", {"metadata": {"n": deep(100)}}, {}),
    ]
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        url = info.a2a_url(provider.fingerprint, "echo")
        for what, message_extra, params in cases:
            for body, headers in (
                (v1_send(message_extra, **params), V1),
                (v03_send(_v03_parts(message_extra), **params), JSON_HEADERS),
            ):
                response = await http.post(url, content=json.dumps(body).encode(), headers=headers)
                assert response.status_code == 200
                answer = response.json()
                assert answer["id"] == 5, (what, answer)
                assert answer["error"]["code"] == -32602, (what, body["method"], answer)
        assert await info.funduq.list_runs() == []


def _v03_parts(message_extra: dict[str, Any]) -> dict[str, Any]:
    """The same message change in the 0.3 shape (parts carry a `kind`)."""
    parts = message_extra.get("parts")
    if parts is None:
        return message_extra
    return {**message_extra, "parts": [{"kind": "data", **p} for p in parts]}


# ------------------------------------------------------------------ second line


def _patch_record(path: Path, thread_id: str, rows: list[tuple[str, str]]) -> None:
    """Queue runs on `thread_id` the way an older deployment could have
    recorded them: (run id, input JSON text) each, in arrival order, copying
    the thread's first run for everything else."""
    with stores.record_connection(path) as conn:  # either store
        arrival = conn.execute("SELECT MAX(arrival) FROM runs").fetchone()[0]
        template = conn.execute(
            "SELECT provider_key, agent_name FROM runs WHERE thread_id=? LIMIT 1", (thread_id,)
        ).fetchone()
        for run_id, input_text in rows:
            arrival += 1
            conn.execute(
                "INSERT INTO runs (arrival, id, thread_id, provider_key, agent_name, status,"
                " input, caller_metadata, metadata, created_at) VALUES"
                " (?, ?, ?, ?, ?, 'queued', ?, '{}', '{}', 0)",
                (arrival, run_id, thread_id, *template, input_text),
            )


def _counters(path: Path) -> list[tuple[int, ...]]:
    with stores.record_connection(path) as conn:
        return [
            tuple(row)
            for row in conn.execute(
                "SELECT misdeclared, unanswered, abandoned, undelivered FROM providers"
            ).fetchall()
        ]


async def test_a_recorded_run_the_link_cannot_encode_fails_alone(tmp_path):
    identity = Identity.generate()
    path = Settings(data_dir=tmp_path).database_path

    # A record with a thread on it, made by the server itself.
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"], identity=identity) as provider,
    ):
        url = f"/agui/{provider.fingerprint}/echo"
        async with trio.open_nursery() as nursery:
            nursery.start_soon(post_sse, http, url, user_input("first", thread_id="t"))
            run = await provider.next_offer()
            await provider.answer(run, "accepted")
            await provider.play(
                run,
                [
                    {"type": "RUN_STARTED", "threadId": run["threadId"], "runId": run["runId"]},
                    {"type": "RUN_FINISHED", "threadId": run["threadId"], "runId": run["runId"]},
                ],
            )
        thread_id = run["threadId"]

    def input_text(text: str) -> str:
        return json.dumps(
            {
                "threadId": thread_id,
                "runId": "x",
                "state": {},
                "tools": [],
                "context": [],
                "messages": [{"id": f"m-{text}", "role": "user", "content": text}],
            }
        )

    poisoned = input_text("bad " + SURROGATE)
    assert "\\ud800" in poisoned  # valid JSON text, as the old door took it
    _patch_record(
        path,
        thread_id,
        [
            ("run_poison_surrogate", poisoned),
            ("run_poison_nan", input_text("nan").replace('"state": {}', '"state": {"n": NaN}')),
            ("run_next", input_text("next")),
        ],
    )
    before = _counters(path)

    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"], identity=identity) as provider,
    ):
        with trio.fail_after(LIMIT):
            offered = await provider.next_offer()
        # The poisoned runs never left; the thread's next run is the one offered.
        assert offered["runId"] == "run_next"
        assert offered["runInput"]["messages"][-1]["content"] == "next"
        await provider.answer(offered, "accepted")
        await provider.play(
            offered,
            [
                {"type": "RUN_STARTED", "threadId": thread_id, "runId": "run_next"},
                {"type": "RUN_FINISHED", "threadId": thread_id, "runId": "run_next"},
            ],
        )
        with trio.fail_after(LIMIT):
            done = await info.funduq.wait_run("run_next")
        assert done["status"] == "completed"

        for run_id in ("run_poison_surrogate", "run_poison_nan"):
            record = (await http.get(f"/runs/{run_id}")).json()
            assert record["status"] == "failed", record
            assert record["metadata"]["failureReason"] == "offer_not_encodable"
            assert [e["event"] for e in record["events"]] == [
                {
                    "type": "RUN_ERROR",
                    "message": "offer_not_encodable",
                    "code": "offer_not_encodable",
                }
            ]
        # The link stayed up all along: the same connection serves a new run.
        roster = (await http.get("/agents")).json()["agents"]
        assert [a["online"] for a in roster] == [True]
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                post_sse,
                http,
                f"/agui/{provider.fingerprint}/echo",
                user_input("after", thread_id=thread_id),
            )
            with trio.fail_after(LIMIT):
                later = await provider.next_offer()
            assert later["threadId"] == thread_id
            await provider.answer(later, "refused", "enough")
        assert provider.offers.statistics().current_buffer_used == 0
    # Nobody's fault at the provider: no quality counter moved.
    assert _counters(path) == before


# ------------------------------------------------------------------ provider side


async def test_an_event_with_a_lone_surrogate_or_absurd_nesting_fails_its_run(tmp_path):
    def events(run: dict[str, Any], bad: dict[str, Any]) -> list[dict[str, Any]]:
        ids = {"threadId": run["threadId"], "runId": run["runId"]}
        return [
            {"type": "RUN_STARTED", **ids},
            {"type": "TEXT_MESSAGE_START", "messageId": "m", "role": "assistant"},
            bad,
            {"type": "TEXT_MESSAGE_END", "messageId": "m"},
            {"type": "RUN_FINISHED", **ids},
        ]

    bad_events = [
        {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "x" + SURROGATE},
        {"type": "TEXT_MESSAGE_START", "messageId": "m" + SURROGATE, "role": "assistant"},
        {"type": "SOMETHING_NEWER", "payload": {"k" + SURROGATE: [1]}},
        {"type": "CUSTOM", "name": "n", "value": {"deep": [[SURROGATE]]}},
        # Past 256 levels (far below where a recursive encoder could fail).
        {"type": "SOMETHING_NEWER", "payload": deep(300)},
    ]
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        url = f"/agui/{provider.fingerprint}/echo"
        for n, bad in enumerate(bad_events):
            seen: dict[str, Any] = {}

            async def call(text: str, seen: dict[str, Any] = seen) -> None:
                seen["response"], seen["events"] = await post_sse(http, url, user_input(text))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call, f"call-{n}")
                with trio.fail_after(LIMIT):
                    run = await provider.next_offer()
                await provider.answer(run, "accepted")
                await provider.play(run, events(run, bad))
            record = (await http.get(f"/runs/{run['runId']}")).json()
            assert record["status"] == "failed", (bad, record["status"])
            assert record["metadata"]["failureReason"] == "provider sent a malformed AG-UI event"
            kinds = [e["event"]["type"] for e in record["events"]]
            # What came before the bad event is kept; it and what followed are not.
            assert kinds[-1] == "RUN_ERROR" and bad not in [e["event"] for e in record["events"]]
            assert kinds == ["RUN_STARTED", "TEXT_MESSAGE_START", "RUN_ERROR"] or kinds == [
                "RUN_STARTED",
                "RUN_ERROR",
            ]
            assert [e["type"] for e in seen["events"]] == kinds
            # The provider is asked to stop; its link stays up for the next run.
            with trio.fail_after(LIMIT):
                assert await provider.cancels.receive() == run["runId"]
        roster = (await http.get("/agents")).json()["agents"]
        assert [a["online"] for a in roster] == [True]


# ------------------------------------------------------------------ the one check


def test_problem_names_what_and_where():
    from funduq_trio.protocol import carriable

    assert carriable.problem({"a": ["ok", 1.5, 10**400, None, True]}) is None
    assert "$.a[1].b" in carriable.problem({"a": [0, {"b": "x" + SURROGATE}]})
    assert "in a key at $.a" in carriable.problem({"a": {SURROGATE: 1}})
    assert "nan at $.n" in carriable.problem({"n": float("nan")})
    assert "-inf" in carriable.problem([float("-inf")])
    assert carriable.problem(deep(100)) is None
    assert "nesting deeper than 100" in carriable.problem(deep(101))
    assert carriable.problem(deep(5000), max_nesting=None) is None  # no recursion
    assert '$["a b"]' in carriable.problem({"a b": SURROGATE})


# ------------------------------------------------------------------ oversize bodies


async def _read_until_closed(stream: trio.SocketStream) -> bytes:
    """Everything the server sends until it closes the connection."""
    data = b""
    with trio.fail_after(LIMIT):  # the base code never closes: the test fails, not hangs
        while chunk := await stream.receive_some():
            data += chunk
    return data


async def test_an_oversize_refusal_closes_its_connection(tmp_path):
    limit = 4096
    async with running_server(tmp_path, max_body_bytes=limit) as info:
        for path, status in ((b"/agui/p/echo", b"413"), (b"/a2a/p/echo", b"200")):
            head = (
                b"POST " + path + b" HTTP/1.1\r\nHost: funduq\r\nContent-Type: application/json\r\n"
            )
            for framing, start in (
                (b"Content-Length: %d\r\n\r\n" % (limit + 1000), b"{" + b" " * 100),
                # No length upfront: the limit is passed while reading, the rest never comes.
                (
                    b"Transfer-Encoding: chunked\r\n\r\n",
                    b"%x\r\n%s\r\n" % (limit + 10, b" " * (limit + 10)),
                ),
            ):
                stream = await trio.open_tcp_stream("127.0.0.1", info.port)
                await stream.send_all(head + framing + start)
                # Meanwhile another connection is served as usual.
                async with http_client(info) as http:
                    assert (await http.get("/healthz")).status_code == 200
                answer = await _read_until_closed(stream)
                await stream.aclose()
                head_part, _, body = answer.partition(b"\r\n\r\n")
                assert head_part.startswith(b"HTTP/1.1 " + status), answer
                assert b"connection: close" in head_part.lower(), answer
                error = json.loads(body)["error"]
                if status == b"413":
                    assert error["code"] == "body_too_large"
                else:
                    assert error["code"] == -32600 and error["message"] == "Payload too large"

        # httpx on one keep-alive pool: the next request after a refusal succeeds.
        async with http_client(info) as http:
            for url in ("/agui/p/echo", "/a2a/p/echo"):
                for _ in range(3):
                    refused = await http.post(url, content=b" " * 4_000_000, headers=JSON_HEADERS)
                    assert refused.headers["connection"] == "close"
                    with trio.fail_after(LIMIT):
                        assert (await http.get("/healthz")).status_code == 200


# ------------------------------------------------------------------ A2A views of odd events

HUGE = 10**400


def _rpc(method: str, params: dict[str, Any], id: int = 1) -> bytes:
    return json.dumps({"jsonrpc": "2.0", "id": id, "method": method, "params": params}).encode()


async def _rpc_call(http: Any, url: str, method: str, params: dict[str, Any]) -> dict[str, Any]:
    response = await http.post(url, content=_rpc(method, params), headers=V1)
    assert response.status_code == 200
    return response.json()


def _sdk_parses(result: dict[str, Any], message: Any) -> Any:
    """What a caller's SDK does with the answer: parse it into the protobuf."""
    from google.protobuf.json_format import ParseDict

    return ParseDict(result, message, ignore_unknown_fields=True)


def _odd_events(run: dict[str, Any]) -> list[dict[str, Any]]:
    ids = {"threadId": run["threadId"], "runId": run["runId"]}
    return [
        {"type": "RUN_STARTED", **ids},
        {"type": "SOMETHING_DEEP", "payload": deep(150)},
        {"type": "CUSTOM", "name": "big", "value": HUGE},
        {"type": "TEXT_MESSAGE_START", "messageId": "m", "role": "assistant"},
        {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "still here"},
        {"type": "TEXT_MESSAGE_END", "messageId": "m"},
        {"type": "RUN_FINISHED", **ids, "result": {"n": HUGE, "deep": deep(60)}},
    ]


async def test_odd_stored_events_degrade_the_a2a_views_never_fail_them(tmp_path):
    from a2a.types import a2a_pb2 as pb

    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        url = info.a2a_url(provider.fingerprint, "echo")
        message = {"messageId": "a1", "role": "ROLE_USER", "parts": [{"text": "hi"}]}
        frames: list[dict[str, Any]] = []

        async def stream() -> None:
            async with http.stream(
                "POST", url, content=_rpc("SendStreamingMessage", {"message": message}), headers=V1
            ) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        frames.append(json.loads(line[len("data:") :]))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream)
            with trio.fail_after(LIMIT):
                run = await provider.next_offer()
            await provider.answer(run, "accepted")
            await provider.play(run, _odd_events(run))
        # The live stream ran to its end, every frame a result a caller's SDK parses.
        assert all("error" not in f for f in frames), frames
        updates = [_sdk_parses(f["result"], pb.StreamResponse()) for f in frames]
        final = updates[-1].status_update
        assert final.status.state == pb.TaskState.TASK_STATE_COMPLETED
        degraded = [u for u in updates if "funduq/degraded" in u.status_update.metadata]
        assert len(degraded) >= 2  # the deep one, the huge one (and the final's RUN_FINISHED)
        text = "".join(p.text for u in updates for p in u.artifact_update.artifact.parts)
        assert text == "still here"

        # A second task on the same context: a refusal whose reason is not UTF-8.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                _rpc_call,
                http,
                url,
                "SendMessage",
                {"message": {**message, "messageId": "a2", "contextId": run["threadId"]}},
            )
            with trio.fail_after(LIMIT):
                refused = await provider.next_offer()
            await provider.answer(refused, "refused", "no " + SURROGATE)

        for task_id, state in (
            (run["runId"], pb.TaskState.TASK_STATE_COMPLETED),
            (refused["runId"], pb.TaskState.TASK_STATE_FAILED),
        ):
            got = await _rpc_call(http, url, "GetTask", {"id": task_id})
            assert "result" in got, got
            task = _sdk_parses(got["result"], pb.Task())
            assert task.status.state == state
        assert task.status.message.parts[0].text == "no \ufffd"

        listed = await _rpc_call(http, url, "ListTasks", {"contextId": run["threadId"]})
        assert "result" in listed, listed
        tasks = _sdk_parses(listed["result"], pb.ListTasksResponse()).tasks
        assert {t.id for t in tasks} == {run["runId"], refused["runId"]}

        # The record keeps every event exactly as the provider sent it.
        record = json.loads((await http.get(f"/runs/{run['runId']}")).text)
        assert [e["event"] for e in record["events"]] == _odd_events(run)
        refusal = json.loads((await http.get(f"/runs/{refused['runId']}")).text)
        assert refusal["metadata"]["failureReason"] == "no " + SURROGATE


async def test_a_stored_event_with_a_lone_surrogate_degrades_the_a2a_views(tmp_path):
    from a2a.types import a2a_pb2 as pb

    path = Settings(data_dir=tmp_path).database_path
    identity = Identity.generate()
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"], identity=identity) as provider,
    ):
        url = info.a2a_url(provider.fingerprint, "echo")
        message = {"messageId": "a1", "role": "ROLE_USER", "parts": [{"text": "hi"}]}
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_rpc_call, http, url, "SendMessage", {"message": message})
            with trio.fail_after(LIMIT):
                run = await provider.next_offer()
            await provider.answer(run, "accepted")
            ids = {"threadId": run["threadId"], "runId": run["runId"]}
            await provider.play(
                run,
                [
                    {"type": "RUN_STARTED", **ids},
                    {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "placeholder"},
                    {"type": "SOMETHING_NEWER", "payload": "placeholder"},
                    {"type": "RUN_FINISHED", **ids},
                ],
            )
    # What an older funduq (which took such events) left in the record.
    stored = {
        2: {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m" + SURROGATE, "delta": "x" + SURROGATE},
        3: {"type": "SOMETHING_NEWER", "payload": {"k" + SURROGATE: SURROGATE}},
    }
    with stores.record_connection(path) as conn:
        for seq, event in stored.items():
            conn.execute(
                "UPDATE events SET event=? WHERE run_id=? AND seq=?",
                (json.dumps(event), run["runId"], seq),
            )

    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"], identity=identity) as provider,
    ):
        url = info.a2a_url(provider.fingerprint, "echo")
        got = await _rpc_call(http, url, "GetTask", {"id": run["runId"]})
        assert "result" in got, got
        task = _sdk_parses(got["result"], pb.Task())
        assert task.status.state == pb.TaskState.TASK_STATE_COMPLETED
        assert [p.text for a in task.artifacts for p in a.parts] == ["x\ufffd"]
        listed = await _rpc_call(http, url, "ListTasks", {"contextId": run["threadId"]})
        assert [t["id"] for t in listed["result"]["tasks"]] == [run["runId"]]
        record = json.loads((await http.get(f"/runs/{run['runId']}")).text)
        assert {e["seq"]: e["event"] for e in record["events"] if e["seq"] in stored} == stored


def test_a_record_no_projection_can_show_is_listed_by_status():
    from a2a.types import a2a_pb2 as pb

    from funduq_trio.protocol import a2a

    good = {"runId": "run_a", "threadId": "t", "status": "completed", "events": []}
    broken = {"runId": "run_b", "threadId": "t", "status": "failed", "events": [7]}
    page = a2a.TaskPage(records=[good, broken], total_size=2, page_size=2, next_page_token="")
    listed = a2a.list_tasks_response(pb.ListTasksRequest(), page, [good, broken])
    assert [t.id for t in listed.tasks] == ["run_a", "run_b"]
    assert listed.tasks[1].status.state == pb.TaskState.TASK_STATE_FAILED
    assert listed.tasks[1].metadata["funduq/degraded"] is True
    assert "funduq/degraded" not in listed.tasks[0].metadata


async def test_a_thread_history_the_link_cannot_carry_fails_the_query_not_the_link(tmp_path):
    identity = Identity.generate()
    path = Settings(data_dir=tmp_path).database_path
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"], identity=identity) as provider,
    ):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                post_sse, http, f"/agui/{provider.fingerprint}/echo", user_input("first")
            )
            run = await provider.next_offer()
            await provider.answer(run, "refused", "not now")
    # What an older funduq (whose door took lone surrogates) left in the history.
    with stores.record_connection(path) as conn:
        conn.execute(
            "UPDATE messages SET message=? WHERE thread_id=?",
            (
                json.dumps({"id": "m1", "role": "user", "content": "bad " + SURROGATE}),
                run["threadId"],
            ),
        )

    async with (
        running_server(tmp_path) as info,
        raw_provider(info, ["echo"], identity=identity) as provider,
    ):
        query = {"kind": "query.threadMessages", "threadId": run["threadId"], "limit": None}
        with trio.fail_after(LIMIT):
            reply = await provider.request(query)
        assert reply["kind"] == "err" and "lone surrogate" in reply["reason"], reply
        # The link is up: it answers the next request.
        with trio.fail_after(LIMIT):
            again = await provider.request({**query, "threadId": "thread_none"})
        assert again["kind"] == "err" and "lone surrogate" not in again["reason"]


def test_sse_frames_escape_what_other_line_readers_split_on():
    """U+0085, U+2028 and U+2029 are not SSE line ends, but Python's
    str.splitlines (httpx's aiter_lines) splits on them: a frame escapes them,
    and the JSON still reads back as sent."""
    from funduq_trio.web.sse import sse_frame

    data = {"delta": "a\u2028b\x85c\u2029d é"}
    frame = sse_frame(data, 7).decode("utf-8")
    assert frame.splitlines() == ["id: 7", 'data: {"delta":"a\\u2028b\\u0085c\\u2029d é"}', ""]
    assert json.loads(frame.splitlines()[1][len("data: ") :]) == data
