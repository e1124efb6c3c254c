"""What one record read costs the process, by callgrind: the SQLite record's
`read` (`SqlStore.read`: a job for trio's worker threads, its result back
through `TrioToken.run_sync_soon`) against the same statement on the trio
thread, a bare scheduler trip, and an OS thread started and joined (what a
read costs more when trio's thread cache has no idle worker). Run it at two
sizes under callgrind and subtract::

    valgrind --tool=callgrind --callgrind-out-file=/tmp/x.%p \\
        .venv/bin/python bench/record_read_cost.py read 200
    (and 1200; (Ir(1200) - Ir(200)) / 1000 = instructions an operation)

`--separate-threads=yes` splits the figure between the trio thread and the
worker. Modes: ``read`` (`SELECT 1` through `SqlStore.read`), ``lookup``
(`SqlStore.thread` of an id the record does not have: a new AG-UI
conversation's lookup), ``now`` (`SELECT 1` on the trio thread, then one
scheduler trip), ``yield`` (the trip alone), ``thread`` (a `threading.Thread`
started and joined).
"""

from __future__ import annotations

import sys
import tempfile
import threading
from pathlib import Path

import trio

from funduq_trio.broker.record import open_record


def select_one(conn: object) -> object:
    return conn.execute("SELECT 1").fetchone()  # type: ignore[attr-defined]


async def main(mode: str, n: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        async with open_record(Path(tmp) / "record.db") as record:
            await record.read(select_one)  # a worker thread and its connection, made
            for i in range(n):
                if mode == "read":
                    await record.read(select_one)
                elif mode == "lookup":
                    assert await record.thread(f"bench-caller-thread-{i}") is None
                elif mode == "now":
                    record.read_now(select_one)
                    await trio.lowlevel.checkpoint()
                elif mode == "yield":
                    await trio.lowlevel.checkpoint()
                elif mode == "thread":
                    thread = threading.Thread(target=lambda: None, daemon=True)
                    thread.start()
                    thread.join()
                else:
                    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    trio.run(main, sys.argv[1], int(sys.argv[2]))
