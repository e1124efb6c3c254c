"""The A2A door's handler alone, in-process: `A2ADoor.answer` on one body.

What e2e's A2A half asks (a blocking 1.0 `SendMessage`, no `contextId` on a
thread's first run, one on the others) against a stub facade that answers at
once with a completed echo run's record (12 events: deltas + 4), so what is
timed is the door's own work: parsing and checking the JSON-RPC call, the
message as a `RunAgentInput`, the Task the record reads as and its JSON-RPC
envelope -- not the broker and not the HTTP server. The coroutine is stepped
by hand (the stub never suspends), so no scheduler time is counted either.

    python bench/a2a_handler.py                 # best of 7 x 2,000, each case
    python bench/a2a_handler.py --profile       # cProfile of each case

Instructions per call, deterministic whatever the host's load (callgrind; the
difference of two runs over the calls made):

    valgrind --tool=callgrind python bench/a2a_handler.py --case 1.0 --number 0 --repeat 1
    valgrind --tool=callgrind python bench/a2a_handler.py --case 1.0 --number 200 --repeat 1

Figures are µs per call (best of the repeats: the least disturbed by the
host's other load).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import timeit
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from funduq_trio.web.a2a_door import A2ADoor  # noqa: E402

PROVIDER = "ab" * 32


class _View:
    key = PROVIDER
    fingerprint = "fp"
    name = "echo"
    description = "echo"
    card = None


class _Ticket:
    def __init__(self, run_id: str) -> None:
        self.run_id = run_id


def echo_record(run_id: str, thread_id: str, text: str, deltas: int = 8) -> dict[str, Any]:
    """A completed echo run's record as `wait_run` answers it."""
    mid = f"{run_id}-echo"
    step = max(1, len(text) // deltas)
    parts = [text[i : i + step] for i in range(0, len(text), step)][:deltas]
    events: list[dict[str, Any]] = [
        {"type": "RUN_STARTED", "threadId": thread_id, "runId": run_id},
        {"type": "TEXT_MESSAGE_START", "messageId": mid, "role": "assistant"},
        *({"type": "TEXT_MESSAGE_CONTENT", "messageId": mid, "delta": p} for p in parts),
        {"type": "TEXT_MESSAGE_END", "messageId": mid},
        {"type": "RUN_FINISHED", "threadId": thread_id, "runId": run_id},
    ]
    return {
        "runId": run_id,
        "threadId": thread_id,
        "agent": {"provider": PROVIDER, "name": "echo"},
        "status": "completed",
        "metadata": {},
        "createdAt": "2026-12-03T10:00:00.000000Z",
        "startedAt": "2026-12-03T10:00:00.001000Z",
        "completedAt": "2026-12-03T10:00:00.004000Z",
        "events": [{"seq": i + 1, "event": e} for i, e in enumerate(events)],
    }


class StubFunduq:
    """Answers every run at once with the same completed record."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record
        self.view = _View()

    def find_agent(self, provider: str, agent: str) -> Any:
        return self.view

    async def start_run(self, *args: Any, **kwargs: Any) -> _Ticket:
        return _Ticket(self.record["runId"])

    async def wait_run(self, run_id: str) -> dict[str, Any]:
        return self.record

    async def get_run(self, run_id: str) -> dict[str, Any]:
        return self.record


class StubRequest:
    mimetype = "application/json"

    def __init__(self, headers: dict[str, str]) -> None:
        self.headers = headers


TEXT = "thread 17 says hello 42 times over"


def bodies() -> dict[str, tuple[bytes, dict[str, str]]]:
    message: dict[str, Any] = {
        "messageId": "bench-msg-17-42",
        "role": "ROLE_USER",
        "parts": [{"text": TEXT}],
        "contextId": "thread_9f2c",
    }
    v1 = {"jsonrpc": "2.0", "id": 1, "method": "SendMessage", "params": {"message": message}}
    v03_message = {
        "messageId": "bench-msg-17-42",
        "role": "user",
        "kind": "message",
        "parts": [{"kind": "text", "text": TEXT}],
        "contextId": "thread_9f2c",
    }
    v03 = {"jsonrpc": "2.0", "id": 1, "method": "message/send", "params": {"message": v03_message}}
    return {
        "SendMessage (1.0)": (json.dumps(v1).encode(), {"A2A-Version": "1.0"}),
        "message/send (0.3)": (json.dumps(v03).encode(), {}),
    }


def run_once(door: A2ADoor, body: bytes) -> Any:
    coro = door.answer(body)
    try:
        coro.send(None)
    except StopIteration as done:
        return done.value
    raise RuntimeError("the stub facade suspended")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--case", default="", help="only the cases whose name contains this")
    args = parser.parse_args()
    funduq = StubFunduq(echo_record("run_bench", "thread_9f2c", TEXT))
    for name, (body, headers) in bodies().items():
        if args.case not in name:
            continue
        door = A2ADoor(funduq, PROVIDER, "echo", StubRequest(headers))
        answer = run_once(door, body)
        if "result" not in answer.payload:
            raise RuntimeError(f"{name}: {answer.payload}")
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.number):
                run_once(door, body)
            profiler.disable()
            print(f"== {name}")
            pstats.Stats(profiler).sort_stats("cumulative").print_stats(45)
            continue
        if not args.number:
            continue  # (instruction counts: the same process without the calls)
        times = timeit.repeat(
            lambda door=door, body=body: run_once(door, body),
            number=args.number,
            repeat=args.repeat,
        )
        best = min(times) / args.number * 1e6
        median = sorted(times)[len(times) // 2] / args.number * 1e6
        print(f"{name:22} best {best:7.1f} µs   median {median:7.1f} µs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
