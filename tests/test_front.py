"""funduq's own HTTP/1.1 and WebSocket front (`funduq_trio/front`), driven
over real loopback sockets: by hand-written bytes where the wire itself is
the point (keep-alive, pipelining, malformed requests, bounds), by httpx and
trio-websocket where a standard client is.

Most tests serve a few-line ASGI app with `serve_asgi`, so each behaviour is
the front's and nothing else's; the last ones go through funduq itself.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from support import refused_handshake, running_server
from trio_websocket import ConnectionClosed, open_websocket_url

from funduq_trio.front import FrontLimits, serve_asgi

NET = 10.0  # a safety net against a hang, never a behaviour clock


#: What /hold waits for before it answers (one per test that uses it).
holding: list[trio.Event] = []


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    """Echoes what it was asked: method, path, query, body; fails on /fail;
    answers in two bursts on /stream; websockets echo until closed."""
    if scope["type"] == "lifespan":
        assert (await receive())["type"] == "lifespan.startup"
        await send({"type": "lifespan.startup.complete"})
        await receive()
        return
    if scope["type"] == "websocket":
        assert (await receive())["type"] == "websocket.connect"
        if scope["path"] == "/refuse":
            await send({"type": "websocket.close"})
            return
        await send({"type": "websocket.accept"})
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                seen.append(message)
                return
            if message.get("text") == "close 4001":
                await send({"type": "websocket.close", "code": 4001, "reason": "asked"})
                continue
            await send(
                {
                    "type": "websocket.send",
                    **{k: message[k] for k in ("text", "bytes") if k in message},
                }
            )
    body = b""
    while True:
        message = await receive()
        body += message.get("body", b"")
        if not message.get("more_body"):
            break
    if scope["path"] == "/fail":
        raise RuntimeError("the app failed on purpose")
    if scope["path"] == "/hold":
        await holding[0].wait()  # the test says when to answer
    if scope["path"] == "/fail-after-start":
        await send({"type": "http.response.start", "status": 200, "headers": []})
        raise RuntimeError("the app failed on purpose, its start sent")
    if scope["path"] == "/stream":
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/plain")],
            }
        )
        await send({"type": "http.response.body", "body": b"one\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"two\n"})
        return
    answer = json.dumps(
        {
            "method": scope["method"],
            "path": scope["path"],
            "query": scope["query_string"].decode(),
            "body": body.decode(),
            "client": list(scope["client"]),
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(answer)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": answer})


seen: list[dict[str, Any]] = []


@asynccontextmanager
async def front(**limits: Any) -> AsyncIterator[int]:
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    port = listening.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(serve_asgi, app, listening, FrontLimits(**limits))
        try:
            yield port
        finally:
            nursery.cancel_scope.cancel()


async def exchange(port: int, data: bytes, *, until_eof: bool = True) -> bytes:
    """Send `data` on a fresh connection; what came back (to the server's close)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(data)
        got = b""
        with trio.fail_after(NET):
            while chunk := await stream.receive_some(65536):
                got += chunk
                if not until_eof and got.count(b"\r\n\r\n"):
                    break
        return got


def answers(raw: bytes) -> list[tuple[bytes, bytes]]:
    """(head, body) of each Content-Length answer in `raw`, in order."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        out.append((head, rest[:length]))
        raw = rest[length:]
    return out


async def test_keep_alive_and_pipelined_requests_are_answered_in_order():
    async with front() as port:
        got = await exchange(
            port,
            b"GET /one?x=1 HTTP/1.1\r\nHost: t\r\n\r\n"
            b"POST /two HTTP/1.1\r\nHost: t\r\nContent-Length: 5\r\n\r\nhello"
            b"GET /three HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n",
        )
    replies = answers(got)
    assert [json.loads(body)["path"] for _, body in replies] == ["/one", "/two", "/three"]
    assert json.loads(replies[0][1])["query"] == "x=1"
    assert json.loads(replies[1][1])["body"] == "hello"
    assert all(
        head.startswith(b"HTTP/1.1 200") and b"\r\ndate: " in head.lower() for head, _ in replies
    )


async def test_httpx_keeps_one_connection_for_many_requests():
    async with (
        front() as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=NET) as client,
    ):
        ports = set()
        for i in range(5):
            reply = await client.post("/echo", content=f"body {i}".encode())
            assert reply.json()["body"] == f"body {i}"
            ports.add(reply.json()["client"][1])
        assert len(ports) == 1  # the same connection each time


async def test_a_chunked_body_and_expect_100_continue():
    async with front() as port:
        got = await exchange(
            port,
            b"POST /c HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n"
            b"Connection: close\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n",
        )
    assert got.startswith(b"HTTP/1.1 100 ")
    final = got[got.index(b"HTTP/1.1 200") :]
    assert json.loads(answers(final)[0][1])["body"] == "hello world"


async def test_a_head_answer_has_no_body():
    async with front() as port:
        got = await exchange(port, b"HEAD /h HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and body == b""


async def test_http_1_0_is_answered_then_closed():
    async with front() as port:
        got = await exchange(port, b"GET /old HTTP/1.0\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 200")
    assert json.loads(got.partition(b"\r\n\r\n")[2])["path"] == "/old"


@pytest.mark.parametrize(
    ("request_bytes", "status"),
    [
        (b"NOT A REQUEST\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: t\r\nBad Header\r\n\r\n", 400),
        (b"GET / HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n", 431),
    ],
)
async def test_a_request_the_front_cannot_read_is_refused_and_closed(request_bytes, status):
    async with front(max_header_bytes=16 * 1024) as port:
        got = await exchange(port, request_bytes)
    head, _, body = got.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status}".encode())
    assert b"connection: close" in head.lower()
    assert json.loads(body)["error"]["status"] == status


async def test_an_app_that_fails_before_answering_is_a_json_500_and_a_close(caplog):
    async with front() as port:
        got = await exchange(
            port,
            b"GET /fail HTTP/1.1\r\nHost: t\r\n\r\nGET /after HTTP/1.1\r\nHost: t\r\n\r\n",
        )
    assert len(answers(got)) == 1  # the request after it is not read
    head, _, rest = got.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 500")
    assert json.loads(answers(got)[0][1])["error"]["code"] == "internal_error"
    assert "the app failed on GET /fail" in caplog.text
    # A start the app sent but no byte of which was written is still a 500.
    async with front() as port:
        got = await exchange(port, b"GET /fail-after-start HTTP/1.1\r\nHost: t\r\n\r\n")
    assert got.startswith(b"HTTP/1.1 500")


async def test_a_streamed_answer_arrives_whole_in_its_bursts():
    async with (
        front() as port,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=NET) as client,
    ):
        async with client.stream("GET", "/stream") as reply:
            assert reply.headers["transfer-encoding"] == "chunked"
            assert [line async for line in reply.aiter_lines()] == ["one", "two"]


async def test_a_chunked_body_is_written_by_the_front_and_a_counted_one_by_h11(monkeypatch):
    """The chunks of a streamed answer are framed by the front itself, byte
    for byte as h11 frames them (h11 is not asked: an SSE burst's write is
    mostly h11's event round otherwise); a Content-Length body still goes
    through h11, which counts it against the length."""
    import h11

    sent: list[str] = []
    h11_send = h11.Connection.send

    def counted(self: h11.Connection, event: Any) -> bytes | None:
        sent.append(type(event).__name__)
        return h11_send(self, event)

    monkeypatch.setattr(h11.Connection, "send", counted)
    async with front() as port:
        got = await exchange(port, b"GET /stream HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert sent == ["Response", "EndOfMessage"]
        head, _, body = got.partition(b"\r\n\r\n")
        assert b"transfer-encoding: chunked" in head.lower()
        reference = h11.Connection(h11.SERVER)
        reference.receive_data(b"GET / HTTP/1.1\r\nHost: t\r\n\r\n")
        reference.next_event(), reference.next_event()
        h11_send(reference, h11.Response(status_code=200, headers=[]))
        assert body == b"".join(
            h11_send(reference, event) or b""
            for event in (h11.Data(data=b"one\n"), h11.Data(data=b"two\n"), h11.EndOfMessage())
        )
        sent.clear()
        got = await exchange(port, b"GET /x HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert sent == ["Response", "Data", "EndOfMessage"]
        assert json.loads(got.partition(b"\r\n\r\n")[2])["path"] == "/x"


async def test_an_idle_connection_is_closed_after_keep_alive(autojump_clock):
    async with front(keep_alive_seconds=5) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"GET /x HTTP/1.1\r\nHost: t\r\n")  # headers never end
            began = trio.current_time()
            assert await stream.receive_some(1024) == b""
            assert 5 <= trio.current_time() - began < 6


@pytest.mark.parametrize(
    ("after", "paths"),
    [
        (b"", ["/hold"]),
        (b"GET /x HTTP/1.1\r\nHost: t\r\n", ["/hold"]),
        (b"GET /x", ["/hold"]),
        (b"GET /next HTTP/1.1\r\nHost: t\r\n\r\n", ["/hold", "/next"]),
    ],
)
async def test_the_idle_bound_holds_for_bytes_already_there(autojump_clock, after, paths):
    """The next request's bytes already in the socket as an answer ends are
    read without the idle bound's scope (there is no wait to bound); a head
    that is not all there is still bounded: closed after keep-alive, counted
    from then. (A complete head read at once is served, then the idle bound
    closes the connection as after any answer.)"""
    holding[:] = [trio.Event()]
    async with front(keep_alive_seconds=5) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"GET /hold HTTP/1.1\r\nHost: t\r\n\r\n")
            await stream.send_all(after)
            await trio.testing.wait_all_tasks_blocked()  # the bytes wait in the socket
            holding[0].set()
            began = trio.current_time()
            got = b""
            with trio.fail_after(60):
                while chunk := await stream.receive_some(65536):
                    got += chunk
            assert 5 <= trio.current_time() - began < 6
    assert [json.loads(body)["path"] for _, body in answers(got)] == paths


async def test_a_kept_connection_idle_after_its_answer_is_closed_quietly(autojump_clock, caplog):
    """Idle after a request was answered: closed after keep-alive, its one
    answer and nothing else written, no failure logged (the loop once read
    the request it no longer had)."""
    async with front(keep_alive_seconds=5) as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(b"GET /once HTTP/1.1\r\nHost: t\r\n\r\n")
            got = b""
            while chunk := await stream.receive_some(65536):
                got += chunk
            assert [json.loads(body)["path"] for _, body in answers(got)] == ["/once"]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]


async def test_websocket_messages_pings_and_close_codes():
    seen.clear()
    async with front() as port:
        async with open_websocket_url(f"ws://127.0.0.1:{port}/echo") as ws:
            await ws.send_message("hello")
            assert await ws.get_message() == "hello"
            await ws.send_message(b"\x00\x01")
            assert await ws.get_message() == b"\x00\x01"
            await ws.ping(b"are you there")  # answered by the front: ping returns on the pong
        await trio.testing.wait_all_tasks_blocked()
        assert seen == [{"type": "websocket.disconnect", "code": 1000}]

        async with open_websocket_url(f"ws://127.0.0.1:{port}/echo") as ws:
            await ws.send_message("close 4001")
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
            assert closed.value.reason.code == 4001


async def test_a_websocket_message_over_the_bound_is_refused_1009():
    async with front(max_message_bytes=1000) as port:
        async with open_websocket_url(f"ws://127.0.0.1:{port}/echo") as ws:
            await ws.send_message("a" * 1000)
            assert len(await ws.get_message()) == 1000
            await ws.send_message("b" * 1001)
            with pytest.raises(ConnectionClosed) as closed:
                await ws.get_message()
            assert closed.value.reason.code == 1009


async def test_a_websocket_handshake_refused_by_the_app_or_malformed():
    async with front() as port:
        assert (await refused_handshake(f"ws://127.0.0.1:{port}/refuse")).status_code == 403
        got = await exchange(
            port,
            b"GET /echo HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
            b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 8\r\n\r\n",
        )
        assert got.startswith(b"HTTP/1.1 400")
        assert "version 13" in json.loads(got.partition(b"\r\n\r\n")[2])["error"]["message"]


async def test_funduq_on_the_front_keeps_a_connection_across_door_requests(tmp_path):
    """The server itself: healthz twice and an unknown route on one kept
    connection, then a 413 that closes it after its answer."""
    async with running_server(tmp_path, max_body_bytes=1000) as info:
        got = await exchange(
            info.port,
            b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"
            b"GET /nowhere HTTP/1.1\r\nHost: t\r\n\r\n"
            b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n"
            b"POST /agui/0123456789abcdef/echo HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
            b"Content-Length: 5000\r\n\r\n" + b"x" * 5000,
        )
        statuses = [head.split(b" ")[1] for head, _ in answers(got)]
        assert statuses == [b"200", b"404", b"200", b"413"]


async def test_connections_past_the_bound_are_answered_503_and_served_again_once_one_ends():
    """Two connections held open take the two places; a third is answered a
    JSON 503 before it says anything, and its request (sent or not) changes
    nothing; once a held one ends, a new connection is served."""
    counts = Counts()
    listening = socket.socket()
    listening.bind(("127.0.0.1", 0))
    port = listening.getsockname()[1]
    async with trio.open_nursery() as nursery:
        await nursery.start(
            partial(serve_asgi, app, listening, FrontLimits(max_connections=2), counts=counts)
        )
        first = await trio.open_tcp_stream("127.0.0.1", port)
        second = await trio.open_tcp_stream("127.0.0.1", port)
        await settled(counts, 2)

        refused = await exchange(
            port, b"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: 2\r\n\r\nhi"
        )
        head, _, body = refused.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 ")
        assert b"retry-after: 1" in head.lower()
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        assert (await exchange(port, b""))[:12] == b"HTTP/1.1 503"  # said before any request
        assert (counts.connections_open, counts.connections_refused) == (2, 2)

        # The held ones are served as before.
        await second.send_all(b"GET /still HTTP/1.1\r\nHost: t\r\n\r\n")
        with trio.fail_after(NET):
            assert b'"/still"' in await second.receive_some(65536)

        await first.aclose()
        await settled(counts, 1)
        got = await exchange(port, b"GET /again HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n")
        assert got.startswith(b"HTTP/1.1 200") and b'"/again"' in got
        await second.aclose()
        nursery.cancel_scope.cancel()


class Counts:
    connections_open = 0
    connections_refused = 0


async def settled(counts: Counts, open_now: int) -> None:
    """Until the server has taken (or let go of) connections: the kernel
    hands them over when the server's loop gets to them."""
    with trio.fail_after(NET):
        while counts.connections_open != open_now:
            await trio.sleep(0.001)


async def test_funduq_counts_its_connections_and_refusals_in_metrics(tmp_path):
    async with (
        running_server(tmp_path, max_connections=2) as info,
        httpx.AsyncClient(base_url=info.url, timeout=NET) as client,
    ):
        held = await trio.open_tcp_stream("127.0.0.1", info.port)
        first = (await client.get("/metrics")).text
        assert "funduq_connections_open 2\n" in first
        assert "funduq_connections_refused_total 0\n" in first
        refused = await exchange(info.port, b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
        assert refused.startswith(b"HTTP/1.1 503")
        # A provider's link attempt past the bound: its handshake's answer.
        assert (await refused_handshake(info.provider_url)).status_code == 503
        again = (await client.get("/metrics")).text  # on the kept connection
        assert "funduq_connections_refused_total 2\n" in again
        await held.aclose()


def _client_frame(opcode: int, payload: bytes, key: bytes = b"\x0f\xf0\x55\xaa") -> bytes:
    n = len(payload)
    length = bytes((0x80 | n,)) if n < 126 else bytes((0x80 | 126,)) + n.to_bytes(2, "big")
    masked = bytes(b ^ key[i % 4] for i, b in enumerate(payload))
    return bytes((0x80 | opcode,)) + length + key + masked


def _server_frames(raw: bytes) -> list[tuple[int, bytes]]:
    out = []
    while raw:
        opcode, n, head = raw[0] & 0x0F, raw[1] & 0x7F, 2
        if n == 126:
            n, head = int.from_bytes(raw[2:4], "big"), 4
        out.append((opcode, raw[head : head + n]))
        raw = raw[head + n :]
    return out


async def test_websocket_frames_in_one_write_in_pieces_and_around_a_ping():
    """Hand-written client frames over a real socket: many in one write (the
    front's own read of the common frame), one cut across writes, a ping
    between (wsproto's), then bytes that are not UTF-8 (close 1007)."""
    seen.clear()
    async with front() as port:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(
                b"GET /echo HTTP/1.1\r\nHost: t\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
                + _client_frame(1, b"with the handshake")
            )
            got = b""
            with trio.fail_after(NET):
                while b"\r\n\r\n" not in got:
                    got += await stream.receive_some(65536)
            head, _, got = got.partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 101")
            many = [_client_frame(1, f"event {i}".encode()) for i in range(20)]
            long = _client_frame(1, "é".encode() * 200)
            await stream.send_all(b"".join(many) + long[:5])
            await stream.send_all(long[5:300])
            await stream.send_all(
                long[300:] + _client_frame(9, b"ping?") + _client_frame(2, b"\x00")
            )
            with trio.fail_after(NET):  # every echo back before the bad frame
                while len(_server_frames(got)) < 24 or _server_frames(got)[-1][0] != 2:
                    got += await stream.receive_some(65536)
            await stream.send_all(
                _client_frame(1, b"\xc3\x28 not utf-8") + _client_frame(1, b"never")
            )
            with trio.fail_after(NET):
                while chunk := await stream.receive_some(65536):
                    got += chunk
    frames = _server_frames(got)
    assert frames[0] == (1, b"with the handshake")
    assert frames[1:21] == [(1, f"event {i}".encode()) for i in range(20)]
    # A ping is answered as it is parsed, before the app takes the messages
    # that one read held (the long one's end among them).
    assert frames[21:24] == [(0xA, b"ping?"), (1, "é".encode() * 200), (2, b"\x00")]
    assert frames[24][0] == 8 and int.from_bytes(frames[24][1][:2], "big") == 1007
    assert len(frames) == 25
    await trio.testing.wait_all_tasks_blocked()
    assert seen == [{"type": "websocket.disconnect", "code": 1007}]
