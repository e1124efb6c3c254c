"""A run's life as an I/O-free state machine.

Theory of operation
-------------------
This module is to a run what ``protocol/link.py`` is to the provider link
(and h11 to HTTP/1.1): it never touches the record, a socket, a clock or
trio. The run's lane (``lanes.py``) is its shell: it reads what happened to
the run from its inbox, the provider registry and its clocks, hands each fact
to ``RunMachine.handle(input)``, and carries out the actions it gets back, in
order. The table below, ``TABLE``, is the one place that says what happens to
a run; an input the table has no row for raises ``RunProtocolError`` (h11's
``LocalProtocolError``): a shell that feeds one has a bug, and the shell's
answer to a bug is the ``FAULT`` input (the run fails alone, reason
``funduq_error``; see below).

Phases (what the machine knows; the recorded status in brackets):

    WAITING   [queued]          in its thread's queue, no offer out
    RESERVED  [offering]        a provider's place is spent and the offering
                                write made; the offer has NOT left yet
    OFFERED   [offering]        the offer left; its answer is awaited
    HELD      [running]         a provider accepted it and is streaming
    STOPPING  [cancelling]      the provider was asked to stop
    PAUSED    [input-required]  the stream ended with an interrupt
    SETTLED   [completed / cancelled / failed]

Besides the phase the machine keeps the facts its table reads: ``head`` (the
run heads its thread's queue), ``declined`` (its last offer was declined and
nothing changed since), ``deferred_cancels`` (cancels that arrived while the
offer was out), ``cancel_requested``, ``reported_error`` and the stream's
``outcome``.

The table (``TABLE``; `-` = no move; "settle X" writes the terminal status X
with the reason, a RUN_ERROR when failed and the provider reported none, and
ends the lane):

  WAITING   TURN                   -         (head = True)
  WAITING   WAKE                   -         (declined = False)
  WAITING   PLACE_FOUND          RESERVED    move offering
  WAITING   CANCEL               SETTLED     note the cancel, settle cancelled, answer it
  WAITING   ARRIVED_UNSERVED     SETTLED     settle failed agent_offline (before the door answers)
  WAITING   UNSERVED_WINDOW_OVER SETTLED     settle failed no_provider_took_it
  WAITING   REPORT/FINISH/LINK_GONE  -       nothing (a run nobody holds)
  WAITING   FAULT                SETTLED     settle failed funduq_error
  RESERVED  OFFER_READY          OFFERED     send the offer
  RESERVED  CANCEL               SETTLED     give the place back, settle cancelled, answer it
  RESERVED  FAULT                SETTLED     give the place back, settle failed funduq_error
  OFFERED   OFFER_NOT_ENCODABLE  SETTLED     give the place back, settle failed offer_not_encodable
  OFFERED   ACCEPTED             HELD        move running, leave the thread's queue
  OFFERED   DECLINED             WAITING     move queued, give the place back quietly,
                                             count misdeclared (declined = True)
  OFFERED   REFUSED              SETTLED     give the place back, settle failed <provider's reason>
  OFFERED   UNANSWERED           WAITING     withdraw, move queued, give the place back,
                                             count unanswered
  OFFERED   LINK_GONE            WAITING     move queued, give the place back
  OFFERED   CANCEL               -           deferred: read again after the answer
  OFFERED   FAULT                SETTLED     withdraw, give the place back,
                                             settle failed funduq_error
  HELD      REPORT               -           relay (persist, then publish)
  HELD      MALFORMED            SETTLED     relay the valid ones, ask to stop, give the place
                                             back, settle failed <malformed>
  HELD      FINISH               (funnel)    give the place back, then FUNNEL below
  HELD      CANCEL               STOPPING    note the cancel, move cancelling, ask to stop,
                                             answer it
  HELD      LINK_GONE            SETTLED     give the place back, settle failed
                                             provider_left_holding_it, count abandoned
  HELD      UNDELIVERED_WINDOW_OVER  -       count undelivered (once; the run is left alone)
  HELD      FAULT                SETTLED     ask to stop, give the place back,
                                             settle failed funduq_error
  STOPPING  (as HELD, except)    CANCEL      answer it (already stopping)
  PAUSED    PAUSE_ANSWERED       WAITING     move queued
  PAUSED/SETTLED  CANCEL         -           answer it: refused (nothing to stop)
  PAUSED/SETTLED  FAULT          -           nothing (the run is already recorded as it ended)
  any active RESTARTED: OFFERED/HELD/STOPPING settle failed orphaned_by_restart; WAITING stays.

A cancel deferred in OFFERED is replayed once the answer's row has run, in
the phase it led to: accepted -> HELD then STOPPING (asked to stop), declined
or unanswered -> WAITING then SETTLED cancelled, refused -> SETTLED (the
cancel is refused: the run ended first). Never both an acceptance and a
cancelled run.

FUNNEL (how a stream that ended settles; first match wins):

  RUN_FINISHED outcome interrupt                     -> PAUSED   move input-required
  RUN_FINISHED outcome cancelled, a cancel was asked -> SETTLED  cancelled
  any RUN_FINISHED                                   -> SETTLED  completed
  no RUN_FINISHED, a cancel was asked                -> SETTLED  cancelled
  no RUN_FINISHED                                    -> SETTLED  failed (stream ended
                                                                 without finishing)

Every status a row writes is a legal move of ``statuses.MOVES`` (a test
checks each row), so the record's guard can only refuse a write the machine
made when someone else moved the run behind the lane's back: the shell treats
that as a fault.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Final

from ..protocol import reasons
from ..protocol.statuses import Status

__all__ = [
    "FUNNEL",
    "TABLE",
    "Action",
    "AnswerCancel",
    "AskToStop",
    "Count",
    "Input",
    "LeaveQueue",
    "Move",
    "NoteCancel",
    "Phase",
    "Relay",
    "ReleasePlace",
    "RunMachine",
    "RunProtocolError",
    "SendOffer",
    "Settle",
    "Verdict",
    "Withdraw",
]


class RunProtocolError(Exception):
    """An input the table has no row for, in the machine's phase."""


