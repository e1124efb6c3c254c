"""A run's trips through the record's writer (issue #16): a write chained
after a move is made only when that move moved, so the two may share a
commit; the running move and the next burst share one; the stream's last
burst is written with the settle that follows it, and published only once
that write is durable. On both stores (conftest.py)."""

from __future__ import annotations

import sqlite3
import time

import pytest
import trio
from broker_support import (
    AGENT,
    Provider,
    accepted,
    broker,
    events_of,
    last_offer_for,
    offered_runs,
    quiet,
    record_of,
    reply,
    start,
    user_input,
)

from funduq_trio.broker.errors import RecordUnavailable
from funduq_trio.broker.store import SKIPPED

EVENT = {"type": "STEP_STARTED", "stepName": "s"}


async def _queued_run(funduq, run_id: str) -> None:
    """A run of a thread of its own in the record, queued, with no lane."""
    thread_id = "thread_" + run_id
    row = {
        "id": run_id,
        "thread_id": thread_id,
        "provider_key": "k",
        "agent_name": AGENT,
        "status": "queued",
        "input": "{}",
        "caller_metadata": "{}",
        "metadata": {},
        "arrival": 10_000 + len(run_id),
        "created_at": time.time(),
    }
    await funduq.record.insert_run(row, (thread_id, "k", AGENT, None, time.time()), [])


async def _events(funduq, run_id: str) -> list[int]:
    rows = await funduq.record.events_after(run_id, 0, None, None)
    return [seq for seq, _ in rows]


async def test_a_write_chained_after_a_move_is_made_only_when_the_move_moved(tmp_path):
    async with broker(tmp_path) as funduq:
        record = funduq.record
        await _queued_run(funduq, "run_a")
        # Refused by the guard (queued -> completed is no move): nothing after it.
        refused = record.move_soon("run_a", "completed")
        assert await record.append_events("run_a", [(1, EVENT)], after=refused) is SKIPPED
        assert await refused.result() is False
        assert await _events(funduq, "run_a") == []
        # A write before it that failed: nothing after it either.

        def broken(conn):
            raise RuntimeError("a bug in a write")

        failed = record.write_soon(broken)
        assert await record.append_events("run_a", [(1, EVENT)], after=failed) is SKIPPED
        assert await _events(funduq, "run_a") == []
        # A move that moved: the write after it is made, in the same commit.
        commits = record.commits
        moved = record.move_soon("run_a", "offering")
        assert await record.append_events("run_a", [(1, EVENT)], after=moved) is None
        assert record.commits == commits + 1
        assert await moved.result() is True
        assert await _events(funduq, "run_a") == [1]
        # A guarded move chained after one: both verdicts as they are.
        running = record.move_soon("run_a", "running")
        assert await record.move("run_a", "completed", after=running) is True
        status, _ = await record.run_events("run_a", 0, None)
        assert status == "completed"


async def test_the_running_move_and_the_first_burst_share_one_commit(tmp_path, mock_clock):
    """The provider's acceptance and its first events arrive together: the
    events are chained behind the `running` move (queued without waiting),
    not written after its commit."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        t = await start(funduq, p)
        commits = funduq.record.commits
        p.session.answer(last_offer_for(p.link, t.run_id), "accepted")
        events = reply(t.run_id, t.thread_id)
        p.stream(t.run_id, *events[:2], finish=False)
        await quiet()
        assert funduq.record.commits == commits + 1
        run = await record_of(funduq, t.run_id)
        assert run["status"] == "running"
        assert events_of(run) == events[:2]
        assert [seq for seq, _ in funduq.lanes[t.run_id].feed.events] == [1, 2]


async def test_the_last_burst_is_written_with_the_settle_and_published_once_durable(
    tmp_path, mock_clock
):
    """Events and the finish read together (an SDK batch): one write -- the
    settle, carrying the events -- and nothing is published before it is
    durable (persist before relay)."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        t = await accepted(funduq, p)
        record = funduq.record
        move, append = record.move, record.append_events
        gate = trio.Event()
        moves: list[tuple[str, list[int]]] = []
        appends: list[list[int]] = []

        async def held_move(run_id, to, **kw):
            moves.append((to, [seq for seq, _ in kw.get("events", ())]))
            await gate.wait()  # the disk is slow
            return await move(run_id, to, **kw)

        async def counted_append(run_id, events, **kw):
            appends.append([seq for seq, _ in events])
            return await append(run_id, events, **kw)

        record.move, record.append_events = held_move, counted_append
        lane = funduq.lanes[t.run_id]
        events = reply(t.run_id, t.thread_id, deltas=3)
        p.stream(t.run_id, *events)
        await quiet()
        assert appends == []
        assert moves == [("completed", [1, 2, 3, 4, 5, 6, 7])]
        assert lane.feed.events == []  # not durable yet: not relayed
        gate.set()
        run = await record_of(funduq, t.run_id)
        assert run["status"] == "completed"
        assert events_of(run) == events
        assert [seq for seq, _ in lane.feed.events] == [1, 2, 3, 4, 5, 6, 7]


