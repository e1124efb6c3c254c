"""A stream served on its connection's task alone (`web/sse.py`
`SseStream.serve` with a `broker/quiet.py` Quiet and the front's hang-up
extension, `front/sockets.py` `Hangups`): no task beside the writer, yet the
keepalive comes at its interval and a caller that hangs up is noticed at
once, its stream's source closed and nothing of it kept, while its run goes
on.

First on ASGI under MockClock with a source that waits in its quiet, then
through funduq's own front over real sockets, both doors, a full provider
(the run waits in the queue as long as the test wants). Last, a blocking
SendMessage's wait, watched by the same hang-up extension (and, without
it, by the watcher task it replaces)."""

from __future__ import annotations

import contextlib
import gc
import json
import socket
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import h11
import pytest
import trio
from reliability_support import eventually
from support import running_server, sdk_provider, user_input

from funduq_trio.broker.quiet import Quiet
from funduq_trio.front import http as front_http
from funduq_trio.front.sockets import Hangups
from funduq_trio.identity import Identity
from funduq_trio.provider import Provider, echo
from funduq_trio.web import sse
from funduq_trio.web.sse import HANGUP_EXTENSION, KEEPALIVE, SseStream


class Caller:
    """The server's side of one request on ASGI: what the app sent and when,
    and the hang-up extension a front offers (`hang_up` plays the caller
    leaving)."""

    def __init__(self) -> None:
        self.sent: list[tuple[float, bytes, bool]] = []
        self.callback: Callable[[], None] | None = None
        self.watched: list[bool] = []

    async def receive(self) -> dict[str, Any]:
        raise AssertionError("a quiet stream never waits on receive")

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(
            (trio.current_time(), message.get("body", b""), message.get("more_body", False))
        )

    def on_hangup(self, callback: Callable[[], None] | None) -> None:
        self.watched.append(callback is not None)
        self.callback = callback

    def hang_up(self) -> None:
        assert self.callback is not None
        callback, self.callback = self.callback, None
        callback()

    def scope(self) -> dict[str, Any]:
        return {"type": "http", "extensions": {HANGUP_EXTENSION: self.on_hangup}}


def quiet_source(
    quiet: Quiet, news: list[trio.Event], closed: trio.Event
) -> AsyncIterator[list[Any]]:
    """Yields a frame, then one per event of `news` as each is set; each wait
    in `quiet`, an empty burst when that ends without news (as
    `Funduq.follow` does)."""

    async def source() -> AsyncIterator[list[Any]]:
        try:
            yield [{"n": 0}]
            for n, event in enumerate(news, 1):
                while not event.is_set():
                    with quiet.waiting() as scope:
                        await event.wait()
                    if scope.cancelled_caught:
                        yield []
                yield [{"n": n}]
        finally:
            closed.set()

    return source()


async def test_keepalives_come_at_their_interval_with_no_task_beside_the_stream(
    autojump_clock,
) -> None:
    news = [trio.Event()]
    closed = trio.Event()
    quiet = Quiet()
    caller = Caller()
    start = trio.current_time()
    async with trio.open_nursery() as nursery:

        async def news_at_40() -> None:
            await trio.sleep_until(start + 40)
            news[0].set()

        nursery.start_soon(news_at_40)
        stream = SseStream(quiet_source(quiet, news, closed), 15)
        await stream.serve(caller.receive, caller.send, quiet, caller.scope())
    assert closed.is_set()
    assert [(t - start, body, more) for t, body, more in caller.sent] == [
        (0, b'data: {"n":0}\n\n', True),
        (15, KEEPALIVE, True),
        (30, KEEPALIVE, True),
        (40, b'data: {"n":1}\n\n', True),
        (40, b"", False),  # ended once
    ]
    assert caller.watched == [True, False]  # watched while it lasted, then let go


async def test_a_write_moves_the_keepalive_on(autojump_clock) -> None:
    news = [trio.Event(), trio.Event()]
    closed = trio.Event()
    quiet = Quiet()
    caller = Caller()
    start = trio.current_time()
    async with trio.open_nursery() as nursery:

        async def news_at(t: float, event: trio.Event) -> None:
            await trio.sleep_until(start + t)
            event.set()

        nursery.start_soon(news_at, 10, news[0])
        nursery.start_soon(news_at, 30, news[1])
        await SseStream(quiet_source(quiet, news, closed), 15).serve(
            caller.receive, caller.send, quiet, caller.scope()
        )
    assert [(t - start, body) for t, body, _ in caller.sent] == [
        (0, b'data: {"n":0}\n\n'),
        (10, b'data: {"n":1}\n\n'),
        (25, KEEPALIVE),  # 15 after the last write, not after the start
        (30, b'data: {"n":2}\n\n'),
        (30, b""),
    ]


