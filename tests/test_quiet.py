"""broker_support.quiet(), which every MockClock broker test leans on: it
waits out a worker thread (a PostgreSQL commit) without spinning and without
letting an autojumping clock move, and it still fails a broker that spins --
on the trio thread or through worker threads -- or a thread that never
returns."""

from __future__ import annotations

import threading
import time

import pytest
import trio
from broker_support import BusyLoop, ThreadStuck, quiet


async def test_a_slow_worker_thread_is_waited_for_without_spinning_or_moving_the_clock(
    autojump_clock,
):
    woke: list[float] = []
    done: list[str] = []

    async def sleeper() -> None:
        await trio.sleep(5)  # the next deadline: what an autojump would jump to
        woke.append(trio.current_time())

    async def commit() -> None:
        # A database call slow in real time, as on a loaded host.
        await trio.to_thread.run_sync(time.sleep, 0.3)
        done.append("committed")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sleeper)
        nursery.start_soon(commit)
        start = trio.current_time()
        # A handful of steps is all the thread's round trip takes: waiting for
        # it costs none (a spinning wait took thousands in 0.3 s).
        await quiet(budget=50)
        assert done == ["committed"]
        assert trio.current_time() == start and woke == []
        # Once quiet, the autojump is free again: the sleeper wakes at +5.
        await trio.sleep(10)
        assert woke == [start + 5]


async def spin_on_the_trio_thread() -> None:
    while True:
        await trio.lowlevel.checkpoint()


async def spin_through_worker_threads() -> None:
    """A write that fails and is tried again at once, forever: a worker thread
    is out at nearly every look, and those steps are the broker's to count."""
    while True:
        await trio.to_thread.run_sync(lambda: None)


@pytest.mark.parametrize("spin", [spin_on_the_trio_thread, spin_through_worker_threads])
async def test_a_task_spinning_without_time_passing_is_a_busy_loop(mock_clock, spin):
    async with trio.open_nursery() as nursery:
        nursery.start_soon(spin)
        with pytest.raises(BusyLoop):
            await quiet()
        nursery.cancel_scope.cancel()


async def test_a_worker_thread_that_never_returns_fails_instead_of_hanging(mock_clock):
    release = threading.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(trio.to_thread.run_sync, release.wait)
        try:
            with pytest.raises(ThreadStuck):
                await quiet(stuck_after=0.2)
        finally:
            release.set()
