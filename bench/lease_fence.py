"""What thread leases cost the PostgreSQL record (docs/cluster.md): the same
run-shaped load through `PostgresStore` without a node id (no lease, no
fence: a record of one process) and with one (every insert takes the
thread's lease, every move and append passes the fence `funduq_lead`).

A run is what a lane writes for a short reply: insert (queued), move to
offering, move to running, three appends of three events, move to completed
with one event. LANES tasks live runs one after another, each on a thread of
its own, for SECONDS per road. Printed: runs/s, group commits/s, writes per
commit.

    python bench/lease_fence.py                 # 3 s per road, 64 lanes
    python bench/lease_fence.py --seconds 5 --lanes 128
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


async def main_async(lanes: int, seconds: float) -> None:
    schema = f"bench_lease_{os.getpid()}"
    with psycopg.connect(URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {schema}")
    joiner = "&" if "?" in URL else "?"
    url = f"{URL}{joiner}options={quote(f'-c search_path={schema}')}"
    try:
        for name, node in (("no node (one process)", None), ("leased and fenced", "node_bench")):
            runs, (commits, writes) = await one_road(url, node, lanes, seconds)
            print(
                f"{name:24s} {runs / seconds:8.1f} runs/s  {commits / seconds:7.1f} commits/s  "
                f"{writes / max(commits, 1):6.1f} writes/commit"
            )
    finally:
        with psycopg.connect(URL, autocommit=True) as conn:
            conn.execute(f"DROP SCHEMA IF EXISTS {schema} CASCADE")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per road (default 3)")
    parser.add_argument("--lanes", type=int, default=64, help="concurrent lanes (default 64)")
    args = parser.parse_args()
    trio.run(main_async, args.lanes, args.seconds)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
