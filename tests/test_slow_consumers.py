"""Slow consumers: a caller that opens an SSE stream and stops reading must
stall nobody but itself -- not the run it follows, not other callers, not the
provider.

The stalled callers are raw TCP clients with a tiny receive buffer: one posts
to the AG-UI door, one calls `SendStreamingMessage` at the A2A door, each
starting a run of the `big` agent (the SDK's provider) whose events add up to
several megabytes -- more than the kernel's socket buffers on both ends can
hold, so the server really cannot push the stream out. While they read
nothing:

* both big runs complete in the record (`GET /runs`), every event recorded;
* other callers' runs (AG-UI, on the same provider) all complete, and each
  stream shows exactly its run's record;
* the stall was real: what reached the stalled sockets (FIONREAD) is far less
  than the stream.

Then the stalled callers read on: each gets its whole stream, the AG-UI one
exactly the run's recorded events, the A2A one ending on the final status.
"""

from __future__ import annotations

import array
import fcntl
import json
import socket
import termios
from pathlib import Path
from typing import Any

import h11
import httpx
import trio
from reliability_support import (
    HTTP_TIMEOUT,
    AguiStream,
    Figures,
    eventually,
    get_run,
    get_runs,
    record_problems,
    seen_problems,
    user_input,
    wait_status,
)
from support import running_server, sdk_provider

from funduq_trio.provider import make_echo

DELTA = 24 * 1024
DELTAS = 220  # ~5.3 MB per big run: more than loopback's socket buffers (4 MiB max)


def make_big(started: list[tuple[str, str]]) -> Any:
    async def big(run_input: Any) -> Any:
        messages = run_input.messages
        started.append((run_input.run_id, messages[-1].id if messages else ""))
        mid = f"{run_input.run_id}-big"
        yield {"type": "RUN_STARTED", "threadId": run_input.thread_id, "runId": run_input.run_id}
        yield {"type": "TEXT_MESSAGE_START", "messageId": mid, "role": "assistant"}
        for i in range(DELTAS):
            yield {
                "type": "TEXT_MESSAGE_CONTENT",
                "messageId": mid,
                "delta": f"{i:06d}" + "x" * (DELTA - 6),
            }
        yield {"type": "TEXT_MESSAGE_END", "messageId": mid}
        yield {"type": "RUN_FINISHED", "threadId": run_input.thread_id, "runId": run_input.run_id}

    return big


class StalledCaller:
    """A raw HTTP/1.1 client over a socket with a tiny receive buffer: it sends
    its request and then reads nothing until told to."""

    def __init__(
        self, port: int, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> None:
        self.port = port
        self.path = path
        self.body = json.dumps(body).encode()
        self.headers = headers or {}
        self.sock: trio.socket.SocketType | None = None
        self.stream: trio.SocketStream | None = None
        self.conn = h11.Connection(h11.CLIENT)

    async def send(self) -> None:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await sock.connect(("127.0.0.1", self.port))
        self.sock = sock
        self.stream = trio.SocketStream(sock)
        headers = [
            ("Host", f"127.0.0.1:{self.port}"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(self.body))),
            *self.headers.items(),
        ]
        data = self.conn.send(h11.Request(method="POST", target=self.path, headers=headers))
        data += self.conn.send(h11.Data(data=self.body))
        data += self.conn.send(h11.EndOfMessage())
        await self.stream.send_all(data)

    def queued_bytes(self) -> int:
        """Bytes the kernel holds for us, unread (FIONREAD)."""
        assert self.sock is not None
        buf = array.array("i", [0])
        fcntl.ioctl(self.sock.fileno(), termios.FIONREAD, buf)
        return buf[0]

    async def read_all(self) -> tuple[int, list[Any]]:
        """Read the whole response now; (status, the SSE frames' JSON)."""
        assert self.stream is not None
        status, body = 0, bytearray()
        while True:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                chunk = await self.stream.receive_some(256 * 1024)
                self.conn.receive_data(chunk)
                continue
            if isinstance(event, h11.Response):
                status = event.status_code
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, (h11.EndOfMessage, h11.ConnectionClosed)):
                break
        frames = [
            json.loads(line[5:]) for line in body.decode().split("\n") if line.startswith("data:")
        ]
        return status, frames

    async def aclose(self) -> None:
        if self.stream is not None:
            await self.stream.aclose()


