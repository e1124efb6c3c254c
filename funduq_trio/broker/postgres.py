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

Several nodes may share the database (docs/cluster.md): every transaction
that adds events to a run or moves it also sends one ``NOTIFY`` per run it
touched (``CHANNEL``; the payload is the run id, its last seq written and
whether its status changed), and ``listen`` holds one connection that
``LISTEN``s and tells the broker which runs changed. The notification only
says "read again": the record is what a follower reads, by seq.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import trio

from ..protocol import statuses
from . import schema
from .store import (
    PUSH_COLUMNS,
    PUSH_DELIVERING,
    ROSTER_NOTICE,
    NoRecord,
    NotLeader,
    PendingWrite,
    RecordUnreachable,
    SqlStore,
    _Write,
)

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
    # A proof spent on one node is spent on all (SqlStore.spend_proof): its
    # signer's key and the SHA-256 of the signed payload, kept until no
    # node's clock can take it as fresh any more.
    _migration(
        5,
        """
CREATE TABLE spent_proofs (
    signer TEXT NOT NULL,
    payload TEXT NOT NULL,
    keep_until DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (signer, payload)
);
CREATE INDEX spent_proofs_keep_until ON spent_proofs (keep_until);
""",
    ),
    # docs/cluster.md. A thread's runs are ordered by the node holding its
    # lease; expiry is on the database's clock, so nodes' clocks never matter.
    # funduq_lead is the fence: a transaction that wrote a run's events or
    # inserted a run calls it once per thread before COMMIT (a guarded move
    # has the same check in its own UPDATE, see _FENCED_MOVE) and is refused
    # unless the run's thread is the writer's (FOR SHARE: a takeover waits
    # for a write in flight, and the new leader reads what it wrote).
    # Arrivals come from one sequence, so a thread's runs keep their order
    # when its lease moves from node to node.
    _migration(
        6,
        """
CREATE TABLE thread_leases (
    thread_id TEXT COLLATE "C" PRIMARY KEY,
    node TEXT NOT NULL,
    expires_at TIMESTAMPTZ NOT NULL
);
CREATE INDEX thread_leases_node ON thread_leases (node);
CREATE INDEX thread_leases_expiry ON thread_leases (expires_at);
CREATE FUNCTION funduq_lead(thread TEXT, me TEXT) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF thread IS NULL THEN
        RETURN;
    END IF;
    PERFORM 1 FROM thread_leases WHERE thread_id = thread AND node = me FOR SHARE;
    IF NOT FOUND THEN
        RAISE EXCEPTION 'funduq_not_leader: % is led by another node than %', thread, me;
    END IF;
END
$$;
CREATE SEQUENCE run_arrivals;
SELECT setval('run_arrivals', (SELECT COALESCE(MAX(arrival), 0) + 1 FROM runs), false);
""",
    ),
    _migration(
        7,
        """
DROP INDEX runs_agent_status_time;
DROP INDEX runs_agent;
CREATE INDEX runs_agent_listing ON runs
    (provider_key, agent_name, arrival, completed_at, started_at, created_at, id);
""",
    ),
    # docs/cluster.md. A push config is delivered by the node holding its
    # delivery lease (expiry on the database's clock); a node advances the
    # config's cursor only while the lease is its own. Configs from before
    # this step hold no lease: the first node to start claims them.
    _migration(
        8,
        """
ALTER TABLE push_configs ADD COLUMN lease_node TEXT;
ALTER TABLE push_configs ADD COLUMN lease_expires TIMESTAMPTZ;
""",
    ),
    # docs/cluster.md, "Forwarding": each node's heartbeat and the URL other
    # nodes reach it at; the agents each node's provider links serve now (a
    # dead node's rows are ignored once its heartbeat lapsed, then swept);
    # the secret forwarded calls between nodes are signed with, made once.
    _migration(
        9,
        """
CREATE TABLE cluster_nodes (
    node TEXT PRIMARY KEY,
    url TEXT NOT NULL DEFAULT '',
    expires_at TIMESTAMPTZ NOT NULL
);
CREATE TABLE served (
    provider_key TEXT NOT NULL,
    agent_name TEXT NOT NULL,
    node TEXT NOT NULL,
    PRIMARY KEY (provider_key, agent_name, node)
);
CREATE INDEX served_node ON served (node);
CREATE TABLE cluster_secret (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    secret TEXT NOT NULL
);
""",
    ),
    _migration(
        10,
        """
DROP INDEX threads_segment_head;
CREATE INDEX threads_segment_head ON threads (segment_head) WHERE segment_head IS NOT NULL;
""",
    ),
)

