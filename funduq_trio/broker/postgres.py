"""The PostgreSQL store: ``FUNDUQ_DATABASE_URL=postgresql://user@host:port/db``.

The same record as the SQLite store (``store.py`` has the interface and the
domain's SQL both speak), kept in the database the operator already runs.

Driver: psycopg 3, its plain (synchronous) connections driven from worker
threads (``trio.to_thread``) -- trio has no PostgreSQL driver of its own, and
a thread per call is what the SQLite store's reads already pay; the measured
choice over asyncpg under trio-asyncio (docs/record.md). One writer
connection takes the group commits (each batch one pipelined transaction, in
a worker thread, first-in first-out as on SQLite); up to ``READERS`` reader
connections serve reads, each in autocommit so every read sees the latest
commit. A connection the server dropped is thrown away and a new one made on
the next use; until then the failure is the medium's (``record_trouble``):
funduq is not ready and the lanes retry, as on a full disk.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import trio

from . import schema
from .store import RecordUnreachable, SqlStore, _Write

T = TypeVar("T")
log = logging.getLogger("funduq.record")


def _migration(version: int, sql: str) -> schema.Migration:
    """Step ``version`` of the PostgreSQL schema: the SQLite store's step of
    that number (``schema.MIGRATIONS``), in PostgreSQL's types."""
    return schema.Migration(version, schema.MIGRATIONS[version - 1].why, sql)


#: The schema, versioned in step with the SQLite store's (``schema.py``): step
#: n here is step n there. Created and upgraded at start (``_open_sync``),
#: all pending steps in one transaction under an advisory lock, so nodes
#: starting together on one database apply each step once. Adding a table is
#: one entry at the end of both lists.
MIGRATIONS: tuple[schema.Migration, ...] = (
    _migration(
        1,
        """
CREATE TABLE providers (
    key TEXT PRIMARY KEY,
    fingerprint TEXT NOT NULL,
    misdeclared BIGINT NOT NULL DEFAULT 0,
    unanswered BIGINT NOT NULL DEFAULT 0,
    abandoned BIGINT NOT NULL DEFAULT 0,
    undelivered BIGINT NOT NULL DEFAULT 0
);
CREATE INDEX providers_fingerprint ON providers (fingerprint);
CREATE TABLE agents (
    ord BIGSERIAL,
    provider_key TEXT NOT NULL,
    name TEXT NOT NULL,
    description TEXT NOT NULL DEFAULT '',
    card TEXT NOT NULL DEFAULT '{}',
    metadata TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (provider_key, name)
);
CREATE TABLE threads (
    id TEXT COLLATE "C" PRIMARY KEY,
    provider_key TEXT NOT NULL,
    agent_name TEXT NOT NULL,
    segment_head TEXT,
    created_at DOUBLE PRECISION NOT NULL
);
CREATE TABLE runs (
    arrival BIGINT NOT NULL,
    id TEXT COLLATE "C" PRIMARY KEY,
    thread_id TEXT NOT NULL,
    provider_key TEXT NOT NULL,
    agent_name TEXT NOT NULL,
    status TEXT NOT NULL,
    input TEXT NOT NULL,
    caller_metadata TEXT NOT NULL DEFAULT '{}',
    metadata TEXT NOT NULL DEFAULT '{}',
    created_at DOUBLE PRECISION NOT NULL,
    started_at DOUBLE PRECISION,
    completed_at DOUBLE PRECISION
);
CREATE INDEX runs_thread ON runs (thread_id, arrival);
CREATE INDEX runs_status ON runs (status, arrival);
CREATE INDEX runs_arrival ON runs (arrival);
CREATE TABLE events (
    run_id TEXT NOT NULL,
    seq BIGINT NOT NULL,
    event TEXT NOT NULL,
    PRIMARY KEY (run_id, seq)
);
CREATE TABLE messages (
    thread_id TEXT NOT NULL,
    idx BIGINT NOT NULL,
    message_id TEXT NOT NULL,
    run_id TEXT,
    message TEXT NOT NULL,
    PRIMARY KEY (thread_id, idx)
);
""",
    ),
    # Ids compare bytewise ("C" above), as SQLite's do: the keyset below pages by id.
    _migration(
        2,
        """
CREATE INDEX threads_segment_head ON threads (segment_head);
CREATE INDEX runs_agent ON runs (provider_key, agent_name, arrival);
CREATE INDEX runs_agent_status_time ON runs
    (provider_key, agent_name, (COALESCE(completed_at, started_at, created_at)), id);
""",
    ),
    _migration(
        3,
        """
CREATE TABLE llm_providers (
    key TEXT PRIMARY KEY,
    completions BIGINT NOT NULL DEFAULT 0,
    refused BIGINT NOT NULL DEFAULT 0,
    failed BIGINT NOT NULL DEFAULT 0
);
CREATE TABLE llm_offerings (
    provider_key TEXT NOT NULL,
    name TEXT NOT NULL,
    description TEXT NOT NULL DEFAULT '',
    metadata TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (provider_key, name)
);
""",
    ),
    _migration(
        4,
        """
CREATE TABLE push_configs (
    task_id TEXT NOT NULL,
    id TEXT COLLATE "C" NOT NULL,
    url TEXT NOT NULL,
    token TEXT NOT NULL DEFAULT '',
    authentication TEXT NOT NULL DEFAULT '{}',
    created_at DOUBLE PRECISION NOT NULL,
    cursor_seq BIGINT NOT NULL DEFAULT 0,
    cursor_index BIGINT NOT NULL DEFAULT -1,
    state TEXT NOT NULL DEFAULT 'delivering',
    attempts BIGINT NOT NULL DEFAULT 0,
    last_error TEXT,
    PRIMARY KEY (task_id, id)
);
CREATE INDEX push_configs_state ON push_configs (state);
""",
    ),
    _migration(
        5,
        """
DROP INDEX runs_agent_status_time;
DROP INDEX runs_agent;
CREATE INDEX runs_agent_listing ON runs
    (provider_key, agent_name, arrival, completed_at, started_at, created_at, id);
""",
    ),
)

