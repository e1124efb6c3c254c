"""The provider SDK.

Most tests run the SDK against an in-memory funduq side (`FakeFunduq`) under
trio's MockClock, so the timing claims (an answer never waits on an agent,
backoff delays) are checked deterministically. The last tests run the SDK
against the real server over real websockets: a caller's run travels
caller -> funduq -> SDK provider -> back.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing
from ag_ui.core import RunAgentInput, TextMessageContentEvent
from support import http_client, post_sse, running_server, user_input

from funduq_trio.identity import (
    Identity,
    funduq_connect_payload,
    new_nonce,
    provider_connect_payload,
    verify,
)
from funduq_trio.protocol import frames as f
from funduq_trio.protocol.frames import BATCH_BYTES
from funduq_trio.provider import (
    Backoff,
    ConnectRejected,
    FunduqKeyMismatch,
    LinkLost,
    Provider,
    RunContext,
    last_user_text,
    make_echo,
    serialize_per_thread,
)
from funduq_trio.provider.echo import split_text

FUNDUQ = Identity.from_private_hex("d1" * 32)
# Virtual seconds: under the autojump clock a test waiting on something that
# never comes fails here instead of hanging.
STUCK = 1000

# --- an in-memory funduq ------------------------------------------------------


class FakeConnection:
    """The provider's end of an in-memory link."""

    def __init__(self, outgoing: trio.MemorySendChannel, incoming: trio.MemoryReceiveChannel):
        self.outgoing = outgoing
        self.incoming = incoming
        self.gate: trio.Event | None = None  # while unset, the socket is busy
        self.sent: list[str] = []  # every message written, in order

    async def send(self, text: str) -> None:
        if self.gate is not None:
            await self.gate.wait()
        try:
            await self.outgoing.send(text)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise LinkLost("fake link closed") from None
        self.sent.append(text)

    async def receive(self) -> str:
        try:
            return await self.incoming.receive()
        except (trio.EndOfChannel, trio.ClosedResourceError):
            raise LinkLost("fake link closed") from None

    async def aclose(self, reason: str = "") -> None:
        await self.outgoing.aclose()
        await self.incoming.aclose()


class FunduqEnd:
    """funduq's end of one in-memory link: the test plays funduq here."""

    def __init__(self, outgoing: trio.MemorySendChannel, incoming: trio.MemoryReceiveChannel):
        self.outgoing = outgoing
        self.incoming = incoming
        self.provider_key: str | None = None
        self.max_runs: int | None = None
        self.connect: f.Connect | None = None  # the provider's, once handshaken

    async def send(self, frame: Any) -> None:
        await self.outgoing.send(f.encode_frame(frame))

    async def recv(self) -> Any:
        with trio.fail_after(STUCK):
            text = await self.incoming.receive()
        return f.decode_frame(text, accept=f.FROM_PROVIDER)

    async def drop(self) -> None:
        await self.outgoing.aclose()
        await self.incoming.aclose()

    async def handshake(
        self, identity: Identity = FUNDUQ, extensions: list[str] | None = None
    ) -> None:
        nonce = new_nonce()
        await self.send(
            f.Hello(funduq_key=identity.public_key_hex, nonce=nonce, extensions=extensions)
        )
        connect = await self.recv()
        assert isinstance(connect, f.Connect)
        assert verify(
            connect.public_key,
            provider_connect_payload(identity.public_key_hex, nonce, connect.nonce),
            connect.proof,
        )
        self.connect = connect
        self.provider_key = connect.public_key
        self.max_runs = connect.max_concurrent_runs
        answer = identity.sign(funduq_connect_payload(nonce, connect.nonce))
        await self.send(f.ConnectOk(answer=answer))

    async def attach(self, extensions: list[str] | None = None) -> f.Register:
        await self.handshake(extensions=extensions)
        register = await self.recv()
        assert isinstance(register, f.Register)
        await self.send(f.Ok(id=register.id))
        return register

    async def offer(self, offer_id: str, run_id: str, **run: Any) -> None:
        await self.send(offer_frame(offer_id, run_id, **run))

    async def until(self, kind: type, **match: Any) -> Any:
        """The next frame of this kind (and these field values), skipping others."""
        while True:
            frame = await self.recv()
            if isinstance(frame, kind) and all(getattr(frame, k) == v for k, v in match.items()):
                return frame

    async def run_frames(self, run_id: str) -> list[Any]:
        """Reports of this run up to and including its finish (others skipped)."""
        seen: list[Any] = []
        while True:
            frame = await self.recv()
            if isinstance(frame, f.Report) and frame.run_id == run_id:
                seen.append(frame)
            elif isinstance(frame, f.Finish) and frame.run_id == run_id:
                seen.append(frame)
                return seen


