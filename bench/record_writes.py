"""The record's writes a run makes, on a record that already holds many runs:
the group commits' CPU on the trio thread, the writer's syscalls and the
process's CPU, per run, over bench/inprocess.py's broker and instant provider
(SQLite on disk).

A fresh record keeps every page it touches in SQLite's page cache; a record
that has served for a while does not, and where a run's rows land in its
B-trees (a random id: a random page) decides how many pages a run reads
and dirties. So the record is first filled with ``--prefill`` runs shaped as
the broker writes them (made once per tree and id scheme, cached under
``--cache``, then copied for each round), then the broker runs ``--warmup``
runs and the measured ``--runs``.

    python bench/record_writes.py --prefill 100000 --runs 3000 --threads 100
    PYTHONPATH=/work/wt/base python bench/record_writes.py ...   # another tree

``--prefill 0`` measures a fresh record. ``--direct`` leaves the broker
out: one task makes each run's writes on the store itself, as a lane and
a door make them (the insert and ``offering`` in one commit; ``running``,
then the settle with the run's events and its reply in the next), for
``--per-commit`` runs at a time, checkpoints off -- deterministic, for
instruction counts (callgrind at two ``--runs``, subtracted).
"""

from __future__ import annotations

import argparse
import hashlib
import inspect
import shutil
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

import inprocess  # noqa: E402

from funduq_trio.broker import funduq as funduq_module  # noqa: E402
from funduq_trio.broker import record  # noqa: E402
from funduq_trio.broker.funduq import Funduq  # noqa: E402
from funduq_trio.config import Settings  # noqa: E402
from funduq_trio.identity import Identity  # noqa: E402


def io_counts() -> dict[str, int]:
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


class _Clock:
    """``time`` for ``_new_id`` while prefilling: runs made in the past."""

    def __init__(self, start: float) -> None:
        self.now = start

    def time(self) -> float:
        return self.now

    def time_ns(self) -> int:
        return int(self.now * 1e9)

    def __getattr__(self, name: str) -> Any:
        return getattr(time, name)


def prefill(path: Path, runs: int, seed_runs: int, deltas: int) -> None:
    """A record holding ``runs`` completed runs, each a new thread with one
    user message and one reply, ``deltas + 4`` events: the broker's own rows
    for ``seed_runs`` runs, copied under new ids made by this tree's
    ``_new_id`` (its clock set to the past, 4 ms a run)."""
    with tempfile.TemporaryDirectory(prefix="funduq-prefill-") as tmp:
        trio.run(inprocess.broker_run, Path(tmp), seed_runs, seed_runs, deltas)
        shutil.copy(Path(tmp) / "funduq.sqlite3", path)
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA journal_mode=WAL")
    runs_rows = conn.execute("SELECT * FROM runs ORDER BY arrival").fetchall()
    threads = {r[0]: r for r in conn.execute("SELECT * FROM threads")}
    messages: dict[str, list[Any]] = {}
    for m in conn.execute("SELECT * FROM messages ORDER BY thread_id, idx"):
        messages.setdefault(m[0], []).append(m)
    events: dict[str, list[Any]] = {}
    for e in conn.execute("SELECT * FROM events ORDER BY run_id, seq"):
        events.setdefault(e[0], []).append(e)
    arrival = max(r[0] for r in runs_rows)
    clock = _Clock(time.time() - runs * 0.004 - 60)
    real_time = funduq_module.time
    funduq_module.time = clock  # type: ignore[assignment]
    try:
        made = 0
        conn.execute("BEGIN")
        while made < runs:
            for r in runs_rows:
                if made >= runs:
                    break
                clock.now += 0.004
                tid = funduq_module._new_id("thread")
                rid = funduq_module._new_id("run")
                arrival += 1
                old_rid, old_tid = r[1], r[2]
                row = list(r)
                row[0], row[1], row[2] = arrival, rid, tid
                conn.execute(f"INSERT INTO runs VALUES ({','.join('?' * len(row))})", row)
                t = list(threads[old_tid])
                t[0] = tid
                conn.execute(f"INSERT INTO threads VALUES ({','.join('?' * len(t))})", t)
                for m in messages.get(old_tid, ()):
                    m2 = list(m)
                    m2[0] = tid
                    m2[2] = funduq_module._new_id("msg") if m[2].startswith("msg_") else m[2]
                    m2[3] = rid if m[3] == old_rid else m[3]
                    conn.execute(f"INSERT INTO messages VALUES ({','.join('?' * len(m2))})", m2)
                conn.executemany(
                    "INSERT INTO events VALUES (?,?,?)",
                    [(rid, e[1], e[2]) for e in events.get(old_rid, ())],
                )
                made += 1
                if made % 10000 == 0:
                    conn.execute("COMMIT")
                    conn.execute("BEGIN")
        conn.execute("COMMIT")
    finally:
        funduq_module.time = real_time
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()


