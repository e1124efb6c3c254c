"""Cancels are requests (DESIGN §2 "Cancelling"): a queued run is cancelled at
once; an offering run's cancel waits behind the provider's answer; a running
run is asked to stop and the funnel decides; a paused or ended run refuses."""

import pytest
import trio
from broker_support import (
    AGENT,
    Provider,
    accepted,
    advance,
    broker,
    events_of,
    interrupt_finish,
    last_offer_for,
    offer_ids_for,
    offered_runs,
    quiet,
    record_of,
    reply,
    resume_input,
    start,
    status_of,
    user_input,
)

from funduq_trio.broker.errors import RunNotCancellable, RunNotFound

# -- queued ------------------------------------------------------------------------------


async def test_cancel_of_a_queued_run_behind_the_head_is_at_once_and_never_offered(
    tmp_path, mock_clock
):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        b = await start(funduq, p, thread_id=a.thread_id, text="b")
        c = await start(funduq, p, thread_id=a.thread_id, text="c")
        answer = await funduq.cancel_run(b.run_id)
        assert answer["status"] == "cancelled"  # at once: nobody has it
        record = await record_of(funduq, b.run_id)
        assert record["status"] == "cancelled" and record["events"] == []  # no RUN_ERROR
        p.session.answer(last_offer_for(p.link, a.run_id), "accepted")
        await quiet()
        assert offered_runs(p.link) == [a.run_id, c.run_id]  # b skipped, c next
        assert p.link.cancels == []


