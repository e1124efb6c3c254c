"""In-process broker benchmark: N runs over T threads through an in-process
provider that answers at once and streams ~12 AG-UI events per run, with the
SQLite record on disk. Prints runs/s, events/s, caller latency p50/p99 and
peak RSS, beside a baseline measured in the same run: the record alone
taking the same writes (one row per event and status) from T writers.

    python bench/inprocess.py --runs 2000 --threads 100 --deltas 8
"""

from __future__ import annotations

import argparse
import math
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

from funduq_trio.broker.funduq import Funduq
from funduq_trio.broker.record import open_record
from funduq_trio.config import Settings
from funduq_trio.identity import Identity


class InstantProvider:
    """A provider link that accepts every offer and streams the reply at once."""

    def __init__(self, deltas: int) -> None:
        self.deltas = deltas
        self.session: Any = None
        self.send, self.receive = trio.open_memory_channel[tuple[str, dict]](math.inf)

    def send_offer(self, offer_id: str, run: dict[str, Any]) -> None:
        self.send.send_nowait((offer_id, run))

    def send_cancel(self, run_id: str) -> None:
        pass

    def close(self, reason: str) -> None:
        raise SystemExit(f"provider withdrawn: {reason}")

    async def serve(self) -> None:
        async for offer_id, run in self.receive:
            rid, tid = run["runId"], run["threadId"]
            self.session.answer(offer_id, "accepted")
            for event in events_for(rid, tid, self.deltas):
                self.session.report(rid, event)
            self.session.finish(rid)


def events_for(run_id: str, thread_id: str, deltas: int) -> list[dict[str, Any]]:
    mid = "m-" + run_id
    return (
        [
            {"type": "RUN_STARTED", "threadId": thread_id, "runId": run_id},
            {"type": "TEXT_MESSAGE_START", "messageId": mid, "role": "assistant"},
        ]
        + [{"type": "TEXT_MESSAGE_CONTENT", "messageId": mid, "delta": "word "}] * deltas
        + [
            {"type": "TEXT_MESSAGE_END", "messageId": mid},
            {"type": "RUN_FINISHED", "threadId": thread_id, "runId": run_id},
        ]
    )


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def broker_run(data_dir: Path, runs: int, threads: int, deltas: int) -> dict[str, float]:
    latencies: list[float] = []
    async with Funduq(Settings(data_dir=data_dir)) as funduq:
        provider = InstantProvider(deltas)
        key = Identity.generate().public_key_hex
        provider.session = funduq.attach_provider(key, None, provider)
        await provider.session.register(
            [{"name": "echo", "description": "", "card": {}, "metadata": {}}]
        )
        message = {
            "threadId": "t",
            "runId": "r",
            "messages": [{"id": "u", "role": "user", "content": "hello"}],
        }

        async def caller(count: int) -> None:
            thread_id = None
            for _ in range(count):
                began = time.perf_counter()
                ticket = await funduq.start_run(key, "echo", message, thread_id=thread_id)
                thread_id = ticket.thread_id
                run = await funduq.wait_run(ticket.run_id)
                assert run["status"] == "completed", run
                latencies.append(time.perf_counter() - began)

        began = time.perf_counter()
        cpu_began = time.process_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(provider.serve)
            async with trio.open_nursery() as callers:
                for i in range(threads):
                    callers.start_soon(caller, runs // threads + (i < runs % threads))
            nursery.cancel_scope.cancel()
        elapsed = time.perf_counter() - began
        cpu = time.process_time() - cpu_began
        commits = funduq.record.commits
    events = runs * (deltas + 4)
    return {
        "runs": runs,
        "seconds": elapsed,
        "runs_per_s": runs / elapsed,
        "events_per_s": events / elapsed,
        "p50_ms": percentile(latencies, 0.5) * 1e3,
        "p99_ms": percentile(latencies, 0.99) * 1e3,
        "commits": commits,
        "cpu_ms_per_run": cpu / runs * 1e3,
    }


async def record_run(data_dir: Path, runs: int, threads: int, deltas: int) -> dict[str, float]:
    """Baseline: the record alone taking one write per event and per status
    change (plus the run's insert), from ``threads`` concurrent writers."""
    writes_per_run = deltas + 4 + 4
    async with open_record(data_dir / "baseline.sqlite3") as record:

        async def writer(index: int, count: int) -> None:
            for r in range(count):
                rid = f"run_{index}_{r}"
                for seq in range(writes_per_run):
                    row = (rid, seq, '{"type":"TEXT_MESSAGE_CONTENT","delta":"word "}')
                    await record.write(
                        lambda c, row=row: c.execute(
                            "INSERT INTO events (run_id, seq, event) VALUES (?,?,?)", row
                        )
                    )

        began = time.perf_counter()
        async with trio.open_nursery() as nursery:
            for i in range(threads):
                nursery.start_soon(writer, i, runs // threads + (i < runs % threads))
        elapsed = time.perf_counter() - began
    return {"seconds": elapsed, "runs_per_s": runs / elapsed}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=100)
    parser.add_argument("--deltas", type=int, default=8, help="text deltas per run (+4 events)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="funduq-bench-") as tmp:
        base = trio.run(record_run, Path(tmp), args.runs, args.threads, args.deltas)
        result = trio.run(broker_run, Path(tmp), args.runs, args.threads, args.deltas)
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(
        f"in-process broker: {args.runs} runs over {args.threads} threads, "
        f"{args.deltas + 4} events each, SQLite on disk"
    )
    print(f"  runs/s        {result['runs_per_s']:10.1f}")
    print(f"  events/s      {result['events_per_s']:10.1f}")
    print(f"  latency p50   {result['p50_ms']:10.2f} ms")
    print(f"  latency p99   {result['p99_ms']:10.2f} ms")
    print(f"  group commits {result['commits']:10d}")
    # Process CPU (every thread: the loop and the record's), which a busy
    # host moves far less than it moves runs/s.
    print(f"  CPU per run   {result['cpu_ms_per_run']:10.3f} ms")
    print(f"  peak RSS      {rss_mib:10.1f} MiB")
    print(f"baseline, the record alone with the same writes: {base['runs_per_s']:.1f} runs/s")
    print(f"  broker / record-alone ratio: {result['runs_per_s'] / base['runs_per_s']:.2f}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
