"""Push notifications on a shared record (issue #12, docs/cluster.md): each
push config is delivered by exactly one node at a time -- the one holding its
delivery lease -- so a receiver gets every update once however many nodes
run; when that node is killed (kill -9) another takes the config over once
the lease lapses and goes on from the durable cursor, in order.

The nodes are real `serve` processes (cluster_support.py) on a schema made
for the test, the provider is played over the real link (`Peer`), and the
receiver is a real HTTP server on loopback (push_support.py). The store's
side (the claim, the fence, the renewal) is checked on `PostgresStore`s
sharing one schema. Waiting is for observable conditions, never a sleep.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import psycopg
import pytest
import stores
import trio
from cluster_support import cluster, metric, online
from google.protobuf.json_format import MessageToDict
from push_support import push_receiver
from reliability_support import (
    A2A,
    HTTP_TIMEOUT,
    Offer,
    Peer,
    eventually,
    finished_event,
    started_event,
    text_events,
    wait_status,
)
from support import running_server

from funduq_trio.broker.postgres import PostgresStore
from funduq_trio.broker.store import run_store
from funduq_trio.protocol import a2a

pytestmark = pytest.mark.parametrize("store", ["postgres"], indirect=True)

AGENT = "scripted"


class Script:
    """The provider: a run is accepted at once; then each item the test
    sends on `steps` is played -- "start" (RUN_STARTED), a text (one whole
    text message), or "finish" (RUN_FINISHED, and the run is over)."""

    def __init__(self) -> None:
        self.steps_in, self.steps = trio.open_memory_channel[str](16)
        self.offered = trio.Event()

    async def on_offer(self, offer: Offer) -> None:
        await offer.answer("accepted")
        self.offered.set()
        n = 0
        async for step in self.steps:
            if step == "start":
                await offer.play([started_event(offer)], finish=False)
            elif step == "finish":
                await offer.play([finished_event(offer)])
                return
            else:
                n += 1
                await offer.play(text_events(f"m-{offer.run_id}-{n}", step), finish=False)

    async def play(self, *steps: str) -> None:
        for step in steps:
            await self.steps_in.send(step)


async def expected_updates(http: httpx.AsyncClient, task_id: str) -> list[dict[str, Any]]:
    """Every update a stream of the (ended) task carries after its snapshot:
    each event's, then the final status -- what the receiver must get."""
    record = (await http.get(f"/runs/{task_id}")).json()
    projection = a2a.TaskProjection(task_id=task_id, context_id=record["threadId"])
    updates = [u for e in record["events"] for u in projection.apply(e["seq"], e["event"])]
    updates.append(projection.settle(record))
    return [MessageToDict(u) for u in updates]


async def test_each_update_reaches_the_receiver_once_with_two_and_three_nodes(
    tmp_path, store
) -> None:
    """A config made on A is delivered by A alone: B, running all along, and
    C, started while the config delivers (before delivery leases, a node
    starting resumed every config still delivering), send nothing."""
    script = Script()
    async with (
        push_receiver() as receiver,
        cluster(tmp_path, push_allow_private=True) as nodes,
        trio.open_nursery() as nursery,
    ):
        a = await nodes.start("a")
        b = await nodes.start("b")
        peer = Peer(a.provider_url, [AGENT], on_offer=script.on_offer)
        await nursery.start(peer.serve)
        async with a.client() as http_a:
            await eventually(lambda: online(http_a, peer.fingerprint), "the agent online on A")
            a2a_a = A2A(http_a, f"/a2a/{peer.fingerprint}/{AGENT}")
            push = {"url": receiver.url, "token": "tok"}
            answer = await a2a_a.call(
                "SendMessage",
                {
                    "message": {"messageId": "m-1", "role": "ROLE_USER", "parts": [{"text": "go"}]},
                    "configuration": {
                        "returnImmediately": True,
                        "taskPushNotificationConfig": push,
                    },
                },
            )
            task_id = answer["result"]["task"]["id"]
            await script.offered.wait()
            await script.play("start", "one")
            await receiver.wait_for(3)  # working, then the first text's artifact updates

            c = await nodes.start("c")
            await script.play("two", "three", "finish")
            await wait_status(http_a, task_id, {"completed"})
            expected = await expected_updates(http_a, task_id)
            await receiver.wait_for(len(expected))

            https = {node.name: node.client() for node in (a, b, c)}
            try:
                # Every node's deliverers done: nothing more can come.
                for http in https.values():
                    await eventually(
                        lambda http=http: _zero(http, "funduq_push_delivering"),
                        "no deliverer left",
                    )
                delivered = {n: await metric(h, "funduq_push_delivered") for n, h in https.items()}
                taken = {
                    n: await metric(h, "funduq_push_taken_over_total") for n, h in https.items()
                }
                renewed = await metric(https["c"], "funduq_lease_renewals_total")
            finally:
                for http in https.values():
                    await http.aclose()
        assert receiver.bodies() == expected
        assert len(expected) > 6
        assert delivered == {"a": len(expected), "b": 0, "c": 0}
        assert taken == {"a": 0, "b": 0, "c": 0}
        assert renewed >= 1  # C's lease rounds ran while the config delivered
        nursery.cancel_scope.cancel()