async def test_no_keepalive_when_it_is_off(autojump_clock) -> None:
    news = [trio.Event()]
    closed = trio.Event()
    quiet = Quiet()
    caller = Caller()
    async with trio.open_nursery() as nursery:

        async def news_at_100() -> None:
            await trio.sleep(100)
            news[0].set()

        nursery.start_soon(news_at_100)
        await SseStream(quiet_source(quiet, news, closed), 0).serve(
            caller.receive, caller.send, quiet, caller.scope()
        )
    assert [body for _, body, _ in caller.sent] == [b'data: {"n":0}\n\n', b'data: {"n":1}\n\n', b""]


async def test_a_caller_that_hangs_up_closes_the_source_and_gets_nothing_more(
    autojump_clock,
) -> None:
    news = [trio.Event()]
    closed = trio.Event()
    quiet = Quiet()
    caller = Caller()
    async with trio.open_nursery() as nursery:

        async def leave_at_20() -> None:
            await trio.sleep(20)
            caller.hang_up()

        nursery.start_soon(leave_at_20)
        await SseStream(quiet_source(quiet, news, closed), 15).serve(
            caller.receive, caller.send, quiet, caller.scope()
        )
        assert trio.current_time() == 20  # at once, not at the next keepalive
    assert closed.is_set() and quiet.gone
    assert [body for _, body, _ in caller.sent] == [b'data: {"n":0}\n\n', KEEPALIVE]
    assert caller.watched == [True, False]


async def test_a_hang_up_during_a_write_cuts_the_write(autojump_clock) -> None:
    """A caller that stops reading and then goes: the write blocked on it is
    cancelled, the source closed."""
    closed = trio.Event()
    quiet = Quiet()
    caller = Caller()
    writing = trio.Event()

    async def stuck_send(message: dict[str, Any]) -> None:
        writing.set()
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:

        async def leave_while_writing() -> None:
            await writing.wait()
            caller.hang_up()

        nursery.start_soon(leave_while_writing)
        await SseStream(quiet_source(quiet, [trio.Event()], closed), 15).serve(
            caller.receive, stuck_send, quiet, caller.scope()
        )
    assert closed.is_set()


async def test_a_cancelled_stream_is_cut_not_ended(autojump_clock) -> None:
    """The server shutting down cancels the connection's task: no end is sent."""
    quiet = Quiet()
    caller = Caller()
    closed = trio.Event()
    with trio.move_on_after(20):
        await SseStream(quiet_source(quiet, [trio.Event()], closed), 15).serve(
            caller.receive, caller.send, quiet, caller.scope()
        )
    assert closed.is_set()
    assert [body for _, body, _ in caller.sent] == [b'data: {"n":0}\n\n', KEEPALIVE]


async def test_without_the_extension_a_watcher_task_serves_it(autojump_clock) -> None:
    """Under a server that does not offer the hang-up extension (hypercorn),
    the same stream is watched by a task reading `receive`, as before."""
    quiet = Quiet()
    closed = trio.Event()
    left = trio.Event()
    sent: list[bytes] = []

    async def receive() -> dict[str, Any]:
        await left.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message.get("body", b""))

    async with trio.open_nursery() as nursery:

        async def leave_at_20() -> None:
            await trio.sleep(20)
            left.set()

        nursery.start_soon(leave_at_20)
        await SseStream(quiet_source(quiet, [trio.Event()], closed), 15).serve(
            receive, send, quiet, {"type": "http", "extensions": {}}
        )
    assert closed.is_set()
    assert sent == [b'data: {"n":0}\n\n', KEEPALIVE]


def test_the_front_and_the_app_name_the_same_extension() -> None:
    assert front_http.HANGUP_EXTENSION == HANGUP_EXTENSION


def test_the_front_and_the_app_name_the_same_send_now() -> None:
    assert front_http.SEND_NOW_EXTENSION == sse.SEND_NOW_EXTENSION
    assert front_http.SENT == sse.SENT


