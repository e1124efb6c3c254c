"""A run's lane -- the one task that owns a run -- and a thread's nursery.

Theory of operation
-------------------
Every run gets one task (its *lane*) from the moment it is queued until it
settles or pauses. The lane's only input is a memory channel (see
``inbox.py``); the provider link, the doors, the thread queue and the
provider registry only *send it what happened*. The lane applies those facts
one at a time, so the order things happen to a run is channel order, not
whoever touched it last.

The wait for an offer's answer is the lane's own await: it offers, awaits
the answer (inside the delivery timeout's cancel scope) and only then reads
its inbox again -- so a cancel that arrived meanwhile is read *after* the
answer. Accepted: the run is running and is then asked to stop like any
running run. Declined or unanswered: it is back in the queue and the cancel
ends it here. Never both.

A thread's lanes live in the thread's own nursery, held open by one task
while the thread has active runs. Only the head of a thread's pending queue
is offered; the next becomes head the moment the head *leaves the queue*
(accepted or settled), not when its turn finishes.

Clocks are cancel scopes inside the lane that waits: the grace window of an
unserved agent, the delivery timeout of an offer, the undelivered window of a
held run. No sweeper polls timestamps.
"""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Any

import trio

from ..protocol import agui, carriable, reasons
from ..protocol import statuses as st
from .inbox import Cancel, Finish, Gone, Message, Report, Turn, Wake
from .providers import ACCEPTED, DECLINED, REFUSED, ProviderSession
from .record import iso

if TYPE_CHECKING:
    from .funduq import Funduq

log = logging.getLogger("funduq.lanes")

#: At most this many queued reports share one write.
REPORT_BURST = 256


class Feed:
    """A live run's events for its followers, in seq order. Events land here
    only after the record has them (persisted before relayed)."""

    __slots__ = ("first_seq", "events", "closed", "_changed")

    def __init__(self, first_seq: int) -> None:
        self.first_seq = first_seq
        self.events: list[tuple[int, dict[str, Any]]] = []
        self.closed = False
        # Made by the first follower to wait: a run nobody follows has none.
        self._changed: trio.Event | None = None

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()
            self._changed = None

    def publish(self, seq: int, event: dict[str, Any]) -> None:
        self.events.append((seq, event))
        self._wake()

    def close(self) -> None:
        self.closed = True
        self._wake()

    async def changed(self) -> None:
        """Wait for the next publish or the close."""
        if self.closed:
            return
        if self._changed is None:
            self._changed = trio.Event()
        await self._changed.wait()