async def _zero(http: httpx.AsyncClient, name: str) -> bool:
    return await metric(http, name) == 0


async def test_a_killed_delivering_node_s_config_is_taken_over_and_goes_on_in_order(
    tmp_path, store
) -> None:
    """The run is on B (its provider's node); its push config was made on A,
    so A delivers it. The receiver takes two updates and goes away; A is
    killed (kill -9) while it retries; the run goes on and ends on B. Once
    A's lease lapses B takes the config over and the receiver, back, gets
    every remaining update in order, none twice (A's last acknowledged
    update was committed before the kill: see docs/cluster.md for the one
    update that can repeat when it was not)."""
    script = Script()
    async with (
        push_receiver() as receiver,
        cluster(tmp_path, push_allow_private=True) as nodes,
        trio.open_nursery() as nursery,
    ):
        b = await nodes.start("b")
        peer = Peer(b.provider_url, [AGENT], on_offer=script.on_offer)
        await nursery.start(peer.serve)
        async with b.client() as http_b:
            await eventually(lambda: online(http_b, peer.fingerprint), "the agent online on B")
            a = await nodes.start("a")  # its door knows the agent from the record
            a2a_b = A2A(http_b, f"/a2a/{peer.fingerprint}/{AGENT}")
            sent = await a2a_b.send("go", message_id="m-go")
            task_id = sent["result"]["task"]["id"]
            await script.offered.wait()
            await wait_status(http_b, task_id, {"running"})
            async with a.client() as http_a:
                a2a_a = A2A(http_a, f"/a2a/{peer.fingerprint}/{AGENT}")
                made = await a2a_a.call(
                    "CreateTaskPushNotificationConfig",
                    {"taskId": task_id, "id": "hook", "url": receiver.url, "token": "tok"},
                )
                assert "result" in made, made
                assert await metric(http_a, "funduq_push_delivering") == 1
                assert await metric(http_b, "funduq_push_delivering") == 0

                receiver.down_after = 3
                await script.play("start", "one")
                await receiver.wait_for(3)
                # A committed the cursor of all three before it dies.
                await eventually(
                    lambda: _at_least(http_a, "funduq_push_delivered", 3), "A's cursor at 3"
                )
            a.kill9()
            await a.exited.wait()
            await script.play("two", "three", "finish")
            await wait_status(http_b, task_id, {"completed"})
            await receiver.up()
            expected = await expected_updates(http_b, task_id)
            await receiver.wait_for(len(expected))
            await eventually(lambda: _zero(http_b, "funduq_push_delivering"), "B done")
            assert await metric(http_b, "funduq_push_taken_over_total") == 1
            assert await metric(http_b, "funduq_push_delivered") == len(expected) - 3
        assert receiver.bodies() == expected
        assert len(expected) > 6
        await b.wait_logged("taking over")
        nursery.cancel_scope.cancel()


