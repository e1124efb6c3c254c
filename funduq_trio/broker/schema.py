"""The record's schema, versioned: every version there has been, in order.

``MIGRATIONS[n - 1]`` is the SQL that takes a file at version ``n - 1`` to
version ``n``; version 1 is the schema as it stood before versions existed
(commit d2191a5), which is what the files of existing users hold. A file
carries its version in SQLite's ``PRAGMA user_version``, written in the same
transaction as the step it marks, so a step is either wholly applied and
marked, or not at all.

Adding a table or a column is one new entry at the END of ``MIGRATIONS``.
Never edit an entry that has been released: files in the field were made by
it. A step is written for a file at exactly the version before it, so it may
``ALTER TABLE``; no ``IF NOT EXISTS`` is needed except in version 1, which
also runs on files made before versions (they hold its tables already).

The planning below is pure (no I/O); ``upgrade`` is the thin part that runs
the plan on a connection.
"""

from __future__ import annotations

import logging
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("funduq.record")


@dataclass(frozen=True)
class Migration:
    """One step: ``sql`` takes a file from ``version - 1`` to ``version``."""

    version: int
    why: str
    sql: str


MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        1,
        "the record as first released (commit d2191a5)",
        """
CREATE TABLE IF NOT EXISTS providers (
    key TEXT PRIMARY KEY,
    fingerprint TEXT NOT NULL,
    misdeclared INTEGER NOT NULL DEFAULT 0,
    unanswered INTEGER NOT NULL DEFAULT 0,
    abandoned INTEGER NOT NULL DEFAULT 0,
    undelivered INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS providers_fingerprint ON providers (fingerprint);
CREATE TABLE IF NOT EXISTS agents (
    provider_key TEXT NOT NULL,
    name TEXT NOT NULL,
    description TEXT NOT NULL DEFAULT '',
    card TEXT NOT NULL DEFAULT '{}',
    metadata TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (provider_key, name)
);
CREATE TABLE IF NOT EXISTS threads (
    id TEXT PRIMARY KEY,
    provider_key TEXT NOT NULL,
    agent_name TEXT NOT NULL,
    segment_head TEXT,
    created_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS runs (
    arrival INTEGER NOT NULL,
    id TEXT PRIMARY KEY,
    thread_id TEXT NOT NULL,
    provider_key TEXT NOT NULL,
    agent_name TEXT NOT NULL,
    status TEXT NOT NULL,
    input TEXT NOT NULL,
    caller_metadata TEXT NOT NULL DEFAULT '{}',
    metadata TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    started_at REAL,
    completed_at REAL
);
CREATE INDEX IF NOT EXISTS runs_thread ON runs (thread_id, arrival);
CREATE INDEX IF NOT EXISTS runs_status ON runs (status, arrival);
CREATE TABLE IF NOT EXISTS events (
    run_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    event TEXT NOT NULL,
    PRIMARY KEY (run_id, seq)
) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS messages (
    thread_id TEXT NOT NULL,
    idx INTEGER NOT NULL,
    message_id TEXT NOT NULL,
    run_id TEXT,
    message TEXT NOT NULL,
    PRIMARY KEY (thread_id, idx)
) WITHOUT ROWID;
""",
    ),
    Migration(
        2,
        "listings page in SQL (DESIGN §8): an agent's runs by arrival (GET /runs) "
        "and by status time (A2A ListTasks), and the threads bound to one key",
        """
CREATE INDEX IF NOT EXISTS threads_segment_head ON threads (segment_head);
CREATE INDEX IF NOT EXISTS runs_agent ON runs (provider_key, agent_name, arrival);
CREATE INDEX IF NOT EXISTS runs_agent_status_time ON runs
    (provider_key, agent_name, COALESCE(completed_at, started_at, created_at), id);
""",
    ),
    Migration(
        3,
        "KYOK (DESIGN §9): LLM providers' counters and their offerings",
        """
CREATE TABLE IF NOT EXISTS llm_providers (
    key TEXT PRIMARY KEY,
    completions INTEGER NOT NULL DEFAULT 0,
    refused INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS llm_offerings (
    provider_key TEXT NOT NULL,
    name TEXT NOT NULL,
    description TEXT NOT NULL DEFAULT '',
    metadata TEXT NOT NULL DEFAULT '{}',
    PRIMARY KEY (provider_key, name)
);
""",
    ),
    # IF NOT EXISTS: builds of main before this step made the table at start.
    Migration(
        4,
        "push notifications (DESIGN §10): each push config and its delivery cursor",
        """
CREATE TABLE IF NOT EXISTS push_configs (
    task_id TEXT NOT NULL,
    id TEXT NOT NULL,
    url TEXT NOT NULL,
    token TEXT NOT NULL DEFAULT '',
    authentication TEXT NOT NULL DEFAULT '{}',
    created_at REAL NOT NULL,
    cursor_seq INTEGER NOT NULL DEFAULT 0,
    cursor_index INTEGER NOT NULL DEFAULT -1,
    state TEXT NOT NULL DEFAULT 'delivering',
    attempts INTEGER NOT NULL DEFAULT 0,
    last_error TEXT,
    PRIMARY KEY (task_id, id)
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS push_configs_state ON push_configs (state);
""",
    ),
    Migration(
        5,
        "spent proofs shared by the nodes on one database (DESIGN §8, §11)",
        # Written only where several nodes share the record (PostgreSQL); the
        # SQLite store has the table to keep the two schemas in step.
        """
CREATE TABLE spent_proofs (
    signer TEXT NOT NULL,
    payload TEXT NOT NULL,
    keep_until REAL NOT NULL,
    PRIMARY KEY (signer, payload)
) WITHOUT ROWID;
CREATE INDEX spent_proofs_keep_until ON spent_proofs (keep_until);
""",
    ),
    # On SQLite the table stays empty: a file has one process, which leads
    # every thread. It keeps both stores' tables and versions in step
    # (postgres.MIGRATIONS, where the fence and the arrival sequence live).
    Migration(
        6,
        "several nodes on one PostgreSQL (issue #12): thread leases, the fence "
        "every write of a run passes, and one arrival order for all nodes",
        """
CREATE TABLE thread_leases (
    thread_id TEXT PRIMARY KEY,
    node TEXT NOT NULL,
    expires_at REAL NOT NULL
);
""",
    ),
    # The listing index of step 2 that moved on every stamp (a run's status
    # time changes as it starts and as it ends) cost each run's writes more
    # than any other: one index in arrival order serves both listings now.
    # A run's entry stays where it is when the run is stamped (only answering
    # a pause gives a run a new arrival); it holds the stamps and the id, so
    # ListTasks counts, orders by status time and pages from the index alone
    # (a top-N sort bounded by the page).
    Migration(
        7,
        "one index serves both listings (an agent's runs by arrival and by status "
        "time): the status-time index, rewritten at each run's start and end, goes",
        """
DROP INDEX runs_agent_status_time;
DROP INDEX runs_agent;
CREATE INDEX runs_agent_listing ON runs
    (provider_key, agent_name, arrival, completed_at, started_at, created_at, id);
""",
    ),
    # On SQLite the columns stay empty: one process delivers every config.
    # On PostgreSQL (postgres.MIGRATIONS) they are the config's delivery
    # lease: the node delivering it, and until when (docs/cluster.md).
    Migration(
        8,
        "push deliveries in a cluster (issue #12): each push config's delivery "
        "lease, so exactly one node delivers it at a time",
        """
ALTER TABLE push_configs ADD COLUMN lease_node TEXT;
ALTER TABLE push_configs ADD COLUMN lease_expires REAL;
""",
    ),
    # On SQLite these stay empty too (one process is the whole funduq).
    Migration(
        9,
        "any node takes callers (issue #12): the nodes and where they serve, "
        "which agents each serves now, and the secret nodes sign forwarded calls with",
        """
CREATE TABLE cluster_nodes (
    node TEXT PRIMARY KEY,
    url TEXT NOT NULL DEFAULT '',
    expires_at REAL NOT NULL
);
CREATE TABLE served (
    provider_key TEXT NOT NULL,
    agent_name TEXT NOT NULL,
    node TEXT NOT NULL,
    PRIMARY KEY (provider_key, agent_name, node)
) WITHOUT ROWID;
CREATE TABLE cluster_secret (
    id INTEGER PRIMARY KEY CHECK (id = 1),
    secret TEXT NOT NULL
);
""",
    ),
    # Most threads are bound to no key (no actor chain: segment_head null),
    # yet each new one added an entry to this index, on a page of its own in
    # every commit that made a thread; only the bound ones are ever looked up
    # (``segment_head=?``, which a partial index on IS NOT NULL serves).
    Migration(
        10,
        "the index of threads bound to a key holds only the bound ones: an "
        "unbound thread's insert no longer writes to it",
        """
DROP INDEX threads_segment_head;
CREATE INDEX threads_segment_head ON threads (segment_head) WHERE segment_head IS NOT NULL;
""",
    ),
    # Next: Migration(11, "why", "CREATE TABLE ...; ALTER TABLE ..."),
)