class ThreadLanes:
    """A thread with active runs: its nursery and its pending queue."""

    __slots__ = ("id", "pending", "lanes", "_nursery", "_starting")

    def __init__(self, thread_id: str) -> None:
        self.id = thread_id
        # A list, not a deque: at most thread_queue_limit long, and an empty
        # deque costs a waiting run most of a kilobyte.
        self.pending: list[Lane] = []
        self.lanes = 0
        self._nursery: trio.Nursery | None = None
        self._starting: list[Lane] | None = []

    async def hold(self) -> None:
        """The thread's task: its lanes run in this nursery; it ends once the
        last of them has ended (the nursery's own exit waits for them). No
        lane starts here after that: the thread is forgotten by then (see
        ``ended``), and a later run of it gets a new ThreadLanes."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for lane in self._starting:
                nursery.start_soon(lane.run)
            self._starting = None

    def start(self, lane: Lane) -> None:
        self.lanes += 1
        if self._nursery is None:
            self._starting.append(lane)
        else:
            self._nursery.start_soon(lane.run)

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
    """The one task that owns a run from queued until it settles or pauses."""

    # Slots: a broker holding ten thousand waiting runs holds ten thousand of these.
    __slots__ = ("f", "run_id", "thread_id", "key", "agent", "status", "run_input_json",
                 "caller_metadata_json", "metadata", "next_seq", "stamps", "arriving", "feed",
                 "thread", "_send", "_inbox", "_finished", "_reported_error",
                 "_cancel_requested", "_texts", "_session", "_backlog", "awaiting_answer",
                 "_baton")

    def __init__(self, funduq: Funduq, row: dict[str, Any], *, arriving: bool) -> None:
        self.f = funduq
        self.run_id: str = row["id"]
        self.thread_id: str = row["thread_id"]
        self.key: str = row["provider_key"]
        self.agent: str = row["agent_name"]
        self.status: str = row["status"]
        # As JSON text: read only to make the offer (Funduq._offer_payload).
        self.run_input_json: str = row["input"]
        self.caller_metadata_json: str = row["caller_metadata"]
        self.metadata: dict[str, Any] = row["metadata"]
        self.next_seq: int = row["next_seq"]
        self.stamps: dict[str, float | None] = {
            k: row.get(k) for k in ("created_at", "started_at", "completed_at")}
        self.arriving = arriving
        self.feed = Feed(self.next_seq)
        self.thread: ThreadLanes | None = None
        self._send, self._inbox = trio.open_memory_channel[Message](math.inf)
        # What the stream said so far (the funnel reads these).
        self._finished: dict[str, Any] | None = None
        self._reported_error = False
        self._cancel_requested = False
        self._texts: dict[str, dict[str, Any]] = {}
        self._session: ProviderSession | None = None
        # Messages read early and not yet applied; rarely any (a list: an
        # empty deque costs a waiting run most of a kilobyte).
        self._backlog: list[Message] = []
        #: An offer is out (or about to leave): a cancel now is read after the answer.
        self.awaiting_answer = False
        self._baton = False

    async def ended(self) -> None:
        """Wait until the lane has ended (the run settled or paused)."""
        while not self.feed.closed:
            await self.feed.changed()

    # -- the inbox ---------------------------------------------------------------

    def tell(self, message: Message) -> None:
        try:
            self._send.send_nowait(message)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            if isinstance(message, Cancel):
                message.refuse()  # the run ended before it could be read

    async def _receive(self, deadline: float = math.inf) -> Message | None:
        if self._backlog:
            return self._backlog.pop(0)
        if deadline == math.inf:
            return await self._inbox.receive()  # no clock: no cancel scope to hold
        with trio.move_on_at(deadline):
            return await self._inbox.receive()
        return None

    def _more_reports(self, first: Report) -> list[Any]:
        """The report just read plus any that queue right behind it, so one
        group commit carries a burst (a message that is not a report waits)."""
        raws = [first.event]
        while len(raws) < REPORT_BURST and not self._backlog:
            try:
                message = self._inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel):
                break
            if isinstance(message, Report):
                raws.append(message.event)
            else:
                self._backlog.append(message)
        return raws

    # -- the task ----------------------------------------------------------------

    async def run(self) -> None:
        try:
            if self.arriving and self.f.providers.serving(self.key, self.agent) is None:
                await self._settle(st.FAILED, reasons.AGENT_OFFLINE)
                return
            if await self._until_accepted():
                await self._while_held()
        except Exception:
            # A bug in one run must not end every other conversation: the run
            # stays as recorded (a restart settles it) and the fault is logged.
            log.exception("run %s: lane failed; the run is left as recorded", self.run_id)
        finally:
            # What is still unread gets its due: a cancel an answer, a baton
            # its next holder. Drain before closing -- a closed inbox is empty.
            leftovers = self._drain()
            self._inbox.close()
            for message in leftovers:
                if isinstance(message, Cancel):
                    message.refuse()  # the run ended (or paused) first
                elif isinstance(message, Wake):
                    self._baton = self._baton or message.baton
            self.f.providers.stop_waiting(self.key, self)
            self._pass_baton()
            if self.thread is not None:
                self.thread.leave(self)
            self.feed.close()
            self.f._lane_ended(self)

    def _drain(self) -> list[Message]:
        out = list(self._backlog)
        self._backlog.clear()
        while True:
            try:
                out.append(self._inbox.receive_nowait())
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                return out

    # -- pending: waiting for a turn, a place, an answer --------------------------

    async def _until_accepted(self) -> bool:
        """Returns True once a provider holds the run, False once it settled."""
        head = False
        declined = False
        while True:
            drained = self._drain()
            for i, message in enumerate(drained):
                outcome = await self._pending_message(message)
                if outcome == "settled":
                    self._backlog.extend(drained[i + 1:])
                    return False
                head = head or outcome == "turn"
                declined = declined and outcome != "wake"
            if not head:
                message = await self._receive()
            else:
                session = self.f.providers.serving(self.key, self.agent)
                if session is None:
                    self._pass_baton()
                    grace = self.f.settings.unserved_grace_seconds
                    deadline = self.f.providers.unserved_since(self.key, self.agent) + grace
                    self.f.providers.wait(self.key, self, for_room=False)
                    message = await self._receive(deadline)
                    if message is None:
                        await self._settle(st.FAILED, reasons.NO_PROVIDER_TOOK_IT)
                        return False
                elif declined or not session.has_room():
                    self._pass_baton()
                    self.f.providers.wait(self.key, self, for_room=True)
                    message = await self._receive()
                else:
                    answer = await self._offer(session)
                    if answer == "accepted":
                        return True
                    if answer == "settled":
                        return False
                    declined = answer == "declined"
                    continue
            self.f.providers.stop_waiting(self.key, self)
            outcome = await self._pending_message(message)
            if outcome == "settled":
                return False
            head = head or outcome == "turn"
            declined = declined and outcome != "wake"

    async def _pending_message(self, message: Message | None) -> str:
        if isinstance(message, Turn):
            return "turn"
        if isinstance(message, Wake):
            self._baton = self._baton or message.baton
            return "wake"
        if isinstance(message, Cancel):
            self._cancel_requested = True
            self._note_cancel(message.by)
            await self._settle(st.CANCELLED)
            message.applied(self.snapshot())
            return "settled"
        # Reports, finishes and "gone" for a run nobody holds: nothing to apply.
        log.debug("run %s ignored %r while pending", self.run_id, message)
        return "ignored"

    def _pass_baton(self) -> None:
        """A lane woken for a freed place that will not use it hands the
        wake-up to the next waiting head, so no freed place goes unnoticed."""
        if self._baton:
            self._baton = False
            session = self.f.providers.sessions.get(self.key)
            if session is not None and session.live and session.has_room():
                self.f.providers.wake_for_room(self.key)

    async def _await_answer(self, offer: Any, session: ProviderSession) -> None:
        """Wait for the answer within the delivery timeout -- of the *link's*
        silence. An answer travels behind the provider's reports on the same
        link, so while the link keeps delivering, a late answer may be
        funduq's own backlog, not the provider's fault: the clock restarts
        from the last frame heard, and only a whole timeout of silence counts."""
        timeout = self.f.settings.deliver_timeout_seconds
        sent = trio.current_time()
        while True:
            deadline = max(sent, session.last_heard) + timeout
            with trio.move_on_at(deadline):
                await offer.answered.wait()
                return
            if not session.live or max(sent, session.last_heard) + timeout <= deadline:
                return

    async def _offer(self, session: ProviderSession) -> str:
        try:
            payload = self.f._offer_payload(self)
            problem = (carriable.problem(payload["runInput"])
                       or carriable.problem(payload["metadata"]))
        except ValueError as exc:  # e.g. a chain hop that cannot be signed (not UTF-8)
            payload, problem = {}, str(exc) or repr(exc)
        if problem is not None:
            # The offer the link cannot encode (the doors refuse such input
            # now; an older record may still hold it). Decided before a place
            # is spent or anything is sent: this run fails alone, the link
            # stays up, and the thread's next run becomes head. No quality
            # counter moves -- it is nobody's fault at the provider.
            log.warning("run %s: its offer cannot be encoded (%s); failing it", self.run_id,
                        problem)
            await self._settle(st.FAILED, reasons.OFFER_NOT_ENCODABLE)
            return "settled"
        offer = session.reserve(self)
        self._baton = False
        self.awaiting_answer = True
        try:
            if not await self._move(st.OFFERING):
                session.give_back()
                return "settled"
            session.send(offer, payload)
            await self._await_answer(offer, session)
            session.withdraw(offer)
        finally:
            self.awaiting_answer = False
        verdict, reason = offer.verdict, offer.reason
        if verdict == ACCEPTED:
            # Not awaited: the record's writer is first-in first-out, so every
            # event persisted (and relayed) later lands after this status.
            await self._move(st.RUNNING, stamp="started_at", wait=False)
            self.thread.leave(self)
            self._session = session
            return "accepted"
        if verdict == REFUSED:
            session.give_back()
            # A refusal is permanent and the reason is the provider's, verbatim.
            await self._settle(st.FAILED, reason or "refused")
            return "settled"
        await self._move(st.QUEUED)
        if verdict == DECLINED:
            session.give_back(wake=False)
            await self.f.providers.count(self.key, "misdeclared")
            return "declined"
        session.give_back()
        if offer.answered.is_set():  # resolved with no verdict: the link went away
            return "gone"
        await self.f.providers.count(self.key, "unanswered")
        return "unanswered"

    # -- held: relaying until the stream ends --------------------------------------

    async def _while_held(self) -> None:
        session = self._session
        deadline = trio.current_time() + self.f.settings.undelivered_window_seconds
        while True:
            message = await self._receive(deadline)
            if message is None:
                # Silence is not a verdict: count it against the provider, once,
                # and leave the run alone.
                deadline = math.inf
                await self.f.providers.count(self.key, "undelivered")
                continue
            if isinstance(message, Report):
                if not await self._relay(self._more_reports(message), session):
                    return
            elif isinstance(message, Finish):
                await self._funnel(session)
                return
            elif isinstance(message, Cancel):
                if self.status == st.RUNNING:
                    self._cancel_requested = True
                    self._note_cancel(message.by)
                    if await self._move(st.CANCELLING):
                        session.cancel(self.run_id)
                message.applied(self.snapshot())
            elif isinstance(message, Gone):
                session.release(self.run_id)
                await self._settle(st.FAILED, reasons.PROVIDER_LEFT_HOLDING_IT)
                await self.f.providers.count(self.key, "abandoned")
                return

    async def _relay(self, raws: list[Any], session: ProviderSession) -> bool:
        """Validate, persist, then relay a burst of reported events. A
        malformed one fails the run; the valid ones before it are kept."""
        events = []
        for raw in raws:
            try:
                event = agui.read_event(raw)
            except agui.MalformedEvent as exc:
                log.info("run %s: malformed event from provider: %s", self.run_id, exc)
                await self._append(events)
                session.cancel(self.run_id)  # please stop: the run is over for us
                session.release(self.run_id)
                await self._settle(st.FAILED, agui.MALFORMED)
                return False
            kind = event["type"]
            if kind == agui.RUN_FINISHED:
                self._finished = event
            elif kind == agui.RUN_ERROR:
                self._reported_error = True
            self._note_text(event)
            events.append(event)
        await self._append(events)
        return True

    async def _funnel(self, session: ProviderSession) -> None:
        """How a run that reached a provider settles: first match wins."""
        session.release(self.run_id)
        outcome = agui.outcome_of(self._finished) if self._finished else None
        if outcome == "interrupt":
            self.metadata["interrupts"] = agui.interrupts_of(self._finished)
            await self._move(st.INPUT_REQUIRED, stamp="completed_at",
                             then=self.f._replies_writer(self))
        elif outcome == "cancelled" and self._cancel_requested:
            # AG-UI 1.0's own word that the run stopped as asked.
            await self._settle(st.CANCELLED)
        elif outcome is not None:
            await self._settle(st.COMPLETED)
        elif self._cancel_requested:
            await self._settle(st.CANCELLED)
        else:
            await self._settle(st.FAILED, reasons.STREAM_ENDED_WITHOUT_FINISHING)

    # -- writing -------------------------------------------------------------------

    async def _append(self, events: list[dict[str, Any]]) -> None:
        if not events:
            return
        numbered = list(enumerate(events, start=self.next_seq))
        self.next_seq += len(events)
        await self.f.record.append_events(self.run_id, numbered)
        self.f.metrics.events_recorded += len(numbered)
        for seq, event in numbered:
            self.feed.publish(seq, event)

    async def _move(self, to: str, *, stamp: str | None = None,
                    events: list[tuple[int, dict[str, Any]]] = (), then: Any = None,
                    wait: bool = True) -> bool:
        when = time.time()
        moved = await self.f.record.move(self.run_id, to, metadata=self.metadata, events=events,
                                         stamp=stamp and (stamp, when), then=then, wait=wait)
        if moved:
            self.status = to
            if stamp:
                self.stamps[stamp] = when
            self.f.metrics.events_recorded += len(events)
            if to in st.TERMINAL or to == st.INPUT_REQUIRED:
                self.f.metrics.run_ended(to)
        return moved

    def snapshot(self) -> dict[str, Any] | None:
        """The run's record as the lane knows it, when the lane saw all of its
        events (a run reopened after a pause did not); the same shape as
        ``Funduq.get_run``."""
        if self.feed.first_seq != 1:
            return None
        return {"runId": self.run_id, "threadId": self.thread_id,
                "agent": {"provider": self.key, "name": self.agent}, "status": self.status,
                "metadata": self.metadata, "createdAt": iso(self.stamps.get("created_at")),
                "startedAt": iso(self.stamps.get("started_at")),
                "completedAt": iso(self.stamps.get("completed_at")),
                "events": [{"seq": seq, "event": event} for seq, event in self.feed.events]}

    async def _settle(self, to: str, reason: str | None = None) -> None:
        """Write a terminal status; a failure nobody reported gets a RUN_ERROR."""
        events = []
        if to == st.FAILED:
            self.metadata["failureReason"] = reason
            if not self._reported_error:
                events.append((self.next_seq, agui.run_error(reason)))
                self.next_seq += 1
        if await self._move(to, stamp="completed_at", events=events,
                            then=self.f._replies_writer(self)):
            for seq, event in events:
                self.feed.publish(seq, event)

    def _note_cancel(self, by: str | None) -> None:
        self.metadata.setdefault("funduq", {})["cancelRequestedBy"] = by

    def _note_text(self, event: dict[str, Any]) -> None:
        """Collect the assistant's text so the thread's history has replies."""
        kind, mid = event["type"], event.get("messageId")
        if mid is None:
            return
        if kind == "TEXT_MESSAGE_START":
            self._texts[mid] = {"id": mid, "role": event.get("role", "assistant"), "content": ""}
        elif kind in ("TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_CHUNK"):
            msg = self._texts.setdefault(mid, {"id": mid, "role": "assistant", "content": ""})
            msg["content"] += event.get("delta") or ""

    def replies(self) -> list[dict[str, Any]]:
        return list(self._texts.values())
