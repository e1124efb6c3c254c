"""The record's write pattern on PostgreSQL, two ways, beside the SQLite record
(issue #12: which PostgreSQL driver the record uses under trio).

Every store takes the same load: LANES trio tasks, each living runs one after
another for DURATION seconds. A run is five awaited writes and one read, what
a lane writes for a short reply:

    insert the run (queued)
    guarded move queued -> running, with 1 event     (UPDATE ... WHERE status IN)
    3 x append 3 events                              (INSERT ... events)
    guarded move running -> completed, with 1 event
    point read of the run's status

Writes go through a group commit (whatever is waiting shares one
transaction, first-in first-out), as `broker/record.py` does:

- `sqlite`: the real `Record` (`open_record`, `write`, `read`): the baseline;
- `asyncpg+trio-asyncio`: asyncpg, an asyncio driver, under trio-asyncio: one
  writer connection, a pool of 4 for reads;
- `psycopg-threads`: psycopg 3 (sync) in `trio.to_thread`: one writer
  connection, a psycopg_pool of 4 for reads.

Printed per store: commits/s, runs/s, events/s, p50/p99 of a commit (the
transaction, BEGIN to durable COMMIT) and of an awaited write (queued to
durable: what a lane waits), reads p50/p99, and CPU per commit: this
process (all its threads) and the PostgreSQL backends serving it.

    python bench/record_pg.py                       # 3 s per store
    python bench/record_pg.py --seconds 5 --lanes 128
    FUNDUQ_BENCH_PG=postgresql://postgres@127.0.0.1:5432/test python bench/record_pg.py

Needs `pip install -e '.[postgres]'` plus trio-asyncio and asyncpg (the
losing road is measured too): `pip install trio-asyncio asyncpg`.
It works in a schema of its own (`bench_record_<pid>`), dropped at the end.
"""

from __future__ import annotations

import argparse
import functools
import os
import sqlite3
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness as h  # noqa: E402

from funduq_trio.broker.record import dumps, open_record  # noqa: E402

URL = os.environ.get("FUNDUQ_BENCH_PG", "postgresql://postgres@127.0.0.1:5432/test")
EVENT = {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "a few words of reply "}
READERS = 4

# An op: ("run", id) | ("events", id, first_seq, n) | ("move", id, from, to, seq)


@dataclass
class Figures:
    commit_seconds: list[float] = field(default_factory=list)
    write_seconds: list[float] = field(default_factory=list)
    read_seconds: list[float] = field(default_factory=list)
    commits: int = 0
    runs: int = 0
    events: int = 0


class GroupCommit:
    """Whatever is waiting goes in one transaction (`apply`), first-in first-out:
    the shape of `Record._flush`, over any store's `apply(ops) -> results`."""

    def __init__(self, apply: Callable[[list[Any]], Awaitable[list[Any]]], figures: Figures):
        self.apply, self.figures = apply, figures
        self.pending: list[tuple[Any, list[Any]]] = []
        self.wake = trio.Event()
        self.done = trio.Event()

    async def write(self, op: Any) -> Any:
        slot: list[Any] = []
        self.pending.append((op, slot))
        done = self.done
        self.wake.set()
        await done.wait()
        return slot[0]

    async def run(self) -> None:
        while True:
            await self.wake.wait()
            self.wake = trio.Event()
            batch, done = self.pending, self.done
            self.pending, self.done = [], trio.Event()
            began = time.perf_counter()
            results = await self.apply([op for op, _ in batch])
            self.figures.commit_seconds.append(time.perf_counter() - began)
            self.figures.commits += 1
            for (_, slot), result in zip(batch, results, strict=True):
                slot.append(result)
            done.set()


def events_rows(op: tuple[Any, ...]) -> list[tuple[str, int, str]]:
    _, run_id, first, n = op
    return [(run_id, first + i, dumps(EVENT)) for i in range(n)]


# -- the load ----------------------------------------------------------------------


async def load(
    write: Callable[[Any], Awaitable[Any]],
    read: Callable[[str], Awaitable[Any]],
    figures: Figures,
    lanes: int,
    seconds: float,
) -> float:
    stop_at = time.perf_counter() + seconds

    async def timed_write(op: Any) -> Any:
        began = time.perf_counter()
        result = await write(op)
        figures.write_seconds.append(time.perf_counter() - began)
        return result

    async def lane(n: int) -> None:
        i = 0
        while time.perf_counter() < stop_at:
            run_id = f"run-{n}-{i}"
            i += 1
            await timed_write(("run", run_id))
            assert await timed_write(("move", run_id, "queued", "running", 1))
            for k in range(3):
                await timed_write(("events", run_id, 2 + 3 * k, 3))
            assert await timed_write(("move", run_id, "running", "completed", 11))
            began = time.perf_counter()
            assert await read(run_id) == "completed"
            figures.read_seconds.append(time.perf_counter() - began)
            figures.runs += 1
            figures.events += 11

    began = time.perf_counter()
    async with trio.open_nursery() as nursery:
        for n in range(lanes):
            nursery.start_soon(lane, n)
    return time.perf_counter() - began