class NowCaller(Caller):
    """A front that also offers `SEND_NOW_EXTENSION`: a chunk is "sent" at
    once, or (`owe`) "owed", its rest left for the next `send`."""

    def __init__(self, owe: bool = False) -> None:
        super().__init__()
        self.owe = owe
        self.now: list[bytes] = []

    def send_now(self, message: dict[str, Any]) -> str:
        assert message["more_body"]
        self.now.append(message["body"])
        self.sent.append((trio.current_time(), message["body"], True))
        return "owed" if self.owe else "sent"

    def scope(self) -> dict[str, Any]:
        scope = super().scope()
        scope["extensions"][sse.SEND_NOW_EXTENSION] = self.send_now
        return scope


@pytest.mark.parametrize("owe", [False, True])
async def test_chunks_written_at_once_come_as_they_did(autojump_clock, owe: bool) -> None:
    """With send_now the stream writes the same chunks at the same times; an
    owed chunk is followed by an empty one (the flush) before anything else."""
    news = [trio.Event()]
    closed = trio.Event()
    quiet = Quiet()
    caller = NowCaller(owe)
    start = trio.current_time()
    async with trio.open_nursery() as nursery:

        async def news_at_40() -> None:
            await trio.sleep_until(start + 40)
            news[0].set()

        nursery.start_soon(news_at_40)
        await SseStream(quiet_source(quiet, news, closed), 15).serve(
            caller.receive, caller.send, quiet, caller.scope()
        )
    assert closed.is_set()
    chunks = [b'data: {"n":0}\n\n', KEEPALIVE, KEEPALIVE, b'data: {"n":1}\n\n']
    assert caller.now == chunks
    flushes = [b""] if owe else []
    assert [body for _, body, _ in caller.sent] == [
        *(part for chunk in chunks for part in [chunk, *flushes]),
        b"",
    ]
    assert [t - start for t, _, _ in caller.sent][:: 2 if owe else 1][:4] == [0, 15, 30, 40]
    assert caller.sent[-1][2] is False  # ended once


async def test_a_hang_up_during_an_owed_write_cuts_it(autojump_clock) -> None:
    """A chunk the kernel did not all take: its flush, blocked on a caller
    that stopped reading, is cancelled when the caller goes."""
    closed = trio.Event()
    quiet = Quiet()
    caller = NowCaller(owe=True)
    writing = trio.Event()

    async def stuck_send(message: dict[str, Any]) -> None:
        writing.set()
        await trio.sleep_forever()

    async with trio.open_nursery() as nursery:

        async def leave_while_writing() -> None:
            await writing.wait()
            caller.hang_up()

        nursery.start_soon(leave_while_writing)
        await SseStream(quiet_source(quiet, [trio.Event()], closed), 15).serve(
            caller.receive, stuck_send, quiet, caller.scope()
        )
    assert closed.is_set() and quiet.gone


async def test_a_source_that_waits_first_sends_the_head_at_once(autojump_clock) -> None:
    """A queued run's AG-UI stream has no event until the run starts: its
    first wait ends at once so the status and headers go out (an empty
    body), with no keepalive text; keepalives then keep their interval."""
    news = trio.Event()
    quiet = Quiet()
    caller = Caller()
    start = trio.current_time()

    async def waits_first() -> AsyncIterator[list[Any]]:
        while not news.is_set():
            with quiet.waiting() as scope:
                await news.wait()
            if scope.cancelled_caught:
                yield []
        yield [{"n": 1}]

    async with trio.open_nursery() as nursery:

        async def news_at_20() -> None:
            await trio.sleep_until(start + 20)
            news.set()

        nursery.start_soon(news_at_20)
        await SseStream(waits_first(), 15).serve(caller.receive, caller.send, quiet, caller.scope())
    assert [(t - start, body, more) for t, body, more in caller.sent] == [
        (0, b"", True),  # the head, at once
        (15, KEEPALIVE, True),
        (20, b'data: {"n":1}\n\n', True),
        (20, b"", False),
    ]


async def test_an_agui_caller_of_a_queued_run_gets_its_status_at_once(tmp_path: Path) -> None:
    """Through the front, keepalives off: the 200 and its headers reach the
    caller while its run waits for room, before any event (the front writes
    a head with the first body; the stream's first wait sends an empty one)."""
    async with running_server(tmp_path, sse_keepalive_seconds=0) as info:
        identity = Identity.generate()
        async with attached(info, identity, room=0):
            caller = RawStream(info.port)
            await caller.post(
                f"/agui/{identity.fingerprint}/echo", user_input("wait", thread_id="head-thread")
            )
            assert caller.sock is not None
            with trio.fail_after(NET):
                while (event := caller.conn.next_event()) is h11.NEED_DATA:
                    caller.conn.receive_data(await caller.sock.recv(65536))
            assert isinstance(event, h11.Response) and event.status_code == 200
            assert dict(event.headers)[b"content-type"].startswith(b"text/event-stream")
            (lane,) = info.funduq.lanes.values()
            assert lane.status == "queued"
            caller.hang_up()


