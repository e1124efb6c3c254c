"""What a waiting run holds on to: a broker holding ten thousand of them holds
ten thousand of each (bench/scale.py measures the whole)."""

import contextlib
import contextvars
import gc
from collections.abc import Iterator

import trio
from broker_support import (
    AGENT,
    Follower,
    Provider,
    accepted,
    broker,
    offered_runs,
    quiet,
    reply,
    start,
    user_input,
)

from funduq_trio.broker.funduq import Funduq
from funduq_trio.broker.inbox import Inbox
from funduq_trio.broker.lanes import Feed, Lane, ThreadLanes

#: What a run is made of in the broker's memory. Matched by exact type: an
#: isinstance() over every live object asks each for its __class__, and some
#: libraries' lazy proxies import on that (openai's numpy proxy raises).
RUN_PARTS = frozenset({Lane, Feed, ThreadLanes, Inbox})

#: Stands in for quart's request context variable, which holds the whole request.
CALLER = contextvars.ContextVar("caller")


def all_tasks() -> list[trio.lowlevel.Task]:
    found, todo = [], [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        found.append(task)
        for nursery in task.child_nurseries:
            todo.extend(nursery.child_tasks)
    return found


async def test_a_waiting_run_does_not_keep_its_callers_context(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=0).attach()

        async def caller(text: str) -> None:
            CALLER.set(f"the request of {text}")
            await funduq.start_run(p.key, AGENT, user_input(text))

        # The first run starts its thread's task; the second joins that thread.
        await caller("first")
        await quiet()
        first = next(iter(funduq.lanes.values()))
        CALLER.set("the request of second")
        await funduq.start_run(p.key, AGENT, user_input("second"), thread_id=first.thread_id)
        CALLER.set(None)
        await quiet()
        assert len(funduq.lanes) == 2
        assert all(lane.status == "queued" for lane in funduq.lanes.values())
        held = [t.name for t in all_tasks() if t.context.get(CALLER, None) is not None]
        assert held == []


async def test_nothing_of_a_run_is_kept_once_it_ends(tmp_path, mock_clock):
    """Settled, cancelled or followed: once its runs end, no lane, feed,
    inbox or thread of them is left in memory. (Only what this test made
    counts: what earlier tests left for the collector is not this one's.)"""
    gc.collect()
    before = {id(o) for o in gc.get_objects() if type(o) in RUN_PARTS}
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        async with trio.open_nursery() as nursery:
            done = await accepted(funduq, p, text="followed to its end")
            follower = Follower(funduq, done.run_id)
            nursery.start_soon(follower.run)
            waiting = await start(funduq, p, text="waits for a place, then is cancelled")
            waiting_follower = Follower(funduq, waiting.run_id)
            nursery.start_soon(waiting_follower.run)
            await quiet()
            await funduq.cancel_run(waiting.run_id)
            p.stream(done.run_id, *reply(done.run_id, done.thread_id, deltas=3))
            await quiet()
        assert follower.ended.is_set() and waiting_follower.ended.is_set()
        await quiet()
        assert funduq.lanes == {} and funduq.threads == {}
        gc.collect()
        kept = [
            type(o).__name__
            for o in gc.get_objects()
            if type(o) in RUN_PARTS and id(o) not in before
        ]
        assert kept == []


@contextlib.contextmanager
def deposed_as_laned(funduq: Funduq) -> Iterator[list[Lane]]:
    """Depose each run's thread the moment its lane is made: the door lanes
    the run as its insert is queued (_insert_laned), so the thread is
    deposed before the lane's task ran. Yields the lanes so made."""
    start_lane = funduq._start_lane
    laned: list[Lane] = []

    def start_then_depose(row, **kw):
        lane = start_lane(row, **kw)
        funduq.threads.pop(lane.thread_id).depose()
        laned.append(lane)
        return lane

    funduq._start_lane = start_then_depose  # type: ignore[method-assign]
    try:
        yield laned
    finally:
        funduq._start_lane = start_lane  # type: ignore[method-assign]


async def test_a_thread_deposed_before_its_lane_began_ends_the_lane_before_any_offer(
    tmp_path, mock_clock
):
    """A thread's lanes run in cancel scopes that ``depose`` cancels. A
    thread deposed before its task entered its scope still ends its lanes
    at their first checkpoint: no offer leaves, and nothing
    of the lane is left. (What it queued before that checkpoint, its
    `offering` move, a shared record fences.)"""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        with deposed_as_laned(funduq) as laned:
            ticket = await funduq.start_run(p.key, AGENT, user_input("deposed at once"))
        (lane,) = laned
        thread = lane.thread
        await quiet()
        assert p.link.offers == []
        assert ticket.run_id not in funduq.lanes
        assert thread.lanes == 0 and lane.feed.closed


async def test_a_threads_first_lane_runs_on_the_threads_task_and_ends_with_it(tmp_path, mock_clock):
    """A thread's first lane runs on the thread's own task, in a cancel
    scope: a conversation's run costs one task, not two. It is still one of
    the thread's lanes like any other: a run queued behind it gets a task of
    its own beside it, and deposing the thread ends both (no lane, an ended
    feed, no task of the thread left)."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        first = await accepted(funduq, p, text="on the thread's task")
        tid = first.thread_id
        names = [t.name for t in all_tasks()]
        assert names.count(f"thread {tid}") == 1
        assert not [n for n in names if n.endswith("Lane.run")]
        behind = await start(funduq, p, thread_id=tid, text="queued behind it")
        assert [n for n in (t.name for t in all_tasks()) if n.endswith("Lane.run")] == [
            "funduq_trio.broker.lanes.Lane.run"
        ]
        lanes = [funduq.lanes[first.run_id], funduq.lanes[behind.run_id]]
        funduq.threads.pop(tid).depose()
        await quiet()
        assert first.run_id not in funduq.lanes and behind.run_id not in funduq.lanes
        assert all(lane.feed.closed for lane in lanes)
        assert not [t for t in all_tasks() if t.name == f"thread {tid}" or "Lane.run" in t.name]


async def test_a_run_laned_beside_a_deposed_thread_ends_before_any_offer(tmp_path, mock_clock):
    """A run laned while another of its thread goes runs beside it, on a task
    of its own, in a cancel scope of its own that ``depose`` cancels too --
    also when the thread is deposed before that task ran: no offer leaves
    for it, though the provider has room and the run is its thread's head."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=2).attach()
        first = await accepted(funduq, p, text="held")
        tid = first.thread_id
        with deposed_as_laned(funduq) as laned:
            behind = await funduq.start_run(
                p.key, AGENT, user_input("laned, then deposed at once"), thread_id=tid
            )
        (lane,) = laned
        await quiet()
        assert behind.run_id not in offered_runs(p.link)
        assert funduq.lanes == {} and lane.feed.closed and lane.thread.lanes == 0
        assert not [t for t in all_tasks() if t.name == f"thread {tid}" or "Lane.run" in t.name]


async def test_a_thread_keeps_no_scope_of_a_lane_that_ended_beside_its_first(tmp_path, mock_clock):
    """Runs that come and go beside a thread's long run leave nothing behind
    while the thread goes on: a conversation with a run held for hours and
    many short ones beside it does not grow (each ended lane's cancel scope
    is let go of)."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        first = await accepted(funduq, p, text="held all along")
        await quiet()
        gc.collect()
        before = sum(1 for o in gc.get_objects() if type(o) is trio.CancelScope)
        for n in range(20):
            behind = await start(funduq, p, thread_id=first.thread_id, text=f"beside {n}")
            await quiet()
            await funduq.cancel_run(behind.run_id)
            await quiet()
        assert list(funduq.lanes) == [first.run_id]
        gc.collect()
        after = sum(1 for o in gc.get_objects() if type(o) is trio.CancelScope)
        assert after <= before