class Verdict(enum.StrEnum):
    """A provider's answer to an offer (the link's ``ok.verdict``)."""

    ACCEPTED = "accepted"
    DECLINED = "declined"
    REFUSED = "refused"


class Phase(enum.Enum):
    # Members are singletons compared by identity: hash them so too (Enum's
    # own __hash__ is a Python call, and every input looks a phase up).
    __hash__ = object.__hash__

    WAITING = "waiting"
    RESERVED = "reserved"
    OFFERED = "offered"
    HELD = "held"
    STOPPING = "stopping"
    PAUSED = "paused"
    SETTLED = "settled"


#: The recorded status each phase stands for (SETTLED: whichever it settled as).
STATUS_OF: Final[dict[Phase, Status | None]] = {
    Phase.WAITING: Status.QUEUED,
    Phase.RESERVED: Status.OFFERING,
    Phase.OFFERED: Status.OFFERING,
    Phase.HELD: Status.RUNNING,
    Phase.STOPPING: Status.CANCELLING,
    Phase.PAUSED: Status.INPUT_REQUIRED,
    Phase.SETTLED: None,
}

#: The phase a run recorded with a status is in when its lane (re)starts.
PHASE_OF: Final[dict[Status, Phase]] = {
    Status.QUEUED: Phase.WAITING,
    Status.OFFERING: Phase.OFFERED,
    Status.RUNNING: Phase.HELD,
    Status.CANCELLING: Phase.STOPPING,
    Status.INPUT_REQUIRED: Phase.PAUSED,
    Status.COMPLETED: Phase.SETTLED,
    Status.FAILED: Phase.SETTLED,
    Status.CANCELLED: Phase.SETTLED,
}


