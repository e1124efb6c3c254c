"""Write first on the provider link (web/provider_socket.py `_queue`,
front/websocket.py `send_now`): a frame for an idle link is written from the
step that made it; what the kernel does not take at once goes to the link's
writer task, which owns the socket until its outbox is empty again.

- the front's `write_now` over a real socket pair: whole, in part (the rest
  goes first with the next write, so nothing lands inside a frame), or not
  at all while another write is under way;
- the link over a scripted socket, every interleaving forced: frames written
  at once, then one taken in part while the provider does not read, the
  frames behind it queued (lanes and reader never wait), then in order and
  batched once it reads, then written at once again; a busy socket; a close
  queued behind a write that does not end, and one that cuts it;
- a real server and a provider that stops reading: its offers back up in
  the kernel and the outbox while it still finishes a run, and once it reads
  every offer arrives whole, in the order the runs were started;
- without the extension (hypercorn) everything goes through the writer.
"""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio
import trio.testing
from broker_support import broker, quiet
from broker_support import user_input as broker_input
from support import http_client, post_sse, running_server, user_input
from wsproto import ConnectionType, WSConnection
from wsproto.events import AcceptConnection, Request, TextMessage

from funduq_trio.front import http as front_http
from funduq_trio.front.http import BUSY, OWED, SENT
from funduq_trio.front.limits import FrontLimits
from funduq_trio.identity import Identity, new_nonce, provider_connect_payload
from funduq_trio.web.provider_socket import (
    WRITE_FIRST_GAP_SECONDS,
    AsgiWebsocket,
    ProviderSocket,
)

# --- the front: Connection.write_now over a real socket pair --------------------------


def _pair() -> tuple[front_http.Connection, socket.socket]:
    ours, theirs = socket.socketpair()
    ours.setblocking(False)
    ours.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
    return front_http.Connection(ours, None, None, FrontLimits()), theirs


def _drain(sock: socket.socket) -> bytes:
    sock.setblocking(False)
    data = b""
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            return data
        if not chunk:
            return data
        data += chunk


async def test_write_or_owe_owes_what_write_now_would_refuse_and_keeps_the_order():
    """`write_or_owe` (an SSE chunk's `Exchange.send_now`): never BUSY; what
    the kernel does not take is owed and goes, in order, with the next write."""
    conn, theirs = _pair()
    big = bytes(range(256)) * 4096
    assert conn.write_or_owe(big) == OWED  # written in part
    assert conn.write_or_owe(b"next") == OWED  # nothing at once: owed after it
    got = b""

    async def read_all() -> None:
        nonlocal got
        await trio.testing.wait_all_tasks_blocked()
        while len(got) < len(big) + len(b"next"):
            await trio.lowlevel.wait_readable(theirs)
            got += _drain(theirs)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_all)
        await conn.write(b"")  # the flush
    assert got == big + b"next"
    assert conn.write_or_owe(b"again") == SENT
    assert _drain(theirs) == b"again"
    conn.sock.close()
    theirs.close()


async def test_write_now_writes_whole_in_part_or_not_at_all_and_keeps_the_order():
    conn, theirs = _pair()
    assert conn.write_now(b"first") == SENT
    assert _drain(theirs) == b"first"
    # The peer stops reading: a message larger than the kernel takes is
    # written in part, and the rest is owed.
    big = bytes(range(256)) * 4096
    assert conn.write_now(big) == OWED
    # While bytes are owed nothing is written at once: it would land inside
    # the owed message.
    assert conn.write_now(b"after") == BUSY
    got = b""

    async def read_all() -> None:
        nonlocal got
        await trio.testing.wait_all_tasks_blocked()  # the write waits for room
        while len(got) < len(big) + len(b"after"):
            await trio.lowlevel.wait_readable(theirs)
            got += _drain(theirs)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read_all)
        await conn.write(b"after")  # the owed rest first, then this
    assert got == big + b"after"
    assert not conn.gone
    # With nothing owed the connection writes at once again.
    assert conn.write_now(b"again") == SENT
    assert _drain(theirs) == b"again"
    conn.sock.close()
    theirs.close()


