"""The run machine alone: no trio, no record, no socket. Each table here is
written from the spec (DESIGN §2/§3/§12, docs/offers.md, docs/cancels.md), not
copied from ``run_machine.TABLE``, so a row that drifts fails a test."""

from __future__ import annotations

import itertools

import pytest

from funduq_trio.broker import run_machine as rm
from funduq_trio.broker.run_machine import (
    TABLE,
    AnswerCancel,
    AskToStop,
    Count,
    Input,
    LeaveQueue,
    Move,
    NoteCancel,
    Pause,
    Phase,
    Relay,
    ReleasePlace,
    RunMachine,
    RunProtocolError,
    SendOffer,
    Settle,
    Withdraw,
)
from funduq_trio.protocol import reasons
from funduq_trio.protocol import statuses as st
from funduq_trio.protocol.statuses import Status

FAILED, CANCELLED, COMPLETED = Status.FAILED, Status.CANCELLED, Status.COMPLETED


def failed(reason: str | None) -> Settle:
    return Settle(FAILED, reason, error_event=True)


def machine_in(phase: Phase) -> RunMachine:
    """A machine driven to ``phase`` the way a lane drives it."""
    m = RunMachine()
    m.handle(Input.TURN)
    path = {
        Phase.WAITING: [],
        Phase.RESERVED: [Input.PLACE_FOUND],
        Phase.OFFERED: [Input.PLACE_FOUND, Input.OFFER_READY],
        Phase.HELD: [Input.PLACE_FOUND, Input.OFFER_READY, Input.ACCEPTED],
        Phase.STOPPING: [Input.PLACE_FOUND, Input.OFFER_READY, Input.ACCEPTED, Input.CANCEL],
        Phase.SETTLED: [Input.CANCEL],
    }
    if phase is Phase.PAUSED:
        return RunMachine(Status.INPUT_REQUIRED)
    for what in path[phase]:
        m.handle(what)
    assert m.phase is phase
    return m


# -- every row: (phase, input, facts) -> (next phase, actions) --------------------------

