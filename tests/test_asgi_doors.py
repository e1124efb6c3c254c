"""The doors' run POSTs and /healthz served on plain ASGI (`web/asgi_doors.py`)
answer exactly as quart's routes for the same doors do.

Each request is sent twice over ASGI (no socket) to one app built by
`create_app` over a running server's broker: once to the app itself, whose
outermost layer serves these requests without quart, and once to what is
behind that layer (quart, with the doors' own routes, and `serve_streams`).
Status, headers and body must match: refusals byte for byte, real runs (an
SDK echo provider) event by event up to the ids that differ between two runs.
"""

from __future__ import annotations

import json
from typing import Any

import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from quart_trio import QuartTrio
from reliability_support import eventually
from support import raw_provider, running_server, sdk_provider

from funduq_trio.web.app import compact_dumps, create_app
from funduq_trio.web.sse import HANGUP_EXTENSION

NET = 15  # a safety net against a hung test, never a behaviour clock

Head = tuple[int, list[tuple[bytes, bytes]]]


async def asgi_call(
    asgi: Any,
    method: str,
    path: str,
    body: bytes = b"",
    headers: list[tuple[bytes, bytes]] = (),
    *,
    hangup: bool = False,
) -> tuple[Head, bytes]:
    """One request over ASGI: its status and (lowercased, sorted) headers, and
    its body. `hangup`: the server offers the hang-up extension (as funduq's
    front does; the caller never hangs up), and whatever the app watches
    with it is unwatched by the end."""
    scope = asgi_scope(method, path, body, headers)
    watched: list[bool] = []
    if hangup:
        scope["extensions"] = {HANGUP_EXTENSION: lambda cb: watched.append(cb is not None)}
    messages: list[dict[str, Any]] = []
    answered = trio.Event()
    body_sent = False

    async def receive() -> dict[str, Any]:
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await answered.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)
        if message["type"] == "http.response.body" and not message.get("more_body", False):
            answered.set()

    with trio.fail_after(NET):
        await asgi(scope, receive, send)
    assert answered.is_set(), messages
    assert watched[-1:] in ([], [False]), watched
    start = messages[0]
    head = (start["status"], sorted((k.lower(), v) for k, v in start["headers"]))
    return head, b"".join(m.get("body", b"") for m in messages[1:])


def asgi_scope(
    method: str, path: str, body: bytes, headers: list[tuple[bytes, bytes]]
) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"spec_version": "2.1", "version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"test"), (b"content-length", b"%d" % len(body)), *headers],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 80),
    }


def sse_events(body: bytes) -> list[dict[str, Any]]:
    return [
        json.loads(line[len(b"data: ") :])
        for line in body.split(b"\n")
        if line.startswith(b"data: ")
    ]


JSON = [(b"content-type", b"application/json")]
A2A = [*JSON, (b"a2a-version", b"1.0")]
REFUSED = [
    ("GET", "/healthz", b"", []),
    ("GET", "/healthz", b"", [(b"origin", b"http://allowed.example")]),
    ("POST", "/agui/p/echo", b"{}", JSON),
    ("POST", "/agui/p/echo", b"{x", JSON),
    ("POST", "/agui/p/echo", b'{"a": NaN}', JSON),
    ("POST", "/agui/p/echo", b"[" * 200 + b"]" * 200, JSON),
    (
        "POST",
        "/agui/p/echo",
        b'{"threadId":"t","runId":"r","messages":[],"tools":[],"context":[],"state":null}',
        [*JSON, (b"origin", b"http://allowed.example")],
    ),
    ("POST", "/agui/p/echo", b"x" * 5000, JSON),  # over the limit
    ("POST", "/a2a/p/echo", b"{}", JSON),
    ("POST", "/a2a/p/echo/", b"{}", [(b"content-type", b"text/plain")]),
    ("POST", "/a2a/p/echo", b'{"jsonrpc":"2.0","id":1,"method":"SendMessage","params":{}}', JSON),
    ("POST", "/a2a/p/echo", b"x" * 5000, JSON),  # over the limit: JSON-RPC's answer
    ("POST", "/a2a/p/echo/extra", b"{}", JSON),  # not a door: quart's 404 either way
]


