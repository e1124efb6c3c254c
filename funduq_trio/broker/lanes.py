"""A run's lane -- the one task that owns a run -- and a thread's lanes.

Theory of operation
-------------------
Every run gets one task (its *lane*) from the moment it is queued until it
settles or pauses. The lane is the shell of the run's machine
(``run_machine.py``): what happens to the run is decided there, in one
table; the lane only gathers the inputs and carries out the actions.

Inputs come from the lane's memory channel (see ``inbox.py``: the provider
link, the doors, the thread queue and the provider registry only *send it
what happened*), from the offer's answer slot and from its clocks. The lane
applies them one at a time, so the order things happen to a run is channel
order, not whoever touched it last.

The wait for an offer's answer is the lane's own await: it offers, awaits
the answer (inside the delivery timeout's cancel scope) and only then reads
its inbox again -- so a cancel that arrived meanwhile is read *after* the
answer (the machine applies it in the phase the answer led to). The one
exception: a cancel that arrives while the ``queued -> offering`` write is
being made is read right after that write and before the offer leaves, so a
run nothing was offered for is cancelled at once.

The delivery timeout counts the *link's* silence (an answer travels behind
the provider's reports, so while the link keeps delivering a late answer may
be funduq's own backlog): the clock restarts from the last frame heard. It is
bounded all the same: an offer unanswered for ``DELIVERY_BOUND`` times the
timeout since it left is unanswered, however much the link chatters.

A lane never dies with its run half-done. A record write that fails for the
medium's sake (disk full, I/O error) is retried, backing off up to
``RETRY_MAX_SECONDS``, while ``/readyz`` says not ready and the doors refuse
new runs; anything else that goes wrong in a lane is the machine's ``FAULT``:
the run fails alone (``funduq_error``, one RUN_ERROR), its provider is asked
to stop, its place comes back and its thread moves on.

A thread's first lane runs on the thread's own task, in a cancel scope;
a lane laned while another of the thread goes gets a task of its own in
the broker's nursery, in a cancel scope too; deposing the thread cancels
them all. Only the head of a thread's pending queue
is offered; the next becomes head the moment the head *leaves the queue*
(accepted or settled), not when its turn finishes.

Clocks are cancel scopes inside the lane that waits: the grace window of an
unserved agent, the delivery timeout of an offer, the undelivered window of a
held run. No sweeper polls timestamps.

The port
--------
A lane reaches the broker only through ``LaneHost`` (the facade implements
it): its settings, record, registry and metrics, and three calls. Nothing
here imports the facade.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import trio

from ..protocol import agui, carriable
from ..protocol.statuses import Status
from . import run_machine as rm
from .inbox import Cancel, Finish, Gone, Inbox, Message, Report, Turn, Wake
from .parking import park
from .run_machine import Input, Phase, RunMachine, Verdict
from .store import SKIPPED, NotLeader, PendingWrite, Store, iso, record_trouble

if TYPE_CHECKING:
    from ..config import Settings
    from .metrics import Metrics
    from .providers import Offer, Providers, ProviderSession

log = logging.getLogger("funduq.lanes")

#: At most this many queued reports share one write.
REPORT_BURST = 256
#: An offer is unanswered after this many delivery timeouts since it left,
#: even while the link keeps delivering other frames.
DELIVERY_BOUND = 5
#: A record write that failed for the medium's sake is retried after this
#: long, doubling up to RETRY_MAX_SECONDS.
RETRY_SECONDS = 0.5
RETRY_MAX_SECONDS = 8.0


#: The phases a provider holds the run in (its events are read).
_HOLDING = frozenset({Phase.HELD, Phase.STOPPING})
# Enum members read per message, bound once (a class attribute of an enum
# costs a lookup through its metaclass each time).
_WAITING, _RESERVED, _SETTLED = Phase.WAITING, Phase.RESERVED, Phase.SETTLED
_REPORT, _FINISH, _TURN, _WAKE = Input.REPORT, Input.FINISH, Input.TURN, Input.WAKE
_CANCEL, _LINK_GONE, _MALFORMED = Input.CANCEL, Input.LINK_GONE, Input.MALFORMED
_RUN_FINISHED, _RUN_ERROR = agui.RUN_FINISHED, agui.RUN_ERROR
#: The events whose text the thread's history keeps (``Lane._note_text``).
_TEXT_KINDS = frozenset({"TEXT_MESSAGE_START", "TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_CHUNK"})
#: A provider's answer to an offer, as the machine's input (an answer that
#: is none of these is the lane's fault: KeyError).
_ANSWER = {verdict.value: Input(verdict.value) for verdict in Verdict}
#: The statuses that end a lane (a run settled or paused), for the metrics.
_ENDS = frozenset({Status.COMPLETED, Status.FAILED, Status.CANCELLED, Status.INPUT_REQUIRED})


class Unrecorded(Exception):
    """The run's insert, queued as its lane started, failed: the run was
    never recorded, and its lane ends having written nothing (the door that
    queued it answers the caller)."""


class MoveRefused(Exception):
    """The record's guard refused a move the machine made: someone moved the
    run behind its lane's back."""


