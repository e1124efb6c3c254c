"""The ``Funduq`` facade: the one object the doors, the provider link and the
tests use. It owns the record, the provider registry, the live lanes and the
thread nurseries; everything a run goes through happens in its lane
(``lanes.py``) -- this module only starts lanes, routes requests to them and
reads the record.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Collection, Iterator
from dataclasses import dataclass, replace
from typing import Any

import trio

from ..config import OPERATOR_TOKEN, Settings
from ..identity import Identity, dispatch_hop, fingerprint_of
from ..protocol import agui, carriable
from ..protocol import statuses as st
from ..secret_file import load_or_create
from . import authority
from .admission import WaitingRuns
from .authority import Reader
from .cluster import (
    CLUSTER_SIGNER,
    FRESH_SECONDS,
    Forwarder,
    Unreachable,
    cluster_kyok_secret,
)
from .errors import (
    AgentNotFound,
    InvalidRunInput,
    NotAuthorized,
    QueueLimitReached,
    RecordUnavailable,
    RunNotCancellable,
    RunNotFound,
    RunNotPaused,
    ThreadLedElsewhere,
    ThreadQueueFull,
    UnknownThread,
)
from .inbox import Cancel
from .kyok import Grant, Kyok, KyokRefusal, load_or_create_secret
from .lanes import Lane, ThreadLanes
from .leases import Leases, new_node_id
from .metrics import Metrics
from .providers import AgentView, ProviderLink, Providers, ProviderSession
from .pushes import Pushes
from .quiet import Quiet
from .run_machine import Input, Move, RunMachine, Settle
from .spends import Spends
from .store import (
    ROSTER_NOTICE,
    NotLeader,
    PendingWrite,
    Store,
    dumps,
    iso,
    keepable,
    open_store,
    record_trouble,
)
from .watchers import RunWatchers

log = logging.getLogger("funduq")


#: Threads whose facts (segment head, message ids) stay cached while idle.
THREAD_CACHE = 16384

#: Request-level metadata keys that prove something to funduq; they are not
#: forwarded to providers.
PROOF_KEYS = ("cancel", "resolution", "presenter")


class _Takeover:
    """A claim of thread leases and the restore of the threads it won, in
    flight on this node (``Funduq._take_threads``).

    Between the claim and the end of the restore, this node leads the
    threads won, so new work of theirs -- a run sent, a pause answered -- is
    recorded at once; laned at once, it would be offered ahead of the runs
    the old leader left queued, which the restore has not laned yet. So such
    work is ``held`` here and laned by the restore after them (in the order
    this node recorded it), and a run the restore read as queued and laned
    itself is not laned again (``laned``)."""

    __slots__ = ("claimed", "won", "done", "restored", "held", "laned")

    def __init__(self) -> None:
        #: Set once the claim answered: ``won`` holds the threads it took.
        self.claimed = trio.Event()
        self.won: set[str] = set()
        #: Set once the restore ended (laned what it could, or failed);
        #: ``restored`` once it went through.
        self.done = trio.Event()
        self.restored = False
        #: (this node's arrival, the run's row, arriving) of new work waiting.
        self.held: list[tuple[int, dict[str, Any], bool]] = []
        #: The runs the restore laned (the queued it read, then the held).
        self.laned: set[str] = set()


def _check_carriable(metadata: Any, thread_id: Any = None) -> None:
    """Refuse request metadata (or a thread id) the provider link could not
    carry -- the doors refuse it first; this keeps any other way in honest."""
    problem = carriable.problem(metadata) or carriable.problem(thread_id)
    if problem is not None:
        raise InvalidRunInput(f"request metadata cannot be carried to a provider: {problem}")


@dataclass(frozen=True)
class RunTicket:
    run_id: str
    thread_id: str


@dataclass(frozen=True)
class KyokRun:
    """A run a KYOK completion may be spent on, as the relay needs it."""

    run_id: str
    key: str  # the agent's provider key: it signs the call
    agent: str
    offering: tuple[str, str]  # the LLM provider key and offering name the caller chose
    context: dict[str, Any] | None  # the caller's, for the LLM provider only
    actor_chain: list[str] | None


@dataclass(slots=True)
class ThreadInfo:
    id: str
    key: str
    agent: str
    segment_head: str | None
    message_ids: set[str]
    message_count: int


_entropy = bytearray()


def _new_id(prefix: str) -> str:
    """``prefix_`` + 24 hex digits: 8 of the clock (milliseconds, modulo
    2**32: it comes round every ~49.7 days), then 16 random (64 bits). Ids
    are unguessable but never credentials; entropy is drawn from the OS in
    blocks, not per id. The clock first puts the rows a run and its thread
    write (``runs``, ``threads``, ``events``, ``messages``, keyed by these
    ids) on the B-trees' newest pages, which the record keeps cached, where a
    random id put each on a random page (bench/README.md, "The record's
    writes on a record that holds many runs")."""
    global _entropy
    if len(_entropy) < 8:
        _entropy = bytearray(secrets.token_bytes(4096))
    chunk = _entropy[:8]
    del _entropy[:8]
    return f"{prefix}_{time.time_ns() // 1_000_000 & 0xFFFFFFFF:08x}{chunk.hex()}"


#: The statuses a lane ends at (settled, or paused): what ``wait_run`` may
#: answer from the lane's snapshot, when the lane recorded it itself.
_ENDED_AS = st.TERMINAL | {st.INPUT_REQUIRED}


class Funduq:
    """The broker. ``async with Funduq(settings) as funduq: ...``"""

    def __init__(self, settings: Settings, *, identity: Identity | None = None) -> None:
        self.settings = settings
        self.identity = identity
        #: This process's id among the nodes sharing a PostgreSQL record, and
        #: the threads it leads (docs/cluster.md; unused on SQLite).
        self.node = new_node_id(settings.node_name)
        self.leases = Leases(self.node, settings.lease_seconds)
        #: On a shared record, an offer leaves only while this node's own
        #: clock says its leases cannot have lapsed (``lease_sure``): that is
        #: the trio time the last renewal the record took was sent (or the
        #: node started: every lease of this node id was taken after it)
        #: plus the lease. False on a record only this process writes.
        self.leased = False
        self._renewal_sent_at = 0.0
        #: Offers held back until a renewal lands (made by the first).
        self._renewal_landed: trio.Event | None = None
        self._claim_now = trio.Event()
        #: Claims of thread leases and the restores of what they won, in
        #: flight: new work of those threads waits for them (_lane_in_order).
        self._takeovers: list[_Takeover] = []
        #: What is served changed (here, or on another node): look for threads
        #: led here whose agent only another node serves now (_hand_over).
        self._handover_due = False
        #: Where other nodes reach this one (FUNDUQ_NODE_URL, else where it
        #: serves), the roster it last told the record, the forwarder of
        #: calls to other nodes and the secret they are signed with.
        self.node_url = settings.node_url or ""
        self._served_told: tuple[tuple[str, str], ...] | None = None
        self._roster_stale = trio.Event()
        self.forwarder: Forwarder | None = None
        self.cluster_secret = ""
        self._leaving = False
        #: The operator's bearer token (see _load_operator_token).
        self.operator_token = ""
        self.record: Store
        self.providers: Providers
        self.lanes: dict[str, Lane] = {}
        self.threads: dict[str, ThreadLanes] = {}
        self.metrics = Metrics()
        #: Runs waiting in funduq and their input, bounded (docs/limits.md).
        self.waiting = WaitingRuns(
            max_runs=settings.max_queued_runs,
            max_runs_per_agent=settings.max_queued_runs_per_agent,
            max_bytes=settings.max_queued_input_bytes,
            still_waiting=self._still_waiting,
        )
        #: Proofs accepted while fresh: each works once (DESIGN §8), on every
        #: node sharing the record (spends.py).
        self.spent = Spends(authority.SpentProofs(settings.max_spent_proofs))
        # Listing and presenter proofs are accepted from any key, so anyone
        # can mint them by the thousand: they are kept apart, where filling
        # the store delays only other listings and presented chains, never a
        # bound thread's reads, cancels and answers.
        self.spent_by_anyone = Spends(authority.SpentProofs(settings.max_spent_proofs))
        #: Signed calls between nodes taken here: each works once, on every
        #: node (a captured call sent again is refused). Only a call the
        #: cluster's secret signed is ever spent, so no per-key share.
        self.spent_calls = Spends(
            authority.SpentProofs(
                settings.max_spent_proofs, window=FRESH_SECONDS, per_key=settings.max_spent_proofs
            )
        )
        self.kyok: Kyok
        self._thread_info: dict[str, ThreadInfo] = {}
        #: thread id -> the runs of it whose utterance is being written (the
        #: queue limit counts them; a thread in it is busy here).
        self._reserved: dict[str, set[str]] = {}
        self._answering: dict[str, int] = {}
        #: run id -> [event set when a lane next takes the run, watchers]:
        #: subscribers waiting at a pause for its answer (see wait_reopened).
        self._reopen: dict[str, list[Any]] = {}
        self._arrival = 0
        #: On a shared record (several nodes on one PostgreSQL): followers and
        #: waiters of runs laned elsewhere, woken by the record's notifications
        #: (docs/cluster.md). None on a record only this process writes.
        self.watchers: RunWatchers | None = None
        self._nursery: trio.Nursery | None = None
        self.pushes: Pushes | None = None
        #: The context lanes start in (see _start_lane).
        self._context = contextvars.Context()
        self._stack = contextlib.AsyncExitStack()
        self.running = False

    # -- life ----------------------------------------------------------------------

    async def __aenter__(self) -> Funduq:
        # Before any write of this node id: every lease it takes is later.
        self._renewal_sent_at = trio.current_time()
        await self._stack.__aenter__()
        try:
            # The secrets first: a corrupt key file stops the start before the
            # record is created or opened.
            if self.identity is None:
                self.identity = await trio.to_thread.run_sync(self._load_identity)
            self.operator_token = await trio.to_thread.run_sync(self._load_operator_token)
            secret = b""
            if self.settings.kyok_secret or not self.settings.database_is_postgres:
                secret = await trio.to_thread.run_sync(self._load_kyok_secret)
            self.record = await self._stack.enter_async_context(
                open_store(self.settings, node=self.node)
            )
            if self.record.shared:
                self.leased = True
                self.cluster_secret = await self.record.cluster_secret()
                if not self.settings.kyok_secret:
                    # Every node mints and reads the same tokens, so a
                    # completion may reach any of them (docs/cluster.md, KYOK).
                    secret = cluster_kyok_secret(self.cluster_secret)
            self.spent.share(self.record)
            self.spent_by_anyone.share(self.record)
            self.spent_calls.share(self.record)
            self.providers = Providers(
                self.record,
                self.settings.quality_allowance,
                self._provider_thread_messages,
                self.metrics,
                max_agents=self.settings.max_agents_per_provider,
                max_roster_bytes=self.settings.max_frame_bytes,
            )
            await self.providers.load()
            self.kyok = Kyok(
                self.record,
                secret,
                self.metrics,
                max_spent_calls=self.settings.max_spent_proofs,
                completions_per_run=self.settings.kyok_completions_per_run,
            )
            await self.kyok.load()
            if self.settings.public_url:
                self.kyok.base_url = self.settings.public_url.rstrip("/") + "/kyok/v1"
            if self.record.shared:
                # Runs after the nursery below ended, before the record closes.
                self._stack.callback(self._let_push_leases_go)
            self._nursery = await self._stack.enter_async_context(trio.open_nursery())
            self._context = contextvars.copy_context()
            self._stack.callback(self._nursery.cancel_scope.cancel)
            if self.record.shared:
                self.forwarder = Forwarder(self.cluster_secret)
                self._stack.push_async_callback(self.forwarder.aclose)
                self._stack.callback(self._leave_cluster)
                self.watchers = RunWatchers()
                await self._nursery.start(self._listen, self._changed, self._caught_up)
                self._nursery.start_soon(self._keep_roster)
                self.metrics.cluster = True
                self.providers.on_served = self._wake_lease_task
                await self._nursery.start(self._keep_leases)
            await self._restore()
            self.pushes = Pushes(self)
            await self._nursery.start(self.pushes.run)
            self.running = True
        except BaseException:
            await self._stack.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        self.running = False
        return await self._stack.__aexit__(*exc)

    async def _listen(
        self,
        changed: Any,
        caught_up: Any,
        *,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        await self.record.listen(changed, caught_up, task_status=task_status)

    def _changed(self, run_id: str) -> None:
        """A notification: a run changed, or (ROSTER_NOTICE) the roster."""
        if run_id == ROSTER_NOTICE:
            self._roster_stale.set()
            self._wake_lease_task()  # another node may serve what we lead
        elif self.watchers is not None:
            self.watchers.wake(run_id)

    def _caught_up(self) -> None:
        self._roster_stale.set()
        if self.watchers is not None:
            self.watchers.wake_all()

    async def _keep_roster(self) -> None:
        """Read the agents again whenever a node's links publish or drop some
        (ROSTER_NOTICE), so every node's doors know every agent."""
        while True:
            await self._roster_stale.wait()
            self._roster_stale = trio.Event()
            try:
                await self.providers.refresh()
            except Exception as exc:
                if not record_trouble(exc):
                    raise
                log.warning("roster: cannot read it again (%s); at the next change", exc)

    def _load_identity(self) -> Identity:
        if self.settings.identity_key:
            return Identity.from_private_hex(self.settings.identity_key)
        return Identity.load_or_create(self.settings.data_dir / "funduq.key")

    def _load_operator_token(self) -> str:
        """The token that lets the operator see everything (DESIGN §8):
        configured, or generated on first start and kept in the data directory."""
        if self.settings.operator_token:
            return self.settings.operator_token

        def read(text: str) -> str:
            if not OPERATOR_TOKEN.fullmatch(text):
                raise ValueError("it must hold one operator token")
            return text

        return load_or_create(
            self.settings.data_dir / "operator.token", lambda: secrets.token_urlsafe(32), read
        )

    def _load_kyok_secret(self) -> bytes:
        if self.settings.kyok_secret:
            return self.settings.kyok_secret.encode("utf-8")
        return load_or_create_secret(self.settings.data_dir / "kyok.secret")

    def served_at(self, url: str) -> None:
        """The server is listening at `url`: KYOK's baseUrl, unless
        FUNDUQ_PUBLIC_URL says where agents reach funduq instead; and where
        other nodes reach this one, unless FUNDUQ_NODE_URL says otherwise."""
        if not self.settings.public_url:
            self.kyok.base_url = url.rstrip("/") + "/kyok/v1"
        if not self.settings.node_url:
            self.node_url = url
        self._claim_now.set()  # tell the record at once

    async def _restore(self) -> None:
        """After a restart: what nobody can still be holding fails
        ``orphaned_by_restart``; queued runs queue again in arrival order;
        paused runs stay answerable. On a record other nodes share, only
        for the threads whose leases this node takes: those nobody leases
        and those whose lease lapsed (their node died) -- never a live
        node's (docs/cluster.md)."""
        if not self.record.shared:
            await self._restore_threads(None)
            return
        await self._take_threads(unleased=True)

    async def _take_threads(self, **claim: Any) -> list[str]:
        """Claim thread leases (``claim_threads``'s arguments) and restore the
        threads won; the threads won. While either is in flight, new work
        recorded here on a thread it may win waits for it (``_Takeover``)."""
        takeover = _Takeover()
        self._takeovers.append(takeover)
        try:
            won = await self.record.claim_threads(**claim)
            takeover.won.update(won)
            takeover.claimed.set()
            if won:
                self.leases.taken(won)
                await self._restore_threads(won, takeover)
                takeover.restored = True
            return won
        finally:
            if takeover in self._takeovers:
                self._takeovers.remove(takeover)
            takeover.claimed.set()
            takeover.done.set()

    def _taking_over(self, thread_id: str) -> bool:
        """Whether a takeover of the thread is being restored here."""
        return bool(self._takeovers) and any(thread_id in t.won for t in self._takeovers)

    async def _lane_in_order(
        self,
        row: dict[str, Any],
        arrival: int,
        takeovers: tuple[_Takeover, ...],
        *,
        arriving: bool,
    ) -> bool:
        """Lane a run this node just recorded (a new run, a paused one
        answered) in its thread's order. ``takeovers``: those in flight when
        its write was sent -- only they can have claimed its thread before the
        write took the lease (a claim sent later finds the lease ours). A
        takeover that won the thread lanes the run after the old leader's
        queued runs (``_Takeover``). True when the run is laned."""
        found: _Takeover | None = None
        held = False
        # Shielded: the run is recorded, and once held a takeover lanes it;
        # a caller gone meanwhile must not leave it unlaned.
        with trio.CancelScope(shield=True):
            for takeover in takeovers:
                await takeover.claimed.wait()
                if row["thread_id"] in takeover.won:
                    found = takeover
                    if not takeover.done.is_set():
                        held = True
                        takeover.held.append((arrival, row, arriving))
                        await takeover.done.wait()
                    break
        if found is None or (
            # The restore ended before the run's write returned here: it did
            # not read the run, and laned everything it read.
            not held and found.restored and row["id"] not in found.laned
        ):
            self._start_lane(row, arriving=arriving)
            return True
        if row["id"] in found.laned:
            return True
        # The takeover failed, or lost the thread: the run waits in the
        # record for the thread's next leader.
        self.waiting.release(row["id"])
        return False

    async def _restore_threads(
        self, threads: list[str] | None, takeover: _Takeover | None = None
    ) -> None:
        """The restart rules, for every thread (None) or for threads whose
        lease this node just took (by ``takeover``): what their old leader
        held fails ``orphaned_by_restart``, their queued runs lane again in
        arrival order, then the new work recorded here meanwhile."""
        arrival, orphans, queued = await self.record.restore_reads(
            tuple(st.ORPHANED_BY_RESTART), threads
        )
        self._arrival = max(self._arrival, arrival)
        self.metrics.threads_taken_over += len(threads or ())
        for tid in threads or ():
            # Another node led it meanwhile: what we knew of its history is stale.
            if tid not in self._reserved and tid not in self._answering:
                self._thread_info.pop(tid, None)
        lost: set[str] = set()
        settled = laned = 0
        for run_id, status, metadata, last_seq, reported in orphans:
            if run_id in self.lanes:
                continue
            machine = RunMachine(status)
            machine.reported_error = bool(reported)
            for action in machine.handle(Input.RESTARTED):
                assert isinstance(action, Settle), action
                try:
                    await self._settle_unlaned(run_id, json.loads(metadata), last_seq + 1, action)
                except NotLeader as exc:
                    lost.add(exc.what)
                else:
                    settled += 1
        for found in queued:
            row = _run_row(found)
            if row["id"] in self.lanes or row["thread_id"] in lost:
                continue
            self.waiting.charge(
                row["id"], (row["provider_key"], row["agent_name"]), _input_size(row), force=True
            )
            await self._thread(row["thread_id"])  # its history, for the replies it will add
            self._start_lane(row, arriving=False)
            laned += 1
            if takeover is not None:
                takeover.laned.add(row["id"])
        if takeover is not None:
            # New work recorded here since the claim, after the old leader's
            # runs, in the order this node recorded it (a run read above as
            # queued was laned there, in the record's order, and is not laned
            # twice); no await from here until the takeover is done.
            for _, row, arriving in sorted(takeover.held, key=lambda held: held[0]):
                tid = row["thread_id"]
                if row["id"] not in takeover.laned and tid not in lost and self.leases.leads(tid):
                    self._start_lane(row, arriving=arriving)
                    takeover.laned.add(row["id"])
            takeover.held.clear()
            # All laned: from here its threads are as any led here (below, a
            # thread with nothing left to lead is released).
            self._takeovers.remove(takeover)
        for tid in threads or ():
            if tid in lost:
                self._lost_lead(tid)
            else:
                self._maybe_release(tid)  # nothing left to lead
        if settled or laned:
            what = "restart" if threads is None else f"took over {len(threads)} threads"
            log.info("%s: %d runs orphaned, %d queued again", what, settled, laned)

    # -- thread leases (docs/cluster.md) --------------------------------------------------

    async def _keep_leases(
        self, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """The node's one lease task: every ``lease_seconds / 3`` (and at once
        when a provider publishes agents here) renew every lease of this node
        in one statement, stop acting for threads another node took over, and
        claim the lapsed leases of threads whose agent is served here; then
        the same for the push configs' delivery leases (``Pushes.renew``). The
        record's troubles are logged and tried again; anything else ends the
        broker (a node that cannot keep its leases must not go on acting)."""
        task_status.started()
        while True:
            next_at = trio.current_time() + self.leases.renew_every
            try:
                await self._renew_and_claim()
            except Exception as exc:
                if not record_trouble(exc):
                    raise
                log.warning("thread leases: renewal failed (%s); trying again", exc)
            if self.pushes is not None:
                # The push configs' delivery leases ride the same round.
                try:
                    await self.pushes.renew()
                except Exception as exc:
                    if not record_trouble(exc):
                        raise
                    log.warning("push delivery leases: renewal failed (%s); trying again", exc)
            with trio.move_on_at(next_at):
                await self._claim_now.wait()
            self._claim_now = trio.Event()

    def _let_push_leases_go(self) -> None:
        """On the way out, once the push deliverers stopped: let this node's
        delivery leases go, so another node's next lease round resumes the
        configs from their cursors rather than a lease later. Queued: the
        record's last flush commits it even when a cancellation stopped the
        writer (a record that does not answer leaves them to lapse)."""
        if self.pushes is not None:
            self.record.release_push_leases()

    def _wake_lease_task(self) -> None:
        """What is served changed -- a provider published agents here or its
        link dropped, or another node's roster changed: claim lapsed threads
        and hand over unserved ones now."""
        self._handover_due = True
        self._claim_now.set()

    def _leave_cluster(self) -> None:
        """An orderly stop: other nodes stop forwarding here at once, rather
        than once this node's heartbeat lapses. Queued, as above."""
        self._leaving = True
        self.record.leave()

    async def _renew_and_claim(self) -> None:
        handed = await self._hand_over() if self._handover_due else 0
        served = tuple(sorted(self._served_pairs()))
        if not self._leaving:
            # Queued, not awaited: it rides the renewal's group commit (one
            # round trip for both); a failure is the writer's to log. Threads
            # handed over are told too, after their release: the serving
            # nodes' lease tasks wake and claim them.
            self.record.heartbeat(
                self.node_url, served, tell=served != self._served_told or handed > 0
            )
        self._served_told = served
        snapshot = self.leases.snapshot()
        # Read before the statement is queued: the record's now() that the
        # renewal extends every lease of this node from is later still.
        sent_at = trio.current_time()
        renewal = self.leases.renewed(snapshot, await self.record.renew_leases())
        self.metrics.lease_renewals += 1
        for tid in renewal.lost:
            self._lost_lead(tid)
        for tid in renewal.strays:
            self.record.release_lease(tid)
        # After the threads lost are let go: an offer held for one of them
        # was dropped with its lane, never woken to leave.
        self._renewal_landed_at(sent_at)
        agents = self._served_agents()
        if agents:
            # Lapsed leases, and threads nobody leads though they have runs
            # needing a leader (another node handed them over).
            await self._take_threads(agents=agents, unleased=True)

    async def _hand_over(self) -> int:
        """Let go of the threads led here whose agent no link here serves any
        more, with no run of theirs in flight (every lane queued) and no
        request of theirs at work here, while a live node's links serve the
        agent: their lanes here end without writing and their leases are
        released, so a serving node's claim round takes them and offers their
        queued runs through its links ("the lease follows the link"). How many
        threads were let go."""
        # Cleared first: a change while this reads the record looks again.
        self._handover_due = False
        served = set(self._served_pairs())
        idle: dict[tuple[str, str], list[str]] = {}
        for tid, thread in self.threads.items():
            if (
                tid in self._reserved
                or tid in self._answering
                or not thread.pending
                or self._taking_over(tid)  # its old leader's runs not all laned yet
            ):
                continue
            lanes = thread.pending
            if len(lanes) != thread.lanes or any(lane.status != st.QUEUED for lane in lanes):
                continue  # a run in flight (or settling): it ends here first
            pair = (lanes[0].key, lanes[0].agent)
            if pair not in served:
                idle.setdefault(pair, []).append(tid)
        handed = 0
        for (key, agent), tids in idle.items():
            try:
                elsewhere = await self.record.serving_nodes(key, agent)
            except BaseException:
                self._handover_due = True  # the next round looks again
                raise
            if not elsewhere:
                continue  # nobody else serves it: its runs wait here (grace window)
            for tid in tids:
                still = self.threads.get(tid)
                if (
                    still is None
                    or tid in self._reserved
                    or tid in self._answering
                    or self._taking_over(tid)
                    or any(lane.status != st.QUEUED for lane in still.pending)
                    or self.providers.serving(key, agent) is not None
                ):
                    continue  # changed while we read
                del self.threads[tid]
                still.depose()
                self.leases.lost(tid)
                self.record.hand_over_lease(tid)  # its queued runs need a leader
                self._thread_info.pop(tid, None)
                handed += 1
        if handed:
            self.metrics.threads_handed_over += handed
            log.info("handed over %d threads whose agent another node serves now", handed)
        return handed

    def _served_pairs(self) -> list[tuple[str, str]]:
        """The (key, agent) a provider attached here serves."""
        return [
            (key, name)
            for key, session in self.providers.sessions.items()
            if session.live
            for name in session.agents
        ]

    def _served_agents(self) -> list[str]:
        """The agents a provider attached here serves, as "key/name"."""
        return [
            f"{key}/{name}"
            for key, session in self.providers.sessions.items()
            if session.live
            for name in session.agents
        ]

    def _lost_lead(self, thread_id: str) -> None:
        """Another node leads the thread now (its lease was taken over): stop
        acting for it. Its lanes here end without writing (their writes would
        be fenced anyway); a run a provider holds through this node is asked
        to stop -- the new leader settles it by the restart rules."""
        was_held = self.leases.lost(thread_id)
        thread = self.threads.pop(thread_id, None)
        if was_held or thread is not None:
            log.warning(
                "thread %s: its lease was taken over by another node; letting go", thread_id
            )
            self.metrics.threads_let_go += 1
        if thread is not None:
            thread.depose()
        if thread_id not in self._reserved and thread_id not in self._answering:
            self._thread_info.pop(thread_id, None)

    def _maybe_release(self, thread_id: str) -> None:
        """Release the thread's lease once nothing of it is at work here, so
        any node may take its next run at once."""
        if not self.record.shared:
            return
        busy = (
            thread_id in self.threads
            or thread_id in self._reserved
            or thread_id in self._answering
            or self._taking_over(thread_id)  # its restore is not done (or its held work laned)
        )
        if self.leases.release(thread_id, busy=busy):
            self.record.release_lease(thread_id)
            # Whoever leads it next may add messages this cache would not know.
            self._thread_info.pop(thread_id, None)

    def _renewal_landed_at(self, sent_at: float) -> None:
        """A renewal sent at ``sent_at`` (trio time) was taken: every lease
        of this node that it found is sure until ``sent_at`` plus the lease
        (and those taken since, later still). Offers held wake."""
        if sent_at > self._renewal_sent_at:
            self._renewal_sent_at = sent_at
        landed, self._renewal_landed = self._renewal_landed, None
        if landed is not None:
            landed.set()

    async def lease_sure(self, thread_id: str) -> None:
        """Before an offer of the thread leaves (a shared record): return
        once this node's own clock says its lease on the thread cannot have
        lapsed -- less than a lease since the last renewal the record took
        was sent (the record's clock started the lease no earlier) -- at
        once on the common road. A node stalled past that (starved of CPU,
        its renewals unanswered) holds the offer until a renewal lands;
        should the renewal find the thread another node's, the lane
        waiting here is ended with the thread's (``_lost_lead``) and the
        offer never leaves: the new leader settles the run, and offers the
        thread's next runs, alone (docs/cluster.md, "An offer leaves within
        the lease"). The renewal's verdict, not ``Leases.held``, decides:
        a thread taken by a run's insert may be laned (and offered) a step
        before the door notes the lease it took."""
        held = False
        while trio.current_time() >= self._renewal_sent_at + self.leases.seconds:
            if not held:
                held = True
                self.metrics.offers_held += 1
                log.warning(
                    "thread %s: this node's lease may have lapsed (no renewal taken for "
                    "%.1fs); its offer waits for the next renewal",
                    thread_id,
                    trio.current_time() - self._renewal_sent_at,
                )
            if self._renewal_landed is None:
                self._renewal_landed = trio.Event()
            await self._renewal_landed.wait()

    async def _take_over(self, thread_id: str) -> bool:
        """A write found the thread's lease another node's: take it over if
        it lapsed (settling what its old leader left first). True when this
        node leads the thread now."""
        await self._take_threads(threads=[thread_id])
        return self.leases.leads(thread_id)

    def _forget_unled(self, thread_id: str) -> None:
        """Before taking a thread this node does not lead: forget what it knew
        of the thread's history (another node may have added to it)."""
        if (
            self.record.shared
            and not self.leases.leads(thread_id)
            and thread_id not in self._reserved
            and thread_id not in self._answering
            and thread_id not in self.threads
        ):
            self._thread_info.pop(thread_id, None)

    # -- lanes and threads ---------------------------------------------------------

    def _start_lane(
        self, row: dict[str, Any], *, arriving: bool, inserted: PendingWrite | None = None
    ) -> Lane:
        # A task inherits the context of whoever starts it, and a caller's
        # carries its whole HTTP request (quart keeps it in a context
        # variable): a waiting run would hold the request it came in on.
        # Lanes and thread tasks start in the broker's own context instead.
        return self._context.run(self._start_lane_here, row, arriving, inserted)

    def _start_lane_here(
        self, row: dict[str, Any], arriving: bool, inserted: PendingWrite | None
    ) -> Lane:
        known = self.lanes.get(row["id"])
        if known is not None:
            return known  # a takeover laned it a moment ago
        lane = Lane(self, row, arriving=arriving, inserted=inserted)
        lane.feed.keep = self.settings.max_feed_events
        self.lanes[lane.run_id] = lane
        thread = self.threads.get(lane.thread_id)
        if thread is None:
            thread = self.threads[lane.thread_id] = ThreadLanes(lane.thread_id)
        lane.thread = thread
        thread.enqueue(lane)
        assert self._nursery is not None
        thread.start(lane, self._nursery)
        reopen = self._reopen.pop(lane.run_id, None)
        if reopen is not None:
            reopen[0].set()
        if self.watchers is not None:
            # Followers reading the run from the record take the lane's feed instead.
            self.watchers.wake(lane.run_id)
        return lane

    async def _settle_unlaned(
        self, run_id: str, metadata: dict[str, Any], next_seq: int, settle: Settle
    ) -> None:
        """Carry out a machine's Settle for a run no lane owns (restart, arrival)."""
        metadata["failureReason"] = settle.reason
        events = (
            [(next_seq, agui.run_error(settle.reason or "failed"))] if settle.error_event else []
        )
        await self.record.move(
            run_id, settle.to, metadata=metadata, events=events, stamp=("completed_at", time.time())
        )
        self.metrics.run_ended(settle.to)

    # -- the port lanes use (lanes.LaneHost) -----------------------------------------

    def offer_payload(self, lane: Lane) -> dict[str, Any]:
        return self._offer_payload(lane)

    def reply_messages(self, lane: Lane) -> list[tuple[Any, ...]] | None:
        return self._reply_messages(lane)

    def lane_ended(self, lane: Lane) -> None:
        self._lane_ended(lane)

    def lost_lead(self, thread_id: str) -> None:
        self._lost_lead(thread_id)

    def _lane_ended(self, lane: Lane) -> None:
        if log.isEnabledFor(logging.DEBUG):  # its arguments cost a run something
            log.debug(
                "run %s ended %s%s",
                lane.run_id,
                lane.status,
                f" ({lane.metadata['failureReason']})"
                if "failureReason" in (lane.metadata or {})
                else "",
            )
        if self.lanes.get(lane.run_id) is lane:
            del self.lanes[lane.run_id]
            self.waiting.release(lane.run_id)
            self.kyok.run_ended(lane.run_id)
        thread = lane.thread
        if thread is not None and thread.ended(lane) and self.threads.get(thread.id) is thread:
            del self.threads[thread.id]
            self._maybe_release(thread.id)
            if len(self._thread_info) > max(THREAD_CACHE, 2 * len(self.threads)):
                self._forget_idle_threads()

    def _forget_idle_threads(self) -> None:
        """Keep the thread cache bounded: forget the least recently used
        threads nobody is using right now (the record still has them)."""
        keep = THREAD_CACHE * 3 // 4
        for tid in list(self._thread_info):
            if len(self._thread_info) <= keep:
                return
            if tid not in self.threads and tid not in self._reserved and tid not in self._answering:
                del self._thread_info[tid]

    def _offer_payload(self, lane: Lane) -> dict[str, Any]:
        run_input = json.loads(lane.run_input_json)
        caller_metadata = json.loads(lane.caller_metadata_json)
        forwarded = run_input.get("forwardedProps")
        if isinstance(forwarded, dict):
            # Proofs were for funduq; the provider gets the props without them.
            forwarded = {k: v for k, v in forwarded.items() if k not in PROOF_KEYS}
            run_input = {**run_input, "forwardedProps": forwarded}
        chain = self._dispatched_chain(lane, caller_metadata)
        if chain is not None:
            forwarded = dict(forwarded) if isinstance(forwarded, dict) else {}
            forwarded["actorChain"] = chain
            run_input = {**run_input, "forwardedProps": forwarded}
        opt_in = caller_metadata.get("kyok")
        if isinstance(opt_in, dict) or (isinstance(forwarded, dict) and "kyok" in forwarded):
            # The agent gets the grant; the caller's opt-in (its context above
            # all) goes only to the LLM provider, with each completion.
            forwarded = dict(forwarded) if isinstance(forwarded, dict) else {}
            forwarded.pop("kyok", None)
            if isinstance(opt_in, dict):
                forwarded["kyok"] = self.kyok.grant(lane.run_id, lane.key, lane.agent)
            run_input = {**run_input, "forwardedProps": forwarded}
        metadata = {k: v for k, v in caller_metadata.items() if k not in PROOF_KEYS and k != "kyok"}
        return {
            "runId": lane.run_id,
            "threadId": lane.thread_id,
            "agentName": lane.agent,
            "runInput": run_input,
            "metadata": metadata,
        }

    def _dispatched_chain(self, lane: Lane, caller_metadata: dict[str, Any]) -> list[Any] | None:
        """The run's actor chain as funduq dispatched it (None: it has none):
        the caller's hops verbatim plus one hop of funduq's naming where it went."""
        chain = caller_metadata.get("actorChain")
        if not (isinstance(chain, list) and chain):
            return None
        assert self.identity is not None
        return [*chain, dispatch_hop(self.identity, chain[-1], lane.key, lane.agent)]

    # -- providers (the port the link plugs into) -----------------------------------

    def attach_provider(
        self, public_key: str, max_concurrent_runs: int | None, link: ProviderLink
    ) -> ProviderSession:
        return self.providers.attach(public_key, max_concurrent_runs, link)

    def find_agent(self, provider: str, agent: str) -> AgentView | None:
        key = self.providers.resolve_key(provider)
        return None if key is None else self.providers.view(key, agent)

    async def roster(self) -> list[dict[str, Any]]:
        views = self.providers.roster()
        if self.record.shared:
            # Online: served by a link here, or on another live node.
            served = await self.record.served_anywhere()
            views = [
                v if v.online or (v.key, v.name) not in served else replace(v, online=True)
                for v in views
            ]
        return [v.as_json() for v in views]

    def provider_quality(self) -> list[dict[str, Any]]:
        """Every provider funduq has met: online or not, its quality counters
        and the allowance they are withdrawn at (the operator's view)."""
        providers = self.providers
        return [
            {
                "provider": key,
                "fingerprint": fingerprint_of(key),
                "online": key in providers.sessions and providers.sessions[key].live,
                "counters": dict(counts),
                "allowance": providers.allowance,
            }
            for key, counts in sorted(providers.counters.items())
        ]

    async def _provider_thread_messages(
        self, key: str, thread_id: str, limit: int | None
    ) -> list[dict[str, Any]]:
        info = await self._thread(thread_id)
        if info is None or info.key != key:
            raise UnknownThread(thread_id)
        return await self._messages(thread_id, limit)

    # -- callers ---------------------------------------------------------------------

    async def start_run(
        self,
        provider: str,
        agent: str,
        run_input: Any,
        *,
        thread_id: str | None = None,
        metadata: dict[str, Any] | None = None,
        create_unknown_thread: bool = False,
        forwarded: bool = False,
    ) -> RunTicket:
        view = self.find_agent(provider, agent)
        if view is None:
            raise AgentNotFound(f"no agent {agent!r} published by provider {provider!r}")
        key = view.key
        if not forwarded and self.record.shared:  # (one process: always here)
            # Carried out where the thread is led, or where the agent is
            # served (docs/cluster.md, "Forwarding"); everything -- authority,
            # limits -- is checked there, once.
            urls = await self._where_to(key, agent, thread_id)
            if urls:
                found = await self._forward(
                    urls,
                    "start_run",
                    {
                        "provider": key,
                        "agent": agent,
                        "run_input": run_input,
                        "thread_id": thread_id,
                        "metadata": metadata,
                        "create_unknown_thread": create_unknown_thread,
                    },
                    thread_id,
                )
                return RunTicket(str(found["runId"]), str(found["threadId"]))
        if self.record.failing:  # (the probe's coroutine only when it may refuse)
            await self._writable()
        _check_carriable(metadata, thread_id)
        run_input = _read_run_input(run_input)
        metadata = dict(metadata or {})
        run_metadata: dict[str, Any] = {}
        if "kyok" in metadata:
            # Refused here, before anything is recorded, when it names no offering.
            metadata["kyok"] = self.kyok.read_opt_in(metadata["kyok"])
            run_metadata = {"funduq": {"kyok": {"llmProvider": metadata["kyok"]["llmProvider"]}}}
        # The chain's check comes before the thread's lookup, so the answer to
        # a forged chain is the same whether or not the thread exists.
        head = (
            await self._presented_head(metadata, run_input, key, agent)
            if metadata.get("actorChain") is not None
            else None
        )
        if thread_id is not None and keepable(thread_id):
            self._forget_unled(thread_id)
        info = await self._thread(thread_id) if thread_id is not None else None
        if info is not None and (info.key, info.agent) != (key, agent):
            info = None
        if info is None and thread_id is not None and not create_unknown_thread:
            raise UnknownThread(f"unknown thread {thread_id!r} for this agent")
        if info is not None and not authority.may_write(info.segment_head, head, key):
            raise NotAuthorized(authority.NOT_AUTHORIZED)
        tid = info.id if info is not None else _new_id("thread")
        run_id = _new_id("run")
        self._reserve(tid, run_id)
        laning = False
        try:
            run_input["threadId"], run_input["runId"] = tid, run_id
            if info is None:
                info = ThreadInfo(tid, key, agent, head, set(), 0)
                self._thread_info[tid] = info
                new_thread = (tid, key, agent, head, time.time())
            else:
                new_thread = None
            messages = self._new_messages(info, run_input, run_id)
            self._arrival += 1
            # The input and the caller's metadata are kept as the record's JSON
            # text (read again only for the offer): a waiting run holds one
            # string each, not a tree of dicts.
            row: dict[str, Any]
            row = {
                "id": run_id,
                "thread_id": tid,
                "provider_key": key,
                "agent_name": agent,
                "status": st.QUEUED,
                "input": dumps(run_input),
                "caller_metadata": dumps(metadata),
                "metadata": run_metadata,
                "next_seq": 1,
                "arrival": self._arrival,
                "created_at": time.time(),
            }
            try:
                self.waiting.charge(run_id, (key, agent), _input_size(row))
            except QueueLimitReached:
                self._unsee(info, messages, new=new_thread is not None)
                raise
            try:
                try:
                    # The takeovers in flight as the write is sent (see _lane_in_order).
                    takeovers = tuple(self._takeovers)
                    if not takeovers and self.providers.serving(key, agent) is not None:
                        await self._insert_laned(row, new_thread, messages)
                        laning = True
                    else:
                        await self.record.insert_run(row, new_thread, messages)
                except NotLeader:
                    # Another node holds the thread's lease: take it over if
                    # it lapsed, else refuse (nothing was recorded).
                    if not await self._take_over(tid):
                        raise ThreadLedElsewhere(
                            f"thread {tid} is led by another funduq node right now; retry "
                            "on the node that leads it"
                        ) from None
                    if new_thread is None:
                        # Another node led the thread until now and may have
                        # added to its history; this node's copy (kept while
                        # the run was being taken: the restore leaves a
                        # reserved thread's alone) is read again, and the
                        # run's messages placed after what is there now.
                        self._unsee(info, messages, new=False)
                        self._thread_info.pop(tid, None)
                        fresh = await self._thread(tid)
                        if fresh is None or (fresh.key, fresh.agent) != (key, agent):
                            raise UnknownThread(f"unknown thread {tid!r} for this agent") from None
                        if not authority.may_write(fresh.segment_head, head, key):
                            raise NotAuthorized(authority.NOT_AUTHORIZED) from None
                        info = fresh
                        messages = self._new_messages(info, run_input, run_id)
                        row["input"] = dumps(run_input)
                    takeovers = tuple(self._takeovers)
                    await self.record.insert_run(row, new_thread, messages)
            except BaseException as exc:
                self.waiting.release(run_id)
                # Not recorded: the cache must not believe the thread holds
                # these messages (a retry would see its own id as taken).
                self._unsee(info, messages, new=new_thread is not None)
                if isinstance(exc, NotLeader):
                    raise ThreadLedElsewhere(
                        f"thread {tid} is led by another funduq node right now; retry on the "
                        "node that leads it"
                    ) from None
                if isinstance(exc, Exception) and record_trouble(exc):
                    raise RecordUnavailable(f"the record cannot take the run: {exc}") from None
                raise
            if self.record.shared:
                self.leases.taken((tid,))
            if laning:
                pass  # laned as it was recorded (_insert_laned)
            elif self.providers.serving(key, agent) is None:
                # Nobody serves the agent: the run fails before the door
                # answers, so every answer (returnImmediately too) reads FAILED.
                # Asked now, not of `view`: the agent may have come (or gone)
                # while the run was being recorded.
                self.waiting.release(run_id)
                machine = RunMachine(st.QUEUED)
                for action in machine.handle(Input.ARRIVED_UNSERVED):
                    assert isinstance(action, Settle), action
                    await self._settle_unlaned(run_id, row["metadata"], 1, action)
                self.metrics.runs_started += 1
                return RunTicket(run_id, tid)
            elif takeovers:
                # A takeover of the thread may be in flight: laned after the
                # old leader's runs (docs/cluster.md, "How ownership moves").
                laning = await self._lane_in_order(row, row["arrival"], takeovers, arriving=True)
            else:
                self._start_lane(row, arriving=True)
                laning = True
        finally:
            writing = self._reserved[tid]
            writing.discard(run_id)
            if not writing:
                del self._reserved[tid]
            if not laning:
                self._maybe_release(tid)
        self.metrics.runs_started += 1
        if log.isEnabledFor(logging.DEBUG):  # the fingerprint costs a hash: only when shown
            log.debug(
                "run %s queued on thread %s for %s/%s", run_id, tid, fingerprint_of(key), agent
            )
        return RunTicket(run_id, tid)

    async def _insert_laned(
        self, row: dict[str, Any], new_thread: tuple[Any, ...] | None, messages: list[Any]
    ) -> None:
        """Queue a new run's insert and start its lane at once: the lane's
        first write (``offering``, when a place is free) is chained behind
        the insert (the writer is first-in first-out) and may share its
        commit, so the offer leaves a commit sooner. Returns once the insert
        is durable, which the door waits for before it answers. Should the
        insert fail, the lane ends having written nothing (its chained write
        is not made; before it waits it reads the insert's verdict), and the
        insert's error is raised once the lane is gone."""
        inserted = self.record.insert_run_soon(row, new_thread, messages)
        lane = self._start_lane(row, arriving=True, inserted=inserted)
        # Not cancellable: the run is laned now, so a caller gone meanwhile
        # must not leave the door's bookkeeping undone for a run that goes on
        # (its cancel reaches it at its next checkpoint). The wait's own
        # shield (`durable_uncancellable`), not a shielded scope: that cost
        # as much as the wait (bench/README.md, "The callers' side of a
        # run"). The writer is woken by the lane (its first write, or its
        # wait for the insert's verdict, or its end), not here: so the two
        # share a commit. (Catching Cancelled to shield only once cancelled
        # would save the scope too, but a Cancelled caught and not re-raised
        # is what trio asks code never to do.)
        await inserted.durable_uncancellable()
        try:
            await inserted.result()  # committed: at hand, no checkpoint
        except BaseException:
            with trio.CancelScope(shield=True):
                await lane.ended()
            raise

    async def _where_to(self, key: str, agent: str, thread_id: str | None) -> list[str]:
        """The URLs of the nodes a caller's request about this thread (None: a
        new one) of this agent is carried out on when not here: the thread's
        leader when it is another live node; else, when no link here serves
        the agent, the nodes whose links do ("the lease follows the link").
        Empty: here."""
        if not self.record.shared:
            return []
        if thread_id is not None and self.leases.leads(thread_id):
            return []  # ours to order, served here or not
        if thread_id is not None and keepable(thread_id):
            leader = await self.record.thread_leader(thread_id)
            if leader is not None:
                node, url, live = leader
                if node != self.node and live:
                    if not url:
                        raise ThreadLedElsewhere(
                            f"thread {thread_id} is led by funduq node {node}, which has "
                            "not said where it can be reached; retry shortly"
                        )
                    return [url]
        if self.providers.serving(key, agent) is None:
            return [url for _, url in await self.record.serving_nodes(key, agent)]
        return []

    async def spend_cluster_call(self, stamp: str, signature: str) -> None:
        """Spend a signed call between nodes (its signature verified, its
        stamp fresh) for the whole cluster: NotAuthorized when it was taken
        before, here or on another node; RecordUnavailable when the record
        cannot take the spending (the call is then not carried out)."""
        at = math.ceil(float(stamp))
        await self.spent_calls.check(
            lambda spent: spent.spend(CLUSTER_SIGNER, signature, at, time.time())
        )

    async def _forward(
        self, urls: list[str], op: str, args: dict[str, Any], thread_id: str | None
    ) -> Any:
        """Carry out ``op`` on another node (docs/cluster.md): its result, or
        the broker error it raised, raised here as the same exception."""
        assert self.forwarder is not None
        self.metrics.calls_forwarded += 1
        try:
            return await self.forwarder.call(urls, op, args)
        except Unreachable as exc:
            what = f"thread {thread_id}" if thread_id else "this agent"
            raise ThreadLedElsewhere(
                f"{what} is served by another funduq node right now, which cannot be "
                f"reached ({exc}); retry shortly"
            ) from None

    def _still_waiting(self, run_id: str) -> bool:
        """Whether a charged run still waits in funduq (see WaitingRuns): not
        yet started (being recorded), or queued or offering."""
        lane = self.lanes.get(run_id)
        return lane is None or lane.status in (st.QUEUED, st.OFFERING)

    def _unsee(self, info: ThreadInfo, messages: list[tuple[Any, ...]], *, new: bool) -> None:
        """Forget what ``_new_messages`` noted for a run that is not recorded
        after all. Its ids were its own (``_new_messages`` gives no id twice);
        its positions are given back only when nobody noted any since (an
        await came between): a gap in positions is harmless, a reused one not."""
        if new:
            if self._thread_info.get(info.id) is info:
                del self._thread_info[info.id]
            return
        for row in messages:
            info.message_ids.discard(row[2])
        if messages and info.message_count == messages[-1][1] + 1:
            info.message_count -= len(messages)

    async def _writable(self) -> None:
        """Refuse new work while the record cannot write (a full disk, an I/O
        error): runs already taken finish first. One probe write decides."""
        if self.record.failing and not await self.record.probe():
            raise RecordUnavailable("the record cannot take writes right now; retry later")

    async def _presented_head(
        self, metadata: dict[str, Any], run_input: dict[str, Any], key: str, agent: str
    ) -> str | None:
        """The head of the request's actor chain (None: no chain). A chain must
        verify and be presented by its last hop to this agent with this
        request's last message, whether or not the thread is bound, so the
        refusal of a forged one says nothing about the thread."""
        chain = metadata.get("actorChain")
        if chain is None:
            return None
        messages = run_input.get("messages") or []
        message_id = messages[-1].get("id") if messages else ""
        try:
            return await self.spent_by_anyone.check(
                lambda spent: authority.check_presented(
                    chain,
                    metadata.get("presenter"),
                    key,
                    agent,
                    message_id if isinstance(message_id, str) else "",
                    time.time(),
                    max_hops=self.settings.max_chain_hops,
                    spent=spent,
                )
            )
        except NotAuthorized:  # spent on another node: as forged as a chain presented twice
            raise authority.InvalidActorChain(authority.NOT_PRESENTED) from None

    def _reserve(self, thread_id: str, run_id: str) -> None:
        """Count a run against the thread's queue limit before any await, so
        two utterances racing cannot both take the last slot. A run laned
        while its insert is written (a served agent's) is in the thread's
        pending queue already: it counts there, not twice."""
        thread = self.threads.get(thread_id)
        writing = self._reserved.get(thread_id, ())
        pending = (len(thread.pending) if thread else 0) + sum(
            run not in self.lanes for run in writing
        )
        if pending >= self.settings.thread_queue_limit:
            raise ThreadQueueFull(
                f"thread {thread_id} already holds {pending} pending runs "
                f"(limit {self.settings.thread_queue_limit}); retry once one is taken"
            )
        self._reserved.setdefault(thread_id, set()).add(run_id)

    def _new_messages(
        self, info: ThreadInfo, run_input: dict[str, Any], run_id: str
    ) -> list[tuple[Any, ...]]:
        """Messages the thread has not seen yet. Earlier messages the thread
        holds are history a caller re-sent; the last one is always the new
        utterance, and keeps its caller's id unless the thread already holds it."""
        rows = []
        messages = run_input.get("messages") or []
        for i, message in enumerate(messages):
            mid = message.get("id")
            last = i == len(messages) - 1
            if mid in info.message_ids:
                if not last:
                    continue
                message["id"] = mid = _new_id("msg")
            rows.append((info.id, info.message_count, mid, run_id, dumps(message)))
            info.message_ids.add(mid)
            info.message_count += 1
        return rows

    def _reply_messages(self, lane: Lane) -> list[tuple[Any, ...]] | None:
        """The messages that append a run's assistant replies to its thread's
        history, written in the same transaction as the run's settling."""
        info = self._thread_info.get(lane.thread_id)
        replies = lane.replies()
        if not replies or info is None:
            return None
        rows = []
        for message in replies:
            if message["id"] in info.message_ids:
                continue
            rows.append((info.id, info.message_count, message["id"], lane.run_id, dumps(message)))
            info.message_ids.add(message["id"])
            info.message_count += 1
        return rows

    async def follow(
        self, run_id: str, after_seq: int = 0, quiet: Quiet | None = None
    ) -> AsyncIterator[list[tuple[int, dict[str, Any]]]]:
        """The run's events after ``after_seq`` as (seq, event), in order, each
        durable before it is yielded; ends once the run settles or pauses.

        Events come in bursts -- a non-empty list of whatever was recorded
        together -- so a stream can write a burst as one chunk: a provider's
        batch of a dozen events is then one socket write, not a dozen.

        With a `quiet` (`broker/quiet.py`), each wait for news runs in its
        scope, and one that ends without news (its deadline, or the caller
        gone) yields an empty burst; without one, every burst has events."""
        lane = self.lanes.get(run_id)
        page = self.settings.max_feed_events
        last = after_seq  # the last seq yielded
        if lane is None and self.watchers is None:
            # One process writes the record: a run with no lane here has
            # settled or paused, and the record holds all it will have.
            if not await self._run_exists(run_id):
                raise RunNotFound(run_id)
            while recorded := await self._events(run_id, after_seq, limit=page):
                after_seq = recorded[-1][0]
                yield recorded
                if len(recorded) < page:
                    return
            return
        while True:
            if lane is None:
                assert self.watchers is not None
                # Shared record: the run may be live on another node. Read it by
                # seq; once read up, wait for news of it (the watch is taken
                # before the first read, so none slips past).
                with self.watchers.watch(run_id) as news:
                    while (lane := self.lanes.get(run_id)) is None:
                        found = await self.record.run_events(run_id, last, page)
                        if found is None:
                            raise RunNotFound(run_id)
                        status, rows = found
                        if rows:
                            last = rows[-1][0]
                            yield [(s, json.loads(e)) for s, e in rows]
                            if len(rows) == page:
                                continue  # more to read before waiting
                        if status in st.TERMINAL and len(rows) < page:
                            return  # read after the run ended: nothing can follow
                        if status == st.INPUT_REQUIRED and not rows:
                            return  # paused, and read up to the pause
                        if status != st.INPUT_REQUIRED:
                            if quiet is None:
                                await news.wait()
                            else:
                                with quiet.waiting() as scope:
                                    await news.wait()
                                if scope.cancelled_caught:
                                    yield []
                # A lane here holds the run now (answered on this node): its feed.
            feed = lane.feed
            while True:
                if last < feed.first_seq - 1:
                    # Behind what the feed holds in memory (it keeps only the
                    # latest events, or the run was reopened after a pause): the
                    # record has these, since an event reaches the feed only once
                    # recorded. A page at a time; the feed may move on meanwhile.
                    recorded = await self._events(run_id, last, feed.first_seq, limit=page)
                    if not recorded:  # pragma: no cover -- the record holds every published seq
                        last = feed.first_seq - 1
                        continue
                    last = recorded[-1][0]
                    yield recorded
                    continue
                events = feed.events
                # The feed holds consecutive seqs from first_seq on: the next
                # to yield is at once at hand (bisected should that ever not hold).
                index = last + 1 - feed.first_seq
                if index < len(events) and events[index][0] != last + 1:  # pragma: no cover
                    index = bisect.bisect_right(events, last, key=lambda item: item[0])
                if index < len(events):
                    burst = events[index:]
                    last = burst[-1][0]
                    yield burst
                    continue  # more may have come (and the feed closed) meanwhile
                if feed.closed:
                    break
                if quiet is None:
                    await feed.changed()
                elif quiet.due():
                    # The wait would end at once (`Quiet.due`; the feed is
                    # open, so `changed` would park): its empty burst now.
                    yield []
                else:
                    with quiet.waiting() as scope:
                        await feed.changed()
                    if scope.cancelled_caught:
                        yield []
            if (
                self.watchers is None
                or lane.status in st.TERMINAL
                or lane.status == st.INPUT_REQUIRED
            ):
                return
            # The lane let go of the run unsettled (another node leads its
            # thread now, taken over or handed over): follow it in the record.
            lane = None

    @contextlib.contextmanager
    def _watch_reopen(self, run_id: str) -> Iterator[trio.Event]:
        """An event set when a lane next takes `run_id`. Registered before the
        caller awaits anything, so no reopen can slip past unseen."""
        entry = self._reopen.get(run_id)
        if entry is None:
            entry = self._reopen[run_id] = [trio.Event(), 0]
        entry[1] += 1
        try:
            yield entry[0]
        finally:
            entry[1] -= 1
            if not entry[1] and self._reopen.get(run_id) is entry:
                del self._reopen[run_id]

    async def wait_reopened(self, run_id: str, after_seq: int) -> None:
        """Wait at a pause for its answer: return once a lane holds the run
        again, or at once when the record already has news for a reader that
        saw up to `after_seq` (events past it, or the run ended). Woken by the
        lane's start, never by a clock, so a subscriber to a paused task stays
        open through the answer."""
        if self.watchers is not None:
            await self._wait_reopened_shared(self.watchers, run_id, after_seq)
            return
        with self._watch_reopen(run_id) as reopened:
            if run_id in self.lanes:
                return

            found = await self.record.run_progress(run_id)
            if found is None:
                raise RunNotFound(run_id)
            status, last_seq = found
            if status in st.TERMINAL or last_seq > after_seq or run_id in self.lanes:
                return
            # Paused with nothing new (or answered a moment ago, its lane
            # about to start): the lane's start wakes us.
            await reopened.wait()

    async def _wait_reopened_shared(
        self, watchers: RunWatchers, run_id: str, after_seq: int
    ) -> None:
        """``wait_reopened`` on a shared record: the answer may come to any
        node. Woken by the record's news of the run (its move out of the
        pause, on whichever node) and by a lane starting here."""
        with watchers.watch(run_id) as news:
            while run_id not in self.lanes:
                found = await self.record.run_progress(run_id)
                if found is None:
                    raise RunNotFound(run_id)
                status, last_seq = found
                if status != st.INPUT_REQUIRED or last_seq > after_seq:
                    return  # answered (queued again, here or elsewhere), or news
                if run_id in self.lanes:
                    return
                await news.wait()

    def gauges(self) -> dict[str, tuple[str, float]]:
        """The current values `GET /metrics` shows beside the counters."""
        return {
            "funduq_runs_live": (
                "Runs with a lane: queued, offering, running, cancelling.",
                len(self.lanes),
            ),
            "funduq_threads_live": ("Threads with a live run.", len(self.threads)),
            **(
                {
                    "funduq_threads_led": (
                        "Threads whose lease this node holds (docs/cluster.md).",
                        len(self.leases.held),
                    )
                }
                if self.metrics.cluster
                else {}
            ),
            "funduq_providers_attached": (
                "Provider links attached.",
                sum(s.live for s in self.providers.sessions.values()),
            ),
            **(self.pushes.gauges() if self.pushes is not None else {}),
        }

    def live_record(self, run_id: str) -> dict[str, Any] | None:
        """A live run's record as its lane knows it, taken without awaiting
        anything -- so a stream opened right after ``start_run`` always starts
        from the run as it arrived. None when no lane has the whole record."""
        lane = self.lanes.get(run_id)
        return lane.snapshot() if lane is not None else None

    def lane_of(self, run_id: str) -> Lane | None:
        """The lane that holds the run here now (None: none): taken before a
        follow, and handed back to `record_after` once it has ended."""
        return self.lanes.get(run_id)

    async def record_after(self, run_id: str, lane: Lane | None) -> dict[str, Any] | None:
        """The run's record once a follow of it has ended (`get_run`'s
        answer). When `lane` (`lane_of`'s, before the follow) has ended
        having settled the run -- a terminal status, recorded (one terminal
        status per run: nothing can change it now), and every event seen
        -- that is the lane's own snapshot, as `wait_run` answers: no read
        of the record, no trip to its thread. Otherwise (a pause, which an
        answer may end at any moment; a lane that let go; a record that
        failed its last write) the record's."""
        if (
            lane is not None
            and lane.feed.closed
            and lane.status in st.TERMINAL
            and lane.recorded == lane.status
        ):
            run = lane.snapshot()
            if run is not None:
                return run
        return await self.get_run(run_id)

    async def wait_run(self, run_id: str) -> dict[str, Any]:
        """Wait until the run settles or pauses; return its record.

        Once the run's lane here has ended, its own snapshot is the answer
        -- no read of the record -- only for what the record holds from it:
        the lane's status is the one its last write recorded (``recorded``:
        a terminal status, or the pause's ``input-required``, each written
        by the move that ended the lane) and the lane saw every event.
        Otherwise the record's: a lane whose last write failed and whose
        fault could not be settled either ended with its machine past the
        record (a blocking answer would show a status the record never
        had), and a lane that let go of its run (another node leads its
        thread now) left it to be settled there. On a shared record such a
        run is waited for through the record (its thread's next leader
        settles it); on one only this process writes, nothing more will
        change it before a restart, so the record is read at once."""
        lane = self.lanes.get(run_id)
        while True:
            if lane is None and self.watchers is not None:
                lane = await self._wait_elsewhere(self.watchers, run_id)
            if lane is None:
                break
            await lane.ended()
            # The machine's status and the set read directly: the property
            # and the union were most of the check's cost (bench/README.md).
            status = lane.machine.status
            if status is lane.recorded and status in _ENDED_AS:
                run = lane.snapshot()
                if run is not None:
                    return run
                break
            if self.watchers is not None:
                # Unsettled here (let go, or a fault that could not be
                # recorded): wait for the record to settle or pause it.
                lane = None
                continue
            break
        run = await self.get_run(run_id)
        if run is None:
            raise RunNotFound(run_id)
        return run

    async def _wait_elsewhere(self, watchers: RunWatchers, run_id: str) -> Lane | None:
        """On a shared record, until a run with no lane here settles or
        pauses (None), woken by the record's news of it; or until a lane
        here takes it (that lane)."""
        with watchers.watch(run_id) as news:
            while (lane := self.lanes.get(run_id)) is None:
                found = await self.record.run_progress(run_id)
                if found is None:
                    raise RunNotFound(run_id)
                if found[0] in st.TERMINAL or found[0] == st.INPUT_REQUIRED:
                    return None
                if run_id in self.lanes:
                    continue
                await news.wait()
            return lane

    async def cancel_run(
        self, run_id: str, *, proof: Any = None, forwarded: bool = False
    ) -> dict[str, Any]:
        """Ask to stop a run. Authority is checked before anything about the
        run's state is revealed (on the node that leads the run's thread: a
        cancel arriving elsewhere is forwarded there first)."""
        if self.record.shared and not forwarded and run_id not in self.lanes:
            thread_id = await self.record.run_thread(run_id)
            leader = None if thread_id is None else await self.record.thread_leader(thread_id)
            if leader is not None and leader[0] != self.node and leader[2] and leader[1]:
                found = await self._forward(
                    [leader[1]], "cancel_run", {"run_id": run_id, "proof": proof}, thread_id
                )
                return dict(found)
        facts = await self._run_facts(run_id)
        if facts is None:
            raise RunNotFound(run_id)
        segment_head, key = facts
        by = None
        if segment_head is not None:
            by = await self.spent.check(
                lambda spent: authority.check_cancel(
                    proof, run_id, (segment_head, key), time.time(), spent=spent
                )
            )
        lane = self.lanes.get(run_id)
        if lane is None and self.record.shared:
            # No lane here: on a shared record another node may lead its thread.
            progress = await self.record.run_progress(run_id)
            if progress is not None and progress[0] in st.ACTIVE - {st.INPUT_REQUIRED}:
                lane = self.lanes.get(run_id)
                if lane is None:
                    raise ThreadLedElsewhere(
                        f"run {run_id} is led by another funduq node right now, which "
                        "cannot be reached; retry shortly"
                    )
        if lane is None or lane.status not in st.MOVES[st.CANCELLED] | st.HELD:
            raise _not_cancellable(run_id)
        if lane.awaiting_answer and lane.cancel_pending:
            # One cancel already waits behind the offer's answer: this one is
            # the same request, answered alike without piling up in the lane.
            run = await self.get_run(run_id)
            assert run is not None
            return run
        cancel = Cancel(by)
        lane.tell(cancel)
        lane.cancel_pending = lane.awaiting_answer
        # Accepted: from this moment no KYOK completion is funded for the run
        # (the seed's rule), and the ones in flight end -- before the lane
        # has even read the cancel.
        self.kyok.mark_cancel_requested(run_id)
        if not lane.awaiting_answer:
            # An offering run reads the cancel only after the provider's answer;
            # don't hold the caller for that.
            await cancel.seen.wait()
            if cancel.refused:
                raise _not_cancellable(run_id)
            if cancel.record is not None:
                return cancel.record
        run = await self.get_run(run_id)
        assert run is not None
        return run

    async def kyok_leader(self, run_id: str) -> str | None:
        """Where a KYOK completion for this run is carried out when not here:
        the URL of the live node leading the run's thread (docs/cluster.md,
        "KYOK from any node"). None: here -- a record of one process, a run
        laned here, or one nobody else leads (``kyok_run`` then answers)."""
        if not self.record.shared or run_id in self.lanes:
            return None
        thread_id = await self.record.run_thread(run_id)
        leader = None if thread_id is None else await self.record.thread_leader(thread_id)
        if leader is None or leader[0] == self.node or not leader[2] or run_id in self.lanes:
            return None
        if not leader[1]:
            raise KyokRefusal(
                503,
                "thread_led_elsewhere",
                f"run {run_id} is led by funduq node {leader[0]}, which has not said "
                "where it can be reached; retry shortly",
            )
        return leader[1]

    def kyok_run(self, grant: Grant) -> KyokRun:
        """The run a KYOK grant names, if a completion may be spent on it now:
        active (its provider holds it), not cancel-requested, and the token's
        agent's. Otherwise KyokRefusal 403. Never awaits, so the web route can
        check and start a completion in one step."""
        lane = self.lanes.get(grant.run_id)
        # Cancel-requested first: a cancel accepted while the offer awaits its
        # answer is already the reason, though the run is not held yet.
        if grant.run_id in self.kyok.cancel_requested or (
            lane is not None and lane.status == st.CANCELLING
        ):
            raise KyokRefusal(
                403,
                "run_cancel_requested",
                f"run {grant.run_id} is cancel-requested: funduq funds no more of its completions",
            )
        session = self.providers.sessions.get(lane.key) if lane is not None else None
        held = session is not None and grant.run_id in session.held
        if lane is None or not (held or lane.status in st.HELD):
            raise KyokRefusal(
                403, "run_not_active", f"run {grant.run_id} is not being worked on by its agent"
            )
        if grant.agent != f"{lane.key}/{lane.agent}":
            raise KyokRefusal(
                403, "not_this_agents_run", f"run {grant.run_id} is not this token's agent's run"
            )
        caller = json.loads(lane.caller_metadata_json)
        opt_in = caller.get("kyok")
        if not isinstance(opt_in, dict):
            raise KyokRefusal(403, "no_kyok_grant", f"run {grant.run_id} opted into no KYOK")
        provider = opt_in["llmProvider"]
        chain = self._dispatched_chain(lane, caller)
        return KyokRun(
            grant.run_id,
            lane.key,
            lane.agent,
            (provider["providerKey"], provider["name"]),
            opt_in.get("context"),
            chain,
        )

    async def paused_run(self, thread_id: str) -> str | None:
        return await self.record.paused_run(thread_id, st.INPUT_REQUIRED)

    async def answer_pause(
        self,
        run_id: str,
        run_input: Any,
        *,
        metadata: dict[str, Any] | None = None,
        thread_id: str | None = None,
        forwarded: bool = False,
    ) -> RunTicket:
        """Answer a paused run: the same run id is queued again, offered in its
        thread's order, its event log continuing. `thread_id`, when the caller
        names one, must be the run's (checked after the authority check, so a
        stranger learns nothing from naming the wrong one). Carried out where
        the run's thread is led, or its agent served (forwarded there)."""
        if self.record.shared and not forwarded and run_id not in self.lanes:
            found_row = await self.record.run_row(run_id)
            if found_row is not None:
                known = _run_row(found_row)
                urls = await self._where_to(
                    known["provider_key"], known["agent_name"], known["thread_id"]
                )
                if urls:
                    found = await self._forward(
                        urls,
                        "answer_pause",
                        {
                            "run_id": run_id,
                            "run_input": run_input,
                            "metadata": metadata,
                            "thread_id": thread_id,
                        },
                        known["thread_id"],
                    )
                    return RunTicket(str(found["runId"]), str(found["threadId"]))
        facts = await self._run_facts(run_id)
        if facts is None:
            raise RunNotFound(run_id)
        segment_head, key = facts
        # Authority before anything else about the request: a refusal of its
        # metadata (a bogus kyok opt-in, say) would tell a stranger that this
        # bound thread has a paused run (DESIGN §8, refuse first).
        by = None
        if segment_head is not None:
            resolution = metadata.get("resolution") if isinstance(metadata, dict) else None
            by = await self.spent.check(
                lambda spent: authority.check_resolution(
                    resolution, run_id, (segment_head, key), time.time(), spent=spent
                )
            )
        _check_carriable(metadata)
        metadata = dict(metadata or {})
        if "kyok" in metadata:
            metadata["kyok"] = self.kyok.read_opt_in(metadata["kyok"])
        run_input = _read_run_input(run_input)
        await self._writable()
        found = await self.record.run_row(run_id)
        if found is None:
            raise RunNotFound(run_id)
        row = _run_row(found)
        if thread_id is not None and thread_id != row["thread_id"]:
            raise InvalidRunInput(f"thread {thread_id} is not the thread of run {run_id}")
        # An answer's chain joins the record's metadata, so it is held to the
        # same rules as a new utterance's: presented by its last hop, and on a
        # bound thread headed by the segment head or the provider -- else an
        # authorized answerer could hand the thread's next turns another chain.
        head = await self._presented_head(metadata, run_input, key, row["agent_name"])
        if head is not None and not authority.may_write(segment_head, head, key):
            raise NotAuthorized(authority.NOT_AUTHORIZED)
        if row["status"] != st.INPUT_REQUIRED or run_id in self.lanes:
            raise RunNotPaused(f"run {run_id} is not waiting for an answer")
        run_input = {**run_input, "threadId": row["thread_id"], "runId": run_id}
        marks = row["metadata"].setdefault("funduq", {})
        marks["answeredBy"] = by
        if "kyok" in metadata:
            marks["kyok"] = {"llmProvider": metadata["kyok"]["llmProvider"]}
        marks.pop("cancelRequestedBy", None)  # the new turn is nobody's to stop yet
        caller = dumps(
            {
                **json.loads(row["caller_metadata"]),
                **{k: v for k, v in metadata.items() if k not in PROOF_KEYS},
            }
        )
        tid = row["thread_id"]
        self._forget_unled(tid)
        info = await self._thread(tid)
        messages = self._new_messages(info, run_input, run_id) if info else []
        row["input"], row["caller_metadata"] = dumps(run_input), caller
        try:
            self.waiting.charge(run_id, (row["provider_key"], row["agent_name"]), _input_size(row))
        except QueueLimitReached:
            if info:
                self._unsee(info, messages, new=False)
            raise
        self._arrival += 1
        arrival = self._arrival
        self._answering[tid] = self._answering.get(tid, 0) + 1  # keep its info cached

        try:
            (move,) = RunMachine(st.INPUT_REQUIRED).handle(Input.PAUSE_ANSWERED)
            assert isinstance(move, Move), move

            async def reopen() -> bool:
                return await self.record.move(
                    run_id,
                    move.to,
                    metadata=row["metadata"],
                    run_input=run_input,
                    caller_metadata=caller,
                    arrival=arrival,
                    stamp=("completed_at", None),
                    messages=messages,
                    lead=tid,  # the thread's lease, taken in the same transaction
                )

            try:
                try:
                    takeovers = tuple(self._takeovers)  # see _lane_in_order
                    moved = await reopen()
                except NotLeader:
                    if not await self._take_over(tid):
                        raise
                    takeovers = tuple(self._takeovers)
                    moved = await reopen()
            except BaseException as exc:
                if info:
                    self._unsee(info, messages, new=False)  # not recorded
                if isinstance(exc, NotLeader):
                    raise ThreadLedElsewhere(
                        f"thread {tid} is led by another funduq node right now; retry on the "
                        "node that leads it"
                    ) from None
                if isinstance(exc, Exception) and record_trouble(exc):
                    raise RecordUnavailable(f"the record cannot take the answer: {exc}") from None
                raise
            if self.record.shared:
                self.leases.taken((tid,))
            if not moved:
                if info:
                    self._unsee(info, messages, new=False)  # not recorded
                raise RunNotPaused(f"run {run_id} is not waiting for an answer")
            row["status"] = move.to
            if takeovers:
                # Laned after the old leader's runs when a takeover of the
                # thread is in flight; laned by it if its restore read the
                # answered run as queued (which is no refusal of the answer).
                await self._lane_in_order(row, arrival, takeovers, arriving=False)
            else:
                self._start_lane(row, arriving=False)
            if self.pushes is not None:
                self.pushes.resumed(run_id)
        except BaseException:
            if run_id not in self.lanes:
                self.waiting.release(run_id)
            raise
        finally:
            self._answering[tid] -= 1
            if not self._answering[tid]:
                del self._answering[tid]
            self._maybe_release(tid)
        return RunTicket(run_id, row["thread_id"])

    # -- reading the record ------------------------------------------------------------

    async def get_run(self, run_id: str) -> dict[str, Any] | None:
        found = await self.record.get_run(run_id)
        if found is None:
            return None
        row, events = found
        return {**_run_json(row), "events": [{"seq": s, "event": json.loads(e)} for s, e in events]}

    async def list_runs(
        self,
        *,
        thread_id: str | None = None,
        provider: str | None = None,
        agent: str | None = None,
        limit: int = 100,
        status: str | Collection[str] | None = None,
        before: str | None = None,
        bound_to: str | None = None,
    ) -> list[dict[str, Any]]:
        """Run summaries (no events), newest first, filtered and paged in SQL.

        Unscoped: who may see them is the caller's question (`run_page` asks
        it). `before` is a run id: only runs that arrived before it (a cursor;
        an unknown id lists nothing). `bound_to` keeps the threads whose
        segment head is that key."""
        key = None if provider is None else self.providers.resolve_key(provider) or provider
        wanted = None if status is None else [status] if isinstance(status, str) else list(status)
        rows = await self.record.list_runs(
            thread_id=thread_id,
            provider_key=key,
            agent=agent,
            limit=limit,
            status=wanted,
            before=before,
            bound_to=bound_to,
        )
        return [_run_json(r) for r in rows]

    # -- who may read what (DESIGN §8); the doors call these, never authority.py

    async def may_read(self, thread_id: str, reader: Reader) -> bool:
        """May `reader` read this thread and its runs? An unknown thread: no.
        An unbound one: anyone holding its id. A bound one: the operator, or a
        `Funduq-Proof` by its segment head or the agent's provider (spent
        here: a request checks once). The doors answer a "no" exactly as an
        unknown id, so a stranger learns nothing."""
        info = await self._thread(thread_id)
        if info is None:
            return False
        if info.segment_head is None or reader.operator:
            return True
        try:
            await self.spent.check(
                lambda spent: authority.check_read(
                    reader.proof, thread_id, (info.segment_head, info.key), time.time(), spent
                )
            )
        except NotAuthorized:
            return False
        return True

    async def read_run(self, run_id: str, reader: Reader) -> dict[str, Any] | None:
        """`get_run` as `reader` may see it: None when unknown or not theirs to read."""
        thread_id = await self._run_thread(run_id)
        if thread_id is None or not await self.may_read(thread_id, reader):
            return None
        return await self.get_run(run_id)

    async def read_thread(self, thread_id: str, reader: Reader) -> dict[str, Any] | None:
        """`get_thread` as `reader` may see it: None when unknown or not theirs to read."""
        if not await self.may_read(thread_id, reader):
            return None
        return await self.get_thread(thread_id)

    async def listing_scope(
        self, reader: Reader, thread_id: str | None = None
    ) -> dict[str, Any] | None:
        """What a listing by `reader` may show, as `list_runs` filters; None:
        nothing (an empty listing). A named thread it may read; else the
        operator's everything; else, with a listing proof (`Funduq-Proof`
        over `funduq-read::{timestamp}`), the threads bound to its key;
        else nothing -- nobody lists another caller's thread ids."""
        if thread_id is not None:
            return {"thread_id": thread_id} if await self.may_read(thread_id, reader) else None
        if reader.operator:
            return {}
        if reader.proof is None:
            return None
        try:
            key = await self.spent_by_anyone.check(
                lambda spent: authority.check_listing(reader.proof, time.time(), spent)
            )
        except NotAuthorized:
            return None
        return {"bound_to": key}

    async def run_page(
        self,
        reader: Reader,
        *,
        thread_id: str | None = None,
        provider: str | None = None,
        agent: str | None = None,
        status: str | Collection[str] | None = None,
        limit: int = 100,
        cursor: str | None = None,
    ) -> dict[str, Any]:
        """`GET /runs`: `{"runs": [summaries, newest first], "nextCursor"}` as
        `reader` may see them (see listing_scope); the cursor is the last
        run's id, null on the last page."""
        scope = await self.listing_scope(reader, thread_id)
        if scope is None:
            return {"runs": [], "nextCursor": None}
        runs = await self.list_runs(
            provider=provider, agent=agent, status=status, limit=limit + 1, before=cursor, **scope
        )
        more = len(runs) > limit
        runs = runs[:limit]
        return {"runs": runs, "nextCursor": runs[-1]["runId"] if more else None}

    async def task_page(
        self,
        provider_key: str,
        agent: str,
        reader: Reader,
        *,
        thread_id: str | None = None,
        status: Collection[str] | None = None,
        status_after: float | None = None,
        page_size: int = 50,
        after_run: str | None = None,
    ) -> tuple[list[dict[str, Any]], int, bool]:
        """One page of an agent's tasks (A2A ListTasks) as `reader` may see
        them: (full run records, how many match in all, whether more follow).
        Newest status time first, ties by id descending; `after_run` is the
        previous page's last run (keyset: an unknown one pages nothing).
        Filtered, counted and paged in SQL: only the page is ever loaded."""
        scope = await self.listing_scope(reader, thread_id)
        if scope is None:
            return [], 0, False
        total, ids = await self.record.task_ids(
            provider_key,
            agent,
            thread_id=scope.get("thread_id"),
            bound_to=scope.get("bound_to"),
            status=None if status is None else list(status),
            status_after=status_after,
            limit=page_size + 1,
            after_run=after_run,
        )
        records = []
        for run_id in ids[:page_size]:
            record = await self.get_run(run_id)
            if record is not None:
                records.append(record)
        return records, total, len(ids) > page_size

    async def get_thread(self, thread_id: str) -> dict[str, Any] | None:
        info = await self._thread(thread_id)
        if info is None:
            return None

        runs = await self.record.thread_runs(thread_id)
        return {
            "threadId": thread_id,
            "agent": {"provider": info.key, "name": info.agent},
            "segmentHead": info.segment_head,
            "messages": await self._messages(thread_id),
            "runs": [{"runId": r, "status": s} for r, s in runs],
        }

    async def ready(self) -> bool:
        """Readiness: the broker runs and the record answers."""
        if not self.running:
            return False
        if self.record.failing:
            # Writes fail (a full disk, an I/O error): not ready until one goes through.
            return await self.record.probe()
        try:
            await self.record.ping()
        except Exception:  # noqa: BLE001 -- any failure means not ready
            return False
        return True

    async def _thread(self, thread_id: str) -> ThreadInfo | None:
        info = self._thread_info.pop(thread_id, None)
        if info is not None:
            self._thread_info[thread_id] = info  # most recently used last
            return info

        found = await self.record.thread(thread_id)
        if found is None:
            return None
        (key, agent, head), ids, position = found
        info = self._thread_info.setdefault(
            thread_id, ThreadInfo(thread_id, key, agent, head, set(ids), position)
        )
        return info

    async def _messages(self, thread_id: str, limit: int | None = None) -> list[dict[str, Any]]:
        return [json.loads(m) for m in await self.record.messages(thread_id, limit)]

    async def _events(
        self, run_id: str, after: int, before: int | None = None, *, limit: int | None = None
    ) -> list[tuple[int, dict[str, Any]]]:
        return [
            (s, json.loads(e))
            for s, e in await self.record.events_after(run_id, after, before, limit)
        ]

    async def _run_thread(self, run_id: str) -> str | None:
        lane = self.lanes.get(run_id)
        if lane is not None:
            return lane.thread_id
        return await self.record.run_thread(run_id)

    async def _run_exists(self, run_id: str) -> bool:
        return await self.record.run_exists(run_id)

    async def _run_facts(self, run_id: str) -> tuple[str | None, str] | None:
        """(segment head of its thread, its provider key), or None."""
        lane = self.lanes.get(run_id)
        if lane is not None:
            info = await self._thread(lane.thread_id)
            return (info.segment_head if info else None), lane.key
        return await self.record.run_facts(run_id)


# -- rows ------------------------------------------------------------------------------


def _run_row(row: Any) -> dict[str, Any]:
    """A run's row; its input and caller metadata stay JSON text."""
    (
        rid,
        tid,
        key,
        agent,
        status,
        run_input,
        caller,
        metadata,
        arrival,
        created,
        started,
        next_seq,
    ) = row
    return {
        "id": rid,
        "thread_id": tid,
        "provider_key": key,
        "agent_name": agent,
        "created_at": created,
        "started_at": started,
        "status": status,
        "input": run_input,
        "caller_metadata": caller,
        "metadata": json.loads(metadata),
        "arrival": arrival,
        "next_seq": next_seq,
    }


def _input_size(row: dict[str, Any]) -> int:
    """The bytes a waiting run holds: its input and its caller's metadata, as
    the record's JSON text (ASCII-escaped, so characters are bytes)."""
    return len(row["input"]) + len(row["caller_metadata"])


def _run_json(row: Any) -> dict[str, Any]:
    rid, tid, key, agent, status, metadata, created, started, completed = row
    return {
        "runId": rid,
        "threadId": tid,
        "agent": {"provider": key, "name": agent},
        "status": status,
        "metadata": json.loads(metadata),
        "createdAt": iso(created),
        "startedAt": iso(started),
        "completedAt": iso(completed),
    }


def _read_run_input(raw: Any) -> dict[str, Any]:
    """A caller's RunAgentInput, valid, and with message ids the record can
    keep as text (no NUL, no lone surrogate: see ``store.keepable``)."""
    try:
        run_input = agui.read_run_input(raw)
    except agui.InvalidInput as exc:
        raise InvalidRunInput(str(exc)) from None
    for message in run_input.get("messages") or ():
        mid = message.get("id") if isinstance(message, dict) else None
        if isinstance(mid, str) and not keepable(mid):
            raise InvalidRunInput(
                "messages: a message id holds a character funduq cannot "
                "record (NUL or a lone surrogate)"
            )
    return run_input


def _not_cancellable(run_id: str) -> RunNotCancellable:
    return RunNotCancellable(f"run {run_id} is paused or has ended; nothing to stop")


__all__ = ["Funduq", "RunTicket", "NotAuthorized"]
