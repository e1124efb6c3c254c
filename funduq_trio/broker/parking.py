"""A task parked in a plain list until someone reschedules it: what
`trio.Event.wait` does, without an Event per wait. A feed's followers and
closers (broker/lanes.py) and a batch's commit waiters (broker/store.py)
wait so."""

from __future__ import annotations

import trio
from trio.lowlevel import Abort, RaiseCancelT


async def park(waiters: list[trio.lowlevel.Task]) -> None:
    """Wait in ``waiters`` until rescheduled (as ``Event.wait`` would:
    cancellable while it waits, a cancel takes the task out of the list)."""
    task = trio.lowlevel.current_task()
    waiters.append(task)

    def abort(_: RaiseCancelT) -> Abort:
        waiters.remove(task)
        return Abort.SUCCEEDED

    await trio.lowlevel.wait_task_rescheduled(abort)
