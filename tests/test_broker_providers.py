"""Providers coming and going (DESIGN §2 "Offering", "Silence is not a
verdict"): offline agents, the grace window, a provider leaving while it holds
runs, the quality counters and withdrawal, and the races around arrival."""

import trio
from broker_support import (
    AGENT,
    Provider,
    accepted,
    advance,
    broker,
    events_of,
    last_offer_for,
    offered_runs,
    online,
    quiet,
    record_of,
    reply,
    start,
    status_of,
    user_input,
)

AGENT_OFFLINE = "agent_offline"
NO_PROVIDER = "no_provider_took_it"
LEFT = "provider_left_holding_it"


def run_error(reason):
    return {"type": "RUN_ERROR", "message": reason, "code": reason}


async def failed_with(funduq, run_id, reason):
    record = await record_of(funduq, run_id)
    assert (record["status"], record["metadata"].get("failureReason")) == ("failed", reason)
    assert events_of(record)[-1] == run_error(reason)
    return record


# -- 7. offline agents and the grace window ---------------------------------------------------


async def test_a_run_for_an_agent_with_no_provider_fails_agent_offline_at_once(
    tmp_path, mock_clock
):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        p.session.detach()
        await quiet()
        assert not await online(funduq)
        t = await funduq.start_run(p.key, AGENT, user_input())
        record = await failed_with(funduq, t.run_id, AGENT_OFFLINE)
        assert events_of(record) == [run_error(AGENT_OFFLINE)]
        assert p.link.offers == []


async def test_queued_runs_of_an_agent_that_loses_its_provider_fail_after_the_grace(
    tmp_path, mock_clock
):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        x = await accepted(funduq, p)
        a = await start(funduq, p)
        b = await start(funduq, p, thread_id=a.thread_id, text="behind")
        assert await status_of(funduq, a.run_id) == "queued"
        p.session.detach()
        await advance(mock_clock, 44)
        assert await status_of(funduq, a.run_id) == "queued"
        assert await status_of(funduq, b.run_id) == "queued"
        await advance(mock_clock, 1.5)  # past the default 45 s
        await failed_with(funduq, a.run_id, NO_PROVIDER)
        await failed_with(funduq, b.run_id, NO_PROVIDER)
        assert offered_runs(p.link) == [x.run_id]


async def test_the_grace_window_is_configurable(tmp_path, mock_clock):
    async with broker(tmp_path, unserved_grace_seconds=10) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        await accepted(funduq, p)
        a = await start(funduq, p)
        p.session.detach()
        await advance(mock_clock, 9)
        assert await status_of(funduq, a.run_id) == "queued"
        await advance(mock_clock, 1.5)
        await failed_with(funduq, a.run_id, NO_PROVIDER)