#: The advisory lock key schema creation holds (any fixed number; "funduq").
SCHEMA_LOCK = 0x66756E647571
#: Seconds a new connection may take before the attempt fails.
CONNECT_TIMEOUT_SECONDS = 10

_PLACEHOLDER = re.compile(r"\?")


def to_pyformat(sql: str) -> str:
    """The shared SQL's ``?`` placeholders as psycopg's ``%s`` (a literal
    ``%`` doubled). The shared SQL has no ``?`` inside string literals."""
    return _PLACEHOLDER.sub("%s", sql.replace("%", "%%"))


class _Pipelined:
    """A statement's cursor in pipeline mode: its result arrives at the next
    sync, so reading its row count syncs first (fetching rows syncs by
    itself). Statements whose results nobody reads cost no round trip."""

    __slots__ = ("_cursor", "_pipeline")

    def __init__(self, cursor: Any, pipeline: Any) -> None:
        self._cursor, self._pipeline = cursor, pipeline

    @property
    def rowcount(self) -> int:
        self._pipeline.sync()
        return int(self._cursor.rowcount)

    def fetchone(self) -> Any:
        return self._cursor.fetchone()

    def fetchall(self) -> list[Any]:
        return list(self._cursor.fetchall())


class PgConnection:
    """A psycopg connection that speaks the shared SQL (``?`` placeholders),
    with sqlite3's ``execute``/``executemany`` shape. While ``pipeline`` is
    set (the writer's batches), statements are pipelined."""

    __slots__ = ("raw", "_sql", "pipeline")

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self._sql: dict[str, str] = {}
        self.pipeline: Any = None

    def _convert(self, sql: str) -> str:
        converted = self._sql.get(sql)
        if converted is None:
            converted = self._sql[sql] = to_pyformat(sql)
        return converted

    def execute(self, sql: str, params: Sequence[Any] = ()) -> Any:
        cursor = self.raw.execute(self._convert(sql), tuple(params))
        return cursor if self.pipeline is None else _Pipelined(cursor, self.pipeline)

    def executemany(self, sql: str, rows: Sequence[Sequence[Any]]) -> Any:
        cursor = self.raw.cursor()
        cursor.executemany(self._convert(sql), list(rows))
        return cursor

    @property
    def usable(self) -> bool:
        return not self.raw.closed and not self.raw.broken

    @property
    def in_transaction(self) -> bool:
        import psycopg

        return bool(self.raw.info.transaction_status != psycopg.pq.TransactionStatus.IDLE)

    def close(self) -> None:
        self.raw.close()