async def test_a_burst_carried_into_a_settle_that_failed_is_written_by_the_fault(
    tmp_path, mock_clock
):
    """The settle carrying the last burst fails (a bug, not the medium): the
    run fails alone, and the fault's settle writes the burst before its
    RUN_ERROR -- nothing the provider sent is lost, nothing relayed twice."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        t = await accepted(funduq, p)
        move = funduq.record.move

        async def broken_once(run_id, to, **kw):
            if to == "completed":
                raise RuntimeError("a bug in the settle")
            return await move(run_id, to, **kw)

        funduq.record.move = broken_once
        events = reply(t.run_id, t.thread_id)
        p.stream(t.run_id, *events)
        run = await record_of(funduq, t.run_id)
        assert run["status"] == "failed"
        assert [e["seq"] for e in run["events"]] == [1, 2, 3, 4, 5, 6]
        assert events_of(run)[:5] == events
        assert events_of(run)[5]["type"] == "RUN_ERROR"


def _medium_error(store: str) -> Exception:
    if store == "postgres":
        import psycopg

        return psycopg.OperationalError("could not extend file: No space left on device")
    return sqlite3.OperationalError("database or disk is full")


async def test_an_insert_that_failed_takes_the_offering_chained_behind_it_along(
    tmp_path, mock_clock, store
):
    """A place is free as the run arrives: its lane's `offering` move is
    queued behind the insert, chained. The insert fails (a full disk): the
    move is not made, no offer leaves, the lane ends having written nothing
    and gives its place back, the door says the record is unavailable -- and
    the record, reopened, has no trace of the run."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        record = funduq.record
        insert_write, move = record._insert_write, record.move
        chained: list[str] = []

        def full(row, new_thread, messages):
            def apply(conn):
                raise _medium_error(store)

            return apply

        async def seen_move(run_id, to, **kw):
            if "after" in kw:
                chained.append(to)
            return await move(run_id, to, **kw)

        record._insert_write, record.move = full, seen_move
        with pytest.raises(RecordUnavailable):
            await funduq.start_run(p.key, AGENT, user_input())
        record._insert_write = insert_write
        # Queued behind the insert (on a shared record its own writes may
        # have woken the writer first: the insert then failed alone).
        assert chained == ["offering"] or (store == "postgres" and chained == [])
        await quiet()
        assert p.link.offers == []
        assert funduq.lanes == {} and funduq.threads == {}
        assert await record.probe()
        t = await start(funduq, p)  # the place came back
        assert offered_runs(p.link) == [t.run_id]

    async with broker(tmp_path) as funduq:
        runs = await funduq.record.list_runs(
            thread_id=None, provider_key=None, agent=None, limit=10
        )
        assert [r[0] for r in runs] == [t.run_id]


