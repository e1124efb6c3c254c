"""Any node takes callers (issue #12, docs/cluster.md "Forwarding"): a
caller's request reaching a node that neither leads the thread nor serves the
agent is carried out, signed, by the node that does -- a new message, a
cancel, a pause's answer -- and the caller follows the run's events where it
is. Every node knows the whole cluster's roster, pushed by a notification.

The nodes are real `serve` processes on one PostgreSQL schema
(cluster_support.py); the provider is played over the real link (`Peer`);
callers are a2a-sdk's client and httpx. Waiting is for observable
conditions, never a sleep and an assertion.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import httpx
import psycopg
import pytest
import stores
import trio
from a2a.types import a2a_pb2 as pb
from cluster_support import Node, cluster, metric, online
from reliability_support import (
    A2A,
    TERMINAL,
    AguiStream,
    Offer,
    Peer,
    event_types,
    eventually,
    finished_event,
    free_port,
    get_run,
    interrupt_outcome,
    started_event,
    text_events,
    user_input,
    wait_status,
)
from test_a2a_door import a2a_client, send_request

pytestmark = pytest.mark.parametrize("store", ["postgres"], indirect=True)

AGENT = "scripted"


class Script:
    """The provider: "hold" runs start and wait for their cancel (then end
    without finishing: cancelled); "slow" runs start and wait for `release`;
    "ask" runs pause; an answer's turn says "resumed"; anything else replies
    "re:{text}" at once."""

    def __init__(self, peer: list[Peer]) -> None:
        self.peer = peer
        self.release = trio.Event()
        self.seen: set[str] = set()
        #: thread id -> the texts offered on it, in offer order.
        self.offered: dict[str, list[str]] = defaultdict(list)

    async def on_offer(self, offer: Offer) -> None:
        answer_turn = offer.run_id in self.seen
        self.seen.add(offer.run_id)
        self.offered[offer.thread_id].append(offer.text)
        await offer.answer("accepted")
        if answer_turn:
            await offer.play(
                [started_event(offer), *text_events(f"m2-{offer.run_id}", "resumed")]
                + [finished_event(offer)]
            )
        elif offer.text.startswith("hold"):
            await offer.play([started_event(offer)], finish=False)
            await self.peer[0].wait_cancel(offer.run_id)
            await offer.finish()
        elif offer.text.startswith("slow"):
            await offer.play([started_event(offer)], finish=False)
            await self.release.wait()
            await offer.play(
                [*text_events(f"m-{offer.run_id}", f"re:{offer.text}"), finished_event(offer)]
            )
        elif offer.text.startswith("ask"):
            await offer.play(
                [started_event(offer), finished_event(offer, outcome=interrupt_outcome(offer))]
            )
        else:
            await offer.play(
                [
                    started_event(offer),
                    *text_events(f"m-{offer.run_id}", f"re:{offer.text}"),
                    finished_event(offer),
                ]
            )


@asynccontextmanager
async def provider_on_a(
    tmp_path: Path,
) -> AsyncIterator[
    tuple[Node, Node, Peer, Script, httpx.AsyncClient, httpx.AsyncClient, trio.Nursery]
]:
    """Nodes A and B, the scripted provider attached to A and its agent online
    on B; a client of each node, and a nursery cancelled on the way out."""
    peers: list[Peer] = []
    script = Script(peers)
    async with cluster(tmp_path) as nodes:
        a = await nodes.start("a")
        b = await nodes.start("b")
        peer = Peer(a.provider_url, [AGENT], on_offer=script.on_offer, max_concurrent_runs=4)
        peers.append(peer)
        async with trio.open_nursery() as nursery, a.client() as http_a, b.client() as http_b:
            await nursery.start(peer.serve)
            await eventually(lambda: online(http_b, peer.fingerprint), "the agent online on B")
            yield a, b, peer, script, http_a, http_b, nursery
            nursery.cancel_scope.cancel()


@asynccontextmanager
async def provider_on_a_and_c(
    tmp_path: Path, *, room: int, reconnect_delay: float = 0.02
) -> AsyncIterator[tuple[list[Node], Peer, Peer, Script, list[httpx.AsyncClient]]]:
    """Nodes A, B and C, the scripted provider linked to A (`peer`) and to C
    (`twin`, the same key), each link with room for ``room`` runs, its agent
    online on all three; a client of each node. B serves nothing."""
    peers: list[Peer] = []
    script = Script(peers)
    async with cluster(tmp_path) as nodes:
        a, b, c = [await nodes.start(name) for name in "abc"]
        peer = Peer(
            a.provider_url,
            [AGENT],
            on_offer=script.on_offer,
            max_concurrent_runs=room,
            reconnect_delay=reconnect_delay,
        )
        twin = Peer(
            c.provider_url,
            [AGENT],
            identity=peer.identity,
            on_offer=script.on_offer,
            max_concurrent_runs=room,
        )
        peers.append(peer)
        async with (
            trio.open_nursery() as nursery,
            a.client() as http_a,
            b.client() as http_b,
            c.client() as http_c,
        ):
            await nursery.start(peer.serve)
            await nursery.start(twin.serve)
            https = [http_a, http_b, http_c]
            for http in https:
                await eventually(lambda h=http: online(h, peer.fingerprint), "the agent online")
            yield [a, b, c], peer, twin, script, https
            nursery.cancel_scope.cancel()


def streamed_text(events: list[pb.StreamResponse]) -> str:
    """The reply's text as the caller sees it: a fast echo may already be
    whole in the stream's opening Task (its artifacts), the rest arrives as
    artifact updates."""
    opening = [
        part.text
        for e in events[:1]
        if e.HasField("task")
        for artifact in e.task.artifacts
        for part in artifact.parts
    ]
    return "".join(opening) + "".join(
        part.text
        for e in events
        if e.HasField("artifact_update")
        for part in e.artifact_update.artifact.parts
    )


def final_state(events: list[pb.StreamResponse]) -> int:
    updates = [e.status_update.status.state for e in events if e.HasField("status_update")]
    return updates[-1]


async def test_a_caller_on_a_node_without_the_provider_is_served_through_the_node_with_it(
    tmp_path, store
):
    """The provider is attached to A only, after B started: B learns of the
    agent (pushed), and B's callers -- a2a-sdk's streaming client, AG-UI --
    send on a new thread and then on the same thread; each message is
    carried out on A, and the replies stream to the caller on B, in order."""
    async with provider_on_a(tmp_path) as (a, b, peer, script, http_a, http_b, nursery):
        async with a2a_client(b, peer.fingerprint, AGENT) as client:
            first = [e async for e in client.send_message(send_request("one"))]
            task = first[0].task
            assert streamed_text(first) == "re:one"
            assert final_state(first) == pb.TaskState.TASK_STATE_COMPLETED
            second = [
                e
                async for e in client.send_message(send_request("two", context_id=task.context_id))
            ]
            assert second[0].task.context_id == task.context_id
            assert streamed_text(second) == "re:two"
            assert final_state(second) == pb.TaskState.TASK_STATE_COMPLETED

        thread = (await http_b.get(f"/threads/{task.context_id}")).json()
        assert [r["runId"] for r in thread["runs"]] == [task.id, second[0].task.id]
        contents = [m.get("content") for m in thread["messages"]]
        assert contents == ["one", "re:one", "two", "re:two"], contents

        # AG-UI on B: a new thread (funduq names it), then the same one.
        url = b.agui_url(peer.fingerprint, AGENT)
        streams: list[AguiStream] = []
        agui_thread_id = "thread-new-on-b"
        for i, text in enumerate(["three", "four"]):
            stream = AguiStream(text)
            body = user_input(text, thread_id=agui_thread_id, message_id=f"m-{i}")
            await nursery.start(stream.run, http_b, url, body)
            await stream.done.wait()
            assert stream.status == 200 and stream.ended_cleanly, stream.error_body
            types = [e["type"] for e in stream.events]
            assert types[0] == "RUN_STARTED" and types[-1] == "RUN_FINISHED", types
            deltas = [e["delta"] for e in stream.events if e["type"] == "TEXT_MESSAGE_CONTENT"]
            assert deltas == [f"re:{text}"]
            streams.append(stream)
            assert stream.thread_id is not None
            agui_thread_id = stream.thread_id
        agui_thread = (await http_b.get(f"/threads/{agui_thread_id}")).json()
        assert [r["runId"] for r in agui_thread["runs"]] == [s.run_id for s in streams]
        assert [r["status"] for r in agui_thread["runs"]] == ["completed"] * 2

        assert script.offered[task.context_id] == ["one", "two"]
        assert await metric(http_b, "funduq_calls_forwarded_total") >= 4
        assert await metric(http_a, "funduq_calls_taken_total") >= 4
        assert b.logged("Traceback") == [], b.lines


async def test_a_cancel_and_an_answer_sent_to_another_node_reach_the_provider(tmp_path, store):
    """A cancel sent to B for a run running on A reaches the provider and the
    run settles cancelled, once; a pause answered through B resumes on A."""
    async with provider_on_a(tmp_path) as (a, b, peer, script, http_a, http_b, nursery):
        a2a_a = A2A(http_a, a.a2a_url(peer.fingerprint, AGENT))
        a2a_b = A2A(http_b, b.a2a_url(peer.fingerprint, AGENT))

        # Started on A; cancelled through B.
        held = (await a2a_a.send("hold on", message_id="msg-hold"))["result"]["task"]
        await wait_status(http_b, held["id"], {"running"})
        cancel = await a2a_b.cancel(held["id"])
        assert "result" in cancel, cancel
        await peer.wait_cancel(held["id"])
        done = await wait_status(http_b, held["id"], TERMINAL)
        assert done["status"] == "cancelled", done
        assert event_types(done).count("RUN_FINISHED") == 0
        assert "RUN_ERROR" not in event_types(done)
        # A second cancel, now that it ended: refused as on one node.
        again = await a2a_b.cancel(held["id"])
        assert again["error"]["code"] == -32002, again  # TaskNotCancelableError

        # Paused on A (asked through A's door); answered through B.
        asked = (await a2a_a.send("ask me", message_id="msg-ask"))["result"]["task"]
        paused = await wait_status(http_b, asked["id"], {"input-required"})
        assert paused["status"] == "input-required"
        answer = await a2a_b.send(
            "yes",
            message_id="msg-yes",
            task_id=asked["id"],
            context_id=asked["contextId"],
            immediately=False,
        )
        assert "result" in answer, answer
        assert answer["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED", answer
        run = await get_run(http_b, asked["id"])
        assert run is not None and run["status"] == "completed", run
        assert event_types(run).count("RUN_FINISHED") == 2  # the pause's and the end's
        assert [o.link.number for o in peer.offers_of(asked["id"])] == [1, 1]


async def test_callers_spread_over_three_nodes_keep_each_threads_order(tmp_path, store):
    """Three nodes; the provider attached to A and C (one key); callers send
    on several threads through all three nodes while each thread's first run
    is held, so later messages reach nodes that do not lead the thread (B
    serves nothing; C serves the agent but must not order A's threads). Each
    thread's runs are offered, recorded and answered in the order they were
    sent, and each run ends once."""
    async with provider_on_a_and_c(tmp_path, room=16) as (_, peer, _, script, https):
        http_b = https[1]
        callers = [A2A(h, f"/a2a/{peer.fingerprint}/{AGENT}") for h in https]

        threads: dict[str, list[str]] = {}
        sent: dict[str, list[str]] = {}
        for t in range(4):
            # Each thread starts on another node; its first run is held.
            first = await callers[t % 3].send(f"slow {t}-0", message_id=f"m-{t}-0")
            task = first["result"]["task"]
            threads[task["contextId"]] = [task["id"]]
            sent[task["contextId"]] = [f"slow {t}-0"]

        async def more(thread: str, t: int) -> None:
            for k in range(1, 4):
                text = f"slow {t}-{k}"
                caller = callers[(t + k) % 3]
                answer = await caller.send(text, message_id=f"m-{t}-{k}", context_id=thread)
                assert "result" in answer, answer
                threads[thread].append(answer["result"]["task"]["id"])
                sent[thread].append(text)

        async with trio.open_nursery() as senders:
            for t, thread in enumerate(list(threads)):
                senders.start_soon(more, thread, t)
        script.release.set()

        for thread, run_ids in threads.items():
            for run_id in run_ids:
                await wait_status(http_b, run_id, TERMINAL)
            record = (await http_b.get(f"/threads/{thread}")).json()
            assert [r["runId"] for r in record["runs"]] == run_ids
            assert [r["status"] for r in record["runs"]] == ["completed"] * len(run_ids)
            assert script.offered[thread] == sent[thread]
            replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
            # (A thread's runs are offered in order, and may then run side by
            # side: their replies are recorded as they finish.)
            assert sorted(replies) == sorted(f"re:{text}" for text in sent[thread])
            users = [m["content"] for m in record["messages"] if m["role"] == "user"]
            assert users == sent[thread]
            for run_id in run_ids:
                run = await get_run(http_b, run_id)
                assert run is not None
                assert event_types(run).count("RUN_FINISHED") == 1, run
                assert "RUN_ERROR" not in event_types(run)
        assert await metric(http_b, "funduq_calls_forwarded_total") > 0


def _database_secret() -> str:
    assert stores.database_url is not None
    with psycopg.connect(stores.database_url, autocommit=True) as conn:
        row = conn.execute("SELECT secret FROM cluster_secret WHERE id = 1").fetchone()
    assert row is not None
    return str(row[0])


def _signed(secret: str, op: str, body: bytes, at: float) -> dict[str, str]:
    stamp = repr(at)
    mac = hmac.new(secret.encode(), f"{op}\n{stamp}\n".encode() + body, hashlib.sha256)
    return {
        "Content-Type": "application/json",
        "Funduq-Cluster-Time": stamp,
        "Funduq-Cluster-Signature": mac.hexdigest(),
    }


async def test_forged_calls_between_nodes_are_refused_and_change_nothing(tmp_path, store):
    """The internal route takes only calls signed with the cluster's secret,
    made now: absent, forged, stale or replayed-for-another-op signatures
    are refused 401 and record nothing."""
    async with cluster(tmp_path) as nodes:
        a = await nodes.start("a")
        peer = Peer(a.provider_url, [AGENT], max_concurrent_runs=1)
        async with (
            trio.open_nursery() as nursery,
            a.client() as http,
        ):
            await nursery.start(peer.serve)
            args = {
                "provider": peer.key,
                "agent": AGENT,
                "run_input": user_input("forged", thread_id="thread-forged", message_id="m-f"),
                "thread_id": "thread-forged",
                "metadata": None,
                "create_unknown_thread": True,
            }
            body = json.dumps(args).encode()
            url = "/internal/cluster/start_run"
            secret = _database_secret()
            attempts = {
                "unsigned": {"Content-Type": "application/json"},
                "another secret": _signed("x" * 64, "start_run", body, time.time()),
                "stale": _signed(secret, "start_run", body, time.time() - 3600),
                "signed for another op": _signed(secret, "cancel_run", body, time.time()),
            }
            for what, headers in attempts.items():
                r = await http.post(url, content=body, headers=headers)
                assert r.status_code == 401, (what, r.status_code, r.text)
                assert r.json()["error"]["code"] == "not_signed", r.text
            tampered = _signed(secret, "start_run", body, time.time())
            r = await http.post(url, content=body.replace(b"forged", b"f0rged"), headers=tampered)
            assert r.status_code == 401, r.text
            assert (await http.get("/threads/thread-forged")).status_code == 404
            assert (await http.get("/runs", params={"threadId": "thread-forged"})).json()[
                "runs"
            ] == []
            assert peer.offer_log == []
            nursery.cancel_scope.cancel()


async def test_a_signed_call_sent_again_is_refused_by_every_node_and_changes_nothing(
    tmp_path, store
):
    """Each signed call between nodes is taken once across the cluster: the
    same call (bytes and headers, as captured on the wire) sent again while
    its time is fresh -- to the node that took it or to another -- is refused
    401 `not_signed` and records nothing."""
    assert stores.database_url is not None
    peers: list[Peer] = []
    script = Script(peers)
    async with cluster(tmp_path) as nodes:
        a = await nodes.start("a")
        b = await nodes.start("b")
        peer = Peer(a.provider_url, [AGENT], on_offer=script.on_offer)
        peers.append(peer)
        async with (
            trio.open_nursery() as nursery,
            a.client() as http_a,
            b.client() as http_b,
        ):
            await nursery.start(peer.serve)
            await eventually(lambda: online(http_b, peer.fingerprint), "the agent online on B")
            body = json.dumps(
                {
                    "provider": peer.key,
                    "agent": AGENT,
                    "run_input": user_input("once", thread_id="thread-once", message_id="m-1"),
                    "thread_id": "thread-once",
                    "metadata": None,
                    "create_unknown_thread": True,
                }
            ).encode()
            headers = _signed(_database_secret(), "start_run", body, time.time())
            url = "/internal/cluster/start_run"
            taken = await http_a.post(url, content=body, headers=headers)
            assert taken.status_code == 200, taken.text
            run_id, thread = taken.json()["ok"]["runId"], taken.json()["ok"]["threadId"]
            await wait_status(http_a, run_id, {"completed"})
            for http in (http_a, http_b):
                again = await http.post(url, content=body, headers=headers)
                assert again.status_code == 401, again.text
                assert again.json()["error"]["code"] == "not_signed", again.text
            with psycopg.connect(stores.database_url, autocommit=True) as conn:
                runs = conn.execute("SELECT id FROM runs WHERE thread_id = %s", (thread,))
                assert [r[0] for r in runs] == [run_id]
            assert [o.run_id for o in peer.offer_log] == [run_id]
            assert script.offered[thread] == ["once"]
            nursery.cancel_scope.cancel()


async def test_a_leader_that_cannot_be_reached_is_answered_503_and_nothing_is_recorded(
    tmp_path, store
):
    """Forwarding's limit: a thread whose live leader does not answer (here a
    lease row naming a node whose URL nobody listens on) is refused 503
    `thread_led_elsewhere`, and nothing is recorded."""
    assert stores.database_url is not None
    async with provider_on_a(tmp_path) as (_, b, peer, script, _, http_b, _):
        a2a_b = A2A(http_b, b.a2a_url(peer.fingerprint, AGENT))
        first = (await a2a_b.send("hello", message_id="msg-1"))["result"]["task"]
        await wait_status(http_b, first["id"], {"completed"})
        thread = first["contextId"]
        assert stores.database_url is not None
        with psycopg.connect(stores.database_url, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO cluster_nodes (node, url, expires_at) "
                "VALUES ('node_gone', %s, now() + interval '1 hour')",
                (f"http://127.0.0.1:{free_port()}",),
            )
            conn.execute(
                "INSERT INTO thread_leases (thread_id, node, expires_at) "
                "VALUES (%s, 'node_gone', now() + interval '1 hour') "
                "ON CONFLICT (thread_id) DO UPDATE SET node = EXCLUDED.node, "
                "expires_at = EXCLUDED.expires_at",
                (thread,),
            )
        before = (await http_b.get(f"/threads/{thread}")).json()
        answer = await a2a_b.send("again", message_id="msg-2", context_id=thread)
        details = (answer.get("error") or {}).get("data") or []
        assert any(
            d.get("metadata", {}).get("reason") == "thread_led_elsewhere" for d in details
        ), answer
        r = await http_b.post(
            b.agui_url(peer.fingerprint, AGENT),
            json=user_input("again too", thread_id=thread, message_id="msg-3"),
        )
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "thread_led_elsewhere", r.text
        assert "cannot be reached" in r.json()["error"]["message"], r.text
        assert (await http_b.get(f"/threads/{thread}")).json() == before