# -- sqlite: the real Record ------------------------------------------------------------


def sqlite_fn(op: tuple[Any, ...]) -> Callable[[sqlite3.Connection], Any]:
    kind = op[0]
    if kind == "run":

        def fn(c: sqlite3.Connection) -> Any:
            c.execute(
                "INSERT INTO runs (arrival, id, thread_id, provider_key, agent_name, status,"
                " input, created_at) VALUES (0, ?, 't', 'k', 'echo', 'queued', '{}', ?)",
                (op[1], time.time()),
            )

        return fn
    if kind == "events":
        rows = events_rows(op)
        return lambda c: c.executemany(
            "INSERT INTO events (run_id, seq, event) VALUES (?,?,?)", rows
        )
    _, run_id, src, to, seq = op

    def move(c: sqlite3.Connection) -> bool:
        moved = (
            c.execute(
                "UPDATE runs SET status=? WHERE id=? AND status IN (?)", (to, run_id, src)
            ).rowcount
            == 1
        )
        if moved:
            c.execute(
                "INSERT INTO events (run_id, seq, event) VALUES (?,?,?)",
                (run_id, seq, dumps(EVENT)),
            )
        return moved

    return move


async def bench_sqlite(lanes: int, seconds: float) -> tuple[Figures, float, dict[str, float]]:
    figures = Figures()
    with tempfile.TemporaryDirectory(prefix="bench-record-") as scratch:
        async with open_record(Path(scratch) / "record.sqlite3") as record:

            async def write(op: Any) -> Any:
                return await record.write(sqlite_fn(op))

            async def read(run_id: str) -> Any:
                return await record.read(
                    lambda c: c.execute("SELECT status FROM runs WHERE id=?", (run_id,)).fetchone()[
                        0
                    ]
                )

            flush = record._flush

            async def timed_flush() -> None:  # the commit's own time, as for PostgreSQL
                began, before = time.perf_counter(), record.commits
                await flush()
                if record.commits != before:
                    figures.commit_seconds.append(time.perf_counter() - began)

            record._flush = timed_flush  # type: ignore[method-assign]

            commits = record.commits
            cpu = h.self_cpu()
            elapsed = await load(write, read, figures, lanes, seconds)
            cpu = h.self_cpu() - cpu
            figures.commits = record.commits - commits
    return figures, elapsed, {"bench process": cpu}


# -- PostgreSQL ---------------------------------------------------------------------------

DDL = """
CREATE TABLE runs (
    arrival BIGINT NOT NULL, id TEXT PRIMARY KEY, thread_id TEXT NOT NULL,
    provider_key TEXT NOT NULL, agent_name TEXT NOT NULL, status TEXT NOT NULL,
    input TEXT NOT NULL, caller_metadata TEXT NOT NULL DEFAULT '{}',
    metadata TEXT NOT NULL DEFAULT '{}', created_at DOUBLE PRECISION NOT NULL,
    started_at DOUBLE PRECISION, completed_at DOUBLE PRECISION);
CREATE INDEX runs_thread ON runs (thread_id, arrival);
CREATE INDEX runs_status ON runs (status, arrival);
CREATE TABLE events (run_id TEXT NOT NULL, seq INTEGER NOT NULL, event TEXT NOT NULL,
                     PRIMARY KEY (run_id, seq));
"""
INSERT_RUN = (
    "INSERT INTO runs (arrival, id, thread_id, provider_key, agent_name, status, input,"
    " created_at) VALUES (0, $1, 't', 'k', 'echo', 'queued', '{}', $2)"
)
INSERT_EVENT = "INSERT INTO events (run_id, seq, event) VALUES ($1, $2, $3)"
# The guarded move and its event in one statement: the event is written only
# when the status moved, and the count of rows says whether it did.
MOVE = (
    "WITH moved AS (UPDATE runs SET status=$1 WHERE id=$2 AND status = ANY($3::text[])"
    " RETURNING id) INSERT INTO events (run_id, seq, event) SELECT id, $4, $5 FROM moved"
)
READ = "SELECT status FROM runs WHERE id=$1"


def psycopg_sql(sql: str) -> str:
    for n in range(5, 0, -1):
        sql = sql.replace(f"${n}", "%s")
    return sql


def backend_cpu(pids: list[int]) -> float:
    return sum(h.proc_cpu(pid) for pid in pids)


