"""The record as an interface: the ``Store`` protocol, and what its two stores
(SQLite, ``record.py``; PostgreSQL, ``postgres.py``) share.

The broker (the facade, the registry, the lanes, KYOK, the push outbox) speaks
to the record only in the domain's words -- insert a run, move it, append its
events, read its thread -- and never writes SQL. Both stores keep the same two
promises:

* **guarded status writes**: ``move`` is ``UPDATE runs ... WHERE status IN
  (legal sources)`` and reports whether the run moved; what goes with the move
  (events, metadata, messages) is written only when it did, in its transaction;
* **group commit, first-in first-out**: one writer takes every write waiting
  and commits them as one transaction, batches in order.

``SqlStore`` holds that machinery and the domain's SQL, written once in the
dialect both databases speak (``?`` placeholders; the PostgreSQL store turns
them into its own). A store supplies its connections, its transactions and the
few expressions the two dialects spell differently.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import sqlite3
import sys
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

import trio

from ..protocol import statuses
from .parking import park

if TYPE_CHECKING:
    from ..config import Settings

T = TypeVar("T")
log = logging.getLogger("funduq.record")

COUNTERS = ("misdeclared", "unanswered", "abandoned", "undelivered")
#: A push config's columns as the stores read them (pushes._config).
PUSH_COLUMNS = "task_id, id, url, token, authentication, cursor_seq, cursor_index, state"
PUSH_DELIVERING = "delivering"
#: An LLM provider's counters (KYOK; kyok.COUNTERS).
LLM_COUNTERS = ("completions", "refused", "failed")

#: A message of a thread as the record keeps it:
#: (thread id, idx, message id, run id, message JSON).
MessageRow = tuple[Any, ...]
#: A run's row for the broker: id, thread_id, provider_key, agent_name, status,
#: input, caller_metadata, metadata, arrival, created_at, started_at, next seq.
RunRow = tuple[Any, ...]
#: A run's summary for the read routes: id, thread_id, provider_key,
#: agent_name, status, metadata, created_at, started_at, completed_at.
SummaryRow = tuple[Any, ...]


# One encoder for every write, the C one json.dumps builds afresh per call
# (with its closures) -- the record encodes ~20 values per run. Without
# json's check for a cycle: what is written is parsed JSON or built by funduq
# (a cycle would be a bug; it fails as RecursionError, as json.dumps with
# check_circular=False does).
_ENCODE: Callable[[Any, int], Any] | None = (
    json.encoder.c_make_encoder(  # type: ignore[attr-defined]
        None,
        json.JSONEncoder().default,
        json.encoder.encode_basestring_ascii,
        None,
        ":",
        ",",
        False,
        False,
        True,
    )
    if json.encoder.c_make_encoder is not None  # type: ignore[attr-defined]
    else None
)
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def dumps(value: Any) -> str:
    # ASCII-escaped: valid JSON may carry lone surrogates ("\ud800"), which
    # SQLite's UTF-8 text cannot hold unescaped.
    if _ENCODE is None:
        return _ENCODER.encode(value)  # a Python without json's C speedups
    return "".join(_ENCODE(value, 0))


def iso(ts: float | None) -> str | None:
    if ts is None:
        return None
    return _iso_second(int(ts // 1)) + f".{int(ts % 1 * 1000):03d}Z"


@functools.lru_cache(maxsize=256)
def _iso_second(second: int) -> str:
    # Every run's snapshot formats three stamps, nearly all within the same
    # few seconds: strftime once per second, not once per stamp.
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))


class RecordUnreachable(RuntimeError):
    """The record could not be opened at start: its database does not answer
    (the message says where and why, never a password)."""


class NoRecord(RuntimeError):
    """A store opened only if it exists (``create=False``: the admin command)
    found no funduq record there: no file, or a file or database without
    funduq's schema. Nothing was created."""


#: A notification on the runs' channel that is no run's: the roster changed
#: (a node's links publish or drop agents); every node reads it again.
ROSTER_NOTICE = "!roster"


class NotLeader(RuntimeError):
    """The record refused a write of a thread's run because this node does
    not hold the thread's lease (another node leads it, docs/cluster.md):
    the write changed nothing. Only a shared store (PostgreSQL with a node
    id) raises it."""

    def __init__(self, thread_or_run: str) -> None:
        super().__init__(f"{thread_or_run} is led by another funduq node")
        self.what = thread_or_run


class Unrecordable(ValueError):
    """Text the record cannot keep outside JSON: a NUL character (PostgreSQL's
    text refuses it) or a lone surrogate (neither database's UTF-8 holds it).
    JSON columns never meet it -- ``dumps`` escapes both."""


def keepable(*texts: str | None) -> bool:
    """Whether every one of ``texts`` (None: nothing) can be kept in, or
    looked up in, a text column of either store. What cannot be kept was never
    recorded, so a lookup of it finds nothing without asking the database."""
    for text in texts:
        if text is None or (text.isascii() and "\x00" not in text):
            continue
        if "\x00" in text:
            return False
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            return False
    return True


def record_trouble(exc: BaseException) -> bool:
    """A write failed because of the record's medium (disk full, I/O error,
    a lock held too long, the database server gone), not because of what it
    wrote: worth retrying."""
    if isinstance(exc, sqlite3.OperationalError):
        return True
    psycopg = sys.modules.get("psycopg")
    return psycopg is not None and isinstance(exc, psycopg.OperationalError)


@dataclass
class _Write:
    fn: Callable[[Any], Any]
    result: Any = None
    error: BaseException | None = None


class _Skipped:
    """What a write chained ``after`` another returns when it was not made
    (the one before it failed, or moved nothing)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "SKIPPED"


#: See ``_Skipped``.
SKIPPED: Any = _Skipped()


def _chained(fn: Callable[[Any], T], first: _Write) -> Callable[[Any], T]:
    """``fn``, made only when ``first`` -- queued before it, so committed in
    the same transaction or an earlier one -- went through with a true result
    (a guarded move that moved). The stores replay a failed batch write by
    write, each one's result reset first, so ``first`` is read as it is."""

    def apply(conn: Any) -> T:
        if first.error is not None or not first.result:
            return cast(T, SKIPPED)
        return fn(conn)

    return apply


class Committed:
    """A batch's commit, said as a `trio.Event` says it (`is_set`, `set`,
    `wait`: a checkpoint when already set, else a cancellable park), with
    one wait more: `wait_uncancellable`, a park that a cancellation does not
    end (trio's own shield for a single wait: its abort fails, and the
    cancel is delivered at the task's next checkpoint). A door that must
    see its run's insert through waits so without a shielded cancel scope,
    which costs as much as the two task steps of the wait it guards
    (bench/README.md, "The callers' side of a run")."""

    __slots__ = ("_set", "_waiters")

    def __init__(self) -> None:
        self._set = False
        self._waiters: list[trio.lowlevel.Task] | None = None

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        waiters, self._waiters = self._waiters, None
        if waiters:
            for task in waiters:
                trio.lowlevel.reschedule(task)

    async def wait(self) -> None:
        if self._set:
            await trio.lowlevel.checkpoint()
            return
        if self._waiters is None:
            self._waiters = []
        await park(self._waiters)

    async def wait_uncancellable(self) -> None:
        """Return once set, whatever cancels the task meanwhile (no
        checkpoint when already set)."""
        if self._set:
            return
        if self._waiters is None:
            self._waiters = []
        self._waiters.append(trio.lowlevel.current_task())
        await trio.lowlevel.wait_task_rescheduled(lambda _: trio.lowlevel.Abort.FAILED)


