"""The run status table: the one place funduq's legal status moves are written.

Theory of operation
-------------------
A run's status is an *observation*, never an intention: funduq writes a status
only once it has seen the thing the status names (an offer leaving, an answer
arriving, a stream ending). Every write is guarded: it names the statuses it
may come from, and a run found anywhere else is left untouched (in SQL,
``UPDATE ... WHERE status IN (...)``). The guard is why two parties racing to
settle one run cannot both win.

Everything else about statuses -- which are active, which are terminal, which
still wait in a thread's queue -- is derived from the table below, so adding a
status or a move is a one-line change here and nowhere else.

    queued ──offer leaves──▶ offering ──accepted──▶ running ──cancel──▶ cancelling
      ▲                        │                     │  │                 │  │
      └──declined/unanswered───┘                     │  └─stream ends─────┘  │
      └──pause answered── input-required ◀──interrupt┘   (the funnel)        │
                                                       completed / cancelled / failed
"""

from __future__ import annotations

import enum
from typing import Final


class Status(enum.StrEnum):
    """A run's recorded status. A ``str``: ``Status.QUEUED == "queued"``, and the
    record's text column holds exactly these values."""

    QUEUED = "queued"
    OFFERING = "offering"
    RUNNING = "running"
    CANCELLING = "cancelling"
    INPUT_REQUIRED = "input-required"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


QUEUED: Final = Status.QUEUED
OFFERING: Final = Status.OFFERING
RUNNING: Final = Status.RUNNING
CANCELLING: Final = Status.CANCELLING
INPUT_REQUIRED: Final = Status.INPUT_REQUIRED
COMPLETED: Final = Status.COMPLETED
FAILED: Final = Status.FAILED
CANCELLED: Final = Status.CANCELLED

#: to-status -> the statuses a run may be in for the move to apply.
MOVES: Final[dict[Status, frozenset[Status]]] = {
    OFFERING: frozenset({QUEUED}),
    RUNNING: frozenset({OFFERING}),
    QUEUED: frozenset({OFFERING, INPUT_REQUIRED}),
    CANCELLING: frozenset({RUNNING}),
    INPUT_REQUIRED: frozenset({RUNNING, CANCELLING}),
    COMPLETED: frozenset({RUNNING, CANCELLING}),
    CANCELLED: frozenset({QUEUED, OFFERING, CANCELLING}),
    FAILED: frozenset({QUEUED, OFFERING, RUNNING, CANCELLING}),
}

_MOVES_BY_TEXT: Final[dict[str, frozenset[Status]]] = {to.value: src for to, src in MOVES.items()}

ALL: Final[frozenset[Status]] = frozenset(Status)
#: A terminal status is one nothing moves out of.
TERMINAL: Final = frozenset(s for s in ALL if not any(s in src for src in MOVES.values()))
ACTIVE: Final = ALL - TERMINAL
#: Pending: still in its thread's queue (nobody has accepted it yet).
PENDING: Final = MOVES[OFFERING] | MOVES[RUNNING]
#: Held: a provider has it -- exactly the statuses a run can complete from.
HELD: Final = MOVES[COMPLETED]
#: Runs a restart cannot honestly resume: their provider's link died with us.
ORPHANED_BY_RESTART: Final = frozenset({OFFERING}) | HELD


def sources(to: str) -> frozenset[Status]:
    """The from-statuses a guarded write to ``to`` names (ValueError: ``to``
    is no status)."""
    # A str finds its Status (a StrEnum hashes and compares as its text)
    # without the enum's lookup; what is no status still raises ValueError.
    found = _MOVES_BY_TEXT.get(to)
    return found if found is not None else MOVES[Status(to)]