#: A safety net against a hang, never a behaviour clock.
NET = 10.0


# ----------------------------------------------- through the front, real sockets


class RawStream:
    """One caller's POST and its SSE stream over a plain socket."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.conn = h11.Connection(h11.CLIENT)
        self.sock: trio.socket.SocketType | None = None
        self.pending = b""

    async def post(self, path: str, body: Any, **extra: str) -> None:
        sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        await sock.connect(("127.0.0.1", self.port))
        self.sock = sock
        data = json.dumps(body).encode()
        headers = [
            ("Host", "test"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(data))),
            *extra.items(),
        ]
        out = self.conn.send(h11.Request(method="POST", target=path, headers=headers))
        out += self.conn.send(h11.Data(data=data)) + self.conn.send(h11.EndOfMessage())
        await sock.send(out)

    async def first_frame(self) -> Any:
        """Read until the first SSE frame; its data as JSON."""
        assert self.sock is not None
        while b"\n\n" not in self.pending:
            event = self.conn.next_event()
            if event is h11.NEED_DATA:
                self.conn.receive_data(await self.sock.recv(65536))
            elif isinstance(event, h11.Response):
                assert event.status_code == 200
            elif isinstance(event, h11.Data):
                self.pending += bytes(event.data)
            else:
                raise AssertionError(f"the stream ended: {event}")
        frame = self.pending.split(b"\n\n", 1)[0]
        data = [line[5:] for line in frame.split(b"\n") if line.startswith(b"data:")]
        return json.loads(data[0])

    def hang_up(self) -> None:
        assert self.sock is not None
        self.sock.close()


def the_hangups() -> Hangups:
    """The running server's (those of servers stopped earlier are closed)."""
    (hangups,) = [o for o in gc.get_objects() if type(o) is Hangups and not o._set.closed]
    return hangups


#: The A2A protocol version the door speaks (its header).
V1 = {"A2A-Version": "1.0"}


def a2a_stream_body(text: str) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": 1,
        "method": "SendStreamingMessage",
        "params": {
            "message": {
                "messageId": f"m-{text}",
                "role": "ROLE_USER",
                "parts": [{"text": text}],
            }
        },
    }


@pytest.mark.parametrize("door", ["a2a", "agui"])
async def test_a_caller_that_hangs_up_while_its_run_waits_is_let_go(
    tmp_path: Path, door: str
) -> None:
    """A waiting run's stream: watched by the front (no task of its own);
    the caller hangs up; its stream ends at once (unwatched, its follow of
    the run closed, nothing of it left in memory) while the run stays queued
    and completes once the provider has room."""
    if not Hangups.available:
        pytest.skip("the hang-up watch is Linux's epoll")
    async with running_server(tmp_path) as info:
        funduq = info.funduq
        identity = Identity.generate()
        fp = identity.fingerprint
        async with attached(info, identity, room=0):
            caller = RawStream(info.port)
            if door == "a2a":
                await caller.post(f"/a2a/{fp}/echo", a2a_stream_body("wait"), **V1)
                first = await caller.first_frame()
                assert first["result"]["task"]["status"]["state"] == "TASK_STATE_SUBMITTED"
            else:  # an AG-UI stream says nothing of a run until it starts
                await caller.post(
                    f"/agui/{fp}/echo", user_input("wait", thread_id="hang-up-thread")
                )

            async def followed() -> bool:
                lanes = list(funduq.lanes.values())
                return bool(lanes and lanes[0].feed._followers)

            await eventually(followed, "the stream follows its queued run")
            (lane,) = funduq.lanes.values()
            run_id = lane.run_id
            assert lane.status == "queued"
            hangups = the_hangups()
            assert len(hangups._callbacks) == 1  # the front watches it, no task does
            stream_parts = {SseStream, Quiet}
            assert [o for o in gc.get_objects() if type(o) in stream_parts]

            caller.hang_up()

            async def let_go() -> bool:
                gc.collect()
                return (
                    not hangups._callbacks
                    and not lane.feed._followers
                    and not [o for o in gc.get_objects() if type(o) in stream_parts]
                )

            await eventually(let_go, "the stream let go of its caller, of the run, of all it held")
            assert funduq.lanes[run_id].status == "queued"  # the run goes on
        async with attached(info, identity, room=None):

            async def completed() -> bool:
                record = await funduq.get_run(run_id)
                return record is not None and record["status"] == "completed"

            await eventually(completed, "the run completes once there is room")


