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

import psycopg
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
    quiet,
    reply,
    resume_input,
    user_input,
)

from funduq_trio.broker.errors import ThreadLedElsewhere
from funduq_trio.broker.funduq import Funduq
from funduq_trio.broker.postgres import PostgresStore
from funduq_trio.broker.store import run_store

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
        with psycopg.connect(stores.database_url, autocommit=True) as conn:
            conn.execute(
                "UPDATE thread_leases SET expires_at = now() - interval '1 second' "
                "WHERE thread_id = %s",
                (tid,),
            )

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
