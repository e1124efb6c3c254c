"""Thread leases: which threads this node leads, decided without I/O.

Several ``funduq-trio serve`` processes on one PostgreSQL are one funduq
(DESIGN §11). Each thread's runs are ordered by exactly one node at a time:
the node holding the thread's row in ``thread_leases`` (its node id, and an
expiry on the database's clock). This module is the bookkeeping half of that,
in the manner of the run machine: plain decisions over what the node knows
and what the record answered. The facade (``funduq.py``) performs them --
the renewal task, the claims, the release of an idle thread -- and the store
(``postgres.py``) holds the SQL, including the fence every write of a run
passes.

How a lease moves (docs/cluster.md):

* **taken** with a thread's first run here (in the run's own transaction),
  by answering a pause, or by a claim (at start, and by the renewal task for
  lapsed leases of agents this node serves);
* **renewed** every ``seconds / 3`` in one statement; a thread the renewal
  no longer finds ours was taken over: the node stops acting for it;
* **released** once the thread has no lane left here, so any node may take
  its next run at once.

A release the record did not take (the database was away) leaves a row of
ours that renewal keeps finding: a *stray*. Seen twice in a row, it is
released again. Twice, because a lease taken a moment ago (its run's insert
committed while the renewal was in flight) is not in the snapshot the
renewal was compared with, and must not be mistaken for one.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass, field

#: Renewals per lease period: a lease is renewed with two thirds of it left.
RENEWALS_PER_LEASE = 3


def new_node_id(name: str | None = None) -> str:
    """A node id for this process: its readable name (or ``node``) and 12
    random hex digits. Random per start, so a restarted process never
    mistakes the lease of its earlier life (or a namesake's) for its own."""
    return f"{name or 'node'}_{secrets.token_hex(6)}"


@dataclass
class Renewal:
    """What one renewal decided: threads lost (taken over by another node:
    stop acting for them) and stray rows of ours to release again."""

    lost: set[str]
    strays: set[str]


@dataclass
class Leases:
    """The threads this node leads, as far as it knows."""

    node: str
    seconds: float
    #: Threads whose lease is ours (the write that took it committed).
    held: set[str] = field(default_factory=set)
    #: Rows of ours the last renewal found that we do not hold.
    _strays: set[str] = field(default_factory=set)

    @property
    def renew_every(self) -> float:
        return self.seconds / RENEWALS_PER_LEASE

    def leads(self, thread_id: str) -> bool:
        return thread_id in self.held

    def taken(self, thread_ids: Iterable[str]) -> None:
        """The record says these leases are ours now."""
        self.held.update(thread_ids)

    def release(self, thread_id: str, *, busy: bool) -> bool:
        """Whether to release the thread's lease now: held here, and no lane
        or request of the thread still at work here (``busy``). When so it is
        no longer held from this moment (the row's delete follows)."""
        if busy or thread_id not in self.held:
            return False
        self.held.discard(thread_id)
        return True

    def lost(self, thread_id: str) -> bool:
        """A write for the thread was fenced off: the lease is another node's.
        True when this node believed it held it."""
        if thread_id in self.held:
            self.held.discard(thread_id)
            return True
        return False

    def snapshot(self) -> frozenset[str]:
        """What we hold as a renewal leaves (compare its answer with this)."""
        return frozenset(self.held)

    def renewed(self, snapshot: frozenset[str], still_ours: Iterable[str]) -> Renewal:
        """A renewal taken with ``snapshot`` found ``still_ours`` (the rows of
        this node it extended). A thread held then and now that it did not
        find was taken over; a row it found that we hold neither then nor now
        is a stray (see the module docstring)."""
        found = set(still_ours)
        lost = {t for t in snapshot if t in self.held and t not in found}
        self.held -= lost
        unheld = {t for t in found if t not in self.held and t not in snapshot}
        strays = unheld & self._strays
        self._strays = unheld - strays
        return Renewal(lost, strays)