def upgrade(
    conn: PgConnection, where: str, migrations: tuple[schema.Migration, ...] = MIGRATIONS
) -> list[int]:
    """Bring the database to the latest schema version: every pending step in
    one transaction, under the schema lock, the version in ``schema_version``.
    Returns the versions applied; raises SchemaTooNew (writing nothing) on a
    database a newer build wrote."""
    conn.execute("BEGIN")
    try:
        conn.execute("SELECT pg_advisory_xact_lock(?)", (SCHEMA_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER NOT NULL)")
        row = conn.execute("SELECT version FROM schema_version").fetchone()
        try:
            steps = schema.plan(0 if row is None else int(row[0]), migrations)
        except schema.SchemaTooNew as exc:
            raise schema.SchemaTooNew(f"{where}: {exc}") from None
        for step in steps:
            for statement in step.sql.split(";"):
                if statement.strip():
                    conn.raw.execute(statement)
            log.info("%s: schema upgraded to version %d (%s)", where, step.version, step.why)
        if steps:
            conn.execute("DELETE FROM schema_version")
            conn.execute("INSERT INTO schema_version (version) VALUES (?)", (steps[-1].version,))
        conn.execute("COMMIT")
    except BaseException:
        if conn.usable and conn.in_transaction:
            conn.execute("ROLLBACK")
        raise
    return [step.version for step in steps]


class PostgresStore(SqlStore):
    """The PostgreSQL record. Open it with ``store.open_store(settings)``."""

    EVENT_TYPE = "(e.event::json ->> 'type')"
    AGENT_ORDER = "ord"

    def __init__(self, url: str) -> None:
        super().__init__()
        self.url = url
        self._writer_conn: PgConnection | None = None
        self._idle_readers: list[PgConnection] = []
        self._readers_lock = threading.Lock()

    # -- connections -------------------------------------------------------------------

    def _connect(self) -> PgConnection:
        import psycopg

        raw = psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_SECONDS)
        return PgConnection(raw)

    def _open_sync(self) -> None:
        import psycopg

        try:
            conn = self._connect()
        except psycopg.OperationalError as exc:
            reason = " ".join(line.strip() for line in str(exc).splitlines()) or repr(exc)
            raise RecordUnreachable(f"{self.where} does not answer: {reason}") from None
        try:
            upgrade(conn, self.where)
        except BaseException:
            conn.close()
            raise
        self._writer_conn = conn

    @property
    def where(self) -> str:
        """The database, named without its password (for messages)."""
        from psycopg import conninfo

        try:
            info = conninfo.conninfo_to_dict(self.url)
        except Exception:  # noqa: BLE001 -- a name for messages only
            return "the PostgreSQL record"
        return (
            f"PostgreSQL database {info.get('dbname', '?')} on "
            f"{info.get('host', 'localhost')}:{info.get('port', 5432)}"
        )

    def _close_sync(self) -> None:
        if self._writer_conn is not None:
            self._writer_conn.close()
        with self._readers_lock:
            idle, self._idle_readers = self._idle_readers, []
        for conn in idle:
            conn.close()

    def _medium_error(self, exc: BaseException) -> bool:
        import psycopg

        return isinstance(exc, psycopg.Error)

    def _touch(self, conn: PgConnection) -> None:
        # A transaction id makes the commit write to the server's log.
        conn.execute("SELECT pg_current_xact_id()").fetchone()

    # -- writing -----------------------------------------------------------------------

    async def _commit(self, ops: list[_Write]) -> None:
        await trio.to_thread.run_sync(self._apply, ops)

    def _writer(self) -> PgConnection:
        conn = self._writer_conn
        if conn is None or not conn.usable:
            if conn is not None:
                conn.close()
            self._writer_conn = None
            conn = self._writer_conn = self._connect()
        return conn

    def _apply(self, ops: list[_Write]) -> None:
        """One transaction for the whole batch, pipelined: its statements go
        out together and only a guarded move's verdict waits for a round
        trip. Should any write fail, the batch is rolled back and replayed
        one write per transaction (not pipelined, so each error is its own
        write's), so one bad write never takes the others with it."""
        conn = self._writer()
        try:
            with conn.raw.pipeline() as pipeline:
                conn.pipeline = pipeline
                conn.execute("BEGIN")
                for op in ops:
                    op.result = op.fn(conn)
                conn.execute("COMMIT")
            return
        except Exception:  # noqa: BLE001 -- replayed below, one by one
            conn.pipeline = None
            self._roll_back(conn)
        finally:
            conn.pipeline = None
        for op in ops:
            try:
                conn = self._writer()
                conn.execute("BEGIN")
                op.result = op.fn(conn)
                conn.execute("COMMIT")
            except Exception as exc:  # noqa: BLE001 -- reported to that write's caller
                self._roll_back(conn)
                op.error = exc
                log.warning("write failed: %s", exc)

    @staticmethod
    def _roll_back(conn: PgConnection) -> None:
        if conn.usable and conn.in_transaction:
            try:
                conn.execute("ROLLBACK")
            except Exception:  # noqa: BLE001 -- the connection is dropped instead
                conn.close()

    # -- reading -----------------------------------------------------------------------

    def _read_sync(self, fn: Callable[[Any], T]) -> T:
        """In a worker thread: ``fn`` on an idle reader connection (a new one
        when none is idle; the read limiter keeps them to READERS). A
        connection that failed is closed, not kept; a pooled one the server
        had dropped meanwhile is replaced and the read tried once more
        (reads change nothing)."""
        import psycopg

        with self._readers_lock:
            conn = self._idle_readers.pop() if self._idle_readers else None
        fresh = conn is None or not conn.usable
        while True:
            if conn is None or not conn.usable:
                conn = self._connect()
            try:
                return fn(conn)
            except psycopg.OperationalError:
                if fresh or conn.usable:
                    raise
                fresh = True  # it died while idle: once more, on a new one
            finally:
                if conn.usable:
                    with self._readers_lock:
                        self._idle_readers.append(conn)
                else:
                    conn.close()

    def read_now(self, fn: Callable[[Any], T]) -> T:
        """Blocking read on the trio thread: only for start-up and tests."""
        return self._read_sync(fn)
