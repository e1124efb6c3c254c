"""The doors' own work on a run's POST, in-process, without the broker: the
app's outer ASGI layer (`web/asgi_doors.py` `serve_doors`) answering e2e's
two run POSTs against a stub facade that answers at once -- a blocking 1.0
`SendMessage` (a completed 12-event echo run's record, as `wait_run` gives
it) and an AG-UI RunAgentInput POST (the run's events as `Funduq.follow`
yields them: one burst for an SDK provider's batch, `--bursts N` to split
them as a raw provider's frames come) -- through to the ASGI messages the
front would write (`send` keeps them). What is counted is the body read,
the request's parse and checks, the run input, the Task or the SSE stream
and the response head: not the broker, not the HTTP server.

    python bench/door_answers.py                     # µs a POST, best of 5 x 2,000
    python bench/door_answers.py --profile a2a       # cProfile of one door

Instructions per POST (callgrind, two sizes subtracted; bench/README.md):

    valgrind --tool=callgrind python bench/door_answers.py --door a2a --number 0
    valgrind --tool=callgrind python bench/door_answers.py --door a2a --number 1000
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time
from pathlib import Path
from typing import Any

import trio
from quart_trio import QuartTrio

from funduq_trio.config import Settings
from funduq_trio.web.app import compact_dumps
from funduq_trio.web.asgi_doors import serve_doors

PROVIDER = "ab" * 32

TEXT = "bench thread 00017 utterance 00042: hello there, echo me".ljust(64, ".")
RUN = "run_e7d282851f11348f562292ef"
THREAD = "thread_14f2ea61a5c3dbaa55fe8bfe"


def echo_record(run_id: str, thread_id: str, text: str, deltas: int = 8) -> dict[str, Any]:
    """A completed echo run's record as `wait_run` answers it (as
    bench/a2a_handler.py's)."""
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
        "createdAt": "2026-12-04T10:39:03.100000Z",
        "startedAt": "2026-12-04T10:39:03.101000Z",
        "completedAt": "2026-12-04T10:39:03.103000Z",
        "events": [{"seq": i + 1, "event": e} for i, e in enumerate(events)],
    }


class _View:
    key = PROVIDER
    fingerprint = "fp"
    name = "echo"
    description = "echo"
    card = None


class _Ticket:
    run_id = RUN
    thread_id = THREAD


class StubFunduq:
    """Answers every run at once: the same completed record, the same events."""

    def __init__(self, bursts: int) -> None:
        self.settings = Settings()
        self.record = echo_record(RUN, THREAD, TEXT)
        events = [(e["seq"], e["event"]) for e in self.record["events"]]
        size = -(-len(events) // bursts)
        self.bursts = [events[i : i + size] for i in range(0, len(events), size)]
        self.view = _View()

    def find_agent(self, provider: str, agent: str) -> Any:
        return self.view

    async def start_run(self, *args: Any, **kwargs: Any) -> _Ticket:
        return _Ticket()

    async def wait_run(self, run_id: str) -> dict[str, Any]:
        return self.record

    async def get_run(self, run_id: str) -> dict[str, Any]:
        return self.record

    def lane_of(self, run_id: str) -> Any:
        return None

    async def record_after(self, run_id: str, lane: Any) -> dict[str, Any]:
        return self.record  # a stream's record once followed (as get_run's)

    def live_record(self, run_id: str) -> dict[str, Any]:
        """The run as it arrived (a stream's opening snapshot)."""
        return {**self.record, "status": "queued", "events": [], "completedAt": None}

    async def follow(self, run_id: str, after_seq: int = 0, quiet: Any = None) -> Any:
        for burst in self.bursts:
            if burst[-1][0] > after_seq:
                yield [(seq, event) for seq, event in burst if seq > after_seq]


def a2a_body(method: str = "SendMessage") -> bytes:
    message = {
        "messageId": "m-17-42",
        "role": "ROLE_USER",
        "parts": [{"text": TEXT}],
        "contextId": THREAD,
    }
    body = {"jsonrpc": "2.0", "id": 42, "method": method, "params": {"message": message}}
    return json.dumps(body).encode()


def agui_body() -> bytes:
    return json.dumps(
        {
            "threadId": "bench-thread-00017",
            "runId": "caller-run",
            "state": None,
            "messages": [{"id": "m-17-42", "role": "user", "content": TEXT}],
            "tools": [],
            "context": [],
            "forwardedProps": None,
        }
    ).encode()


def request(door: str) -> tuple[dict[str, Any], bytes]:
    if door == "a2a-stream":
        body = a2a_body("SendStreamingMessage")
    else:
        body = a2a_body() if door == "a2a" else agui_body()
    headers = [
        (b"host", b"127.0.0.1:8000"),
        (b"accept", b"*/*"),
        (b"content-type", b"application/json"),
        (b"content-length", b"%d" % len(body)),
    ]
    if door.startswith("a2a"):
        headers.append((b"a2a-version", b"1.0"))
    path = f"/{door.split('-')[0]}/{PROVIDER}/echo"
    scope = {
        "type": "http",
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": headers,
        "client": ("127.0.0.1", 40000),
        "server": ("127.0.0.1", 8000),
        "extensions": {"funduq.hangup": lambda callback: None},
    }
    return scope, body


async def post(app: Any, scope: dict[str, Any], body: bytes) -> list[Any]:
    sent: list[Any] = []
    message = {"type": "http.request", "body": body, "more_body": False}

    async def receive() -> dict[str, Any]:
        return message

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await app(dict(scope), receive, send)
    return sent


def answered(sent: list[Any]) -> bytes:
    return b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


async def main_async(args: argparse.Namespace) -> None:
    app = QuartTrio("bench")
    app.json.sort_keys = False
    funduq = StubFunduq(args.bursts)
    doors = serve_doors(None, funduq, compact_dumps(app))
    for door in ("a2a", "agui", "a2a-stream"):
        if args.door != door and not (args.door == "both" and door != "a2a-stream"):
            continue
        scope, body = request(door)
        out = answered(await post(doors, scope, body))
        if args.show:
            print(out.decode())
        if door == "a2a":
            assert json.loads(out)["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
        elif door == "a2a-stream":
            frames = [json.loads(x[6:]) for x in out.split(b"\n") if x.startswith(b"data: ")]
            assert frames[-1]["result"]["statusUpdate"]["status"]["state"] == (
                "TASK_STATE_COMPLETED"
            ), frames[-1]
        else:
            assert out.count(b"data: ") == 12, out
        if args.profile:
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(args.number):
                await post(doors, scope, body)
            profiler.disable()
            print(f"== {door}")
            pstats.Stats(profiler).sort_stats("tottime").print_stats(35)
            continue
        if not args.number:
            continue
        best = float("inf")
        for _ in range(args.repeat):
            began = time.perf_counter()
            for _ in range(args.number):
                await post(doors, scope, body)
            best = min(best, time.perf_counter() - began)
        print(f"{door:10} best {best / args.number * 1e6:7.1f} µs a POST")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--door",
        choices=("a2a", "agui", "both", "a2a-stream"),
        default="both",
        help="both: e2e's two (a blocking SendMessage, an AG-UI POST); "
        "a2a-stream: a SendStreamingMessage read to its end",
    )
    parser.add_argument("--number", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--bursts", type=int, default=1, help="the AG-UI run's events in N bursts")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--show", action="store_true", help="print each answer's body once")
    args = parser.parse_args()
    import funduq_trio

    print(f"measuring {Path(funduq_trio.__file__).parent}")
    trio.run(main_async, args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