async def measured_run(
    data_dir: Path, warmup: int, runs: int, threads: int, deltas: int
) -> dict[str, float]:
    commit_cpu = [0.0]
    commits = [0, 0]
    original = record.SqliteStore._commit

    async def timed_commit(self: Any, ops: list[Any]) -> None:
        cpu = time.thread_time()
        try:
            await original(self, ops)
        finally:
            commit_cpu[0] += time.thread_time() - cpu
            commits[0] += 1
            commits[1] += len(ops)

    record.SqliteStore._commit = timed_commit  # type: ignore[method-assign]
    out: dict[str, float] = {}
    try:
        async with Funduq(Settings(data_dir=data_dir)) as funduq:
            provider = inprocess.InstantProvider(deltas)
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
                # A new thread each run, as e2e's callers make them.
                for _ in range(count):
                    ticket = await funduq.start_run(key, "echo", message)
                    run = await funduq.wait_run(ticket.run_id)
                    assert run["status"] == "completed", run

            async with trio.open_nursery() as nursery:
                nursery.start_soon(provider.serve)
                for phase, n in (("warmup", warmup), ("measured", runs)):
                    commit_cpu[0], commits[:] = 0.0, [0, 0]
                    io0, cpu0, t0 = io_counts(), time.process_time(), time.perf_counter()
                    async with trio.open_nursery() as callers:
                        for i in range(threads):
                            callers.start_soon(caller, n // threads + (i < n % threads))
                    io1 = io_counts()
                    if phase == "measured":
                        out = {
                            "seconds": time.perf_counter() - t0,
                            "cpu": time.process_time() - cpu0,
                            "commit_cpu": commit_cpu[0],
                            "commits": commits[0],
                            "writes": commits[1],
                            "syscw": io1["syscw"] - io0["syscw"],
                            "syscr": io1["syscr"] - io0["syscr"],
                        }
                nursery.cancel_scope.cancel()
    finally:
        record.SqliteStore._commit = original  # type: ignore[method-assign]
    return out


async def direct_run(
    data_dir: Path, warmup: int, runs: int, per_commit: int, deltas: int
) -> dict[str, float]:
    """The record alone, a run's writes in the order a door and a lane make
    them, ``per_commit`` runs sharing each commit."""
    from funduq_trio.broker.store import dumps

    async def no_checkpoints(self: Any) -> None:
        await trio.sleep_forever()

    record.SqliteStore._run_checkpoints = no_checkpoints  # type: ignore[method-assign]
    key = "k" * 64
    arrival = [10**9]
    out: dict[str, float] = {}
    async with record.open_record(data_dir / "funduq.sqlite3") as store:

        def one_run(i: int) -> tuple[Any, ...]:
            tid, rid = funduq_module._new_id("thread"), funduq_module._new_id("run")
            arrival[0] += 1
            run_input = {
                "threadId": tid,
                "runId": rid,
                "messages": [{"id": "u", "role": "user", "content": "hello"}],
            }
            row = {
                "id": rid,
                "thread_id": tid,
                "provider_key": key,
                "agent_name": "echo",
                "status": "queued",
                "input": dumps(run_input),
                "caller_metadata": "{}",
                "metadata": {},
                "arrival": arrival[0],
                "created_at": time.time(),
            }
            messages = [(tid, 0, "u", rid, dumps(run_input["messages"][0]))]
            return rid, tid, row, (tid, key, "echo", None, time.time()), messages

        async def batch(n: int) -> None:
            made = [one_run(i) for i in range(n)]
            pending = []
            for rid, _tid, row, thread, messages in made:
                store.insert_run_soon(row, thread, messages)
                pending.append(store.write_soon(store._move_write(rid, "offering")))
            await pending[-1].result()
            for rid, *_ in made:
                store.move_soon(rid, "running", metadata={}, stamp=("started_at", time.time()))
            done = []
            for rid, tid, *_ in made:
                events = list(enumerate(inprocess.events_for(rid, tid, deltas), start=1))
                reply = [
                    (
                        tid,
                        1,
                        "m-" + rid,
                        rid,
                        dumps({"id": "m-" + rid, "role": "assistant", "content": "word " * deltas}),
                    )
                ]
                done.append(
                    store.write_soon(
                        store._move_write(
                            rid,
                            "completed",
                            metadata={},
                            events=events,
                            stamp=("completed_at", time.time()),
                            messages=reply,
                        )
                    )
                )
            for handle in done:
                assert await handle.result() is True

        for phase, n in (("warmup", warmup), ("measured", runs)):
            commits0, writes0 = store.commits, store.writes
            io0, cpu0, t0 = io_counts(), time.process_time(), time.perf_counter()
            for _ in range(n // per_commit):
                await batch(per_commit)
            io1 = io_counts()
            if phase == "measured":
                out = {
                    "seconds": time.perf_counter() - t0,
                    "cpu": time.process_time() - cpu0,
                    "commit_cpu": 0.0,
                    "commits": store.commits - commits0,
                    "writes": store.writes - writes0,
                    "syscw": io1["syscw"] - io0["syscw"],
                    "syscr": io1["syscr"] - io0["syscr"],
                }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=100_000)
    parser.add_argument("--seed-runs", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=500)
    parser.add_argument("--runs", type=int, default=3000)
    parser.add_argument("--threads", type=int, default=100)
    parser.add_argument("--deltas", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--direct", action="store_true", help="the record alone (see above)")
    parser.add_argument("--per-commit", type=int, default=1, help="--direct: runs a commit")
    args = parser.parse_args()
    tree = Path(sys.modules["funduq_trio"].__file__ or "").resolve().parent.parent
    # One prefilled record per id scheme and schema: keyed by _new_id's and
    # schema.py's source, so two trees with the same ones share it.
    from funduq_trio.broker import schema

    tag = hashlib.sha256(
        (inspect.getsource(funduq_module._new_id) + inspect.getsource(schema)).encode()
    ).hexdigest()[:10]
    print(f"measuring {tree}; record prefilled with {args.prefill} runs (ids/schema {tag})")
    with tempfile.TemporaryDirectory(prefix="funduq-rw-") as tmp:
        seeded = args.cache / f"funduq-prefill-{args.prefill}-{tag}.sqlite3"
        if args.prefill and not seeded.exists():
            began = time.perf_counter()
            prefill(seeded.with_suffix(".tmp"), args.prefill, args.seed_runs, args.deltas)
            seeded.with_suffix(".tmp").rename(seeded)
            print(f"  prefilled {seeded} in {time.perf_counter() - began:.0f} s")
        for r in range(args.rounds):
            data = Path(tmp) / f"round{r}"
            data.mkdir()
            if args.prefill:
                shutil.copy(seeded, data / "funduq.sqlite3")
            if args.direct:
                res = trio.run(
                    direct_run, data, args.warmup, args.runs, args.per_commit, args.deltas
                )
            else:
                res = trio.run(
                    measured_run, data, args.warmup, args.runs, args.threads, args.deltas
                )
            n = args.runs
            print(
                f"  round {r}: commit CPU {res['commit_cpu'] / n * 1e6:6.1f} us/run, "
                f"process CPU {res['cpu'] / n * 1e6:6.0f} us/run, "
                f"commits {res['commits'] / n:.2f}, writes {res['writes'] / n:.2f}, "
                f"pwrite-ish {res['syscw'] / n:.1f}, pread-ish {res['syscr'] / n:.1f} a run, "
                f"{n / res['seconds']:.0f} runs/s"
            )
            shutil.rmtree(data)


if __name__ == "__main__":
    main()