#: The advisory lock key schema creation holds (any fixed number; "funduq").
SCHEMA_LOCK = 0x66756E647571
#: Seconds a new connection may take before the attempt fails.
CONNECT_TIMEOUT_SECONDS = 10
#: The notification channel of the runs' changes; one per schema (a schema
#: holds one funduq), so this name and the schema's (``channel_for``).
CHANNEL = "funduq_runs"
#: The LISTEN connection's reconnect backoff: first wait, longest wait (seconds).
LISTEN_RETRY = (0.05, 5.0)
#: A LISTEN connection that held this long is made again at once when lost;
#: one lost sooner is made again after the backoff's wait.
LISTEN_STEADY_SECONDS = 1.0
#: TCP keepalives on the LISTEN connection, which otherwise only ever reads:
#: a peer gone without a word (a cut network) is noticed within about
#: idle + interval * count seconds, and the connection made again.
LISTEN_KEEPALIVES: dict[str, Any] = {
    "keepalives": 1,
    "keepalives_idle": 10,
    "keepalives_interval": 5,
    "keepalives_count": 3,
}

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

    __slots__ = ("raw", "_sql", "pipeline", "changes", "fenced_runs", "fenced_threads")

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self._sql: dict[str, str] = {}
        self.pipeline: Any = None
        #: The runs the open transaction changed: run id -> [last seq, status
        #: changed], told at its commit (``PostgresStore._notify``).
        self.changes: dict[str, list[Any]] = {}
        #: The runs and threads the open transaction wrote that must be this
        #: node's at its commit, checked once each just before it
        #: (``PostgresStore._check_fences``).
        self.fenced_runs: set[str] = set()
        self.fenced_threads: set[str] = set()

    def begin(self) -> None:
        """A transaction starts: nothing to tell or check yet."""
        self.changes.clear()
        self.fenced_runs.clear()
        self.fenced_threads.clear()
        self.execute("BEGIN")

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
            for statement in statements(step.sql):
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


def _has_schema(conn: PgConnection) -> bool:
    """Whether the database (its search path) holds funduq's schema."""
    return conn.execute("SELECT to_regclass('schema_version')").fetchone()[0] is not None


def statements(sql: str) -> list[str]:
    """A step's SQL cut at its semicolons, except inside a ``$$``-quoted body
    (a function's)."""
    found, pending = [], ""
    for i, piece in enumerate(sql.split("$$")):
        if i % 2:  # inside $$ ... $$
            pending += "$$" + piece + "$$"
            continue
        *complete, rest = piece.split(";")
        for part in complete:
            pending += part
            if pending.strip():
                found.append(pending.strip())
            pending = ""
        pending += rest
    if pending.strip():
        found.append(pending.strip())
    return found


