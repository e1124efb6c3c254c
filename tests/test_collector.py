"""The collector's idle passes (funduq_trio/collector.py): a pass is made only
once nothing is runnable, and only the generation CPython's counts say is due.

Unit tests of the task's logic on trio's scheduler: the process's collector
is set for each test and put back after it."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest
import trio

from funduq_trio import collector


@pytest.fixture
def passes() -> Iterator[list[int]]:
    """The generations of the passes made during the test, with the automatic
    ones out of reach (a line no test crosses)."""
    seen: list[int] = []

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            seen.append(info["generation"])

    thresholds = gc.get_threshold()
    gc.collect()
    gc.set_threshold(10**8, thresholds[1], thresholds[2])
    gc.callbacks.append(on_gc)
    try:
        yield seen
    finally:
        gc.callbacks.remove(on_gc)
        gc.set_threshold(*thresholds)


async def test_an_idle_pass_waits_until_nothing_is_runnable(autojump_clock, passes):
    async with trio.open_nursery() as nursery:
        nursery.start_soon(partial(collector.pass_when_idle, line=1_000, period=0.1))
        made = [[] for _ in range(5_000)]  # the count is over the line
        await trio.sleep(0.1)  # the period is over: the task looks at the count
        for _ in range(200):  # a task is runnable in every scheduler round
            await trio.lowlevel.checkpoint()
        assert passes == []
        await trio.sleep(0.05)  # nothing is runnable
        assert passes == [0]
        assert gc.get_count()[0] < 1_000
        del made
        await trio.sleep(1)  # under the line: no more passes
        assert passes == [0]
        nursery.cancel_scope.cancel()


async def test_no_idle_pass_while_the_collector_is_disabled(autojump_clock, passes):
    gc.disable()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(collector.pass_when_idle, line=1_000, period=0.1))
            made = [[] for _ in range(5_000)]
            await trio.sleep(1)
            assert passes == []
            del made
            nursery.cancel_scope.cancel()
    finally:
        gc.enable()


def test_the_pass_due_is_the_oldest_generation_over_its_count(passes):
    young, middle, full = gc.get_threshold()
    assert collector.due_generation() == 0
    for _ in range(middle + 1):
        gc.collect(0)  # each young pass counts one toward the middle generation
    assert collector.due_generation() == 1
    for _ in range(full + 1):
        gc.collect(1)  # each middle pass counts one toward the full one
    assert collector.due_generation() == 2
    for _ in range(middle + 1):
        gc.collect(0)
    assert collector.due_generation() == 2  # both are due: the full pass covers both
    gc.collect(2)
    assert collector.due_generation() == 0