def offer_frame(
    offer_id: str,
    run_id: str,
    *,
    thread: str = "t1",
    agent: str = "echo",
    text: str = "hello",
    run_input: dict[str, Any] | None = None,
) -> f.Offer:
    if run_input is None:
        run_input = user_input(text, thread_id=thread) | {"runId": run_id}
    run = {
        "runId": run_id,
        "threadId": thread,
        "agentName": agent,
        "runInput": run_input,
        "metadata": None,
    }
    return f.Offer(id=offer_id, run=f.OfferRun.model_validate(run))


def items_of(frame: Any) -> list[Any]:
    """A message's frames: a batch's items (each must decode), or the frame."""
    if not isinstance(frame, f.Batch):
        return [frame]
    items = list(f.batch_items(frame, accept=f.IN_BATCH))
    assert not any(isinstance(i, f.FrameError) for i in items), items
    return items


class FakeFunduq:
    """Hands each connection the SDK opens to the test as a FunduqEnd."""

    def __init__(self) -> None:
        self._send, self.links = trio.open_memory_channel[FunduqEnd](math.inf)
        self.dials: list[float] = []
        self.connections: list[FakeConnection] = []
        self.refuse = 0  # refuse this many dials (funduq unreachable)

    async def connect(self, nursery: trio.Nursery, url: str) -> FakeConnection:
        self.dials.append(trio.current_time())
        if self.refuse:
            self.refuse -= 1
            raise LinkLost("connection refused (fake)")
        to_funduq, from_provider = trio.open_memory_channel[str](math.inf)
        to_provider, from_funduq = trio.open_memory_channel[str](math.inf)
        self._send.send_nowait(FunduqEnd(to_provider, from_provider))
        self.connections.append(FakeConnection(to_funduq, from_funduq))
        return self.connections[-1]

    async def next_link(self) -> FunduqEnd:
        with trio.fail_after(STUCK):
            return await self.links.receive()


def provider_for(fake: FakeFunduq, **kw: Any) -> Provider:
    kw.setdefault("backoff", Backoff(initial=1.0, factor=2.0, maximum=8.0, jitter=0.0))
    return Provider(Identity.generate(), "ws://fake/ws/provider", connector=fake.connect, **kw)


@asynccontextmanager
async def serving(
    agents: dict[str, Any], *, extensions: list[str] | None = None, **kw: Any
) -> AsyncIterator[tuple[FakeFunduq, Provider, FunduqEnd]]:
    """A provider serving `agents`, running against an in-memory funduq that
    said `extensions` in its hello; yields (fake, provider, its attached link)."""
    fake = FakeFunduq()
    provider = provider_for(fake, **kw)
    for name, agent in agents.items():
        provider.add_agent(agent, name=name)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(provider.run)
        link = await fake.next_link()
        await link.attach(extensions)
        yield fake, provider, link
        nursery.cancel_scope.cancel()


# --- answers are receipts -----------------------------------------------------


async def test_an_agent_that_blocks_forever_does_not_delay_the_next_answer(autojump_clock):
    entered = trio.Event()

    async def stuck(run_input: RunAgentInput) -> AsyncIterator[Any]:
        entered.set()
        await trio.sleep_forever()
        yield  # pragma: no cover

    fake = FakeFunduq()
    provider = provider_for(fake, max_concurrent_runs=2)
    provider.add_agent(stuck, name="stuck")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(provider.run)
        link = await fake.next_link()
        await link.attach()
        assert link.max_runs == 2
        # A virtual-time limit: under autojump it fires only if the SDK waits
        # on something that never comes (the stuck agent).
        with trio.fail_after(1):
            start = trio.current_time()
            await link.offer("o1", "r1", agent="stuck")
            assert await link.until(f.Ok, id="o1") == f.Ok(id="o1", verdict="accepted")
            await entered.wait()
            await link.offer("o2", "r2", agent="stuck", thread="t2")
            assert (await link.until(f.Ok, id="o2")).verdict == "accepted"
            await link.offer("o3", "r3", agent="stuck", thread="t3")
            assert (await link.until(f.Ok, id="o3")).verdict == "declined"  # full
            await link.offer("o4", "r4", agent="nobody")
            ok = await link.until(f.Ok, id="o4")
            assert ok.verdict == "refused" and "'nobody' is not served" in ok.reason
            await link.offer("o5", "r5", agent="stuck", run_input={"threadId": "t1"})
            ok = await link.until(f.Ok, id="o5")
            assert ok.verdict == "refused"
            assert ok.reason.startswith("input does not validate as RunAgentInput: ")
            assert "runId" in ok.reason and "messages" in ok.reason
            assert trio.current_time() == start  # no clock was waited on
        assert provider.held_runs == {"r1", "r2"}
        nursery.cancel_scope.cancel()


