"""No fault wedges a run (DESIGN §12, issue #11): a lane that raises, an offer
the link keeps chattering past, a cancel during the offering write, a record
that cannot write for a while, a move the record refused, an agent nobody
serves. The real Funduq on each store, under MockClock with no autojump."""

from __future__ import annotations

import sqlite3

import pytest
import trio
from broker_support import (
    AGENT,
    Provider,
    a_followed_run,
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
    relayed_and_recorded,
    reply,
    resume_input,
    start,
    status_of,
    user_input,
)

from funduq_trio.broker.errors import RecordUnavailable
from funduq_trio.broker.record import Record
from funduq_trio.protocol import reasons


def run_errors(run: dict) -> list[dict]:
    return [e for e in events_of(run) if e["type"] == "RUN_ERROR"]


# -- 1. a lane that raises ----------------------------------------------------------------


async def test_a_lane_that_raises_fails_its_run_alone_and_frees_everything(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        a = await accepted(funduq, p)
        b = await start(funduq, p, thread_id=a.thread_id)  # waits: the thread's next, no room
        assert offered_runs(p.link) == [a.run_id]

        async def broken(run_id, events):
            raise RuntimeError("a bug in the lane's write")

        funduq.record.append_events = broken
        p.stream(a.run_id, *reply(a.run_id, a.thread_id), finish=False)
        run = await record_of(funduq, a.run_id)
        assert run["status"] == "failed"
        assert run["metadata"]["failureReason"] == reasons.FUNDUQ_ERROR
        assert [e["code"] for e in run_errors(run)] == [reasons.FUNDUQ_ERROR]
        assert p.link.cancels == [a.run_id]  # the provider is asked to stop
        # Its place came back and its thread moved on: the next run is offered.
        assert offered_runs(p.link) == [a.run_id, b.run_id]
        # Later reports for the dead run are refused.
        assert not p.session.report(a.run_id, {"type": "STEP_STARTED", "stepName": "s"})
        assert not p.session.finish(a.run_id)


# -- 2. the delivery timeout is bounded ------------------------------------------------------


async def test_an_offer_is_unanswered_after_a_bounded_time_however_busy_the_link(
    tmp_path, mock_clock
):
    """The timeout runs on the link's silence, but at most 5 timeouts in all
    (deliver_timeout_seconds = 5 by default: 25 s)."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        busy = await accepted(funduq, p)
        b = await start(funduq, p)
        first = last_offer_for(p.link, b.run_id)
        for _ in range(6):  # 24 s of a link busy with another run's events
            await advance(mock_clock, 4)
            assert p.session.report(busy.run_id, {"type": "STEP_STARTED", "stepName": "s"})
        assert offer_ids_for(p.link, b.run_id) == [first]
        await advance(mock_clock, 1.1)  # 25.1 s since it left, chatter or not
        assert p.session.report(busy.run_id, {"type": "STEP_STARTED", "stepName": "s"})
        await quiet()
        assert len(offer_ids_for(p.link, b.run_id)) == 2  # back in the queue, offered afresh
        assert funduq.providers.counters[p.key]["unanswered"] == 1


# -- 3. a cancel during the queued -> offering write ---------------------------------------


async def test_a_cancel_during_the_offering_write_cancels_before_anything_leaves(
    tmp_path, mock_clock
):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        move = funduq.record.move
        answers: list[dict] = []
        cancelled = trio.Event()

        async def cancel(run_id: str) -> None:
            answers.append(await funduq.cancel_run(run_id))
            cancelled.set()

        async with trio.open_nursery() as nursery:

            async def move_with_a_cancel_arriving(run_id, to, **kw):
                if to == "offering" and not answers and not cancelled.is_set():
                    lane = funduq.lanes[run_id]
                    nursery.start_soon(cancel, run_id)
                    # Hold the write until the cancel is in the lane's inbox.
                    while lane._send.statistics().current_buffer_used == 0:
                        await trio.sleep(0)
                return await move(run_id, to, **kw)

            funduq.record.move = move_with_a_cancel_arriving
            t = await funduq.start_run(p.key, AGENT, user_input())
            await cancelled.wait()
        funduq.record.move = move
        assert answers[0]["status"] == "cancelled"  # the caller's answer: cancelled at once
        assert p.link.offers == []  # nothing left
        assert await status_of(funduq, t.run_id) == "cancelled"
        # The place came back: the next run is offered.
        u = await start(funduq, p)
        assert offered_runs(p.link) == [u.run_id]


# -- 4. a record that cannot write for a while ---------------------------------------------


@pytest.fixture(params=["in the transaction", "at BEGIN"])
def disk_full(request, monkeypatch, store):
    """While ``state["full"]``, every write fails as the store's database fails
    when its disk is full: inside the transaction (each write's statement
    fails), or before it (the group commit's BEGIN itself fails, as on an I/O
    error or a PostgreSQL server gone)."""
    state = {"full": False}
    if store == "postgres":
        import psycopg

        from funduq_trio.broker.postgres import PostgresStore as Store

        full, broken = (
            psycopg.OperationalError("could not extend file: No space left on device"),
            psycopg.OperationalError("server closed the connection unexpectedly"),
        )
        begin_name, begin = "_commit", Store._commit

        async def failing_begin(self, ops):
            if state["full"]:
                raise broken
            return await begin(self, ops)
    else:
        Store = Record
        full = sqlite3.OperationalError("database or disk is full")
        begin_name, begin = "_begin_now", Record._begin_now

        def failing_begin(self):
            if state["full"]:
                raise sqlite3.OperationalError("disk I/O error")
            return begin(self)

    apply = Store._apply

    def failing_apply(self, ops, **kwargs):
        if not state["full"]:
            return apply(self, ops, **kwargs)
        if kwargs.get("begun"):
            self._writer_conn.execute("ROLLBACK")
        for op in ops:
            op.error = full

    if request.param == "at BEGIN":
        monkeypatch.setattr(Store, begin_name, failing_begin)
    else:
        monkeypatch.setattr(Store, "_apply", failing_apply)
    return state


async def test_failed_writes_are_retried_and_every_run_settles_once_they_succeed(
    tmp_path, mock_clock, disk_full
):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        a = await accepted(funduq, p)
        b = await start(funduq, p)
        assert await funduq.ready()
        disk_full["full"] = True
        p.stream(a.run_id, *reply(a.run_id, a.thread_id))
        p.session.answer(last_offer_for(p.link, b.run_id), "declined")
        await advance(mock_clock, 3)
        assert not await funduq.ready()
        with pytest.raises(RecordUnavailable):
            await funduq.start_run(p.key, AGENT, user_input())
        await advance(mock_clock, 30)  # still failing: the lanes keep retrying
        assert a.run_id in funduq.lanes and b.run_id in funduq.lanes
        disk_full["full"] = False
        await advance(mock_clock, 10)
        assert await funduq.ready()
        run = await record_of(funduq, a.run_id)
        assert run["status"] == "completed"
        assert [e["type"] for e in events_of(run)][-1] == "RUN_FINISHED"
        # The declined run went back to the queue, and a's place freed after
        # the decline (once a's completion was written): it is offered again
        # (DESIGN §2), though it was still recording its decline then.
        assert offered_runs(p.link).count(b.run_id) == 2
        assert await status_of(funduq, b.run_id) == "offering"
        # Nobody-owned runs: none. Every active run in the record has a lane.
        for run in await funduq.list_runs():
            if run["status"] in ("queued", "offering", "running", "cancelling"):
                assert run["runId"] in funduq.lanes
        c = await funduq.start_run(p.key, AGENT, user_input())  # taken again
        await quiet()
        assert c.run_id in offered_runs(p.link)


async def test_a_burst_whose_write_failed_is_written_again_before_it_is_relayed(
    tmp_path, mock_clock, disk_full
):
    """A burst's write fails: the lane retries it until the record takes it,
    and only then relays it -- with no other message needed to wake it."""
    async with broker(tmp_path) as funduq:
        async with a_followed_run(funduq) as run:
            p, a, events, follower = run.provider, run.ticket, run.events, run.follower
            disk_full["full"] = True
            p.stream(a.run_id, events[1], finish=False)
            await advance(mock_clock, 3)  # failed, and failed again on retry
            assert not await funduq.ready()
            assert [seq for seq, _ in follower.items] == [1]
            disk_full["full"] = False
            await advance(mock_clock, 10)
            assert [seq for seq, _ in follower.items] == [1, 2]
            assert [e["seq"] for e in (await record_of(funduq, a.run_id))["events"]] == [1, 2]
            p.stream(a.run_id, *events[2:])
            await quiet()
        await relayed_and_recorded(funduq, run)


async def test_a_run_the_record_could_not_take_leaves_its_thread_as_it_was(
    tmp_path, mock_clock, disk_full
):
    """A write that fails must not leave the thread's cache believing it holds
    the message: the caller's retry keeps its message id, in the next place."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        first = await accepted(funduq, p)
        p.stream(first.run_id, *reply(first.run_id, first.thread_id))
        await quiet()
        assert await status_of(funduq, first.run_id) == "completed"
        disk_full["full"] = True
        with pytest.raises(RecordUnavailable):
            await funduq.start_run(
                p.key, AGENT, user_input("again", "m2"), thread_id=first.thread_id
            )
        disk_full["full"] = False
        await funduq.start_run(p.key, AGENT, user_input("again", "m2"), thread_id=first.thread_id)
        messages = await funduq._messages(first.thread_id)
        assert [(m["id"], m.get("content")) for m in messages][-1] == ("m2", "again")
        assert [m["role"] for m in messages] == ["user", "assistant", "user"]


async def test_an_answer_the_record_could_not_take_leaves_its_thread_as_it_was(
    tmp_path, mock_clock, disk_full
):
    """The same for an answer to a pause: its message id is the caller's again
    when the answer is retried."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        t = await accepted(funduq, p)
        ask = [{"id": "ask-1", "reason": "approval", "message": "Proceed?"}]
        p.stream(
            t.run_id,
            *reply(t.run_id, t.thread_id)[:-1],
            interrupt_finish(t.run_id, t.thread_id, ask),
        )
        assert await status_of(funduq, t.run_id) == "input-required"
        answer = resume_input("ask-1", text="yes", message_id="r1")
        disk_full["full"] = True
        with pytest.raises(RecordUnavailable):
            await funduq.answer_pause(t.run_id, answer)
        disk_full["full"] = False
        await funduq.answer_pause(t.run_id, resume_input("ask-1", text="yes", message_id="r1"))
        messages = await funduq._messages(t.thread_id)
        assert [(m["id"], m.get("content")) for m in messages][-1] == ("r1", "yes")


async def test_a_running_move_the_record_refused_is_not_believed(tmp_path, mock_clock):
    """The `running` write is queued without waiting; should the record's guard
    refuse it, the lane must not go on as if the run were running."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        t = await start(funduq, p)
        p.session.answer(last_offer_for(p.link, t.run_id), "accepted")
        # Someone moves the run behind the lane's back before its write lands.
        funduq.record.write_soon(
            lambda c: c.execute("UPDATE runs SET status='cancelled' WHERE id=?", (t.run_id,))
        )
        await quiet()
        p.stream(t.run_id, *reply(t.run_id, t.thread_id), finish=False)
        run = await record_of(funduq, t.run_id)
        assert run["status"] == "cancelled"
        assert events_of(run) == []  # nothing relayed for a run that is not running
        assert t.run_id not in funduq.lanes
        assert p.link.cancels == [t.run_id]  # asked to stop
        assert not p.session.report(t.run_id, {"type": "STEP_STARTED", "stepName": "s"})


# -- 6. an agent nobody serves ---------------------------------------------------------------


async def test_a_run_for_an_agent_nobody_serves_has_failed_when_start_run_returns(
    tmp_path, mock_clock
):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        p.session.detach()
        t = await funduq.start_run(p.key, AGENT, user_input())
        # No checkpoint since start_run returned: what any door reads now.
        status = funduq.record.read_now(
            lambda c: c.execute("SELECT status FROM runs WHERE id=?", (t.run_id,)).fetchone()[0]
        )
        assert status == "failed"
        run = await record_of(funduq, t.run_id)
        assert run["metadata"]["failureReason"] == reasons.AGENT_OFFLINE
        assert [e["code"] for e in run_errors(run)] == [reasons.AGENT_OFFLINE]


async def test_an_agent_that_attaches_while_its_run_is_recorded_is_offered_the_run(
    tmp_path, mock_clock
):
    """Whether anybody serves the agent is asked after the run is recorded,
    not of what start_run saw before its awaits (forced: the provider attaches
    during the record's write)."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        p.session.detach()
        write = funduq.record.write

        async def attach_then_write(fn, **how):
            if p.session is not None and not p.session.live:
                await p.attach()
            return await write(fn, **how)

        funduq.record.write = attach_then_write
        t = await funduq.start_run(p.key, AGENT, user_input())
        funduq.record.write = write
        await quiet()
        assert await status_of(funduq, t.run_id) in ("queued", "offering")
        assert t.run_id in offered_runs(p.link)


# -- 4, at the doors: not ready, and new runs refused 503, while writes fail ----------------


async def test_while_writes_fail_readyz_is_503_and_the_doors_refuse_new_runs(tmp_path, disk_full):
    from support import http_client, post_sse, running_server, sdk_provider
    from support import user_input as agui_input

    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        sdk_provider(info) as provider,
    ):
        url = info.agui_url(provider.identity.fingerprint, "echo")
        disk_full["full"] = True
        refused = await http.post(url, json=agui_input("hello"))
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "record_unavailable"
        assert (await http.get("/readyz")).status_code == 503
        again = await http.post(url, json=agui_input("hello"))
        assert again.status_code == 503
        disk_full["full"] = False
        assert (await http.get("/readyz")).status_code == 200
        response, events = await post_sse(http, url, agui_input("hello"))
        assert response.status_code == 200
        assert events[-1]["type"] == "RUN_FINISHED"


# -- 5. backpressure: a run's inbox is bounded, its link waits ----------------------------


async def test_a_link_waits_while_funduq_is_behind_recording_its_reports(tmp_path, mock_clock):
    async with broker(tmp_path, lane_inbox_reports=4) as funduq:
        p = await Provider(funduq).attach()
        t = await accepted(funduq, p)
        append = funduq.record.append_events
        gate = trio.Event()

        async def slow_append(run_id, events):
            await gate.wait()  # the disk is slow
            await append(run_id, events)

        funduq.record.append_events = slow_append
        events = reply(t.run_id, t.thread_id, deltas=5)  # 9 events
        p.stream(t.run_id, events[0], finish=False)
        await quiet()  # the lane took it and is writing it
        p.stream(t.run_id, *events[1:], finish=False)
        lane = funduq.lanes[t.run_id]
        assert lane.unread_reports == 8 and lane.full
        readable = trio.Event()

        async def reader() -> None:
            await p.session.can_read()
            readable.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(reader)
            await quiet()
            assert not readable.is_set()  # the link's reader would wait here
            gate.set()
            await quiet()
            assert readable.is_set()
        assert p.session.finish(t.run_id)
        run = await record_of(funduq, t.run_id)
        assert run["status"] == "completed"
        assert events_of(run) == events


async def test_a_flood_of_reports_over_a_small_inbox_all_arrive_in_order(tmp_path):
    from support import http_client, post_sse, raw_provider, running_server
    from support import user_input as agui_input

    async with (
        running_server(tmp_path, lane_inbox_reports=2) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        got: list = []

        async def caller() -> None:
            url = info.agui_url(provider.fingerprint, "echo")
            got.extend((await post_sse(http, url, agui_input("flood")))[1])

        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller)
            run = await provider.next_offer()
            await provider.answer(run, "accepted")
            events = reply(run["runId"], run["threadId"], deltas=200)
            await provider.play(run, events)
    assert got == events


async def test_a_settling_write_that_raises_still_ends_the_run(tmp_path, mock_clock):
    """The fault is in the very write that was to end the run: the run fails
    from where the record has it (running), not left there."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        t = await accepted(funduq, p)

        # A bug in the thread's history write: a message row short of columns.
        funduq.reply_messages = lambda lane: [(lane.thread_id, 0, "m")]
        p.stream(t.run_id, *reply(t.run_id, t.thread_id))
        run = await record_of(funduq, t.run_id)
        assert run["status"] == "failed"
        assert run["metadata"]["failureReason"] == reasons.FUNDUQ_ERROR
        assert [e["type"] for e in events_of(run)][-2:] == ["RUN_FINISHED", "RUN_ERROR"]
        assert t.run_id not in funduq.lanes
        u = await start(funduq, p)  # the place came back
        assert offered_runs(p.link)[-1] == u.run_id


async def test_an_offer_the_link_cannot_encode_fails_its_run_alone(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        send_offer = p.link.send_offer

        def picky_send_offer(offer_id, run):
            if run["runInput"]["messages"][-1]["content"] == "unsendable":
                raise ValueError("this offer does not encode as a frame")
            send_offer(offer_id, run)

        p.link.send_offer = picky_send_offer
        bad = await start(funduq, p, text="unsendable")
        good = await start(funduq, p, thread_id=bad.thread_id, text="fine")
        run = await record_of(funduq, bad.run_id)
        assert run["status"] == "failed"
        assert run["metadata"]["failureReason"] == reasons.OFFER_NOT_ENCODABLE
        assert [e["code"] for e in run_errors(run)] == [reasons.OFFER_NOT_ENCODABLE]
        assert p.link.closed is None  # the link stays up
        assert offered_runs(p.link) == [good.run_id]  # the place came back, the thread moved on