ROWS = [
    (Phase.WAITING, Input.TURN, {}, Phase.WAITING, []),
    (Phase.WAITING, Input.WAKE, {}, Phase.WAITING, []),
    (Phase.WAITING, Input.PLACE_FOUND, {}, Phase.RESERVED, [Move(Status.OFFERING)]),
    (
        Phase.WAITING,
        Input.CANCEL,
        {},
        Phase.SETTLED,
        [NoteCancel(), Settle(CANCELLED), AnswerCancel(applied=True)],
    ),
    (Phase.WAITING, Input.ARRIVED_UNSERVED, {}, Phase.SETTLED, [failed(reasons.AGENT_OFFLINE)]),
    (
        Phase.WAITING,
        Input.UNSERVED_WINDOW_OVER,
        {},
        Phase.SETTLED,
        [failed(reasons.NO_PROVIDER_TOOK_IT)],
    ),
    (Phase.WAITING, Input.REPORT, {}, Phase.WAITING, []),
    (Phase.WAITING, Input.FINISH, {}, Phase.WAITING, []),
    (Phase.WAITING, Input.LINK_GONE, {}, Phase.WAITING, []),
    (Phase.WAITING, Input.RESTARTED, {}, Phase.WAITING, []),
    (Phase.WAITING, Input.FAULT, {}, Phase.SETTLED, [failed(reasons.FUNDUQ_ERROR)]),
    (Phase.RESERVED, Input.OFFER_READY, {}, Phase.OFFERED, [SendOffer()]),
    (
        Phase.RESERVED,
        Input.CANCEL,
        {},
        Phase.SETTLED,
        [ReleasePlace(), NoteCancel(), Settle(CANCELLED), AnswerCancel(applied=True)],
    ),
    (
        Phase.RESERVED,
        Input.FAULT,
        {},
        Phase.SETTLED,
        [ReleasePlace(), failed(reasons.FUNDUQ_ERROR)],
    ),
    (
        Phase.OFFERED,
        Input.ACCEPTED,
        {},
        Phase.HELD,
        [Move(Status.RUNNING, "started_at", soon=True), LeaveQueue()],
    ),
    (
        Phase.OFFERED,
        Input.DECLINED,
        {},
        Phase.WAITING,
        [Move(Status.QUEUED), ReleasePlace(wake=False), Count("misdeclared")],
    ),
    (
        Phase.OFFERED,
        Input.REFUSED,
        {"reason": "not today"},
        Phase.SETTLED,
        [ReleasePlace(), failed("not today")],
    ),
    (
        Phase.OFFERED,
        Input.UNANSWERED,
        {},
        Phase.WAITING,
        [Withdraw(), Move(Status.QUEUED), ReleasePlace(), Count("unanswered")],
    ),
    (Phase.OFFERED, Input.LINK_GONE, {}, Phase.WAITING, [Move(Status.QUEUED), ReleasePlace()]),
    (
        Phase.OFFERED,
        Input.OFFER_NOT_ENCODABLE,
        {},
        Phase.SETTLED,
        [Withdraw(), ReleasePlace(), failed(reasons.OFFER_NOT_ENCODABLE)],
    ),
    (Phase.OFFERED, Input.CANCEL, {}, Phase.OFFERED, []),
    (
        Phase.OFFERED,
        Input.FAULT,
        {},
        Phase.SETTLED,
        [Withdraw(), ReleasePlace(), failed(reasons.FUNDUQ_ERROR)],
    ),
    (Phase.OFFERED, Input.RESTARTED, {}, Phase.SETTLED, [failed(reasons.ORPHANED_BY_RESTART)]),
    (Phase.HELD, Input.REPORT, {}, Phase.HELD, [Relay()]),
    (
        Phase.HELD,
        Input.MALFORMED,
        {"reason": "bad"},
        Phase.SETTLED,
        [Relay(), AskToStop(), ReleasePlace(), failed("bad")],
    ),
    (
        Phase.HELD,
        Input.CANCEL,
        {},
        Phase.STOPPING,
        [NoteCancel(), Move(Status.CANCELLING), AskToStop(), AnswerCancel(applied=True)],
    ),
    (
        Phase.HELD,
        Input.LINK_GONE,
        {},
        Phase.SETTLED,
        [ReleasePlace(), failed(reasons.PROVIDER_LEFT_HOLDING_IT), Count("abandoned")],
    ),
    (Phase.HELD, Input.UNDELIVERED_WINDOW_OVER, {}, Phase.HELD, [Count("undelivered")]),
    (
        Phase.HELD,
        Input.FAULT,
        {},
        Phase.SETTLED,
        [AskToStop(), ReleasePlace(), failed(reasons.FUNDUQ_ERROR)],
    ),
    (Phase.HELD, Input.RESTARTED, {}, Phase.SETTLED, [failed(reasons.ORPHANED_BY_RESTART)]),
    (
        Phase.HELD,
        Input.FINISH,
        {},
        Phase.SETTLED,
        [ReleasePlace(), failed(reasons.STREAM_ENDED_WITHOUT_FINISHING)],
    ),
    (Phase.STOPPING, Input.CANCEL, {}, Phase.STOPPING, [AnswerCancel(applied=True)]),
    (Phase.STOPPING, Input.REPORT, {}, Phase.STOPPING, [Relay()]),
    (
        Phase.STOPPING,
        Input.MALFORMED,
        {"reason": "bad"},
        Phase.SETTLED,
        [Relay(), AskToStop(), ReleasePlace(), failed("bad")],
    ),
    (Phase.STOPPING, Input.UNDELIVERED_WINDOW_OVER, {}, Phase.STOPPING, [Count("undelivered")]),
    (Phase.STOPPING, Input.RESTARTED, {}, Phase.SETTLED, [failed(reasons.ORPHANED_BY_RESTART)]),
    (
        Phase.STOPPING,
        Input.LINK_GONE,
        {},
        Phase.SETTLED,
        [ReleasePlace(), failed(reasons.PROVIDER_LEFT_HOLDING_IT), Count("abandoned")],
    ),
    (Phase.STOPPING, Input.FINISH, {}, Phase.SETTLED, [ReleasePlace(), Settle(CANCELLED)]),
    (
        Phase.STOPPING,
        Input.FAULT,
        {},
        Phase.SETTLED,
        [AskToStop(), ReleasePlace(), failed(reasons.FUNDUQ_ERROR)],
    ),
    (Phase.PAUSED, Input.PAUSE_ANSWERED, {}, Phase.WAITING, [Move(Status.QUEUED)]),
    (Phase.PAUSED, Input.CANCEL, {}, Phase.PAUSED, [AnswerCancel(applied=False)]),
    (Phase.PAUSED, Input.FAULT, {}, Phase.PAUSED, []),
    (Phase.SETTLED, Input.CANCEL, {}, Phase.SETTLED, [AnswerCancel(applied=False)]),
    (Phase.SETTLED, Input.FAULT, {}, Phase.SETTLED, []),
]


