from contextlib import asynccontextmanager

import pytest
from broker_support import AGENT, Provider, broker, reply, user_input

from funduq_trio.broker.errors import InvalidRunInput
from funduq_trio.protocol import reasons


async def test_lone_surrogates_are_refused_never_half_recorded(tmp_path, autojump_clock):
    """A lone surrogate is valid JSON text but nothing the link, SQLite's text
    or protobuf can hold: refused in a run's input (nothing recorded) and
    malformed in a provider's event (the run fails; what came before is kept)."""
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        with pytest.raises(InvalidRunInput, match="lone surrogate"):
            await funduq.start_run(p.key, AGENT, user_input("\ud800 hi"))
        assert await funduq.list_runs() == []
        t = await funduq.start_run(p.key, AGENT, user_input("hi"))
        oid, run = await p.offer(0)
        p.session.answer(oid, "accepted")
        fine = {"type": "CUSTOM", "name": "x", "value": "ok"}
        odd = {"type": "CUSTOM", "name": "x", "value": "\udc00"}
        p.stream(t.run_id, fine, odd, *reply(t.run_id, t.thread_id))
        rec = await funduq.wait_run(t.run_id)
        assert rec["status"] == "failed"
        assert rec["metadata"]["failureReason"] == reasons.MALFORMED_EVENT
        rec = await funduq.get_run(t.run_id)
        assert [e["event"] for e in rec["events"]] == [
            fine,
            {
                "type": "RUN_ERROR",
                "message": reasons.MALFORMED_EVENT,
                "code": reasons.MALFORMED_EVENT,
            },
        ]


async def test_forgotten_idle_threads_continue_from_the_record(
    tmp_path, autojump_clock, monkeypatch
):
    """The thread cache is bounded; a thread it forgot continues from the
    record, its history in order and nothing refused."""
    from funduq_trio.broker import funduq as facade

    monkeypatch.setattr(facade, "THREAD_CACHE", 4)
    async with broker(tmp_path) as funduq:
        p = await Provider(funduq).attach()
        threads = []
        for i in range(12):
            t = await funduq.start_run(p.key, AGENT, user_input(f"first {i}", f"u{i}"))
            oid, _ = await p.offer(i)
            p.session.answer(oid, "accepted")
            p.stream(t.run_id, *reply(t.run_id, t.thread_id))
            assert (await funduq.wait_run(t.run_id))["status"] == "completed"
            threads.append(t.thread_id)
        assert len(funduq._thread_info) <= 4
        t = await funduq.start_run(p.key, AGENT, user_input("again", "again"), thread_id=threads[0])
        oid, _ = await p.offer(12)
        p.session.answer(oid, "accepted")
        p.stream(t.run_id, *reply(t.run_id, t.thread_id))
        assert (await funduq.wait_run(t.run_id))["status"] == "completed"
        snapshot = await funduq.get_thread(threads[0])
        assert [m["content"] for m in snapshot["messages"]] == ["first 0", "hi", "again", "hi"]
        assert len(snapshot["runs"]) == 2


async def test_a_write_lock_held_by_another_process_parks_the_writer_not_the_loop(tmp_path):
    """Commits run on the trio thread but never wait for the lock there: while
    another connection (an operator's sqlite3 shell, a backup) holds the write
    lock, the batch waits in a worker thread, the loop keeps serving, and the
    write lands once the lock is released."""
    import sqlite3

    import trio
    import trio.testing

    from funduq_trio.broker.record import open_record

    path = tmp_path / "record.sqlite3"
    async with open_record(path) as record:
        blocker = sqlite3.connect(path, isolation_level=None)
        blocker.execute("BEGIN IMMEDIATE")
        landed = trio.Event()

        async def write() -> None:
            await record.write(
                lambda c: c.execute(
                    "INSERT INTO threads (id, provider_key, agent_name, created_at) VALUES ('t', 'k', 'a', 0)"
                )
            )
            landed.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(write)
            await trio.testing.wait_all_tasks_blocked()
            for _ in range(100):  # the loop still runs other tasks
                await trio.lowlevel.checkpoint()
            assert not landed.is_set()
            blocker.execute("COMMIT")
            with trio.fail_after(30):
                await landed.wait()
        blocker.close()
        found = await record.read(lambda c: c.execute("SELECT id FROM threads").fetchall())
        assert found == [("t",)]