class LaneHost(Protocol):
    """What a lane needs of the broker (``Funduq`` implements it)."""

    settings: Settings
    record: Store
    providers: Providers
    metrics: Metrics

    def offer_payload(self, lane: Lane) -> dict[str, Any]:
        """The ``run`` of the offer frame for this run."""
        ...

    def reply_messages(self, lane: Lane) -> list[tuple[Any, ...]] | None:
        """The messages adding the run's replies to its thread (written with its
        settling)."""
        ...

    def lane_ended(self, lane: Lane) -> None:
        """The lane ended (settled or paused): forget it."""
        ...

    def lost_lead(self, thread_id: str) -> None:
        """A write of the thread was fenced off: another node leads it now."""
        ...

    #: A shared record: an offer leaves only within the lease (``lease_sure``).
    leased: bool

    async def lease_sure(self, thread_id: str) -> None:
        """Until this node's own clock says its lease on the thread cannot
        have lapsed (a lane whose thread another node took is ended meanwhile)."""
        ...


class Feed:
    """A live run's events for its followers, in seq order. Events land here
    only after the record has them (persisted before relayed).

    It keeps the latest ``keep`` events (FUNDUQ_MAX_FEED_EVENTS; None: all).
    Older ones leave memory and ``first_seq`` moves past them: a follower
    behind that reads them from the record (``Funduq.follow``)."""

    __slots__ = ("first_seq", "events", "closed", "_followers", "_closing", "keep")

    def __init__(self, first_seq: int, keep: int | None = None) -> None:
        #: The seq of the first event held (or of the next one, while none is).
        self.first_seq = first_seq
        self.events: list[tuple[int, dict[str, Any]]] = []
        self.closed = False
        self.keep = keep
        # The tasks waiting in ``changed``, parked on the feed itself rather
        # than on a trio.Event: an event, its parking lot and their two
        # frames are most of a kilobyte per followed waiting run. Made by the
        # first follower to wait: a run nobody follows has none.
        self._followers: list[trio.lowlevel.Task] | None = None
        # The tasks waiting for the end alone (``wait_closed``), parked as
        # followers are: made by the first of them.
        self._closing: list[trio.lowlevel.Task] | None = None

    def _wake(self) -> None:
        followers, self._followers = self._followers, None
        if followers:
            for task in followers:
                trio.lowlevel.reschedule(task)

    def publish(self, seq: int, event: dict[str, Any]) -> None:
        self.publish_all([(seq, event)])

    def publish_all(self, numbered: list[tuple[int, dict[str, Any]]]) -> None:
        """Publish events (seq order, following those held): one wake-up of
        the followers for the lot."""
        events = self.events
        events += numbered
        if self.keep is not None and len(events) > self.keep:
            del events[: len(events) - self.keep]
            self.first_seq = events[0][0]
        if self._followers:
            self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()
        closing, self._closing = self._closing, None
        if closing:
            for task in closing:
                trio.lowlevel.reschedule(task)

    async def changed(self) -> None:
        """Wait for the next publish or the close (as ``Event.wait`` would:
        cancellable while it waits)."""
        if self.closed:
            return
        if self._followers is None:
            self._followers = []
        await park(self._followers)

    async def wait_closed(self) -> None:
        """Wait for the close only: a waiter that reads no events is not woken
        by each publish (a caller awaiting the run's end, ``Lane.ended``)."""
        if self.closed:
            return
        if self._closing is None:
            self._closing = []
        await park(self._closing)


class ThreadLanes:
    """A thread with active runs: its lanes' cancel scopes and its pending queue."""

    __slots__ = ("id", "pending", "lanes", "_scopes", "deposed")

    def __init__(self, thread_id: str) -> None:
        self.id = thread_id
        #: Another node took the thread's lease over: its lanes here end
        #: without writing (docs/cluster.md).
        self.deposed = False
        # A list, not a deque: at most thread_queue_limit long, and an empty
        # deque costs a waiting run most of a kilobyte.
        self.pending: list[Lane] = []
        self.lanes = 0
        # The cancel scope of each lane still going: what ``depose`` cancels.
        self._scopes: list[trio.CancelScope] = []

    def start(self, lane: Lane, nursery: trio.Nursery) -> None:
        """Start the lane's task in ``nursery`` (the broker's), in a cancel
        scope of its own that ``depose`` cancels. A plain cancel scope, not a
        nursery of the thread's (about half the instructions, bench/README.md,
        "A thread's lanes in cancel scopes, not a nursery"): most threads never
        have two lanes at once. The first lane's task is the thread's, and
        named so."""
        self.lanes += 1
        name = f"thread {self.id}" if self.lanes == 1 else _LANE_TASK
        nursery.start_soon(self._run, lane, name=name)

    async def _run(self, lane: Lane) -> None:
        """A lane's task. A thread deposed before this task ran ends the lane
        at its first checkpoint."""
        with trio.CancelScope() as scope:
            if self.deposed:
                scope.cancel()
            self._scopes.append(scope)
            try:
                await lane.run()
            finally:
                self._scopes.remove(scope)

    def depose(self) -> None:
        """Another node leads the thread now: end every lane of it here."""
        self.deposed = True
        for scope in self._scopes:
            scope.cancel()

    def ended(self, lane: Lane) -> bool:
        """A lane ended. True when it was the thread's last."""
        self.lanes -= 1
        return self.lanes == 0

    def enqueue(self, lane: Lane) -> None:
        self.pending.append(lane)
        if len(self.pending) == 1:
            lane.tell(Turn())

    def leave(self, lane: Lane) -> None:
        """The lane left the pending queue (accepted or settled): next, please."""
        if not self.pending or lane not in self.pending:
            return
        was_head = self.pending[0] is lane
        self.pending.remove(lane)
        if was_head and self.pending:
            self.pending[0].tell(Turn())