class PendingWrite:
    """A write queued with ``write_soon``: its result, once its batch committed."""

    __slots__ = ("_op", "_done", "_record")

    def __init__(self, record: SqlStore, op: _Write, done: Committed) -> None:
        self._record, self._op, self._done = record, op, done

    @property
    def done(self) -> bool:
        """Its batch committed (or failed): ``result`` is at hand."""
        return self._done.is_set()

    def hurry(self) -> None:
        """Wake the writer for it (queued with ``wake=False``)."""
        if not self._done.is_set():
            self._record._wake.set()

    async def durable(self) -> None:
        """Wait until its batch committed (or failed), without waking the
        writer: ``result`` then has the verdict at hand."""
        if not self._done.is_set():
            await self._done.wait()

    async def durable_uncancellable(self) -> None:
        """`durable`, a cancellation meanwhile left for the task's next
        checkpoint (as in a shielded scope, without one)."""
        await self._done.wait_uncancellable()

    async def result(self) -> Any:
        """The write's result (or its error raised), once its batch committed.
        A batch already committed costs no schedule point: the caller (a lane
        confirming its move before its next write) yields at that write; a
        trip through the scheduler here was a lane's one extra per run."""
        if not self._done.is_set():
            self._record._wake.set()  # queued with wake=False: wanted now
            await self._done.wait()
        self._record._note(self._op)
        if self._op.error is not None:
            raise self._op.error
        return self._op.result


