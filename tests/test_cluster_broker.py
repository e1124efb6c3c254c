"""Two brokers on one PostgreSQL record, in one process (docs/cluster.md): a
thread moves between nodes only while idle; a start, an answer or a cancel
for a thread the other node leads, when that node cannot be reached (these
brokers serve no HTTP, so they never said where they are), is refused
`ThreadLedElsewhere` with nothing recorded; a node taking a thread again reads its history afresh
(the other node added to it meanwhile). The real processes are
test_cluster.py's; this one reaches the paths a door cannot time."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import stores
import trio
import trio.testing
from broker_support import (
    AGENT,
    Provider,
    broker,
    interrupt_finish,
    last_offer_for,
    offered_runs,
    quiet,
    reply,
    resume_input,
    user_input,
)

from funduq_trio.broker.errors import ThreadLedElsewhere
from funduq_trio.broker.funduq import Funduq
from funduq_trio.broker.postgres import PostgresStore
from funduq_trio.broker.store import run_store
from funduq_trio.identity import Identity

pytestmark = pytest.mark.parametrize("store", ["postgres"], indirect=True)


async def take(funduq: Funduq, p: Provider, run_id: str) -> None:
    """Accept the run's offer on `p` (the node's provider link)."""
    await quiet()
    p.session.answer(last_offer_for(p.link, run_id), "accepted")
    await quiet()


async def committed(funduq: Funduq) -> None:
    """Everything the node queued for the record (a lease's release) is in.
    First every task runs until it blocks: a lane that settled its run (which
    wakes ``wait_run``) releases its thread's lease only as it ends."""
    await trio.testing.wait_all_tasks_blocked()
    await funduq.record.probe()


async def test_a_thread_moves_between_nodes_only_while_idle(tmp_path, store):
    async with broker(tmp_path / "a") as a, broker(tmp_path / "b") as b:
        assert a.record.shared and b.record.shared and a.node != b.node
        pa = await Provider(a).attach()
        pb = await Provider(b, identity=pa.identity).attach()  # one key, a link to each node

        # A pauses a run of the thread, then holds a second one: A leads it.
        first = await a.start_run(pa.key, AGENT, user_input("one", "m1"))
        tid = first.thread_id
        await take(a, pa, first.run_id)
        ask = [{"id": "ask-1", "reason": "confirm"}]
        pa.stream(
            first.run_id, *reply(first.run_id, tid)[:-1], interrupt_finish(first.run_id, tid, ask)
        )
        assert (await a.wait_run(first.run_id))["status"] == "input-required"
        second = await a.start_run(pa.key, AGENT, user_input("two", "m2"), thread_id=tid)
        await take(a, pa, second.run_id)
        assert a.leases.leads(tid)

        before: dict[str, Any] | None = await b.get_thread(tid)
        with pytest.raises(ThreadLedElsewhere):
            await b.answer_pause(first.run_id, resume_input("ask-1", text="yes", message_id="a1"))
        with pytest.raises(ThreadLedElsewhere):
            await b.start_run(pb.key, AGENT, user_input("three", "m3"), thread_id=tid)
        with pytest.raises(ThreadLedElsewhere):
            await b.cancel_run(second.run_id)
        assert await b.get_thread(tid) == before  # nothing recorded
        assert (await b.get_run(first.run_id))["status"] == "input-required"
        assert (await b.get_run(second.run_id))["status"] == "running"
        assert not b.leases.leads(tid)

        # A finishes; the thread is idle and released: B answers the pause.
        pa.stream(second.run_id, *reply(second.run_id, tid, "done"))
        assert (await a.wait_run(second.run_id))["status"] == "completed"
        await committed(a)
        assert not a.leases.leads(tid)
        await b.answer_pause(first.run_id, resume_input("ask-1", text="yes", message_id="a1"))
        assert b.leases.leads(tid)
        await take(b, pb, first.run_id)
        pb.stream(first.run_id, *reply(first.run_id, tid, "resumed"))
        assert (await b.wait_run(first.run_id))["status"] == "completed"
        await committed(b)
        assert not b.leases.leads(tid)

        # A takes the thread again, reading what B added to its history: its
        # new message lands after B's, under a fresh position.
        third = await a.start_run(pa.key, AGENT, user_input("three", "m3"), thread_id=tid)
        await take(a, pa, third.run_id)
        pa.stream(third.run_id, *reply(third.run_id, tid, "again"))
        assert (await a.wait_run(third.run_id))["status"] == "completed"
        thread = await a.get_thread(tid)
        assert thread is not None
        ids = [m["id"] for m in thread["messages"]]
        users = [i for i in ids if not i.startswith("r-")]  # the replies ride between
        assert users == ["m1", "m2", "a1", "m3"], ids
        assert len(ids) == len(set(ids))
        assert [r["runId"] for r in thread["runs"]] == [
            second.run_id,
            first.run_id,  # answered later: a new arrival
            third.run_id,
        ]
        assert [r["status"] for r in thread["runs"]] == ["completed"] * 3


async def test_a_run_arriving_for_a_dead_nodes_thread_takes_it_over_first(tmp_path, store):
    """A node that died left a thread with a running and a queued run, its
    lease lapsing. A new run for the thread, on another node, takes the
    thread over: what the dead node held fails orphaned_by_restart, its
    queued run is offered first, the new one after it."""
    assert stores.database_url is not None
    async with broker(tmp_path) as b:
        pb = await Provider(b).attach()
        async with run_store(PostgresStore(stores.database_url, node="node_dead")) as dead:
            tid = "thread_of_the_dead"
            new = (tid, pb.key, AGENT, None, time.time())
            await dead.insert_run(_row("run_held", tid, pb.key), new, [])
            await dead.insert_run(_row("run_queued", tid, pb.key), None, [])
            assert await dead.move("run_held", "offering")
            assert await dead.move("run_held", "running")
            await dead.append_events("run_held", [(1, {"type": "RUN_STARTED"})])
        stores.lapse_leases([tid])

        third = await b.start_run(pb.key, AGENT, user_input("third", "m3"), thread_id=tid)
        assert b.leases.leads(tid)
        held = await b.get_run("run_held")
        assert held is not None and held["status"] == "failed", held
        assert held["metadata"]["failureReason"] == "orphaned_by_restart"
        assert [e["event"]["type"] for e in held["events"]] == ["RUN_STARTED", "RUN_ERROR"]

        await quiet()
        # The dead node's queued run is the head: offered alone, first.
        assert [run["runId"] for _, run in pb.link.offers] == ["run_queued"]
        await take(b, pb, "run_queued")
        # Accepted, it left the queue: the new run is offered next.
        assert [run["runId"] for _, run in pb.link.offers] == ["run_queued", third.run_id]
        pb.stream("run_queued", *reply("run_queued", tid))
        assert (await b.wait_run("run_queued"))["status"] == "completed"
        await take(b, pb, third.run_id)
        pb.stream(third.run_id, *reply(third.run_id, tid))
        assert (await b.wait_run(third.run_id))["status"] == "completed"


@pytest.mark.parametrize("held", ["before the restore reads", "after the restore read"])
@pytest.mark.parametrize("taken_by", ["the lease task", "an arriving run"])
async def test_work_sent_while_a_thread_is_taken_over_waits_for_the_dead_leaders_runs(
    tmp_path, store, taken_by, held
):
    """A node died leaving a thread with a paused run, a running one and two
    queued ones; its lease lapsed. Node B takes the thread over -- by its
    lease task's claim round (a provider attaching), or because a run X
    arrives for the thread -- and, between the claim and the end of the
    restore, the pause is answered and a run Y is sent, one after the
    other. The restore is held at a gate (before it reads the thread's runs,
    or after) until both are recorded. The provider must be offered the
    thread's runs in the order they were recorded -- the dead node's queued
    runs first, then the answer, then Y (then X, recorded once the thread
    was taken) -- each once, none lost (docs/cluster.md, "How ownership
    moves")."""
    assert stores.database_url is not None
    tid = "thread_of_the_dead"
    identity = Identity.generate()
    key = identity.public_key_hex
    # A lease lasting an hour: no periodic round claims anything meanwhile.
    async with broker(tmp_path, lease_seconds=3600) as b:
        pb = Provider(b, identity=identity)
        if taken_by == "an arriving run":
            # The provider first, and the claim rounds its attaching starts
            # (one at once, one when B hears its own roster notification)
            # done before the lease lapses: X's takeover is the only one.
            heard, wake = trio.Event(), b._wake_lease_task

            def woken() -> None:
                heard.set()
                wake()

            b._wake_lease_task = woken  # type: ignore[method-assign]
            await pb.attach()
            await heard.wait()
            await quiet()
        async with run_store(PostgresStore(stores.database_url, node="node_dead")) as dead:
            new = (tid, key, AGENT, None, time.time())
            await dead.insert_run(_row("run_paused", tid, key), new, [])
            for to in ("offering", "running", "input-required"):
                assert await dead.move("run_paused", to)
            await dead.insert_run(_row("run_held", tid, key), None, [])
            assert await dead.move("run_held", "offering")
            assert await dead.move("run_held", "running")
            for run_id in ("run_queued_1", "run_queued_2"):
                await dead.insert_run(_row(run_id, tid, key), None, [])
        stores.lapse_leases([tid])

        # The takeover's restore of the thread waits at the gate.
        at_gate, gate = trio.Event(), trio.Event()
        restore_reads = b.record.restore_reads

        async def held_restore_reads(orphaned: Any, threads: Any = None) -> Any:
            if threads is None or tid not in threads:
                return await restore_reads(orphaned, threads)
            if held == "before the restore reads":
                at_gate.set()
                await gate.wait()
            found = await restore_reads(orphaned, threads)
            if held == "after the restore read":
                at_gate.set()
                await gate.wait()
            return found

        b.record.restore_reads = held_restore_reads  # type: ignore[method-assign]
        tickets: dict[str, str] = {}

        async def send(name: str, text: str) -> None:
            ticket = await b.start_run(key, AGENT, user_input(text, text), thread_id=tid)
            tickets[name] = ticket.run_id

        async def answer() -> None:
            ticket = await b.answer_pause("run_paused", resume_input("ask-1", text="yes"))
            tickets["answer"] = ticket.run_id

        async def recorded() -> list[str]:
            """The thread's runs in the record, in arrival order."""
            await quiet()
            thread = await b.get_thread(tid)
            assert thread is not None
            return [r["runId"] for r in thread["runs"]]

        async with trio.open_nursery() as nursery:
            if taken_by == "the lease task":
                await pb.attach()  # its agent served here now: the lease task claims
            else:
                nursery.start_soon(send, "x", "x")  # finds the lease lapsed: takes over
            await at_gate.wait()
            assert b.leases.leads(tid)  # claimed; not yet restored
            # Sent one after the other, each recorded before the next is sent.
            nursery.start_soon(answer)
            await quiet()
            assert (await b.get_run("run_paused"))["status"] != "input-required"  # recorded
            nursery.start_soon(send, "y", "y")
            before = await recorded()
            assert len(before) == 5, before  # Y is in the record, X not yet
            gate.set()
        assert b.record.restore_reads is held_restore_reads

        # Every caller has its ticket. The provider takes each offer as it
        # comes, one at a time, and finishes it.
        order = ["run_queued_1", "run_queued_2", "run_paused", tickets["y"]]
        if taken_by == "an arriving run":
            order.append(tickets["x"])
        assert (await recorded())[1:] == order  # the record's arrival order, after run_held
        await finish_offers_in_turn(b, pb, len(order), tid)
        await quiet()
        names = {run_id: name for name, run_id in tickets.items()}
        offered = [names.get(run_id, run_id) for run_id in offered_runs(pb.link)]
        assert offered == [names.get(run_id, run_id) for run_id in order]
        orphan = await b.get_run("run_held")
        assert orphan is not None and orphan["status"] == "failed"
        assert orphan["metadata"]["failureReason"] == "orphaned_by_restart"
        await committed(b)
        assert not b.leases.leads(tid)  # idle again: released


async def test_a_run_sent_as_a_thread_is_handed_over_comes_after_its_queued_runs(tmp_path, store):
    """A hands a thread with two queued runs over to B (A's provider link
    dropped; B's serves the agent). Before B's lease task claims the thread,
    a run Y for it reaches B. Y must not take the thread as an idle one
    (its lease there for the taking) and be offered alone: B takes the
    thread over first, and offers the queued runs, then Y, each once."""
    identity = Identity.generate()
    async with (
        broker(tmp_path / "a", lease_seconds=3600) as a,
        broker(tmp_path / "b", lease_seconds=3600) as b,
    ):
        b.served_at("http://127.0.0.1:9")  # where A would reach B (never, here)
        # B's lease task is woken only when the test says (its own round
        # comes an hour on): the window before it claims is held open.
        woken: list[bool] = []
        b._wake_lease_task = lambda: woken.append(True)  # type: ignore[method-assign]
        pb = await Provider(b, identity=identity).attach()
        # A serves the agent through a link that can hold one run at a time.
        pa = await Provider(a, identity=identity, max_concurrent=1).attach()
        busy = await a.start_run(pa.key, AGENT, user_input("busy", "m0"))
        await take(a, pa, busy.run_id)
        first = await a.start_run(pa.key, AGENT, user_input("q1", "q1"))
        tid = first.thread_id
        second = await a.start_run(pa.key, AGENT, user_input("q2", "q2"), thread_id=tid)
        await quiet()
        assert (await a.get_run(first.run_id))["status"] == "queued"
        assert a.leases.leads(tid)

        pa.session.detach()  # A serves the agent no more; B does
        await quiet()
        await committed(a)
        assert a.metrics.threads_handed_over == 1
        assert not a.leases.leads(tid) and not b.leases.leads(tid)

        y = await b.start_run(pb.key, AGENT, user_input("y", "y"), thread_id=tid)
        order = [first.run_id, second.run_id, y.run_id]
        names = {first.run_id: "q1", second.run_id: "q2", y.run_id: "y"}
        await finish_offers_in_turn(b, pb, len(order), tid)
        await quiet()
        assert [names.get(r, r) for r in offered_runs(pb.link)] == ["q1", "q2", "y"]


async def test_a_run_sharing_a_commit_with_the_claim_of_its_thread_comes_after_its_queued_runs(
    tmp_path, store
):
    """A node died leaving a thread with two queued runs, its lease lapsed.
    On B a run X arrives for the thread while B's lease task is renewing;
    the renewal's commit is held until X's insert is queued, so the lease
    task's claim of the thread lands in the same group commit as X's insert,
    behind it. The insert must be refused as the dead node's (its lease was
    not B's when the insert took it), not recorded because the claim, later
    in the same transaction, made the lease B's by the commit: recorded so,
    X was laned as it arrived, ahead of the queued runs the claim's restore
    then laned behind it. The provider must be offered the queued runs
    first, then X, each once (docs/cluster.md, "How ownership moves")."""
    assert stores.database_url is not None
    tid = "thread_of_the_dead"
    identity = Identity.generate()
    key = identity.public_key_hex
    # A lease lasting an hour: no periodic round claims anything meanwhile.
    async with broker(tmp_path, lease_seconds=3600) as b:
        # The provider holds one run at a time, and holds one: X, when laned,
        # waits for room rather than writing its offer.
        heard, wake = trio.Event(), b._wake_lease_task

        def woken() -> None:
            heard.set()
            wake()

        b._wake_lease_task = woken  # type: ignore[method-assign]
        pb = await Provider(b, identity=identity, max_concurrent=1).attach()
        await heard.wait()
        await quiet()
        busy = await b.start_run(key, AGENT, user_input("busy", "m0"))
        await take(b, pb, busy.run_id)
        async with run_store(PostgresStore(stores.database_url, node="node_dead")) as dead:
            new = (tid, key, AGENT, None, time.time())
            await dead.insert_run(_row("run_queued_1", tid, key), new, [])
            await dead.insert_run(_row("run_queued_2", tid, key), None, [])
        stores.lapse_leases([tid])

        # The lease task's renewal is held in its commit (the writer with it).
        at_gate, gate = trio.Event(), trio.Event()
        commit = b.record._commit

        async def held_commit(ops: Any) -> None:
            if not gate.is_set():
                at_gate.set()
                await gate.wait()
            await commit(ops)

        b.record._commit = held_commit  # type: ignore[method-assign]
        tickets: dict[str, str] = {}

        async def send_x() -> None:
            ticket = await b.start_run(key, AGENT, user_input("x", "x"), thread_id=tid)
            tickets["x"] = ticket.run_id

        async with trio.open_nursery() as nursery:
            b._claim_now.set()  # a lease round: its renewal waits at the gate
            await at_gate.wait()
            nursery.start_soon(send_x)
            await quiet()  # X's insert is queued behind the renewal
            assert not b.leases.leads(tid)
            gate.set()  # the renewal commits; the claim joins X's insert
        b.record._commit = commit  # type: ignore[method-assign]
        assert b.leases.leads(tid)

        pb.stream(busy.run_id, *reply(busy.run_id, busy.thread_id))
        assert (await b.wait_run(busy.run_id))["status"] == "completed"
        order = ["run_queued_1", "run_queued_2", tickets["x"]]
        thread = await b.get_thread(tid)
        assert thread is not None
        assert [r["runId"] for r in thread["runs"]] == order
        # The busy run's offer came first; then the thread's, one at a time.
        await finish_offers_in_turn_after(b, pb, 1, len(order), tid)
        await quiet()
        names = {tickets["x"]: "x"}
        offered = [names.get(r, r) for r in offered_runs(pb.link)][1:]
        assert offered == ["run_queued_1", "run_queued_2", "x"]


async def test_a_run_taking_over_a_thread_it_thought_its_own_reads_its_history_again(
    tmp_path, store
):
    """A leads a thread (its run held) and stops renewing; B takes the
    thread over, and a run sent to B adds a message to it; then B's lease
    lapses too. A, which never heard it had lost the thread, is sent a run
    for it: the insert is refused (B's lease), so A takes the thread over
    and records the run -- with the history B added read again, not A's
    stale copy of it, whose next message position B's message took (a
    duplicate key and a 500, before). Every message ends in the thread, in
    the order sent."""
    identity = Identity.generate()
    async with (
        broker(tmp_path / "a", lease_seconds=3600) as a,
        broker(tmp_path / "b", lease_seconds=3600) as b,
    ):
        pa = await Provider(a, identity=identity).attach()
        pb = await Provider(b, identity=identity).attach()
        await quiet()
        first = await a.start_run(pa.key, AGENT, user_input("one", "m1"))
        tid = first.thread_id
        await take(a, pa, first.run_id)
        assert a.leases.leads(tid)

        stores.lapse_leases([tid])  # A renews no more (its next round is an hour on)
        b._claim_now.set()
        await quiet()
        await committed(b)
        assert (await b.get_run(first.run_id))["status"] == "failed"  # orphaned
        second = await b.start_run(pb.key, AGENT, user_input("two", "m2"), thread_id=tid)
        await take(b, pb, second.run_id)
        assert b.leases.leads(tid)
        stores.lapse_leases([tid])  # and B's lease lapses in turn
        assert a.leases.leads(tid)  # as far as A knows

        third = await a.start_run(pa.key, AGENT, user_input("three", "m3"), thread_id=tid)
        assert a.leases.leads(tid)
        assert (await a.get_run(second.run_id))["status"] == "failed"  # orphaned by A
        thread = await a.get_thread(tid)
        assert thread is not None
        assert [r["runId"] for r in thread["runs"]] == [
            first.run_id,
            second.run_id,
            third.run_id,
        ]
        assert [m["id"] for m in thread["messages"]] == ["m1", "m2", "m3"]


@pytest.mark.parametrize("then", ["a renewal lands", "another node takes the thread"])
async def test_a_node_whose_renewals_stall_past_its_lease_holds_its_offer(
    tmp_path, store, mock_clock, then
):
    """Node A leads a thread: one run held by its provider (one place), two
    queued. A's lease renewal is sent and stalls, unanswered, while A's own
    clock passes the lease. The held run finishes and the next one's
    `offering` write commits (the record's lease is still A's) -- but by
    A's clock its lease may have lapsed, so the offer is held back, not
    handed to the link. Then either A's renewal lands (the offer leaves,
    and the thread goes on in order), or first the lease lapses and node B,
    whose link serves the same provider's agent, takes the thread: B settles
    the offered run `orphaned_by_restart` and offers the next one; A's
    renewal, landing later, finds the thread B's, and A's held offer is
    dropped with its lane -- the provider never sees it, and sees the runs
    offered in the thread's order (docs/cluster.md, "An offer leaves within
    the lease")."""
    identity = Identity.generate()
    lease = 10.0
    async with (
        broker(tmp_path / "a", lease_seconds=lease) as a,
        broker(tmp_path / "b", lease_seconds=lease) as b,
    ):
        pa = await Provider(a, identity=identity, max_concurrent=1).attach()
        pb = await Provider(b, identity=identity).attach()
        await quiet()
        first = await a.start_run(pa.key, AGENT, user_input("one", "m1"))
        tid = first.thread_id
        second = await a.start_run(pa.key, AGENT, user_input("two", "m2"), thread_id=tid)
        third = await a.start_run(pa.key, AGENT, user_input("three", "m3"), thread_id=tid)
        await take(a, pa, first.run_id)
        assert offered_runs(pa.link) == [first.run_id]  # the others wait for its place

        # A's next renewal is sent and goes unanswered until the gate opens.
        gate, stalled = trio.Event(), trio.Event()
        renew = a.record.renew_leases

        async def stalled_renewal() -> Any:
            stalled.set()
            await gate.wait()
            return await renew()

        a.record.renew_leases = stalled_renewal  # type: ignore[method-assign]
        mock_clock.jump(lease + 1)  # past the lease, by A's clock
        await stalled.wait()
        await quiet()

        # The held run ends; the next one's offering write commits, and its
        # offer waits for a renewal.
        pa.stream(first.run_id, *reply(first.run_id, tid))
        await quiet()
        assert (await a.get_run(first.run_id))["status"] == "completed"
        assert (await a.get_run(second.run_id))["status"] == "offering"
        assert offered_runs(pa.link) == [first.run_id]
        assert a.metrics.offers_held == 1

        if then == "a renewal lands":
            gate.set()
            await quiet()
            assert offered_runs(pa.link) == [first.run_id, second.run_id]
            await finish_offers_in_turn_after(a, pa, 1, 2, tid)
            await quiet()
            assert offered_runs(pa.link) == [first.run_id, second.run_id, third.run_id]
            assert offered_runs(pb.link) == []
            for run in (second, third):
                assert (await a.get_run(run.run_id))["status"] == "completed"
            return

        stores.lapse_leases([tid])
        b._wake_lease_task()  # B's lease round: the lapsed thread is claimed
        await quiet()
        assert b.leases.leads(tid)
        orphan = await b.get_run(second.run_id)
        assert orphan is not None and orphan["status"] == "failed"
        assert orphan["metadata"]["failureReason"] == "orphaned_by_restart"
        assert offered_runs(pb.link) == [third.run_id]
        gate.set()  # A's renewal lands: the thread is B's
        await quiet()
        assert not a.leases.leads(tid)
        assert offered_runs(pa.link) == [first.run_id]  # never the held offer
        await finish_offers_in_turn(b, pb, 1, tid)
        await quiet()
        assert offered_runs(pa.link) + offered_runs(pb.link) == [first.run_id, third.run_id]
        orphan = await b.get_run(second.run_id)
        assert orphan is not None and orphan["status"] == "failed"
        assert [e["event"]["type"] for e in orphan["events"]] == ["RUN_ERROR"]
        assert (await b.get_run(third.run_id))["status"] == "completed"


async def finish_offers_in_turn(funduq: Any, provider: Any, most: int, thread_id: str) -> None:
    """The provider takes each offer as it comes, one at a time, and
    finishes it; up to `most` offers, fewer when nothing more is offered."""
    await finish_offers_in_turn_after(funduq, provider, 0, most, thread_id)


async def finish_offers_in_turn_after(
    funduq: Any, provider: Any, first: int, most: int, thread_id: str
) -> None:
    """`finish_offers_in_turn` from the link's offer number `first` on."""
    for n in range(first, first + most):
        await quiet()
        if len(provider.link.offers) <= n:
            break  # nothing more is offered
        offer_id, run = provider.link.offers[n]
        provider.session.answer(offer_id, "accepted")
        await quiet()
        provider.stream(run["runId"], *reply(run["runId"], thread_id))
        assert (await funduq.wait_run(run["runId"]))["status"] == "completed"


def _row(run_id: str, thread_id: str, key: str) -> dict[str, Any]:
    return {
        "id": run_id,
        "thread_id": thread_id,
        "provider_key": key,
        "agent_name": AGENT,
        "status": "queued",
        "input": json.dumps(
            {
                "threadId": thread_id,
                "runId": run_id,
                "messages": [{"id": f"msg-{run_id}", "role": "user", "content": run_id}],
                "tools": [],
                "context": [],
                "state": None,
                "forwardedProps": None,
            }
        ),
        "caller_metadata": "{}",
        "metadata": {},
        "arrival": 0,
        "created_at": time.time(),
    }