@pytest.mark.parametrize(
    ("phase", "what", "facts", "after", "actions"),
    ROWS,
    ids=[f"{r[0].value}-{r[1].value}" for r in ROWS],
)
def test_row(phase, what, facts, after, actions):
    m = machine_in(phase)
    assert m.handle(what, **facts) == actions
    assert m.phase is after


def test_every_row_of_the_table_is_specified_here():
    specified = {(phase, what) for phase, what, *_ in ROWS}
    loose = {(p, i) for (p, i), row in TABLE.items() if row.actions or row.next is not None}
    assert loose - specified == set()


@pytest.mark.parametrize(
    ("phase", "what"), [(p, i) for p, i in itertools.product(Phase, Input) if (p, i) not in TABLE]
)
def test_an_input_with_no_row_raises(phase, what):
    m = machine_in(phase)
    with pytest.raises(RunProtocolError):
        m.handle(what)
    assert m.phase is phase  # and changed nothing


@pytest.mark.parametrize(("phase", "what"), sorted(TABLE, key=lambda k: (k[0].value, k[1].value)))
def test_every_status_a_row_writes_is_a_legal_move(phase, what):
    """The record's guard could refuse nothing the machine writes."""
    m = machine_in(phase)
    status = m.status
    for action in m.handle(what, reason="r"):
        to = (
            action.to
            if isinstance(action, (Move, Settle))
            else Status.INPUT_REQUIRED
            if isinstance(action, Pause)
            else None
        )
        if to is not None:
            assert status in st.MOVES[to], (status, to)
            status = to
    assert m.status == status


# -- the funnel --------------------------------------------------------------------------

FUNNEL_CASES = [
    # (RUN_FINISHED outcome or None, a cancel was asked, the action)
    ("interrupt", False, Pause()),
    ("interrupt", True, Pause()),
    ("cancelled", True, Settle(CANCELLED)),
    ("cancelled", False, Settle(COMPLETED)),
    ("success", False, Settle(COMPLETED)),
    ("success", True, Settle(COMPLETED)),
    (None, True, Settle(CANCELLED)),
    (None, False, failed(reasons.STREAM_ENDED_WITHOUT_FINISHING)),
]


@pytest.mark.parametrize(("outcome", "cancel", "action"), FUNNEL_CASES)
def test_the_funnel(outcome, cancel, action):
    m = machine_in(Phase.HELD)
    if cancel:
        m.handle(Input.CANCEL)
    m.handle(Input.REPORT, finished=outcome)
    assert m.handle(Input.FINISH) == [ReleasePlace(), action]
    assert m.phase is (Phase.PAUSED if isinstance(action, Pause) else Phase.SETTLED)
    assert m.over


