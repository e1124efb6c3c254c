"""How an SSE stream is written once quart has answered (`web/sse.py`,
`serve_streams`): quart sends the status and headers, then the stream is
written on the connection's own task, with the keepalive comments, the
response's end once the source ends, and nothing more once the caller has
gone. Driven straight on ASGI (no server, no socket) under MockClock, with a
one-route quart-trio app wrapped as `web/app.py` wraps funduq's."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import trio
from quart import jsonify
from quart_trio import QuartTrio

from funduq_trio.web.sse import (
    KEEPALIVE,
    KEEPALIVE_CONFIG,
    STREAM_SLOT,
    Identified,
    serve_streams,
    sse_response,
)


def make_app(source: Any, interval: float = 15) -> Any:
    app = QuartTrio(__name__)
    app.config[KEEPALIVE_CONFIG] = interval

    @app.get("/stream")
    async def stream() -> Any:
        return sse_response(source(), headers={"X-Extra": "yes"})

    @app.get("/plain")
    async def plain() -> Any:
        return jsonify({"plain": True})

    @app.after_request
    async def hook(response: Any) -> Any:
        response.headers["X-After"] = "seen"  # as the CORS hook adds its headers
        return response

    return serve_streams(app.asgi_app)


def scope_of(path: str) -> dict[str, Any]:
    return {
        "type": "http",
        "asgi": {"spec_version": "2.1", "version": "3.0"},
        "http_version": "1.1",
        "method": "GET",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"test")],
        "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 2),
        "extensions": {},
    }


class Peer:
    """The server's side of one request: what the app sent, and when."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, dict[str, Any]]] = []
        self.leave = trio.Event()
        self._asked = False

    async def receive(self) -> dict[str, Any]:
        if not self._asked:
            self._asked = True
            return {"type": "http.request", "body": b"", "more_body": False}
        await self.leave.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append((trio.current_time(), message))

    def bodies(self) -> list[tuple[float, bytes, bool]]:
        return [
            (t, m.get("body", b""), m.get("more_body", False))
            for t, m in self.sent
            if m["type"] == "http.response.body"
        ]


async def test_a_stream_is_written_with_keepalives_then_ended(autojump_clock) -> None:
    more = trio.Event()
    closed = trio.Event()

    async def source() -> AsyncIterator[list[Any]]:
        try:
            yield [Identified(1, {"n": 1}), {"plain": "frame"}]
            await more.wait()
            yield [Identified(2, {"n": 2})]
        finally:
            closed.set()

    app = make_app(source)
    peer = Peer()
    async with trio.open_nursery() as nursery:
        start = trio.current_time()

        async def release_at(t: float) -> None:
            await trio.sleep_until(start + t)
            more.set()

        nursery.start_soon(release_at, 40)
        scope = scope_of("/stream")
        await app(scope, peer.receive, peer.send)
    assert closed.is_set()
    assert STREAM_SLOT not in scope
    head = peer.sent[0][1]
    assert head["type"] == "http.response.start" and head["status"] == 200
    headers = {k.decode(): v.decode() for k, v in head["headers"]}
    assert headers["content-type"] == "text/event-stream"
    assert headers["cache-control"] == "no-cache"
    assert headers["x-extra"] == "yes" and headers["x-after"] == "seen"
    assert [(t - start, body, more_body) for t, body, more_body in peer.bodies()] == [
        (0, b'id: 1\ndata: {"n":1}\n\ndata: {"plain":"frame"}\n\n', True),
        (15, KEEPALIVE, True),
        (30, KEEPALIVE, True),
        (40, b'id: 2\ndata: {"n":2}\n\n', True),
        (40, b"", False),  # the end, once: quart's own end of the body was held back
    ]


