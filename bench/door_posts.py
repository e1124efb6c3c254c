"""The doors' run POSTs end to end in one process, as e2e's callers ask them:
the app's ASGI callable (`web/asgi_doors.py` in front of quart) with the
real `Funduq` (SQLite on disk) and one provider linked in-process (the
front's `WebSocket` over a memory wire, as bench/frame_path.py does; SDK
batches, or one frame a socket read with `--shape raw`).

Half the threads ask the A2A door (a blocking 1.0 `SendMessage` whose
answer is the completed Task), half the AG-UI door (a RunAgentInput POST
whose answer is the run's SSE stream, read to its end); `--door` picks one.
Each request is one ASGI call as funduq's front makes it (the scope with
the `funduq.hangup` extension, a `receive` that gives the body, a `send`
that keeps what is written); the answers are checked (a completed Task
with the echo, every AG-UI event). No sockets, no HTTP parser: what is
left of a run beyond the broker and the provider link is the doors' work.

    python bench/door_posts.py [--runs 600] [--threads 20] [--door mix]

Instructions per run, deterministic whatever the host's load (callgrind at
two sizes, subtracted; bench/README.md):

    valgrind --tool=callgrind python bench/door_posts.py --runs 100 --rounds 1
    valgrind --tool=callgrind python bench/door_posts.py --runs 500 --rounds 1

`--profile FILE` writes a cProfile of one round (the doors' functions by
name; cProfile inflates Python calls, read shares, not µs).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import tempfile
import time
from pathlib import Path
from typing import Any

import trio
from frame_path import Wire, provider

from funduq_trio.broker.funduq import Funduq
from funduq_trio.config import Settings
from funduq_trio.web.app import create_app
from funduq_trio.web.provider_socket import AsgiWebsocket, ProviderSocket

TEXT = "bench thread 00017 utterance 00042: hello there, echo me".ljust(64, ".")


def a2a_body(request_id: int, text: str, message_id: str, context: str | None) -> bytes:
    message: dict[str, Any] = {
        "messageId": message_id,
        "role": "ROLE_USER",
        "parts": [{"text": text}],
    }
    if context is not None:
        message["contextId"] = context
    body = {
        "jsonrpc": "2.0",
        "id": request_id,
        "method": "SendMessage",
        "params": {"message": message},
    }
    return json.dumps(body).encode()


def agui_body(thread_id: str, text: str, message_id: str) -> bytes:
    return json.dumps(
        {
            "threadId": thread_id,
            "runId": "caller-run",
            "state": None,
            "messages": [{"id": message_id, "role": "user", "content": text}],
            "tools": [],
            "context": [],
            "forwardedProps": None,
        }
    ).encode()


async def post(app: Any, path: str, body: bytes, headers: list[tuple[bytes, bytes]]) -> list[Any]:
    """One POST through the app as the front asks it; the ASGI messages sent."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"127.0.0.1:8000"),
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(body)),
            *headers,
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
        "extensions": {"funduq.hangup": lambda callback: None},
    }
    sent: list[Any] = []
    given = False

    async def receive() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        await trio.sleep_forever()
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)
        await trio.lowlevel.checkpoint()  # a socket write is a checkpoint too

    await app(scope, receive, send)
    return sent


def body_of(sent: list[Any]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


async def load(data_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    deltas = args.deltas
    async with Funduq(Settings(data_dir=data_dir)) as funduq:
        app = create_app(funduq).asgi_app
        wire = Wire()
        wire.ready = trio.Event()  # type: ignore[attr-defined]
        from wsproto.connection import Connection, ConnectionType

        from funduq_trio.front.websocket import WebSocket

        front = WebSocket(wire, b"key")  # type: ignore[arg-type]
        front.ws = Connection(ConnectionType.SERVER)
        front.state = "open"

        async def ws_send(message: dict[str, Any]) -> None:
            if message["type"] != "websocket.accept":
                await front.send(message)

        link = ProviderSocket(AsgiWebsocket(front.receive, ws_send, lambda: None), funduq)
        done = [0]

        async def caller(thread: int, count: int) -> None:
            door = args.door if args.door != "mix" else ("a2a" if thread % 2 == 0 else "agui")
            key = wire.key  # type: ignore[attr-defined]
            context: str | None = None
            agui_thread = f"bench-thread-{thread:05d}"
            for index in range(count):
                message_id = f"m-{thread}-{index}"
                if door == "a2a":
                    sent = await post(
                        app,
                        f"/a2a/{key}/echo",
                        a2a_body(index, TEXT, message_id, context),
                        [(b"a2a-version", b"1.0")],
                    )
                    task = json.loads(body_of(sent))["result"]["task"]
                    assert task["status"]["state"] == "TASK_STATE_COMPLETED", task
                    context = task["contextId"]
                else:
                    sent = await post(
                        app, f"/agui/{key}/echo", agui_body(agui_thread, TEXT, message_id), []
                    )
                    frames = [
                        line for line in body_of(sent).split(b"\n") if line.startswith(b"data:")
                    ]
                    assert len(frames) == deltas + 4, frames
                    assert json.loads(frames[-1][5:])["type"] == "RUN_FINISHED"
                done[0] += 1

        async with trio.open_nursery() as nursery:
            nursery.start_soon(link.run)
            nursery.start_soon(provider, wire, args.shape, deltas, funduq.identity)
            await wire.ready.wait()  # type: ignore[attr-defined]
            profiler = cProfile.Profile() if args.profile else None
            cpu = time.process_time()
            if profiler is not None:
                profiler.enable()
            async with trio.open_nursery() as callers:
                for i in range(args.threads):
                    callers.start_soon(
                        caller, i, args.runs // args.threads + (i < args.runs % args.threads)
                    )
            if profiler is not None:
                profiler.disable()
                profiler.dump_stats(args.profile)
            cpu = time.process_time() - cpu
            nursery.cancel_scope.cancel()
    assert done[0] == args.runs
    return {"cpu_us_run": cpu / args.runs * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=600)
    parser.add_argument("--threads", type=int, default=20)
    parser.add_argument("--deltas", type=int, default=8)
    parser.add_argument("--door", choices=("mix", "a2a", "agui"), default="mix")
    parser.add_argument("--shape", choices=("raw", "read", "batch"), default="batch")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", default="", help="a cProfile of one round to this file")
    args = parser.parse_args()
    import funduq_trio

    print(f"measuring {Path(funduq_trio.__file__).parent}")
    results = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as tmp:
            results.append(trio.run(load, Path(tmp), args))
        args.profile = ""
    best = min(r["cpu_us_run"] for r in results)
    print(
        f"door {args.door}, shape {args.shape}: {args.runs} runs over {args.threads} threads; "
        f"CPU a run {best:.1f} us (best of {args.rounds}; all: "
        + ", ".join(f"{r['cpu_us_run']:.0f}" for r in results)
        + ")"
    )
    if args.profile:
        pstats.Stats(args.profile).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