#: The message the fence raises with (see migration 6).
NOT_LEADER = "funduq_not_leader"
#: Active statuses whose runs need a leader (a paused run needs none until answered).
NEEDS_LEADER = tuple(sorted(statuses.ACTIVE - {statuses.INPUT_REQUIRED}))
_NEEDS_LEADER_SQL = ",".join(f"'{s}'" for s in NEEDS_LEADER)
#: Take the thread's lease when nobody holds it; keep (extend) it when it is
#: ours. Held by another node, lapsed or not, it is left alone: taking a
#: lapsed lease over is a claim (``claim_threads``), since the new leader
#: must first settle what the old one left (docs/cluster.md). And the write
#: is refused there and then (``funduq_lead`` raises), not only by the
#: check before COMMIT: a claim of this node's, queued after the write but
#: sharing its group commit, would make the lease ours by then, and the run
#: would be recorded -- and laned as it arrived -- ahead of the runs the old
#: leader left queued, which that claim's restore lanes after it. (Refused
#: here, too, before a stale leader's messages meet the new leader's.)
_TAKE_LEASE = (
    "INSERT INTO thread_leases (thread_id, node, expires_at) "
    "VALUES (?, ?, now() + make_interval(secs => ?)) "
    "ON CONFLICT (thread_id) DO UPDATE SET expires_at = EXCLUDED.expires_at "
    "WHERE CASE WHEN thread_leases.node = EXCLUDED.node THEN true "
    "ELSE funduq_lead(thread_leases.thread_id, EXCLUDED.node) IS NULL END"
)


#: The fence in a guarded move's WHERE: the run's thread's lease is this
#: node's, its row locked FOR SHARE for the rest of the transaction.
_FENCED_MOVE = (
    " AND EXISTS (SELECT 1 FROM thread_leases l WHERE l.thread_id = runs.thread_id "
    "AND l.node = ? FOR SHARE)"
)


