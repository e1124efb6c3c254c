"""A held run's bursts while the record's commit is held: persisted before
relayed, and whatever arrives meanwhile read once the burst is durable; a
lane whose last commit found its inbox empty reads its next report as any.
The real Funduq on each store, under MockClock, the writer's commits held by
the test. (Written for a lane not woken for its own commit, measured and not
taken: bench/README.md, "A lane not woken for its own commit".)"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import trio
from broker_support import Follower, a_followed_run, broker, quiet, relayed_and_recorded

from funduq_trio.broker.funduq import Funduq


@contextlib.contextmanager
def held_commits(funduq: Funduq) -> Iterator[trio.Event]:
    """Every group commit waits (before its BEGIN) until the event is set."""
    record = funduq.record
    commit, gate = record._commit, trio.Event()

    async def held(ops):
        await gate.wait()
        await commit(ops)

    record._commit = held  # type: ignore[method-assign]
    try:
        yield gate
    finally:
        gate.set()
        record._commit = commit  # type: ignore[method-assign]


def seqs(follower: Follower) -> list[int]:
    return [seq for seq, _ in follower.items]


async def test_a_burst_is_relayed_once_its_commit_is_done_and_the_lane_reads_on(
    tmp_path, mock_clock
):
    async with broker(tmp_path) as funduq:
        async with a_followed_run(funduq) as run:
            p, a, events, follower = run.provider, run.ticket, run.events, run.follower
            # The first burst rode behind the `running` move (awaited).
            assert seqs(follower) == [1]
            with held_commits(funduq) as gate:
                p.stream(a.run_id, events[1], finish=False)
                await quiet()  # queued, its commit held: nobody sees it
                assert seqs(follower) == [1]
                gate.set()
                await quiet()
                assert seqs(follower) == [1, 2]
            # The commit found the lane's inbox empty: the next report is
            # read as any would be.
            p.stream(a.run_id, events[2], finish=False)
            await quiet()
            assert seqs(follower) == [1, 2, 3]
            p.stream(a.run_id, *events[3:])
            await quiet()
            assert follower.ended.is_set()
        await relayed_and_recorded(funduq, run)


async def test_what_arrives_while_a_burst_is_written_is_read_once_it_is_durable(
    tmp_path, mock_clock
):
    async with broker(tmp_path) as funduq:
        async with a_followed_run(funduq) as run:
            p, a, events, follower = run.provider, run.ticket, run.events, run.follower
            with held_commits(funduq) as gate:
                p.stream(a.run_id, events[1], finish=False)
                await quiet()
                # The rest of the stream and its finish, while the burst's
                # write waits: read once it is durable, not before.
                p.stream(a.run_id, *events[2:])
                await quiet()
                assert seqs(follower) == [1]
                assert funduq.lanes[a.run_id].unread_reports == len(events) - 2
                gate.set()
                await quiet()
            assert follower.ended.is_set()
        assert follower.bursts == [[1], [2], list(range(3, len(events) + 1))]
        await relayed_and_recorded(funduq, run)