async def test_write_now_is_busy_while_a_write_waits_for_room_and_sent_once_gone():
    conn, theirs = _pair()
    big = b"x" * (1 << 20)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(conn.write, big)
        await trio.testing.wait_all_tasks_blocked()  # blocked: the peer does not read
        assert conn.write_now(b"y") == BUSY
        nursery.cancel_scope.cancel()
    # A write cut half way leaves the connection unusable: dropped, like `write`.
    assert conn.gone
    assert conn.write_now(b"z") == SENT
    conn.sock.close()
    theirs.close()


# --- the link: a scripted socket, every interleaving forced ----------------------------


class ScriptedSocket:
    """The server side of a provider link in memory, offering `send_now`.
    `wire` is what the provider would read, one entry per message; `outcome`
    is what the next `send_now` does. An "owed" message reaches the wire
    only once `flush` ends, which waits for `reading` (a provider that does
    not read)."""

    can_send_now = True

    def __init__(self) -> None:
        self._in_send, self._in = trio.open_memory_channel[str](100)
        self.wire: list[dict[str, Any]] = []
        self.how: list[str] = []  # "now" or "writer", per message on the wire
        self.outcome = SENT
        self.owed: str | None = None
        self.reading: trio.Event | None = None
        self.closed: tuple[int, str] | None = None
        self.flushing = False

    async def accept(self) -> None:
        pass

    async def receive(self) -> str:
        return await self._in.receive()

    def send_now(self, text: str) -> str:
        if self.owed is not None or self.flushing:
            return BUSY  # as the front: bytes owed, or a write under way
        if self.outcome == SENT:
            self._put(text, "now")
        elif self.outcome == OWED:
            self.owed = text
        return self.outcome

    async def flush(self) -> None:
        self.flushing = True
        try:
            if self.reading is not None:
                await self.reading.wait()
            if self.owed is not None:
                self._put(self.owed, "now")
                self.owed = None
        finally:
            self.flushing = False

    async def send(self, text: str) -> None:
        assert self.owed is None, "the owed rest must go before anything else"
        self.flushing = True
        try:
            if self.reading is not None:
                await self.reading.wait()
        finally:
            self.flushing = False
        self._put(text, "writer")

    async def close(self, code: int, reason: str) -> None:
        assert self.owed is None
        self.closed = (code, reason)

    def _put(self, text: str, how: str) -> None:
        self.wire.append(json.loads(text))
        self.how.append(how)

    def offers(self) -> list[str]:
        """The run ids of the offers on the wire, in order, batches opened."""
        ids = []
        for message in self.wire:
            for frame in message["frames"] if message["kind"] == "batch" else [message]:
                if frame["kind"] == "offer":
                    ids.append(frame["run"]["runId"])
        return ids


async def attach(ws: Any, funduq: Any, provider: Identity, extensions: Any) -> None:
    """Play a provider's handshake and registration of `echo` over `ws`."""
    await trio.testing.wait_all_tasks_blocked()
    hello = next(m for m in ws.wire if m["kind"] == "hello")
    nonce = new_nonce()
    proof = provider.sign(provider_connect_payload(hello["funduqKey"], hello["nonce"], nonce))
    await ws._in_send.send(
        json.dumps(
            {
                "kind": "connect",
                "publicKey": provider.public_key_hex,
                "nonce": nonce,
                "proof": proof,
                "maxConcurrentRuns": None,
                "extensions": extensions,
            }
        )
    )
    await ws._in_send.send(
        json.dumps(
            {
                "kind": "register",
                "id": "r1",
                "agents": [{"name": "echo", "description": None, "card": None, "metadata": None}],
            }
        )
    )
    await quiet()
    assert ws.wire[-1]["kind"] == "ok", ws.wire


@asynccontextmanager
async def linked(
    tmp_path: Any, extensions: Any
) -> AsyncIterator[tuple[Any, Identity, ScriptedSocket, ProviderSocket]]:
    """A broker, and a provider attached over a scripted socket with
    `extensions`, its link running until the block ends."""
    provider = Identity.generate()
    async with broker(tmp_path) as funduq:
        ws = ScriptedSocket()
        link = ProviderSocket(ws, funduq)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(link.run)
            await attach(ws, funduq, provider, extensions)
            yield funduq, provider, ws, link
            nursery.cancel_scope.cancel()