async def test_the_log_is_copied_into_the_database_file_each_second_off_the_loop(
    tmp_path, mock_clock
):
    """Commits never checkpoint (that fsyncs, on the loop); the checkpoint
    task does, once a second when anything was committed."""
    from broker_support import quiet

    from funduq_trio.broker.record import CHECKPOINT_SECONDS, open_record

    path = tmp_path / "record.sqlite3"
    rows = [(f"t{i}", "k", "a", "x" * 500) for i in range(400)]
    async with open_record(path) as record:
        await quiet()
        before = path.stat().st_size
        await record.write(
            lambda c: c.executemany(
                "INSERT INTO threads (id, provider_key, agent_name, segment_head, created_at) "
                "VALUES (?, ?, ?, ?, 0)",
                rows,
            )
        )
        await quiet()
        assert path.stat().st_size == before  # committed to the log only
        mock_clock.jump(CHECKPOINT_SECONDS)
        await quiet()
        assert path.stat().st_size > before + 400 * 500  # now in the file itself


def _insert_threads(prefix: str, count: int):
    def insert(conn) -> None:
        conn.executemany(
            "INSERT INTO threads (id, provider_key, agent_name, segment_head, created_at) "
            "VALUES (?, 'k', 'a', ?, 0)",
            [(f"{prefix}-{i}", "x" * 500) for i in range(count)],
        )

    return insert


async def _thread_count(record) -> int:
    return (await record.read(lambda c: c.execute("SELECT COUNT(*) FROM threads").fetchone()))[0]


@asynccontextmanager
async def _grown_log(path, monkeypatch, limit_kib: int = 64):
    """The record at `path` with LOG_SIZE_LIMIT at `limit_kib` KiB, once 400
    rows (~230 KiB of log) are committed: (record, the log file, its size)."""
    from funduq_trio.broker import record as R

    monkeypatch.setattr(R, "LOG_SIZE_LIMIT", limit_kib * 1024)
    log_file = path.with_name(path.name + "-wal")
    async with R.open_record(path) as record:
        await record.write(_insert_threads("a", 400))
        grown = log_file.stat().st_size
        assert grown > 64 * 1024
        yield record, log_file, grown


async def test_a_commit_that_starts_the_log_over_never_truncates_it(tmp_path, monkeypatch):
    """The commit runs on the loop, and truncating a file frees its pages in
    the kernel (tens of ms after a burst): the writer's commits leave the
    log file's size alone when they start it over, even past the limit."""
    from funduq_trio.broker import record as R

    path = tmp_path / "record.sqlite3"
    async with _grown_log(path, monkeypatch) as (record, log_file, grown):
        # A pass that copies all of it, as the checkpoint task's first does.
        busy, frames, copied = await record.read(R.SqliteStore._checkpoint)
        assert (busy, copied) == (0, frames)
        await record.write(_insert_threads("b", 1))  # starts the log over
        assert await record.read(lambda c: c.execute("PRAGMA wal_checkpoint").fetchone()[1]) < 5
        assert log_file.stat().st_size == grown
    async with R.open_record(path) as record:
        assert await _thread_count(record) == 401


@pytest.mark.parametrize("limit_kib, cut", [(64, True), (64 * 1024, False)])
async def test_a_log_a_burst_grew_past_its_limit_is_cut_back_off_the_loop(
    tmp_path, mock_clock, monkeypatch, limit_kib, cut
):
    """A log file over LOG_SIZE_LIMIT is truncated (in a worker thread) at
    the first second without commits, never while the writer is busy; one
    under it keeps its size, to be written again from its beginning. Nothing
    committed is lost either way, and the writer goes on writing."""
    from broker_support import quiet

    from funduq_trio.broker import record as R

    path = tmp_path / "record.sqlite3"
    async with _grown_log(path, monkeypatch, limit_kib) as (record, log_file, grown):
        mock_clock.jump(R.CHECKPOINT_SECONDS)  # a second with commits: a pass
        await quiet()
        assert log_file.stat().st_size == grown
        await record.write(_insert_threads("b", 1))  # starts it over, in place
        mock_clock.jump(R.CHECKPOINT_SECONDS)
        await quiet()
        assert log_file.stat().st_size == grown
        mock_clock.jump(R.CHECKPOINT_SECONDS)  # a second without commits
        await quiet()
        assert log_file.stat().st_size == (0 if cut else grown)
        await record.write(_insert_threads("c", 1))
    async with R.open_record(path) as record:
        assert await _thread_count(record) == 402


