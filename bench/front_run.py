"""What a run costs funduq's front (`funduq_trio/front`) and the doors' SSE
writer (`web/sse.py` `SseStream`), in one trio process over loopback sockets,
for counting instructions (callgrind) rather than timing.

Two parts, each a loop of "runs" on one keep-alive connection:

- ``http``: a caller's run POST (the lean client's head, a ~250-byte JSON
  body), read by the front, answered by a plain ASGI app as the doors answer
  a stream (`web/asgi_doors.py`: the SSE head, then `SseStream` served on
  the connection's task with a `Quiet` and the front's hang-up extension):
  the head alone, then the run's 14 events in ``--bursts`` chunks, then the
  end. The client reads the answer to its end before the next POST.
- ``ws``: a raw provider's run on an open websocket: one offer written to it
  (`send_now`, as `web/provider_socket.py` writes), then its 14 messages
  (an ``ok``, 12 reports, a ``finish``) as masked client frames, one socket
  write each, the client waiting for the app to have received each one (so
  each message is one socket read, as when the server keeps up).

The client's own work is the same in every tree; count two sizes and
subtract to get the front's instructions per run::

    valgrind --tool=callgrind --callgrind-out-file=/tmp/x.%p \\
        .venv/bin/python bench/front_run.py --part http --runs 200
    (and --runs 400; (Ir(400) - Ir(200)) / 200 = instructions per run)

Without valgrind it prints microseconds per run (noisy on a shared host).
Each tree by ``PYTHONPATH=<tree>``; it prints which tree it measured.
"""

from __future__ import annotations

import argparse
import json
import math
import socket
import sys
import time
from typing import Any

import trio

import funduq_trio
from funduq_trio.broker.quiet import Quiet
from funduq_trio.front import FrontLimits, serve_asgi
from funduq_trio.front.http import HANGUP_EXTENSION
from funduq_trio.web.sse import SseStream