class Store(Protocol):
    """What the broker asks of its record. Every write is durable when its
    await returns; ``move_soon`` queues one first-in first-out."""

    #: The last write failed for the medium's sake: not ready, no new runs.
    failing: bool
    #: Several funduq nodes may share this record (PostgreSQL): what one node
    #: keeps in memory alone, such as spent proofs, must also be kept here;
    #: other processes may write its runs, so a run with no lane here may be
    #: live on another node, and ``listen`` says when a run changes.
    shared: bool

    async def listen(
        self,
        changed: Callable[[str], None],
        caught_up: Callable[[], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Only on a shared record: call ``changed(run_id)`` whenever any
        process commits events or a status change to a run, and
        ``caught_up()`` each time the channel is (re)established -- what it
        missed meanwhile must be read from the record. Started once it listens."""
        ...

    async def probe(self) -> bool:
        """One small write; True when it went through (clears ``failing``)."""
        ...

    # -- thread leases (docs/cluster.md; nothing on a store of one process;
    # on a shared one, writes of a thread's runs need its lease)

    async def renew_leases(self) -> list[str]:
        """Extend every lease of this node; the threads it still holds."""
        ...

    async def claim_threads(
        self,
        *,
        agents: Sequence[str] | None = None,
        threads: Sequence[str] | None = None,
        unleased: bool = False,
    ) -> list[str]:
        """Take over lapsed leases of other nodes (and, with ``unleased``,
        take threads with active runs that nobody leases): of the threads of
        ``agents`` ("key/name") with runs needing a leader, or of ``threads``.
        Returns the threads won; two nodes claiming one thread never both win."""
        ...

    def release_lease(self, thread_id: str) -> PendingWrite | None:
        """Give up the thread's lease (queued first-in first-out)."""
        ...

    def hand_over_lease(self, thread_id: str) -> PendingWrite | None:
        """Give up the lease of a thread whose runs still need a leader
        (queued first-in first-out): left lapsed and no node's, so the next
        node to lead it takes it over -- restoring it first -- rather than
        take it as an idle thread's."""
        ...

    # -- the cluster's roster and forwarding (docs/cluster.md)

    def heartbeat(
        self, url: str, served: Sequence[tuple[str, str]], *, tell: bool = False
    ) -> PendingWrite | None:
        """This node is alive (for a lease's length), reached at ``url``, and
        its provider links serve ``served`` (key, agent) now, replacing what
        it said before; with ``tell``, every node reads the roster again.
        Queued first-in first-out (so it shares the next group commit)."""
        ...

    async def cluster_secret(self) -> str:
        """The secret the nodes sign forwarded calls with (made once)."""
        ...

    def leave(self) -> None:
        """This node stops: its heartbeat and what it serves are deleted
        (and every node told), so nobody forwards here any more. Queued,
        not awaited: a stop may come as a cancellation that has already
        stopped the writer, and the record's last flush commits it then."""
        ...

    async def thread_leader(self, thread_id: str) -> tuple[str, str, bool] | None:
        """(node, its URL, whether its lease is live) of the thread's lease
        holder; None when nobody holds it."""
        ...

    async def serving_nodes(self, key: str, agent: str) -> list[tuple[str, str]]:
        """(node, URL) of the other live nodes whose links serve the agent."""
        ...

    async def served_anywhere(self) -> set[tuple[str, str]]:
        """The (key, agent) some other live node serves now (this node's
        own links are the registry's to say, at once)."""
        ...

    async def ping(self) -> None:
        """One small read; raises when the record does not answer."""
        ...

    # -- writes
    async def insert_run(
        self,
        row: dict[str, Any],
        new_thread: tuple[Any, ...] | None,
        messages: Sequence[MessageRow],
    ) -> None: ...

    def insert_run_soon(
        self,
        row: dict[str, Any],
        new_thread: tuple[Any, ...] | None,
        messages: Sequence[MessageRow],
    ) -> PendingWrite:
        """``insert_run`` queued without waiting (first-in first-out) and
        without waking the writer (``write_soon``'s ``wake=False``): the
        run's lane, about to write or wait, does. Its result is True once
        recorded; a write chained ``after`` it is made only if it was."""
        ...

    async def move(
        self, run_id: str, to: str, *, after: PendingWrite | None = None, **changes: Any
    ) -> bool:
        """Guarded; ``lead=thread_id`` takes (or keeps) the thread's lease in
        the same transaction (answering a pause). ``after``: a move queued
        before it (``move_soon``); this one is made only if that one moved,
        else it returns ``SKIPPED`` -- so the two may share a commit."""
        ...

    def move_soon(
        self,
        run_id: str,
        to: str,
        *,
        metadata: dict[str, Any] | None = None,
        stamp: tuple[str, float] | None = None,
    ) -> PendingWrite: ...

    async def append_events(
        self,
        run_id: str,
        events: list[tuple[int, dict[str, Any]]],
        *,
        after: PendingWrite | None = None,
    ) -> Any:
        """``after`` as for ``move``: ``SKIPPED`` unless that move moved."""
        ...

    async def record_agents(
        self,
        key: str,
        fingerprint: str,
        rows: list[tuple[str, str, str, str, str]],
        forget: Callable[[list[tuple[str, int]]], list[str]],
    ) -> list[str]: ...

    async def set_counter(self, key: str, counter: str, value: int) -> None: ...

    async def spend_proof(self, signer: str, payload: str, keep_until: float, now: float) -> bool:
        """Spend a proof for every node sharing the record; False when one
        spent it already (only called where ``shared``)."""
        ...

    async def record_offerings(self, key: str, rows: list[tuple[str, str, str, str]]) -> None: ...

    def set_llm_counter_soon(self, key: str, counter: str, value: int) -> PendingWrite: ...

    async def llm_providers_and_offerings(self) -> tuple[list[Any], list[Any]]: ...

    async def push_configs_delivering(self) -> list[Any]: ...

    async def put_push_config(
        self,
        task_id: str,
        config_id: str,
        url: str,
        token: str,
        authentication: str,
        cursor: tuple[int, int],
        *,
        per_task: int | None,
        active: int | None,
    ) -> tuple[str, int] | None: ...

    async def push_config(self, task_id: str, config_id: str) -> Any: ...

    async def push_configs(self, task_id: str) -> list[Any]: ...

    async def delete_push_config(self, task_id: str, config_id: str) -> bool: ...

    async def end_push_config(
        self, task_id: str, config_id: str, state: str, error: str | None
    ) -> bool: ...

    async def push_delivered(
        self, task_id: str, config_id: str, cursor: tuple[int, int], attempts: int
    ) -> bool: ...

    async def claim_push_configs(self) -> list[Any]:
        """Take the delivery lease of every config still delivering whose
        lease lapsed or is nobody's; their rows (``PUSH_COLUMNS``). Only
        where ``shared``."""
        ...

    def release_push_leases(self) -> None:
        """Let every delivery lease of this node go (at a stop): another
        node's next round resumes those configs at once. Only where
        ``shared``. Queued like ``leave``."""
        ...

    async def renew_push_leases(
        self, keys: Sequence[tuple[str, str]]
    ) -> tuple[set[tuple[str, str]], list[Any]]:
        """One renewal round of the push delivery leases (only where
        ``shared``): extend those of ``keys`` still this node's, then claim
        the lapsed ones; (the keys extended, the claimed rows)."""
        ...

    # -- reads
    async def providers_and_agents(self) -> tuple[list[Any], list[Any]]: ...

    async def restore_reads(
        self, orphaned: Sequence[str], threads: Sequence[str] | None = None
    ) -> tuple[int, list[Any], list[RunRow]]: ...

    async def run_row(self, run_id: str) -> RunRow | None: ...

    async def get_run(self, run_id: str) -> tuple[SummaryRow, list[tuple[int, str]]] | None: ...

    async def list_runs(
        self,
        *,
        thread_id: str | None,
        provider_key: str | None,
        agent: str | None,
        limit: int,
        status: Sequence[str] | None = None,
        before: str | None = None,
        bound_to: str | None = None,
    ) -> list[SummaryRow]: ...

    async def task_ids(
        self,
        provider_key: str,
        agent: str,
        *,
        thread_id: str | None,
        bound_to: str | None,
        status: Sequence[str] | None,
        status_after: float | None,
        limit: int,
        after_run: str | None,
    ) -> tuple[int, list[str]]: ...

    async def run_thread(self, run_id: str) -> str | None: ...

    async def thread_runs(self, thread_id: str) -> list[tuple[str, str]]: ...

    async def thread(
        self, thread_id: str
    ) -> tuple[tuple[str, str, str | None], list[str], int] | None:
        """((provider key, agent, segment head), message ids, the next
        message's position) of a thread."""
        ...

    async def messages(self, thread_id: str, limit: int | None) -> list[str]: ...

    async def events_after(
        self, run_id: str, after: int, before: int | None, limit: int | None
    ) -> list[tuple[int, str]]: ...

    async def run_exists(self, run_id: str) -> bool: ...

    async def run_facts(self, run_id: str) -> tuple[str | None, str] | None: ...

    async def paused_run(self, thread_id: str, status: str) -> str | None: ...

    async def run_progress(self, run_id: str) -> tuple[str, int] | None: ...

    async def run_events(
        self, run_id: str, after: int, limit: int | None
    ) -> tuple[str, list[tuple[int, str]]] | None: ...

    # -- the operator's commands (admin.py), not the broker's
    async def quality_counters(self) -> list[tuple[Any, ...]]: ...

    async def reset_quality(self, provider: str) -> str | None: ...


# -- the SQL both stores speak ---------------------------------------------------------

_RUN_COLUMNS = (
    "id, thread_id, provider_key, agent_name, status, input, caller_metadata, "
    "metadata, arrival, created_at, started_at, "
    "(SELECT COALESCE(MAX(seq), 0) + 1 FROM events e WHERE e.run_id = r.id)"
)
_SUMMARY_COLUMNS = (
    "id, thread_id, provider_key, agent_name, status, metadata, created_at, "
    "started_at, completed_at"
)
_SUMMARY_COLUMNS_R = (
    "r.id, r.thread_id, r.provider_key, r.agent_name, r.status, r.metadata, "
    "r.created_at, r.started_at, r.completed_at"
)
#: When a run's status last changed (what A2A calls the status timestamp);
#: the same expression as the stores' index on it, so SQL can use it.
STATUS_TIME = "COALESCE(r.completed_at, r.started_at, r.created_at)"
_INSERT_MESSAGE = (
    "INSERT INTO messages (thread_id, idx, message_id, run_id, message) VALUES (?,?,?,?,?)"
)
_INSERT_EVENT = "INSERT INTO events (run_id, seq, event) VALUES (?,?,?)"
#: A run's events go in as one statement of up to this many rows each (not
#: a statement run once a row): SQLite's VALUES list costs a fraction of a
#: step a row. Bounded, so there are at most this many statements to keep.
EVENTS_A_STATEMENT = 16
_INSERT_EVENTS = ("",) + tuple(
    _INSERT_EVENT + ",(?,?,?)" * (n - 1) for n in range(1, EVENTS_A_STATEMENT + 1)
)


def _event_statements(
    run_id: str, events: Iterable[tuple[int, dict[str, Any]]]
) -> tuple[list[tuple[str, tuple[Any, ...]]], int]:
    """A run's events as the statements that insert them (each with its
    parameters, made now, outside the commit), and the last seq (0: none)."""
    statements: list[tuple[str, tuple[Any, ...]]] = []
    flat: list[Any] = []
    seq = 0
    for seq, event in events:
        flat += (run_id, seq, dumps(event))
        if len(flat) == 3 * EVENTS_A_STATEMENT:
            statements.append((_INSERT_EVENTS[EVENTS_A_STATEMENT], tuple(flat)))
            flat = []
    if flat:
        statements.append((_INSERT_EVENTS[len(flat) // 3], tuple(flat)))
    return statements, seq


def _insert_messages(conn: Any, messages: Sequence[MessageRow]) -> None:
    if len(messages) == 1:
        conn.execute(_INSERT_MESSAGE, messages[0])
    else:
        conn.executemany(_INSERT_MESSAGE, messages)


def _dumps_metadata(metadata: dict[str, Any]) -> str:
    """``dumps(metadata)``; most runs' is empty."""
    if not metadata and type(metadata) is dict:
        return "{}"
    return dumps(metadata)


class SqlStore:
    """The group-committed writer and the domain's SQL; a store subclasses it
    with its connections (``_commit``, ``_read_sync``, ``_open_sync``,
    ``_close_sync``, ``_touch``) and its dialect (``EVENT_TYPE``,
    ``AGENT_ORDER``)."""

    #: The SQL expression for an event row's ``type`` (``e.event`` is its JSON).
    EVENT_TYPE = "json_extract(e.event, '$.type')"
    #: The column that orders a key's agents oldest first.
    AGENT_ORDER = "rowid"
    #: Reads running at once, each on a connection of its own.
    READERS = 4
    #: Several nodes may share the record; the SQLite store is one process's.
    shared = False
    #: How often (seconds, at most) spending a proof also deletes the spent
    #: proofs past their time.
    SPENT_SWEEP_SECONDS = 5.0
    #: The SQL a new arrival is written as (a parameter here; a sequence
    #: shared by every node on PostgreSQL).
    ARRIVAL = "?"
    #: This process's node id when other processes share the record
    #: (docs/cluster.md): every write of a thread's runs is then fenced by
    #: the thread's lease. None: the record is this process's alone.
    node: str | None = None

    def __init__(self, *, create: bool = True) -> None:
        #: Whether opening may create the record (``serve``); False: it must
        #: exist with funduq's schema already, else NoRecord (the admin command).
        self.create = create
        self._pending: list[_Write] = []
        self._batch_done = Committed()
        self._wake = trio.Event()
        self._read_limiter = trio.CapacityLimiter(self.READERS)
        #: The last write failed for the medium's sake (see ``record_trouble``):
        #: funduq is not ready and takes no new runs until a write succeeds.
        self.failing = False
        self._next_sweep = 0.0  # when spend_proof next deletes old spent proofs
        self.commits = 0  # group commits done (for benchmarks)
        self.writes = 0
        #: On a shared store, each write that adds events to a run or moves it
        #: calls this in its transaction: ``(connection, run id, its last seq
        #: written or 0, whether its status changed)``. None: nobody to tell.
        self._changed: Callable[[Any, str, int, bool], None] | None = None
        #: A guarded move's UPDATE for each shape of its changes (``_move_sql``).
        self._move_sqls: dict[tuple[Any, ...], str] = {}

    async def listen(
        self,
        changed: Callable[[str], None],
        caught_up: Callable[[], None],
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """See ``Store.listen``: a store no other process writes has nothing to say."""
        raise NotImplementedError

    # -- what a store supplies ----------------------------------------------------------

    def _open_sync(self) -> None:
        """Connect and create (or upgrade) the schema; in a worker thread."""
        raise NotImplementedError

    def _close_sync(self) -> None:
        raise NotImplementedError

    async def _commit(self, ops: list[_Write]) -> None:
        """Run ``ops`` as one transaction (replayed one by one should one fail),
        setting each op's result or error. Raises when no write could start."""
        raise NotImplementedError

    def _read_sync(self, fn: Callable[[Any], T]) -> T:
        """In a worker thread: ``fn`` on an idle reader connection."""
        raise NotImplementedError

    def read_now(self, fn: Callable[[Any], T]) -> T:
        """Blocking read on the trio thread: only for start-up and tests."""
        raise NotImplementedError

    def _medium_error(self, exc: BaseException) -> bool:
        """An error of the database itself (its driver's), as opposed to a bug."""
        raise NotImplementedError

    def _touch(self, conn: Any) -> None:
        """The probe's write: one that touches the medium and changes nothing."""
        raise NotImplementedError

    async def _background(self) -> None:
        """Whatever else the store runs while open (checkpoints)."""

    # -- thread leases: nothing to do for a record of one process -----------------------

    def _lead(self, conn: Any, thread_id: str) -> None:
        """In a write: take the thread's lease when nobody holds it, keep it
        when it is ours, and refuse (NotLeader) otherwise."""

    def _fence(self, conn: Any, run_id: str) -> None:
        """In a write: refuse (NotLeader) unless the run's thread is ours.
        A store may check at the transaction's end (before COMMIT) instead
        of at once: a refusal then undoes the whole transaction."""

    def _fenced_move(self) -> tuple[str, tuple[Any, ...]]:
        """The lease check folded into a guarded move's ``UPDATE runs``: a
        condition ANDed to its WHERE (``runs.thread_id`` in scope) and its
        parameters. Empty: no lease to check (a record of one process)."""
        return "", ()

    def _refused(self, conn: Any, run_id: str) -> None:
        """In a write, after a guarded move changed no row: raise NotLeader
        when the fence, not the status guard, was the reason."""

    async def renew_leases(self) -> list[str]:
        return []

    async def claim_threads(
        self,
        *,
        agents: Sequence[str] | None = None,
        threads: Sequence[str] | None = None,
        unleased: bool = False,
    ) -> list[str]:
        return []

    def release_lease(self, thread_id: str) -> PendingWrite | None:
        return None

    def hand_over_lease(self, thread_id: str) -> PendingWrite | None:
        return None

    # -- the cluster's roster and forwarding (docs/cluster.md): nothing on a
    # record of one process, which is the whole funduq

    def heartbeat(
        self, url: str, served: Sequence[tuple[str, str]], *, tell: bool = False
    ) -> PendingWrite | None:
        return None

    async def cluster_secret(self) -> str:
        return ""

    def leave(self) -> None:
        return None

    async def thread_leader(self, thread_id: str) -> tuple[str, str, bool] | None:
        return None

    async def serving_nodes(self, key: str, agent: str) -> list[tuple[str, str]]:
        return []

    async def served_anywhere(self) -> set[tuple[str, str]]:
        return set()

    # -- writing ------------------------------------------------------------------------

    async def write(self, fn: Callable[[Any], T], *, after: PendingWrite | None = None) -> T:
        """Run ``fn`` in the next group commit; return once it is durable.
        ``after``: a write queued before, which ``fn`` needs to have gone
        through with a true result; if it did not, ``fn`` is not run and the
        result is ``SKIPPED``. First-in first-out, the two may then share a
        commit where awaiting the first before queueing ``fn`` took two."""
        op = _Write(fn if after is None else _chained(fn, after._op))
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

    def write_soon(self, fn: Callable[[Any], Any], *, wake: bool = True) -> PendingWrite:
        """Queue ``fn`` for the next group commit without waiting for it. The
        writer is first-in first-out, so anything written (and awaited) after
        it is durable only once this is too. Its result (or error) is the
        returned handle's, once that commit is done. ``wake=False``: the
        writer is not woken for it; the next write, or the handle's
        ``result`` or ``hurry``, does -- so a write its queuer knows is
        coming right behind it shares its commit."""
        op = _Write(fn)
        self._pending.append(op)
        if wake:
            self._wake.set()
        return PendingWrite(self, op, self._batch_done)

    async def probe(self) -> bool:
        """Try a write that touches the medium; True when it went through.
        Clears ``failing`` then."""
        try:
            await self.write(self._touch)
        except Exception as exc:
            if not self._medium_error(exc):
                raise
            return False
        return True

    async def _run_writer(
        self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        task_status.started()
        while True:
            await self._wake.wait()
            # One pass of the scheduler before taking the batch: the tasks
            # made runnable with this one (a commit wakes every writer of
            # its batch at once) queue their next writes into it. In
            # bench/inprocess.py's shape that halves the commits per run.
            await trio.lowlevel.checkpoint()
            await self._flush()

    async def _flush(self) -> None:
        self._wake = trio.Event()
        ops, done = self._pending, self._batch_done
        if not ops:
            return
        self._pending, self._batch_done = [], Committed()
        try:
            await self._commit(ops)
        except Exception as exc:
            if not self._medium_error(exc):
                for op in ops:
                    op.error = op.error or exc
                raise
            # The medium failed before any write could start (an I/O error at
            # BEGIN, the server gone): each write of the batch fails with it,
            # and the writer lives on for the next batch -- a dead writer
            # would wedge every run.
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

    # -- reading ------------------------------------------------------------------------

    async def read(self, fn: Callable[[Any], T]) -> T:
        async with self._read_limiter:
            return await trio.to_thread.run_sync(self._read_sync, fn)

    async def ping(self) -> None:
        await self.read(lambda c: c.execute("SELECT 1").fetchone())

    # -- the writes the broker makes ----------------------------------------------------

    async def insert_run(
        self,
        row: dict[str, Any],
        new_thread: tuple[Any, ...] | None,
        messages: Sequence[MessageRow],
    ) -> None:
        """A new run (and its new thread, and the messages it adds)."""
        await self.write(self._insert_write(row, new_thread, messages))

    def insert_run_soon(
        self,
        row: dict[str, Any],
        new_thread: tuple[Any, ...] | None,
        messages: Sequence[MessageRow],
    ) -> PendingWrite:
        """See ``Store.insert_run_soon``."""
        return self.write_soon(self._insert_write(row, new_thread, messages), wake=False)

    def _insert_write(
        self,
        row: dict[str, Any],
        new_thread: tuple[Any, ...] | None,
        messages: Sequence[MessageRow],
    ) -> Callable[[Any], bool]:
        if not keepable(*(m[2] for m in messages), *(new_thread or ())[:4]):
            raise Unrecordable(
                "a message id or thread holds a character the record cannot "
                "keep (NUL or a lone surrogate)"
            )

        sequenced = self.ARRIVAL != "?"
        insert = (
            "INSERT INTO runs (arrival, id, thread_id, provider_key, agent_name, status, "
            "input, caller_metadata, metadata, created_at) "
            f"VALUES ({self.ARRIVAL},?,?,?,?,?,?,?,?,?)"
        )

        def apply(conn: Any) -> bool:
            if new_thread is not None:
                conn.execute(
                    "INSERT INTO threads (id, provider_key, agent_name, segment_head, "
                    "created_at) VALUES (?,?,?,?,?)",
                    new_thread,
                )
            self._lead(conn, row["thread_id"])
            conn.execute(
                insert,
                (
                    *(() if sequenced else (row["arrival"],)),
                    row["id"],
                    row["thread_id"],
                    row["provider_key"],
                    row["agent_name"],
                    row["status"],
                    row["input"],
                    row["caller_metadata"],
                    _dumps_metadata(row["metadata"]),
                    row["created_at"],
                ),
            )
            if messages:
                _insert_messages(conn, messages)
            return True

        return apply

    async def move(
        self, run_id: str, to: str, *, after: PendingWrite | None = None, **changes: Any
    ) -> bool:
        """Guarded status write, with any events, metadata and messages that go
        with it, in one transaction (the changes are ``_move_write``'s).
        Returns False (and writes nothing) when the run is not in a status the
        move starts from. ``move_soon`` queues the same write without waiting.
        ``after``: see ``write`` (``SKIPPED`` when that move did not move)."""
        return await self.write(self._move_write(run_id, to, **changes), after=after)

    def move_soon(
        self,
        run_id: str,
        to: str,
        *,
        metadata: dict[str, Any] | None = None,
        stamp: tuple[str, float] | None = None,
    ) -> PendingWrite:
        """``move`` queued without waiting (first-in first-out): whatever is
        written after it lands after it. Its verdict is the handle's result."""
        return self.write_soon(self._move_write(run_id, to, metadata=metadata, stamp=stamp))

    def _move_write(
        self,
        run_id: str,
        to: str,
        *,
        metadata: dict[str, Any] | None = None,
        events: Iterable[tuple[int, dict[str, Any]]] = (),
        stamp: tuple[str, float | None] | None = None,
        run_input: dict[str, Any] | None = None,
        arrival: int | None = None,
        caller_metadata: str | None = None,
        messages: Sequence[MessageRow] | None = None,
        lead: str | None = None,
    ) -> Callable[[Any], bool]:
        fence, fence_args = self._fenced_move()
        shape = (
            to,
            metadata is None,
            stamp and stamp[0],
            run_input is None,
            arrival is None,
            caller_metadata is None,
            fence,
        )
        sql = self._move_sqls.get(shape)
        if sql is None:
            sql = self._move_sqls[shape] = self._move_sql(shape)
        args: list[Any] = []
        if metadata is not None:
            args.append(_dumps_metadata(metadata))
        if stamp is not None:
            args.append(stamp[1])
        if run_input is not None:
            args.append(dumps(run_input))
        if arrival is not None and self.ARRIVAL == "?":
            args.append(arrival)
        if caller_metadata is not None:
            args.append(caller_metadata)
        args.append(run_id)
        if fence_args:
            args.extend(fence_args)
        params = tuple(args)
        inserts, last_seq = _event_statements(run_id, events)
        changed = self._changed

        def apply(conn: Any) -> bool:
            if lead is not None:
                self._lead(conn, lead)
            if conn.execute(sql, params).rowcount != 1:
                self._refused(conn, run_id)
                log.error("run %s: guarded write to %r refused", run_id, to)
                return False
            for insert, values in inserts:
                conn.execute(insert, values)
            if messages:
                _insert_messages(conn, messages)
            if changed is not None:
                changed(conn, run_id, last_seq, True)
            return True

        return apply

    def _move_sql(self, shape: tuple[Any, ...]) -> str:
        """A guarded move's UPDATE for one shape of ``_move_write``'s changes,
        made once and kept. The statuses are the table's own words, written
        into the SQL: no parameters to bind for them."""
        to, no_metadata, stamp_column, no_input, no_arrival, no_caller_metadata, fence = shape
        src = sorted(statuses.sources(to))  # ValueError: no status
        sets: list[str] = [f"status='{statuses.Status(to).value}'"]
        if not no_metadata:
            sets.append("metadata=?")
        if stamp_column is not None:
            if stamp_column not in ("started_at", "completed_at"):
                raise ValueError(f"not a stamp: {stamp_column!r}")
            sets.append(f"{stamp_column}=?")
        if not no_input:
            sets.append("input=?")
        if not no_arrival:
            sets.append(f"arrival={self.ARRIVAL}")
        if not no_caller_metadata:
            sets.append("caller_metadata=?")
        # The lease check is in the UPDATE itself (one statement, and the
        # lease row is locked before the run's, as a takeover locks them).
        sources = ",".join(f"'{s.value}'" for s in src)
        return f"UPDATE runs SET {', '.join(sets)} WHERE id=? AND status IN ({sources}){fence}"

    async def append_events(
        self,
        run_id: str,
        events: list[tuple[int, dict[str, Any]]],
        *,
        after: PendingWrite | None = None,
    ) -> Any:
        """A run's events by seq; ``after``: see ``write`` (``SKIPPED`` when
        that move did not move, and nothing written)."""
        inserts, last_seq = _event_statements(run_id, events)
        changed = self._changed
        if changed is None and self.node is None:

            def insert(conn: Any) -> None:
                for statement, values in inserts:
                    conn.execute(statement, values)

            return await self.write(insert, after=after)

        def apply(conn: Any) -> None:
            self._fence(conn, run_id)
            for statement, values in inserts:
                conn.execute(statement, values)
            if inserts and changed is not None:
                changed(conn, run_id, last_seq, False)

        return await self.write(apply, after=after)

    async def record_agents(
        self,
        key: str,
        fingerprint: str,
        rows: list[tuple[str, str, str, str, str]],
        forget: Callable[[list[tuple[str, int]]], list[str]],
    ) -> list[str]:
        """Upsert a key's published agents; ``forget`` decides, from the key's
        recorded ``(name, size)`` oldest first, which of them to delete.
        Returns the names forgotten."""
        for row in rows:
            if not keepable(*row):
                raise Unrecordable(
                    f"agent {row[1]!r}: holds a character the record cannot "
                    "keep (NUL or a lone surrogate)"
                )

        def apply(conn: Any) -> list[str]:
            conn.execute(
                "INSERT INTO providers (key, fingerprint) VALUES (?, ?) "
                "ON CONFLICT (key) DO NOTHING",
                (key, fingerprint),
            )
            recorded = conn.execute(
                "SELECT name, length(name) + length(description) + length(card) + "
                f"length(metadata) FROM agents WHERE provider_key=? ORDER BY {self.AGENT_ORDER}",
                (key,),
            ).fetchall()
            gone = forget([(name, size) for name, size in recorded])
            if gone:
                conn.executemany(
                    "DELETE FROM agents WHERE provider_key=? AND name=?",
                    [(key, name) for name in gone],
                )
            if rows:
                conn.executemany(
                    "INSERT INTO agents (provider_key, name, description, card, metadata) "
                    "VALUES (?,?,?,?,?) ON CONFLICT (provider_key, name) DO UPDATE SET "
                    "description=excluded.description, card=excluded.card, "
                    "metadata=excluded.metadata",
                    rows,
                )
            return gone

        return await self.write(apply)

    async def set_counter(self, key: str, counter: str, value: int) -> None:
        if counter not in COUNTERS:
            raise ValueError(f"not a counter: {counter!r}")
        await self.write(
            lambda c: c.execute(f"UPDATE providers SET {counter}=? WHERE key=?", (value, key))
        )

    # Spent proofs shared by the nodes on one record (DESIGN §8, §11; spends.py).

    async def spend_proof(self, signer: str, payload: str, keep_until: float, now: float) -> bool:
        """Record that ``signer``'s proof over ``payload`` is spent, until
        ``keep_until`` (wall-clock seconds); False, writing nothing, when
        it was spent before -- on this node or any other sharing the record.
        The payload is kept as its SHA-256 (a bounded, keepable key, whatever
        text the proof signed). Now and then (``SPENT_SWEEP_SECONDS``) the
        proofs kept past their time are deleted, so the table stays bounded;
        that delete is a write of its own, so a failure of it fails no spend."""
        digest = hashlib.sha256(payload.encode("utf-8", "surrogatepass")).hexdigest()
        if now >= self._next_sweep:
            self._next_sweep = now + self.SPENT_SWEEP_SECONDS
            self.write_soon(
                lambda c: c.execute("DELETE FROM spent_proofs WHERE keep_until < ?", (now,))
            )
        return bool(
            await self.write(
                lambda c: (
                    c.execute(
                        "INSERT INTO spent_proofs (signer, payload, keep_until) VALUES (?,?,?) "
                        "ON CONFLICT DO NOTHING",
                        (signer, digest, keep_until),
                    ).rowcount
                    == 1
                )
            )
        )

    # The operator's commands (admin.py): the providers' quality counters.

    async def quality_counters(self) -> list[tuple[Any, ...]]:
        """(key, fingerprint, *counters) of every provider, by fingerprint."""
        return cast(
            list[tuple[Any, ...]],
            await self.read(
                lambda c: c.execute(
                    "SELECT key, fingerprint, "
                    + ", ".join(COUNTERS)
                    + " FROM providers ORDER BY fingerprint, key"
                ).fetchall()
            ),
        )

    async def reset_quality(self, provider: str) -> str | None:
        """Zero the counters of the provider whose key (64 hex) or fingerprint
        (16 hex) is ``provider``; its key, or None when there is no such one."""
        column = {64: "key", 16: "fingerprint"}.get(len(provider))
        if column is None or not keepable(provider):
            return None

        def apply(conn: Any) -> str | None:
            row = conn.execute(
                f"SELECT key FROM providers WHERE {column}=? ORDER BY key LIMIT 1", (provider,)
            ).fetchone()
            if row is None:
                return None
            conn.execute(
                "UPDATE providers SET " + ", ".join(f"{c}=0" for c in COUNTERS) + " WHERE key=?",
                (row[0],),
            )
            return str(row[0])

        return cast(str | None, await self.write(apply))

    # KYOK (DESIGN §9): LLM providers' counters and their offerings.

    async def record_offerings(self, key: str, rows: list[tuple[str, str, str, str]]) -> None:
        """Upsert an LLM provider's offerings: (key, name, description, metadata JSON)."""
        for row in rows:
            if not keepable(*row):
                raise Unrecordable(
                    f"offering {row[1]!r}: holds a character the record "
                    "cannot keep (NUL or a lone surrogate)"
                )

        def apply(conn: Any) -> None:
            conn.execute(
                "INSERT INTO llm_providers (key) VALUES (?) ON CONFLICT (key) DO NOTHING", (key,)
            )
            if rows:
                conn.executemany(
                    "INSERT INTO llm_offerings (provider_key, name, description, metadata) "
                    "VALUES (?,?,?,?) ON CONFLICT (provider_key, name) DO UPDATE SET "
                    "description=excluded.description, metadata=excluded.metadata",
                    rows,
                )

        await self.write(apply)

    def set_llm_counter_soon(self, key: str, counter: str, value: int) -> PendingWrite:
        """An LLM provider's counter, queued without waiting (nothing hangs on it)."""
        if counter not in LLM_COUNTERS:
            raise ValueError(f"not an LLM provider counter: {counter!r}")
        return self.write_soon(
            lambda c: c.execute(f"UPDATE llm_providers SET {counter}=? WHERE key=?", (value, key))
        )

    async def llm_providers_and_offerings(self) -> tuple[list[Any], list[Any]]:
        """(key, *counters) of every LLM provider; (provider_key, name,
        description, metadata) of every offering."""

        def read(conn: Any) -> tuple[list[Any], list[Any]]:
            return (
                conn.execute(
                    "SELECT key, " + ", ".join(LLM_COUNTERS) + " FROM llm_providers"
                ).fetchall(),
                conn.execute(
                    "SELECT provider_key, name, description, metadata FROM llm_offerings"
                ).fetchall(),
            )

        return await self.read(read)

    # Push notifications (DESIGN §10): each config and its delivery cursor.

    async def push_configs_delivering(self) -> list[Any]:
        """Every push config still delivering (``PUSH_COLUMNS``)."""
        return cast(
            list[Any],
            await self.read(
                lambda c: c.execute(
                    f"SELECT {PUSH_COLUMNS} FROM push_configs WHERE state=?", (PUSH_DELIVERING,)
                ).fetchall()
            ),
        )

    async def put_push_config(
        self,
        task_id: str,
        config_id: str,
        url: str,
        token: str,
        authentication: str,
        cursor: tuple[int, int],
        *,
        per_task: int | None,
        active: int | None,
    ) -> tuple[str, int] | None:
        """Record a push config (replacing one of that id, cursor and all),
        delivering from ``cursor``; or, writing nothing, why not: ("per_task",
        configs the task has) at ``per_task``, ("active", configs delivering)
        at ``active`` (None: room held already, nothing checked),
        ("unrecordable", 0) for text the record cannot keep."""
        if not keepable(task_id, config_id, url, token, authentication):
            return "unrecordable", 0

        def apply(conn: Any) -> tuple[str, int] | None:
            existing = conn.execute(
                "SELECT 1 FROM push_configs WHERE task_id=? AND id=?", (task_id, config_id)
            ).fetchone()
            if existing is None and per_task is not None:
                count = int(
                    conn.execute(
                        "SELECT COUNT(*) FROM push_configs WHERE task_id=?", (task_id,)
                    ).fetchone()[0]
                )
                if count >= per_task:
                    return "per_task", count
            if existing is None and active is not None:
                count = int(
                    conn.execute(
                        "SELECT COUNT(*) FROM push_configs WHERE state=?", (PUSH_DELIVERING,)
                    ).fetchone()[0]
                )
                if count >= active:
                    return "active", count
            conn.execute(
                "INSERT INTO push_configs (task_id, id, url, token, authentication, created_at, "
                "cursor_seq, cursor_index, state, attempts, last_error) "
                "VALUES (?,?,?,?,?,?,?,?,?,0,NULL) ON CONFLICT (task_id, id) DO UPDATE SET "
                "url=excluded.url, token=excluded.token, authentication=excluded.authentication, "
                "created_at=excluded.created_at, cursor_seq=excluded.cursor_seq, "
                "cursor_index=excluded.cursor_index, state=excluded.state, attempts=0, "
                "last_error=NULL",
                (
                    task_id,
                    config_id,
                    url,
                    token,
                    authentication,
                    time.time(),
                    cursor[0],
                    cursor[1],
                    PUSH_DELIVERING,
                ),
            )
            self._lease_push_config(conn, task_id, config_id)
            return None

        return cast(tuple[str, int] | None, await self.write(apply))

    def _lease_push_config(self, conn: Any, task_id: str, config_id: str) -> None:
        """Around a config's insert (or replacement), in its transaction: on a
        shared record, make its delivery lease this node's. Nothing here."""

    def _push_fence(self) -> tuple[str, tuple[Any, ...]]:
        """A condition (and its arguments) that a push config's cursor
        advance and end add to their ``WHERE``: on a shared record, "the
        delivery lease is this node's". Nothing here: one process delivers."""
        return "", ()

    async def push_config(self, task_id: str, config_id: str) -> Any:
        """One push config (``PUSH_COLUMNS``), or None."""
        if not keepable(task_id, config_id):
            return None
        return await self.read(
            lambda c: c.execute(
                f"SELECT {PUSH_COLUMNS} FROM push_configs WHERE task_id=? AND id=?",
                (task_id, config_id),
            ).fetchone()
        )

    async def push_configs(self, task_id: str) -> list[Any]:
        """A task's push configs (``PUSH_COLUMNS``), oldest first."""
        if not keepable(task_id):
            return []
        return cast(
            list[Any],
            await self.read(
                lambda c: c.execute(
                    f"SELECT {PUSH_COLUMNS} FROM push_configs WHERE task_id=? "
                    "ORDER BY created_at, id",
                    (task_id,),
                ).fetchall()
            ),
        )

    async def delete_push_config(self, task_id: str, config_id: str) -> bool:
        if not keepable(task_id, config_id):
            return False
        return bool(
            await self.write(
                lambda c: (
                    c.execute(
                        "DELETE FROM push_configs WHERE task_id=? AND id=?", (task_id, config_id)
                    ).rowcount
                )
            )
        )

    async def end_push_config(
        self, task_id: str, config_id: str, state: str, error: str | None
    ) -> bool:
        """A config stops delivering: done, or given up with its last error
        (its delivery lease, if any, let go). False when the config is gone
        or (shared record) its lease is another node's: nothing was written."""
        fence, args = self._push_fence()
        return bool(
            await self.write(
                lambda c: (
                    c.execute(
                        "UPDATE push_configs SET state=?, last_error=?, lease_node=NULL, "
                        f"lease_expires=NULL WHERE task_id=? AND id=?{fence}",
                        (state, error, task_id, config_id, *args),
                    ).rowcount
                )
            )
        )

    async def push_delivered(
        self, task_id: str, config_id: str, cursor: tuple[int, int], attempts: int
    ) -> bool:
        """The receiver acknowledged the update at ``cursor`` after
        ``attempts``. False when the config is gone or (shared record) its
        delivery lease is another node's: the cursor did not move."""
        fence, args = self._push_fence()
        return bool(
            await self.write(
                lambda c: (
                    c.execute(
                        "UPDATE push_configs SET cursor_seq=?, cursor_index=?, "
                        f"attempts=attempts+? WHERE task_id=? AND id=?{fence}",
                        (cursor[0], cursor[1], attempts, task_id, config_id, *args),
                    ).rowcount
                )
            )
        )

    async def claim_push_configs(self) -> list[Any]:
        raise NotImplementedError("push delivery leases are a shared record's")

    def release_push_leases(self) -> None:
        raise NotImplementedError("push delivery leases are a shared record's")

    async def renew_push_leases(
        self, keys: Sequence[tuple[str, str]]
    ) -> tuple[set[tuple[str, str]], list[Any]]:
        raise NotImplementedError("push delivery leases are a shared record's")

    # -- the reads the broker makes -----------------------------------------------------

    async def providers_and_agents(self) -> tuple[list[Any], list[Any]]:
        """(key, fingerprint, *counters) of every provider; (provider_key,
        name, description, card, metadata) of every agent."""

        def read(conn: Any) -> tuple[list[Any], list[Any]]:
            return (
                conn.execute(
                    "SELECT key, fingerprint, " + ", ".join(COUNTERS) + " FROM providers"
                ).fetchall(),
                conn.execute(
                    "SELECT provider_key, name, description, card, metadata FROM agents"
                ).fetchall(),
            )

        return await self.read(read)

    async def restore_reads(
        self, orphaned: Sequence[str], threads: Sequence[str] | None = None
    ) -> tuple[int, list[Any], list[RunRow]]:
        """What a restart needs: the last arrival; the runs in ``orphaned``
        statuses as (id, status, metadata, last seq, reported an error); the
        queued runs in arrival order. Of every thread, or of ``threads`` only
        (the threads a node just took the leases of)."""
        marks = ",".join("?" * len(orphaned))
        if threads is not None and not threads:
            return 0, [], []
        # A node taking over thousands of threads at once reads them in chunks.
        chunks: list[tuple[str, tuple[str, ...]]] = [("", ())]
        if threads is not None:
            chunks = [
                (
                    f" AND r.thread_id IN ({','.join('?' * len(part))})",
                    tuple(part),
                )
                for part in (threads[i : i + 500] for i in range(0, len(threads), 500))
            ]

        def read(conn: Any) -> tuple[int, list[Any], list[Any]]:
            arrival = conn.execute("SELECT COALESCE(MAX(arrival), 0) FROM runs").fetchone()[0]
            orphans: list[Any] = []
            queued: list[Any] = []
            for where, ids in chunks:
                orphans += conn.execute(
                    f"SELECT id, status, metadata, (SELECT COALESCE(MAX(seq), 0) FROM events e "
                    f"WHERE e.run_id = r.id), EXISTS (SELECT 1 FROM events e WHERE e.run_id = "
                    f"r.id AND {self.EVENT_TYPE} = 'RUN_ERROR') "
                    f"FROM runs r WHERE status IN ({marks}){where}",
                    (*orphaned, *ids),
                ).fetchall()
                queued += conn.execute(
                    f"SELECT {_RUN_COLUMNS} FROM runs r WHERE status = ?{where}",
                    (statuses.QUEUED, *ids),
                ).fetchall()
            queued.sort(key=lambda row: row[8])  # arrival order
            return int(arrival), orphans, queued

        return await self.read(read)

    async def run_row(self, run_id: str) -> RunRow | None:
        if not keepable(run_id):
            return None
        return cast(
            RunRow | None,
            await self.read(
                lambda c: c.execute(
                    f"SELECT {_RUN_COLUMNS} FROM runs r WHERE id=?", (run_id,)
                ).fetchone()
            ),
        )

    async def get_run(self, run_id: str) -> tuple[SummaryRow, list[tuple[int, str]]] | None:
        """A run's summary and its events (seq, JSON) in order."""
        if not keepable(run_id):
            return None

        def read(conn: Any) -> Any:
            row = conn.execute(
                f"SELECT {_SUMMARY_COLUMNS} FROM runs WHERE id=?", (run_id,)
            ).fetchone()
            if row is None:
                return None
            events = conn.execute(
                "SELECT seq, event FROM events WHERE run_id=? ORDER BY seq", (run_id,)
            ).fetchall()
            return row, events

        return cast(tuple[SummaryRow, list[tuple[int, str]]] | None, await self.read(read))

    async def list_runs(
        self,
        *,
        thread_id: str | None,
        provider_key: str | None,
        agent: str | None,
        limit: int,
        status: Sequence[str] | None = None,
        before: str | None = None,
        bound_to: str | None = None,
    ) -> list[SummaryRow]:
        """Run summaries, newest first, narrowed to a thread, a provider, an
        agent, statuses; ``before`` a run id (only runs that arrived before
        it; an unknown id lists nothing); ``bound_to`` the threads whose
        segment head is that key."""
        where, args = [], []
        if not keepable(thread_id, provider_key, agent, before, bound_to, *(status or ())):
            return []
        for column, value in (
            ("thread_id", thread_id),
            ("provider_key", provider_key),
            ("agent_name", agent),
        ):
            if value is not None:
                where.append(f"r.{column}=?")
                args.append(value)
        if status is not None:
            where.append(f"r.status IN ({','.join('?' * len(status))})")
            args.extend(status)
        if before is not None:
            where.append("r.arrival < (SELECT arrival FROM runs WHERE id=?)")
            args.append(before)
        if bound_to is not None:
            where.append("r.thread_id IN (SELECT id FROM threads WHERE segment_head=?)")
            args.append(bound_to)
        sql = (
            f"SELECT {_SUMMARY_COLUMNS_R} FROM runs r"
            + (" WHERE " + " AND ".join(where) if where else "")
            + " ORDER BY r.arrival DESC LIMIT ?"
        )
        return cast(
            list[SummaryRow], await self.read(lambda c: c.execute(sql, (*args, limit)).fetchall())
        )

    async def task_ids(
        self,
        provider_key: str,
        agent: str,
        *,
        thread_id: str | None,
        bound_to: str | None,
        status: Sequence[str] | None,
        status_after: float | None,
        limit: int,
        after_run: str | None,
    ) -> tuple[int, list[str]]:
        """An agent's runs by status time (A2A ListTasks): how many match in
        all, and the ids of up to ``limit`` of them, newest status time first,
        ties by id descending, after ``after_run`` (keyset: an unknown one
        pages nothing). Narrowed like ``list_runs``; ``status_after`` keeps
        runs whose status time is at least that."""
        if not keepable(provider_key, agent, thread_id, bound_to, after_run, *(status or ())):
            return 0, []
        where = ["r.provider_key=?", "r.agent_name=?"]
        args: list[Any] = [provider_key, agent]
        if thread_id is not None:
            where.append("r.thread_id=?")
            args.append(thread_id)
        if bound_to is not None:
            where.append("r.thread_id IN (SELECT id FROM threads WHERE segment_head=?)")
            args.append(bound_to)
        if status is not None:
            where.append(f"r.status IN ({','.join('?' * len(status))})")
            args.extend(status)
        if status_after is not None:
            where.append(f"{STATUS_TIME} >= ?")
            args.append(status_after)
        matching = " AND ".join(where)
        keyset, keyset_args = "", []
        if after_run is not None:
            keyset = (
                f" AND ({STATUS_TIME}, r.id) < (SELECT {STATUS_TIME}, r.id FROM runs r "
                "WHERE r.id=?)"
            )
            keyset_args = [after_run]

        def read(conn: Any) -> tuple[int, list[str]]:
            total = conn.execute(f"SELECT COUNT(*) FROM runs r WHERE {matching}", args).fetchone()[
                0
            ]
            ids = [
                r[0]
                for r in conn.execute(
                    f"SELECT r.id FROM runs r WHERE {matching}{keyset} "
                    f"ORDER BY {STATUS_TIME} DESC, r.id DESC LIMIT ?",
                    (*args, *keyset_args, limit),
                ).fetchall()
            ]
            return int(total), ids

        return await self.read(read)

    async def run_thread(self, run_id: str) -> str | None:
        """The thread a run is in."""
        if not keepable(run_id):
            return None
        row = await self.read(
            lambda c: c.execute("SELECT thread_id FROM runs WHERE id=?", (run_id,)).fetchone()
        )
        return None if row is None else str(row[0])

    async def thread_runs(self, thread_id: str) -> list[tuple[str, str]]:
        """(run id, status) of a thread's runs in arrival order."""
        if not keepable(thread_id):
            return []
        return cast(
            list[tuple[str, str]],
            await self.read(
                lambda c: c.execute(
                    "SELECT id, status FROM runs WHERE thread_id=? ORDER BY arrival", (thread_id,)
                ).fetchall()
            ),
        )

    async def thread(
        self, thread_id: str
    ) -> tuple[tuple[str, str, str | None], list[str], int] | None:
        """((provider key, agent, segment head), message ids, the next
        message's position) of a thread. The next position is one past the
        last one taken, not the count: positions a run that was not recorded
        could not give back (``Funduq._unsee``) leave gaps."""
        if not keepable(thread_id):
            return None

        def read(conn: Any) -> Any:
            row = conn.execute(
                "SELECT provider_key, agent_name, segment_head FROM threads WHERE id=?",
                (thread_id,),
            ).fetchone()
            if row is None:
                return None
            found = conn.execute(
                "SELECT message_id, idx FROM messages WHERE thread_id=?", (thread_id,)
            ).fetchall()
            return tuple(row), [r[0] for r in found], max((r[1] + 1 for r in found), default=0)

        return cast(
            tuple[tuple[str, str, str | None], list[str], int] | None, await self.read(read)
        )

    async def messages(self, thread_id: str, limit: int | None) -> list[str]:
        """A thread's messages (JSON) in order: all, or the last ``limit``."""
        if not keepable(thread_id):
            return []

        def read(conn: Any) -> list[Any]:
            if limit is None:
                return cast(
                    list[Any],
                    conn.execute(
                        "SELECT message FROM messages WHERE thread_id=? ORDER BY idx", (thread_id,)
                    ).fetchall(),
                )
            rows = conn.execute(
                "SELECT message FROM messages WHERE thread_id=? ORDER BY idx DESC LIMIT ?",
                (thread_id, limit),
            ).fetchall()
            return cast(list[Any], rows[::-1])

        return [m for (m,) in await self.read(read)]

    async def events_after(
        self, run_id: str, after: int, before: int | None, limit: int | None
    ) -> list[tuple[int, str]]:
        """A run's events (seq, JSON) with after < seq < before, in order."""
        if not keepable(run_id):
            return []
        sql = "SELECT seq, event FROM events WHERE run_id=? AND seq>? AND seq<? ORDER BY seq"
        args: tuple[Any, ...] = (run_id, after, before if before is not None else 2**62)
        if limit is not None:
            sql, args = sql + " LIMIT ?", (*args, limit)
        return [(int(s), e) for s, e in await self.read(lambda c: c.execute(sql, args).fetchall())]

    async def run_exists(self, run_id: str) -> bool:
        if not keepable(run_id):
            return False
        return bool(
            await self.read(
                lambda c: (
                    c.execute("SELECT 1 FROM runs WHERE id=?", (run_id,)).fetchone() is not None
                )
            )
        )

    async def run_facts(self, run_id: str) -> tuple[str | None, str] | None:
        """(segment head of its thread, its provider key), or None."""
        if not keepable(run_id):
            return None
        row = await self.read(
            lambda c: c.execute(
                "SELECT t.segment_head, r.provider_key FROM runs r JOIN threads t "
                "ON t.id = r.thread_id WHERE r.id=?",
                (run_id,),
            ).fetchone()
        )
        return None if row is None else (row[0], row[1])

    async def paused_run(self, thread_id: str, status: str) -> str | None:
        """The thread's latest run in ``status``."""
        if not keepable(thread_id):
            return None
        row = await self.read(
            lambda c: c.execute(
                "SELECT id FROM runs WHERE thread_id=? AND status=? ORDER BY arrival DESC LIMIT 1",
                (thread_id, status),
            ).fetchone()
        )
        return None if row is None else str(row[0])

    async def run_progress(self, run_id: str) -> tuple[str, int] | None:
        """(status, last seq) of a run."""
        if not keepable(run_id):
            return None
        row = await self.read(
            lambda c: c.execute(
                "SELECT status, (SELECT COALESCE(MAX(seq), 0) FROM events e "
                "WHERE e.run_id = r.id) FROM runs r WHERE id=?",
                (run_id,),
            ).fetchone()
        )
        return None if row is None else (row[0], int(row[1]))

    async def run_events(
        self, run_id: str, after: int, limit: int | None
    ) -> tuple[str, list[tuple[int, str]]] | None:
        """(status, events (seq, JSON) after ``after``, in order, at most
        ``limit``) of a run, or None. The status is read first: when it says
        the run settled, every event written up to its settling is among the
        events read after it (each read sees every commit before it)."""
        if not keepable(run_id):
            return None
        sql = "SELECT seq, event FROM events WHERE run_id=? AND seq>? ORDER BY seq"
        args: tuple[Any, ...] = (run_id, after)
        if limit is not None:
            sql, args = sql + " LIMIT ?", (*args, limit)

        def read(conn: Any) -> Any:
            row = conn.execute("SELECT status FROM runs WHERE id=?", (run_id,)).fetchone()
            if row is None:
                return None
            return str(row[0]), [(int(s), e) for s, e in conn.execute(sql, args).fetchall()]

        return cast(tuple[str, list[tuple[int, str]]] | None, await self.read(read))


@asynccontextmanager
async def run_store(store: SqlStore) -> AsyncIterator[SqlStore]:
    """Open ``store`` and run its writer; on the way out, commit whatever is
    still waiting before its connections close."""
    await trio.to_thread.run_sync(store._open_sync)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(store._run_writer)
            nursery.start_soon(store._background)
            try:
                yield store
            finally:
                nursery.cancel_scope.cancel()
    finally:
        with trio.CancelScope(shield=True):
            await store._flush()
            await trio.to_thread.run_sync(store._close_sync)


def record_name(settings: Settings) -> str:
    """Where the record is, for people: the SQLite file's absolute path, or
    the PostgreSQL database (never its password)."""
    if settings.database_is_postgres:
        from .postgres import PostgresStore

        return PostgresStore(settings.database_url or "").where
    return os.path.abspath(settings.database_path)


def open_store(settings: Settings, *, create: bool = True, node: str | None = None) -> Any:
    """The store ``FUNDUQ_DATABASE_URL`` names (the data directory's SQLite
    file by default), as an async context manager. ``create=False`` opens
    only a record that exists (NoRecord otherwise), creating nothing.
    ``node``: this process's node id, when the record is shared (PostgreSQL)
    and this process leads threads -- its writes of runs are then fenced by
    thread leases."""
    if settings.database_is_postgres:
        from .postgres import PostgresStore

        return run_store(
            PostgresStore(
                settings.database_url or "",
                create=create,
                node=node,
                lease_seconds=settings.lease_seconds,
            )
        )
    from .record import SqliteStore

    return run_store(SqliteStore(settings.database_path, create=create))
