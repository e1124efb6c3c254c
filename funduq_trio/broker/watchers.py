"""Who waits for news of a run laned on another node (docs/cluster.md).

On a shared record (PostgreSQL, several nodes) a run's lane may be on another
node. A follower here reads the record by seq and, when it has read
everything, waits on a ``Watch`` of the run. The record's listener
(``Store.listen``) wakes the run's watches for each notification of a change
to it, and wakes every watch whenever its connection is made again: a
notification lost while it was down is then caught up from the record. A
wake-up only ever means "read again"; what is read is the record.

A watch is registered *before* the follower reads, and a wake-up that comes
while it reads is kept until its next wait: nothing slips between the read
and the wait.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import trio


class Watch:
    """One waiter's view of a run: woken (and staying woken until it next
    waits) by any news of it."""

    __slots__ = ("_woken",)

    def __init__(self) -> None:
        self._woken = trio.Event()

    def wake(self) -> None:
        self._woken.set()

    @property
    def woken(self) -> bool:
        return self._woken.is_set()

    async def wait(self) -> None:
        """Until woken since the last wait (at once if it was meanwhile)."""
        await self._woken.wait()
        self._woken = trio.Event()


class RunWatchers:
    """Run id -> the watches of the followers and waiters reading it from
    the record. Only runs somebody waits for are held."""

    __slots__ = ("_watches", "wakes", "catch_ups")

    def __init__(self) -> None:
        self._watches: dict[str, list[Watch]] = {}
        self.wakes = 0  # notifications that found a watcher (for metrics and tests)
        self.catch_ups = 0  # times every watcher was woken to read again

    def __len__(self) -> int:
        return len(self._watches)

    def watching(self, run_id: str) -> int:
        return len(self._watches.get(run_id, ()))

    @contextlib.contextmanager
    def watch(self, run_id: str) -> Iterator[Watch]:
        """A watch of ``run_id`` for the block's length. Enter it before
        reading the record, so news that lands during the read wakes it."""
        watch = Watch()
        self._watches.setdefault(run_id, []).append(watch)
        try:
            yield watch
        finally:
            watches = self._watches.get(run_id)
            if watches is not None:
                watches.remove(watch)
                if not watches:
                    del self._watches[run_id]

    def wake(self, run_id: str) -> None:
        """News of ``run_id`` (a notification, or a lane starting here)."""
        watches = self._watches.get(run_id)
        if watches:
            self.wakes += 1
            for watch in watches:
                watch.wake()

    def wake_all(self) -> None:
        """Everyone reads again: the news channel was (re)established and
        may have missed something meanwhile."""
        self.catch_ups += 1
        for watches in self._watches.values():
            for watch in watches:
                watch.wake()
