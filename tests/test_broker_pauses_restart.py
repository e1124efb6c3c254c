"""Pauses (DESIGN §2 "Pauses") and restarts (DESIGN §2 "Restarts"): an
answered pause reopens the same run id in its thread's order with its event
log continuing; a new Funduq on the same data directory re-queues what was
queued, fails what a dead link held, and keeps pauses answerable."""

import pytest
import trio
from broker_support import (
    AGENT,
    Follower,
    Provider,
    accepted,
    advance,
    broker,
    events_of,
    interrupt_finish,
    last_offer_for,
    offered_runs,
    quiet,
    record_of,
    reply,
    resume_input,
    start,
    status_of,
    user_input,
)

from funduq_trio.broker.errors import RunNotPaused, ThreadQueueFull

ORPHANED = "orphaned_by_restart"
ASK = [
    {
        "id": "ask-1",
        "reason": "approval",
        "message": "Proceed?",
        "expiresAt": "2030-06-01T00:00:00Z",
    }
]


async def pause(funduq, p, thread_id=None):
    """A run accepted by p that streamed a little and paused on ASK."""
    t = await accepted(funduq, p, thread_id=thread_id)
    events = reply(t.run_id, t.thread_id)[:-1] + [interrupt_finish(t.run_id, t.thread_id, ASK)]
    p.stream(t.run_id, *events)
    assert await status_of(funduq, t.run_id) == "input-required"
    return t, events


# -- 13. pauses ----------------------------------------------------------------------------------


async def test_an_answered_pause_reopens_the_same_run_in_thread_order_and_its_log_continues(
    tmp_path, mock_clock
):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a, first = await pause(funduq, p)
        # A paused run holds nothing back: later runs of its thread go over.
        b = await accepted(funduq, p, thread_id=a.thread_id)
        c = await start(funduq, p, thread_id=a.thread_id, text="c")
        assert offered_runs(p.link) == [a.run_id, b.run_id, c.run_id]
        assert await status_of(funduq, c.run_id) == "offering"
        ticket = await funduq.answer_pause(a.run_id, resume_input("ask-1", {"ok": True}))
        assert (ticket.run_id, ticket.thread_id) == (a.run_id, a.thread_id)
        assert await status_of(funduq, a.run_id) == "queued"
        assert offered_runs(p.link) == [a.run_id, b.run_id, c.run_id]  # behind c, its head
        p.session.answer(last_offer_for(p.link, c.run_id), "accepted")
        await quiet()
        assert offered_runs(p.link) == [a.run_id, b.run_id, c.run_id, a.run_id]
        reoffer = p.link.offers[-1][1]
        assert reoffer["runInput"]["runId"] == a.run_id
        assert reoffer["runInput"]["resume"] == [
            {"interruptId": "ask-1", "status": "resolved", "payload": {"ok": True}}
        ]
        p.session.answer(last_offer_for(p.link, a.run_id), "accepted")
        second = reply(a.run_id, a.thread_id, text="done")
        async with trio.open_nursery() as nursery:
            follower = Follower(funduq, a.run_id)
            nursery.start_soon(follower.run)
            await quiet()
            p.stream(a.run_id, *second)
            await quiet()
            assert follower.ended.is_set()
        record = await record_of(funduq, a.run_id)
        assert record["status"] == "completed"
        assert events_of(record) == first + second
        assert [e["seq"] for e in record["events"]] == list(range(1, len(first + second) + 1))
        assert follower.items == list(enumerate(first + second, start=1))