async def test_a_node_stopping_lets_its_configs_go_and_another_resumes_them(
    tmp_path, store
) -> None:
    """An orderly stop (SIGTERM) lets the node's delivery leases go as it
    leaves, so another node's next round resumes its configs without waiting
    a lease; the receiver gets every update once."""
    script = Script()
    async with (
        push_receiver() as receiver,
        cluster(tmp_path, push_allow_private=True) as nodes,
        trio.open_nursery() as nursery,
    ):
        b = await nodes.start("b")
        peer = Peer(b.provider_url, [AGENT], on_offer=script.on_offer)
        await nursery.start(peer.serve)
        async with b.client() as http_b:
            await eventually(lambda: online(http_b, peer.fingerprint), "the agent online on B")
            a = await nodes.start("a")
            sent = await A2A(http_b, f"/a2a/{peer.fingerprint}/{AGENT}").send("go", message_id="m")
            task_id = sent["result"]["task"]["id"]
            await wait_status(http_b, task_id, {"running"})
            async with a.client() as http_a:
                made = await A2A(http_a, f"/a2a/{peer.fingerprint}/{AGENT}").call(
                    "CreateTaskPushNotificationConfig",
                    {"taskId": task_id, "id": "hook", "url": receiver.url},
                )
                assert "result" in made, made
                await script.play("start")
                await receiver.wait_for(1)
            assert _lease_of(task_id) is not None
            assert await a.stop() == 0
            # Let go as A left: nobody's, or already B's (A's leaving tells
            # every node, and B's lease round may claim it at once).
            assert not (_lease_of(task_id) or "").startswith("a_")
            await eventually(
                lambda: _at_least(http_b, "funduq_push_taken_over_total", 1), "B took it over"
            )
            await script.play("one", "finish")
            await wait_status(http_b, task_id, {"completed"})
            expected = await expected_updates(http_b, task_id)
            await receiver.wait_for(len(expected))
            await eventually(lambda: _zero(http_b, "funduq_push_delivering"), "B done")
        assert receiver.bodies() == expected
        nursery.cancel_scope.cancel()


async def test_a_node_stopped_by_cancellation_leaves_the_roster_and_lets_its_configs_go(
    tmp_path, store
) -> None:
    """A node stopped by a cancellation (a nursery cancelled around it, as
    embedding code or this suite stops a server) still leaves the cluster's
    roster and lets its delivery leases go: what another node or an operator
    reads in the record afterwards is no row of it and no config of it. Those
    writes are queued at the stop and the record's last flush commits them
    (a cancelled stop used to wait for the writer, gone by then, until a
    lease ran out). The lease here outlasts the suite's timeout, so a stop
    that waited on it fails this test rather than slowing it."""
    assert stores.database_url is not None
    script = Script()
    async with push_receiver() as receiver, trio.open_nursery() as nursery:
        async with (
            running_server(tmp_path, lease_seconds=3600, push_allow_private=True) as info,
            httpx.AsyncClient(base_url=info.url, timeout=HTTP_TIMEOUT) as http,
        ):
            node = info.funduq.node
            peer = Peer(info.provider_url, [AGENT], on_offer=script.on_offer)
            await nursery.start(peer.serve)
            sent = await A2A(http, f"/a2a/{peer.fingerprint}/{AGENT}").send("go", message_id="m")
            task_id = sent["result"]["task"]["id"]
            made = await A2A(http, f"/a2a/{peer.fingerprint}/{AGENT}").call(
                "CreateTaskPushNotificationConfig",
                {"taskId": task_id, "id": "hook", "url": receiver.url},
            )
            assert "result" in made, made
            await script.play("start")
            await receiver.wait_for(1)
            await eventually(lambda: _roster_has(node), "the node on the roster")
            assert _lease_of(task_id) == node
        # running_server cancelled the server's nursery on the way out.
        assert not await _roster_has(node)
        assert _lease_of(task_id) is None
        nursery.cancel_scope.cancel()


async def _roster_has(node: str) -> bool:
    assert stores.database_url is not None
    with psycopg.connect(stores.database_url, autocommit=True) as conn:
        (rows,) = conn.execute(
            "SELECT count(*) FROM cluster_nodes WHERE node = %s", (node,)
        ).fetchone() or (0,)
    return bool(rows)