class Input(enum.Enum):
    __hash__ = object.__hash__  # as Phase's

    TURN = "turn"  # the run heads its thread's queue
    WAKE = "wake"  # something changed for its agent: look again
    PLACE_FOUND = "place found"  # the shell spent a serving provider's place
    OFFER_READY = "offer ready"  # the offering write is made, no cancel came
    OFFER_NOT_ENCODABLE = "offer not encodable"
    ACCEPTED = "accepted"
    DECLINED = "declined"
    REFUSED = "refused"
    UNANSWERED = "unanswered"  # the delivery timeout passed
    CANCEL = "cancel"
    REPORT = "report"  # a burst of valid events
    MALFORMED = "malformed"  # a burst ending in an invalid event
    FINISH = "finish"
    LINK_GONE = "link gone"
    ARRIVED_UNSERVED = "arrived unserved"  # nobody serves its agent as it arrives
    UNSERVED_WINDOW_OVER = "unserved window over"
    UNDELIVERED_WINDOW_OVER = "undelivered window over"
    PAUSE_ANSWERED = "pause answered"
    RESTARTED = "restarted"
    FAULT = "fault"


# --- actions ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Move:
    """Guarded write of a non-terminal status. ``soon``: queue it without
    waiting (the record's writer is first-in first-out); the shell must still
    learn the record's verdict before it writes anything else."""

    to: Status
    stamp: str | None = None
    soon: bool = False


@dataclass(frozen=True, slots=True)
class Settle:
    """Guarded write of a terminal status (with the reason, and a RUN_ERROR
    when ``error_event``); the lane ends after it."""

    to: Status
    reason: str | None = None
    error_event: bool = False


@dataclass(frozen=True, slots=True)
class Pause:
    """Move input-required (the stream ended with an interrupt); the lane ends."""


@dataclass(frozen=True, slots=True)
class SendOffer:
    pass


@dataclass(frozen=True, slots=True)
class Withdraw:
    """Stop waiting for the offer's answer (a late one is ignored)."""


@dataclass(frozen=True, slots=True)
class ReleasePlace:
    """Give the provider's place back (the offer's, or the held run's).
    ``wake=False``: quietly -- the provider just said it is full."""

    wake: bool = True


@dataclass(frozen=True, slots=True)
class Relay:
    """Persist the burst of reported events, then publish it to followers."""


@dataclass(frozen=True, slots=True)
class AskToStop:
    pass


@dataclass(frozen=True, slots=True)
class Count:
    counter: str  # a record.COUNTERS column


@dataclass(frozen=True, slots=True)
class NoteCancel:
    """Record who asked to stop (metadata), before the write that follows."""


@dataclass(frozen=True, slots=True)
class AnswerCancel:
    """Answer the oldest unanswered cancel: applied, or refused (the run
    ended or paused before the cancel could reach it)."""

    applied: bool


@dataclass(frozen=True, slots=True)
class LeaveQueue:
    """The run left its thread's pending queue: the next one may go."""


Action = (
    Move
    | Settle
    | Pause
    | SendOffer
    | Withdraw
    | ReleasePlace
    | Relay
    | AskToStop
    | Count
    | NoteCancel
    | AnswerCancel
    | LeaveQueue
)

#: Placeholders a row fills from the input or the machine's facts.
FROM_INPUT: Final = "<the input's reason>"
_FUNNEL: Final = "<the funnel>"


@dataclass(frozen=True, slots=True)
class Row:
    next: Phase | None  # None: stays; FUNNEL rows name their next phase in FUNNEL
    actions: tuple[Action, ...] = ()
    funnel: bool = False
    #: Derived once, when the table is built (``handle`` reads them per input):
    #: the status the row's actions leave the run in (None: unchanged), and
    #: whether an action needs the input's facts filled in (a Settle).
    status: Status | None = field(init=False, compare=False, repr=False)
    fills: bool = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "status", _status_after(self.actions))
        object.__setattr__(self, "fills", any(isinstance(a, Settle) for a in self.actions))


