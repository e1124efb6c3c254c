"""The callers' side of a run, whole, in one trio process: funduq's front
(`front/serving.py` `serve_asgi`, with its hang-up watch) serving the real
app (`web/app.py`: `web/asgi_doors.py` in front of quart) and the real
`Funduq` (SQLite on disk), one provider linked in-process (the front's
`WebSocket` over a memory wire, as bench/frame_path.py and
bench/door_posts.py do), and callers on keep-alive loopback connections
asking one door each:

- ``a2a``: a blocking 1.0 `SendMessage` (e2e's A2A half), its answer the
  completed Task (a Content-Length body);
- ``stream``: a 1.0 `SendStreamingMessage`, its answer an SSE stream read to
  its end;
- ``agui``: a RunAgentInput POST (e2e's AG-UI half) and its SSE stream.

`--count` installs a trio Instrument and a few counting patches, and prints
per run: task steps by task (the callers' own tasks apart), cancel scopes
entered (by the function that entered them), contextlib context managers
entered (by generator), `trio.Event`s made, the record's reads (each a
worker thread's job) by caller, OS threads started, and the net change in
GC-tracked objects per step. Without it, the CPU a run (noisy on a shared
host). For instructions that do not move with the host, run it under
callgrind at two sizes and subtract (the callers' own work is in the
figure, the same in every tree)::

    valgrind --tool=callgrind --callgrind-out-file=/tmp/x.%p \\
        .venv/bin/python bench/caller_runs.py --door a2a --runs 100
    (and --runs 300; (Ir(300) - Ir(100)) / 200 = instructions a run)

Each tree by ``PYTHONPATH=<tree>``; it prints which tree it measured.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import trio
from frame_path import Wire, provider

from funduq_trio.broker.funduq import Funduq
from funduq_trio.config import Settings
from funduq_trio.front import serve_asgi
from funduq_trio.server import front_limits
from funduq_trio.web.app import create_app
from funduq_trio.web.provider_socket import AsgiWebsocket, ProviderSocket

TEXT = "bench thread 00017 utterance 00042: hello there, echo me".ljust(64, ".")


def a2a_body(request_id: int, message_id: str, context: str | None, method: str) -> bytes:
    message: dict[str, Any] = {
        "messageId": message_id,
        "role": "ROLE_USER",
        "parts": [{"text": TEXT}],
    }
    if context is not None:
        message["contextId"] = context
    return json.dumps(
        {"jsonrpc": "2.0", "id": request_id, "method": method, "params": {"message": message}}
    ).encode()


def agui_body(thread_id: str, message_id: str) -> bytes:
    return json.dumps(
        {
            "threadId": thread_id,
            "runId": "caller-run",
            "state": None,
            "messages": [{"id": message_id, "role": "user", "content": TEXT}],
            "tools": [],
            "context": [],
            "forwardedProps": None,
        }
    ).encode()


def request(port: int, path: str, body: bytes, a2a: bool) -> bytes:
    # The lean client's head (bench/harness.py RawHTTP), head and body in one write.
    head = b"POST %s HTTP/1.1\r\nhost: 127.0.0.1:%d\r\ncontent-type: application/json\r\n" % (
        path.encode(),
        port,
    )
    if a2a:
        head += b"a2a-version: 1.0\r\n"
    return head + b"content-length: %d\r\n\r\n" % len(body) + body


async def answer(sock: trio.socket.SocketType) -> bytes:
    """One whole answer: a Content-Length body, or a chunked one to its end."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += await _recv(sock)
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    lower = head.lower()
    if b"content-length:" in lower:
        size = int(lower.split(b"content-length:")[1].split(b"\r\n")[0])
        while len(rest) < size:
            rest += await _recv(sock)
        return rest
    while not rest.endswith(b"0\r\n\r\n"):
        rest += await _recv(sock)
    return rest


async def _recv(sock: trio.socket.SocketType) -> bytes:
    data = await sock.recv(65536)
    if not data:
        raise RuntimeError("the server closed")
    return data