async def test_a_cut_back_a_reader_holds_off_is_tried_again_at_the_next_quiet_second(
    tmp_path, mock_clock, monkeypatch
):
    """A reader still on a snapshot in the log keeps the TRUNCATE checkpoint
    from finishing: it gives up after CUT_BACK_WAIT_MS (SQLite's own wait,
    in its worker thread; the writer's commits would wait as long), the log
    stays as it is (nothing lost, the reader's view intact), and the next
    second without commits tries again."""
    import sqlite3

    from broker_support import quiet

    from funduq_trio.broker import record as R

    path = tmp_path / "record.sqlite3"
    async with _grown_log(path, monkeypatch) as (record, log_file, grown):
        outside = sqlite3.connect(path, isolation_level=None)
        outside.execute("BEGIN")
        assert outside.execute("SELECT COUNT(*) FROM threads").fetchone() == (400,)
        mock_clock.jump(R.CHECKPOINT_SECONDS)  # a second with commits: a pass
        await quiet()
        mock_clock.jump(R.CHECKPOINT_SECONDS)  # quiet: the cut back, held off
        await quiet()
        assert log_file.stat().st_size == grown
        assert outside.execute("SELECT COUNT(*) FROM threads").fetchone() == (400,)
        # The reader connection it used (the one a read takes next) waits for
        # locks as long as every reader again.
        timeout = await record.read(lambda c: c.execute("PRAGMA busy_timeout").fetchone()[0])
        assert timeout == R.BUSY_TIMEOUT_MS
        outside.execute("COMMIT")
        outside.close()
        mock_clock.jump(R.CHECKPOINT_SECONDS)  # quiet again: tried again
        await quiet()
        assert log_file.stat().st_size == 0
        await record.write(_insert_threads("b", 1))
        assert await _thread_count(record) == 401


async def test_a_log_a_crash_left_oversized_is_cut_back_at_the_first_quiet_second(
    tmp_path, mock_clock, monkeypatch
):
    """A log file left behind by a process that never closed the record (a
    crash: the files as they were while it ran) is truncated at the first
    second without commits once the record is opened again, its rows all
    there."""
    import shutil

    from broker_support import quiet

    from funduq_trio.broker import record as R

    running = tmp_path / "running"
    crashed = tmp_path / "crashed"
    crashed.mkdir()
    async with _grown_log(running / "record.sqlite3", monkeypatch):
        for name in ("record.sqlite3", "record.sqlite3-wal"):
            shutil.copy(running / name, crashed / name)
    log_file = crashed / "record.sqlite3-wal"
    assert log_file.stat().st_size > R.LOG_SIZE_LIMIT
    async with R.open_record(crashed / "record.sqlite3") as record:
        await quiet()
        mock_clock.jump(R.CHECKPOINT_SECONDS)
        await quiet()
        assert log_file.stat().st_size == 0
        assert await _thread_count(record) == 400


async def test_commits_landing_during_a_checkpoint_do_not_keep_the_log_growing(
    tmp_path, mock_clock, monkeypatch
):
    """The log starts over from its beginning only once a checkpoint pass
    copied all of it with nothing committed meanwhile. Commits that land
    during a pass (steady load) are chased by further passes at once, so the
    log starts over at the next commit instead of growing for as long as the
    load lasts; and every commit is still there after a restart."""
    import sqlite3

    import trio
    from broker_support import quiet

    from funduq_trio.broker import record as R

    path = tmp_path / "record.sqlite3"
    monkeypatch.setattr(R, "CATCH_UP_FRAMES", 10)
    passes: list[tuple[int, int, int]] = []
    real = R.SqliteStore._checkpoint
    batch = 0

    def insert(conn) -> None:
        conn.executemany(
            "INSERT INTO threads (id, provider_key, agent_name, segment_head, created_at) "
            "VALUES (?, 'k', 'a', ?, 0)",
            [(f"t{batch}-{i}", "x" * 500) for i in range(100)],
        )

    async def commit_a_batch() -> None:
        nonlocal batch
        await record.write(insert)
        batch += 1

    def raced_checkpoint(conn):
        if len(passes) >= 2:
            out = real(conn)
        else:
            # The first two passes: a commit lands after the pass took its
            # view of the log (a reader's older snapshot stands for that
            # moment), so the pass cannot copy it.
            before = sqlite3.connect(path, isolation_level=None)
            before.execute("BEGIN")
            before.execute("SELECT COUNT(*) FROM threads").fetchone()
            trio.from_thread.run(commit_a_batch)
            out = real(conn)
            before.execute("COMMIT")
            before.close()
        passes.append(out)
        return out

    def log_frames(conn) -> int:
        return conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()[1]

    async with R.open_record(path) as record:
        monkeypatch.setattr(R.SqliteStore, "_checkpoint", staticmethod(raced_checkpoint))
        await commit_a_batch()
        await quiet()
        mock_clock.jump(R.CHECKPOINT_SECONDS)
        await quiet()
        # Two passes left what landed meanwhile; the third copied it all.
        assert [copied < frames for _, frames, copied in passes] == [True, True, False]
        first_batch = passes[0][2]
        assert first_batch > 10
        await commit_a_batch()  # the writer's next commit starts the log over
        assert await record.read(log_frames) <= first_batch
    async with R.open_record(path) as record:
        count = await record.read(lambda c: c.execute("SELECT COUNT(*) FROM threads").fetchone())
        assert count == (400,)