EVENTS = 14
SSE_HEAD = [
    (b"content-type", b"text/event-stream"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


def a2a_event(i: int) -> dict[str, Any]:
    """An A2A streaming result of about the doors' size."""
    return {
        "jsonrpc": "2.0",
        "id": "req-1",
        "result": {
            "kind": "artifact-update",
            "taskId": "0b9f1c2e-6a4d-4f7e-9a51-3c2d8e7f6a10",
            "contextId": "5e1d2c3b-4a59-4687-b7c8-d9e0f1a2b3c4",
            "artifact": {
                "artifactId": "msg-0b9f1c2e",
                "parts": [{"kind": "text", "text": f"word{i} "}],
            },
            "append": True,
            "lastChunk": False,
        },
    }


def request_bytes(port: int) -> bytes:
    body = json.dumps(
        {
            "jsonrpc": "2.0",
            "id": "req-1",
            "method": "message/stream",
            "params": {
                "message": {
                    "role": "user",
                    "parts": [{"kind": "text", "text": "hello there"}],
                    "messageId": "m-5e1d2c3b-4a59-4687-b7c8-d9e0f1a2b3c4",
                    "kind": "message",
                }
            },
        }
    ).encode()
    # The lean client's head (bench/harness.py RawHTTP, h11's writer).
    head = (
        b"POST /a2a/p/a HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-length: %d\r\n"
        b"content-type: application/json\r\n\r\n" % (port, len(body))
    )
    return head + body


def make_app(bursts: int, got: list[Any]) -> Any:
    events = [a2a_event(i) for i in range(EVENTS)]
    size = math.ceil(EVENTS / bursts)
    chunks = [events[i : i + size] for i in range(0, EVENTS, size)]
    offer = json.dumps({"kind": "offer", "id": "o-1", "run_id": "r" * 32, "x": "y" * 80})

    async def source() -> Any:
        yield []  # the first wait ends at once: the head goes alone
        for burst in chunks:
            yield burst

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()
            await send({"type": "lifespan.startup.complete"})
            await trio.sleep_forever()
        if scope["type"] == "websocket":
            await receive()
            await send({"type": "websocket.accept"})
            send_now = scope["extensions"]["funduq.websocket.send_now"]
            while True:
                message = await receive()
                if message["type"] != "websocket.receive":
                    return
                text = message["text"]
                if text == "start":
                    assert send_now({"type": "websocket.send", "text": offer}) == "sent"
                    continue
                got[0] += 1
                got[1].unpark()
            return
        # An HTTP run POST, as web/asgi_doors.py reads and answers it.
        body = []
        while True:
            message = await receive()
            body.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        json.loads(b"".join(body))
        await send({"type": "http.response.start", "status": 200, "headers": SSE_HEAD})
        quiet = Quiet()
        assert HANGUP_EXTENSION in scope["extensions"]
        await SseStream(source(), 15.0).serve(receive, send, quiet, scope)

    return app


def masked(text: str, key: bytes = b"\x37\xfa\x21\x3d") -> bytes:
    payload = text.encode()
    n = len(payload)
    length = bytes((0x80 | n,)) if n < 126 else bytes((0x80 | 126,)) + n.to_bytes(2, "big")
    mask = (key * (n // 4 + 1))[:n]
    data = (int.from_bytes(payload, "big") ^ int.from_bytes(mask, "big")).to_bytes(n, "big")
    return bytes((0x81,)) + length + key + data


def provider_frames() -> list[bytes]:
    run = "r" * 32
    texts = ['{"kind":"ok","id":"o-1","verdict":"accepted","reason":null,"payload":null}']
    for seq in range(1, 13):
        event = {"type": "TEXT_MESSAGE_CONTENT", "messageId": "msg-1", "delta": f"word{seq} "}
        texts.append(json.dumps({"kind": "report", "run_id": run, "seq": seq, "event": event}))
    texts.append(json.dumps({"kind": "finish", "run_id": run}))
    return [masked(t) for t in texts]


async def recv_until(sock: trio.socket.SocketType, buffer: bytes, end: bytes) -> bytes:
    while not buffer.endswith(end):
        data = await sock.recv(65536)
        if not data:
            raise RuntimeError("the server closed")
        buffer += data
    return buffer


async def http_runs(port: int, runs: int) -> None:
    request = request_bytes(port)
    sock = trio.socket.socket()
    await sock.connect(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(runs):
        await sock.send(request)
        answer = await recv_until(sock, b"", b"\r\n0\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 200"), answer[:100]
    sock.close()


async def ws_runs(port: int, runs: int, got: list[Any]) -> None:
    sock = trio.socket.socket()
    await sock.connect(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    await sock.send(
        b"GET /link HTTP/1.1\r\nhost: 127.0.0.1\r\nupgrade: websocket\r\n"
        b"connection: Upgrade\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"sec-websocket-version: 13\r\n\r\n"
    )
    await recv_until(sock, b"", b"\r\n\r\n")
    start = masked("start")
    frames = provider_frames()
    for _ in range(runs):
        await sock.send(start)
        offer = await sock.recv(65536)
        assert offer[0] == 0x81, offer[:10]
        for frame in frames:
            before = got[0]
            await sock.send(frame)
            while got[0] == before:
                await got[1].park()
    sock.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["http", "ws"], default="http")
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--bursts", type=int, default=2, help="SSE chunks a run (http)")
    args = parser.parse_args()
    print(f"tree: {funduq_trio.__file__}", file=sys.stderr)
    got: list[Any] = [0, trio.lowlevel.ParkingLot()]

    async def run() -> float:
        listening = socket.socket()
        listening.bind(("127.0.0.1", 0))
        port = listening.getsockname()[1]
        async with trio.open_nursery() as nursery:
            await nursery.start(serve_asgi, make_app(args.bursts, got), listening, FrontLimits())
            began = time.perf_counter()
            if args.part == "http":
                await http_runs(port, args.runs)
            else:
                await ws_runs(port, args.runs, got)
            took = time.perf_counter() - began
            nursery.cancel_scope.cancel()
        return took

    took = trio.run(run)
    print(f"{args.part}: {args.runs} runs, {took / args.runs * 1e6:.1f} us a run")


if __name__ == "__main__":
    main()
