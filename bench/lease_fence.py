"""What thread leases cost the PostgreSQL record (docs/cluster.md): the same
run-shaped load through `PostgresStore` without a node id (no lease, no
fence: a record of one process) and with one (every insert takes the
thread's lease, every move and append passes the fence `funduq_lead`).

A run is what a lane writes for a short reply: insert (queued), move to
offering, move to running, three appends of three events, move to completed
with one event. LANES tasks live runs one after another, each on a thread of
its own, for SECONDS per road, the roads alternating for ROUNDS rounds.
Printed per round and as medians: writes/s (7 a run; finer-grained than
runs/s, since 64 lanes finish their runs together), group commits/s, writes
per commit, and fenced ÷ unfenced, the same-run ratio that says what the
fence costs on this host at this moment.

    python bench/lease_fence.py                 # 3 rounds of 3 s per road, 64 lanes
    python bench/lease_fence.py --seconds 5 --lanes 128 --rounds 5
    FUNDUQ_BENCH_PG=postgresql://postgres@127.0.0.1:5432/test python bench/lease_fence.py

Works in a schema of its own (`bench_lease_<pid>`), dropped at the end.
"""

from __future__ import annotations

import argparse
import itertools
import os
import time
from typing import Any
from urllib.parse import quote

import psycopg
import trio

from funduq_trio.broker.postgres import PostgresStore
from funduq_trio.broker.store import run_store

URL = os.environ.get("FUNDUQ_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/test")
EVENT = {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "a few words of reply "}
_ids = itertools.count()


def _row(run_id: str, thread_id: str) -> dict[str, Any]:
    return {
        "id": run_id,
        "thread_id": thread_id,
        "provider_key": "k" * 64,
        "agent_name": "bench",
        "status": "queued",
        "input": '{"messages":[]}',
        "caller_metadata": "{}",
        "metadata": {},
        "arrival": 0,
        "created_at": time.time(),
    }


async def one_road(url: str, node: str | None, lanes: int, seconds: float) -> tuple[int, Any]:
    runs = 0
    async with run_store(PostgresStore(url, node=node, lease_seconds=60)) as store:

        async def lane() -> None:
            nonlocal runs
            while True:
                n = next(_ids)
                run_id, thread_id = f"run_{n}", f"thread_{n}"
                new = (thread_id, "k" * 64, "bench", None, time.time())
                await store.insert_run(_row(run_id, thread_id), new, [])
                await store.move(run_id, "offering")
                await store.move(run_id, "running")
                seq = 1
                for _ in range(3):
                    await store.append_events(run_id, [(seq + i, EVENT) for i in range(3)])
                    seq += 3
                await store.move(run_id, "completed", events=[(seq, EVENT)])
                runs += 1

        commits, writes = store.commits, store.writes
        with trio.move_on_after(seconds):
            async with trio.open_nursery() as nursery:
                for _ in range(lanes):
                    nursery.start_soon(lane)
        return runs, (store.commits - commits, store.writes - writes)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


async def main_async(lanes: int, seconds: float, rounds: int) -> None:
    schema = f"bench_lease_{os.getpid()}"
    with psycopg.connect(URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    joiner = "&" if "?" in URL else "?"
    url = f"{URL}{joiner}options={quote(f'-c search_path={schema}')}"
    roads = (("no node (one process)", None), ("leased and fenced", "node_bench"))
    rates: dict[str, list[float]] = {name: [] for name, _ in roads}
    try:
        for r in range(rounds):
            for name, node in roads if r % 2 == 0 else roads[::-1]:
                runs, (commits, writes) = await one_road(url, node, lanes, seconds)
                rates[name].append(writes / seconds)
                print(
                    f"  round {r + 1} {name:24s} {writes / seconds:7.0f} writes/s "
                    f"{runs / seconds:6.1f} runs/s  {commits / seconds:5.1f} commits/s  "
                    f"{writes / max(commits, 1):5.1f} writes/commit"
                )
        ratios = [f / n for f, n in zip(rates[roads[1][0]], rates[roads[0][0]], strict=True)]
        for name, _ in roads:
            print(f"{name:24s} median {_median(rates[name]):7.0f} writes/s")
        each = ", ".join(f"{x:.2f}" for x in ratios)
        print(f"fenced / unfenced        median {_median(ratios):.2f}  (each round: {each})")
    finally:
        with psycopg.connect(URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per road (default 3)")
    parser.add_argument("--lanes", type=int, default=64, help="concurrent lanes (default 64)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of both roads (default 3)")
    args = parser.parse_args()
    trio.run(main_async, args.lanes, args.seconds, args.rounds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
