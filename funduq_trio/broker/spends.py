"""Spent proofs, on every node (DESIGN §8, §11).

A proof funduq accepts (a cancel, a resolution, a presenter, a read or
listing proof, a KYOK call's signature) works once. Each process keeps the
proofs it accepted in memory (`authority.SpentProofs`): the first check,
local and capped. When the record is shared by several nodes (PostgreSQL,
`Store.shared`), that is not enough -- a proof spent on node A could be
replayed on node B -- so what a check spent is then also written to the
record (`Store.spend_proof`, the `spent_proofs` table, unique on signer and
payload), and a proof some node spent before is refused exactly as any bad
proof (`NotAuthorized`). On SQLite (one process) nothing more happens: no
I/O, no await.

A proof is kept in the record until its timestamp is a window past stale
(`timestamp + 2 * window`): no node whose clock is within a window of this
one's can take it as fresh any more, so clocks may differ by up to a window
(60 s) without opening a replay.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from .authority import NOT_AUTHORIZED, NotedSpends, Spender, SpentProofs
from .errors import NotAuthorized, RecordUnavailable
from .store import Store, record_trouble

__all__ = ["Spends"]

T = TypeVar("T")


class Spends:
    """Where a check spends the proofs it accepts: `local` always, and the
    record too once `share(record)` named a shared one."""

    def __init__(self, local: SpentProofs) -> None:
        self.local = local
        self.record: Store | None = None

    def share(self, record: Store) -> None:
        """Spend in `record` as well when several nodes share it."""
        self.record = record if getattr(record, "shared", False) else None

    def __len__(self) -> int:
        return len(self.local)

    async def check(self, check: Callable[[Spender], T]) -> T:
        """Run `check` (an authority check taking where to spend) and return
        what it returns. Where the record is shared, each proof it spent is
        then spent in the record: NotAuthorized when another node (or this
        one, before a restart) spent it first; RecordUnavailable when the
        record cannot take the write (the proof stays spent here)."""
        if self.record is None:
            return check(self.local)
        noted = NotedSpends(self.local)
        result = check(noted)
        now = time.time()
        for key, payload, timestamp in noted.noted:
            try:
                fresh = await self.record.spend_proof(
                    key, payload, timestamp + 2 * self.local.window, now
                )
            except Exception as exc:
                if not record_trouble(exc):
                    raise
                raise RecordUnavailable(
                    "the record cannot take the proof's spending right now; retry later"
                ) from None
            if not fresh:
                raise NotAuthorized(NOT_AUTHORIZED)
        return result
