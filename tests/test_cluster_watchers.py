"""The registry of followers of runs laned on other nodes (broker/watchers.py),
as logic: no database, no clock. The cluster's own test
(test_cluster_events.py) drives it through two servers on PostgreSQL."""

from __future__ import annotations

import trio
import trio.testing

from funduq_trio.broker.postgres import CHANNEL, channel_for
from funduq_trio.broker.watchers import RunWatchers


async def test_news_of_a_run_wakes_its_watchers_and_no_others() -> None:
    watchers = RunWatchers()
    woken: list[str] = []

    async def waiter(run_id: str, name: str, ready: trio.Event) -> None:
        with watchers.watch(run_id) as watch:
            ready.set()
            await watch.wait()
            woken.append(name)

    async with trio.open_nursery() as nursery:
        for run_id, name in (("run_1", "a"), ("run_1", "b"), ("run_2", "c")):
            ready = trio.Event()
            nursery.start_soon(waiter, run_id, name, ready)
            await ready.wait()
        assert (watchers.watching("run_1"), watchers.watching("run_2")) == (2, 1)
        watchers.wake("run_1")
        watchers.wake("run_9")  # nobody waits for it: nothing happens
        await trio.testing.wait_all_tasks_blocked()
        assert sorted(woken) == ["a", "b"]
        assert watchers.wakes == 1
        watchers.wake("run_2")
    assert sorted(woken) == ["a", "b", "c"]
    assert len(watchers) == 0  # a watch leaves with its block


async def test_news_that_lands_between_the_read_and_the_wait_is_kept() -> None:
    """Registered before reading: a wake-up during the read makes the next
    wait return at once, and only that one."""
    watchers = RunWatchers()
    with watchers.watch("run_1") as watch:
        watchers.wake("run_1")  # while the follower reads the record
        assert watch.woken
        with trio.fail_after(1):  # returns at once: a safety net, not a clock
            await watch.wait()
        assert not watch.woken  # consumed: the next wait waits for new news
        with trio.move_on_after(0) as scope:
            await watch.wait()
        assert scope.cancelled_caught


async def test_catching_up_wakes_every_watcher() -> None:
    """The LISTEN connection came back: whatever it missed is in the record,
    so every follower reads again."""
    watchers = RunWatchers()
    with watchers.watch("run_1") as one, watchers.watch("run_2") as two:
        watchers.wake_all()
        assert one.woken and two.woken
        assert watchers.catch_ups == 1
    assert len(watchers) == 0


def test_each_schema_has_its_own_channel() -> None:
    assert channel_for("public") == channel_for(None) == CHANNEL
    assert channel_for("tenant_a") == f"{CHANNEL}.tenant_a"
    assert channel_for("tenant_a") != channel_for("tenant_b")
    assert len(channel_for("x" * 100)) == 63  # PostgreSQL's identifier length