class SchemaTooNew(RuntimeError):
    """The file was written by a newer build than this one: refuse to touch it."""


def latest(migrations: tuple[Migration, ...] = MIGRATIONS) -> int:
    return len(migrations)


def check(migrations: tuple[Migration, ...]) -> None:
    """The list is numbered 1, 2, 3, ... with no gap or repeat."""
    numbers = [m.version for m in migrations]
    if numbers != list(range(1, len(numbers) + 1)):
        raise ValueError(f"migrations must be numbered 1..n in order, not {numbers}")


def plan(current: int, migrations: tuple[Migration, ...] = MIGRATIONS) -> list[Migration]:
    """The steps that take a file at ``current`` to the latest version, in
    order (none when it is there already). A file newer than the list is
    refused: this build cannot know what the newer one's tables mean."""
    check(migrations)
    if current < 0:
        raise ValueError(f"schema version {current} is not a version")
    if current > len(migrations):
        raise SchemaTooNew(
            f"schema version {current}, newer than this build of funduq-trio knows "
            f"(up to {len(migrations)}); refusing to open it: run a build at least as "
            "new as the one that wrote it"
        )
    return list(migrations[current:])


def found_version(user_version: int, has_tables: bool) -> int:
    """The version a file is at: its mark, except that a file made before
    versions (tables, no mark) is at version 1 and an empty file at 0."""
    if user_version == 0 and has_tables:
        return 1
    return user_version