async def test_a_verdict_is_written_before_its_agent_starts(autojump_clock):
    """With the writer idle, each accepted run's agent starts only once funduq
    has been sent the verdict, and the verdict leaves alone: it does not wait
    behind the run's first events."""
    verdicts_held: list[bool] = []
    sockets: list[FakeConnection] = []

    async def looks(run_input: RunAgentInput) -> AsyncIterator[Any]:
        offer_id = "o" + run_input.run_id[1:]
        verdict = f.encode_frame(f.Ok(id=offer_id, verdict="accepted"))
        verdicts_held.append(verdict in sockets[0].sent)
        async for event in make_echo(deltas=8)(run_input):
            yield event

    async with serving({"looks": looks}, extensions=["batch"]) as (fake, _, link):
        sockets.append(fake.connections[-1])
        for n in range(10):
            await link.offer(f"o{n}", f"r{n}", agent="looks", thread=f"t{n}")
            messages = await frames_until_finished(link, {f"r{n}"})
            assert messages[0] == [f.Ok(id=f"o{n}", verdict="accepted")]
            assert all(not isinstance(i, f.Ok) for m in messages[1:] for i in m)
    assert verdicts_held == [True] * 10


async def test_with_the_socket_busy_a_verdict_queues_in_order_and_its_run_starts(
    autojump_clock,
):
    """While the writer is stuck on a stalled socket, an offer is still read
    and answered at once: the verdict queues behind the frames already
    waiting, the run's agent starts without waiting for it, and funduq gets
    the verdict before any of the run's frames."""

    async def paced(run_input: RunAgentInput) -> AsyncIterator[Any]:
        async for event in make_echo(deltas=8)(run_input):
            await trio.sleep(1)
            yield event

    async with serving({"paced": paced, "echo": make_echo(deltas=8)}, extensions=["batch"]) as (
        fake,
        provider,
        link,
    ):
        await link.offer("o1", "r1", agent="paced")
        assert await link.recv() == f.Ok(id="o1", verdict="accepted")
        fake.connections[-1].gate = gate = trio.Event()
        await trio.sleep(1.5)  # r1's first event is in the writer, at the stalled socket
        await link.offer("o2", "r2", agent="echo", thread="t2")
        await trio.sleep(0.1)
        assert provider.held_runs == {"r1"}  # r2 ran to its end meanwhile
        gate.set()
        messages = await frames_until_finished(link, {"r1", "r2"})
    items = [i for m in messages for i in m]
    ok = items.index(f.Ok(id="o2", verdict="accepted"))
    r2 = [k for k, i in enumerate(items) if getattr(i, "run_id", None) == "r2"]
    assert len(r2) == 13 and ok < r2[0]
    assert [items[k].seq for k in r2[:-1]] == list(range(1, 13))


async def test_a_run_reports_seq_numbered_events_then_finishes(autojump_clock):
    fake = FakeFunduq()
    provider = provider_for(fake)
    provider.add_agent(make_echo(deltas=8), name="echo")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(provider.run)
        link = await fake.next_link()
        register = await link.attach()
        assert [a.name for a in register.agents] == ["echo"]
        await link.offer("o1", "r1", text="hello, world!")
        frames = await link.run_frames("r1")
        reports, finish = frames[:-1], frames[-1]
        assert finish == f.Finish(run_id="r1")
        assert [r.seq for r in reports] == list(range(1, 13))
        types = [r.event["type"] for r in reports]
        assert types == [
            "RUN_STARTED",
            "TEXT_MESSAGE_START",
            *["TEXT_MESSAGE_CONTENT"] * 8,
            "TEXT_MESSAGE_END",
            "RUN_FINISHED",
        ]
        text = "".join(r.event["delta"] for r in reports if "delta" in r.event)
        assert text == "hello, world!"
        assert reports[0].event == {"type": "RUN_STARTED", "threadId": "t1", "runId": "r1"}
        assert provider.held_runs == frozenset()
        nursery.cancel_scope.cancel()