async def test_refusals_are_answered_alike_with_and_without_quart(tmp_path):
    async with running_server(
        tmp_path, max_body_bytes=4096, cors_origins=frozenset({"http://allowed.example"})
    ) as info:
        app = create_app(info.funduq)
        plain, quart = app.asgi_app, app.asgi_app.behind
        for method, path, body, headers in REFUSED:
            ours = await asgi_call(plain, method, path, body, headers)
            theirs = await asgi_call(quart, method, path, body, headers)
            assert ours == theirs, (method, path, body[:40])
            # On funduq's front (the hang-up extension): the same answers.
            watched = await asgi_call(plain, method, path, body, headers, hangup=True)
            assert watched == ours, (method, path, body[:40])
            assert ours[0][0] in (200, 400, 404, 413), ours


def agui_body(text: str) -> bytes:
    return json.dumps(
        {
            "threadId": "caller-thread",
            "runId": "caller-run",
            "state": None,
            "messages": [{"id": "m-1", "role": "user", "content": text}],
            "tools": [],
            "context": [],
            "forwardedProps": None,
        }
    ).encode()


def a2a_body(text: str, method: str) -> bytes:
    message = {"messageId": "m-1", "role": "ROLE_USER", "parts": [{"text": text}]}
    return json.dumps(
        {"jsonrpc": "2.0", "id": 7, "method": method, "params": {"message": message}}
    ).encode()


IDS = {"runId", "threadId", "id", "contextId", "taskId", "messageId", "artifactId", "timestamp"}


def without_ids(value: Any) -> Any:
    """`value` with the ids two runs do not share (run, thread, task, context,
    message ids; timestamps) blanked."""
    if isinstance(value, dict):
        return {k: "*" if k in IDS else without_ids(v) for k, v in value.items()}
    if isinstance(value, list):
        return [without_ids(v) for v in value]
    return value


async def test_runs_are_answered_alike_with_and_without_quart(tmp_path):
    async with running_server(tmp_path) as info, sdk_provider(info) as provider:
        key = provider.identity.fingerprint
        app = create_app(info.funduq)
        plain, quart = app.asgi_app, app.asgi_app.behind

        # AG-UI: the run's stream.
        streams = []
        for asgi in (plain, quart):
            head, body = await asgi_call(asgi, "POST", f"/agui/{key}/echo", agui_body("hi"), JSON)
            streams.append((head, [without_ids(e) for e in sse_events(body)]))
        assert streams[0] == streams[1]
        (status, headers), events = streams[0]
        assert status == 200 and (b"content-type", b"text/event-stream") in headers
        assert events[0]["type"] == "RUN_STARTED" and events[-1]["type"] == "RUN_FINISHED"

        # A2A: a blocking SendMessage (JSON) and a SendStreamingMessage (SSE).
        for method in ("SendMessage", "SendStreamingMessage"):
            answers = []
            # Plain, behind quart, and plain as on funduq's front (the hang-up extension).
            for asgi, hangup in ((plain, False), (quart, False), (plain, True)):
                (status, headers), body = await asgi_call(
                    asgi, "POST", f"/a2a/{key}/echo", a2a_body("hello", method), A2A, hangup=hangup
                )
                if method == "SendStreamingMessage":
                    payloads = sse_events(body)
                else:
                    payloads = [json.loads(body)]
                # Lengths differ with the ids' and timestamps' lengths.
                headers = [(k, v) for k, v in headers if k != b"content-length"]
                answers.append(((status, headers), [without_ids(p) for p in payloads]))
            assert answers[0] == answers[1] == answers[2], method
            assert answers[0][0][0] == 200
            assert "result" in answers[0][1][-1], answers[0][1][-1]