class Counts(trio.abc.Instrument):
    """Task steps by task name, and what the patches below count."""

    def __init__(self) -> None:
        self.steps: collections.Counter[str] = collections.Counter()
        self.scopes: collections.Counter[str] = collections.Counter()
        self.cms: collections.Counter[str] = collections.Counter()
        self.events: collections.Counter[str] = collections.Counter()
        #: OS threads started (trio's worker threads: a record read or the
        #: checkpoint found no idle one), and the record's reads by caller.
        self.threads: collections.Counter[str] = collections.Counter()
        self.reads: collections.Counter[str] = collections.Counter()
        self.on = False
        self.parks: collections.Counter[str] | None = collections.Counter()

    def before_task_step(self, task: Any) -> None:
        name = task.name
        if "caller" in name:
            name = "(callers)"
        elif name.startswith("thread "):
            name = "thread <id>"
        elif name.startswith("run "):
            name = "run <id>"
        self.steps[name] += 1

    def after_task_step(self, task: Any) -> None:
        if self.parks is None or "serve" not in task.name:
            return
        # Where the connection's task parked: its innermost funduq frames.
        where = [
            f"{frame.f_code.co_name}:{lineno}"
            for frame, lineno in task.iter_await_frames()
            if "funduq_trio" in frame.f_code.co_filename
        ]
        self.parks[" < ".join(reversed(where[-3:]))] += 1


def _where(depth: int = 2) -> str:
    """The first caller outside trio and contextlib, and its caller."""
    frame: Any = sys._getframe(depth)
    names = []
    while frame is not None and len(names) < 2:
        name = frame.f_code.co_filename
        if "/trio/" not in name and "contextlib" not in name:
            names.append(f"{name.rsplit('/', 1)[-1]}:{frame.f_code.co_name}")
        frame = frame.f_back
    return " < ".join(names)


def patch(counts: Counts) -> None:
    scope_enter = trio.CancelScope.__enter__

    def enter(self: Any) -> Any:
        if counts.on:
            counts.scopes[_where()] += 1
        return scope_enter(self)

    trio.CancelScope.__enter__ = enter  # type: ignore[method-assign]

    cm_enter = contextlib._GeneratorContextManager.__enter__

    def cm(self: Any) -> Any:
        if counts.on:
            code = self.gen.gi_code
            counts.cms[f"{code.co_filename.rsplit('/', 2)[-1]}:{code.co_name}"] += 1
        return cm_enter(self)

    contextlib._GeneratorContextManager.__enter__ = cm  # type: ignore[method-assign]

    from trio._threads import to_thread_run_sync

    def to_thread(*a: Any, **k: Any) -> Any:
        if counts.on:
            counts.events["to_thread: " + _where()] += 1
        return to_thread_run_sync(*a, **k)

    trio.to_thread.run_sync = to_thread  # type: ignore[assignment]

    event_init = trio.Event.__init__

    def event(self: Any, *a: Any, **k: Any) -> None:
        if counts.on:
            counts.events[_where()] += 1
        event_init(self, *a, **k)

    trio.Event.__init__ = event  # type: ignore[method-assign]

    thread_start = threading.Thread.start

    def start(self: Any) -> None:
        if counts.on:
            counts.threads[self.name.rstrip("0123456789")] += 1
        thread_start(self)

    threading.Thread.start = start  # type: ignore[method-assign]

    from funduq_trio.broker.store import SqlStore

    store_read = SqlStore.read

    async def read(self: Any, fn: Any) -> Any:
        if counts.on:
            counts.reads[_where()] += 1
        return await store_read(self, fn)

    SqlStore.read = read  # type: ignore[method-assign]