async def test_a_caller_that_stops_reading_stalls_nobody(tmp_path: Path) -> None:
    fig = Figures("slow_consumers")
    started: list[tuple[str, str]] = []
    others: list[AguiStream] = []
    async with (
        running_server(tmp_path) as info,
        httpx.AsyncClient(base_url=info.url, timeout=HTTP_TIMEOUT) as http,
        sdk_provider(
            info, {"big": make_big(started), "echo": make_echo(deltas=4, delay=0.001)}
        ) as provider,
    ):
        fp = provider.identity.fingerprint
        agui = StalledCaller(
            info.port,
            f"/agui/{fp}/big",
            user_input("big please", thread_id="slow-agui", message_id="stalled-agui"),
        )
        a2a = StalledCaller(
            info.port,
            f"/a2a/{fp}/big",
            {
                "jsonrpc": "2.0",
                "id": "slow",
                "method": "SendStreamingMessage",
                "params": {
                    "message": {
                        "messageId": "stalled-a2a",
                        "role": "ROLE_USER",
                        "parts": [{"text": "big please"}],
                    }
                },
            },
            headers={"A2A-Version": "1.0"},
        )
        stalled = {"stalled-agui": agui, "stalled-a2a": a2a}
        try:
            for caller in stalled.values():
                await caller.send()
                fig.fault("stalled_stream")

            async def both_started() -> bool:
                return {m for _, m in started} >= set(stalled)

            await eventually(both_started, "both big runs started")
            big_runs = {mid: rid for rid, mid in started}

            # Everyone else carries on: 40 runs on the same provider, 8 at a time.
            limit = trio.CapacityLimiter(8)

            async def other(n: int) -> None:
                async with limit:
                    stream = AguiStream(f"other-{n}")
                    others.append(stream)
                    await stream.run(
                        http,
                        f"/agui/{fp}/echo",
                        user_input(f"other {n}", thread_id=f"other-{n}", message_id=f"other-{n}"),
                    )

            async with trio.open_nursery() as nursery:
                for n in range(40):
                    nursery.start_soon(other, n)

            # The stalled runs themselves complete in the record.
            records = {}
            for mid, rid in big_runs.items():
                records[mid] = await wait_status(http, rid, ["completed"])
                fig.violations.extend(record_problems(records[mid]))
                fig.expect(
                    len(records[mid]["events"]) == DELTAS + 4,
                    f"{rid}: {len(records[mid]['events'])} events recorded",
                )
            total = sum(len(json.dumps(e["event"])) for e in records["stalled-agui"]["events"])

            # The stall was real: the server could not have pushed the streams out.
            for mid, caller in stalled.items():
                queued = caller.queued_bytes()
                fig.expect(
                    queued < total // 2,
                    f"{mid}: {queued} bytes already at the client of a {total}-byte "
                    f"stream: the consumer was not slow, the test proves nothing",
                )
                fig.extra[f"{mid}_queued_bytes"] = queued
            fig.extra["stream_bytes"] = total

            # Other callers' runs all completed, each stream exactly its record.
            finals = await get_runs(http, [s.run_id for s in others if s.run_id])
            for stream in others:
                fig.expect(
                    stream.ended_cleanly and stream.run_id is not None,
                    f"{stream.label}: stream did not end cleanly: {stream.cut!r}",
                )
                if stream.run_id:
                    run = finals.get(stream.run_id)
                    fig.expect(
                        run is not None and run["status"] == "completed",
                        f"{stream.label}: {run and run['status']}",
                    )
                    fig.violations.extend(
                        seen_problems(stream.run_id, stream.events, run, complete=True)
                    )

            # The slow consumers read on and get their whole streams.
            with trio.fail_after(60):
                status, events = await agui.read_all()
            fig.expect(status == 200, f"stalled AG-UI caller got HTTP {status}")
            fig.violations.extend(
                seen_problems(
                    big_runs["stalled-agui"], events, records["stalled-agui"], complete=True
                )
            )
            with trio.fail_after(60):
                status, frames = await a2a.read_all()
            fig.expect(status == 200, f"stalled A2A caller got HTTP {status}")
            last = frames[-1]["result"] if frames and "result" in frames[-1] else {}
            fig.expect(
                last.get("statusUpdate", {}).get("status", {}).get("state")
                == "TASK_STATE_COMPLETED",
                f"stalled A2A stream did not end on COMPLETED: {json.dumps(last)[:300]}",
            )
            again = await get_run(http, big_runs["stalled-a2a"])
            fig.expect(again == records["stalled-a2a"], "the record changed after settling")
        finally:
            for caller in stalled.values():
                await caller.aclose()
    fig.runs_driven = len(others) + len(stalled)
    fig.check()