def _status_after(actions: tuple[Action, ...] | list[Action]) -> Status | None:
    """The status a run is in once ``actions`` are carried out (None: as it was)."""
    status = None
    for action in actions:
        if isinstance(action, (Move, Settle)):
            status = action.to
        elif isinstance(action, Pause):
            status = Status.INPUT_REQUIRED
    return status


def _settle(reason: str | None, to: Status = Status.FAILED) -> Settle:
    return Settle(to, reason, error_event=to is Status.FAILED)


_S = Phase
_I = Input
_STAY = Row(None)
_REFUSE_CANCEL = Row(None, (AnswerCancel(applied=False),))
_HELD_ROWS: dict[Input, Row] = {
    _I.REPORT: Row(None, (Relay(),)),
    _I.MALFORMED: Row(_S.SETTLED, (Relay(), AskToStop(), ReleasePlace(), _settle(FROM_INPUT))),
    _I.FINISH: Row(None, (ReleasePlace(),), funnel=True),
    _I.LINK_GONE: Row(
        _S.SETTLED, (ReleasePlace(), _settle(reasons.PROVIDER_LEFT_HOLDING_IT), Count("abandoned"))
    ),
    _I.UNDELIVERED_WINDOW_OVER: Row(None, (Count("undelivered"),)),
    _I.FAULT: Row(_S.SETTLED, (AskToStop(), ReleasePlace(), _settle(reasons.FUNDUQ_ERROR))),
    _I.RESTARTED: Row(_S.SETTLED, (_settle(reasons.ORPHANED_BY_RESTART),)),
    _I.TURN: _STAY,
    _I.WAKE: _STAY,
}