async def messages_while_the_socket_was_busy(extensions: list[str] | None) -> list[Any]:
    """Offer an 8-delta echo run whose events come a second apart, stall the
    provider's socket once the verdict is out, let the agent finish, free the
    socket: the messages that arrive after the verdict."""

    async def paced(run_input: RunAgentInput) -> AsyncIterator[Any]:
        async for event in make_echo(deltas=8)(run_input):
            await trio.sleep(1)
            yield event

    async with serving({"paced": paced}, extensions=extensions) as (fake, provider, link):
        await link.offer("o1", "r1", agent="paced", text="hello, world!")
        assert await link.recv() == f.Ok(id="o1", verdict="accepted")
        fake.connections[-1].gate = gate = trio.Event()
        await trio.sleep(60)
        assert provider.held_runs == frozenset()  # the run is over, its frames queued
        gate.set()
        messages = [await link.recv()]
        while not isinstance(items_of(messages[-1])[-1], f.Finish):
            messages.append(await link.recv())
    return messages


async def test_frames_queued_while_the_socket_is_busy_go_out_as_one_batch(autojump_clock):
    messages = await messages_while_the_socket_was_busy(["batch"])
    # The first event found the socket free and waits in it alone; everything
    # queued behind it leaves as one batch.
    first, last = messages
    assert isinstance(first, f.Report) and first.seq == 1
    assert isinstance(last, f.Batch)
    items = items_of(last)
    assert [i.seq for i in items[:-1]] == list(range(2, 13))
    assert all(isinstance(i, f.Report) and i.run_id == "r1" for i in items[:-1])
    assert items[-1] == f.Finish(run_id="r1")


async def test_without_the_extension_every_frame_goes_alone(autojump_clock):
    messages = await messages_while_the_socket_was_busy(None)
    assert [type(x) for x in messages] == [*[f.Report] * 12, f.Finish]


async def test_a_batch_stays_under_the_batch_size(autojump_clock):
    big = "x" * 20_000

    async def chatty(run_input: RunAgentInput) -> AsyncIterator[Any]:
        for _ in range(10):
            yield {"type": "CUSTOM", "name": "blob", "value": big}

    async with serving({"chatty": chatty}, extensions=["batch"]) as (fake, _, link):
        fake.connections[-1].gate = gate = trio.Event()
        await link.offer("o1", "r1", agent="chatty")
        await trio.testing.wait_all_tasks_blocked()
        gate.set()
        items: list[Any] = []
        while not items or not isinstance(items[-1], f.Finish):
            with trio.fail_after(STUCK):
                text = await link.incoming.receive()
            assert len(text.encode()) <= BATCH_BYTES
            items += items_of(f.decode_frame(text, accept=f.FROM_PROVIDER))
    assert [x.seq for x in items if isinstance(x, f.Report)] == list(range(1, 11))


async def frames_until_finished(link: FunduqEnd, run_ids: set[str]) -> list[list[Any]]:
    """The frames of each message funduq receives until every run in
    `run_ids` has finished (a lone frame is a message of one)."""
    messages: list[list[Any]] = []
    finished: set[str] = set()
    while finished != run_ids:
        messages.append(items_of(await link.recv()))
        finished |= {i.run_id for i in messages[-1] if isinstance(i, f.Finish)}
    return messages


async def test_events_yielded_back_to_back_leave_in_one_message(autojump_clock):
    async with serving({"echo": make_echo(deltas=8)}, extensions=["batch"]) as (_, _, link):
        await link.offer("o1", "r1", text="hello, world!")
        messages = await frames_until_finished(link, {"r1"})
    run_messages = [m for m in messages if any(isinstance(i, f.Report) for i in m)]
    (only,) = run_messages  # 12 reports and the finish, one message (the ok may ride too)
    frames = [i for i in only if isinstance(i, (f.Report, f.Finish))]
    assert [i.seq for i in frames[:-1]] == list(range(1, 13))
    assert frames[-1] == f.Finish(run_id="r1")


async def test_a_chatty_agent_still_lets_other_runs_through(autojump_clock):
    """Reports queue without yielding, but only REPORTS_PER_YIELD at a time:
    an agent producing thousands of events back to back does not hold the
    provider's other runs until it is done."""

    async def chatty(run_input: RunAgentInput) -> AsyncIterator[Any]:
        for i in range(500):
            yield {"type": "CUSTOM", "name": "n", "value": i}

    agents = {"chatty": chatty, "echo": make_echo(deltas=1)}
    async with serving(agents, extensions=["batch"], report_window=10_000) as (_, _, link):
        await link.offer("o1", "big", agent="chatty")
        await link.offer("o2", "small", text="hi")
        messages = await frames_until_finished(link, {"big", "small"})
    order = [(i.run_id, i.kind) for m in messages for i in m if isinstance(i, (f.Report, f.Finish))]
    assert order.index(("small", "finish")) < order.index(("big", "finish"))
    assert sum(1 for run, kind in order if run == "big" and kind == "report") == 500