async def start(funduq: Any, provider: Identity, i: int, clock: Any = None) -> str:
    """Start a run and let its lane hand the offer to the link; with `clock`,
    past the link's write-first gap first (WRITE_FIRST_GAP_SECONDS)."""
    if clock is not None:
        clock.jump(WRITE_FIRST_GAP_SECONDS)
    ticket = await funduq.start_run(provider.public_key_hex, "echo", broker_input(f"run {i}"))
    await quiet()  # its lane has handed the offer to the link
    return ticket.run_id


async def test_frames_written_at_once_then_queued_behind_a_stalled_write_keep_their_order(
    tmp_path, mock_clock
):
    async with linked(tmp_path, ["batch"]) as (funduq, provider, ws, link):
        before = len(ws.wire)
        # Idle: each offer is written from its lane's step, no writer step.
        runs = [await start(funduq, provider, i, mock_clock) for i in (0, 1)]
        assert ws.how[before:] == ["now", "now"]
        # The provider stops reading: the next offer is taken in part, and
        # the writer owns the socket; what follows queues behind it.
        ws.reading, ws.outcome = trio.Event(), OWED
        runs.append(await start(funduq, provider, 2, mock_clock))
        assert ws.owed is not None and not link._writer_idle
        ws.outcome = SENT  # room again, but the owed rest must go first
        runs += [await start(funduq, provider, i, mock_clock) for i in (3, 4)]
        assert ws.offers() == runs[:2]  # the lanes went on; nothing more left
        # The reader is not held either: the provider accepts the first
        # run and finishes it while its writes are stalled.
        first = next(m for m in ws.wire if m["kind"] == "offer")
        ids = {"threadId": first["run"]["threadId"], "runId": runs[0]}
        frames: list[dict[str, Any]] = [
            {"kind": "ok", "id": first["id"], "verdict": "accepted", "reason": None},
            *(
                {"kind": "report", "runId": runs[0], "event": {"type": t, **ids}, "seq": n}
                for n, t in enumerate(("RUN_STARTED", "RUN_FINISHED"), 1)
            ),
            {"kind": "finish", "runId": runs[0]},
        ]
        for frame in frames:
            await ws._in_send.send(json.dumps(frame))
        await quiet()
        assert (await funduq.get_run(runs[0]))["status"] == "completed"
        # It reads again: the owed offer, then the two queued behind it as
        # one batch, in the order their runs were started.
        ws.reading.set()
        await quiet()
        assert ws.offers() == runs
        tail = ws.wire[-2:]
        assert tail[0]["kind"] == "offer" and tail[0]["run"]["runId"] == runs[2]
        assert tail[1]["kind"] == "batch" and len(tail[1]["frames"]) == 2
        assert link._writer_idle
        # The outbox is empty again: the next one is written at once.
        ws.reading = None
        runs.append(await start(funduq, provider, 5, mock_clock))
        assert ws.offers() == runs and ws.how[-1] == "now"


async def test_a_busy_socket_sends_the_frame_through_the_writer_in_its_place(tmp_path, mock_clock):
    async with linked(tmp_path, None) as (funduq, provider, ws, link):
        before = len(ws.wire)
        ws.outcome = BUSY  # e.g. the front writing a pong
        runs = [await start(funduq, provider, 0, mock_clock)]
        ws.outcome = SENT
        runs.append(await start(funduq, provider, 1, mock_clock))
        assert ws.offers() == runs and ws.how[before:] == ["writer", "now"]


async def test_a_frame_made_while_the_writer_holds_one_goes_behind_it(tmp_path, mock_clock):
    """The writer has been handed a frame but has not run yet (the socket is
    free): a frame made in the same step must not be written before it."""
    async with linked(tmp_path, ["batch"]) as (funduq, provider, ws, link):
        before = len(ws.wire)
        ws.outcome = BUSY
        mock_clock.jump(WRITE_FIRST_GAP_SECONDS)
        link.send_cancel("run-a")  # to the writer, which is not yet back
        ws.outcome = SENT
        link.send_cancel("run-b")  # same step: queued behind it
        link.send_cancel("run-c")
        await quiet()
        (batch,) = ws.wire[before:]
        assert [f["runId"] for f in batch["frames"]] == ["run-a", "run-b", "run-c"]
        mock_clock.jump(WRITE_FIRST_GAP_SECONDS)
        link.send_cancel("run-d")  # the outbox is empty again: at once
        assert ws.wire[-1] == {"kind": "cancel", "runId": "run-d"} and ws.how[-1] == "now"


