"""Offering: events flowing, thread order, places, declines, refusals, the
delivery timeout and the thread queue limit (DESIGN §2 "Offering").

Every test drives the real Funduq on a SQLite file through its facade and its
provider port, under trio's MockClock with no autojump: time moves only when a
test says so, and `quiet()` lets the broker do all it can without time passing.
"""

import contextlib
from unittest import mock

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
    last_offer_for,
    offer_ids_for,
    offered_runs,
    quiet,
    record_of,
    reply,
    start,
    status_of,
    user_input,
)

from funduq_trio.broker.errors import ThreadQueueFull

# -- 1. events flow from provider to caller ---------------------------------------------


async def test_events_flow_to_followers_in_order_and_run_completes(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        t = await start(funduq, p)
        assert offered_runs(p.link) == [t.run_id]
        events = reply(t.run_id, t.thread_id, text="ahoy", deltas=3)
        async with trio.open_nursery() as nursery:
            live = Follower(funduq, t.run_id)
            nursery.start_soon(live.run)
            await quiet()
            p.session.answer(last_offer_for(p.link, t.run_id), "accepted")
            p.stream(t.run_id, *events[:3], finish=False)
            await quiet()
            assert live.items == [(1, events[0]), (2, events[1]), (3, events[2])]
            assert not live.ended.is_set()
            assert await status_of(funduq, t.run_id) == "running"
            # A follower re-attaching from seq 2 gets what it missed, then the rest live.
            late = Follower(funduq, t.run_id, after_seq=2)
            nursery.start_soon(late.run)
            await quiet()
            assert late.items == [(3, events[2])]
            p.stream(t.run_id, *events[3:])
            await quiet()
            assert live.ended.is_set() and late.ended.is_set()
        assert live.items == list(enumerate(events, start=1))
        assert late.items == list(enumerate(events, start=1))[2:]
        assert live.not_yet_durable == [] and late.not_yet_durable == []
        record = await funduq.wait_run(t.run_id)
        assert record["status"] == "completed"
        assert [e["seq"] for e in record["events"]] == list(range(1, len(events) + 1))
        assert events_of(record) == events
        # Re-attaching after the run ended reads the record from the given seq.
        async with trio.open_nursery() as nursery:
            after = Follower(funduq, t.run_id, after_seq=4)
            nursery.start_soon(after.run)
        assert after.items == list(enumerate(events, start=1))[4:]


# -- 2. thread order; threads side by side ----------------------------------------------


async def test_second_utterance_is_offered_once_the_first_is_accepted_not_finished(
    tmp_path, mock_clock
):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        b = await start(funduq, p, thread_id=a.thread_id, text="and another thing")
        assert offered_runs(p.link) == [a.run_id]
        assert await status_of(funduq, b.run_id) == "queued"
        await advance(mock_clock, 4)  # inside the delivery timeout: still only the head
        assert offered_runs(p.link) == [a.run_id]
        p.session.answer(last_offer_for(p.link, a.run_id), "accepted")
        p.stream(a.run_id, reply(a.run_id, a.thread_id)[0], finish=False)
        await quiet()
        assert offered_runs(p.link) == [a.run_id, b.run_id]
        assert await status_of(funduq, a.run_id) == "running"  # not finished, yet b went over
        assert await status_of(funduq, b.run_id) == "offering"


async def test_two_threads_on_one_agent_are_offered_side_by_side(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        c = await start(funduq, p)
        assert a.thread_id != c.thread_id
        assert sorted(offered_runs(p.link)) == sorted([a.run_id, c.run_id])
        assert await status_of(funduq, a.run_id) == "offering"
        assert await status_of(funduq, c.run_id) == "offering"


async def test_a_slow_answer_on_one_thread_delays_no_other_thread(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        slow = await start(funduq, p)  # never answered in this test
        c = await start(funduq, p)
        d = await start(funduq, p, thread_id=c.thread_id, text="second")
        assert offered_runs(p.link) == [slow.run_id, c.run_id]
        p.session.answer(last_offer_for(p.link, c.run_id), "accepted")
        await quiet()
        assert offered_runs(p.link)[-1] == d.run_id  # c's thread moves on
        p.stream(c.run_id, *reply(c.run_id, c.thread_id))
        p.session.answer(last_offer_for(p.link, d.run_id), "accepted")
        p.stream(d.run_id, *reply(d.run_id, d.thread_id))
        await quiet()
        assert await status_of(funduq, c.run_id) == "completed"
        assert await status_of(funduq, d.run_id) == "completed"
        assert await status_of(funduq, slow.run_id) == "offering"  # all of it in zero time


# -- 3. the place is spent when the offer leaves ------------------------------------------


async def test_room_for_one_gets_exactly_one_offer_while_it_thinks(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        a = await start(funduq, p)
        b = await start(funduq, p)
        c = await start(funduq, p)
        assert offered_runs(p.link) == [a.run_id]
        await advance(mock_clock, 4.5)
        assert offered_runs(p.link) == [a.run_id]
        assert await status_of(funduq, b.run_id) == "queued"
        assert await status_of(funduq, c.run_id) == "queued"


async def test_room_for_one_attaching_to_waiting_threads_gets_one_offer(tmp_path, mock_clock):
    """Two threads wait on the grace road; a provider with room for one comes
    back. Both lanes wake at once; only one of them may have an offer out."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        x = await accepted(funduq, p)  # holds the one place
        a = await start(funduq, p)
        b = await start(funduq, p)
        assert offered_runs(p.link) == [x.run_id]
        p.session.detach()
        await advance(mock_clock, 10)
        assert await status_of(funduq, a.run_id) == "queued"
        await p.attach()
        await quiet()
        assert len(p.link.offers) == 1, offered_runs(p.link)
        waiting = {a.run_id, b.run_id} - set(offered_runs(p.link))
        assert [await status_of(funduq, r) for r in waiting] == ["queued"]


async def test_place_returns_when_the_offer_is_refused(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        a = await start(funduq, p)
        b = await start(funduq, p)
        assert offered_runs(p.link) == [a.run_id]
        p.session.answer(last_offer_for(p.link, a.run_id), "refused", "not today")
        await quiet()
        assert offered_runs(p.link) == [a.run_id, b.run_id]


async def test_place_returns_when_the_offer_is_declined(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        a = await start(funduq, p)
        p.session.answer(last_offer_for(p.link, a.run_id), "declined")
        await quiet()
        b = await start(funduq, p)  # arrives after the decline gave the place back
        assert offered_runs(p.link) == [a.run_id, b.run_id]


async def test_place_returns_when_the_held_run_ends(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        a = await accepted(funduq, p)
        b = await start(funduq, p)
        assert offered_runs(p.link) == [a.run_id]  # accepted and held: still no room
        p.stream(a.run_id, *reply(a.run_id, a.thread_id), finish=False)
        await quiet()
        assert offered_runs(p.link) == [a.run_id]  # RUN_FINISHED reported, stream not ended
        assert p.session.finish(a.run_id)
        await quiet()
        assert offered_runs(p.link) == [a.run_id, b.run_id]


async def test_a_freed_place_reaches_a_run_that_can_use_it(tmp_path, mock_clock):
    """The place a finished run frees must reach a run that can take it, not a
    run of an agent the provider no longer serves (which cannot use it)."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach(AGENT, "other")
        x = await accepted(funduq, p)  # fills the one place
        y = await start(funduq, p, agent="other")  # waits for room...
        await p.session.register(
            [{"name": AGENT, "description": "", "card": {}, "metadata": {}}]
        )  # ...then for a provider: "other" dropped
        await quiet()
        z = await start(funduq, p)  # waits for room on a served agent
        assert offered_runs(p.link) == [x.run_id]
        p.stream(x.run_id, *reply(x.run_id, x.thread_id))  # the place frees
        await quiet()
        assert offered_runs(p.link) == [x.run_id, z.run_id]
        assert await status_of(funduq, y.run_id) == "queued"  # on its grace road


async def test_a_freed_place_taken_by_another_head_leaves_the_waiters_waiting(tmp_path, mock_clock):
    """A place frees (and is handed to the longest waiter) at the moment
    another thread's next head, moving up because its head was accepted, takes
    it first. The waiters that find no room must wait -- not hand the wake-up
    back and forth between themselves. Which of the two woken lanes runs first
    is trio's (random) choice, so the scene is played several times."""
    for attempt in range(8):
        async with broker(tmp_path / str(attempt)) as funduq:
            p = await Provider(funduq, max_concurrent=2).attach()
            held = await accepted(funduq, p)
            head = await start(funduq, p)  # offering: the second place
            nxt = await start(funduq, p, thread_id=head.thread_id, text="next")
            w1 = await start(funduq, p)
            w2 = await start(funduq, p)
            assert offered_runs(p.link) == [held.run_id, head.run_id]
            # In one tick: the held run's stream ends, and the offering head is accepted.
            assert p.session.finish(held.run_id)
            p.session.answer(last_offer_for(p.link, head.run_id), "accepted")
            await quiet()
            assert len(p.link.offers) == 3  # exactly one of nxt, w1, w2 got the place
            assert offered_runs(p.link)[2] in {nxt.run_id, w1.run_id, w2.run_id}
            statuses = [await status_of(funduq, t.run_id) for t in (nxt, w1, w2)]
            assert sorted(statuses) == ["offering", "queued", "queued"]


async def test_a_freed_place_reaches_the_next_waiter_when_the_first_is_cancelled(
    tmp_path, mock_clock
):
    """A place frees while the longest waiter is being cancelled: the place
    must still reach the next waiter. Whether the cancel or the freed place
    reaches the first waiter's lane first is trio's (random) choice, so the
    scene is played several times."""
    for attempt in range(8):
        async with broker(tmp_path / str(attempt)) as funduq:
            p = await Provider(funduq, max_concurrent=1).attach()
            held = await accepted(funduq, p)
            first = await start(funduq, p)
            second = await start(funduq, p)
            assert offered_runs(p.link) == [held.run_id]
            # In one tick: the held run's stream ends, and the first waiter is cancelled.
            p.stream(held.run_id, *reply(held.run_id, held.thread_id)[-1:], finish=False)
            await quiet()
            assert p.session.finish(held.run_id)
            answer = await funduq.cancel_run(first.run_id)
            assert answer["status"] == "cancelled"
            await quiet()
            assert offered_runs(p.link) == [held.run_id, second.run_id], attempt
            assert await status_of(funduq, held.run_id) == "completed"


async def test_place_returns_when_the_offer_goes_unanswered(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        a = await start(funduq, p)
        await advance(mock_clock, 5.5)
        ids = offer_ids_for(p.link, a.run_id)
        assert len(ids) == 2 and ids[0] != ids[1]  # the place came back: offered again


# -- 4. declined: back to queued at the head, re-offered only when something changes -----


async def test_declined_run_is_queued_at_the_head_and_not_reoffered_in_a_loop(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        b = await start(funduq, p, thread_id=a.thread_id, text="behind")
        p.session.answer(last_offer_for(p.link, a.run_id), "declined")
        assert await status_of(funduq, a.run_id) == "queued"
        assert offered_runs(p.link) == [a.run_id]  # b stays behind its head
        for _ in range(6):
            await advance(mock_clock, 600)
        assert offered_runs(p.link) == [a.run_id]
        assert await status_of(funduq, a.run_id) == "queued"
        assert await status_of(funduq, b.run_id) == "queued"


async def test_declined_run_is_reoffered_when_a_place_frees(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=2).attach()
        x = await accepted(funduq, p)
        a = await start(funduq, p)
        p.session.answer(last_offer_for(p.link, a.run_id), "declined")
        await quiet()
        assert offered_runs(p.link) == [x.run_id, a.run_id]
        p.stream(x.run_id, *reply(x.run_id, x.thread_id))
        await quiet()
        assert offered_runs(p.link) == [x.run_id, a.run_id, a.run_id]
        assert await status_of(funduq, a.run_id) == "offering"


@contextlib.asynccontextmanager
async def recording_the_decline(funduq, run_id):
    """Hold the lane of ``run_id`` inside the write that records its decline
    (the move back to queued) until the block ends: what happens meanwhile
    happens before the lane can wait for room."""
    gate, held = trio.Event(), trio.Event()
    real_move = funduq.record.move

    async def held_move(rid, to, **changes):
        if rid == run_id and to == "queued" and not gate.is_set():
            held.set()
            await gate.wait()
        return await real_move(rid, to, **changes)

    with mock.patch.object(funduq.record, "move", held_move):
        yield held
        gate.set()
        await quiet()


@pytest.mark.parametrize("change", ["a place frees", "the provider republishes", "nothing"])
async def test_a_change_while_a_decline_is_recorded_reoffers_the_run(tmp_path, mock_clock, change):
    """The provider said "full" while it held x; x ends (or the provider
    publishes again) while the declined run's lane is still recording the
    decline, before it waits for room. The wake-up that went out then found
    no head waiting; the run is offered again all the same, not left queued
    behind an idle provider (found by tests/test_provider_faults.py's
    scenario hanging one run in ten on PostgreSQL). With nothing changing
    meanwhile it waits: a decline by itself wakes nothing (DESIGN §2)."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        x = await accepted(funduq, p)
        a = await start(funduq, p)
        async with recording_the_decline(funduq, a.run_id) as held:
            p.session.answer(last_offer_for(p.link, a.run_id), "declined")
            await quiet()
            assert held.is_set()
            if change == "a place frees":
                p.stream(x.run_id, *reply(x.run_id, x.thread_id))
            elif change == "the provider republishes":
                await p.session.register(
                    [{"name": AGENT, "description": "", "card": {}, "metadata": {}}]
                )
            await quiet()
            assert offered_runs(p.link) == [x.run_id, a.run_id]  # not yet: still recording
        if change == "nothing":
            await advance(mock_clock, 60)
            assert offered_runs(p.link) == [x.run_id, a.run_id]
            assert await status_of(funduq, a.run_id) == "queued"
        else:
            assert offered_runs(p.link) == [x.run_id, a.run_id, a.run_id]
            assert await status_of(funduq, a.run_id) == "offering"


async def test_declined_run_is_reoffered_when_the_provider_republishes(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        b = await start(funduq, p, thread_id=a.thread_id, text="behind")
        p.session.answer(last_offer_for(p.link, a.run_id), "declined")
        await quiet()
        await p.session.register([{"name": AGENT, "description": "", "card": {}, "metadata": {}}])
        await quiet()
        assert offered_runs(p.link) == [a.run_id, a.run_id]  # the head again, not b
        assert await status_of(funduq, b.run_id) == "queued"


async def test_declined_run_is_reoffered_when_the_provider_attaches_again(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        p.session.answer(last_offer_for(p.link, a.run_id), "declined")
        await quiet()
        await p.attach()  # same key, a fresh link
        await quiet()
        assert offered_runs(p.link) == [a.run_id]
        assert await status_of(funduq, a.run_id) == "offering"


# -- 5. refused ----------------------------------------------------------------------------


async def test_refused_run_fails_with_the_reason_verbatim_and_is_offered_once(tmp_path, mock_clock):
    reason = "I only speak Klingon — «nuqneH»; try the other desk"
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        b = await start(funduq, p, thread_id=a.thread_id, text="behind")
        p.session.answer(last_offer_for(p.link, a.run_id), "refused", reason)
        record = await record_of(funduq, a.run_id)
        assert record["status"] == "failed"
        assert record["metadata"]["failureReason"] == reason
        assert events_of(record) == [{"type": "RUN_ERROR", "message": reason, "code": reason}]
        assert offered_runs(p.link) == [a.run_id, b.run_id]  # the thread moved on
        # Nothing that would wake a declined run re-offers a refused one.
        await p.session.register([{"name": AGENT, "description": "", "card": {}, "metadata": {}}])
        await advance(mock_clock, 3600)
        assert len(offer_ids_for(p.link, a.run_id)) == 1
        assert await status_of(funduq, a.run_id) == "failed"


# -- 6. the delivery timeout ---------------------------------------------------------------


async def test_unanswered_offer_returns_to_queued_and_counts_unanswered(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        first = last_offer_for(p.link, a.run_id)
        await advance(mock_clock, 4.9)
        assert offer_ids_for(p.link, a.run_id) == [first]
        assert await status_of(funduq, a.run_id) == "offering"
        await advance(mock_clock, 0.2)  # past the default 5 s
        second = last_offer_for(p.link, a.run_id)
        assert second != first  # back in the queue, and offered afresh
        p.session.answer(first, "accepted")  # too late: funduq stopped waiting for it
        assert await status_of(funduq, a.run_id) == "offering"
        assert p.session.report(a.run_id, reply(a.run_id, a.thread_id)[0]) is False
        # Each unanswered offer counts; the third reaches the allowance (3).
        assert p.link.closed is None
        await advance(mock_clock, 5.1)
        assert p.link.closed is None
        await advance(mock_clock, 5.1)
        assert p.link.closed is not None and "unanswered" in p.link.closed
        assert await status_of(funduq, a.run_id) == "queued"
        assert len(offer_ids_for(p.link, a.run_id)) == 3


async def test_a_late_taker_is_asked_to_stop_once_the_newer_offer_is_declined(tmp_path, mock_clock):
    """The stop held back for the newer offer's sake is sent once that offer
    is declined (the provider still plays the stale take: a runtime declines
    a run it is already running) -- before the run is offered again."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        first = last_offer_for(p.link, a.run_id)
        await advance(mock_clock, 5.1)
        second = last_offer_for(p.link, a.run_id)
        p.session.answer(first, "accepted")  # too late, with `second` out
        assert p.link.cancels == []
        p.session.answer(second, "declined")
        assert p.link.cancels == [a.run_id]
        await quiet()
        await p.session.register(
            [{"name": AGENT, "description": "", "card": {}, "metadata": {}}]
        )  # wakes the declined head
        await quiet()
        assert len(offer_ids_for(p.link, a.run_id)) == 3
        assert p.link.cancels == [a.run_id]


async def test_a_late_acceptance_of_a_run_not_offered_again_is_asked_to_stop(tmp_path, mock_clock):
    """With no newer offer of the run out, the late taker is asked to stop (it
    would work for nobody); the run's next offer leaves after that cancel."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        a = await start(funduq, p)
        first = last_offer_for(p.link, a.run_id)
        b = await start(funduq, p)  # another thread: waits for the only place
        assert offered_runs(p.link) == [a.run_id]
        await advance(mock_clock, 5.1)  # a's offer unanswered: b takes the place
        assert offered_runs(p.link) == [a.run_id, b.run_id]
        p.session.answer(first, "accepted")  # late, and a is not offered again
        await quiet()
        assert p.link.cancels == [a.run_id]
        p.session.answer(last_offer_for(p.link, b.run_id), "accepted")
        p.stream(b.run_id, *reply(b.run_id, b.thread_id))
        await quiet()
        assert offered_runs(p.link) == [a.run_id, b.run_id, a.run_id]


async def test_delivery_timeout_is_configurable(tmp_path, mock_clock):
    async with broker(tmp_path, deliver_timeout_seconds=20) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        await advance(mock_clock, 19)
        assert len(offer_ids_for(p.link, a.run_id)) == 1
        await advance(mock_clock, 2)
        assert len(offer_ids_for(p.link, a.run_id)) == 2


# -- 14. the thread queue limit --------------------------------------------------------------


async def test_thread_queue_limit_refuses_the_next_utterance_loudly(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        head = await start(funduq, p)  # offering, unanswered: still pending
        tid = head.thread_id
        for i in range(7):
            await funduq.start_run(p.key, AGENT, user_input(f"u{i}"), thread_id=tid)
        with pytest.raises(ThreadQueueFull):
            await funduq.start_run(p.key, AGENT, user_input("one too many"), thread_id=tid)
        thread = await funduq.get_thread(tid)
        assert len(thread["runs"]) == 8  # nothing dropped, nothing added
        # Another thread is not affected.
        other = await start(funduq, p)
        assert await status_of(funduq, other.run_id) == "offering"
        # Once the head is accepted it no longer counts: there is room again.
        p.session.answer(last_offer_for(p.link, head.run_id), "accepted")
        await quiet()
        late = await funduq.start_run(p.key, AGENT, user_input("now"), thread_id=tid)
        assert await status_of(funduq, late.run_id) == "queued"


async def test_thread_queue_limit_is_configurable(tmp_path, mock_clock):
    async with broker(tmp_path, thread_queue_limit=2) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        await funduq.start_run(p.key, AGENT, user_input("2"), thread_id=a.thread_id)
        with pytest.raises(ThreadQueueFull):
            await funduq.start_run(p.key, AGENT, user_input("3"), thread_id=a.thread_id)


async def test_a_run_laned_while_its_insert_is_written_counts_once_against_the_limit(
    tmp_path, mock_clock
):
    """A served agent's run joins its thread's pending queue as soon as its
    insert is queued, and stays reserved until the insert is durable. Counted
    in both, a thread one short of its limit refused the next utterance while
    a commit was under way (bench/one_thread.py: 8 callers, limit 8)."""
    async with broker(tmp_path, thread_queue_limit=2) as funduq:
        p = await Provider(funduq).attach()
        tid = (await accepted(funduq, p)).thread_id  # the thread exists, nothing pending
        gate = trio.Event()
        commit = funduq.record._commit

        async def held(ops):
            await gate.wait()
            await commit(ops)

        funduq.record._commit = held
        answers: dict[str, object] = {}

        async def say(text):
            try:
                answers[text] = await funduq.start_run(
                    p.key, AGENT, user_input(text), thread_id=tid
                )
            except ThreadQueueFull as exc:
                answers[text] = exc

        async with trio.open_nursery() as nursery:
            nursery.start_soon(say, "a")
            await quiet()
            # a is laned (in the pending queue), its insert not yet durable.
            assert len(funduq.threads[tid].pending) == 1 and answers == {}
            nursery.start_soon(say, "b")  # a and b: the limit, not over it
            await quiet()
            nursery.start_soon(say, "c")  # one too many
            await quiet()
            assert isinstance(answers.pop("c"), ThreadQueueFull)
            gate.set()
        assert sorted(answers) == ["a", "b"]
        assert not any(isinstance(answer, ThreadQueueFull) for answer in answers.values())
        await quiet()
        thread = await funduq.get_thread(tid)
        assert len(thread["runs"]) == 3  # the first, a and b; nothing of c
        assert {answers["a"].run_id, answers["b"].run_id} <= {r["runId"] for r in thread["runs"]}


async def test_a_link_still_delivering_is_not_charged_for_a_late_answer(tmp_path, mock_clock):
    """An answer travels behind the provider's reports on one link: while the
    link keeps delivering, the delivery timeout runs from the last frame heard,
    and only a whole timeout of the link's silence counts as unanswered."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        busy = await accepted(funduq, p)
        b = await start(funduq, p)
        first = last_offer_for(p.link, b.run_id)
        for _ in range(4):  # 16 s of a link busy with another run's events
            await advance(mock_clock, 4)
            assert p.session.report(busy.run_id, {"type": "STEP_STARTED", "stepName": "s"})
        await quiet()
        assert offer_ids_for(p.link, b.run_id) == [first]
        assert await status_of(funduq, b.run_id) == "offering"
        await advance(mock_clock, 4.9)  # silent, but not yet for a whole timeout
        assert offer_ids_for(p.link, b.run_id) == [first]
        await advance(mock_clock, 0.2)  # now it has been: back in the queue, offered afresh
        assert len(offer_ids_for(p.link, b.run_id)) == 2


async def test_a_late_acceptance_while_the_run_is_offered_again_asks_nothing_to_stop(
    tmp_path, mock_clock
):
    """The provider accepts the first offer after funduq stopped waiting, while
    the second offer of the same run is out. A cancel names a run, not an
    offer: sent now, it would reach the provider after the second offer and
    stop the play funduq is about to hold (which then ends with no RUN_FINISHED
    and no cancel asked: failed provider_stream_ended_without_finishing, for
    nobody's fault). So none is sent; the second play completes the run."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        first = last_offer_for(p.link, a.run_id)
        await advance(mock_clock, 5.1)  # a whole timeout of silence: offered afresh
        second = last_offer_for(p.link, a.run_id)
        assert second != first and p.link.cancels == []
        p.session.answer(first, "accepted")  # too late, with `second` out
        assert p.link.cancels == []
        p.session.answer(second, "accepted")  # in time: the run is held
        await quiet()
        assert await status_of(funduq, a.run_id) == "running"
        p.session.answer(first, "accepted")  # a repeat of the stale answer changes nothing
        assert p.link.cancels == []
        p.stream(a.run_id, *reply(a.run_id, a.thread_id))
        assert (await funduq.wait_run(a.run_id))["status"] == "completed"