async def test_the_sdk_asks_for_batches_and_reads_them_frame_by_frame(autojump_clock):
    fake = FakeFunduq()
    provider = provider_for(fake)
    provider.add_agent(make_echo(deltas=1), name="echo")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(provider.run)
        link = await fake.next_link()
        await link.handshake()
        assert link.connect is not None and link.connect.extensions == ["batch"]
        register = await link.recv()
        await link.outgoing.send(
            f.batch_text(
                [
                    f.encode_frame(f.Ok(id=register.id)),
                    '{"kind": "offer", "id": "bad-offer", "run": {}}',  # answered err, the rest read
                    f.encode_frame(offer_frame("o2", "r2", thread="t2", text="two")),
                ]
            )
        )
        err = await link.until(f.Err)
        assert err.id == "bad-offer" and err.reason.startswith("batch item 1: ")
        ok = await link.until(f.Ok, id="o2")
        assert ok.verdict == "accepted"
        assert (await link.run_frames("r2"))[-1] == f.Finish(run_id="r2")
        # An item without a usable id that does not decode ends the link.
        await link.outgoing.send(f.batch_text(['{"kind": "cancel"}']))
        with trio.fail_after(STUCK):
            await fake.next_link()  # the SDK reconnects
        nursery.cancel_scope.cancel()


async def test_an_agent_that_raises_reports_run_error_then_finishes(autojump_clock):
    async def broken(run_input: RunAgentInput) -> AsyncIterator[Any]:
        yield {"type": "RUN_STARTED", "threadId": run_input.thread_id, "runId": run_input.run_id}
        raise RuntimeError("the model fell over")

    async def not_a_generator(run_input: RunAgentInput) -> list[Any]:
        return []

    fake = FakeFunduq()
    provider = provider_for(fake)
    provider.add_agent(broken, name="broken")
    provider.add_agent(not_a_generator, name="plain")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(provider.run)
        link = await fake.next_link()
        await link.attach()
        await link.offer("o1", "r1", agent="broken")
        started, error, finish = await link.run_frames("r1")
        assert started.seq == 1 and error.seq == 2
        assert error.event == {
            "type": "RUN_ERROR",
            "message": "RuntimeError: the model fell over",
            "code": "agent_error",
        }
        assert finish == f.Finish(run_id="r1")
        await link.offer("o2", "r2", agent="plain")
        error, finish = await link.run_frames("r2")
        assert (
            error.event["type"] == "RUN_ERROR" and "not an async iterator" in error.event["message"]
        )
        nursery.cancel_scope.cancel()


async def test_cancel_reaches_the_agents_task_and_finish_follows(autojump_clock):
    seen: dict[str, Any] = {}

    async def patient(run_input: RunAgentInput, ctx: RunContext) -> AsyncIterator[Any]:
        yield {"type": "RUN_STARTED", "threadId": ctx.thread_id, "runId": ctx.run_id}
        try:
            await trio.sleep_forever()
        except trio.Cancelled:
            seen["cancelled"] = True
            seen["cancel_requested"] = ctx.cancel_requested
            raise
        yield  # pragma: no cover

    fake = FakeFunduq()
    provider = provider_for(fake)
    provider.add_agent(patient, name="patient")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(provider.run)
        link = await fake.next_link()
        await link.attach()
        await link.offer("o1", "r1", agent="patient")
        await link.offer("o2", "r2", agent="patient", thread="t2")
        await link.until(f.Report, run_id="r1")
        await link.send(f.Cancel(run_id="r1"))
        await link.send(f.Cancel(run_id="r-unknown"))  # not held: ignored
        assert await link.until(f.Finish) == f.Finish(run_id="r1")
        assert seen == {"cancelled": True, "cancel_requested": True}
        assert provider.held_runs == {"r2"}  # the other run goes on
        nursery.cancel_scope.cancel()


# --- serialize_per_thread -----------------------------------------------------


