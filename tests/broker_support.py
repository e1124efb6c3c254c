"""Helpers for the broker's own tests: a Funduq on a real SQLite file and an
in-process provider link that records what the broker asked of it.

The in-process link is a fake of the WebSocket shell only; the record, the
lanes and the registry under test are the real ones. Capabilities that cross
the network are proven again in the tests that drive the real server.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import stores
import trio
import trio.testing

from funduq_trio.broker.funduq import Funduq
from funduq_trio.config import Settings
from funduq_trio.identity import Identity

AGENT = "echo"


@dataclass
class FakeLink:
    """Records offers and cancels the broker sends; lets a test answer them."""

    offers: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    closed: str | None = None
    offered: trio.Event = field(default_factory=trio.Event)

    def send_offer(self, offer_id: str, run: dict[str, Any]) -> None:
        self.offers.append((offer_id, run))
        self.offered.set()
        self.offered = trio.Event()

    def send_cancel(self, run_id: str) -> None:
        self.cancels.append(run_id)

    def close(self, reason: str) -> None:
        self.closed = reason

    async def next_offer(self, after: int) -> tuple[str, dict[str, Any]]:
        """Wait until more than ``after`` offers were made; return offer #after."""
        while len(self.offers) <= after:
            await self.offered.wait()
        return self.offers[after]


class Provider:
    """A provider attached through the broker's port, with a fake link."""

    def __init__(
        self, funduq: Funduq, identity: Identity | None = None, max_concurrent: int | None = None
    ) -> None:
        self.funduq = funduq
        self.identity = identity or Identity.generate()
        self.max_concurrent = max_concurrent
        self.link = FakeLink()
        self.session = None

    @property
    def key(self) -> str:
        return self.identity.public_key_hex

    async def attach(self, *agents: str) -> Provider:
        self.link = FakeLink()
        self.session = self.funduq.attach_provider(self.key, self.max_concurrent, self.link)
        await self.session.register(
            [
                {"name": a, "description": f"{a} agent", "card": {}, "metadata": {}}
                for a in (agents or (AGENT,))
            ]
        )
        return self

    async def offer(self, n: int) -> tuple[str, dict[str, Any]]:
        return await self.link.next_offer(n)

    def stream(self, run_id: str, *events: dict[str, Any], finish: bool = True) -> None:
        for event in events:
            assert self.session.report(run_id, event)
        if finish:
            assert self.session.finish(run_id)


def user_input(text: str = "hello", message_id: str = "m1") -> dict[str, Any]:
    return {
        "threadId": "caller-thread",
        "runId": "caller-run",
        "messages": [{"id": message_id, "role": "user", "content": text}],
    }


def reply(run_id: str, thread_id: str, text: str = "hi", deltas: int = 1) -> list[dict[str, Any]]:
    events = [
        {"type": "RUN_STARTED", "threadId": thread_id, "runId": run_id},
        {"type": "TEXT_MESSAGE_START", "messageId": "r-" + run_id, "role": "assistant"},
    ]
    events += [
        {"type": "TEXT_MESSAGE_CONTENT", "messageId": "r-" + run_id, "delta": text}
        for _ in range(deltas)
    ]
    events += [
        {"type": "TEXT_MESSAGE_END", "messageId": "r-" + run_id},
        {"type": "RUN_FINISHED", "threadId": thread_id, "runId": run_id},
    ]
    return events


@contextlib.asynccontextmanager
async def broker(tmp_path: Path, **overrides: Any) -> AsyncIterator[Funduq]:
    overrides.setdefault("database_url", stores.database_url)  # this test's store
    settings = Settings(data_dir=tmp_path, **overrides)
    async with Funduq(settings) as funduq:
        yield funduq


async def settled(funduq: Funduq, run_id: str) -> dict[str, Any]:
    return await funduq.wait_run(run_id)


