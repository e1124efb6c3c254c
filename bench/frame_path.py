"""In-process cost of a provider's frames along the whole per-frame path:
masked websocket frames -> the front's `WebSocket.receive` -> the ASGI
message -> `ProviderSocket._reader` -> `LinkMachine.receive` ->
`ProviderSession.report` -> `Lane.tell` -> the lane's bursts (validation,
the record on SQLite on disk, the feed) and each run's settling. One
provider link in the same trio loop as the broker (`Funduq`), handshake and
`register` included; `--threads` callers each start runs one after another
(`Funduq.start_run`, then `Funduq.follow` to the run's end, each burst
encoded as a stream would, then `wait_run`).

`--shape raw`: every frame (an `ok`, 12 reports, a `finish` at 8 deltas) is
its own socket read, as from a provider that does not batch when the
server keeps up with it. `--shape read`: a run's frames after the `ok` come
in one socket read. `--shape batch`: one `batch` frame, as the SDK sends.
`--gap N` (raw): the provider waits N scheduler passes after each frame, so
frames come slower than the record commits (a provider starved of a core,
as on a loaded host: bench/README.md, "A lane not woken for its own commit").

Prints, per run: process CPU (the record's writer thread included; best of
`--rounds`, no instrument), then from two more rounds trio task steps (by
task), record writes and commits, and bursts as a follower saw them (near
deterministic). The provider's own work is in the CPU figure too; compare
trees, not absolute values. For a count that does not move with the host,
run it under callgrind at two `--runs` and subtract (bench/README.md).

    python bench/frame_path.py [--runs 600] [--threads 20] [--shape raw] [--gap 0] [--rounds 3]
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from funduq_trio.broker.funduq import Funduq
from funduq_trio.config import Settings
from funduq_trio.identity import Identity, provider_connect_payload
from funduq_trio.protocol import frames as f
from funduq_trio.web.provider_socket import AsgiWebsocket, ProviderSocket


def masked(text: str, key: bytes = b"\x37\xfa\x21\x3d") -> bytes:
    """`text` as a client's one-frame text message (RFC 6455 §5.2-5.3)."""
    payload = text.encode()
    n = len(payload)
    if n < 126:
        length = bytes((0x80 | n,))
    elif n < 65536:
        length = bytes((0x80 | 126,)) + n.to_bytes(2, "big")
    else:
        length = bytes((0x80 | 127,)) + n.to_bytes(8, "big")
    mask = int.from_bytes((key * (n // 4 + 1))[:n], "big")
    body = (int.from_bytes(payload, "big") ^ mask).to_bytes(n, "big") if n else b""
    return bytes((0x81,)) + length + key + body


def run_texts(run_id: str, thread_id: str, deltas: int) -> list[str]:
    """A run's reports and finish as the SDK encodes them."""
    mid = "msg-" + run_id
    events: list[dict[str, Any]] = [
        {"type": "RUN_STARTED", "threadId": thread_id, "runId": run_id},
        {"type": "TEXT_MESSAGE_START", "messageId": mid, "role": "assistant"},
        *(
            {"type": "TEXT_MESSAGE_CONTENT", "messageId": mid, "delta": f"word{i} "}
            for i in range(deltas)
        ),
        {"type": "TEXT_MESSAGE_END", "messageId": mid},
        {"type": "RUN_FINISHED", "threadId": thread_id, "runId": run_id},
    ]
    texts = [
        f.encode_frame(f.Report(run_id=run_id, event=event, seq=seq))
        for seq, event in enumerate(events, start=1)
    ]
    texts.append(f.encode_frame(f.Finish(run_id=run_id)))
    return texts


class Wire:
    """The front's `Connection` for one provider socket: reads come from
    the provider task's channel (each item one socket read), writes are
    server frames the provider parses."""

    class limits:
        max_message_bytes = 16 * 1024 * 1024

    def __init__(self) -> None:
        self.to_server, self._reads = trio.open_memory_channel[bytes](1_000_000)
        self.to_provider, self.from_server = trio.open_memory_channel[str](1_000_000)

    async def read(self) -> bytes:
        return await self._reads.receive()

    async def write(self, data: bytes) -> None:
        # Server frames are unmasked, FIN, one frame a message.
        at = 2
        n = data[1] & 0x7F
        if n == 126:
            n, at = int.from_bytes(data[2:4], "big"), 4
        elif n == 127:
            n, at = int.from_bytes(data[2:10], "big"), 10
        self.to_provider.send_nowait(data[at : at + n].decode())


class Steps(trio.abc.Instrument):
    def __init__(self) -> None:
        self.by_task: collections.Counter[str] = collections.Counter()

    def before_task_step(self, task: Any) -> None:
        name = task.name
        self.by_task[
            "thread" if name.startswith("thread ") else ".".join(name.split(".")[-2:])
        ] += 1


async def provider(
    wire: Wire, shape: str, deltas: int, funduq_identity: Identity, gap: int = 0
) -> None:
    me = Identity.generate()
    hello = json.loads(await wire.from_server.receive())
    nonce = "p" * 32
    proof = me.sign(provider_connect_payload(hello["funduqKey"], hello["nonce"], nonce))
    connect = f.Connect(public_key=me.public_key_hex, nonce=nonce, proof=proof)
    await wire.to_server.send(masked(f.encode_frame(connect)))
    assert json.loads(await wire.from_server.receive())["kind"] == "connect.ok"
    register = {"kind": "register", "id": "reg-1", "agents": [{"name": "echo"}]}
    await wire.to_server.send(masked(json.dumps(register)))
    assert json.loads(await wire.from_server.receive())["kind"] == "ok"
    wire.key = me.public_key_hex  # type: ignore[attr-defined]
    wire.ready.set()  # type: ignore[attr-defined]
    async for text in wire.from_server:
        offer = json.loads(text)
        assert offer["kind"] == "offer", offer
        run = offer["run"]
        ok = {"kind": "ok", "id": offer["id"], "verdict": "accepted"}
        await wire.to_server.send(masked(json.dumps(ok, separators=(",", ":"))))
        texts = run_texts(run["runId"], run["threadId"], deltas)
        if shape == "raw":
            for t in texts:
                await wire.to_server.send(masked(t))
                for _ in range(gap):
                    await trio.lowlevel.checkpoint()
        elif shape == "read":
            await wire.to_server.send(b"".join(masked(t) for t in texts))
        else:
            batch = '{"kind":"batch","frames":[' + ",".join(texts) + "]}"
            await wire.to_server.send(masked(batch))


async def load(
    data_dir: Path,
    runs: int,
    threads: int,
    shape: str,
    deltas: int,
    count_steps: bool,
    gap: int = 0,
) -> dict[str, Any]:
    from wsproto.connection import Connection, ConnectionType

    from funduq_trio.front.websocket import WebSocket

    steps = Steps()
    # A delivery timeout no slow round reaches: under callgrind on a loaded
    # host the provider's answers can take seconds, and a timed-out offer
    # (the link withdrawn at the third) voids the count. The same code runs
    # either way while no timeout fires.
    async with Funduq(Settings(data_dir=data_dir, deliver_timeout_seconds=3600.0)) as funduq:
        wire = Wire()
        wire.ready = trio.Event()  # type: ignore[attr-defined]
        front = WebSocket(wire, b"key")  # type: ignore[arg-type]
        front.ws = Connection(ConnectionType.SERVER)
        front.state = "open"

        async def receive() -> dict[str, Any]:
            return await front.receive()

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "websocket.accept":
                return
            await front.send(message)

        if "receive_message" in inspect.signature(AsgiWebsocket).parameters:
            # As the server's front offers it (its receive_message extension).
            ws = AsgiWebsocket(receive, send, lambda: None, receive_message=front.receive_message)
        else:  # a tree before it
            ws = AsgiWebsocket(receive, send, lambda: None)
        link = ProviderSocket(ws, funduq)
        message = {
            "threadId": "t",
            "runId": "r",
            "messages": [{"id": "u", "role": "user", "content": "hello"}],
        }
        frames = 0
        streamed: list[str] = []
        followed = [0]

        async def caller(count: int) -> None:
            nonlocal frames
            thread_id = None
            key = wire.key  # type: ignore[attr-defined]
            for _ in range(count):
                ticket = await funduq.start_run(key, "echo", message, thread_id=thread_id)
                thread_id = ticket.thread_id
                bursts = 0
                async for burst in funduq.follow(ticket.run_id):
                    bursts += 1
                    streamed.append(json.dumps(burst))  # as a stream writes a burst
                followed[0] += bursts
                run = await funduq.wait_run(ticket.run_id)
                assert run["status"] == "completed", run
                assert len(run["events"]) == deltas + 4, run
                frames += deltas + 6  # ok, reports, finish

        async with trio.open_nursery() as nursery:
            nursery.start_soon(link.run)
            nursery.start_soon(provider, wire, shape, deltas, funduq.identity, gap)
            await wire.ready.wait()  # type: ignore[attr-defined]
            writes0, commits0 = funduq.record.writes, funduq.record.commits
            if count_steps:  # not while timed: an instrument costs every step
                trio.lowlevel.add_instrument(steps)
            cpu = time.process_time()
            began = time.perf_counter()
            async with trio.open_nursery() as callers:
                for i in range(threads):
                    callers.start_soon(caller, runs // threads + (i < runs % threads))
            cpu = time.process_time() - cpu
            elapsed = time.perf_counter() - began
            if count_steps:
                trio.lowlevel.remove_instrument(steps)
            writes = funduq.record.writes - writes0
            commits = funduq.record.commits - commits0
            nursery.cancel_scope.cancel()
    return {
        "bursts_run": followed[0] / runs,
        "cpu_us_run": cpu / runs * 1e6,
        "cpu_us_frame": cpu / frames * 1e6,
        "runs_s": runs / elapsed,
        "steps_run": sum(steps.by_task.values()) / runs,
        "by_task": {k: v / runs for k, v in steps.by_task.most_common(8)},
        "writes_run": writes / runs,
        "commits_run": commits / runs,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=600)
    parser.add_argument("--threads", type=int, default=20)
    parser.add_argument("--deltas", type=int, default=8)
    parser.add_argument("--shape", choices=("raw", "read", "batch"), default="raw")
    parser.add_argument("--gap", type=int, default=0, help="raw: scheduler passes between frames")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import funduq_trio

    print(f"measuring {Path(funduq_trio.__file__).parent}")

    def once(count_steps: bool) -> dict[str, Any]:
        with tempfile.TemporaryDirectory() as tmp:
            return trio.run(
                load,
                Path(tmp),
                args.runs,
                args.threads,
                args.shape,
                args.deltas,
                count_steps,
                args.gap,
            )

    results = [once(False) for _ in range(args.rounds)]
    counted = [once(True) for _ in range(2)]
    best = min(results, key=lambda r: r["cpu_us_run"])
    print(
        f"shape {args.shape}: {args.runs} runs over {args.threads} threads, "
        f"{args.deltas + 6} frames a run"
        + (f", {args.gap} passes between frames" if args.gap else "")
    )
    print(
        f"  CPU a run {best['cpu_us_run']:7.1f} us (best of {args.rounds}; all: "
        + ", ".join(f"{r['cpu_us_run']:.0f}" for r in results)
        + f"), a frame {best['cpu_us_frame']:.2f} us, {best['runs_s']:.0f} runs/s"
    )
    print(
        "  (two rounds counting) task steps a run "
        + ", ".join(f"{r['steps_run']:.1f}" for r in counted)
        + "; record writes a run "
        + ", ".join(f"{r['writes_run']:.2f}" for r in counted)
        + "; commits a run "
        + ", ".join(f"{r['commits_run']:.2f}" for r in counted)
        + "; bursts a run (followed) "
        + ", ".join(f"{r['bursts_run']:.2f}" for r in counted)
    )
    print(
        "  steps a run by task: "
        + ", ".join(f"{k} {v:.1f}" for k, v in counted[-1]["by_task"].items())
    )


if __name__ == "__main__":
    main()