async def load(data_dir: Path, args: argparse.Namespace, counts: Counts | None) -> dict[str, Any]:
    from wsproto.connection import Connection, ConnectionType

    from funduq_trio.front.websocket import WebSocket

    # An offer's answer may take long under callgrind on a busy host: not
    # withdrawn for that (the deadline's value costs nothing while it holds).
    settings = Settings(data_dir=data_dir, deliver_timeout_seconds=600.0)
    async with Funduq(settings) as funduq:
        app = create_app(funduq).asgi_app
        wire = Wire()
        wire.ready = trio.Event()  # type: ignore[attr-defined]
        front = WebSocket(wire, b"key")  # type: ignore[arg-type]
        front.ws = Connection(ConnectionType.SERVER)
        front.state = "open"

        async def ws_send(message: dict[str, Any]) -> None:
            if message["type"] != "websocket.accept":
                await front.send(message)

        link = ProviderSocket(AsgiWebsocket(front.receive, ws_send, lambda: None), funduq)
        listening = socket.socket()
        listening.bind(("127.0.0.1", 0))
        port = listening.getsockname()[1]
        done = [0]
        deltas = 8

        async def caller(thread: int, count: int) -> None:
            key = wire.key  # type: ignore[attr-defined]
            sock = trio.socket.socket()
            await sock.connect(("127.0.0.1", port))
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            context: str | None = None
            agui_thread = f"bench-caller-thread-{thread}"  # then the one funduq gave (as e2e)
            for index in range(count):
                mid = f"m-{thread}-{index}"
                if args.door == "agui":
                    body = agui_body(agui_thread, mid)
                    await sock.send(request(port, f"/agui/{key}/echo", body, False))
                    frames = [
                        line for line in (await answer(sock)).split(b"\n") if b"data:" in line
                    ]
                    assert len(frames) == deltas + 4, frames
                    agui_thread = json.loads(frames[0].split(b"data:", 1)[1])["threadId"]
                elif args.door == "a2a":
                    body = a2a_body(index, mid, context, "SendMessage")
                    await sock.send(request(port, f"/a2a/{key}/echo", body, True))
                    task = json.loads(await answer(sock))["result"]["task"]
                    assert task["status"]["state"] == "TASK_STATE_COMPLETED", task
                    context = task["contextId"]
                else:
                    body = a2a_body(index, mid, context, "SendStreamingMessage")
                    await sock.send(request(port, f"/a2a/{key}/echo", body, True))
                    got = await answer(sock)
                    assert b"TASK_STATE_COMPLETED" in got, got[-300:]
                    if context is None:
                        line = next(x for x in got.split(b"\n") if b"data:" in x)
                        context = json.loads(line.split(b"data:", 1)[1])["result"]["task"][
                            "contextId"
                        ]
                done[0] += 1
            sock.close()

        async with trio.open_nursery() as nursery:
            await nursery.start(serve_asgi, app, listening, front_limits(settings))
            nursery.start_soon(link.run)
            nursery.start_soon(provider, wire, args.shape, deltas, funduq.identity)
            await wire.ready.wait()  # type: ignore[attr-defined]
            if counts is not None:
                trio.lowlevel.add_instrument(counts)
                counts.on = True
            cpu = time.process_time()
            async with trio.open_nursery() as callers:
                for i in range(args.threads):
                    n = args.runs // args.threads + (i < args.runs % args.threads)
                    callers.start_soon(caller, i, n, name=f"caller {i}")
            cpu = time.process_time() - cpu
            if counts is not None:
                counts.on = False
                trio.lowlevel.remove_instrument(counts)
            nursery.cancel_scope.cancel()
    assert done[0] == args.runs
    return {"cpu_us_run": cpu / args.runs * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--door", choices=("a2a", "stream", "agui"), default="a2a")
    parser.add_argument("--runs", type=int, default=300)
    parser.add_argument("--threads", type=int, default=10)
    parser.add_argument("--shape", choices=("raw", "read", "batch"), default="batch")
    parser.add_argument("--count", action="store_true")
    args = parser.parse_args()
    import funduq_trio

    print(f"tree: {Path(funduq_trio.__file__).parent}", file=sys.stderr)
    counts = None
    if args.count:
        counts = Counts()
        patch(counts)
    with tempfile.TemporaryDirectory() as tmp:
        result = trio.run(load, Path(tmp), args, counts)
    runs = args.runs
    print(
        f"door {args.door}, shape {args.shape}: {runs} runs, "
        f"CPU {result['cpu_us_run']:.0f} us a run"
    )
    if counts is not None:

        def show(title: str, counter: collections.Counter[str]) -> None:
            total = sum(counter.values())
            print(f"  {title}: {total / runs:.2f} a run ({total} in all)")
            for k, v in counter.most_common(14):
                print(f"      {v / runs:6.2f}  {k}")

        show("task steps", counts.steps)
        show("cancel scopes entered", counts.scopes)
        show("contextlib CMs entered", counts.cms)
        show("trio.Events made", counts.events)
        show("record reads (`SqlStore.read`, each through a worker thread)", counts.reads)
        show("OS threads started", counts.threads)
        assert counts.parks is not None
        show("the connection task parked at", counts.parks)


if __name__ == "__main__":
    main()
