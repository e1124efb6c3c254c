"""The callers' side of a run without the waits it does not need (each
shortcut held equal to the general path it skips, bench/README.md "The
callers' side of a run"):

- a request body all at hand is handed over by the front
  (`Exchange.body_now`, the `funduq.http.body_now` extension) without the
  read's wait, so the doors take it without the body timeout's cancel scope;
- a quiet follower's wait that would end at once (`Quiet.due`: its deadline
  passed, as a stream's first wait's has, or the caller gone) is not made:
  `Funduq.follow` yields its empty burst without the scope, the trip through
  the scheduler and the `Cancelled`;
- an A2A stream's final status is written from the run's lane, as the
  blocking answer is, once the lane has settled the run (no record read).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import trio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_front_plain import _PLAIN_POST, _cut, _request, _Scripted

from funduq_trio.broker.quiet import Quiet
from funduq_trio.front import http as front_http
from funduq_trio.web import asgi_doors, sse

# ------------------------------------------------------- a body at hand


def _serve_bodies(pieces: list[bytes], limit: int, take_now: bool, peek: bool) -> Any:
    """Serve `pieces` (pipelined requests) with an app that reads each
    body as the doors do -- with `body_now` first when `take_now`, then
    `read_body` -- and answers with what it got (when `peek`, after asking
    `receive` once more: a body read is not read again); what the app saw,
    the bytes written, whether the connection was gone."""
    seen: list[Any] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body_now = scope["extensions"].get(front_http.BODY_NOW_EXTENSION)
        assert body_now is not None
        got: Any = body_now(limit) if take_now else None
        try:
            if got is None:
                got = await asgi_doors.read_body(scope, receive, limit, 30.0)
        except asgi_doors.RequestEntityTooLarge:
            got = "too large"
        except asgi_doors._Gone:
            got = "gone"
        seen.append(got)
        if got == "gone":
            return
        if peek and not seen[1:]:  # the first request's: it reads all that follows
            seen.append(await receive())
        answer = b"413" if got == "too large" else b"%d:%b" % (len(got), got[:8])
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", b"%d" % len(answer))],
            }
        )
        await send({"type": "http.response.body", "body": answer, "more_body": False})
        # Whatever receive says next is the same either way.
        with trio.move_on_after(0):
            seen.append((await receive())["type"])

    async def main() -> Any:
        conn = _Scripted(pieces, app)
        await conn.serve()
        return conn

    with (
        mock.patch.object(front_http, "_date", lambda: b"Fri, 04 Dec 2026 10:00:00 GMT"),
        mock.patch.object(front_http.log, "exception"),
    ):
        conn = trio.run(main)
    return seen, b"".join(conn.out), conn.gone


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(_request(), min_size=1, max_size=3),
    how=st.sampled_from(["whole", "per request", "head and body", "cut"]),
    cuts=st.lists(st.integers(0, 400), max_size=4),
    limit=st.sampled_from([0, 1, 2, 5, 40, 1 << 20]),
    peek=st.booleans(),
)
@example(requests=[_PLAIN_POST, _PLAIN_POST], how="whole", cuts=[], limit=1 << 20, peek=False)
@example(requests=[_PLAIN_POST, _PLAIN_POST], how="whole", cuts=[], limit=1 << 20, peek=True)
@example(requests=[_PLAIN_POST], how="head and body", cuts=[], limit=1 << 20, peek=False)
@example(requests=[_PLAIN_POST], how="whole", cuts=[], limit=1, peek=False)
def test_a_body_taken_at_once_is_the_body_read(
    requests: list[bytes], how: str, cuts: list[int], limit: int, peek: bool
) -> None:
    """Whatever the requests and however their bytes come, an app that
    takes each body with `body_now` first sees what one that reads it sees
    (the body, the refusal, the caller gone, what `receive` says after),
    and the same bytes go back."""
    pieces = _cut(requests, how, cuts)
    assert _serve_bodies(pieces, limit, True, peek) == _serve_bodies(pieces, limit, False, peek)


def test_a_body_at_hand_is_given_once_and_a_long_one_not_at_all() -> None:
    exchange = front_http.Exchange(
        mock.Mock(gone=False), b"POST", b"/a2a/p/a", body=b"{}", body_left=0
    )
    assert exchange.body_now(1) is None  # longer than the limit: left to receive
    assert exchange.body_now(2) == b"{}"
    assert exchange.body_now(2) is None  # taken
    still = front_http.Exchange(mock.Mock(gone=False), b"POST", b"/", body=b"{", body_left=1)
    assert still.body_now(10) is None  # not all here


def test_the_front_and_the_doors_name_the_same_body_extension() -> None:
    assert front_http.BODY_NOW_EXTENSION == sse.BODY_NOW_EXTENSION


# ------------------------------------------------ a wait that would end at once


@pytest.mark.parametrize("first", [True, False], ids=["head", "keepalive"])
async def test_a_due_quiet_is_one_whose_wait_would_end_at_once(
    autojump_clock: trio.testing.MockClock, first: bool
) -> None:
    """`Quiet.due` says True exactly when a wait entered in `waiting()`
    would end at once without news (trio cancels a scope entered at or past
    its deadline); False when it would wait."""
    quiet = Quiet()
    for ahead, gone in [(0, False), (-1, False), (1, False), (1, True)]:
        now = trio.current_time()
        quiet.deadline, quiet.gone = now + ahead, gone
        due = quiet.due()
        with quiet.waiting() as scope:
            if first:
                await trio.Event().wait()
            else:
                await trio.sleep(0.5)
        ended_at_once = scope.cancelled_caught and trio.current_time() == now
        assert due == ended_at_once, (ahead, gone)


@st.composite
def _timelines(draw: Any) -> Any:
    """When a run's events are published (seconds after the stream
    opens), its keepalive interval, and when (if ever) the caller goes."""
    # No two things at one instant (a publish, a keepalive's deadline, the
    # hang-up, the end at 40): which of two goes first is trio's to choose.
    moments = [0, 0.5, 5.25, 14.125, 16.0625, 31.03]
    times = sorted(draw(st.lists(st.sampled_from(moments), max_size=5)))
    interval = draw(st.sampled_from([0, 15]))
    gone = draw(st.sampled_from([None, 0.25, 15.375, 20.3]))
    return times, interval, gone


async def _stream_of_a_feed(timeline: Any, use_due: bool) -> list[tuple[float, bytes, bool]]:
    """A stream (`SseStream` on a quiet, the front's hang-up extension)
    of `Funduq.follow` over a live feed publishing at `timeline`'s times;
    what it sent and when. `use_due` False is the general road: every
    wait made."""
    from funduq_trio.broker.funduq import Funduq
    from funduq_trio.broker.lanes import Feed

    times, interval, gone_at = timeline
    feed = Feed(1)
    lane = mock.Mock(feed=feed, status="completed")
    facade = mock.Mock(lanes={"r": lane}, settings=mock.Mock(max_feed_events=None), watchers=None)
    sent: list[tuple[float, bytes, bool]] = []
    callback: list[Any] = []
    start = trio.current_time()

    async def send(message: dict[str, Any]) -> None:
        sent.append(
            (trio.current_time() - start, message.get("body", b""), message.get("more_body"))
        )

    def on_hangup(fn: Any) -> None:
        callback[:] = [fn]

    quiet = Quiet()

    async def bursts() -> Any:
        follow = Funduq.follow(facade, "r", quiet=quiet)
        async with contextlib.aclosing(follow) as each:
            async for burst in each:
                yield [{"seq": seq} for seq, _ in burst]

    async def publisher() -> None:
        for seq, at in enumerate(times, 1):
            await trio.sleep_until(start + at)
            feed.publish(seq, {"type": "X"})
        await trio.sleep_until(start + 40)
        feed.close()

    async def leaver() -> None:
        await trio.sleep_until(start + gone_at)
        if callback and callback[0] is not None:
            callback[0]()

    due = Quiet.due if use_due else (lambda self: False)
    with mock.patch.object(Quiet, "due", due):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(publisher)
            if gone_at is not None:
                nursery.start_soon(leaver)
            scope = {"type": "http", "extensions": {sse.HANGUP_EXTENSION: on_hangup}}
            await sse.SseStream(bursts(), interval).serve(None, send, quiet, scope)  # type: ignore[arg-type]
            nursery.cancel_scope.cancel()
    return sent


@settings(max_examples=300, deadline=None)
@given(_timelines())
@example(([], 15, None))
@example(([0], 15, None))
@example(([0.5, 16.0625], 15, 20.3))
def test_a_stream_of_a_feed_sends_the_same_with_waits_that_end_at_once_skipped(
    timeline: Any,
) -> None:
    """The same chunks at the same times, head first, keepalives at their
    interval, nothing after a hang-up: with `Quiet.due` asked, and with
    every wait made (the general road)."""

    def run(use_due: bool) -> Any:
        return trio.run(
            _stream_of_a_feed, timeline, use_due, clock=trio.testing.MockClock(autojump_threshold=0)
        )

    assert by_instant(run(True)) == by_instant(run(False))


def by_instant(sent: list[tuple[float, bytes, bool]]) -> list[tuple[float, bytes, bool]]:
    """What went out at each instant, and whether the stream went on: how
    one instant's bytes are cut into writes is the scheduler's (a publisher
    and the stream at the same instant interleave either way)."""
    merged: list[tuple[float, bytes, bool]] = []
    for at, body, more in sent:
        if merged and merged[-1][0] == at:
            merged[-1] = (at, merged[-1][1] + body, more)
        else:
            merged.append((at, body, more))
    return merged


async def test_a_streams_head_costs_no_wait(autojump_clock: trio.testing.MockClock) -> None:
    """The first wait of a stream whose run has no event yet is not made
    (its head goes at once); every later wait for news is, as before."""
    real = Quiet.waiting

    async def follows_waits(use_due: bool) -> Any:
        entered: list[float] = []
        start = trio.current_time()

        def waiting(self: Quiet, deadline: float | None = None) -> trio.CancelScope:
            if deadline is None:  # a wait for news (a write's is `waiting(inf)`)
                entered.append(trio.current_time() - start)
            return real(self, deadline)

        with mock.patch.object(Quiet, "waiting", waiting):
            sent = await _stream_of_a_feed(([5.25], 15, None), use_due)
        return entered, [(t, body) for t, body, _ in sent]

    entered, sent = await follows_waits(True)
    assert sent[:2] == [(0, b""), (5.25, b'data: {"seq":1}\n\n')]
    assert entered == [0, 5.25, 20.25, 35.25]
    assert await follows_waits(False) == ([0, 0, 5.25, 20.25, 35.25], sent)


# ------------------------------------------ an A2A stream's record once followed


def _endings(run_id: str, thread_id: str) -> dict[str, list[dict[str, Any]]]:
    from broker_support import interrupt_finish, reply

    started = {"type": "RUN_STARTED", "threadId": thread_id, "runId": run_id}
    return {
        "completed": reply(run_id, thread_id, "é\u2028 hi", deltas=3),
        "failed": [started, {"type": "RUN_ERROR", "message": "boom"}],
        "no end event": [started],
        "paused": [started, interrupt_finish(run_id, thread_id, [{"id": "i1", "reason": "ok?"}])],
    }


async def _end_run(funduq: Any, p: Any, ticket: Any, ending: str, events: str) -> None:
    """End the run as a test's ``ending`` asks: cancelled by the caller (the
    provider then finishes it), or the provider streams ``_endings``'
    ``events``."""
    if ending == "cancelled":
        await funduq.cancel_run(ticket.run_id)
        p.session.finish(ticket.run_id)
    else:
        p.stream(ticket.run_id, *_endings(ticket.run_id, ticket.thread_id)[events])


@pytest.mark.parametrize(
    "ending", ["completed", "failed", "no end event", "paused", "answered", "cancelled"]
)
@pytest.mark.parametrize("keep", [None, 2])
async def test_the_record_after_a_follow_is_the_records(
    tmp_path: Path, ending: str, keep: int | None
) -> None:
    """`Funduq.record_after` answers exactly what `get_run` reads, however
    the run ended (settled, failed, cancelled, paused) and whether or not
    its lane kept every event; from the lane itself only when the lane
    settled the run and saw all of it."""
    from broker_support import accepted, broker, quiet

    overrides = {} if keep is None else {"max_feed_events": keep}
    async with broker(tmp_path, **overrides) as funduq:
        from broker_support import Provider as FakeProvider

        p = await FakeProvider(funduq).attach()
        ticket = await accepted(funduq, p)
        lane = funduq.lane_of(ticket.run_id)
        assert lane is not None
        reads: list[str] = []
        real = funduq.record.get_run

        async def counted(run_id: str) -> Any:
            reads.append(run_id)
            return await real(run_id)

        followed = []

        async def follower() -> None:
            async with contextlib.aclosing(funduq.follow(ticket.run_id)) as bursts:
                async for burst in bursts:
                    followed.extend(burst)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(follower)
            await quiet()
            await _end_run(funduq, p, ticket, ending, "paused" if ending == "answered" else ending)
            await quiet()
        if ending == "answered":  # the pause is over before the record is asked for
            from broker_support import resume_input

            await funduq.answer_pause(ticket.run_id, resume_input("i1"))
            await quiet()
        with mock.patch.object(funduq.record, "get_run", counted):
            after = await funduq.record_after(ticket.run_id, lane)
        assert after == await funduq.get_run(ticket.run_id)
        assert json.dumps(after) == json.dumps(await funduq.get_run(ticket.run_id))
        from_lane = ending not in ("paused", "answered") and lane.feed.first_seq == 1
        assert reads == ([] if from_lane else [ticket.run_id])
        if ending == "completed":  # five events and more: a feed of two kept the last
            assert from_lane == (keep is None)


@pytest.mark.parametrize(
    "ending", ["completed", "failed", "no end event", "paused", "cancelled", "unrecorded"]
)
async def test_a_blocking_answer_is_the_lanes_only_for_what_it_recorded(
    tmp_path: Path, store: str, ending: str
) -> None:
    """`Funduq.wait_run` answers exactly what `get_run` then reads. From the
    lane itself -- no read of the record -- whenever the lane recorded the
    status it ended at (settled, failed, cancelled, paused); from the
    record when it did not ("unrecorded": the completion's write failed,
    and so did the fault's settle, so the lane's machine says `failed`
    while the record says `running` -- on PostgreSQL until the next lease
    round claims the idle thread and settles it `orphaned_by_restart`)."""
    from broker_support import Provider as FakeProvider
    from broker_support import accepted, broker, quiet

    async with broker(tmp_path, lease_seconds=3) as funduq:
        p = await FakeProvider(funduq).attach()
        ticket = await accepted(funduq, p)
        reads: list[str] = []
        real_get, real_move = funduq.record.get_run, funduq.record.move

        async def counted(run_id: str) -> Any:
            reads.append(run_id)
            return await real_get(run_id)

        refused: list[str] = []

        async def failing_move(run_id: str, to: str, **changes: Any) -> Any:
            if ending == "unrecorded" and len(refused) < 2 and to in ("completed", "failed"):
                refused.append(str(to))
                raise RuntimeError("the record's write failed (a bug, not the medium)")
            return await real_move(run_id, to, **changes)

        with (
            mock.patch.object(funduq.record, "get_run", counted),
            mock.patch.object(funduq.record, "move", failing_move),
        ):
            async with trio.open_nursery() as nursery:
                answers: list[dict[str, Any]] = []

                async def wait() -> None:
                    answers.append(await funduq.wait_run(ticket.run_id))

                nursery.start_soon(wait)
                await quiet()
                await _end_run(
                    funduq, p, ticket, ending, "completed" if ending == "unrecorded" else ending
                )
        (answer,) = answers
        assert answer == await funduq.get_run(ticket.run_id)
        if ending == "unrecorded":
            assert refused == ["completed", "failed"]
            assert reads == [ticket.run_id]
            settled = "running" if store == "sqlite" else "failed"
            assert answer["status"] == settled
        else:
            assert reads == []


# --------------------------------------------- a batch's commit, waited for


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.one_of(
            st.tuples(st.sampled_from(["wait", "wait cancelled"]), st.integers(0, 3)),
            st.tuples(st.just("cancel"), st.integers(0, 3)),
            st.just(("set", 0)),
        ),
        max_size=10,
    )
)
def test_a_commit_is_waited_for_as_an_event_is(script: list[tuple[str, int]]) -> None:
    """`store.Committed` (a batch's commit) against `trio.Event`: the same
    waiters woken, the same cancelled, whatever the order of waits, cancels
    and the set; `wait_uncancellable` is never cancelled while it waits,
    and its task's cancel comes at its next checkpoint."""
    from funduq_trio.broker.store import Committed

    def run(kind: Any, uncancellable: bool) -> Any:
        async def main() -> Any:
            done = kind()
            outcome: dict[int, str] = {}
            scopes: dict[int, trio.CancelScope] = {}

            async def waiter(i: int, scope: trio.CancelScope) -> None:
                with scope:
                    if uncancellable:
                        await done.wait_uncancellable()
                        outcome[i] = "woken"
                        await trio.lowlevel.checkpoint()
                        outcome[i] = "not cancelled after"
                    else:
                        await done.wait()
                        outcome[i] = "woken"
                if scope.cancelled_caught:
                    outcome[i] = outcome.get(i, "") + " cancelled"

            async with trio.open_nursery() as nursery:
                for what, i in script:
                    if what.startswith("wait") and i not in scopes:
                        scopes[i] = trio.CancelScope()
                        if what == "wait cancelled":
                            scopes[i].cancel()
                        nursery.start_soon(waiter, i, scopes[i])
                    elif what == "cancel" and i in scopes:
                        scopes[i].cancel()
                    elif what == "set":
                        done.set()
                    await trio.testing.wait_all_tasks_blocked()
                done.set()
            return outcome

        return trio.run(main)

    assert run(Committed, False) == run(trio.Event, False)
    if any(what == "wait cancelled" for what, _ in script):
        return  # (the uncancellable wait's own check, below, takes waits not yet cancelled)
    shielded = run(Committed, True)
    started: set[int] = set()
    cancelled: set[int] = set()  # while it waited: before the set
    is_set = False
    for what, i in script:
        if what == "wait":
            started.add(i)
        elif what == "cancel" and i in started and not is_set:
            cancelled.add(i)
        elif what == "set":
            is_set = True
    # Every waiter waits until the set; one cancelled meanwhile gets its
    # cancel at its next checkpoint, not in the wait.
    assert shielded == {
        i: "woken cancelled" if i in cancelled else "not cancelled after" for i in started
    }