# -- deterministic stepping under MockClock -------------------------------------------
#
# The record runs its database calls off the trio thread (SQLite when another
# process holds the write lock, every PostgreSQL commit and read), so "every
# task is blocked" is not yet "nothing more will happen": a task may be waiting
# on a worker thread. `quiet()` waits until every task is blocked AND no worker
# thread is out (each holds a token of trio's default thread limiter). With
# `mock_clock` (no autojump) time then stands still, so what a test reads after
# `quiet()` is what the broker does with no more time passing -- and a broker
# that never gets there fails the test instead of hanging it.
#
# While a thread is out, `quiet()` sleeps until it is back instead of polling
# `wait_all_tasks_blocked()`: polling spins the trio thread, which holds the GIL
# the worker thread needs after each of its C calls, so the spin slows the very
# commit it waits for (200 PostgreSQL round trips: 4 ms blocked, 7-11 ms
# spinning, on an idle host; worse the busier it is), and its own steps drown
# the broker's in the busy-loop count. Sleeping, nothing of ours
# runs: the steps counted are the broker's alone, and a broker that keeps going
# back to a worker thread without time passing still runs out of budget. The
# clock is held meanwhile by a task parked in `wait_all_tasks_blocked()`, which
# an autojumping MockClock treats as busy (trio.testing.MockClock's docs) -- the
# thread's work is not a reason for virtual time to pass.


class _Steps(trio.abc.Instrument):
    """Counts task steps, and cancels ``scope`` once there were too many: the
    broker was busy for that long without time passing (a busy loop). Sets
    ``threads_back`` (when there is one) after the step that returned the
    last worker thread's token."""

    def __init__(self, scope: trio.CancelScope, budget: int, limiter: trio.CapacityLimiter) -> None:
        self.scope, self.budget, self.limiter, self.count = scope, budget, limiter, 0
        self.token = trio.lowlevel.current_trio_token()
        self.threads_back: trio.Event | None = None

    def before_task_step(self, task: Any) -> None:
        self.count += 1
        if self.count == self.budget:
            self.token.run_sync_soon(self.scope.cancel)

    def after_task_step(self, task: Any) -> None:
        # Instruments may not wake tasks themselves: the set is queued.
        if self.threads_back is not None and self.limiter.borrowed_tokens == 0:
            self.token.run_sync_soon(self.threads_back.set)
            self.threads_back = None

    async def until_threads_are_back(self, stuck_after: float) -> None:
        back = self.threads_back = trio.Event()
        stuck = False
        async with trio.open_nursery() as nursery:

            async def hold_the_clock() -> None:
                # Parked in wait_all_tasks_blocked, this task keeps an
                # autojumping clock where it is; it wakes only after
                # ``stuck_after`` real seconds with nothing at all happening.
                nonlocal stuck
                await trio.testing.wait_all_tasks_blocked(stuck_after)
                stuck = True
                nursery.cancel_scope.cancel()

            nursery.start_soon(hold_the_clock)
            await back.wait()
            nursery.cancel_scope.cancel()
        if stuck:
            raise ThreadStuck(
                f"a worker thread was out for {stuck_after:.0f} s with nothing else "
                "happening (a database call that never returns: a lock wait?)"
            )


class BusyLoop(AssertionError):
    pass


class ThreadStuck(AssertionError):
    pass


#: Real seconds a worker thread may stay out while nothing else happens, before
#: quiet() gives up on it: far beyond one database call on a loaded host.
STUCK_SECONDS = 60.0


async def quiet(budget: int = 5_000, stuck_after: float = STUCK_SECONDS) -> None:
    """Let the broker do everything it can do without time passing. A broker
    still busy after ``budget`` task steps is spinning: the test fails (the
    broker tests' busiest settle takes under 100). So does a worker thread
    out for ``stuck_after`` real seconds with nothing else happening."""
    limiter = trio.to_thread.current_default_thread_limiter()
    with trio.CancelScope() as scope:
        steps = _Steps(scope, budget, limiter)
        trio.lowlevel.add_instrument(steps)
        try:
            calm = 0
            while calm < 2:
                await trio.testing.wait_all_tasks_blocked()
                if limiter.borrowed_tokens:
                    calm = 0
                    await steps.until_threads_are_back(stuck_after)
                else:
                    calm += 1
        finally:
            trio.lowlevel.remove_instrument(steps)
    if scope.cancelled_caught:
        raise BusyLoop(
            f"the broker never went quiet: {steps.count} task steps without time passing"
        )


async def advance(clock: Any, seconds: float) -> None:
    """Settle, move trio's (mock) clock forward, settle again."""
    await quiet()
    clock.jump(seconds)
    await quiet()


async def status_of(funduq: Funduq, run_id: str) -> str:
    await quiet()
    run = await funduq.get_run(run_id)
    assert run is not None, run_id
    return run["status"]


async def record_of(funduq: Funduq, run_id: str) -> dict[str, Any]:
    await quiet()
    run = await funduq.get_run(run_id)
    assert run is not None, run_id
    return run


def events_of(run: dict[str, Any]) -> list[dict[str, Any]]:
    return [e["event"] for e in run["events"]]