async def test_a_restart_finds_a_run_offered_as_it_arrived_offering_or_queued_never_between(
    tmp_path, mock_clock, store
):
    """What a stop finds: a run offered as it arrived was recorded with its
    `offering` move in one commit (so a crash finds both or neither: the
    door answered only after it), and reopens as an orphaned offer; a run
    that arrived with no place free was recorded alone, queued, and reopens
    queued, to be offered again."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        commits = funduq.record.commits
        offered = await funduq.start_run(p.key, AGENT, user_input())
        if store == "sqlite":  # PostgreSQL: see test_broker_cancels (its own writes)
            assert funduq.record.commits == commits + 1
        waiting = await funduq.start_run(p.key, AGENT, user_input("second"))
        await quiet()
        assert offered_runs(p.link) == [offered.run_id]
        identity = p.identity

    async with broker(tmp_path) as funduq:
        run = await record_of(funduq, offered.run_id)
        assert run["status"] == "failed"
        assert run["metadata"]["failureReason"] == "orphaned_by_restart"
        assert (await record_of(funduq, waiting.run_id))["status"] == "queued"
        p = await Provider(funduq, identity=identity).attach()
        await quiet()
        assert offered_runs(p.link) == [waiting.run_id]


@pytest.mark.parametrize("count", [1, 15, 16, 17, 40])
async def test_events_go_in_by_statements_of_many_rows_and_come_back_whole(tmp_path, count):
    """A burst is written as statements of up to EVENTS_A_STATEMENT rows
    each (store._event_statements): every event comes back, in seq order,
    as one row each, with a move's events as with an append's; and a burst
    with a seq already recorded is refused whole, as row by row it was."""
    from funduq_trio.broker.store import EVENTS_A_STATEMENT, dumps

    assert EVENTS_A_STATEMENT == 16  # the counts above straddle it
    events = [
        {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": f"w{i}é\ud800"}
        for i in range(count)
    ]
    async with broker(tmp_path) as funduq:
        record = funduq.record
        await _queued_run(funduq, "run_a")
        assert await record.move("run_a", "offering") is True
        await record.append_events("run_a", list(enumerate(events, start=1)))
        more = list(enumerate(events, start=count + 1))
        assert await record.move("run_a", "running", events=more) is True
        rows = await record.events_after("run_a", 0, None, None)
        assert [seq for seq, _ in rows] == list(range(1, 2 * count + 1))
        assert [text for _, text in rows] == [dumps(e) for e in events + events]
        with pytest.raises(Exception):  # noqa: B017 -- each store's own IntegrityError
            await record.append_events("run_a", [(2 * count + 1, EVENT), (1, EVENT)])
        assert len(await record.events_after("run_a", 0, None, None)) == 2 * count


@pytest.mark.parametrize("insert_fails", [False, True])
async def test_a_caller_cancelled_while_its_run_is_inserted_is_answered_as_if_shielded(
    tmp_path, mock_clock, store, insert_fails
):
    """The door waits for a laned run's insert shielded only once cancelled
    (``Funduq._insert_laned``): a caller cancelled during that wait still
    gets the door's answer -- its ticket, the run laned, offered and going
    on; or, when the insert failed, RecordUnavailable and nothing laned --
    and its cancel only after it, at its own next checkpoint, as a wait
    shielded throughout gave it."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        record = funduq.record
        insert_soon, insert_write = record.insert_run_soon, record._insert_write
        answered: list[object] = []

        def failing(row, new_thread, messages):
            def apply(conn):
                raise _medium_error(store)

            return apply

        if insert_fails:
            record._insert_write = failing
        with trio.CancelScope() as scope:

            def cancelled_as_queued(*args, **kw):
                handle = insert_soon(*args, **kw)
                scope.cancel()  # the door's next checkpoint is the insert's wait
                return handle

            record.insert_run_soon = cancelled_as_queued
            try:
                answered.append(await funduq.start_run(p.key, AGENT, user_input()))
            except RecordUnavailable as exc:
                answered.append(exc)
            await trio.lowlevel.checkpoint()  # the cancel, delivered here
            answered.append("not cancelled")
        record.insert_run_soon, record._insert_write = insert_soon, insert_write
        assert scope.cancelled_caught
        await quiet()
        if insert_fails:
            assert len(answered) == 1 and isinstance(answered[0], RecordUnavailable)
            assert p.link.offers == [] and funduq.lanes == {} and funduq.threads == {}
            assert funduq.waiting.runs == 0 and funduq.waiting.bytes == 0
            return
        assert len(answered) == 1 and not isinstance(answered[0], Exception)
        ticket = answered[0]
        assert offered_runs(p.link) == [ticket.run_id]
        assert funduq.waiting.runs == 1  # charged until the run is taken
        p.session.answer(last_offer_for(p.link, ticket.run_id), "accepted")
        p.stream(ticket.run_id, *reply(ticket.run_id, ticket.thread_id))
        assert (await funduq.wait_run(ticket.run_id))["status"] == "completed"