async def test_serialize_per_thread_runs_a_threads_runs_one_at_a_time_in_arrival_order(
    autojump_clock,
):
    log: list[str] = []

    async def slow(run_input: RunAgentInput) -> AsyncIterator[Any]:
        text = last_user_text(run_input)
        log.append(f"start {text}")
        await trio.sleep(10)
        yield TextMessageContentEvent(message_id="m", delta=text)
        log.append(f"end {text}")

    agent = serialize_per_thread(slow)
    fake = FakeFunduq()
    provider = provider_for(fake)
    provider.add_agent(agent, name="slow")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(provider.run)
        link = await fake.next_link()
        await link.attach()
        for i, (thread, text) in enumerate(
            [("A", "a1"), ("A", "a2"), ("B", "b1"), ("A", "a3"), ("B", "b2")]
        ):
            await link.offer(f"o{i}", f"run-{text}", thread=thread, agent="slow", text=text)
        for i in range(5):  # all accepted at once: turn-taking is the agent's, not the answer's
            assert (await link.until(f.Ok, id=f"o{i}")).verdict == "accepted"
        assert agent.waiting("A") == ["run-a1", "run-a2", "run-a3"]
        finished: list[str] = []
        started_at = trio.current_time()
        while len(finished) < 5:
            frame = await link.until(f.Finish)
            finished.append(frame.run_id)
        assert trio.current_time() - started_at == 30  # thread A's three turns in a row
        assert [e for e in log if e.split()[1].startswith("a")] == [
            "start a1",
            "end a1",
            "start a2",
            "end a2",
            "start a3",
            "end a3",
        ]
        assert [e for e in log if e.split()[1].startswith("b")] == [
            "start b1",
            "end b1",
            "start b2",
            "end b2",
        ]
        # B never waited for A: b1 started alongside a1
        assert set(log[:2]) == {"start a1", "start b1"}
        assert agent.waiting("A") == [] and agent.waiting("B") == []
        nursery.cancel_scope.cancel()


async def test_serialize_per_thread_lets_the_next_turn_go_when_one_is_cancelled(autojump_clock):
    log: list[str] = []

    async def slow(run_input: RunAgentInput) -> AsyncIterator[Any]:
        log.append(f"start {last_user_text(run_input)}")
        await trio.sleep(10)
        yield {"type": "CUSTOM", "name": "done", "value": None}

    agent = serialize_per_thread(slow)
    fake = FakeFunduq()
    provider = provider_for(fake)
    provider.add_agent(agent, name="slow")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(provider.run)
        link = await fake.next_link()
        await link.attach()
        await link.offer("o1", "r1", agent="slow", text="first")
        await link.offer("o2", "r2", agent="slow", text="second")
        await link.offer("o3", "r3", agent="slow", text="third")
        await link.until(f.Ok, id="o3")
        await link.send(f.Cancel(run_id="r2"))  # cancelled while waiting its turn
        assert await link.until(f.Finish) == f.Finish(run_id="r2")
        assert (await link.until(f.Finish)).run_id == "r1"
        assert (await link.until(f.Finish)).run_id == "r3"
        assert log == ["start first", "start third"]
        nursery.cancel_scope.cancel()


# --- reconnecting ---------------------------------------------------------------


async def test_reconnects_with_backoff_and_resets_after_registering(autojump_clock):
    cancelled = trio.Event()

    async def holder(run_input: RunAgentInput) -> AsyncIterator[Any]:
        try:
            await trio.sleep_forever()
        finally:
            cancelled.set()
        yield  # pragma: no cover

    # backoff: 1, 2, 4, 8, 8 ... s (no jitter)
    fake = FakeFunduq()
    provider = provider_for(fake)
    provider.add_agent(holder, name="holder")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(provider.run)
        link = await fake.next_link()
        await link.attach()
        await provider.wait_registered(1)
        await link.offer("o1", "r1", agent="holder")
        await link.until(f.Ok, id="o1")

        # funduq drops the link: the held run's task is cancelled (funduq has
        # already failed it), and the SDK dials again after 1 s.
        fake.refuse = 2  # ...and funduq is unreachable for two more dials
        dropped_at = trio.current_time()
        await link.drop()
        await cancelled.wait()
        link = await fake.next_link()
        assert [t - dropped_at for t in fake.dials[1:]] == [1, 1 + 2, 1 + 2 + 4]
        assert provider.held_runs == frozenset()

        # A link that never registers does not reset the backoff...
        await link.handshake()
        await link.drop()
        link = await fake.next_link()
        assert fake.dials[-1] - fake.dials[-2] == 8
        # ...one that registers does.
        await link.attach()
        await provider.wait_registered(2)
        await link.drop()
        link = await fake.next_link()
        assert fake.dials[-1] - fake.dials[-2] == 1
        await link.attach()
        await link.offer("o2", "r2", agent="holder")
        assert (await link.until(f.Ok, id="o2")).verdict == "accepted"
        nursery.cancel_scope.cancel()


async def test_run_reports_started_once_the_first_link_registered(autojump_clock):
    fake = FakeFunduq()
    provider = provider_for(fake)
    provider.add_agent(make_echo(), name="echo")

    async def play_funduq() -> None:
        link = await fake.next_link()
        await trio.sleep(5)
        await link.attach()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(play_funduq)
        await nursery.start(provider.run)
        assert trio.current_time() == 5 and provider.registrations == 1
        nursery.cancel_scope.cancel()