@contextlib.asynccontextmanager
async def attached(info: Any, identity: Identity, room: int | None) -> AsyncIterator[None]:
    """The SDK's echo provider under `identity`, holding `room` runs at once."""
    provider = Provider(identity, info.provider_url, max_concurrent_runs=room)
    provider.add_agent(echo, name="echo")
    async with trio.open_nursery() as nursery:
        await nursery.start(provider.run)
        yield
        nursery.cancel_scope.cancel()


async def test_nothing_of_a_streamed_run_is_kept_once_it_ends(tmp_path: Path) -> None:
    """A streamed run followed to its end through the front: once the stream
    has ended, no stream, quiet, lane or feed of it is left, and the front
    watches nothing."""
    if not Hangups.available:
        pytest.skip("the hang-up watch is Linux's epoll")
    from funduq_trio.broker.lanes import Feed, Lane

    parts = {SseStream, Quiet, Lane, Feed}
    gc.collect()
    before = {id(o) for o in gc.get_objects() if type(o) in parts}
    async with running_server(tmp_path) as info, sdk_provider(info) as provider:
        fp = provider.identity.fingerprint
        caller = RawStream(info.port)
        await caller.post(f"/a2a/{fp}/echo", a2a_stream_body("to the end"), **V1)
        assert (await caller.first_frame())["result"]["task"]
        assert caller.sock is not None
        while True:  # read to the response's end
            event = caller.conn.next_event()
            if event is h11.NEED_DATA:
                caller.conn.receive_data(await caller.sock.recv(65536))
            elif isinstance(event, h11.EndOfMessage):
                break
            else:
                assert isinstance(event, h11.Data | h11.Response)
        caller.hang_up()

        def kept() -> list[str]:
            gc.collect()
            return [
                type(o).__name__
                for o in gc.get_objects()
                if type(o) in parts and id(o) not in before
            ]

        async def settled() -> bool:
            return not info.funduq.lanes and not the_hangups()._callbacks and not kept()

        await eventually(settled, "the run settled, nothing of it is kept, the front watches none")


# ------------------------------------------------- the broker's follow, quiet


async def test_follow_in_a_quiet_yields_an_empty_burst_at_each_deadline_and_at_the_end(
    tmp_path: Path, mock_clock
) -> None:
    """`Funduq.follow` with a quiet: a queued run's follower gets an empty
    burst when its wait reaches the quiet's deadline (and waits again), and
    one at once when the quiet ends (the caller went); the run goes on.
    Without a quiet, no empty burst ever (every other follower)."""
    from broker_support import Provider as FakeProvider
    from broker_support import advance, broker, start
    from broker_support import quiet as settle

    async with broker(tmp_path) as funduq:
        p = await FakeProvider(funduq, max_concurrent=0).attach()
        ticket = await start(funduq, p, text="followed quietly")
        quiet = Quiet()
        t0 = trio.current_time()
        quiet.deadline = t0 + 15
        seen: list[tuple[float, int]] = []
        plain_seen: list[Any] = []

        async def follower() -> None:
            async with contextlib.aclosing(funduq.follow(ticket.run_id, quiet=quiet)) as bursts:
                async for burst in bursts:
                    seen.append((trio.current_time() - t0, len(burst)))
                    if quiet.gone:
                        break
                    quiet.deadline = trio.current_time() + 15  # as a stream after a write

        async def plain_follower() -> None:
            async with contextlib.aclosing(funduq.follow(ticket.run_id)) as bursts:
                async for burst in bursts:
                    plain_seen.append(burst)  # pragma: no cover -- nothing comes

        async with trio.open_nursery() as nursery:
            nursery.start_soon(follower)
            nursery.start_soon(plain_follower)
            await advance(mock_clock, 14.5)
            assert seen == []
            await advance(mock_clock, 0.5)
            assert seen == [(15, 0)]
            await advance(mock_clock, 15)
            assert seen == [(15, 0), (30, 0)]
            await advance(mock_clock, 5)
            quiet.end()
            await settle()
            assert seen == [(15, 0), (30, 0), (35, 0)]  # at once, and the follower left
            lane = funduq.lanes[ticket.run_id]
            assert lane.status == "queued"  # the run goes on
            assert lane.feed._followers is not None and len(lane.feed._followers) == 1
            await advance(mock_clock, 100)
            assert plain_seen == []
            nursery.cancel_scope.cancel()