class PostgresStore(SqlStore):
    """The PostgreSQL record. Open it with ``store.open_store(settings)``."""

    EVENT_TYPE = "(e.event::json ->> 'type')"
    AGENT_ORDER = "ord"
    #: Several funduq nodes may share this record (DESIGN §11).
    shared = True
    ARRIVAL = "nextval('run_arrivals')"

    def __init__(
        self,
        url: str,
        *,
        create: bool = True,
        node: str | None = None,
        lease_seconds: float = 10.0,
    ) -> None:
        super().__init__(create=create)
        self.url = url
        self.node = node
        self.lease_seconds = float(lease_seconds)
        self._writer_conn: PgConnection | None = None
        self._idle_readers: list[PgConnection] = []
        self._readers_lock = threading.Lock()
        self._changed = self._note_change
        #: Set at open, from the schema the connection uses.
        self.channel = CHANNEL
        #: The LISTEN connection's server process while it is up (for
        #: operators and tests: ``pg_terminate_backend`` drops it).
        self.listener_pid: int | None = None
        #: How many times the LISTEN connection was (re)established.
        self.listens = 0

    # -- connections -------------------------------------------------------------------

    def _connect(self) -> PgConnection:
        import psycopg

        raw = psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_SECONDS)
        return PgConnection(raw)

    @staticmethod
    def _unprepared(conn: PgConnection) -> PgConnection:
        """The writer's connection prepares no statements: in pipeline mode a
        batch that fails (a fenced write, docs/cluster.md) skips the Parse of
        statements queued behind the error, and psycopg's cache of prepared
        statements would go on naming ones the server never made ("prepared
        statement _pg3_N does not exist" on every later use). Unnamed
        statements cost a parse each, inside the same round trip."""
        conn.raw.prepare_threshold = None
        return conn

    def _open_sync(self) -> None:
        import psycopg

        try:
            conn = self._connect()
        except psycopg.OperationalError as exc:
            reason = " ".join(line.strip() for line in str(exc).splitlines()) or repr(exc)
            raise RecordUnreachable(f"{self.where} does not answer: {reason}") from None
        try:
            if not self.create and not _has_schema(conn):
                raise NoRecord(f"no record in {self.where} (no funduq schema there)")
            upgrade(conn, self.where)
            (schema_name,) = conn.execute("SELECT current_schema()").fetchone()
        except BaseException:
            conn.close()
            raise
        self.channel = channel_for(schema_name)
        self._writer_conn = self._unprepared(conn)

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

    # -- thread leases (docs/cluster.md) ---------------------------------------------------

    # The fence (docs/cluster.md). A guarded move checks the lease in its own
    # UPDATE (``_fenced_move``: the lease row locked FOR SHARE before the
    # run's row is touched). Other writes of a run (event appends, a run's
    # insert) only note its run or thread on the connection; one statement
    # just before COMMIT (``_check_fences``) then locks each noted thread's
    # lease row FOR SHARE and raises unless it names this node, which undoes
    # the whole transaction. Either way a takeover (an UPDATE of the lease
    # row) waits for a transaction that passed the fence to commit, and a
    # write from a node that lost the lease changes nothing.

    def _lead(self, conn: Any, thread_id: str) -> None:
        if self.node is None:
            return
        conn.execute(_TAKE_LEASE, (thread_id, self.node, self.lease_seconds))
        conn.fenced_threads.add(thread_id)

    def _fence(self, conn: Any, run_id: str) -> None:
        if self.node is not None:
            conn.fenced_runs.add(run_id)

    def _fenced_move(self) -> tuple[str, tuple[Any, ...]]:
        if self.node is None:
            return "", ()
        return _FENCED_MOVE, (self.node,)

    def _refused(self, conn: Any, run_id: str) -> None:
        if self.node is None:
            return
        row = conn.execute(
            "SELECT r.thread_id, EXISTS (SELECT 1 FROM thread_leases l "
            "WHERE l.thread_id = r.thread_id AND l.node = ?) FROM runs r WHERE r.id = ?",
            (self.node, run_id),
        ).fetchone()
        if row is not None and not row[1]:
            raise NotLeader(str(row[0]))

    def _check_fences(self, conn: PgConnection) -> None:
        """Before COMMIT: one statement for every run and thread the
        transaction noted (``funduq_lead`` on each thread: FOR SHARE, raises
        unless ours). Pipelined: a refusal surfaces at the commit's sync."""
        if not conn.fenced_runs and not conn.fenced_threads:
            return
        runs, threads = sorted(conn.fenced_runs), sorted(conn.fenced_threads)
        conn.fenced_runs.clear()
        conn.fenced_threads.clear()
        conn.execute(
            "SELECT funduq_lead(t, ?) FROM (SELECT thread_id FROM runs WHERE id = ANY(?) "
            "UNION SELECT unnest(?::text[])) AS x(t)",
            (self.node, runs, threads),
        )

    @staticmethod
    def _not_leader(exc: BaseException) -> NotLeader | None:
        """The fence's refusal as the broker reads it (None: another error)."""
        import psycopg

        if isinstance(exc, NotLeader):
            return exc
        if isinstance(exc, psycopg.errors.RaiseException) and NOT_LEADER in str(exc):
            what = str(exc).split(NOT_LEADER + ": ", 1)[-1].split(" is led by", 1)[0]
            return NotLeader(what.strip())
        return None

    async def renew_leases(self) -> list[str]:
        node, seconds = self.node, self.lease_seconds
        if node is None:
            return []

        def apply(conn: Any) -> list[str]:
            rows = conn.execute(
                "UPDATE thread_leases SET expires_at = now() + make_interval(secs => ?) "
                "WHERE node = ? RETURNING thread_id",
                (seconds, node),
            ).fetchall()
            return [str(r[0]) for r in rows]

        return await self.write(apply)

    async def claim_threads(
        self,
        *,
        agents: Sequence[str] | None = None,
        threads: Sequence[str] | None = None,
        unleased: bool = False,
    ) -> list[str]:
        node, seconds = self.node, self.lease_seconds
        if (
            node is None
            or (agents is not None and not agents)
            or (threads is not None and not threads)
        ):
            return []
        needing = f"r.status IN ({_NEEDS_LEADER_SQL})"
        agent_args: list[Any] = []
        if agents is not None:
            needing += " AND r.provider_key || '/' || r.agent_name = ANY(?)"
            agent_args = [list(agents)]
        where = ["l.expires_at < now()", "l.node <> ?"]
        args: list[Any] = [node, seconds, node]
        if threads is not None:
            where.append("l.thread_id = ANY(?)")
            args.append(list(threads))
        else:
            where.append(
                f"EXISTS (SELECT 1 FROM runs r WHERE r.thread_id = l.thread_id AND {needing})"
            )
            args += agent_args
        # Row locks make one node the winner: the loser's UPDATE waits, then
        # finds the lease no longer lapsed; its INSERT finds the row there.
        take_over = (
            "UPDATE thread_leases l SET node = ?, expires_at = now() + make_interval(secs => ?) "
            f"WHERE {' AND '.join(where)} RETURNING l.thread_id"
        )
        take_unleased = (
            "INSERT INTO thread_leases (thread_id, node, expires_at) "
            "SELECT DISTINCT r.thread_id, ?, now() + make_interval(secs => ?) FROM runs r "
            f"WHERE {needing} AND NOT EXISTS (SELECT 1 FROM thread_leases l "
            "WHERE l.thread_id = r.thread_id) ON CONFLICT (thread_id) DO NOTHING "
            "RETURNING thread_id"
        )

        def apply(conn: Any) -> list[str]:
            won = conn.execute(take_over, args).fetchall()
            if unleased:
                won += conn.execute(take_unleased, (node, seconds, *agent_args)).fetchall()
            return [str(r[0]) for r in won]

        return await self.write(apply)

    def release_lease(self, thread_id: str) -> PendingWrite | None:
        node = self.node
        if node is None:
            return None
        return self.write_soon(
            lambda c: c.execute(
                "DELETE FROM thread_leases WHERE thread_id = ? AND node = ?", (thread_id, node)
            )
        )

    def hand_over_lease(self, thread_id: str) -> PendingWrite | None:
        # Deleted, the row would leave the thread looking idle: a run reaching
        # the serving node before its claim round would take the lease in its
        # own insert and be laned alone, ahead of the queued runs handed over
        # (which no claim round takes then: the thread is leased). Lapsed and
        # nobody's (no node id is empty), that insert is refused and its node
        # takes the thread over first, as from a dead node (docs/cluster.md).
        node = self.node
        if node is None:
            return None
        return self.write_soon(
            lambda c: c.execute(
                "UPDATE thread_leases SET node = '', expires_at = '-infinity' "
                "WHERE thread_id = ? AND node = ?",
                (thread_id, node),
            )
        )

    # -- push delivery leases (docs/cluster.md) ------------------------------------------

    def _lease_push_config(self, conn: Any, task_id: str, config_id: str) -> None:
        # Made (or replaced) here: delivered from here. A deliverer of the old
        # config on another node finds its next cursor advance refused.
        if self.node is None:
            return
        conn.execute(
            "UPDATE push_configs SET lease_node = ?, "
            "lease_expires = now() + make_interval(secs => ?) WHERE task_id = ? AND id = ?",
            (self.node, self.lease_seconds, task_id, config_id),
        )

    def _push_fence(self) -> tuple[str, tuple[Any, ...]]:
        if self.node is None:
            return "", ()
        return " AND lease_node = ?", (self.node,)

    def _claim_push_sync(self, conn: Any) -> list[Any]:
        # Row locks make one node the winner: a second claimer's UPDATE waits
        # for the first's, then finds the lease no longer lapsed.
        return list(
            conn.execute(
                "UPDATE push_configs SET lease_node = ?, "
                "lease_expires = now() + make_interval(secs => ?) "
                "WHERE state = ? AND (lease_node IS NULL OR lease_expires < now()) "
                f"RETURNING {PUSH_COLUMNS}",
                (self.node, self.lease_seconds, PUSH_DELIVERING),
            ).fetchall()
        )

    async def claim_push_configs(self) -> list[Any]:
        if self.node is None:
            return []
        return await self.write(self._claim_push_sync)

    def release_push_leases(self) -> None:
        node = self.node
        if node is None:
            return
        self.write_soon(
            lambda c: c.execute(
                "UPDATE push_configs SET lease_node = NULL, lease_expires = NULL "
                "WHERE lease_node = ? AND state = ?",
                (node, PUSH_DELIVERING),
            )
        )

    async def renew_push_leases(
        self, keys: Sequence[tuple[str, str]]
    ) -> tuple[set[tuple[str, str]], list[Any]]:
        node, seconds = self.node, self.lease_seconds
        if node is None:
            return set(), []
        tasks, ids = [k[0] for k in keys], [k[1] for k in keys]

        def apply(conn: Any) -> tuple[set[tuple[str, str]], list[Any]]:
            ours: set[tuple[str, str]] = set()
            if keys:
                rows = conn.execute(
                    "UPDATE push_configs SET lease_expires = now() + make_interval(secs => ?) "
                    "WHERE lease_node = ? AND (task_id, id) IN "
                    '(SELECT t, i COLLATE "C" FROM unnest(?::text[], ?::text[]) AS k(t, i)) '
                    "RETURNING task_id, id",
                    (seconds, node, tasks, ids),
                ).fetchall()
                ours = {(str(r[0]), str(r[1])) for r in rows}
            return ours, self._claim_push_sync(conn)

        return await self.write(apply)

    # -- the cluster's roster and forwarding (docs/cluster.md) -------------------------

    def heartbeat(
        self, url: str, served: Sequence[tuple[str, str]], *, tell: bool = False
    ) -> PendingWrite | None:
        node, seconds = self.node, self.lease_seconds
        if node is None:
            return None

        def apply(conn: Any) -> None:
            conn.execute(
                "INSERT INTO cluster_nodes (node, url, expires_at) "
                "VALUES (?, ?, now() + make_interval(secs => ?)) ON CONFLICT (node) "
                "DO UPDATE SET url = EXCLUDED.url, expires_at = EXCLUDED.expires_at",
                (node, url, seconds),
            )
            # Dead nodes: their heartbeat lapsed a while ago (a live one that
            # could not renew in time writes its rows again when it can).
            conn.execute(
                "DELETE FROM cluster_nodes WHERE expires_at < now() - make_interval(secs => ?)",
                (10 * seconds,),
            )
            conn.execute(
                "DELETE FROM served s WHERE NOT EXISTS "
                "(SELECT 1 FROM cluster_nodes n WHERE n.node = s.node)"
            )
            # Said again at every heartbeat: a node whose rows were swept
            # while it could not reach the record is back in the roster.
            conn.execute("DELETE FROM served WHERE node = ?", (node,))
            for key, agent in served:
                conn.execute(
                    "INSERT INTO served (provider_key, agent_name, node) VALUES (?, ?, ?)",
                    (key, agent, node),
                )
            if tell:
                conn.execute("SELECT pg_notify(?, ?)", (self.channel, ROSTER_NOTICE))

        return self.write_soon(apply)

    def leave(self) -> None:
        node = self.node
        if node is None:
            return

        def apply(conn: Any) -> None:
            conn.execute("DELETE FROM served WHERE node = ?", (node,))
            conn.execute("DELETE FROM cluster_nodes WHERE node = ?", (node,))
            conn.execute("SELECT pg_notify(?, ?)", (self.channel, ROSTER_NOTICE))

        self.write_soon(apply)

    async def cluster_secret(self) -> str:
        import secrets

        made = secrets.token_hex(32)

        def apply(conn: Any) -> str:
            conn.execute(
                "INSERT INTO cluster_secret (id, secret) VALUES (1, ?) ON CONFLICT (id) DO NOTHING",
                (made,),
            )
            row = conn.execute("SELECT secret FROM cluster_secret WHERE id = 1").fetchone()
            return str(row[0])

        return await self.write(apply)

    async def thread_leader(self, thread_id: str) -> tuple[str, str, bool] | None:
        def read(conn: Any) -> tuple[str, str, bool] | None:
            row = conn.execute(
                "SELECT l.node, COALESCE(n.url, ''), l.expires_at > now() FROM thread_leases l "
                "LEFT JOIN cluster_nodes n ON n.node = l.node WHERE l.thread_id = ?",
                (thread_id,),
            ).fetchone()
            return None if row is None else (str(row[0]), str(row[1]), bool(row[2]))

        return await self.read(read)

    async def serving_nodes(self, key: str, agent: str) -> list[tuple[str, str]]:
        node = self.node or ""

        def read(conn: Any) -> list[tuple[str, str]]:
            rows = conn.execute(
                "SELECT n.node, n.url FROM served s JOIN cluster_nodes n ON n.node = s.node "
                "WHERE s.provider_key = ? AND s.agent_name = ? AND s.node <> ? "
                "AND n.expires_at > now() AND n.url <> '' ORDER BY random()",
                (key, agent, node),
            ).fetchall()
            return [(str(r[0]), str(r[1])) for r in rows]

        return await self.read(read)

    async def served_anywhere(self) -> set[tuple[str, str]]:
        node = self.node or ""

        def read(conn: Any) -> set[tuple[str, str]]:
            rows = conn.execute(
                "SELECT DISTINCT s.provider_key, s.agent_name FROM served s "
                "JOIN cluster_nodes n ON n.node = s.node "
                "WHERE n.expires_at > now() AND s.node <> ?",
                (node,),
            ).fetchall()
            return {(str(r[0]), str(r[1])) for r in rows}

        return await self.read(read)

    # -- writing -----------------------------------------------------------------------

    async def _commit(self, ops: list[_Write]) -> None:
        await trio.to_thread.run_sync(self._apply, ops)

    def _writer(self) -> PgConnection:
        conn = self._writer_conn
        if conn is None or not conn.usable:
            if conn is not None:
                conn.close()
            self._writer_conn = None
            conn = self._writer_conn = self._unprepared(self._connect())
        return conn

    def _apply(self, ops: list[_Write]) -> None:
        """One transaction for the whole batch, pipelined: its statements go
        out together and only a guarded move's verdict waits for a round
        trip. Should any write fail, the batch is rolled back and replayed
        one write per transaction (not pipelined, so each error is its own
        write's), so one bad write never takes the others with it. Each
        transaction tells the runs it changed (``_notify``) as it commits."""
        conn = self._writer()
        try:
            with conn.raw.pipeline() as pipeline:
                conn.pipeline = pipeline
                conn.begin()
                for op in ops:
                    op.result = op.fn(conn)
                self._check_fences(conn)
                self._notify(conn)
                conn.execute("COMMIT")
            return
        except Exception:  # noqa: BLE001 -- replayed below, one by one
            conn.pipeline = None
            self._roll_back(conn)
        finally:
            conn.pipeline = None
        for op in ops:
            try:
                op.result = None  # not the rolled-back attempt's (see store._chained)
                conn = self._writer()
                conn.begin()
                op.result = op.fn(conn)
                self._check_fences(conn)
                self._notify(conn)
                conn.execute("COMMIT")
            except Exception as exc:  # noqa: BLE001 -- reported to that write's caller
                self._roll_back(conn)
                fenced = self._not_leader(exc)
                if fenced is not None:
                    op.error = fenced  # another node leads the thread: expected, said by the caller
                    continue
                op.error = exc
                log.warning("write failed: %s", exc)

    @staticmethod
    def _note_change(conn: PgConnection, run_id: str, seq: int, status: bool) -> None:
        """A write of the open transaction changed ``run_id`` (see SqlStore._changed)."""
        change = conn.changes.get(run_id)
        if change is None:
            conn.changes[run_id] = [seq, status]
        else:
            change[0] = max(change[0], seq)
            change[1] = change[1] or status

    def _notify(self, conn: PgConnection) -> None:
        """One notification per run the transaction changed, all in one
        statement (pipelined: no round trip of its own). PostgreSQL delivers
        them only if, and once, the transaction commits."""
        if not conn.changes:
            return
        payloads = [
            f"{run_id} {seq} {'s' if status else '-'}"
            for run_id, (seq, status) in conn.changes.items()
        ]
        conn.changes.clear()
        conn.execute("SELECT pg_notify(?, p) FROM unnest(?::text[]) AS p", (self.channel, payloads))

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

    # -- listening ---------------------------------------------------------------------

    async def listen(
        self,
        changed: Callable[[str], None],
        caught_up: Callable[[], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Hold one connection that LISTENs on the runs' channel; for each
        notification, ``changed(run_id)``. Each time the connection is made
        (at start, and again after it dropped, with backoff) ``caught_up()``
        is called once it listens: whatever was notified while it was down is
        then read from the record, so nothing is lost and nothing polls.
        ``task_status.started()`` once it first listens.

        Waiting is trio's (``wait_readable`` on the connection's socket, then
        libpq's ``PQconsumeInput``/``PQnotifies``, as psycopg's own
        ``notifies()`` does under its wait function), not a worker thread
        blocked in ``Connection.notifies()``: such a thread cannot be woken
        to stop without a timeout, and the hop back to trio would add a
        thread switch to every notification."""
        import psycopg

        delay, started = LISTEN_RETRY[0], False
        while True:
            try:
                raw = await trio.to_thread.run_sync(self._listen_connect, abandon_on_cancel=True)
            except psycopg.Error as exc:
                log.warning(
                    "cannot LISTEN on %s (again in %.2f s): %s",
                    self.where,
                    delay,
                    " ".join(str(exc).split()),
                )
                await trio.sleep(delay)
                delay = min(delay * 2, LISTEN_RETRY[1])
                continue
            since = trio.current_time()
            try:
                self.listener_pid = raw.info.backend_pid
                self.listens += 1
                caught_up()
                if not started:
                    started = True
                    task_status.started()
                await _relay_notifications(raw, changed)
            except (psycopg.Error, OSError) as exc:
                log.warning(
                    "LISTEN connection to %s lost: %s", self.where, " ".join(str(exc).split())
                )
            finally:
                self.listener_pid = None
                raw.close()
            if trio.current_time() - since < LISTEN_STEADY_SECONDS:
                # Lost as soon as made: the next attempt waits, so a server
                # that drops it at once is not asked again and again.
                await trio.sleep(delay)
                delay = min(delay * 2, LISTEN_RETRY[1])
            else:
                delay = LISTEN_RETRY[0]  # it held: the next loss retries at once

    def _listen_connect(self) -> Any:
        """In a worker thread: a new connection, LISTENing on the channel."""
        import psycopg
        from psycopg import sql

        raw = psycopg.connect(
            self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_SECONDS, **LISTEN_KEEPALIVES
        )
        try:
            raw.execute(sql.SQL("LISTEN {}").format(sql.Identifier(self.channel)))
        except BaseException:
            raw.close()
            raise
        return raw


def channel_for(schema_name: str | None) -> str:
    """The runs' notification channel of the funduq kept in ``schema_name``
    (channels are per database, and each schema is a funduq of its own)."""
    if not schema_name or schema_name == "public":
        return CHANNEL
    return f"{CHANNEL}.{schema_name}"[:63]  # an identifier's length at most


async def _relay_notifications(raw: Any, changed: Callable[[str], None]) -> None:
    """Until the connection fails: wait for its socket to be readable, take
    what arrived, and tell each notification's run id."""
    import psycopg

    pgconn = raw.pgconn
    fd = pgconn.socket
    while True:
        await trio.lowlevel.wait_readable(fd)
        pgconn.consume_input()  # raises OperationalError once the server is gone
        while (notice := pgconn.notifies()) is not None:
            changed(notice.extra.decode("utf-8", "replace").partition(" ")[0])
        if pgconn.status != psycopg.pq.ConnStatus.OK:
            raise psycopg.OperationalError("the LISTEN connection was closed")