async def bench_asyncpg(
    schema: str, sync: str, lanes: int, seconds: float
) -> tuple[Figures, float, dict[str, float]]:
    import asyncpg
    import trio_asyncio
    from trio_asyncio import aio_as_trio

    figures = Figures()
    settings = {"search_path": schema, "synchronous_commit": sync}
    async with trio_asyncio.open_loop():
        writer = await aio_as_trio(asyncpg.connect)(URL, server_settings=settings)
        pool = await aio_as_trio(asyncpg.create_pool)(
            URL, min_size=READERS, max_size=READERS, server_settings=settings
        )
        try:
            pids = [writer.get_server_pid()]
            for _ in range(READERS):
                pids.append(await aio_as_trio(pool.fetchval)("SELECT pg_backend_pid()"))

            async def apply(ops: list[Any]) -> list[Any]:  # an asyncio coroutine
                results: list[Any] = []
                async with writer.transaction():
                    for op in ops:
                        if op[0] == "run":
                            await writer.execute(INSERT_RUN, op[1], time.time())
                            results.append(None)
                        elif op[0] == "events":
                            await writer.executemany(INSERT_EVENT, events_rows(op))
                            results.append(None)
                        else:
                            _, run_id, src, to, seq = op
                            status = await writer.execute(
                                MOVE, to, run_id, [src], seq, dumps(EVENT)
                            )
                            results.append(status == "INSERT 0 1")
                return results

            group = GroupCommit(aio_as_trio(apply), figures)

            async def read(run_id: str) -> Any:
                return await aio_as_trio(pool.fetchval)(READ, run_id)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(group.run)
                cpu, server = h.self_cpu(), backend_cpu(pids)
                elapsed = await load(group.write, read, figures, lanes, seconds)
                cpu, server = h.self_cpu() - cpu, backend_cpu(pids) - server
                nursery.cancel_scope.cancel()
        finally:
            await aio_as_trio(pool.close)()
            await aio_as_trio(writer.close)()
    return figures, elapsed, {"bench process": cpu, "postgres backends": server}


async def bench_psycopg(
    schema: str, sync: str, lanes: int, seconds: float, pipeline: bool = False
) -> tuple[Figures, float, dict[str, float]]:
    import psycopg
    from psycopg_pool import ConnectionPool

    figures = Figures()
    options = f"-c search_path={schema} -c synchronous_commit={sync}"
    writer = await trio.to_thread.run_sync(
        lambda: psycopg.connect(URL, options=options, autocommit=True)
    )
    pool = ConnectionPool(
        URL,
        min_size=READERS,
        max_size=READERS,
        open=False,
        kwargs={"options": options, "autocommit": True},
    )
    await trio.to_thread.run_sync(lambda: pool.open(wait=True))
    limiter = trio.CapacityLimiter(READERS)
    insert_run, insert_event = psycopg_sql(INSERT_RUN), psycopg_sql(INSERT_EVENT)
    move_sql, read_sql = psycopg_sql(MOVE), psycopg_sql(READ)
    try:
        pids = [writer.info.backend_pid]

        def pool_pids() -> list[int]:
            with (
                pool.connection() as c1,
                pool.connection() as c2,
                pool.connection() as c3,
                pool.connection() as c4,
            ):
                return [c.info.backend_pid for c in (c1, c2, c3, c4)]

        pids += await trio.to_thread.run_sync(pool_pids)

        def apply_sync(ops: list[Any]) -> list[Any]:  # in a worker thread
            with writer.transaction(), writer.cursor() as cur:
                return [execute(cur, op) for op in ops]

        def apply_pipelined(ops: list[Any]) -> list[Any]:
            # Every statement of the batch sent at once, the results read at
            # the end: one round trip per commit instead of one per statement.
            cursors = [writer.cursor() for _ in ops]
            with writer.pipeline(), writer.transaction():
                for cur, op in zip(cursors, ops, strict=True):
                    execute(cur, op)
            return [
                cur.rowcount == 1 if op[0] == "move" else None
                for cur, op in zip(cursors, ops, strict=True)
            ]

        def execute(cur: Any, op: Any) -> Any:
            if op[0] == "run":
                cur.execute(insert_run, (op[1], time.time()))
                return None
            if op[0] == "events":
                cur.executemany(insert_event, events_rows(op))
                return None
            _, run_id, src, to, seq = op
            cur.execute(move_sql, (to, run_id, [src], seq, dumps(EVENT)))
            return cur.rowcount == 1

        async def apply(ops: list[Any]) -> list[Any]:
            return await trio.to_thread.run_sync(apply_pipelined if pipeline else apply_sync, ops)

        def read_sync(run_id: str) -> Any:
            with pool.connection() as conn:
                return conn.execute(read_sql, (run_id,)).fetchone()[0]

        async def read(run_id: str) -> Any:
            return await trio.to_thread.run_sync(read_sync, run_id, limiter=limiter)

        group = GroupCommit(apply, figures)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(group.run)
            cpu, server = h.self_cpu(), backend_cpu(pids)
            elapsed = await load(group.write, read, figures, lanes, seconds)
            cpu, server = h.self_cpu() - cpu, backend_cpu(pids) - server
            nursery.cancel_scope.cancel()
    finally:
        await trio.to_thread.run_sync(pool.close)
        writer.close()
    return figures, elapsed, {"bench process": cpu, "postgres backends": server}