#: (phase, input) -> what happens. Nothing else decides a run's fate.
TABLE: Final[dict[tuple[Phase, Input], Row]] = {
    (_S.WAITING, _I.TURN): _STAY,
    (_S.WAITING, _I.WAKE): _STAY,
    (_S.WAITING, _I.PLACE_FOUND): Row(_S.RESERVED, (Move(Status.OFFERING),)),
    (_S.WAITING, _I.CANCEL): Row(
        _S.SETTLED, (NoteCancel(), _settle(None, Status.CANCELLED), AnswerCancel(applied=True))
    ),
    (_S.WAITING, _I.ARRIVED_UNSERVED): Row(_S.SETTLED, (_settle(reasons.AGENT_OFFLINE),)),
    (_S.WAITING, _I.UNSERVED_WINDOW_OVER): Row(_S.SETTLED, (_settle(reasons.NO_PROVIDER_TOOK_IT),)),
    (_S.WAITING, _I.REPORT): _STAY,
    (_S.WAITING, _I.FINISH): _STAY,
    (_S.WAITING, _I.LINK_GONE): _STAY,
    (_S.WAITING, _I.FAULT): Row(_S.SETTLED, (_settle(reasons.FUNDUQ_ERROR),)),
    (_S.WAITING, _I.RESTARTED): _STAY,
    (_S.RESERVED, _I.TURN): _STAY,
    (_S.RESERVED, _I.WAKE): _STAY,
    (_S.RESERVED, _I.OFFER_READY): Row(_S.OFFERED, (SendOffer(),)),
    (_S.RESERVED, _I.CANCEL): Row(
        _S.SETTLED,
        (ReleasePlace(), NoteCancel(), _settle(None, Status.CANCELLED), AnswerCancel(applied=True)),
    ),
    (_S.RESERVED, _I.FAULT): Row(_S.SETTLED, (ReleasePlace(), _settle(reasons.FUNDUQ_ERROR))),
    (_S.OFFERED, _I.TURN): _STAY,
    (_S.OFFERED, _I.WAKE): _STAY,
    (_S.OFFERED, _I.OFFER_NOT_ENCODABLE): Row(
        _S.SETTLED, (Withdraw(), ReleasePlace(), _settle(reasons.OFFER_NOT_ENCODABLE))
    ),
    (_S.OFFERED, _I.ACCEPTED): Row(
        _S.HELD, (Move(Status.RUNNING, "started_at", soon=True), LeaveQueue())
    ),
    (_S.OFFERED, _I.DECLINED): Row(
        _S.WAITING, (Move(Status.QUEUED), ReleasePlace(wake=False), Count("misdeclared"))
    ),
    (_S.OFFERED, _I.REFUSED): Row(_S.SETTLED, (ReleasePlace(), _settle(FROM_INPUT))),
    (_S.OFFERED, _I.UNANSWERED): Row(
        _S.WAITING, (Withdraw(), Move(Status.QUEUED), ReleasePlace(), Count("unanswered"))
    ),
    (_S.OFFERED, _I.LINK_GONE): Row(_S.WAITING, (Move(Status.QUEUED), ReleasePlace())),
    (_S.OFFERED, _I.CANCEL): _STAY,  # deferred: see RunMachine.handle
    (_S.OFFERED, _I.FAULT): Row(
        _S.SETTLED, (Withdraw(), ReleasePlace(), _settle(reasons.FUNDUQ_ERROR))
    ),
    (_S.OFFERED, _I.RESTARTED): Row(_S.SETTLED, (_settle(reasons.ORPHANED_BY_RESTART),)),
    **{(_S.HELD, i): row for i, row in _HELD_ROWS.items()},
    (_S.HELD, _I.CANCEL): Row(
        _S.STOPPING,
        (NoteCancel(), Move(Status.CANCELLING), AskToStop(), AnswerCancel(applied=True)),
    ),
    **{(_S.STOPPING, i): row for i, row in _HELD_ROWS.items()},
    (_S.STOPPING, _I.CANCEL): Row(None, (AnswerCancel(applied=True),)),
    (_S.PAUSED, _I.PAUSE_ANSWERED): Row(_S.WAITING, (Move(Status.QUEUED),)),
    (_S.PAUSED, _I.CANCEL): _REFUSE_CANCEL,
    (_S.PAUSED, _I.FAULT): _STAY,
    (_S.SETTLED, _I.CANCEL): _REFUSE_CANCEL,
    (_S.SETTLED, _I.FAULT): _STAY,
    (_S.SETTLED, _I.TURN): _STAY,
    (_S.SETTLED, _I.WAKE): _STAY,
}


class Outcome(enum.StrEnum):
    """How the provider's RUN_FINISHED said the run ended (AG-UI 1.0's outcome)."""

    SUCCESS = "success"
    INTERRUPT = "interrupt"
    CANCELLED = "cancelled"


#: (RUN_FINISHED outcome or None when none came, a cancel was asked or None for
#: either) -> (next phase, action). First match wins.
FUNNEL: Final[tuple[tuple[str | None, bool | None, Phase, Action], ...]] = (
    (Outcome.INTERRUPT, None, Phase.PAUSED, Pause()),
    (Outcome.CANCELLED, True, Phase.SETTLED, _settle(None, Status.CANCELLED)),
    ("any", None, Phase.SETTLED, _settle(None, Status.COMPLETED)),
    (None, True, Phase.SETTLED, _settle(None, Status.CANCELLED)),
    (None, None, Phase.SETTLED, _settle(reasons.STREAM_ENDED_WITHOUT_FINISHING)),
)


#: ``TABLE`` by phase, then input: what ``handle`` looks rows up in (derived
#: from the table, never edited: the table above is the one that says).
_ROWS: Final[dict[Phase, dict[Input, Row]]] = {phase: {} for phase in Phase}
for (_phase, _input), _row in TABLE.items():
    _ROWS[_phase][_input] = _row
del _phase, _input, _row