async def test_no_keepalive_when_it_is_off(autojump_clock) -> None:
    async def source() -> AsyncIterator[list[Any]]:
        yield [{"n": 1}]
        await trio.sleep(100)
        yield [{"n": 2}]

    peer = Peer()
    await make_app(source, interval=0)(scope_of("/stream"), peer.receive, peer.send)
    assert [body for _, body, _ in peer.bodies()] == [
        b'data: {"n":1}\n\n',
        b'data: {"n":2}\n\n',
        b"",
    ]


async def test_a_caller_that_goes_closes_the_source_and_gets_nothing_more(
    autojump_clock,
) -> None:
    closed = trio.Event()

    async def source() -> AsyncIterator[list[Any]]:
        try:
            yield [{"n": 1}]
            await trio.sleep_forever()
            yield [{"never": True}]  # pragma: no cover
        finally:
            closed.set()

    app = make_app(source)
    peer = Peer()
    async with trio.open_nursery() as nursery:

        async def leave_at_20() -> None:
            await trio.sleep(20)
            peer.leave.set()

        nursery.start_soon(leave_at_20)
        await app(scope_of("/stream"), peer.receive, peer.send)
    assert closed.is_set()
    # The first frame and one keepalive; no end of the response after the caller left.
    assert [body for _, body, _ in peer.bodies()] == [b'data: {"n":1}\n\n', KEEPALIVE]


async def test_a_source_that_fails_cuts_the_response(autojump_clock) -> None:
    async def source() -> AsyncIterator[list[Any]]:
        yield [{"n": 1}]
        raise RuntimeError("broken source")

    peer = Peer()
    with pytest.raises(BaseException) as raised:  # noqa: PT011 -- a group on newer trio
        await make_app(source)(scope_of("/stream"), peer.receive, peer.send)
    assert "broken source" in repr(raised.value) or any(
        "broken source" in repr(e) for e in getattr(raised.value, "exceptions", ())
    )
    # Never ended as if complete.
    assert [(body, more) for _, body, more in peer.bodies()] == [(b'data: {"n":1}\n\n', True)]


async def test_a_cancelled_stream_is_cut_not_ended(autojump_clock) -> None:
    """The server shutting down cancels the connection's task: no end is sent."""

    async def source() -> AsyncIterator[list[Any]]:
        yield [{"n": 1}]
        await trio.sleep_forever()

    peer = Peer()
    with trio.move_on_after(20):
        await make_app(source)(scope_of("/stream"), peer.receive, peer.send)
    assert [body for _, body, _ in peer.bodies()] == [b'data: {"n":1}\n\n', KEEPALIVE]


async def test_other_responses_pass_through(autojump_clock) -> None:
    peer = Peer()
    scope = scope_of("/plain")
    await make_app(None)(scope, peer.receive, peer.send)
    assert peer.sent[0][1]["status"] == 200
    bodies = peer.bodies()
    assert bodies[-1][1:] == (b"", False)
    assert b"".join(body for _, body, _ in bodies) == b'{"plain":true}\n'
    assert STREAM_SLOT not in scope  # nothing is left behind in the scope


async def test_a_source_that_waits_first_has_its_head_sent_at_once(autojump_clock) -> None:
    """A stream of a queued run has no event yet: its status and headers go
    out at once (an empty body; funduq's front writes a head with the first
    body), and keepalives keep their interval from there."""
    more = trio.Event()

    async def source() -> AsyncIterator[list[Any]]:
        await more.wait()
        yield [{"n": 1}]

    peer = Peer()
    async with trio.open_nursery() as nursery:
        start = trio.current_time()

        async def release_at_20() -> None:
            await trio.sleep_until(start + 20)
            more.set()

        nursery.start_soon(release_at_20)
        await make_app(source)(scope_of("/stream"), peer.receive, peer.send)
    assert [(t - start, body, more_body) for t, body, more_body in peer.bodies()] == [
        (0, b"", True),  # the head, at once
        (15, KEEPALIVE, True),
        (20, b'data: {"n":1}\n\n', True),
        (20, b"", False),
    ]
