"""The record: everything funduq observed, in one SQLite file (WAL).

Writes go through one writer task that gathers whatever writes are waiting
into a single transaction (a group commit): a run's event is durable before
anyone relays it, yet a thousand busy runs share one commit instead of paying
one each -- one transaction per event is what capped the original at ~24
runs/s. The commit itself runs on the trio thread: in WAL mode with
`synchronous=NORMAL` a commit appends to the log without an fsync and takes
microseconds, while handing every batch to a worker thread cost the loop
more than the commit (a thread wake-up per batch, then the GIL passed back
and forth; bench/README.md has the figures). What does fsync -- the
checkpoint that copies the log into the database file -- runs in a worker
thread instead (`_run_checkpoints`), as do reads.

Status writes are guarded (``UPDATE ... WHERE status IN (legal sources)``,
sources from ``protocol.statuses``) and report whether they moved the run.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast

import trio

from ..protocol import statuses
from . import schema

T = TypeVar("T")
log = logging.getLogger("funduq.record")

COUNTERS = ("misdeclared", "unanswered", "abandoned", "undelivered")

#: Reads running at once, each on a connection of its own. A connection per
#: worker thread instead grew with trio's thread cache (dozens under load),
#: each with its own page cache.
READERS = 4
#: How long a write or read waits (in a worker thread) for another process
#: holding the file's lock before it fails.
BUSY_TIMEOUT_MS = 5000
#: How often the write-ahead log is copied into the database file (when
#: anything was committed since). SQLite's own default would do it every
#: 1,000 pages, inside whichever commit crossed the line.
CHECKPOINT_SECONDS = 1.0


def dumps(value: Any) -> str:
    # ASCII-escaped: valid JSON may carry lone surrogates ("\ud800"), which
    # SQLite's UTF-8 text cannot hold unescaped.
    return json.dumps(value, separators=(",", ":"))


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"


@dataclass
class _Write:
    fn: Callable[[sqlite3.Connection], Any]
    result: Any = None
    error: BaseException | None = None


def record_trouble(exc: BaseException) -> bool:
    """A write failed because of the record's medium (disk full, I/O error,
    a lock held too long), not because of what it wrote: worth retrying."""
    return isinstance(exc, sqlite3.OperationalError)


class PendingWrite:
    """A write queued with ``write_soon``: its result, once its batch committed."""

    __slots__ = ("_op", "_done", "_record")

    def __init__(self, record: Record, op: _Write, done: trio.Event) -> None:
        self._record, self._op, self._done = record, op, done

    async def result(self) -> Any:
        await self._done.wait()
        self._record._note(self._op)
        if self._op.error is not None:
            raise self._op.error
        return self._op.result


class Record:
    """The SQLite record. Use ``async with open_record(path) as record``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._pending: list[_Write] = []
        self._batch_done = trio.Event()
        self._wake = trio.Event()
        self._read_limiter = trio.CapacityLimiter(READERS)
        self._idle_readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._writer_conn: sqlite3.Connection | None = None
        #: The last write failed for the medium's sake (see ``record_trouble``):
        #: funduq is not ready and takes no new runs until a write succeeds.
        self.failing = False
        self.commits = 0  # group commits done (for benchmarks)
        self.writes = 0

    # -- connections -------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        conn = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        return conn

    def _read_sync(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """In a worker thread: ``fn`` on an idle reader connection (a new one
        when none is idle; the read limiter keeps them to READERS)."""
        with self._readers_lock:
            conn = self._idle_readers.pop() if self._idle_readers else None
        if conn is None:
            conn = self._connect()
        try:
            return fn(conn)
        finally:
            with self._readers_lock:
                self._idle_readers.append(conn)

    def _open_sync(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = self._connect()
        try:
            # Tables are created and upgraded here, and only here: schema.py.
            schema.upgrade(conn, str(self.path))
        except BaseException:
            conn.close()
            raise
        # Commits never checkpoint (that fsyncs, on the loop): _run_checkpoints
        # does. Nor do they wait for the write lock on the loop: _begin_now.
        conn.execute("PRAGMA wal_autocheckpoint=0")
        conn.execute("PRAGMA busy_timeout=0")
        self._writer_conn = conn

    # -- writing -----------------------------------------------------------

    async def write(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` in the next group commit; return once it is durable."""
        op = _Write(fn)
        self._pending.append(op)
        done = self._batch_done
        self._wake.set()
        await done.wait()
        self._note(op)
        if op.error is not None:
            raise op.error
        return cast(T, op.result)

    def _note(self, op: _Write) -> None:
        if op.error is None:
            self.failing = False
        elif record_trouble(op.error):
            self.failing = True

    def write_soon(self, fn: Callable[[sqlite3.Connection], Any]) -> PendingWrite:
        """Queue ``fn`` for the next group commit without waiting for it. The
        writer is first-in first-out, so anything written (and awaited) after
        it is durable only once this is too. Its result (or error) is the
        returned handle's, once that commit is done."""
        op = _Write(fn)
        self._pending.append(op)
        self._wake.set()
        return PendingWrite(self, op, self._batch_done)

    async def probe(self) -> bool:
        """Try a write that touches the file (the header's user_version, set
        to itself); True when it went through. Clears ``failing`` then."""
        def touch(conn: sqlite3.Connection) -> None:
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            conn.execute(f"PRAGMA user_version={int(version)}")
        try:
            await self.write(touch)
        except sqlite3.Error:
            return False
        return True

    def _begin_now(self) -> bool:
        """Take the write lock without waiting; False when someone else holds
        it (another process writing the file: an operator's sqlite3 shell, a
        backup). The writer connection's busy timeout is 0 for this."""
        conn = self._writer_conn
        assert conn is not None
        try:
            conn.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as exc:
            if exc.sqlite_errorcode in (sqlite3.SQLITE_BUSY, sqlite3.SQLITE_LOCKED):
                return False
            raise
        return True

    def _apply_waiting(self, ops: list[_Write]) -> None:
        """`_apply` for a worker thread, waiting up to the busy timeout for the
        write lock instead of failing at once."""
        conn = self._writer_conn
        assert conn is not None
        conn.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
        try:
            self._apply(ops)
        finally:
            conn.execute("PRAGMA busy_timeout=0")

    def _apply(self, ops: list[_Write], *, begun: bool = False) -> None:
        """One transaction for the whole batch. Should any write fail, the
        batch is rolled back and replayed one write per transaction, so one
        bad write never takes the others with it."""
        conn = self._writer_conn
        assert conn is not None
        try:
            if not begun:
                conn.execute("BEGIN IMMEDIATE")
            for op in ops:
                op.result = op.fn(conn)
            conn.execute("COMMIT")
            return
        except Exception:  # noqa: BLE001 -- replayed below, one by one
            if conn.in_transaction:
                conn.execute("ROLLBACK")
        for op in ops:
            try:
                conn.execute("BEGIN IMMEDIATE")
                op.result = op.fn(conn)
                conn.execute("COMMIT")
            except Exception as exc:  # noqa: BLE001 -- reported to that write's caller
                if conn.in_transaction:
                    conn.execute("ROLLBACK")
                op.error = exc
                log.warning("write failed: %s", exc)

    async def _run_writer(
        self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        while True:
            await self._wake.wait()
            await self._flush()

    async def _run_checkpoints(self) -> None:
        """Copy the write-ahead log into the database file now and then, off
        the trio thread, so the log stays short and commits stay cheap."""
        checkpointed = self.commits
        while True:
            await trio.sleep(CHECKPOINT_SECONDS)
            if self.commits != checkpointed:
                checkpointed = self.commits
                try:
                    await self.read(
                        lambda c: c.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
                    )
                except sqlite3.Error as exc:
                    # Nothing is lost (the log still holds every commit) and the
                    # next second tries again; serving goes on.
                    log.warning("WAL checkpoint failed: %s", exc)

    async def _flush(self) -> None:
        self._wake = trio.Event()
        ops, done = self._pending, self._batch_done
        if not ops:
            return
        self._pending, self._batch_done = [], trio.Event()
        try:
            if self._begin_now():
                self._apply(ops, begun=True)  # on the trio thread: see the module docstring
            else:
                await trio.to_thread.run_sync(self._apply_waiting, ops)
        except sqlite3.Error as exc:
            # The file failed before any write could start (an I/O error at
            # BEGIN): each write of the batch fails with it, and the writer
            # lives on for the next batch -- a dead writer would wedge every run.
            log.warning("group commit failed: %s", exc)
            for op in ops:
                op.error = op.error or exc
        except BaseException as exc:
            for op in ops:
                op.error = op.error or exc
            raise
        finally:
            self.commits += 1
            self.writes += len(ops)
            done.set()

    # -- reading -----------------------------------------------------------

    async def read(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        async with self._read_limiter:
            return await trio.to_thread.run_sync(self._read_sync, fn)

    def read_now(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Blocking read on the trio thread: only for start-up, before serving."""
        assert self._writer_conn is not None
        return fn(self._writer_conn)

    # -- the writes the broker makes -----------------------------------------

    async def move(self, run_id: str, to: str, **changes: Any) -> bool:
        """Guarded status write, with any events and metadata that go with it,
        in one transaction, and ``then`` after it when it moved (the changes
        are ``_move_write``'s). Returns False (and writes nothing) when the run
        is not in a status the move starts from. ``move_soon`` queues the same
        write without waiting for it."""
        return await self.write(self._move_write(run_id, to, **changes))

    def move_soon(self, run_id: str, to: str, *, metadata: dict[str, Any] | None = None,
                  stamp: tuple[str, float] | None = None) -> PendingWrite:
        """``move`` queued without waiting (first-in first-out): whatever is
        written after it lands after it. Its verdict is the handle's result."""
        return self.write_soon(self._move_write(run_id, to, metadata=metadata, stamp=stamp))

    def _move_write(
        self, run_id: str, to: str, *, metadata: dict[str, Any] | None = None,
        events: Iterable[tuple[int, dict[str, Any]]] = (),
        stamp: tuple[str, float | None] | None = None,
        run_input: dict[str, Any] | None = None, arrival: int | None = None,
        caller_metadata: str | None = None,
        then: Callable[[sqlite3.Connection], Any] | None = None,
    ) -> Callable[[sqlite3.Connection], bool]:
        src = tuple(statuses.sources(to))
        sets: list[str] = ["status=?"]
        args: list[Any] = [to]
        if metadata is not None:
            sets.append("metadata=?")
            args.append(dumps(metadata))
        if stamp is not None:
            column, when = stamp
            sets.append(f"{column}=?")
            args.append(when)
        if run_input is not None:
            sets.append("input=?")
            args.append(dumps(run_input))
        if arrival is not None:
            sets.append("arrival=?")
            args.append(arrival)
        if caller_metadata is not None:
            sets.append("caller_metadata=?")
            args.append(caller_metadata)
        sql = (f"UPDATE runs SET {', '.join(sets)} WHERE id=? AND status IN "
               f"({','.join('?' * len(src))})")
        rows = [(run_id, seq, dumps(ev)) for seq, ev in events]

        def apply(conn: sqlite3.Connection) -> bool:
            moved = conn.execute(sql, (*args, run_id, *src)).rowcount == 1
            if moved and rows:
                conn.executemany("INSERT INTO events (run_id, seq, event) VALUES (?,?,?)", rows)
            if moved and then is not None:
                then(conn)
            if not moved:
                log.error("run %s: guarded write to %r refused", run_id, to)
            return moved

        return apply

    async def append_events(self, run_id: str, events: list[tuple[int, dict[str, Any]]]) -> None:
        rows = [(run_id, seq, dumps(event)) for seq, event in events]
        await self.write(
            lambda c: c.executemany("INSERT INTO events (run_id, seq, event) VALUES (?,?,?)", rows)
        )


@asynccontextmanager
async def open_record(path: Path) -> AsyncIterator[Record]:
    """Open the record and run its writer; on the way out, commit whatever
    is still waiting before the file is closed."""
    record = Record(path)
    await trio.to_thread.run_sync(record._open_sync)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(record._run_writer)
            nursery.start_soon(record._run_checkpoints)
            try:
                yield record
            finally:
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await record._flush()
            if record._writer_conn is not None:
                record._writer_conn.close()
            with record._readers_lock:
                idle, record._idle_readers = record._idle_readers, []
            for conn in idle:
                conn.close()