async def test_frames_made_within_the_gap_go_to_the_writer_as_one_batch(tmp_path, mock_clock):
    """At saturation frames come faster than the gap: the first is written at
    once, those right behind it wait for the writer and share a message."""
    async with linked(tmp_path, ["batch"]) as (funduq, provider, ws, link):
        before = len(ws.wire)
        mock_clock.jump(WRITE_FIRST_GAP_SECONDS)
        link.send_cancel("run-a")  # at once
        await quiet()  # other steps, no time passing
        for run_id in ("run-b", "run-c", "run-d"):
            link.send_cancel(run_id)  # within the gap: the writer's
        await quiet()
        assert ws.how[before:] == ["now", "writer"]
        first, batch = ws.wire[before:]
        assert first["runId"] == "run-a"
        assert [f["runId"] for f in batch["frames"]] == ["run-b", "run-c", "run-d"]
        mock_clock.jump(WRITE_FIRST_GAP_SECONDS)
        link.send_cancel("run-e")  # past the gap: at once again
        assert ws.how[-1] == "now" and ws.wire[-1]["runId"] == "run-e"


async def test_without_batches_every_frame_is_written_first(tmp_path, mock_clock):
    """A provider that takes no batches gains nothing from the writer: no gap."""
    async with linked(tmp_path, None) as (funduq, provider, ws, link):
        before = len(ws.wire)
        runs = [await start(funduq, provider, i) for i in range(3)]
        assert ws.offers() == runs and ws.how[before:] == ["now"] * 3


async def test_a_close_waits_behind_a_stalled_write_and_goes_after_it(tmp_path, mock_clock):
    async with linked(tmp_path, None) as (funduq, provider, ws, link):
        ws.reading, ws.outcome = trio.Event(), OWED
        run_id = await start(funduq, provider, 0, mock_clock)
        link.close("going away")
        await quiet()
        assert ws.closed is None and ws.owed is not None  # behind the owed rest
        ws.reading.set()
        await quiet()
        assert ws.offers() == [run_id] and ws.closed is not None
        assert ws.closed[1] == "going away"


async def test_a_link_that_ends_while_a_write_is_stalled_ends_whole(tmp_path, mock_clock):
    provider = Identity.generate()
    async with broker(tmp_path) as funduq:
        ws = ScriptedSocket()
        link = ProviderSocket(ws, funduq)
        handler = trio.CancelScope()
        ended = trio.Event()

        async def serve() -> None:
            with handler:
                await link.run()
            ended.set()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(serve)
            await attach(ws, funduq, provider, None)
            ws.reading, ws.outcome = trio.Event(), OWED
            run_id = await start(funduq, provider, 0, mock_clock)
            await start(funduq, provider, 1, mock_clock)
            # The provider goes: as AsgiWebsocket does on a disconnect, the
            # link's handler is cancelled, the stalled write with it.
            handler.cancel()
            await quiet()
            assert ended.is_set()
        assert ws.offers() == [] and not link._writer_idle
        # Its runs are not left waiting on a link that is gone.
        assert (await funduq.get_run(run_id))["status"] != "offering"


async def test_without_the_extension_every_frame_goes_through_the_writer(tmp_path):
    async def nothing() -> dict[str, Any]:
        return {}

    # Under hypercorn the scope has no funduq.websocket.send_now.
    plain = AsgiWebsocket(nothing, nothing, lambda: None)
    assert not plain.can_send_now
    async with broker(tmp_path) as funduq:
        assert not ProviderSocket(plain, funduq)._write_first
        offered = AsgiWebsocket(nothing, nothing, lambda: None, lambda message: SENT)
        assert ProviderSocket(offered, funduq)._write_first


# --- a real server and a provider that stops reading ------------------------------------