# -- the run ----------------------------------------------------------------------------


def pg_admin(sql: str) -> Any:
    import psycopg

    with psycopg.connect(URL, autocommit=True) as conn:
        cur = conn.execute(sql)
        return cur.fetchone() if cur.description else None


def report(name: str, figures: Figures, elapsed: float, cpu: dict[str, float]) -> dict[str, Any]:
    commits = max(figures.commits, 1)
    row = {
        "store": name,
        "commits/s": figures.commits / elapsed,
        "runs/s": figures.runs / elapsed,
        "events/s": figures.events / elapsed,
        "writes/commit": len(figures.write_seconds) / commits,
        "commit p50 ms": h.ms(figures.commit_seconds, 0.5),
        "commit p99 ms": h.ms(figures.commit_seconds, 0.99),
        "write p50 ms": h.ms(figures.write_seconds, 0.5),
        "write p99 ms": h.ms(figures.write_seconds, 0.99),
        "read p50 ms": h.ms(figures.read_seconds, 0.5),
        "read p99 ms": h.ms(figures.read_seconds, 0.99),
    }
    for who, seconds in cpu.items():
        row[f"CPU/commit us, {who}"] = seconds / commits * 1e6
    for who, seconds in cpu.items():
        row[f"CPU/run us, {who}"] = seconds / max(figures.runs, 1) * 1e6
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per store (default 3)")
    parser.add_argument("--lanes", type=int, default=64, help="concurrent writers (default 64)")
    parser.add_argument(
        "--synchronous-commit",
        choices=("on", "off"),
        action="append",
        help="PostgreSQL's synchronous_commit for the bench's sessions "
        "(repeatable; default both: on is what a commit costs with its "
        "fsync, off is the driver's own cost)",
    )
    parser.add_argument(
        "--only",
        choices=("sqlite", "asyncpg", "psycopg"),
        action="append",
        help="measure only these (repeatable)",
    )
    args = parser.parse_args()
    only = set(args.only or ("sqlite", "asyncpg", "psycopg"))
    print(f"measuring {h.describe_build()}", file=sys.stderr)
    rows = []
    watch = h.CpuWatch({"bench": os.getpid()})
    watch.start()
    if "sqlite" in only:
        rows.append(report("sqlite (Record)", *trio.run(bench_sqlite, args.lanes, args.seconds)))
    if only - {"sqlite"}:
        schema = f"bench_record_{os.getpid()}"
        version = pg_admin("SHOW server_version")[0]
        print(f"PostgreSQL {version} at {URL}", file=sys.stderr)
        pipelined = functools.partial(bench_psycopg, pipeline=True)
        roads = [
            (name, bench, sync)
            for sync in (args.synchronous_commit or ("on", "off"))
            for name, bench in (
                ("asyncpg", bench_asyncpg),
                ("psycopg", bench_psycopg),
                ("psycopg-pipeline", pipelined),
            )
            if name.split("-")[0] in only
        ]
        for name, bench, sync in roads:
            pg_admin(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
            pg_admin(f"CREATE SCHEMA {schema}")
            try:
                import psycopg

                with psycopg.connect(
                    URL, autocommit=True, options=f"-c search_path={schema}"
                ) as conn:
                    for statement in DDL.split(";"):
                        if statement.strip():
                            conn.execute(statement)
                label = {
                    "asyncpg": "asyncpg+trio-asyncio",
                    "psycopg": "psycopg-threads",
                    "psycopg-pipeline": "psycopg-thr-pipeline",
                }[name] + f" sc={sync}"
                rows.append(report(label, *trio.run(bench, schema, sync, args.lanes, args.seconds)))
            finally:
                pg_admin(f"DROP SCHEMA IF EXISTS {schema} CASCADE")
    print(
        f"{args.lanes} lanes, {args.seconds:g} s per store; host: {h.format_shares(watch.shares())}"
    )
    keys = list(dict.fromkeys(k for r in rows for k in r))
    width = max(len(k) for k in keys)
    print(f"{'':{width}}  " + "  ".join(f"{r['store'][:24]:>24}" for r in rows))
    print(f"{'':{width}}  " + "  ".join(f"{r['store'][24:]:>24}" for r in rows))
    for key in keys[1:]:
        cells = "  ".join(f"{r.get(key, float('nan')):>24,.1f}" for r in rows)
        print(f"{key:{width}}  {cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