async def test_a_pause_can_be_answered_once(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a, _ = await pause(funduq, p)
        await funduq.answer_pause(a.run_id, resume_input("ask-1"))
        with pytest.raises(RunNotPaused):
            await funduq.answer_pause(a.run_id, resume_input("ask-1"))
        b = await accepted(funduq, p)
        with pytest.raises(RunNotPaused):
            await funduq.answer_pause(b.run_id, resume_input("ask-1"))


async def test_a_pause_has_no_deadline_of_funduqs(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a, _ = await pause(funduq, p)
        for _ in range(48):
            await advance(mock_clock, 3600)
        record = await record_of(funduq, a.run_id)
        assert record["status"] == "input-required"
        assert record["metadata"]["interrupts"] == ASK
        await funduq.answer_pause(a.run_id, resume_input("ask-1"))
        assert await status_of(funduq, a.run_id) == "offering"


async def test_answering_a_pause_is_exempt_from_the_thread_queue_limit(tmp_path, mock_clock):
    async with broker(tmp_path, thread_queue_limit=2) as funduq:
        p = await Provider(funduq).attach()
        a, _ = await pause(funduq, p)
        await start(funduq, p, thread_id=a.thread_id, text="q1")  # offering
        await start(funduq, p, thread_id=a.thread_id, text="q2")  # queued
        with pytest.raises(ThreadQueueFull):
            await funduq.start_run(p.key, AGENT, user_input("q3"), thread_id=a.thread_id)
        ticket = await funduq.answer_pause(a.run_id, resume_input("ask-1"))
        assert ticket.run_id == a.run_id
        assert await status_of(funduq, a.run_id) == "queued"


# -- 15. restarts ---------------------------------------------------------------------------------


async def test_restart_fails_what_a_dead_link_held_and_keeps_pauses_answerable(
    tmp_path, mock_clock
):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        offering = await start(funduq, p)
        running = await accepted(funduq, p)
        running_events = reply(running.run_id, running.thread_id)[:3]
        p.stream(running.run_id, *running_events, finish=False)
        cancelling = await accepted(funduq, p)
        await funduq.cancel_run(cancelling.run_id)
        reported = await accepted(funduq, p)  # said RUN_ERROR itself, never finished
        own_error = {"type": "RUN_ERROR", "message": "boom"}
        p.stream(reported.run_id, own_error, finish=False)
        paused, paused_events = await pause(funduq, p)
        assert [await status_of(funduq, t.run_id) for t in (offering, running, cancelling)] == [
            "offering",
            "running",
            "cancelling",
        ]
        identity = p.identity

    async with broker(tmp_path) as funduq:
        error = {"type": "RUN_ERROR", "message": ORPHANED, "code": ORPHANED}
        for t, before in ((offering, []), (running, running_events), (cancelling, [])):
            record = await record_of(funduq, t.run_id)
            assert record["status"] == "failed"
            assert record["metadata"]["failureReason"] == ORPHANED
            assert events_of(record) == [*before, error]
            assert [e["seq"] for e in record["events"]] == list(range(1, len(before) + 2))
        record = await record_of(funduq, reported.run_id)
        assert record["status"] == "failed" and events_of(record) == [own_error]
        # The paused run is still answerable, and answering it works as before.
        record = await record_of(funduq, paused.run_id)
        assert record["status"] == "input-required"
        assert record["metadata"]["interrupts"] == ASK
        assert await funduq.paused_run(paused.thread_id) == paused.run_id
        p = await Provider(funduq, identity=identity).attach()
        await funduq.answer_pause(paused.run_id, resume_input("ask-1"))
        await quiet()
        assert offered_runs(p.link) == [paused.run_id]
        p.session.answer(last_offer_for(p.link, paused.run_id), "accepted")
        more = reply(paused.run_id, paused.thread_id, text="resumed")
        p.stream(paused.run_id, *more)
        record = await record_of(funduq, paused.run_id)
        assert record["status"] == "completed"
        assert events_of(record) == paused_events + more
        assert [e["seq"] for e in record["events"]] == list(range(1, len(paused_events + more) + 1))


async def test_restart_requeues_queued_runs_in_arrival_order(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        head = await start(funduq, p)  # offering when we stop: orphaned
        queued = [await start(funduq, p, thread_id=head.thread_id, text=f"q{i}") for i in range(3)]
        assert offered_runs(p.link) == [head.run_id]
        identity = p.identity

    async with broker(tmp_path) as funduq:
        assert await status_of(funduq, head.run_id) == "failed"
        for t in queued:
            assert await status_of(funduq, t.run_id) == "queued"
        p = await Provider(funduq, identity=identity).attach()
        for i, t in enumerate(queued):
            await quiet()
            assert offered_runs(p.link) == [q.run_id for q in queued[: i + 1]]
            p.session.answer(last_offer_for(p.link, t.run_id), "accepted")
        for t in queued:
            p.stream(t.run_id, *reply(t.run_id, t.thread_id))
            assert await status_of(funduq, t.run_id) == "completed"


async def test_restart_requeued_runs_take_the_grace_road_when_nobody_serves(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        head = await start(funduq, p)
        behind = await start(funduq, p, thread_id=head.thread_id, text="behind")

    async with broker(tmp_path) as funduq:
        await advance(mock_clock, 44)
        assert await status_of(funduq, behind.run_id) == "queued"
        await advance(mock_clock, 2)
        record = await record_of(funduq, behind.run_id)
        assert record["status"] == "failed"
        assert record["metadata"]["failureReason"] == "no_provider_took_it"


async def test_restart_with_a_pause_in_the_middle_of_a_thread(tmp_path, mock_clock):
    """The paused run and a later queued run of the same thread both survive:
    the queued one goes first (it is pending), the answered pause after it."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        paused, _ = await pause(funduq, p)
        blocker = await accepted(funduq, p)  # fills the one place
        later = await start(funduq, p, thread_id=paused.thread_id, text="later")
        assert await status_of(funduq, later.run_id) == "queued"
        identity = p.identity

    async with broker(tmp_path) as funduq:
        assert await status_of(funduq, blocker.run_id) == "failed"
        p = await Provider(funduq, identity=identity, max_concurrent=1).attach()
        await quiet()
        assert offered_runs(p.link) == [later.run_id]
        await funduq.answer_pause(paused.run_id, resume_input("ask-1"))
        await quiet()
        assert offered_runs(p.link) == [later.run_id]  # behind the thread's head
        p.session.answer(last_offer_for(p.link, later.run_id), "accepted")
        p.stream(later.run_id, *reply(later.run_id, later.thread_id))
        await quiet()
        assert offered_runs(p.link) == [later.run_id, paused.run_id]


async def test_quality_counters_survive_a_restart(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        for n in range(2):
            if n:
                await p.session.register(
                    [{"name": AGENT, "description": "", "card": {}, "metadata": {}}]
                )
                await quiet()
            p.session.answer(last_offer_for(p.link, a.run_id), "declined")
            await quiet()
        assert p.link.closed is None
        identity = p.identity

    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, identity=identity).attach()
        await quiet()
        assert offered_runs(p.link) == [a.run_id]  # still queued, offered again
        p.session.answer(last_offer_for(p.link, a.run_id), "declined")
        await quiet()
        assert p.link.closed is not None and "misdeclared" in p.link.closed
