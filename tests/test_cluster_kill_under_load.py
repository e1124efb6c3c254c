"""A node killed with kill -9 while the cluster is busy (issue #12, item 5):
three nodes on one PostgreSQL, the provider linked to two of them, callers
on all three. Per-thread order, one owner per run and one terminal status
per run hold across the death, and no two nodes offer a thread's head.

The nodes are real `serve` processes (cluster_support.py), the provider is
played over the real link (`Peer`), callers are httpx. Waiting is for
observable conditions, never a sleep and an assertion.
"""

from __future__ import annotations

import pytest
import trio
from reliability_support import (
    A2A,
    TERMINAL,
    Offer,
    Peer,
    event_types,
    eventually,
    get_run,
    wait_status,
)
from test_cluster import a_settled_run_once
from test_cluster_forwarding import AGENT, provider_on_a_and_c

pytestmark = pytest.mark.parametrize("store", ["postgres"], indirect=True)

THREADS = 6
#: Runs each link of the provider holds at once: the rest of a busy
#: thread's runs wait queued on its leader.
ROOM = 2


def offers_seen(thread: str, peer: Peer, twin: Peer) -> list[str]:
    """Every offer of ``thread`` the provider's links read, in the order they
    were read: its text, run, the node it came from (``peer``'s first link is
    A's, its later ones B's; ``twin``'s are C's), the answers given and
    whether a cancel followed -- kept in a failure's message as evidence."""

    def via(offer: Offer) -> str:
        if offer.link.peer is twin:
            return f"C#{offer.link.number}"
        return f"{'A' if offer.link.number == 1 else 'B'}#{offer.link.number}"

    offers = sorted(
        (o for o in [*peer.offer_log, *twin.offer_log] if o.thread_id == thread),
        key=lambda o: o.received,
    )
    return [
        f"#{o.received} {o.text!r} {o.run_id} via {via(o)} answers={o.answers}"
        + (" cancelled" if o.cancelled else "")
        for o in offers
    ]


async def send_until_taken(caller: A2A, text: str, thread: str) -> str:
    """Send as a client of a cluster does: a 503 `thread_led_elsewhere` (the
    thread's leader cannot be reached and its lease has not lapsed yet)
    recorded nothing, so the same message is sent again. Anything else but
    an accepted task fails the test."""
    while True:
        answer = await caller.send(text, message_id=f"m-{text}", context_id=thread)
        if "result" in answer:
            return str(answer["result"]["task"]["id"])
        details = (answer.get("error") or {}).get("data") or []
        reasons = {d.get("metadata", {}).get("reason") for d in details}
        assert reasons == {"thread_led_elsewhere"}, answer
        await trio.sleep(0.05)


async def test_a_node_killed_under_load_loses_nothing_and_keeps_every_threads_order(
    tmp_path, store
):
    """Six threads, three led by A and three by C, each with held runs and
    more queued behind them (the provider takes two runs a link at a time).
    A is killed with kill -9 while C's runs go on and callers keep sending
    to every thread through B and C (sends refused while A's leases lapse are
    sent again). Afterwards: every accepted run ended exactly once; what A
    had offered failed orphaned_by_restart and nothing else failed; each
    thread's runs are recorded, and were offered, once each in the order
    they were sent."""
    async with provider_on_a_and_c(tmp_path, room=ROOM, reconnect_delay=0.05) as (
        (a, b, c),
        peer,
        twin,
        script,
        (http_a, http_b, http_c),
    ):
        path = f"/a2a/{peer.fingerprint}/{AGENT}"
        on_a, on_b, on_c = A2A(http_a, path), A2A(http_b, path), A2A(http_c, path)

        # Each thread starts where a link is (A for the first half, C for
        # the rest), so that node leads it; two more held runs each come
        # through all three nodes and queue behind the link's room.
        runs: dict[str, list[str]] = {}
        sent: dict[str, list[str]] = {}
        for t in range(THREADS):
            caller = on_a if t < THREADS // 2 else on_c
            text = f"slow {t}-0"
            answer = await caller.send(text, message_id=f"m-{text}")
            task = answer["result"]["task"]
            runs[task["contextId"]], sent[task["contextId"]] = [task["id"]], [text]
        for k in (1, 2):
            for t, thread in enumerate(list(runs)):
                text = f"slow {t}-{k}"
                caller = (on_a, on_b, on_c)[(t + k) % 3]
                runs[thread].append(await send_until_taken(caller, text, thread))
                sent[thread].append(text)

        def offered_through_a() -> list[str]:
            return [o.run_id for o in peer.offer_log if o.link.number == 1]

        async def both_links_full() -> bool:
            return len(offered_through_a()) == ROOM and len(twin.offer_log) == ROOM

        await eventually(both_links_full, "each link holding its room")
        held_by_a = offered_through_a()
        led_by_a = list(runs)[: THREADS // 2]
        queued_on_a = [r for thread in led_by_a for r in runs[thread] if r not in held_by_a]
        assert len(queued_on_a) == 3 * len(led_by_a) - ROOM
        for run_id in queued_on_a:
            assert (await get_run(http_b, run_id) or {}).get("status") == "queued", run_id

        # kill -9 A while C's runs are let go and callers keep sending.
        peer.set_url(b.provider_url)  # where the provider reconnects
        a.kill9()
        await a.exited.wait()
        script.release.set()

        async def keep_sending(t: int, thread: str) -> None:
            for k in (3, 4):
                text = f"quick {t}-{k}"
                caller = (on_b, on_c)[(t + k) % 2]
                runs[thread].append(await send_until_taken(caller, text, thread))
                sent[thread].append(text)

        async with trio.open_nursery() as senders:
            for t, thread in enumerate(list(runs)):
                senders.start_soon(keep_sending, t, thread)

        every_run = [r for ids in runs.values() for r in ids]
        for run_id in every_run:
            await wait_status(http_b, run_id, TERMINAL)

        for thread, ids in runs.items():
            record = (await http_c.get(f"/threads/{thread}")).json()
            evidence = "\n".join(
                [
                    f"thread {thread}",
                    f"sent: {list(zip(sent[thread], ids, strict=True))}",
                    f"recorded: {[(r['runId'], r.get('status')) for r in record['runs']]}",
                    f"script.offered: {script.offered[thread]}",
                    "offers read (every link, in reading order):",
                    *offers_seen(thread, peer, twin),
                    "the nodes' takeovers and letting go:",
                    *(
                        f"{node.name}: {line}"
                        for node in (a, b, c)
                        for line in node.lines
                        if "took over" in line or "letting go" in line or "handed over" in line
                    ),
                ]
            )
            assert [r["runId"] for r in record["runs"]] == ids, evidence
            # once each, in order
            assert script.offered[thread] == sent[thread], evidence
            users = [m["content"] for m in record["messages"] if m["role"] == "user"]
            assert users == sent[thread], thread
        for run_id in every_run:
            run = await get_run(http_c, run_id)
            assert run is not None
            if run_id in held_by_a:
                a_settled_run_once(run, "failed", "orphaned_by_restart")
                assert "RUN_FINISHED" not in event_types(run)
            else:
                a_settled_run_once(run, "completed")
                assert event_types(run).count("RUN_FINISHED") == 1, run
                assert "RUN_ERROR" not in event_types(run), run