class StalledProvider:
    """A provider on a raw socket with a small receive buffer, framing by
    wsproto: it reads only when told to."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.CLIENT)
        self.messages: list[dict[str, Any]] = []
        self._parts: list[str] = []

    @classmethod
    async def dial(cls, port: int) -> StalledProvider:
        sock = trio.socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        await sock.connect(("127.0.0.1", port))
        self = cls(trio.SocketStream(sock))
        await self.stream.send_all(self.ws.send(Request(host="127.0.0.1", target="/ws/provider")))
        while not any(m["kind"] == "hello" for m in self.messages):
            await self.read_some()
        return self

    async def read_some(self) -> None:
        data = await self.stream.receive_some()
        assert data, "the server closed the link"
        self.ws.receive_data(data)
        for event in self.ws.events():
            if isinstance(event, TextMessage):
                self._parts.append(event.data)
                if event.message_finished:
                    self.messages.append(json.loads("".join(self._parts)))
                    self._parts = []
            else:
                assert isinstance(event, AcceptConnection), event

    async def send(self, frame: dict[str, Any]) -> None:
        await self.stream.send_all(self.ws.send(TextMessage(data=json.dumps(frame))))

    async def next(self, kind: str) -> dict[str, Any]:
        while not any(m["kind"] == kind for m in self.messages):
            await self.read_some()
        found = next(m for m in self.messages if m["kind"] == kind)
        self.messages.remove(found)
        return found


async def test_a_provider_that_stops_reading_holds_nothing_up_and_gets_every_offer_in_order(
    tmp_path, monkeypatch
):
    identity = Identity.generate()
    handed: list[str] = []  # offer ids in the order the lanes gave them to the link
    send_offer = ProviderSocket.send_offer

    def recorded(self: ProviderSocket, offer_id: str, run: dict[str, Any]) -> None:
        handed.append(offer_id)
        send_offer(self, offer_id, run)

    monkeypatch.setattr(ProviderSocket, "send_offer", recorded)
    async with running_server(tmp_path) as info, http_client(info) as http:
        provider = await StalledProvider.dial(info.port)
        hello = await provider.next("hello")
        nonce = new_nonce()
        payload = provider_connect_payload(hello["funduqKey"], hello["nonce"], nonce)
        await provider.send(
            {
                "kind": "connect",
                "publicKey": identity.public_key_hex,
                "nonce": nonce,
                "proof": identity.sign(payload),
                "maxConcurrentRuns": None,
                "extensions": None,
            }
        )
        await provider.next("connect.ok")
        agent = {"name": "echo", "description": None, "card": None, "metadata": None}
        await provider.send({"kind": "register", "id": "r1", "agents": [agent]})
        await provider.next("ok")
        url = f"/agui/{identity.fingerprint}/echo"
        answers: dict[str, Any] = {}

        async def call(name: str, text: str) -> None:
            answers[name] = await post_sse(http, url, user_input(text, thread_id=name))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call, "held", "hi")
            held = await provider.next("offer")
            await provider.send(
                {"kind": "ok", "id": held["id"], "verdict": "accepted", "reason": None}
            )
            # From here the provider reads nothing. Runs with large inputs,
            # started one at a time: their offers fill the socket's buffers,
            # then the link's outbox.
            big = "x" * 200_000
            for i in range(40):
                nursery.start_soon(call, f"big-{i:02}", f"{i:02} {big}")
                await trio.testing.wait_all_tasks_blocked()
            # The reader is not held: the held run is finished and its caller
            # answered while funduq's writes to this provider are stalled.
            ids = {"threadId": held["run"]["threadId"], "runId": held["run"]["runId"]}
            events = [{"type": "RUN_STARTED", **ids}, {"type": "RUN_FINISHED", **ids}]
            for seq, event in enumerate(events, 1):
                await provider.send(
                    {"kind": "report", "runId": ids["runId"], "event": event, "seq": seq}
                )
            await provider.send({"kind": "finish", "runId": ids["runId"]})
            with trio.fail_after(30):
                while "held" not in answers:
                    await trio.sleep(0.01)
            assert not provider.messages  # it really read nothing meanwhile
            # It reads again: every offer, whole, in the order it was handed
            # to the link.
            offers = [await provider.next("offer") for _ in range(40)]
            assert [o["id"] for o in offers] == handed[1:]
            texts = [o["run"]["runInput"]["messages"][-1]["content"] for o in offers]
            assert sorted(t[:2] for t in texts) == [f"{i:02}" for i in range(40)]
            assert all(len(t) == 3 + len(big) for t in texts)
            nursery.cancel_scope.cancel()
