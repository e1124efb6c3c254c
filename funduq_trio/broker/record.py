"""The SQLite store: everything funduq observed, in one SQLite file (WAL).
The zero-configuration default; ``store.py`` has the interface and what the
two stores share, ``postgres.py`` the other store.

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

import logging
import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import AbstractAsyncContextManager, contextmanager
from pathlib import Path
from typing import TypeVar

import trio

from . import schema

# The shared parts, importable from here as before the record had two stores.
from .store import (  # noqa: F401
    COUNTERS,
    NoRecord,
    PendingWrite,
    SqlStore,
    _Write,
    dumps,
    iso,
    record_trouble,
    run_store,
)

T = TypeVar("T")
log = logging.getLogger("funduq.record")


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
#: A checkpoint pass copies what was committed before it began. The log
#: starts over from its beginning (at the writer's next commit) only after a
#: pass during which nothing was committed; under steady load one pass a
#: second almost never is, and the log grew for as long as the load lasted
#: (95-200 MB in 35 s of bench/e2e.py). So while the log is longer than
#: CATCH_UP_FRAMES pages and commits landed during the last pass, up to
#: CATCH_UP_PASSES more passes follow at once, each copying only the little
#: committed during the one before, until one falls in a gap between commits.
CATCH_UP_PASSES = 8
CATCH_UP_FRAMES = 4096
#: A log file that a burst grew past this size (bytes) is truncated at the
#: first second without commits, so the burst does not keep its disk space.
#: A log under it keeps its size: it starts over from its beginning in place.
LOG_SIZE_LIMIT = 64 * 1024 * 1024
#: How long that truncation waits for the write lock, and then, holding it,
#: for readers to leave the log. Commits wait as long (in a worker thread),
#: so it is short: a reader on a long query makes it give up, and the next
#: quiet second tries again.
CUT_BACK_WAIT_MS = 20


class SqliteStore(SqlStore):
    """The SQLite record. Use ``async with open_record(path) as record``."""

    READERS = READERS

    def __init__(self, path: Path, *, create: bool = True) -> None:
        super().__init__(create=create)
        self.path = path
        self._idle_readers: list[sqlite3.Connection] = []
        self._readers_lock = threading.Lock()
        self._writer_conn: sqlite3.Connection | None = None
        #: The writer connection's one cursor: every write's statements run
        #: on it (``conn.execute`` made a cursor, registered by weak
        #: reference with its connection, a statement).
        self._writer_cursor: sqlite3.Cursor | None = None

    # -- connections -------------------------------------------------------

    def _connect(self) -> sqlite3.Connection:
        # Opened without create, a file that vanished meanwhile is an error,
        # never a new empty one.
        where = self.path if self.create else self.path.resolve().as_uri() + "?mode=rw"
        conn = sqlite3.connect(
            where, check_same_thread=False, isolation_level=None, uri=not self.create
        )
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
        if self.create:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        else:
            self._check_exists()
        conn = self._connect()
        try:
            # Tables are created and upgraded here, and only here: schema.py.
            schema.upgrade(conn, str(self.path))
        except BaseException:
            conn.close()
            raise
        # Commits never checkpoint (that fsyncs, on the loop): _run_checkpoints
        # does. Nor do they wait for the write lock on the loop: _begin_now.
        # Nor do they truncate the log (journal_size_limit stays SQLite's -1):
        # a commit that starts an oversized log over would cut it on the loop,
        # and freeing a file's pages takes the kernel ~0.3 ms a MB (a 20-40 ms
        # stall after a burst). _cut_back does it, when the writer is idle.
        conn.execute("PRAGMA wal_autocheckpoint=0")
        conn.execute("PRAGMA busy_timeout=0")
        self._writer_conn = conn
        self._writer_cursor = conn.cursor()

    def _check_exists(self) -> None:
        """NoRecord unless the file exists and holds funduq's tables; looked
        at read-only, before anything (WAL mode, say) is written to it."""
        if not self.path.is_file():
            raise NoRecord(f"no record at {self.path}")
        conn = sqlite3.connect(self.path.resolve().as_uri() + "?mode=ro", uri=True)
        try:
            if schema._version_of(conn) == 0:
                raise NoRecord(f"no record at {self.path} (the file holds no funduq tables)")
        finally:
            conn.close()

    def _close_sync(self) -> None:
        if self._writer_conn is not None:
            self._writer_conn.close()
        with self._readers_lock:
            idle, self._idle_readers = self._idle_readers, []
        for conn in idle:
            conn.close()

    def _medium_error(self, exc: BaseException) -> bool:
        return isinstance(exc, sqlite3.Error)

    def _touch(self, conn: sqlite3.Connection) -> None:
        # The file header's user_version, set to itself.
        version = conn.execute("PRAGMA user_version").fetchone()[0]
        conn.execute(f"PRAGMA user_version={int(version)}")

    # -- writing -----------------------------------------------------------

    async def _commit(self, ops: list[_Write]) -> None:
        if self._begin_now():
            self._apply(ops, begun=True)  # on the trio thread: see the module docstring
        else:
            await trio.to_thread.run_sync(self._apply_waiting, ops)

    def _begin_now(self) -> bool:
        """Take the write lock without waiting; False when someone else holds
        it (another process writing the file: an operator's sqlite3 shell, a
        backup). The writer connection's busy timeout is 0 for this."""
        cursor = self._writer_cursor
        assert cursor is not None
        try:
            cursor.execute("BEGIN IMMEDIATE")
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
        with _busy_timeout(conn, BUSY_TIMEOUT_MS, then=0):
            self._apply(ops)

    def _apply(self, ops: list[_Write], *, begun: bool = False) -> None:
        """One transaction for the whole batch. Should any write fail, the
        batch is rolled back and replayed one write per transaction, so one
        bad write never takes the others with it. Each write's statements run
        on the writer's one cursor (a write is handed it as its connection:
        ``execute``, ``executemany``, ``fetchone``, ``rowcount``), one after
        another."""
        conn, cursor = self._writer_conn, self._writer_cursor
        assert conn is not None and cursor is not None
        try:
            if not begun:
                cursor.execute("BEGIN IMMEDIATE")
            for op in ops:
                op.result = op.fn(cursor)
            cursor.execute("COMMIT")
            return
        except Exception:  # noqa: BLE001 -- replayed below, one by one
            if conn.in_transaction:
                cursor.execute("ROLLBACK")
        for op in ops:
            try:
                op.result = None  # not the rolled-back attempt's (see store._chained)
                cursor.execute("BEGIN IMMEDIATE")
                op.result = op.fn(cursor)
                cursor.execute("COMMIT")
            except Exception as exc:  # noqa: BLE001 -- reported to that write's caller
                if conn.in_transaction:
                    cursor.execute("ROLLBACK")
                op.error = exc
                log.warning("write failed: %s", exc)

    async def _background(self) -> None:
        await self._run_checkpoints()

    async def _run_checkpoints(self) -> None:
        """Copy the write-ahead log into the database file now and then, off
        the trio thread, so the log stays short and commits stay cheap."""
        checkpointed = self.commits
        # Whether the log is known to be within LOG_SIZE_LIMIT; not at start
        # (a crash may have left it oversized), nor after a second of commits.
        log_within_limit = False
        while True:
            await trio.sleep(CHECKPOINT_SECONDS)
            try:
                if self.commits != checkpointed:
                    checkpointed = self.commits
                    log_within_limit = False
                    await self._checkpoint_all()
                elif not log_within_limit:
                    log_within_limit = await self.read(self._cut_back)
            except sqlite3.Error as exc:
                # Nothing is lost (the log still holds every commit) and the
                # next second tries again; serving goes on.
                log.warning("WAL checkpoint failed: %s", exc)

    async def _checkpoint_all(self) -> None:
        """A pass, then more (see CATCH_UP_PASSES) while commits kept the log
        from starting over."""
        for _ in range(1 + CATCH_UP_PASSES):
            commits = self.commits
            _, log_frames, copied = await self.read(self._checkpoint)
            if log_frames <= CATCH_UP_FRAMES:
                return  # short enough, whether or not it starts over
            if self.commits == commits and copied >= log_frames:
                return  # all of it copied, nothing since: the next commit restarts it

    @staticmethod
    def _checkpoint(conn: sqlite3.Connection) -> tuple[int, int, int]:
        """One PASSIVE checkpoint, on a reader connection in a worker thread:
        (busy, frames in the log, frames copied). PASSIVE never waits for a
        lock, so the writer is never held up by it."""
        busy, log_frames, copied = conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        return busy, log_frames, copied

    def _cut_back(self, conn: sqlite3.Connection) -> bool:
        """In a worker thread, after a second without commits: a log file
        over LOG_SIZE_LIMIT is truncated (a TRUNCATE checkpoint: the rest of
        the log copied, then the file cut to nothing). It holds the write
        lock meanwhile; a commit that comes then goes to a worker thread and
        waits for it (`_commit`), and the loop serves on. False when the log
        is still over the limit (a reader or another process kept the
        checkpoint from finishing within CUT_BACK_WAIT_MS): the next quiet
        second tries again."""
        log_file = self.path.with_name(self.path.name + "-wal")
        try:
            if log_file.stat().st_size <= LOG_SIZE_LIMIT:
                return True
        except FileNotFoundError:
            return True
        with _busy_timeout(conn, CUT_BACK_WAIT_MS, then=BUSY_TIMEOUT_MS):
            busy, _, _ = conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchone()
        return not busy

    # -- reading -----------------------------------------------------------

    def read_now(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Blocking read on the trio thread: only for start-up, before serving."""
        assert self._writer_conn is not None
        return fn(self._writer_conn)


@contextmanager
def _busy_timeout(conn: sqlite3.Connection, ms: int, *, then: int) -> Iterator[None]:
    """The connection waits up to `ms` for a lock inside, `then` after."""
    conn.execute(f"PRAGMA busy_timeout={int(ms)}")
    try:
        yield
    finally:
        conn.execute(f"PRAGMA busy_timeout={int(then)}")


#: The SQLite store under its old name.
Record = SqliteStore


def open_record(path: Path) -> AbstractAsyncContextManager[SqlStore]:
    """Open the SQLite record at ``path`` and run its writer; on the way out,
    commit whatever is still waiting before the file is closed."""
    return run_store(SqliteStore(path))