async def test_a_blocking_send_whose_caller_leaves_stops_waiting_and_the_run_goes_on(tmp_path):
    """A blocking SendMessage for a run the provider holds; the caller
    disconnects: the door stops waiting at once (nothing is answered to a
    caller who is gone, and nothing of the request is held), and the run
    itself is still running."""
    async with running_server(tmp_path) as info, raw_provider(info, ["held"]) as provider:
        plain = create_app(info.funduq).asgi_app
        body = a2a_body("hold", "SendMessage")
        scope = asgi_scope("POST", f"/a2a/{provider.identity.fingerprint}/held", body, A2A)
        gone, returned = trio.Event(), trio.Event()
        sent: list[dict[str, Any]] = []
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def call() -> None:
            await plain(scope, receive, send)
            returned.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            run = await provider.next_offer()
            await provider.answer(run, "accepted")

            async def running() -> bool:
                record = await info.funduq.get_run(run["runId"])
                return record is not None and record["status"] == "running"

            await eventually(running, "the run running")
            assert not returned.is_set()  # the caller is still there: waiting
            gone.set()
            with trio.fail_after(NET):
                await returned.wait()
        assert sent == []
        record = await info.funduq.get_run(run["runId"])
        assert record is not None and record["status"] == "running", record


async def test_a_blocking_send_on_a_front_that_says_when_its_caller_hangs_up(tmp_path):
    """The same wait on a server that offers the hang-up extension (funduq's
    front): nothing reads `receive` once the body is read (no watcher task);
    the hang-up the app asked for stops the wait at once, nothing is
    answered, the watch is dropped, and the run itself is still running."""
    async with running_server(tmp_path) as info, raw_provider(info, ["held"]) as provider:
        plain = create_app(info.funduq).asgi_app
        body = a2a_body("hold", "SendMessage")
        scope = asgi_scope("POST", f"/a2a/{provider.identity.fingerprint}/held", body, A2A)
        callbacks: list[Any] = []
        scope["extensions"] = {HANGUP_EXTENSION: callbacks.append}
        returned = trio.Event()
        sent: list[dict[str, Any]] = []
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            assert not delivered, "receive read again after the body: a watcher"
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def call() -> None:
            await plain(scope, receive, send)
            returned.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            run = await provider.next_offer()
            await provider.answer(run, "accepted")

            async def running() -> bool:
                record = await info.funduq.get_run(run["runId"])
                return record is not None and record["status"] == "running"

            await eventually(running, "the run running")
            assert not returned.is_set()  # the caller is still there: waiting
            (hung_up,) = callbacks
            hung_up()  # as the front's Hangups task calls it
            with trio.fail_after(NET):
                await returned.wait()
        assert sent == []
        assert callbacks[1:] == [None]  # unwatched
        record = await info.funduq.get_run(run["runId"])
        assert record is not None and record["status"] == "running", record


async def test_an_agui_post_whose_caller_left_starts_its_run_and_returns(tmp_path):
    """The AG-UI door does not wait for its run, so its POST has no watch
    for a disconnect: a caller gone right after its body still gets its run
    started (recorded and offered), and the request ends at once -- its
    stream notices the caller gone as it opens -- without waiting for the
    run, which goes on."""
    async with running_server(tmp_path) as info, raw_provider(info, ["held"]) as provider:
        plain = create_app(info.funduq).asgi_app
        body = agui_body("left at once")
        scope = asgi_scope("POST", f"/agui/{provider.identity.fingerprint}/held", body, JSON)
        delivered = False
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        with trio.fail_after(NET):
            await plain(scope, receive, send)
            run = await provider.next_offer()
        await provider.answer(run, "accepted")
        assert [m["type"] for m in sent][:1] == ["http.response.start"]
        assert sent[0]["status"] == 200

        async def running() -> bool:
            record = await info.funduq.get_run(run["runId"])
            return record is not None and record["status"] == "running"

        await eventually(running, "the run running")


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text()
    | st.datetimes()  # the provider's `default` writes these
    | st.uuids(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(JSON_VALUES)
def test_the_doors_json_is_the_apps_json(value):
    """The doors write JSON with an encoder made once; it writes exactly what
    the app's JSON provider writes (lone surrogates escaped, key order kept,
    its `default` for what JSON has no type for)."""
    app = QuartTrio(__name__)
    app.json.sort_keys = False  # as create_app sets it
    assert compact_dumps(app)(value) == app.json.dumps(value, separators=(",", ":"))