async def failure_of(provider: Provider, play_funduq: Any) -> Exception:
    """Run the provider against `play_funduq()` and return what it raised."""
    failure: list[Exception] = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(play_funduq)
        try:
            await provider.run()
        except Exception as exc:  # noqa: BLE001 - the test inspects it
            failure.append(exc)
        nursery.cancel_scope.cancel()
    return failure[0]


async def test_a_pinned_funduq_key_refuses_another_funduq(autojump_clock):
    fake = FakeFunduq()
    provider = provider_for(fake, funduq_key=Identity.generate().public_key_hex)
    provider.add_agent(make_echo(), name="echo")

    async def impostor() -> None:
        link = await fake.next_link()
        await link.send(f.Hello(funduq_key=FUNDUQ.public_key_hex, nonce=new_nonce()))

    assert isinstance(await failure_of(provider, impostor), FunduqKeyMismatch)
    assert len(fake.dials) == 1  # not retried


async def test_a_pinned_funduq_key_accepts_the_funduq_that_proves_it(autojump_clock):
    fake = FakeFunduq()
    provider = provider_for(fake, funduq_key=FUNDUQ.public_key_hex)
    provider.add_agent(make_echo(), name="echo")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(provider.run)
        link = await fake.next_link()
        await link.attach()
        await provider.wait_registered(1)
        nursery.cancel_scope.cancel()


async def test_connect_err_is_not_retried(autojump_clock):
    fake = FakeFunduq()
    provider = provider_for(fake)
    provider.add_agent(make_echo(), name="echo")

    async def refuse() -> None:
        link = await fake.next_link()
        await link.send(f.Hello(funduq_key=FUNDUQ.public_key_hex, nonce=new_nonce()))
        await link.recv()
        await link.send(f.ConnectErr(reason="key not allowed on this funduq"))

    failure = await failure_of(provider, refuse)
    assert isinstance(failure, ConnectRejected) and "key not allowed" in str(failure)
    assert len(fake.dials) == 1


# --- small pure parts -------------------------------------------------------------


def test_backoff_grows_and_caps():
    backoff = Backoff(initial=0.5, factor=2, maximum=4, jitter=0)
    assert [backoff.delay(i) for i in range(6)] == [0.5, 1, 2, 4, 4, 4]
    jittered = Backoff(initial=1, factor=2, maximum=30, jitter=0.1)
    assert all(0.9 <= jittered.delay(0) <= 1.1 for _ in range(50))


def test_echo_splits_into_exactly_n_deltas():
    assert split_text("abcdefg", 3) == ["abc", "de", "fg"]
    assert split_text("ab", 4) == ["a", "b", "", ""]
    assert "".join(split_text("hello world", 8)) == "hello world"


