"""Several `funduq-trio serve` processes on one PostgreSQL are one funduq
(issue #12, docs/cluster.md): each thread's runs are ordered by the one node
holding its lease; a node that starts takes only what nobody holds; a node
killed with kill -9 loses nothing -- its threads move on once their lease
lapses, what it held settles by the restart rules, queued runs are offered
again; two nodes claiming one lapsed thread never both win. (Callers on
another node than a thread's leader: test_cluster_forwarding.py.)

The nodes are real processes (cluster_support.py) on a schema made for the
test; the provider is played over the real link (`Peer`). Lease lapses are
waited for as observable conditions, never with a sleep and an assertion.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
import stores
import trio
from cluster_support import Node, cluster, metric, online
from reliability_support import (
    A2A,
    RUN_ERROR,
    TERMINAL,
    Offer,
    Peer,
    event_types,
    eventually,
    finished_event,
    get_run,
    started_event,
    text_events,
    wait_status,
)

from funduq_trio.broker.leases import RENEWALS_PER_LEASE
from funduq_trio.broker.postgres import PostgresStore
from funduq_trio.broker.store import NotLeader, run_store

pytestmark = pytest.mark.parametrize("store", ["postgres"], indirect=True)

AGENT = "scripted"


class Script:
    """The provider's behaviour: a run whose text starts with "hold" is
    accepted and started but not finished until `release` is set; any other
    is accepted and finished at once. Offers on a link numbered in `decline`
    are left unanswered (never happens here unless asked)."""

    def __init__(self) -> None:
        self.release = trio.Event()

    async def on_offer(self, offer: Offer) -> None:
        await offer.answer("accepted")
        if offer.text.startswith("hold") and offer.link.number == 1:
            await offer.play([started_event(offer)], finish=False)
            await self.release.wait()
            await offer.play([*text_events(f"m-{offer.run_id}", "held"), finished_event(offer)])
            return
        await offer.play(
            [started_event(offer), *text_events(f"m-{offer.run_id}", "ok"), finished_event(offer)]
        )


async def send(a2a: A2A, text: str, *, context_id: str | None = None) -> dict[str, Any]:
    answer = await a2a.send(text, message_id=f"msg-{text}", context_id=context_id)
    assert "result" in answer, answer
    return answer["result"]["task"]


def led_elsewhere(answer: dict[str, Any]) -> bool:
    """An A2A 1.0 error answer whose reason (in `error.data`, a
    google.rpc.ErrorInfo's metadata) is `thread_led_elsewhere`."""
    details = (answer.get("error") or {}).get("data") or []
    return any(
        isinstance(d, dict) and d.get("metadata", {}).get("reason") == "thread_led_elsewhere"
        for d in details
    )


async def one_running_two_queued(a2a: A2A, http: httpx.AsyncClient) -> tuple[str, list[str]]:
    """A thread with a held ("hold on") run and two queued behind it (the
    provider has room for one): (its id, the three runs' ids in order)."""
    first = await send(a2a, "hold on")
    await wait_status(http, first["id"], {"running"})
    thread = first["contextId"]
    second = await send(a2a, "second", context_id=thread)
    third = await send(a2a, "third", context_id=thread)
    for task in (second, third):
        await wait_status(http, task["id"], {"queued"})
    return thread, [first["id"], second["id"], third["id"]]


@asynccontextmanager
async def a_thread_held_on_a(
    tmp_path: Path, **settings: Any
) -> AsyncIterator[
    tuple[
        Node, Node, Peer, Script, httpx.AsyncClient, httpx.AsyncClient, trio.Nursery, str, list[str]
    ]
]:
    """Nodes A and B; the provider linked to A with room for one run (it
    reconnects quickly, wherever `set_url` points); a thread on A with a held
    run and two queued behind it. Yields the nodes, the provider, its script,
    a client of each node, a nursery cancelled on the way out, the thread and
    its three runs' ids in order."""
    script = Script()
    async with cluster(tmp_path, **settings) as nodes:
        a = await nodes.start("a")
        b = await nodes.start("b")
        peer = Peer(
            a.provider_url,
            [AGENT],
            on_offer=script.on_offer,
            max_concurrent_runs=1,
            reconnect_delay=0.05,
        )
        async with trio.open_nursery() as nursery, a.client() as http_a, b.client() as http_b:
            await nursery.start(peer.serve)
            a2a = A2A(http_a, f"/a2a/{peer.fingerprint}/{AGENT}")
            thread, ids = await one_running_two_queued(a2a, http_a)
            yield a, b, peer, script, http_a, http_b, nursery, thread, ids
            nursery.cancel_scope.cancel()


def a_settled_run_once(run: dict[str, Any], status: str, reason: str | None = None) -> None:
    assert run["status"] == status, run
    if reason is not None:
        assert run["metadata"].get("failureReason") == reason, run
        assert event_types(run).count(RUN_ERROR) == 1, event_types(run)


async def test_a_second_node_leaves_the_first_nodes_running_run_alone(tmp_path, store):
    """Before leases, every node settled every active run of the record as
    orphaned at its start: a second node killed the first one's runs."""
    script = Script()
    async with cluster(tmp_path) as nodes:
        a = await nodes.start("a")
        peer = Peer(a.provider_url, [AGENT], on_offer=script.on_offer, max_concurrent_runs=4)
        async with (
            trio.open_nursery() as nursery,
            a.client() as http_a,
        ):
            await nursery.start(peer.serve)
            a2a = A2A(http_a, f"/a2a/{peer.fingerprint}/{AGENT}")
            held = await send(a2a, "hold the first")
            await wait_status(http_a, held["id"], {"running"})

            b = await nodes.start("b")
            # B serves the agent too (the same provider key attached to it),
            # so B's lease task is claiming this agent's lapsed threads the
            # whole time: a lease A failed to renew would be taken now.
            twin = Peer(b.provider_url, [AGENT], identity=peer.identity)
            nursery.start_soon(twin.serve)
            async with b.client() as http_b:
                await eventually(lambda: online(http_b, peer.fingerprint), "the agent online on B")
                assert b.logged("runs orphaned") == [], b.lines
                # Three leases' worth of B's lease task renewing and claiming
                # this agent's lapsed threads: A renews, B takes nothing.
                since = await metric(http_b, "funduq_lease_renewals_total")

                async def three_leases_of_claims() -> bool:
                    renewals = await metric(http_b, "funduq_lease_renewals_total")
                    return renewals >= since + 3 * RENEWALS_PER_LEASE + 1

                await eventually(three_leases_of_claims, "B's lease task at work for 3 leases")
                assert await metric(http_b, "funduq_threads_taken_over_total") == 0
                assert await metric(http_a, "funduq_threads_led") == 1
                assert await metric(http_a, "funduq_threads_let_go_total") == 0
                run = await get_run(http_b, held["id"])
                assert run is not None and run["status"] == "running", run
                assert twin.offer_log == []

                script.release.set()
                done = await wait_status(http_b, held["id"], TERMINAL)
                assert done["status"] == "completed", done
                assert event_types(done).count("RUN_FINISHED") == 1
                assert RUN_ERROR not in event_types(done)
            nursery.cancel_scope.cancel()


async def test_a_killed_nodes_thread_moves_on_to_the_node_its_provider_reconnects_to(
    tmp_path, store
):
    """kill -9 the node leading a thread with one running and two queued runs:
    once its lease lapses the node the provider reconnected to takes the
    thread over, the running run fails orphaned_by_restart exactly once, and
    the queued ones are offered through the new node in their order."""
    async with a_thread_held_on_a(tmp_path) as (a, b, peer, script, http_a, http_b, _, thread, ids):
        peer.set_url(b.provider_url)  # where it reconnects once A is gone
        a.kill9()
        await a.exited.wait()

        for run_id in ids:
            await wait_status(http_b, run_id, TERMINAL)
        runs = {run_id: await get_run(http_b, run_id) for run_id in ids}
        a_settled_run_once(runs[ids[0]], "failed", "orphaned_by_restart")
        for run_id in ids[1:]:
            a_settled_run_once(runs[run_id], "completed")
            assert event_types(runs[run_id]).count("RUN_FINISHED") == 1

        # Offered again through B (the provider's second link), in order,
        # once each; the orphan never again.
        on_b = [o.run_id for o in peer.offer_log if o.link.number > 1]
        assert on_b == ids[1:], on_b
        assert [o.run_id for o in peer.offer_log if o.link.number == 1] == ids[:1]
        await b.wait_logged("took over 1 threads")

        # The thread is B's to go on with (it released it once idle).
        a2a_b = A2A(http_b, f"/a2a/{peer.fingerprint}/{AGENT}")
        fourth = await send(a2a_b, "fourth", context_id=thread)
        done = await wait_status(http_b, fourth["id"], TERMINAL)
        assert done["status"] == "completed", done
        thread_json = (await http_b.get(f"/threads/{thread}")).json()
        assert [r["runId"] for r in thread_json["runs"]] == [*ids, fourth["id"]]


async def test_a_node_whose_lease_was_taken_over_lets_go_and_writes_nothing_more(tmp_path, store):
    """Another node claims the thread (here: its lease row is handed to
    another node id, as a takeover does): the old leader's renewal finds it
    gone, its lane ends without writing, and the provider holding the run is
    asked to stop; whatever the provider still sends is recorded nowhere."""
    assert stores.database_url is not None
    script = Script()
    async with cluster(tmp_path) as nodes:
        a = await nodes.start("a")
        peer = Peer(a.provider_url, [AGENT], on_offer=script.on_offer, max_concurrent_runs=4)
        async with (
            trio.open_nursery() as nursery,
            a.client() as http_a,
        ):
            await nursery.start(peer.serve)
            a2a = A2A(http_a, f"/a2a/{peer.fingerprint}/{AGENT}")
            held = await send(a2a, "hold me")
            await wait_status(http_a, held["id"], {"running"})

            # "running" is the provider's accept; its RUN_STARTED comes after
            # and must be in the record before the takeover, or it would be
            # fenced off with the rest (a busy host delays it that long).
            async def started_recorded() -> bool:
                run = await get_run(http_a, held["id"])
                return run is not None and event_types(run) == ["RUN_STARTED"]

            await eventually(started_recorded, "the run's RUN_STARTED in the record")
            thread = held["contextId"]
            with psycopg.connect(stores.database_url, autocommit=True) as conn:
                taken = conn.execute(
                    # A live node's lease: it does not lapse within the test.
                    "UPDATE thread_leases SET node = 'node_elsewhere', "
                    "expires_at = now() + interval '1 hour' WHERE thread_id = %s",
                    (thread,),
                ).rowcount
            assert taken == 1

            await peer.wait_cancel(held["id"])
            assert await metric(http_a, "funduq_threads_let_go_total") == 1
            assert await metric(http_a, "funduq_threads_led") == 0
            await a.wait_logged("letting go")

            # The provider carries on regardless: none of it is recorded.
            offer = peer.offers_of(held["id"])[0]
            await offer.play([*text_events("m-late", "late"), finished_event(offer)])
            link = await peer.attached()
            reply = await link.request(
                {"kind": "query.threadMessages", "threadId": thread, "limit": None}
            )
            assert reply is not None  # the link read everything sent before it
            run = await get_run(http_a, held["id"])
            assert run is not None and run["status"] == "running", run
            assert event_types(run) == ["RUN_STARTED"], event_types(run)
            # And a caller on A is now told the thread is led elsewhere.
            answer = await a2a.send("more", message_id="msg-more", context_id=thread)
            assert led_elsewhere(answer), answer
            nursery.cancel_scope.cancel()


# -- the record's side: claims and the fence, with two stores as two nodes ------------


def _run_row(run_id: str, thread_id: str) -> dict[str, Any]:
    return {
        "id": run_id,
        "thread_id": thread_id,
        "provider_key": "k" * 64,
        "agent_name": AGENT,
        "status": "queued",
        "input": json.dumps({"threadId": thread_id, "runId": run_id, "messages": []}),
        "caller_metadata": "{}",
        "metadata": {},
        "arrival": 1,
        "created_at": time.time(),
    }


async def test_two_nodes_claiming_lapsed_threads_never_both_win_and_the_loser_is_fenced(
    tmp_path, store
):
    assert stores.database_url is not None
    url = stores.database_url
    threads = [f"thread_race{i:02d}" for i in range(24)]
    async with (
        run_store(PostgresStore(url, node="node_a", lease_seconds=60)) as a,
        run_store(PostgresStore(url, node="node_b", lease_seconds=60)) as b,
        run_store(PostgresStore(url, node="node_c", lease_seconds=60)) as c,
    ):
        for i, tid in enumerate(threads):
            new = (tid, "k" * 64, AGENT, None, time.time())
            await a.insert_run(_run_row(f"run_race{i:02d}", tid), new, [])
        # A leads them all, alive: nobody else may claim or add to them.
        assert await b.claim_threads(threads=threads) == []
        assert await b.claim_threads(agents=[f"{'k' * 64}/{AGENT}"]) == []
        with pytest.raises(NotLeader):
            await b.insert_run(_run_row("run_intruder", threads[0]), None, [])
        assert await b.run_row("run_intruder") is None  # nothing recorded

        stores.lapse_leases(threads)
        won: dict[str, list[str]] = {}

        async def claim(name: str, store: PostgresStore) -> None:
            won[name] = await store.claim_threads(agents=[f"{'k' * 64}/{AGENT}"])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(claim, "b", b)
            nursery.start_soon(claim, "c", c)
        assert not set(won["b"]) & set(won["c"]), won
        assert sorted(won["b"] + won["c"]) == threads

        # The old leader's writes are refused by the record; the new one's go.
        run_id, tid = "run_race00", threads[0]
        winner, loser = (b, c) if tid in won["b"] else (c, b)
        for stale in (a, loser):
            with pytest.raises(NotLeader):
                await stale.move(run_id, "offering")
            with pytest.raises(NotLeader):
                await stale.append_events(run_id, [(1, {"type": "RUN_STARTED"})])
        assert await winner.move(run_id, "offering")
        row = await winner.run_row(run_id)
        assert row is not None and row[4] == "offering"
        assert await winner.events_after(run_id, 0, None, None) == []

        # Renewal tells the old leader what it still holds: nothing.
        assert await a.renew_leases() == []
        assert sorted(await winner.renew_leases()) == sorted(won["b" if winner is b else "c"])
        # Released, a thread is anyone's to take with its next run.
        pending = winner.release_lease(tid)
        assert pending is not None
        await pending.result()
        await a.insert_run(_run_row("run_next", tid), None, [])
        assert (await a.run_row("run_next")) is not None


async def test_a_fenced_off_write_in_a_group_commit_undoes_itself_and_nothing_else(tmp_path, store):
    """The fence refuses a stale write wherever it sits in a group commit: a
    move (checked in its UPDATE) and an event append (checked once before
    COMMIT), each queued beside writes of a thread the node does lead. The
    batch is replayed one write at a time: the refused writes raise NotLeader
    and change nothing, the others commit."""
    assert stores.database_url is not None
    url = stores.database_url
    async with (
        run_store(PostgresStore(url, node="node_a", lease_seconds=60)) as a,
        run_store(PostgresStore(url, node="node_b", lease_seconds=60)) as b,
    ):
        mine, theirs = "thread_mine", "thread_theirs"
        await a.insert_run(_run_row("run_mine", mine), (mine, "k" * 64, AGENT, None, 1.0), [])
        await b.insert_run(_run_row("run_theirs", theirs), (theirs, "k" * 64, AGENT, None, 1.0), [])
        event = json.dumps({"type": "RUN_STARTED"})

        def stale_append(conn: Any) -> None:
            a._fence(conn, "run_theirs")
            conn.execute(
                "INSERT INTO events (run_id, seq, event) VALUES (?,?,?)", ("run_theirs", 1, event)
            )

        # Queued with no await between them: one group commit.
        stale_move = a.move_soon("run_theirs", "offering")
        good_move = a.move_soon("run_mine", "offering")
        stale_events = a.write_soon(stale_append)
        with pytest.raises(NotLeader):
            await stale_move.result()
        assert await good_move.result() is True
        with pytest.raises(NotLeader):
            await stale_events.result()
        theirs_row, mine_row = await b.run_row("run_theirs"), await b.run_row("run_mine")
        assert theirs_row is not None and theirs_row[4] == "queued"
        assert mine_row is not None and mine_row[4] == "offering"
        assert await b.events_after("run_theirs", 0, None, None) == []
        # The leader's own writes of that run go through.
        assert await b.move("run_theirs", "offering")
        await b.append_events("run_theirs", [(1, {"type": "RUN_STARTED"})])


async def test_a_lease_is_taken_with_the_run_in_one_transaction_and_arrivals_are_shared(
    tmp_path, store
):
    """Every node draws arrivals from one sequence, so a thread's runs keep
    their order when its lease moves between nodes."""
    assert stores.database_url is not None
    url = stores.database_url
    async with (
        run_store(PostgresStore(url, node="node_a", lease_seconds=60)) as a,
        run_store(PostgresStore(url, node="node_b", lease_seconds=60)) as b,
    ):
        tid = "thread_shared"
        await a.insert_run(_run_row("run_1", tid), (tid, "k" * 64, AGENT, None, time.time()), [])
        assert await a.renew_leases() == [tid]
        pending = a.release_lease(tid)
        assert pending is not None
        await pending.result()
        await b.insert_run(_run_row("run_2", tid), None, [])
        assert await b.renew_leases() == [tid]
        assert [r for r, _ in await a.thread_runs(tid)] == ["run_1", "run_2"]
        first, second = await a.run_row("run_1"), await a.run_row("run_2")
        assert first is not None and second is not None and first[8] < second[8]


async def test_a_thread_whose_provider_moved_to_another_node_is_handed_over_there(tmp_path, store):
    """The provider's link moves from A to B while A leads a thread with one
    running and two queued runs: the running run ends with the link, and A --
    alive, serving the agent no more while B does -- hands the thread over:
    its queued runs are offered through B in their order, at once (not after
    the unserved window, which is long here), and callers waiting on A -- one
    following a queued run, one blocked in A2A's SendMessage -- see theirs end."""
    async with a_thread_held_on_a(tmp_path, unserved_grace_seconds=3600) as (
        a,
        b,
        peer,
        script,
        http_a,
        http_b,
        nursery,
        thread,
        ids,
    ):
        a2a = A2A(http_a, f"/a2a/{peer.fingerprint}/{AGENT}")
        followed: list[dict[str, Any]] = []

        async def follow_on_a() -> None:
            async with http_a.stream("GET", f"/agui/runs/{ids[2]}/events") as events:
                async for line in events.aiter_lines():
                    if line.startswith("data: "):
                        followed.append(json.loads(line[len("data: ") :]))

        nursery.start_soon(follow_on_a)
        blocked: list[dict[str, Any]] = []

        async def blocking_send_on_a() -> None:
            answer = await a2a.send(
                "fourth", message_id="msg-fourth", context_id=thread, immediately=False
            )
            blocked.append(answer)

        nursery.start_soon(blocking_send_on_a)
        await eventually(lambda: _runs_on(http_a, thread, 4), "the blocking send's run queued on A")
        peer.set_url(b.provider_url)  # where it reconnects
        assert peer.link is not None
        await peer.link.drop()

        for run_id in ids:
            await wait_status(http_b, run_id, TERMINAL)
        runs = {run_id: await get_run(http_b, run_id) for run_id in ids}
        assert runs[ids[0]]["status"] == "failed", runs[ids[0]]
        for run_id in ids[1:]:
            a_settled_run_once(runs[run_id], "completed")
        await eventually(lambda: _true(bool(blocked)), "the blocking send answered on A")
        fourth = blocked[0]["result"]["task"]
        assert fourth["status"]["state"] == "TASK_STATE_COMPLETED", fourth
        on_b = [o.run_id for o in peer.offer_log if o.link.number > 1]
        assert on_b == [*ids[1:], fourth["id"]], on_b
        assert await metric(http_a, "funduq_threads_handed_over_total") == 1
        assert await metric(http_b, "funduq_threads_taken_over_total") == 1
        await eventually(
            lambda: _followed_to_the_end(followed), "the follower on A saw the run end"
        )
        assert [e["type"] for e in followed].count("RUN_FINISHED") == 1


async def _runs_on(http: httpx.AsyncClient, thread: str, count: int) -> bool:
    return len((await http.get(f"/threads/{thread}")).json()["runs"]) >= count


async def _true(value: bool) -> bool:
    return value


async def _followed_to_the_end(events: list[dict[str, Any]]) -> bool:
    return bool(events) and events[-1]["type"] == "RUN_FINISHED"