def test_a_reported_run_error_is_not_synthesized_again():
    m = machine_in(Phase.HELD)
    m.handle(Input.REPORT, errored=True)
    assert m.handle(Input.FAULT)[-1] == Settle(FAILED, reasons.FUNDUQ_ERROR, error_event=False)


# -- offer x cancel x answer -------------------------------------------------------------

ANSWERS = {
    "accepted": Input.ACCEPTED,
    "declined": Input.DECLINED,
    "refused": Input.REFUSED,
    "unanswered": Input.UNANSWERED,
    "link gone": Input.LINK_GONE,
}
#: With no cancel: (phase after the answer, recorded status).
NO_CANCEL = {
    "accepted": (Phase.HELD, Status.RUNNING),
    "declined": (Phase.WAITING, Status.QUEUED),
    "refused": (Phase.SETTLED, FAILED),
    "unanswered": (Phase.WAITING, Status.QUEUED),
    "link gone": (Phase.WAITING, Status.QUEUED),
}
#: A cancel read while the offer was out, applied after the answer:
#: (phase, status, the cancel's answer, provider asked to stop).
CANCEL_WHILE_OFFERED = {
    "accepted": (Phase.STOPPING, Status.CANCELLING, True, True),
    "declined": (Phase.SETTLED, CANCELLED, True, False),
    "refused": (Phase.SETTLED, FAILED, False, False),
    "unanswered": (Phase.SETTLED, CANCELLED, True, False),
    "link gone": (Phase.SETTLED, CANCELLED, True, False),
}


def offered(cancel_at: str | None) -> tuple[RunMachine, list[rm.Action]]:
    m = RunMachine()
    actions = m.handle(Input.TURN)
    for step in (Input.PLACE_FOUND, Input.OFFER_READY):
        if (
            cancel_at == "waiting"
            and step is Input.PLACE_FOUND
            or cancel_at == "reserved"
            and step is Input.OFFER_READY
        ):
            actions += m.handle(Input.CANCEL)
            return m, actions
        actions += m.handle(step)
    if cancel_at == "offered":
        actions += m.handle(Input.CANCEL)
    return m, actions


@pytest.mark.parametrize("answer", ANSWERS)
@pytest.mark.parametrize("cancel_at", [None, "waiting", "reserved", "offered"])
def test_offer_cancel_answer(cancel_at, answer):
    m, actions = offered(cancel_at)
    if cancel_at in ("waiting", "reserved"):
        # Nothing left (or nothing will): cancelled at once, and no answer can come.
        assert m.phase is Phase.SETTLED and m.status is CANCELLED
        assert SendOffer() not in actions
        assert actions[-1] == AnswerCancel(applied=True)
        assert (ReleasePlace() in actions) is (cancel_at == "reserved")
        with pytest.raises(RunProtocolError):
            m.handle(ANSWERS[answer])
        return
    actions = m.handle(ANSWERS[answer], reason="busy")
    if cancel_at is None:
        assert (m.phase, m.status) == NO_CANCEL[answer]
        assert not any(isinstance(a, AnswerCancel) for a in actions)
        return
    phase, status, applied, stopped = CANCEL_WHILE_OFFERED[answer]
    assert (m.phase, m.status) == (phase, status)
    assert [a for a in actions if isinstance(a, AnswerCancel)] == [AnswerCancel(applied)]
    assert (AskToStop() in actions) is stopped
    # Never both: a run the provider holds is not also cancelled in the record.
    assert not (status is CANCELLED and m.phase is Phase.HELD)


def test_a_decline_makes_the_run_wait_for_a_wake():
    m = machine_in(Phase.OFFERED)
    m.handle(Input.DECLINED)
    assert m.declined and m.wants_place
    m.handle(Input.WAKE)
    assert not m.declined


def test_status_is_a_str_enum_the_record_text_stays():
    assert Status.QUEUED == "queued" and st.INPUT_REQUIRED == "input-required"
    assert Status("input-required") is Status.INPUT_REQUIRED
    assert rm.Verdict.ACCEPTED == "accepted"