# -- the thin part: on a connection ----------------------------------------------


def _version_of(conn: sqlite3.Connection) -> int:
    return found_version(*_marks(conn))


def _marks(conn: sqlite3.Connection) -> tuple[int, bool]:
    user_version = conn.execute("PRAGMA user_version").fetchone()[0]
    has_tables = (
        conn.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='runs'").fetchone()
        is not None
    )
    return user_version, has_tables


def _mark_unversioned(conn: sqlite3.Connection, where: str) -> None:
    """A file made before versions holds version 1's tables: write the mark."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        if _marks(conn) == (0, True):
            conn.execute("PRAGMA user_version=1")
            log.info("%s: made before schema versions; marked as version 1", where)
        conn.execute("COMMIT")
    except BaseException:
        if conn.in_transaction:
            conn.execute("ROLLBACK")
        raise


def upgrade(
    conn: sqlite3.Connection,
    where: str = "the record",
    migrations: tuple[Migration, ...] = MIGRATIONS,
    before_step: Callable[[Migration], None] | None = None,
) -> list[int]:
    """Bring the file on ``conn`` (autocommit mode) to the latest version, one
    transaction per step, and return the versions applied. Each step takes the
    write lock first and reads the version again under it, so two processes
    opening one file at once apply each step once. Raises SchemaTooNew, with
    nothing written, on a file newer than ``migrations``."""
    try:
        steps = plan(_version_of(conn), migrations)
    except SchemaTooNew as exc:
        raise SchemaTooNew(f"{where}: {exc}") from None
    marks = _marks(conn)
    if marks == (0, True):
        _mark_unversioned(conn, where)
    fresh = marks == (0, False)  # a new file: one line for the lot, not one per step
    applied: list[int] = []
    for step in steps:
        if before_step is not None:
            before_step(step)
        try:
            conn.execute("BEGIN IMMEDIATE")
            now = _version_of(conn)
            if now >= step.version:
                conn.execute("ROLLBACK")
                if now > len(migrations):  # someone made it newer meanwhile
                    raise SchemaTooNew(
                        f"{where}: schema version {now}, newer than this "
                        f"build of funduq-trio knows (up to {len(migrations)})"
                    )
                continue
            # Statement by statement: executescript() would commit first.
            for statement in statements(step.sql):
                try:
                    conn.execute(statement)
                except sqlite3.Error as exc:
                    exc.add_note(
                        f"{where}: schema migration {step.version} ({step.why}) "
                        f"failed at: {statement}"
                    )
                    raise
            conn.execute(f"PRAGMA user_version={step.version:d}")
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        applied.append(step.version)
        if not fresh:
            log.info("%s: schema upgraded to version %d (%s)", where, step.version, step.why)
    if fresh and applied:
        log.debug("%s: created at schema version %d", where, applied[-1])
    return applied


def statements(sql: str) -> list[str]:
    """``sql`` cut into its statements (a trigger's body stays whole)."""
    found, pending = [], ""
    for piece in sql.split(";"):
        pending += piece + ";"
        if sqlite3.complete_statement(pending):
            if pending.strip(" \t\r\n;"):
                found.append(pending.strip())
            pending = ""
    if pending.strip(" \t\r\n;"):
        raise ValueError(f"an incomplete statement in a migration: {pending.strip()!r}")
    return found