def offered_runs(link: FakeLink) -> list[str]:
    """The run ids of the offers a link received, in order."""
    return [run["runId"] for _, run in link.offers]


def offer_ids_for(link: FakeLink, run_id: str) -> list[str]:
    return [oid for oid, run in link.offers if run["runId"] == run_id]


def last_offer_for(link: FakeLink, run_id: str) -> str:
    ids = offer_ids_for(link, run_id)
    assert ids, f"{run_id} was never offered"
    return ids[-1]


async def online(funduq: Funduq, agent: str = AGENT) -> bool:
    return next(a["online"] for a in await funduq.roster() if a["name"] == agent)


def interrupt_finish(
    run_id: str, thread_id: str, interrupts: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "type": "RUN_FINISHED",
        "threadId": thread_id,
        "runId": run_id,
        "outcome": {"type": "interrupt", "interrupts": interrupts},
    }


def resume_input(
    interrupt_id: str, payload: Any = True, text: str | None = None, message_id: str = "answer-1"
) -> dict[str, Any]:
    messages = [] if text is None else [{"id": message_id, "role": "user", "content": text}]
    return {
        "threadId": "caller-thread",
        "runId": "caller-run",
        "messages": messages,
        "resume": [{"interruptId": interrupt_id, "status": "resolved", "payload": payload}],
    }


class Follower:
    """Consumes ``funduq.follow`` in the background; ``items`` grows as it yields,
    ``ended`` is set when the generator returns. Each item is checked against the
    record as it is yielded (persisted before relayed)."""

    def __init__(self, funduq: Funduq, run_id: str, after_seq: int = 0) -> None:
        self.funduq, self.run_id, self.after_seq = funduq, run_id, after_seq
        self.items: list[tuple[int, dict[str, Any]]] = []
        self.bursts: list[list[int]] = []  # the seqs of each burst follow yielded
        self.not_yet_durable: list[int] = []
        self.ended = trio.Event()

    async def run(self) -> None:
        async with contextlib.aclosing(self.funduq.follow(self.run_id, self.after_seq)) as gen:
            async for burst in gen:
                assert burst, "follow yielded an empty burst"
                self.bursts.append([seq for seq, _ in burst])
                self.items += burst
                run = await self.funduq.get_run(self.run_id)
                durable = {e["seq"] for e in run["events"]}
                self.not_yet_durable += [seq for seq, _ in burst if seq not in durable]
        self.ended.set()


async def start(
    funduq: Funduq,
    p: Provider,
    *,
    thread_id: str | None = None,
    text: str = "hello",
    agent: str = AGENT,
) -> Any:
    """Start a run and let the broker do what it does with it (offer or not)."""
    ticket = await funduq.start_run(p.key, agent, user_input(text), thread_id=thread_id)
    await quiet()
    return ticket


async def accepted(
    funduq: Funduq, p: Provider, *, thread_id: str | None = None, text: str = "hello"
) -> Any:
    """Start a run, accept its offer, and let the broker claim it."""
    ticket = await start(funduq, p, thread_id=thread_id, text=text)
    p.session.answer(last_offer_for(p.link, ticket.run_id), "accepted")
    await quiet()
    return ticket


@dataclass
class FollowedRun:
    """A held run whose first report is durable and relayed, and its follower."""

    provider: Provider
    ticket: Any
    events: list[dict[str, Any]]
    follower: Follower


@contextlib.asynccontextmanager
async def a_followed_run(funduq: Funduq, deltas: int = 3) -> AsyncIterator[FollowedRun]:
    """Accept a run, follow it, and stream its first report (which rides
    behind the `running` move); the follower's task ends with the block."""
    p = await Provider(funduq).attach()
    a = await accepted(funduq, p)
    events = reply(a.run_id, a.thread_id, deltas=deltas)
    async with trio.open_nursery() as nursery:
        follower = Follower(funduq, a.run_id)
        nursery.start_soon(follower.run)
        p.stream(a.run_id, events[0], finish=False)
        await quiet()
        yield FollowedRun(p, a, events, follower)


async def relayed_and_recorded(funduq: Funduq, run: FollowedRun) -> None:
    """Every event relayed once durable, in order, and the run recorded
    `completed` with exactly those events."""
    assert run.follower.not_yet_durable == []
    assert [e for _, e in run.follower.items] == run.events
    recorded = await record_of(funduq, run.ticket.run_id)
    assert recorded["status"] == "completed"
    assert events_of(recorded) == run.events