def _lease_of(task_id: str) -> str | None:
    assert stores.database_url is not None
    with psycopg.connect(stores.database_url, autocommit=True) as conn:
        row = conn.execute(
            "SELECT lease_node FROM push_configs WHERE task_id = %s", (task_id,)
        ).fetchone()
    assert row is not None
    return row[0]


async def _at_least(http: httpx.AsyncClient, name: str, value: float) -> bool:
    return await metric(http, name) >= value


def _lapse_push_leases() -> None:
    """The delivery leases' time runs out (as a dead node's would)."""
    assert stores.database_url is not None
    with psycopg.connect(stores.database_url, autocommit=True) as conn:
        conn.execute("UPDATE push_configs SET lease_expires = now() - interval '1 second'")


async def test_one_node_holds_a_configs_lease_and_only_it_moves_the_cursor(tmp_path, store) -> None:
    """The store's side: the node that makes a config holds its lease; no
    other node may claim it or move its cursor while it lives; once it
    lapses exactly one claimer wins, the old holder's writes change nothing
    and its renewal no longer lists it; an ended config lets its lease go."""
    assert stores.database_url is not None
    url = stores.database_url
    key = ("task_1", "cfg")
    async with (
        run_store(PostgresStore(url, node="node_a", lease_seconds=60)) as a,
        run_store(PostgresStore(url, node="node_b", lease_seconds=60)) as b,
        run_store(PostgresStore(url, node="node_c", lease_seconds=60)) as c,
    ):
        made = await a.put_push_config(
            *key, "http://x/", "", "{}", (0, -1), per_task=None, active=None
        )
        assert made is None
        assert await b.claim_push_configs() == []
        assert await b.renew_push_leases([key]) == (set(), [])
        assert not await b.push_delivered(*key, (1, 0), 1)
        assert await a.push_delivered(*key, (1, 0), 1)
        assert await a.renew_push_leases([key]) == ({key}, [])

        _lapse_push_leases()
        won: dict[str, Any] = {}

        async def claim(name: str, store: PostgresStore) -> None:
            won[name] = (await store.renew_push_leases([]))[1]

        async with trio.open_nursery() as nursery:
            nursery.start_soon(claim, "b", b)
            nursery.start_soon(claim, "c", c)
        assert sorted(len(rows) for rows in won.values()) == [0, 1], won
        winner, loser = (b, c) if won["b"] else (c, b)
        (row,) = won["b"] or won["c"]
        assert (row[0], row[1]) == key and (row[5], row[6]) == (1, 0)  # the durable cursor

        for stale in (a, loser):
            assert not await stale.push_delivered(*key, (2, 0), 1)
            assert not await stale.end_push_config(*key, "done", None)
        assert await a.renew_push_leases([key]) == (set(), [])
        assert await winner.push_delivered(*key, (2, 0), 1)
        assert await winner.end_push_config(*key, "done", None)
        config = await a.push_config(*key)
        assert json.loads(config[4]) == {} and (config[5], config[6], config[7]) == (2, 0, "done")
        _lapse_push_leases()
        assert await c.claim_push_configs() == []  # ended: nobody delivers it


async def test_a_node_starting_resumes_configs_nobody_delivers(tmp_path, store) -> None:
    """Configs from before delivery leases (no lease) or whose node died are
    resumed by the first node that starts or renews; a live node's are not."""
    assert stores.database_url is not None
    url = stores.database_url
    async with (
        run_store(PostgresStore(url, node="node_a", lease_seconds=60)) as a,
        run_store(PostgresStore(url, node="node_b", lease_seconds=60)) as b,
    ):
        for cid in ("old", "live"):
            await a.put_push_config(
                "t", cid, "http://x/", "", "{}", (0, -1), per_task=None, active=None
            )
        with psycopg.connect(url, autocommit=True) as conn:
            conn.execute("UPDATE push_configs SET lease_node = NULL WHERE id = 'old'")
        claimed = await b.claim_push_configs()
        assert [(r[0], r[1]) for r in claimed] == [("t", "old")]
        assert await b.renew_push_leases([("t", "old")]) == ({("t", "old")}, [])