async def test_cancel_of_a_queued_head_lets_the_next_run_of_its_thread_go(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        x = await accepted(funduq, p)  # fills the provider
        a = await start(funduq, p)
        b = await start(funduq, p, thread_id=a.thread_id, text="b")
        assert await status_of(funduq, a.run_id) == "queued"
        answer = await funduq.cancel_run(a.run_id)
        assert answer["status"] == "cancelled"
        p.stream(x.run_id, *reply(x.run_id, x.thread_id))  # the place frees
        await quiet()
        assert offered_runs(p.link) == [x.run_id, b.run_id]
        assert await status_of(funduq, a.run_id) == "cancelled"


async def test_cancel_of_a_run_before_its_lane_first_ran_is_never_offered(tmp_path, mock_clock):
    """Its lane has not taken a place yet (the thread's head holds the only
    one): cancelled at once, never offered."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        head = await start(funduq, p)
        t = await funduq.start_run(p.key, AGENT, user_input(), thread_id=head.thread_id)
        answer = await funduq.cancel_run(t.run_id)
        assert answer["status"] == "cancelled"
        await quiet()
        assert offered_runs(p.link) == [head.run_id]


async def test_a_run_offered_as_it_arrives_is_offering_when_the_door_answers(
    tmp_path, mock_clock, store
):
    """A place free as the run arrives: its insert and its `offering` move
    share one commit (first-in first-out), so when the door answers the
    record already says offering."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        commits = funduq.record.commits
        t = await funduq.start_run(p.key, AGENT, user_input())
        status = funduq.record.read_now(
            lambda c: c.execute("SELECT status FROM runs WHERE id=?", (t.run_id,)).fetchone()[0]
        )
        if store == "sqlite":
            assert funduq.record.commits == commits + 1
            assert status == "offering"
        else:
            # A shared record's own writes (heartbeat, leases; the mock clock
            # jumps while a commit is in its worker thread) may wake the
            # writer first: the insert then commits alone, queued.
            assert status in ("queued", "offering")
        # Read by the lane before the offer leaves, a cancel now would still
        # be applied at once (the lane's drain after its offering write);
        # once the offer is out it waits behind the answer.
        await quiet()
        assert offered_runs(p.link) == [t.run_id]
        answer = await funduq.cancel_run(t.run_id)
        assert answer["status"] == "offering"
        p.session.answer(last_offer_for(p.link, t.run_id), "declined")
        assert await status_of(funduq, t.run_id) == "cancelled"


# -- offering: the cancel waits behind the answer ---------------------------------------------


async def test_cancel_during_offering_then_accepted_runs_and_asks_to_stop(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        answer = await funduq.cancel_run(a.run_id)
        assert answer["status"] == "offering"  # not decided in funduq's favour
        assert await status_of(funduq, a.run_id) == "offering"
        assert p.link.cancels == []
        p.session.answer(last_offer_for(p.link, a.run_id), "accepted")
        await quiet()
        # Handed over, so it is a running run asked to stop -- never "cancelled" here.
        assert p.link.cancels == [a.run_id]
        assert await status_of(funduq, a.run_id) == "cancelling"
        p.stream(a.run_id, reply(a.run_id, a.thread_id)[0])  # stopped without RUN_FINISHED
        record = await record_of(funduq, a.run_id)
        assert record["status"] == "cancelled"
        assert [e["type"] for e in events_of(record)] == ["RUN_STARTED"]


async def test_repeated_cancels_during_offering_are_one_request(tmp_path, mock_clock):
    """Each cancel of an offering run is answered at once; only the first is
    told to the lane, so a flood of them piles nothing up (finding 6)."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        lane = funduq.lanes[a.run_id]
        for _ in range(500):
            answer = await funduq.cancel_run(a.run_id)
            assert answer["status"] == "offering"
        assert lane._send.statistics().current_buffer_used <= 1
        p.session.answer(last_offer_for(p.link, a.run_id), "accepted")
        await quiet()
        assert p.link.cancels == [a.run_id]  # asked to stop once
        assert await status_of(funduq, a.run_id) == "cancelling"
        p.stream(a.run_id, reply(a.run_id, a.thread_id)[0])
        assert (await record_of(funduq, a.run_id))["status"] == "cancelled"
        assert not lane._cancels


async def test_cancel_during_offering_then_declined_ends_cancelled_never_handed_over(
    tmp_path, mock_clock
):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        b = await start(funduq, p, thread_id=a.thread_id, text="b")
        await funduq.cancel_run(a.run_id)
        p.session.answer(last_offer_for(p.link, a.run_id), "declined")
        record = await record_of(funduq, a.run_id)
        assert record["status"] == "cancelled" and record["events"] == []
        assert p.link.cancels == []
        assert offered_runs(p.link) == [a.run_id, b.run_id]  # the thread moves on
        # Nothing re-offers it.
        await p.session.register([{"name": AGENT, "description": "", "card": {}, "metadata": {}}])
        await advance(mock_clock, 60)
        assert len(offer_ids_for(p.link, a.run_id)) == 1


async def test_cancel_during_offering_then_unanswered_ends_cancelled(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        await funduq.cancel_run(a.run_id)
        await advance(mock_clock, 4)
        assert await status_of(funduq, a.run_id) == "offering"
        await advance(mock_clock, 1.5)
        assert await status_of(funduq, a.run_id) == "cancelled"
        assert len(offer_ids_for(p.link, a.run_id)) == 1
        assert p.link.cancels == []


async def test_cancel_in_the_same_tick_as_the_accept_is_read_after_it(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        p.session.answer(last_offer_for(p.link, a.run_id), "accepted")
        answer = await funduq.cancel_run(a.run_id)  # before the lane has read the answer
        assert answer["status"] in ("offering", "running", "cancelling")
        assert await status_of(funduq, a.run_id) == "cancelling"
        assert p.link.cancels == [a.run_id]
        p.stream(a.run_id, *reply(a.run_id, a.thread_id))
        assert await status_of(funduq, a.run_id) == "completed"


async def _cancels(funduq, run_id, n):
    """Send n cancels of one run in the same tick; return each one's outcome
    once the broker is quiet (None: that caller is still waiting)."""
    outcomes = [None] * n

    async def ask(i):
        try:
            outcomes[i] = (await funduq.cancel_run(run_id))["status"]
        except RunNotCancellable:
            outcomes[i] = "not cancellable"

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(ask, i)
        await quiet()
        nursery.cancel_scope.cancel()  # a caller left hanging fails the test, not the run
    return outcomes


async def test_two_cancels_of_a_queued_run_both_get_an_answer(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        b = await start(funduq, p, thread_id=a.thread_id, text="b")
        outcomes = await _cancels(funduq, b.run_id, 2)
        assert None not in outcomes, outcomes  # neither caller left waiting forever
        assert "cancelled" in outcomes and set(outcomes) <= {"cancelled", "not cancellable"}
        assert await status_of(funduq, b.run_id) == "cancelled"


async def test_a_cancel_arriving_as_the_stream_ends_gets_an_answer(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        p.stream(a.run_id, *reply(a.run_id, a.thread_id))  # ends: Finish is in the lane's inbox
        outcomes = await _cancels(funduq, a.run_id, 1)  # ...and the cancel right behind it
        assert outcomes != [None], "cancel_run never returned"
        assert await status_of(funduq, a.run_id) == "completed"


# -- running ----------------------------------------------------------------------------------


async def test_an_accepted_cancel_is_answered_as_applied_though_the_run_ends_at_once(
    tmp_path, mock_clock
):
    """The provider ignores the cancel and finishes before the caller is
    answered: the answer is the run as the cancel left it (cancelling: A2A's
    working plus the pending-cancel marker), not the completed run a read
    made a moment later would find -- that would tell the caller its accepted
    cancel hit an ended run."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        events = reply(a.run_id, a.thread_id)
        p.stream(a.run_id, *events[:2], finish=False)
        await quiet()
        ended = trio.Event()
        real_read = funduq.record.read

        async def read_once_the_run_ended(fn):
            await ended.wait()
            return await real_read(fn)

        funduq.record.read = read_once_the_run_ended
        answers = []

        async def cancel():
            answers.append(await funduq.cancel_run(a.run_id))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(cancel)
            await quiet()
            assert p.link.cancels == [a.run_id]  # applied: the provider was asked
            p.stream(a.run_id, *events[2:])  # ...and finishes anyway
            await quiet()
            ended.set()
        funduq.record.read = real_read
        (answer,) = answers
        assert answer["status"] == "cancelling"
        assert "cancelRequestedBy" in answer["metadata"]["funduq"]
        assert events_of(answer) == events[:2]
        assert await status_of(funduq, a.run_id) == "completed"  # what the provider did


async def test_cancel_of_a_running_run_tells_the_provider_and_relays_until_it_stops(
    tmp_path, mock_clock
):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        events = reply(a.run_id, a.thread_id)
        p.stream(a.run_id, *events[:2], finish=False)
        answer = await funduq.cancel_run(a.run_id)
        assert answer["status"] in ("running", "cancelling")
        assert await status_of(funduq, a.run_id) == "cancelling"
        assert p.link.cancels == [a.run_id]
        p.stream(a.run_id, events[2], finish=False)  # still relayed while cancelling
        record = await record_of(funduq, a.run_id)
        assert record["status"] == "cancelling"
        assert events_of(record) == events[:3]
        assert p.session.finish(a.run_id)
        record = await record_of(funduq, a.run_id)
        assert record["status"] == "cancelled"
        assert events_of(record) == events[:3]  # no RUN_ERROR for a cancelled run


async def test_provider_that_ignores_the_cancel_and_finishes_is_completed(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        await funduq.cancel_run(a.run_id)
        assert await status_of(funduq, a.run_id) == "cancelling"
        p.stream(a.run_id, *reply(a.run_id, a.thread_id))
        assert await status_of(funduq, a.run_id) == "completed"


# -- refused cancels ------------------------------------------------------------------------


async def test_cancel_of_a_paused_run_is_refused_and_the_run_stays_answerable(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        p.stream(
            a.run_id, interrupt_finish(a.run_id, a.thread_id, [{"id": "i1", "reason": "approval"}])
        )
        before = await record_of(funduq, a.run_id)
        assert before["status"] == "input-required"
        with pytest.raises(RunNotCancellable):
            await funduq.cancel_run(a.run_id)
        assert await record_of(funduq, a.run_id) == before
        assert p.link.cancels == []
        ticket = await funduq.answer_pause(a.run_id, resume_input("i1"))
        assert ticket.run_id == a.run_id
        await quiet()
        assert offered_runs(p.link) == [a.run_id, a.run_id]


@pytest.mark.parametrize("ending", ["completed", "failed", "cancelled"])
async def test_cancel_of_an_ended_run_is_refused(tmp_path, mock_clock, ending):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        if ending == "completed":
            p.stream(a.run_id, *reply(a.run_id, a.thread_id))
        elif ending == "failed":
            p.stream(a.run_id, reply(a.run_id, a.thread_id)[0])
        else:
            await funduq.cancel_run(a.run_id)
            assert p.session.finish(a.run_id)
        before = await record_of(funduq, a.run_id)
        assert before["status"] == ending
        with pytest.raises(RunNotCancellable):
            await funduq.cancel_run(a.run_id)
        assert await record_of(funduq, a.run_id) == before
        assert p.link.cancels == ([a.run_id] if ending == "cancelled" else [])


async def test_cancel_of_an_unknown_run_is_not_found(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        with pytest.raises(RunNotFound):
            await funduq.cancel_run("run_000000000000000000000000")
