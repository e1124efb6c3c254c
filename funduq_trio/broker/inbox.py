"""What can be said to a run: the messages its lane's memory channel carries.

The lane is the only reader. Everyone else -- the provider link, the doors,
the thread queue, the provider registry -- only sends it what happened, and
the lane applies those facts one at a time, in channel order.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import trio


@dataclass(slots=True)
class Turn:
    """You are now the head of your thread's pending queue."""


@dataclass(slots=True)
class Wake:
    """Something changed for your agent: a place freed, a provider attached,
    (re)published or left. Look again. ``baton``: you were woken for a freed
    place, and must pass it on if you do not use it."""

    baton: bool = False


@dataclass(slots=True)
class Cancel:
    """A caller asked to stop the run. ``seen`` is set once the lane read it;
    ``refused`` too when the run had ended before the lane got to it.
    ``record`` is the run as the lane left it right after applying the cancel
    (None when the lane lacks the whole record): the caller's answer, which a
    finish read a moment later must not overtake."""

    by: str | None = None
    seen: trio.Event = field(default_factory=trio.Event)
    refused: bool = False
    record: dict[str, Any] | None = None

    def refuse(self) -> None:
        self.refused = True
        self.seen.set()

    def applied(self, record: dict[str, Any] | None) -> None:
        self.record = copy.deepcopy(record)
        self.seen.set()


@dataclass(slots=True)
class Report:
    """An event the provider holding the run reported (not yet validated)."""

    event: Any


@dataclass(slots=True)
class Finish:
    """The provider says the run's stream ended."""


@dataclass(slots=True)
class Gone:
    """The provider holding the run stopped serving (link closed or withdrawn)."""


Message = Turn | Wake | Cancel | Report | Finish | Gone