# ------------------------------------- a blocking SendMessage's wait, watched too


def a2a_blocking_body(text: str) -> dict[str, Any]:
    return {**a2a_stream_body(text), "method": "SendMessage"}


def all_tasks() -> list[trio.lowlevel.Task]:
    tasks, todo = [], [trio.lowlevel.current_root_task()]
    while todo:
        task = todo.pop()
        assert task is not None
        tasks.append(task)
        todo.extend(t for n in task.child_nurseries for t in n.child_tasks)
    return tasks


def named(part: str) -> list[str]:
    return [t.name for t in all_tasks() if part in t.name]


#: The task `asgi_doors._until_gone` starts beside a door's wait (no
#: hang-up extension: hypercorn, or a front without epoll).
WATCHER = "_until_gone.<locals>.watch"


@pytest.mark.parametrize("half_closes", [False, True], ids=["closes", "half-closes"])
@pytest.mark.parametrize("watched_by_the_front", [True, False], ids=["hangup", "fallback"])
async def test_a_blocking_send_whose_caller_hangs_up_is_let_go_at_once(
    tmp_path: Path,
    mock_clock: Any,
    monkeypatch: pytest.MonkeyPatch,
    watched_by_the_front: bool,
    half_closes: bool,
) -> None:
    """A blocking SendMessage through the front over real sockets, its run
    queued behind a full provider. With the hang-up extension the wait runs
    on the connection's task alone (the front watches the socket; no watcher
    task); without it, a watcher task reads `receive`. The caller hangs up:
    with trio's clock frozen (no timeout can end anything), the request is
    over once the server has done what it can -- no task, no epoll
    registration, no exchange or door left, nothing written to it (a caller
    that only half-closes reads its end, no answer) -- and the run stays
    queued, then completes once the provider has room, as it always did."""
    from broker_support import quiet as settle

    from funduq_trio.web.a2a_door import A2ADoor

    if watched_by_the_front and not Hangups.available:
        pytest.skip("the hang-up watch is Linux's epoll")
    if not watched_by_the_front:
        monkeypatch.setattr(Hangups, "available", False)
    request_parts = {front_http.Exchange, A2ADoor}
    async with running_server(tmp_path) as info:
        funduq = info.funduq
        identity = Identity.generate()
        async with attached(info, identity, room=0):
            try:
                await settle()
                connections = len(named("Connection.serve"))  # the provider's link
                caller = RawStream(info.port)
                await caller.post(
                    f"/a2a/{identity.fingerprint}/echo", a2a_blocking_body("wait"), **V1
                )
                await settle()
                (lane,) = funduq.lanes.values()
                run_id = lane.run_id
                assert lane.status == "queued"
                assert len(named("Connection.serve")) == connections + 1  # the caller's, waiting
                if watched_by_the_front:
                    assert len(the_hangups()._callbacks) == 1
                    assert named(WATCHER) == []  # the wait has no task beside it
                else:
                    assert len(named(WATCHER)) == 1
                t0 = trio.current_time()

                assert caller.sock is not None
                if half_closes:
                    caller.sock.shutdown(socket.SHUT_WR)
                else:
                    caller.hang_up()
                await settle()
                if half_closes:
                    assert await caller.sock.recv(65536) == b""  # no answer, the end
                    caller.hang_up()

                assert trio.current_time() == t0  # frozen: no timeout could have done it
                assert (
                    len(named("Connection.serve")) == connections
                )  # the request, and its connection, over
                assert named(WATCHER) == []
                if watched_by_the_front:
                    assert not the_hangups()._callbacks
                gc.collect()
                assert not [o for o in gc.get_objects() if type(o) in request_parts]
                assert funduq.lanes[run_id].status == "queued"  # the run goes on
            finally:  # time flows again: a provider's link closes on timers
                mock_clock.rate = 1
        async with attached(info, identity, room=None):

            async def completed() -> bool:
                record = await funduq.get_run(run_id)
                return record is not None and record["status"] == "completed"

            await eventually(completed, "the run completes once there is room")