class Lane:
    """The shell of one run's machine, from queued until it settles or pauses."""

    # Slots: a broker holding ten thousand waiting runs holds ten thousand of these.
    __slots__ = (
        "f",
        "run_id",
        "thread_id",
        "key",
        "agent",
        "machine",
        "run_input_json",
        "caller_metadata_json",
        "metadata",
        "next_seq",
        "stamps",
        "arriving",
        "feed",
        "thread",
        "_inbox",
        "_finished",
        "_cancels",
        "_texts",
        "_text_room",
        "_place",
        "_offer",
        "_backlog",
        "awaiting_answer",
        "cancel_pending",
        "_baton",
        "_burst",
        "_carried",
        "_unconfirmed",
        "_inserting",
        "_undelivered_at",
        "_declined_news",
        "unread_reports",
        "_room",
        "_inbox_reports",
        "_recorded",
        "_faulted",
    )

    def __init__(
        self,
        host: LaneHost,
        row: dict[str, Any],
        *,
        arriving: bool,
        inserted: PendingWrite | None = None,
    ) -> None:
        self.f = host
        self.run_id: str = row["id"]
        self.thread_id: str = row["thread_id"]
        self.key: str = row["provider_key"]
        self.agent: str = row["agent_name"]
        self.machine = RunMachine(row["status"])
        # The status the record has (as far as the lane knows): the machine's
        # runs ahead of it while a write is being made.
        self._recorded = self.machine.status
        self._faulted = False
        # As JSON text: read only to make the offer (LaneHost.offer_payload).
        self.run_input_json: str = row["input"]
        self.caller_metadata_json: str = row["caller_metadata"]
        self.metadata: dict[str, Any] = row["metadata"]
        self.next_seq: int = row["next_seq"]
        self.stamps: dict[str, float | None] = {
            "created_at": row.get("created_at"),
            "started_at": row.get("started_at"),
            "completed_at": row.get("completed_at"),
        }
        self.arriving = arriving
        self.feed = Feed(self.next_seq)
        self.thread: ThreadLanes | None = None
        self._inbox: Inbox[Message] = Inbox()
        # The RUN_FINISHED the stream carried (its interrupts, on a pause).
        self._finished: dict[str, Any] | None = None
        # Cancels read and not answered yet, oldest first (AnswerCancel answers them).
        self._cancels: list[Cancel] = []
        # The assistant's text as it streams (message id -> role and parts), for
        # the thread's history; at most _text_room more characters of it.
        self._texts: dict[str, tuple[str, list[str]]] = {}
        self._text_room: int | None = None
        # The session whose place the run holds (offer out, or held), if any.
        self._place: ProviderSession | None = None
        self._offer: Offer | None = None
        # Messages read early and not yet applied; rarely any (a list: an
        # empty deque costs a waiting run most of a kilobyte).
        self._backlog: list[Message] = []
        #: An offer is out: a cancel now is read after the answer.
        self.awaiting_answer = False
        #: A cancel was told while the offer is out: later ones are the same
        #: request and are not told again (the inbox is unbounded).
        self.cancel_pending = False
        self._baton = False
        self._burst: list[dict[str, Any]] = []
        # Events read, not yet written: the stream's last burst, which the
        # write that ends the run carries (see ``_do_relay``).
        self._carried: list[dict[str, Any]] = []
        # A write queued without waiting, whose verdict is not read yet: a
        # move, or (``_inserting``) the run's own insert, which the door
        # queued as it started the lane -- its first write is chained
        # behind it and may share its commit.
        self._unconfirmed: PendingWrite | None = inserted
        self._inserting = inserted is not None
        self._undelivered_at = math.inf
        #: The provider's news count when it last declined this run.
        self._declined_news = 0
        #: Reports told and not yet taken up for recording (see ``full``).
        self.unread_reports = 0
        self._room: trio.Event | None = None
        self._inbox_reports = host.settings.lane_inbox_reports

    @property
    def status(self) -> Status:
        return self.machine.status

    @property
    def recorded(self) -> Status:
        """The status the record has from this lane (its last move written)."""
        return self._recorded

    async def ended(self) -> None:
        """Wait until the lane has ended (the run settled or paused)."""
        await self.feed.wait_closed()

    # -- the inbox ---------------------------------------------------------------

    @property
    def _send(self) -> Inbox[Message]:
        """The inbox's sending side: the inbox itself (one object, both ends)."""
        return self._inbox

    def tell(self, message: Message) -> None:
        try:
            self._inbox.send_nowait(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            if isinstance(message, Cancel):
                message.refuse()  # the run ended before it could be read
            return
        if isinstance(message, Report):
            self.unread_reports += 1

    def report(self, event: Any) -> bool:
        """``tell(Report(event))``, the provider link's commonest message, on
        its own road; True when the lane is ``full`` after it."""
        try:
            self._inbox.send_nowait(Report(event))
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            return False
        self.unread_reports = unread = self.unread_reports + 1
        return unread >= self._inbox_reports

    # -- backpressure: the inbox holds at most lane_inbox_reports reports ----------

    @property
    def full(self) -> bool:
        """Funduq is behind recording this run's reports: whoever reports for
        it should stop reading until ``room()`` (its link's reader does)."""
        return self.unread_reports >= self._inbox_reports

    async def room(self) -> None:
        """Wait until the run is no longer ``full`` (or its lane ended)."""
        while self.full:
            if self._room is None:
                self._room = trio.Event()
            await self._room.wait()

    def _took_reports(self, count: int) -> None:
        self.unread_reports = max(0, self.unread_reports - count)
        if self._room is not None and not self.full:
            self._room.set()
            self._room = None

    async def _receive(self, deadline: float = math.inf) -> Message | None:
        if self._backlog:
            return self._backlog.pop(0)
        if deadline == math.inf:
            return await self._inbox.receive()  # no clock: no cancel scope to hold
        with trio.move_on_at(deadline):
            return await self._inbox.receive()
        return None

    def _receive_nowait(self) -> Message | None:
        if self._backlog:
            return self._backlog.pop(0)
        return self._inbox.take_nowait()

    def _more_reports(self, first: Report) -> list[Any]:
        """The report just read plus any that queue right behind it, so one
        group commit carries a burst (a message that is not a report waits)."""
        raws = [first.event]
        if self._backlog:
            return raws
        take = self._inbox.take_nowait
        while len(raws) < REPORT_BURST:
            message = take()
            if message is None:
                break
            if type(message) is Report:
                raws.append(message.event)
            else:
                self._backlog.append(message)
                break
        return raws

    def _drain(self) -> list[Message]:
        out = self._backlog
        if out:
            self._backlog = []
        else:
            out = []
        take = self._inbox.take_nowait
        while (message := take()) is not None:
            out.append(message)
        return out

    # -- the task ----------------------------------------------------------------

    async def run(self) -> None:
        deposed = False
        try:
            await self._live()
        except Unrecorded:
            log.debug("run %s: not recorded; its lane ends", self.run_id)
        except NotLeader:
            # The record refused a write: another node took the thread's lease
            # over and settles this run by the restart rules. Nothing more is
            # written here, and every lane of the thread here ends.
            log.warning("run %s: its thread is led by another node now; letting go", self.run_id)
            deposed = True
            self.f.lost_lead(self.thread_id)
        except Exception:
            # A bug in one run must not end every other conversation, nor
            # leave this one wedged: it fails alone.
            log.exception("run %s: lane failed; the run fails (%s)", self.run_id, "funduq_error")
            await self._fault()
        finally:
            if self._inserting and self._unconfirmed is not None:
                # Ended (cancelled) before its first write: the door waits on
                # the insert, which nobody else may wake the writer for.
                self._unconfirmed.hurry()
            # What is still unread gets its due: a cancel an answer, a baton
            # its next holder. Drain before closing -- a closed inbox is empty.
            leftovers = self._drain()
            self._inbox.close()
            for message in leftovers:
                if isinstance(message, Cancel):
                    message.refuse()  # the run ended (or paused) first
                elif isinstance(message, Wake):
                    self._baton = self._baton or message.baton
            if self.unread_reports or self._room is not None:
                self._took_reports(self.unread_reports)  # dropped: nobody waits on them
            for cancel in self._cancels:
                cancel.refuse()
            self._cancels.clear()
            deposed = deposed or (self.thread is not None and self.thread.deposed)
            if deposed and self._place is not None:
                if self._place.held.get(self.run_id) is self:
                    # The provider works for nobody now: ask it to stop.
                    self._place.cancel(self.run_id)
                elif self._offer is not None:
                    # An answer still to come is nobody's: a late acceptance
                    # is asked to stop (see ProviderSession.answer).
                    self._place.withdraw(self._offer)
            if self._place is not None:
                self._release_place(wake=True)  # the fault could not settle: still free it
            self.f.providers.stop_waiting(self.key, self)
            if self._baton:
                self._pass_baton()
            if self.thread is not None:
                self.thread.leave(self)
            self.feed.close()
            self.f.lane_ended(self)

    async def _fault(self) -> None:
        self._faulted = True
        m = self.machine
        if m.over and self._recorded != m.status:
            # The write that was to end the run is what failed: fail the run
            # from where the record has it.
            self.machine = RunMachine(self._recorded)
            self.machine.reported_error = m.reported_error
        try:
            await self._do(self.machine.handle(Input.FAULT))
        except NotLeader:
            # Another node leads the thread now: it settles the run.
            self.f.lost_lead(self.thread_id)
        except Exception:
            log.exception("run %s: could not settle it after a fault", self.run_id)

    async def _live(self) -> None:
        m = self.machine
        if self.arriving and self.f.providers.serving(self.key, self.agent) is None:
            # Served when the door took it, gone by the lane's first step.
            await self._do(m.handle(Input.ARRIVED_UNSERVED))
        while not m.over:
            phase = m.phase
            if phase is _WAITING:
                message = await self._pending_wait()
                if message is None:
                    continue
            elif phase in _HOLDING:
                # ``_receive``, inline: the held run's every message comes here.
                if self._backlog:
                    message = self._backlog.pop(0)
                elif self._undelivered_at == math.inf:
                    message = await self._inbox.receive()
                elif self._inbox.waiting():
                    # A message waits: ``receive`` returns it at once (still a
                    # checkpoint), so the window's clock is read, not armed --
                    # a cancel scope per message was most of a burst's cost.
                    if trio.current_time() < self._undelivered_at:
                        message = await self._inbox.receive()
                    else:
                        message = None  # as the scope, entered past its deadline
                else:
                    message = None
                    with trio.move_on_at(self._undelivered_at):
                        message = await self._inbox.receive()
                if message is None:
                    # Silence is not a verdict: counted against the provider,
                    # once, and the run is left alone.
                    self._undelivered_at = math.inf
                    await self._do(m.handle(Input.UNDELIVERED_WINDOW_OVER))
                    continue
            else:
                raise rm.RunProtocolError(f"lane idle in phase {m.phase.value!r}")
            await self._on_message(message)

    async def _on_message(self, message: Message) -> None:
        m = self.machine
        kind = type(message)
        if kind is Report:  # the commonest first
            raws = self._more_reports(message)  # type: ignore[arg-type]
            self._took_reports(len(raws))
            if m.phase not in _HOLDING:
                await self._do(m.handle(_REPORT))  # a run nobody holds: nothing
                return
            await self._report(raws)
        elif kind is Finish:
            await self._do(m.handle(_FINISH))
        elif kind is Turn:
            if actions := m.handle(_TURN):  # none in any phase today: no _do to await
                await self._do(actions)
        elif kind is Wake:
            self._baton = self._baton or message.baton  # type: ignore[union-attr]
            if actions := m.handle(_WAKE):
                await self._do(actions)
        elif kind is Cancel:
            self._cancels.append(message)  # type: ignore[arg-type]
            await self._do(m.handle(_CANCEL))
        elif kind is Gone:
            await self._do(m.handle(_LINK_GONE))

    async def _report(self, raws: list[Any]) -> None:
        """Validate a burst; the machine relays it (persist, then publish) or,
        for a malformed event, relays the valid ones before it and fails the run."""
        events: list[dict[str, Any]] = []
        finished: str | None = None
        errored = False
        read_event = agui.read_event
        for raw in raws:
            try:
                event = read_event(raw)
            except agui.MalformedEvent as exc:
                log.info("run %s: malformed event from provider: %s", self.run_id, exc)
                self._burst = events
                await self._do(
                    self.machine.handle(
                        _MALFORMED, reason=agui.MALFORMED, finished=finished, errored=errored
                    )
                )
                return
            kind = event["type"]
            if kind in _TEXT_KINDS:
                self._note_text(event)
            elif kind == _RUN_FINISHED:
                self._finished = event
                finished = agui.outcome_of(event)
            elif kind == _RUN_ERROR:
                errored = True
            events.append(event)
        self._burst = events
        await self._do(self.machine.handle(_REPORT, finished=finished, errored=errored))

    # -- pending: waiting for a turn, a place, an answer --------------------------

    async def _pending_wait(self) -> Message | None:
        """The next message for a queued run; None when the lane acted instead
        (offered, or its unserved window ran out)."""
        message = self._receive_nowait()
        if message is None and self._inserting and not self._offers_now():
            # About to wait: first the insert's verdict (queued as the lane
            # started); then everything is looked at again, since the await
            # may have changed it (the provider left, say).
            await self._insert_confirmed()
            return None
        # Nothing is read early (the backlog is empty): the waits below read
        # the inbox itself, without ``_receive``'s frame, which every queued
        # run would hold while it waits.
        if message is not None or not self.machine.wants_place:
            return message if message is not None else await self._inbox.receive()
        providers = self.f.providers
        session = providers.serving(self.key, self.agent)
        if session is None:
            self._pass_baton()
            grace = self.f.settings.unserved_grace_seconds
            deadline = providers.unserved_since(self.key, self.agent) + grace
            providers.wait(self.key, self, for_room=False)
            message = await self._receive(deadline)
            if message is None:
                providers.stop_waiting(self.key, self)
                await self._do(self.machine.handle(Input.UNSERVED_WINDOW_OVER))
                return None
        elif self.machine.declined or not session.has_room():
            self._pass_baton()
            if self.machine.declined and providers.news(self.key) != self._declined_news:
                # Something changed on the provider after it said "full" --
                # a place freed, it re-published -- while this lane was
                # still recording the decline: that wake-up found no head
                # waiting. It was this head's; look again.
                return Wake()
            providers.wait(self.key, self, for_room=True)
            message = await self._inbox.receive()
        else:
            await self._offer_to(session)
            return None
        providers.stop_waiting(self.key, self)
        return message

    def _offers_now(self) -> bool:
        """``_pending_wait`` would offer the run at once (no message waits)."""
        if not self.machine.wants_place:
            return False
        session = self.f.providers.serving(self.key, self.agent)
        return session is not None and not self.machine.declined and session.has_room()

    def _pass_baton(self) -> None:
        """A lane woken for a freed place that will not use it hands the
        wake-up to the next waiting head, so no freed place goes unnoticed."""
        if self._baton:
            self._baton = False
            session = self.f.providers.sessions.get(self.key)
            if session is not None and session.live and session.has_room():
                self.f.providers.wake_for_room(self.key)

    async def _await_answer(self, offer: Offer, session: ProviderSession) -> None:
        """Wait for the answer within the delivery timeout of the link's
        silence, and at most DELIVERY_BOUND timeouts in all (module docstring)."""
        timeout = self.f.settings.deliver_timeout_seconds
        sent = trio.current_time()
        bound = sent + DELIVERY_BOUND * timeout
        while True:
            deadline = min(max(sent, session.last_heard) + timeout, bound)
            with trio.move_on_at(deadline):
                await offer.wait()
                return
            if (
                not session.live
                or deadline >= bound
                or max(sent, session.last_heard) + timeout <= deadline
            ):
                return

    async def _offer_to(self, session: ProviderSession) -> None:
        m = self.machine
        self._offer = session.reserve(self)
        self._place = session
        self._baton = False
        await self._do(m.handle(Input.PLACE_FOUND))
        # A cancel that came while the offering write was made: nothing has
        # left yet, so it is applied now ("queued: cancelled at once").
        for message in self._drain():
            if isinstance(message, Cancel) and m.phase is Phase.RESERVED:
                self._cancels.append(message)
                await self._do(m.handle(Input.CANCEL))
            else:
                self._backlog.append(message)
        if m.phase is not Phase.RESERVED:
            return
        offer = self._offer
        await self._do(m.handle(Input.OFFER_READY))
        if m.phase in (Phase.SETTLED,):
            return  # the offer could not leave
        self.awaiting_answer = True
        try:
            await self._await_answer(offer, session)
        finally:
            self.awaiting_answer = self.cancel_pending = False
        if offer.verdict is not None:
            self._declined_news = offer.news
            await self._do(m.handle(_ANSWER[offer.verdict], reason=offer.reason or "refused"))
            if m.phase in _HOLDING:
                self._undelivered_at = (
                    trio.current_time() + self.f.settings.undelivered_window_seconds
                )
        elif offer.answered:  # resolved with no verdict: the link went away
            await self._do(m.handle(Input.LINK_GONE))
        else:
            await self._do(m.handle(Input.UNANSWERED))

    # -- carrying out the machine's actions ------------------------------------------

    async def _do(self, actions: list[rm.Action]) -> None:
        """Carry out the machine's actions, in order. Each action's step is
        looked up by its type (``_STEPS``); a step that must wait returns
        what to await, the others are done when they return."""
        for action in actions:
            step = _STEPS[type(action)](self, action)
            if step is not None:
                await step

    def _do_move(self, action: rm.Move) -> Awaitable[None]:
        return self._move(action.to, stamp=action.stamp, soon=action.soon)

    async def _do_pause(self, action: rm.Pause) -> None:
        self.metadata["interrupts"] = agui.interrupts_of(self._finished or {})
        await self._move(
            Status.INPUT_REQUIRED,
            stamp="completed_at",
            messages=self.f.reply_messages(self),
        )

    def _do_send_offer(self, action: rm.SendOffer) -> Awaitable[None]:
        return self._send_offer()

    def _do_withdraw(self, action: rm.Withdraw) -> None:
        if self._place is not None and self._offer is not None:
            self._place.withdraw(self._offer)

    def _do_release_place(self, action: rm.ReleasePlace) -> None:
        self._release_place(wake=action.wake)

    def _do_relay(self, action: rm.Relay) -> Awaitable[None] | None:
        burst, self._burst = self._burst, []
        if burst and (
            self.machine.over or (self._backlog and isinstance(self._backlog[0], Finish))
        ):
            # The run ends next (the stream's finish is read right behind
            # this burst, or this very input settles it): the write that ends
            # it carries these events, in its transaction, and publishes them
            # once it is durable -- one write where there were two.
            self._carried.extend(burst)
            return None
        return self._append(burst)

    def _do_ask_to_stop(self, action: rm.AskToStop) -> None:
        if self._place is not None:
            self._place.cancel(self.run_id)

    async def _do_count(self, action: rm.Count) -> None:
        try:
            await self.f.providers.count(self.key, action.counter)
        except Exception as exc:
            if not record_trouble(exc):
                raise
            log.warning(
                "run %s: could not record a %s strike: %s", self.run_id, action.counter, exc
            )

    def _do_note_cancel(self, action: rm.NoteCancel) -> None:
        by = self._cancels[0].by if self._cancels else None
        self.metadata.setdefault("funduq", {})["cancelRequestedBy"] = by

    def _do_answer_cancel(self, action: rm.AnswerCancel) -> None:
        if self._cancels:
            cancel = self._cancels.pop(0)
            if action.applied:
                cancel.applied(self.snapshot())
            else:
                cancel.refuse()

    def _do_leave_queue(self, action: rm.LeaveQueue) -> None:
        if self.thread is not None:
            self.thread.leave(self)

    async def _send_offer(self) -> None:
        session, offer = self._place, self._offer
        assert session is not None and offer is not None
        if self.f.leased:
            # Several nodes: not past this node's lease as its own clock
            # tells it (a stalled node's late offer would reach the provider
            # after the thread's new leader's). No await between this and
            # the send below.
            await self.f.lease_sure(self.thread_id)
        try:
            payload = self.f.offer_payload(self)
            # What the link cannot carry (the doors refuse such input now; an
            # older record may still hold it) is found here, before anything
            # is sent: the frame itself is encoded later, by the link's writer.
            problem = carriable.problem(payload["runInput"]) or carriable.problem(
                payload["metadata"]
            )
            if problem is not None:
                raise ValueError(problem)
            session.send(offer, payload)
        except (ValueError, TypeError) as exc:
            # The link could not encode this offer: the run fails alone, the
            # link stays up for the others, and no quality counter moves.
            log.warning("run %s: offer not encodable: %s", self.run_id, exc)
            await self._do(self.machine.handle(Input.OFFER_NOT_ENCODABLE))

    def _release_place(self, *, wake: bool) -> None:
        session, self._place = self._place, None
        offer, self._offer = self._offer, None
        if session is None:
            return
        if session.held.get(self.run_id) is self:
            session.release(self.run_id)
        elif offer is not None:
            session.give_back(wake=wake)

    # -- writing -------------------------------------------------------------------

    async def _retrying(self, write: Callable[[], Any], failed: Exception | None = None) -> Any:
        """``await write()`` until the record takes it. Only the medium's
        troubles are retried (while they last the broker is not ready); any
        other error is the lane's fault and propagates. ``failed``: the first
        try was made already (by the caller, on its own road) and raised this."""
        pause = RETRY_SECONDS
        while True:
            if failed is None:
                try:
                    return await write()
                except Exception as exc:  # noqa: BLE001 -- raised below unless the medium's
                    failed = exc
            if not record_trouble(failed):
                raise failed
            log.warning(
                "run %s: record write failed (%s); retrying in %.1fs", self.run_id, failed, pause
            )
            failed = None
            await trio.sleep(pause)
            pause = min(pause * 2, RETRY_MAX_SECONDS)

    async def _after_move(self, write: Callable[[PendingWrite | None], Awaitable[Any]]) -> Any:
        """``await write(None)`` once the move queued without waiting
        (``_unconfirmed``) is confirmed. While that move is still on its way,
        ``write(it)`` is queued chained behind it instead -- made only if it
        moved (``Store.write``'s ``after``) -- so the two share a commit rather
        than each wait for its own; the move's verdict is then at hand
        (first-in first-out) and read as ``_confirm`` reads it."""
        pending = self._unconfirmed
        if pending is not None and not pending.done:
            try:
                result = await write(pending)
            except Exception as exc:
                if not record_trouble(exc):
                    raise
                result = SKIPPED  # made again below, once the move is confirmed
            await self._confirm()  # refused: MoveRefused; failed: the move retried
            if result is not SKIPPED:
                return result
        elif pending is not None:
            await self._confirm()
        return await self._retrying(lambda: write(None))

    async def _insert_confirmed(self) -> None:
        """Before a queued run waits: its insert's verdict (Unrecorded when
        it failed), so a run never recorded does not wait as if it were."""
        if self._inserting:
            await self._confirm()

    async def _confirm(self) -> None:
        """Read the verdict of a move queued without waiting, before writing
        anything after it: a move the record refused is not believed. For
        the run's insert: Unrecorded when it failed (nothing is written)."""
        pending, self._unconfirmed = self._unconfirmed, None
        if pending is None:
            return
        if self._inserting:
            self._inserting = False
            try:
                inserted = await pending.result()
            except Exception:  # noqa: BLE001 -- the door raises it, to the caller
                inserted = False
            if not inserted:
                raise Unrecorded(self.run_id)
            return
        try:
            moved = await pending.result()
        except Exception as exc:
            if not record_trouble(exc):
                raise
            moved = await self._retrying(
                lambda: self.f.record.move(
                    self.run_id,
                    Status.RUNNING,
                    metadata=self.metadata,
                    stamp=("started_at", self.stamps.get("started_at") or time.time()),
                )
            )
        if not moved:
            raise MoveRefused(f"run {self.run_id}: the record refused the move to running")

    async def _append(self, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        numbered = list(enumerate(events, start=self.next_seq))
        record = self.f.record
        run_id = self.run_id
        if self._unconfirmed is None:
            # The common road: nothing to chain behind, so ``_after_move``'s
            # and ``_retrying``'s frames only for a failed first try.
            try:
                await record.append_events(run_id, numbered)
            except Exception as exc:  # noqa: BLE001 -- _retrying re-raises what is not the medium's
                await self._retrying(lambda: record.append_events(run_id, numbered), exc)
        else:

            def append(after: PendingWrite | None) -> Awaitable[Any]:
                if after is None:
                    return record.append_events(run_id, numbered)
                return record.append_events(run_id, numbered, after=after)

            await self._after_move(append)
        self.next_seq += len(events)
        self.f.metrics.events_recorded += len(numbered)
        self.feed.publish_all(numbered)

    async def _move(
        self,
        to: Status,
        *,
        stamp: str | None = None,
        events: list[dict[str, Any]] | None = None,
        messages: list[tuple[Any, ...]] | None = None,
        soon: bool = False,
    ) -> None:
        """Write the move, with ``events`` (after any carried ones) numbered
        from ``next_seq`` and published once it is durable."""
        numbered = list(enumerate([*self._carried, *(events or ())], start=self.next_seq))
        soon = soon and not numbered
        if soon and self._unconfirmed is not None:
            await self._confirm()
        when = time.time()
        record = self.f.record
        if soon:
            # Not awaited: the record's writer is first-in first-out, so every
            # event persisted (and relayed) later lands after this status; its
            # verdict is read before the next write (_confirm).
            self._unconfirmed = record.move_soon(
                self.run_id, to, metadata=self.metadata, stamp=(stamp, when) if stamp else None
            )
        else:

            def move(after: PendingWrite | None) -> Awaitable[Any]:
                changes: dict[str, Any] = {
                    "metadata": self.metadata,
                    "events": numbered,
                    "stamp": (stamp, when) if stamp else None,
                    "messages": messages,
                }
                if after is not None:
                    changes["after"] = after
                return record.move(self.run_id, to, **changes)

            if self._unconfirmed is None:
                # As in ``_append``: the common road without the chain's frames.
                try:
                    moved = await move(None)
                except Exception as exc:  # noqa: BLE001 -- _retrying re-raises what is not the medium's
                    moved = await self._retrying(lambda: move(None), exc)
            else:
                moved = await self._after_move(move)
            if not moved:
                raise MoveRefused(f"run {self.run_id}: the record refused the move to {to}")
            self._carried = []
            self.next_seq += len(numbered)
        self._recorded = to
        if stamp:
            self.stamps[stamp] = when
        self.f.metrics.events_recorded += len(numbered)
        if to in _ENDS:
            self.f.metrics.run_ended(to)
        if numbered:
            self.feed.publish_all(numbered)

    def snapshot(self) -> dict[str, Any] | None:
        """The run's record as the lane knows it, when the lane saw all of its
        events (a run reopened after a pause did not); the same shape as
        ``Funduq.get_run``."""
        if self.feed.first_seq != 1:
            return None
        return {
            "runId": self.run_id,
            "threadId": self.thread_id,
            "agent": {"provider": self.key, "name": self.agent},
            "status": self.status,
            "metadata": self.metadata,
            "createdAt": iso(self.stamps.get("created_at")),
            "startedAt": iso(self.stamps.get("started_at")),
            "completedAt": iso(self.stamps.get("completed_at")),
            "events": [{"seq": seq, "event": event} for seq, event in self.feed.events],
        }

    async def _settle(self, settle: rm.Settle) -> None:
        """Write a terminal status; a failure nobody reported gets a RUN_ERROR."""
        events = []
        if settle.to is Status.FAILED:
            self.metadata["failureReason"] = settle.reason
        if settle.error_event:
            events.append(agui.run_error(settle.reason or "failed"))
        # After a fault, the least that ends the run: no replies for its thread.
        replies = None if self._faulted else self.f.reply_messages(self)
        await self._move(settle.to, stamp="completed_at", events=events, messages=replies)

    def _note_text(self, event: dict[str, Any]) -> None:
        """Collect the assistant's text so the thread's history has replies.
        Bounded: a run keeps at most FUNDUQ_MAX_BODY_BYTES characters of reply
        text (and ids) for the history -- the most a caller could send back as
        one message -- so a provider streaming megabytes of deltas cannot grow
        the server (the record still has every event)."""
        kind, mid = event["type"], event.get("messageId")
        if not isinstance(mid, str):
            return
        if kind == "TEXT_MESSAGE_CONTENT":
            # The commonest, on its own road: a delta of a message begun, with
            # room for it (``_keep_text`` does the same, in a call more).
            delta, known, room = event.get("delta"), self._texts.get(mid), self._text_room
            if known is not None and type(delta) is str and room is not None:
                if len(delta) <= room:
                    self._text_room = room - len(delta)
                    if delta:
                        known[1].append(delta)
                    return
        if kind == "TEXT_MESSAGE_START":
            role = event.get("role", "assistant")
            self._keep_text(mid, role if isinstance(role, str) else "assistant", "", restart=True)
        elif kind in ("TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_CHUNK"):
            delta = event.get("delta")
            self._keep_text(mid, "assistant", delta if isinstance(delta, str) else "")

    def _keep_text(self, mid: str, role: str, delta: str, *, restart: bool = False) -> None:
        if self._text_room is None:
            self._text_room = self.f.settings.max_body_bytes
        known = self._texts.get(mid)
        cost = len(delta) + (0 if known is not None else len(mid) + len(role))
        if cost > self._text_room:
            if self._text_room >= 0:
                log.info(
                    "run %s: reply text past %d characters is kept in the record only",
                    self.run_id,
                    self.f.settings.max_body_bytes,
                )
                self._text_room = -1  # said once
            return
        self._text_room -= cost
        if known is None or restart:
            self._texts[mid] = (role, [delta] if delta else [])
        elif delta:
            known[1].append(delta)

    def replies(self) -> list[dict[str, Any]]:
        return [
            {"id": mid, "role": role, "content": "".join(parts)}
            for mid, (role, parts) in self._texts.items()
        ]


#: A lane's task name, as trio would make it from ``Lane.run`` -- made once,
#: not formatted at each spawn.
_LANE_TASK = f"{Lane.run.__module__}.{Lane.run.__qualname__}"

#: Each action of the run machine and the lane's step that carries it out.
_STEPS: dict[type[Any], Callable[[Lane, Any], Awaitable[None] | None]] = {
    rm.Move: Lane._do_move,
    rm.Settle: Lane._settle,
    rm.Pause: Lane._do_pause,
    rm.SendOffer: Lane._do_send_offer,
    rm.Withdraw: Lane._do_withdraw,
    rm.ReleasePlace: Lane._do_release_place,
    rm.Relay: Lane._do_relay,
    rm.AskToStop: Lane._do_ask_to_stop,
    rm.Count: Lane._do_count,
    rm.NoteCancel: Lane._do_note_cancel,
    rm.AnswerCancel: Lane._do_answer_cancel,
    rm.LeaveQueue: Lane._do_leave_queue,
}