async def test_an_agent_dropped_by_a_republish_takes_the_grace_road(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach(AGENT, "other")
        await accepted(funduq, p)
        a = await start(funduq, p)
        await advance(mock_clock, 100)  # the window runs from the drop, not from start-up
        await p.session.register([{"name": "other", "description": "", "card": {}, "metadata": {}}])
        await quiet()
        assert not await online(funduq, AGENT)
        await advance(mock_clock, 44)
        assert await status_of(funduq, a.run_id) == "queued"
        await advance(mock_clock, 2)
        await failed_with(funduq, a.run_id, NO_PROVIDER)


async def test_queued_runs_keep_their_place_when_the_provider_returns_inside_the_grace(
    tmp_path, mock_clock
):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        await accepted(funduq, p)
        a = await start(funduq, p)
        b = await start(funduq, p, thread_id=a.thread_id, text="behind")
        p.session.detach()
        await advance(mock_clock, 30)
        await p.attach()
        await quiet()
        assert offered_runs(p.link) == [a.run_id]  # the head first, on the new link
        p.session.answer(last_offer_for(p.link, a.run_id), "accepted")
        await advance(mock_clock, 30)  # past the original window: nothing gives up
        assert await status_of(funduq, a.run_id) == "running"
        assert await status_of(funduq, b.run_id) == "queued"  # waits for the one place
        p.stream(a.run_id, *reply(a.run_id, a.thread_id))  # frees it
        await quiet()
        assert offered_runs(p.link) == [a.run_id, b.run_id]


async def test_a_served_agents_queued_run_waits_indefinitely(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        x = await accepted(funduq, p)
        a = await start(funduq, p)
        for _ in range(12):
            await advance(mock_clock, 3600)
        assert await status_of(funduq, a.run_id) == "queued"
        assert await status_of(funduq, x.run_id) == "running"
        assert offered_runs(p.link) == [x.run_id]
        p.stream(x.run_id, *reply(x.run_id, x.thread_id))
        await quiet()
        assert offered_runs(p.link) == [x.run_id, a.run_id]


# -- 11. leaving while holding; silence is not a verdict ------------------------------------------


async def test_a_provider_leaving_while_holding_a_run_fails_it_at_once(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        events = reply(a.run_id, a.thread_id)[:2]
        p.stream(a.run_id, *events, finish=False)
        p.session.detach()
        record = await failed_with(funduq, a.run_id, LEFT)  # no time passed
        assert events_of(record) == [*events, run_error(LEFT)]


async def test_leaving_while_holding_counts_abandoned_across_a_reconnect(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        held = [await accepted(funduq, p) for _ in range(3)]
        first_link = p.link
        p.session.detach()
        await p.attach()  # reconnects at once; the counters are the key's, not the link's
        await quiet()
        for t in held:
            await failed_with(funduq, t.run_id, LEFT)
        assert first_link.closed is None  # it left on its own
        assert p.link.closed is not None and "abandoned" in p.link.closed
        assert not await online(funduq)


async def test_two_abandoned_runs_do_not_withdraw(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        held = [await accepted(funduq, p) for _ in range(2)]
        p.session.detach()
        await p.attach()
        await quiet()
        for t in held:
            await failed_with(funduq, t.run_id, LEFT)
        assert p.link.closed is None
        assert await online(funduq)


async def test_a_quiet_provider_keeps_its_run(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        await advance(mock_clock, 1801)  # past the undelivered window: counted, not settled
        assert await status_of(funduq, a.run_id) == "running"
        for _ in range(24):
            await advance(mock_clock, 3600)
        assert await status_of(funduq, a.run_id) == "running"
        assert p.link.closed is None and p.link.cancels == []
        p.stream(a.run_id, *reply(a.run_id, a.thread_id))  # a day later, it delivers
        assert await status_of(funduq, a.run_id) == "completed"


async def test_the_undelivered_window_is_read_when_a_message_waits_as_when_the_lane_waits(
    tmp_path, mock_clock
):
    """A held run's lane arms the window's clock only when it must wait; a
    message already waiting is taken without it. Past the window, that
    message is not taken first: the window is counted before it, as the
    clock's scope, entered past its deadline, counted it."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        lane = funduq.lanes[a.run_id]
        record, providers = funduq.record, funduq.providers
        append, count = record.append_events, providers.count
        gate = trio.Event()
        published_when_counted: list[int] = []

        async def held_append(*args, **kw):
            await gate.wait()
            return await append(*args, **kw)

        async def seen_count(key, counter):
            if counter == "undelivered":
                published_when_counted.append(len(lane.feed.events))
            await count(key, counter)

        record.append_events, providers.count = held_append, seen_count
        events = reply(a.run_id, a.thread_id)
        p.stream(a.run_id, events[0], finish=False)
        await quiet()  # the lane writes the first event: its write waits at the gate
        p.stream(a.run_id, events[1], finish=False)  # waits in the inbox meanwhile
        await advance(mock_clock, 1801)  # past the window: nobody's clock was armed
        assert published_when_counted == []
        gate.set()
        await quiet()
        assert published_when_counted == [1]  # counted before the waiting event was taken
        record.append_events = append
        p.stream(a.run_id, *events[2:])
        assert await status_of(funduq, a.run_id) == "completed"
        assert published_when_counted == [1]  # once
        assert [e["type"] for e in events_of(await record_of(funduq, a.run_id))] == [
            e["type"] for e in events
        ]


async def test_undelivered_counts_once_per_run_and_withdraws_at_the_allowance(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        first = [await accepted(funduq, p) for _ in range(2)]
        await advance(mock_clock, 1801)
        for _ in range(5):  # two runs, each counted once, however long they stay quiet
            await advance(mock_clock, 3600)
        assert p.link.closed is None
        assert [await status_of(funduq, t.run_id) for t in first] == ["running", "running"]
        third = await accepted(funduq, p)
        await advance(mock_clock, 1799)
        assert p.link.closed is None
        await advance(mock_clock, 2)
        assert p.link.closed is not None and "undelivered" in p.link.closed
        assert not await online(funduq)
        for t in [*first, third]:  # withdrawal is what settles what it held
            await failed_with(funduq, t.run_id, LEFT)


# -- 4/12. misdeclared, withdrawal, reconnecting -------------------------------------------------


async def _decline(funduq, p, run_id):
    p.session.answer(last_offer_for(p.link, run_id), "declined")
    await quiet()


async def _republish(p):
    await p.session.register([{"name": AGENT, "description": "", "card": {}, "metadata": {}}])
    await quiet()


async def test_two_declines_do_not_withdraw(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        await _decline(funduq, p, a.run_id)
        await _republish(p)
        await _decline(funduq, p, a.run_id)
        assert p.link.closed is None
        assert await online(funduq)
        assert await status_of(funduq, a.run_id) == "queued"


async def test_the_third_decline_withdraws_the_provider(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        for n in range(3):
            if n:
                await _republish(p)
            assert p.link.closed is None
            await _decline(funduq, p, a.run_id)
        assert p.link.closed is not None and "misdeclared" in p.link.closed
        assert not await online(funduq)
        assert offered_runs(p.link) == [a.run_id] * 3


async def test_the_allowance_is_configurable(tmp_path, mock_clock):
    async with broker(tmp_path, quality_allowance=1) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        await _decline(funduq, p, a.run_id)
        assert p.link.closed is not None and "misdeclared" in p.link.closed


async def test_withdrawal_settles_what_it_held_and_reconnecting_restores_service(
    tmp_path, mock_clock
):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        held = await accepted(funduq, p)
        d = await start(funduq, p)
        q = await start(funduq, p, thread_id=d.thread_id, text="behind")
        for n in range(3):
            if n:
                await _republish(p)
            await _decline(funduq, p, d.run_id)
        withdrawn_link = p.link
        assert withdrawn_link.closed is not None and "misdeclared" in withdrawn_link.closed
        assert not await online(funduq)
        await failed_with(funduq, held.run_id, LEFT)  # at once
        await advance(mock_clock, 40)  # the queued ones take the grace road
        assert await status_of(funduq, d.run_id) == "queued"
        assert await status_of(funduq, q.run_id) == "queued"
        # Coming back restores service...
        await p.attach()
        await quiet()
        assert await online(funduq)
        assert offered_runs(p.link) == [d.run_id]
        await advance(mock_clock, 20)  # the grace window no longer applies
        assert await status_of(funduq, q.run_id) == "queued"
        # ...with the record intact: one more strike withdraws again.
        await _decline(funduq, p, d.run_id)
        assert p.link.closed is not None and "misdeclared" in p.link.closed
        assert not await online(funduq)
        await advance(mock_clock, 46)
        await failed_with(funduq, d.run_id, NO_PROVIDER)
        await failed_with(funduq, q.run_id, NO_PROVIDER)


async def test_a_new_connection_under_the_same_key_replaces_the_first(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        old = p.link
        await p.attach()
        assert old.closed is not None
        await failed_with(funduq, a.run_id, LEFT)
        assert await online(funduq)
        b = await start(funduq, p)
        assert offered_runs(p.link) == [b.run_id] and old.offers[-1][1]["runId"] == a.run_id


# -- 16. races -------------------------------------------------------------------------------------


async def test_provider_leaving_between_arrival_and_the_lanes_first_step(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        start_lane = funduq._start_lane

        def start_then_leave(row, **kw):
            lane = start_lane(row, **kw)
            p.session.detach()  # the lane is laned, its task has not run
            return lane

        funduq._start_lane = start_then_leave
        t = await funduq.start_run(p.key, AGENT, user_input())
        funduq._start_lane = start_lane
        await failed_with(funduq, t.run_id, AGENT_OFFLINE)
        assert p.link.offers == []


async def test_provider_leaving_before_a_second_runs_lane_first_step(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)  # the thread's task exists already
        p.stream(a.run_id, *reply(a.run_id, a.thread_id), finish=False)
        start_lane = funduq._start_lane

        def start_then_leave(row, **kw):
            lane = start_lane(row, **kw)
            p.session.detach()  # the lane is laned, its task has not run
            return lane

        funduq._start_lane = start_then_leave
        t = await funduq.start_run(p.key, AGENT, user_input("more"), thread_id=a.thread_id)
        funduq._start_lane = start_lane
        await failed_with(funduq, t.run_id, AGENT_OFFLINE)
        await failed_with(funduq, a.run_id, LEFT)
        for _ in range(4):
            await advance(mock_clock, 3600)
        assert offered_runs(p.link) == [a.run_id]


async def test_provider_leaving_while_an_offer_waits_takes_the_grace_road(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        assert await status_of(funduq, a.run_id) == "offering"
        p.session.detach()
        assert await status_of(funduq, a.run_id) == "queued"
        await advance(mock_clock, 44)
        assert await status_of(funduq, a.run_id) == "queued"
        await advance(mock_clock, 2)
        await failed_with(funduq, a.run_id, NO_PROVIDER)


async def test_an_offer_accepted_just_before_its_provider_left(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await start(funduq, p)
        # Answer then leave, with no checkpoint between: the lane reads the
        # answer only after the provider is already gone.
        p.session.answer(last_offer_for(p.link, a.run_id), "accepted")
        p.session.report(a.run_id, reply(a.run_id, a.thread_id)[0])
        p.session.detach()
        record = await failed_with(funduq, a.run_id, LEFT)
        assert record["events"][-1]["event"] == run_error(LEFT)


async def test_many_runs_racing_a_leaving_provider_all_settle(tmp_path, mock_clock):
    """Runs at every stage when the provider goes: none is left queued forever."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=2).attach()
        held = await accepted(funduq, p)
        offering = await start(funduq, p)
        waiting = await start(funduq, p)
        behind = await start(funduq, p, thread_id=waiting.thread_id, text="behind")
        async with trio.open_nursery() as nursery:
            fresh = []

            async def arrive():
                fresh.append(await funduq.start_run(p.key, AGENT, user_input("late")))

            for _ in range(3):
                nursery.start_soon(arrive)
            await trio.testing.wait_all_tasks_blocked()
            p.session.detach()
        await advance(mock_clock, 46)
        statuses = {
            t.run_id: await status_of(funduq, t.run_id)
            for t in [held, offering, waiting, behind, *fresh]
        }
        assert set(statuses.values()) == {"failed"}, statuses