# Enum members read per input, bound once (a class attribute costs a lookup
# through the enum's metaclass each time).
_WAITING, _OFFERED, _PAUSED, _SETTLED = Phase.WAITING, Phase.OFFERED, Phase.PAUSED, Phase.SETTLED
_TURN, _WAKE, _DECLINED, _CANCEL = Input.TURN, Input.WAKE, Input.DECLINED, Input.CANCEL
_REPORT, _MALFORMED = Input.REPORT, Input.MALFORMED


class RunMachine:
    """One run's state. ``handle(input)`` -> the actions to carry out, in order."""

    __slots__ = (
        "phase",
        "status",
        "head",
        "declined",
        "deferred_cancels",
        "cancel_requested",
        "reported_error",
        "outcome",
    )

    def __init__(self, status: Status | str = Status.QUEUED) -> None:
        self.status = status if type(status) is Status else Status(status)
        self.phase = PHASE_OF[self.status]
        self.head = False
        self.declined = False
        self.deferred_cancels = 0
        self.cancel_requested = False
        self.reported_error = False
        #: The RUN_FINISHED's outcome once one was relayed (None: none yet).
        self.outcome: str | None = None

    @property
    def over(self) -> bool:
        """The lane has nothing more to do: the run settled or paused."""
        phase = self.phase
        return phase is _SETTLED or phase is _PAUSED

    @property
    def wants_place(self) -> bool:
        """Queued and heading its thread: it should be offered when it can."""
        return self.phase is _WAITING and self.head

    def handle(
        self,
        what: Input,
        *,
        reason: str | None = None,
        finished: str | None = None,
        errored: bool = False,
    ) -> list[Action]:
        """Apply one input. ``reason``: a refusal's or a malformed event's;
        ``finished`` / ``errored``: what a relayed burst carried (a
        RUN_FINISHED's outcome, a RUN_ERROR)."""
        row = _ROWS[self.phase].get(what)
        if row is None:
            raise RunProtocolError(
                f"{what.value!r} cannot happen to a run in phase {self.phase.value!r}"
            )
        # Facts first: the rows' actions read them.
        if what is _REPORT or what is _MALFORMED:
            self.reported_error = self.reported_error or errored
            if finished is not None:
                self.outcome = finished
        elif what is _TURN:
            self.head = True
        elif what is _WAKE:
            self.declined = False
        elif what is _DECLINED:
            self.declined = True
        elif what is _CANCEL and self.phase is not _SETTLED and self.phase is not _PAUSED:
            self.cancel_requested = True
            if self.phase is _OFFERED:
                self.deferred_cancels += 1
        if row.fills:
            actions = [self._fill(a, reason) for a in row.actions]
        else:
            actions = list(row.actions)
        if row.next is not None:
            self.phase = row.next
            if row.status is not None:
                self.status = row.status
        if row.funnel:
            phase, action = self._funnel()
            actions.append(self._fill(action, reason))
            self.phase = phase
            self.status = _status_after((action,)) or self.status
        if self.deferred_cancels and self.phase is not _OFFERED:
            # A cancel read while the offer was out is applied now that the
            # answer's row has run, in the phase the answer led to.
            pending, self.deferred_cancels = self.deferred_cancels, 0
            for _ in range(pending):
                actions += self.handle(_CANCEL)
        return actions

    def _fill(self, action: Action, reason: str | None) -> Action:
        if isinstance(action, Settle):
            if action.reason == FROM_INPUT:
                action = Settle(action.to, reason, action.error_event)
            if action.error_event and self.reported_error:
                action = Settle(action.to, action.reason, error_event=False)
        return action

    def _funnel(self) -> tuple[Phase, Action]:
        for outcome, cancel, phase, action in FUNNEL:
            if outcome == "any":
                matches = self.outcome is not None
            else:
                matches = self.outcome == outcome
            if matches and (cancel is None or cancel == self.cancel_requested):
                return phase, action
        raise AssertionError("the funnel's last row matches everything")