def test_the_sdk_imports_neither_the_broker_nor_the_web_app():
    import subprocess
    import sys

    code = (
        "import sys, funduq_trio.provider; "
        "bad = [m for m in sys.modules if m.startswith(('quart', 'hypercorn', "
        "'funduq_trio.broker', 'funduq_trio.web', 'funduq_trio.server', 'a2a'))]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], check=False, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr


# --- the real thing -----------------------------------------------------------------


async def test_a_run_travels_caller_funduq_sdk_and_back(tmp_path):
    async with running_server(tmp_path) as info, http_client(info) as http:
        identity = Identity.generate()
        provider = Provider(
            identity, info.provider_url, funduq_key=info.funduq.identity.public_key_hex
        )
        provider.add_agent(make_echo(deltas=8), name="echo", description="says it back")
        async with trio.open_nursery() as nursery:
            await nursery.start(provider.run)
            response, events = await post_sse(
                http, f"/agui/{identity.fingerprint}/echo", user_input("round trip please")
            )
            assert response.status_code == 200
            types = [e["type"] for e in events]
            assert types[0] == "RUN_STARTED" and types[-1] == "RUN_FINISHED"
            assert types.count("TEXT_MESSAGE_CONTENT") == 8
            text = "".join(e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT")
            assert text == "round trip please"
            run_id = events[0]["runId"]
            record = (await http.get(f"/runs/{run_id}")).json()
            assert record["status"] == "completed" and len(record["events"]) == 12
            roster = (await http.get("/agents")).json()["agents"]
            assert roster == [
                {
                    "provider": identity.public_key_hex,
                    "fingerprint": identity.fingerprint,
                    "name": "echo",
                    "description": "says it back",
                    "online": True,
                }
            ]
            nursery.cancel_scope.cancel()


async def test_an_agent_reads_its_threads_messages_from_funduq(tmp_path):
    async def recall(run_input: RunAgentInput, ctx: RunContext) -> AsyncIterator[Any]:
        messages = await ctx.thread_messages()
        said = " | ".join(m["content"] for m in messages if m["role"] == "user")
        yield {"type": "RUN_STARTED", "threadId": ctx.thread_id, "runId": ctx.run_id}
        yield {"type": "CUSTOM", "name": "recall", "value": said}
        yield {"type": "RUN_FINISHED", "threadId": ctx.thread_id, "runId": ctx.run_id}

    async with running_server(tmp_path) as info:
        identity = Identity.generate()
        provider = Provider(identity, info.provider_url)
        provider.add_agent(recall, name="recall")
        async with trio.open_nursery() as nursery:
            await nursery.start(provider.run)
            first = await info.funduq.start_run(identity.fingerprint, "recall", user_input("one"))
            await info.funduq.wait_run(first.run_id)
            second = await info.funduq.start_run(
                identity.fingerprint, "recall", user_input("two"), thread_id=first.thread_id
            )
            record = await info.funduq.wait_run(second.run_id)
            assert record["status"] == "completed"
            custom = [e["event"] for e in record["events"] if e["event"]["type"] == "CUSTOM"]
            assert custom[0]["value"] == "one | two"
            nursery.cancel_scope.cancel()


async def test_the_sdk_reconnects_when_the_server_drops_its_link(tmp_path):
    from test_provider_link import attached  # a raw link under the same key replaces ours

    async with running_server(tmp_path) as info:
        identity = Identity.generate()
        provider = Provider(
            identity, info.provider_url, backoff=Backoff(initial=0.01, maximum=0.05, jitter=0)
        )
        provider.add_agent(make_echo(), name="echo")
        async with trio.open_nursery() as nursery:
            await nursery.start(provider.run)
            async with attached(info, identity=identity) as raw:
                await raw.closed()  # the SDK came back and replaced the raw link in turn
            with trio.fail_after(15):
                await provider.wait_registered(2)
            assert "replaced" in provider.last_end_reason
            ticket = await info.funduq.start_run(identity.fingerprint, "echo", user_input("again"))
            record = await info.funduq.wait_run(ticket.run_id)
            assert record["status"] == "completed"
            nursery.cancel_scope.cancel()


async def test_an_event_the_link_cannot_carry_fails_its_run_alone(autojump_clock):
    async def odd(run_input: RunAgentInput) -> AsyncIterator[Any]:
        yield {"type": "RUN_STARTED", "threadId": run_input.thread_id, "runId": run_input.run_id}
        yield {"type": "CUSTOM", "name": "n", "value": {"x": [float("nan")]}}

    async def lone(run_input: RunAgentInput) -> AsyncIterator[Any]:
        yield {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "x\ud800"}

    fake = FakeFunduq()
    provider = provider_for(fake)
    provider.add_agent(odd, name="odd")
    provider.add_agent(lone, name="lone")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(provider.run)
        link = await fake.next_link()
        await link.attach()
        await link.offer("o1", "r1", agent="odd")
        started, error, finish = await link.run_frames("r1")
        # Not NaN sent as null: the run fails, saying why.
        assert started.seq == 1 and error.event["code"] == "agent_error"
        assert "cannot be carried" in error.event["message"]
        assert "nan at $.value.x[0]" in error.event["message"]
        assert finish == f.Finish(run_id="r1")
        # The same link serves the next run (and refuses its lone surrogate the same way).
        await link.offer("o2", "r2", agent="lone")
        error, finish = await link.run_frames("r2")
        assert "lone surrogate" in error.event["message"] and finish == f.Finish(run_id="r2")
        nursery.cancel_scope.cancel()


async def test_stray_replies_keep_the_link_and_a_second_hello_drops_it(autojump_clock):
    """The runtime performs its machine's answers (protocol/provider_link.py):
    an ok to an id it never asked and funduq's id-less complaint are only
    logged, the link serving on; a hello on an attached link is a protocol
    error, and the runtime reconnects."""
    async with serving({"echo": make_echo(deltas=1)}) as (fake, provider, link):
        await link.send(f.Ok(id="register-99"))
        await link.send(f.Err(reason="your last report was odd"))
        await link.offer("o1", "r1")
        assert (await link.until(f.Ok, id="o1")).verdict == "accepted"
        assert (await link.run_frames("r1"))[-1] == f.Finish(run_id="r1")
        assert len(fake.dials) == 1
        await link.send(f.Hello(funduq_key=FUNDUQ.public_key_hex, nonce=new_nonce()))
        await (await fake.next_link()).attach()
        assert len(fake.dials) == 2
        assert provider.last_end_reason == "protocol error: unexpected 'hello' on an attached link"
