"""One HTTP/1.1 connection: h11 parses, the app answers on this task.

`Connection.serve` reads a request, builds its ASGI scope, awaits the app with
an `Exchange`'s `receive` and `send`, and goes on to the next request while
h11 says the connection may be kept. A websocket upgrade is handed to
`front/websocket.py` with what h11 read past the request.

The common request takes a road of its own (`parse_request`): a keep-alive
HTTP/1.1 request whose head is whole in the bytes read and has nothing h11
would fold, refuse or treat apart is read by one regular expression, its
body counted by the `Exchange`, and its answer's head written by hand while
h11 would write it as it is (`_plain_head`). h11 cost ~0.5M instructions a
request cycle (bench/README.md); anything off that road goes to h11, brought
first to the state it would be in, and tests/test_front_plain.py holds the
two roads byte-equal.
"""

from __future__ import annotations

import logging
import re
import socket
import time
from collections.abc import Callable
from email.utils import formatdate
from typing import Any
from urllib.parse import unquote

import h11
import trio

try:  # h11's writer of a chunked body: its chunks are written here (Exchange.send)
    from h11._writers import ChunkedWriter as _ChunkedWriter
except ImportError:  # pragma: no cover - another h11: every chunk through h11
    _ChunkedWriter = None  # type: ignore[assignment,misc]

from . import sockets
from .limits import FrontLimits

log = logging.getLogger("funduq_trio.server")

#: After refusing a request whose body is not read (413, 408), funduq reads
#: and drops what the caller still sends, for at most this long and this
#: much, before closing: closing with unread bytes resets the connection, and
#: a caller still writing its body (as most clients do before they read)
#: would lose the answer it was sent. (nginx's "lingering close".)
LINGER_SECONDS = 2.0
LINGER_BYTES = 64 * 1024 * 1024

DISCONNECT = {"type": "http.disconnect"}

#: The ASGI extension by which the app asks to be told when the caller goes
#: without a task waiting on `receive` (`web/sse.py` streams and
#: `web/asgi_doors.py`'s blocking door waits use it): its
#: value is a callable taking a callback, or None to stop.
HANGUP_EXTENSION = "funduq.hangup"
#: The ASGI extension by which the app writes a body chunk from the step
#: that made it, without awaiting (`web/sse.py`'s chunks): its value is
#: `Exchange.send_now`. When it answers "owed", the app's next `send`
#: must follow (an empty body with more to come will do).
SEND_NOW_EXTENSION = "funduq.http.send_now"
#: The ASGI extension by which the app takes a request's body when it is
#: all at hand, without awaiting (`web/asgi_doors.py`'s run POSTs): its
#: value is `Exchange.body_now`, taking the most bytes the app accepts.
#: What it gives is what `receive` would have returned at once as the
#: body's one message; None leaves the body to `receive`.
BODY_NOW_EXTENSION = "funduq.http.body_now"
#: What `Connection.write_now` did with the bytes it was given.
SENT, OWED, BUSY = "sent", "owed", "busy"
_ASGI = {"version": "3.0", "spec_version": "2.3"}


class Connection:
    """One accepted TCP connection and the h11 state machine reading it."""

    __slots__ = (
        "app",
        "buffered",
        "client",
        "gone",
        "h11",
        "hangups",
        "limits",
        "released",
        "server",
        "sock",
        "_owed",
        "_writing",
        "_write_turns",
    )

    def __init__(
        self,
        sock: socket.socket,
        client: tuple[str, int] | None,
        app: Any,
        limits: FrontLimits,
        hangups: sockets.Hangups | None = None,
        released: Callable[[], None] | None = None,
    ) -> None:
        self.sock = sock
        #: Called once the connection has closed (the server's count).
        self.released = released
        #: The server's watch over callers that hang up (None: not offered).
        self.hangups = hangups
        self.app = app
        self.limits = limits
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=limits.max_header_bytes)
        #: The caller is gone (EOF, reset, or a write that failed or was cut):
        #: nothing more is written and the connection closes after this request.
        self.gone = False
        self.client = client
        try:
            self.server: tuple[str, int] | None = _address(sock.getsockname())
        except OSError:
            self.server = None
        self._writing = False
        #: The rest of bytes `write_now` could write only in part: the next
        #: write sends them first, so nothing lands inside a frame.
        self._owed = b""
        #: Writers waiting for the one in progress (made when first needed:
        #: two writers at once are rare, an SSE keepalive beside a burst).
        self._write_turns: trio.lowlevel.ParkingLot | None = None
        #: Bytes read past the request being served, on the front's own road
        #: (`parse_request`): the next request's, kept here, not in h11.
        self.buffered = b""

    # -- socket -----------------------------------------------------------------

    async def read(self) -> bytes:
        """The next bytes from the caller, b"" at its end (or a reset)."""
        return await sockets.read(self.sock)

    def read_now(self) -> bytes | None:
        """`read`'s bytes if the caller's are here already, without its
        checkpoints; None when they are yet to come."""
        return sockets.read_now(self.sock)

    async def read_when_ready(self) -> bytes:
        """`read` once `read_now` found nothing: the next bytes, waited for."""
        return await sockets.read_when_ready(self.sock)

    async def write(self, data: bytes) -> None:
        """Write `data` whole, or mark the caller gone. Writes never
        interleave; a write cut half way (cancelled) leaves the connection
        unusable, so it marks it gone too."""
        if self.gone or not (data or self._owed):
            return
        while self._writing:
            if self._write_turns is None:
                self._write_turns = trio.lowlevel.ParkingLot()
            await self._write_turns.park()
            if self.gone:
                return
        self._writing = True
        if self._owed:
            data, self._owed = self._owed + data, b""
        done = False
        try:
            done = await sockets.write_all(self.sock, data)
        finally:
            self._writing = False
            if not done:
                self.gone = True
            if self._write_turns is not None:
                self._write_turns.unpark()

    def write_now(self, data: bytes) -> str:
        """Write `data` from the calling step, without waiting: SENT (written
        whole, or dropped with the caller gone), OWED (the kernel took only a
        part: the rest goes first with the next `write`, which the caller
        must make), BUSY (nothing taken: a write is in progress or waiting,
        bytes are owed, or the kernel's buffer is full; use `write`)."""
        if self.gone:
            return SENT
        turns = self._write_turns
        if self._writing or self._owed or (turns is not None and len(turns)):
            return BUSY
        sent = sockets.send_some(self.sock, data)
        if sent is None:
            self.gone = True
            return SENT
        if sent == len(data):
            return SENT
        if sent == 0:
            return BUSY
        self._owed = data[sent:]
        return OWED

    def write_or_owe(self, data: bytes) -> str:
        """`write_now`, but bytes it cannot write now are owed rather than
        refused (BUSY never comes back): OWED, and the caller's next `write`
        (if only of b"") writes them first, after any write in progress."""
        state = self.write_now(data)
        if state is BUSY:
            self._owed += data
            return OWED
        return state

    async def next_event(self) -> Any:
        """h11's next event, reading the socket as h11 needs."""
        conn = self.h11
        while True:
            event = conn.next_event()
            if event is not h11.NEED_DATA:
                return event
            conn.receive_data(await self.read())

    # -- the connection's life --------------------------------------------------

    async def serve(self) -> None:
        """Serve the connection's requests until it closes. A failure of
        this connection's is logged, never raised: it is no one else's."""
        from .websocket import is_upgrade, serve_websocket

        conn = self.h11
        #: The next request may be read on the front's own road: h11 is
        #: between requests and holds no bytes of the next one.
        own_road = True
        try:
            while True:
                request: Any = None  # stays None when the connection sits idle too long
                parsed: tuple[Any, ...] | None = None
                # The next request's bytes already here (the common keep-alive
                # caller, at load) are read without the idle bound's cancel
                # scope: it bounds a wait, and there is none. Any wait for the
                # rest (bytes yet to come, a head in parts) is bounded.
                at_hand = await self._bytes_at_hand() if own_road else None
                if at_hand is not None:
                    parsed = self._plain_request(at_hand)
                if parsed is None:
                    with trio.move_on_after(self.limits.keep_alive_seconds):
                        try:
                            if own_road and at_hand is None:
                                parsed = await self._next_plain_request()
                            if parsed is None:
                                request = await self.next_event()
                        except h11.RemoteProtocolError as exc:
                            await self._refuse_unreadable(exc)
                            return
                if parsed is not None:
                    method, target, headers, body, body_left = parsed
                    del parsed
                    exchange = Exchange(self, method, target, body, body_left)
                    scope = self._scope(method, target, headers, "http", b"1.1")
                    del method, target, headers, body
                else:
                    if not isinstance(request, h11.Request):
                        return  # closed by the caller, or idle too long
                    if _head_size(request) > self.limits.max_header_bytes:
                        # h11 bounds only a head still incomplete; one read can hold more.
                        await self.write(
                            _plain_response(
                                conn, 431, "request_header_fields_too_large", "headers too large"
                            )
                        )
                        self.gone = True
                        return
                    if is_upgrade(request):
                        await serve_websocket(self, request)
                        return
                    exchange = Exchange(self, request.method, request.target)
                    scope = self.scope(request, "http")
                    # The scope has all of it: h11's request is not held while the
                    # app answers (an SSE stream may wait for hours), nor the scope
                    # once the app is given it (the app keeps what it needs).
                    del request
                extensions = scope["extensions"]
                extensions[SEND_NOW_EXTENSION] = exchange.send_now
                extensions[BODY_NOW_EXTENSION] = exchange.body_now
                if self.hangups is not None:
                    extensions[HANGUP_EXTENSION] = exchange.on_hangup
                del extensions
                logged = None if self.limits.access_log is None else _logged(scope)
                began = time.monotonic()
                answering: Any = None
                try:
                    answering = self.app(scope, exchange.receive, exchange.send)
                    del scope
                    await answering
                except Exception:
                    log.exception("the app failed on %s %s", exchange.method, exchange.target)
                answering = None
                await self._answered(exchange, began, logged)
                if exchange.plain:
                    # A body the app left unread and not all here yet closes the
                    # connection, as h11 would (one all here is passed over).
                    if self.gone or exchange.body_left or not exchange.ended:
                        return
                    if not exchange.plain_answer:  # h11 wrote the answer
                        if conn.our_state is not h11.DONE:
                            return  # it closes (Connection: close)
                        conn.start_next_cycle()
                    del exchange
                    continue
                del exchange
                _finish_buffered_body(conn)
                if self.gone or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    # Closing (Connection: close, HTTP/1.0), or a body left unread:
                    # the next bytes would not be a request.
                    return
                conn.start_next_cycle()
                own_road = not conn.trailing_data[0]
        except Exception:  # this connection's failure, never the server's
            log.exception("a connection failed")
        finally:
            try:
                await self._close()
            finally:
                if self.released is not None:
                    self.released()

    async def _bytes_at_hand(self) -> bytes | None:
        """The next request's bytes if they are here without a wait (kept
        from the last read, or in the socket now), taken as `read` takes
        them (its checkpoints); None when they are yet to come."""
        data = self.buffered
        if data:
            return data
        await trio.lowlevel.checkpoint_if_cancelled()
        data = self.read_now()
        if data is not None:
            await trio.lowlevel.cancel_shielded_checkpoint()
        return data

    async def _next_plain_request(self) -> tuple[Any, ...] | None:
        """The next request once its first bytes come (`_bytes_at_hand`
        found none): `_plain_request` of them."""
        return self._plain_request(await self.read_when_ready())

    def _plain_request(self, data: bytes) -> tuple[Any, ...] | None:
        """The request in `data` (the next bytes of the connection), if it
        is a plain one whose head is all there (`parse_request`); else None,
        with every byte handed to h11, which reads the request instead."""
        self.buffered = b""
        parsed = parse_request(data, self.limits.max_header_bytes >> 1) if data else None
        if parsed is None:
            self.h11.receive_data(data)  # b"": the caller's end, h11 reports it
            return None
        method, target, headers, start, length = parsed
        end = start + length
        if end < len(data):
            self.buffered = data[end:]
        return (method, target, headers, data[start:end], max(0, end - len(data)))

    async def _answered(
        self, exchange: Exchange, began: float, logged: tuple[str, bytes, bytes] | None
    ) -> None:
        """After the app: an answer it did not give is given (500) or cut;
        the access log's line (`logged`: `_logged`'s, when it is on)."""
        if not exchange.ended:
            if exchange.nothing_written():
                await exchange.answer_plain(500, "internal_error", "the server could not answer")
            else:
                self.gone = True  # a partial answer is cut, never ended as if whole
        if logged is not None:
            self._log_access(exchange, logged, time.monotonic() - began)

    def scope(self, request: h11.Request, kind: str) -> dict[str, Any]:
        return self._scope(
            request.method, request.target, list(request.headers), kind, request.http_version
        )

    def _scope(
        self,
        method: bytes,
        target: bytes,
        headers: list[tuple[bytes, bytes]],
        kind: str,
        http_version: bytes,
    ) -> dict[str, Any]:
        raw_path, _, query = target.partition(b"?")
        return {
            "type": kind,
            "asgi": _ASGI,
            "http_version": http_version.decode(),
            "method": method.decode(),
            "scheme": "ws" if kind == "websocket" else "http",
            "path": unquote(raw_path.decode("latin-1")),
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": headers,
            "client": self.client,
            "server": self.server,
            "extensions": {},
        }

    async def _refuse_unreadable(self, exc: h11.RemoteProtocolError) -> None:
        """A request h11 cannot read (malformed, or headers over the bound):
        answer its status hint and close."""
        status = exc.error_status_hint
        if self.h11.our_state not in (h11.IDLE, h11.SEND_RESPONSE):
            self.gone = True
            return
        code = "request_header_fields_too_large" if status == 431 else "bad_request"
        await self.write(_plain_response(self.h11, status, code, str(exc) or "bad request"))
        self.gone = True

    async def _close(self) -> None:
        """Say we are done, read what the caller still sends (bounded), close.
        Not shielded: a server being cancelled closes at once."""
        sock = self.sock
        try:
            if not self.gone:
                sock.shutdown(socket.SHUT_WR)
            with trio.move_on_after(LINGER_SECONDS):
                drained = 0
                while drained < LINGER_BYTES:
                    data = await sockets.read(sock)
                    if not data:
                        break
                    drained += len(data)
        except OSError:
            pass
        finally:
            sockets.close(sock)

    def _log_access(
        self, exchange: Exchange, logged: tuple[str, bytes, bytes], took: float
    ) -> None:
        version, referer, user_agent = logged
        assert self.limits.access_log is not None
        self.limits.access_log.info(
            '%s - - [%s] "%s %s %s" %s %s "%s" "%s" %.1fms',
            f"{self.client[0]}:{self.client[1]}" if self.client else "-",
            time.strftime("%d/%b/%Y:%H:%M:%S %z"),
            exchange.method,
            exchange.target,
            version,
            exchange.status,
            exchange.sent_bytes,
            referer.decode("latin-1"),
            user_agent.decode("latin-1"),
            took * 1000,
        )


def _logged(scope: dict[str, Any]) -> tuple[str, bytes, bytes]:
    """What the access log's line needs of a request besides its `Exchange`."""
    headers = dict(scope["headers"])
    return scope["http_version"], headers.get(b"referer", b"-"), headers.get(b"user-agent", b"-")


class Exchange:
    """One request and its answer: the app's ASGI `receive` and `send`.

    A plain request (read by `parse_request`, not h11) is `plain`: its body
    is counted here (`body_left`: bytes still in the socket), and its answer
    too is written here (`plain_answer`) while it is a plain one
    (`_plain_head`): a status and headers h11 would write as they are, with
    a Content-Length body in one message or a chunked one. Any other answer
    (and the front's own 500) goes through h11, brought first to where it
    would be after such a request (`_to_h11`)."""

    __slots__ = (
        "conn",
        "status",
        "started",
        "ended",
        "sent_bytes",
        "plain",
        "plain_answer",
        "body_left",
        "_body",
        "_body_done",
        "_chunked",
        "_head",
        "_head_only",
        "_on_gone",
        "target",
        "method",
    )

    def __init__(
        self,
        conn: Connection,
        method: bytes,
        target: bytes,
        body: bytes | None = None,
        body_left: int = 0,
    ) -> None:
        self.conn = conn
        self.target = target.decode("latin-1")
        self.method = method.decode()
        self._head_only = method == b"HEAD"
        self._head: list[tuple[bytes, bytes]] | None = None
        self.status = 0
        self.started = self.ended = self._body_done = False
        self._chunked = False  # the answer's body goes out in chunks (h11's choice)
        self.sent_bytes = 0
        #: The app's hang-up callback while the server watches for it.
        self._on_gone: Callable[[], None] | None = None
        #: Read by `parse_request` (None: by h11); what of its body is here.
        self.plain = self.plain_answer = body is not None
        self._body = body
        self.body_left = body_left

    async def receive(self) -> dict[str, Any]:
        conn = self.conn
        if self._body_done or self.ended or conn.gone:
            return await self._until_disconnect()
        if self.plain:
            return await self._receive_plain()
        machine = conn.h11
        if machine.they_are_waiting_for_100_continue:
            await conn.write(machine.send(h11.InformationalResponse(status_code=100, headers=[])))
        chunks: list[bytes] = []
        try:
            while True:
                event = machine.next_event()
                if event is h11.NEED_DATA:
                    if chunks:  # hand over what this read held
                        return {"type": "http.request", "body": b"".join(chunks), "more_body": True}
                    machine.receive_data(await conn.read())
                elif type(event) is h11.Data:
                    chunks.append(bytes(event.data))
                elif type(event) is h11.EndOfMessage:
                    self._body_done = True
                    return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
                else:  # ConnectionClosed
                    break
        except h11.RemoteProtocolError:
            pass  # the caller ended mid-body, or sent a malformed chunk
        conn.gone = True
        return DISCONNECT

    async def _receive_plain(self) -> dict[str, Any]:
        """A plain request's body: what came with its head, then what each
        read brings, up to its Content-Length (bytes past it are the next
        request's)."""
        body, self._body = self._body, None
        left = self.body_left
        if body is None:
            conn = self.conn
            data = await conn.read()
            if not data:
                conn.gone = True  # the caller ended mid-body
                return DISCONNECT
            if len(data) > left:
                data, conn.buffered = data[:left], data[left:]
            body = data
            left = self.body_left = left - len(data)
        elif not body and left:  # nothing of it came with the head
            return await self._receive_plain()
        if not left:
            self._body_done = True
            return {"type": "http.request", "body": body, "more_body": False}
        return {"type": "http.request", "body": body, "more_body": True}

    def body_now(self, limit: int) -> bytes | None:
        """The `BODY_NOW_EXTENSION`: a plain request's whole body, when all
        of it came with the head (or was read since) and it is at most
        `limit` bytes, taken as `receive` takes it (the body read, the next
        `receive` waits for the caller to go). None otherwise -- a body
        still to come, h11's road, too long, already taken, or the caller
        gone: `receive` reads it then, as it would have. A read that needs
        no wait needs no deadline: the app's body timeout is for the rest."""
        body = self._body
        if (
            body is None
            or self.body_left
            or len(body) > limit
            or self._body_done
            or self.ended
            or self.conn.gone
        ):
            return None
        self._body = None
        self._body_done = True
        return body

    def on_hangup(self, callback: Callable[[], None] | None) -> None:
        """The ASGI hang-up extension (`HANGUP_EXTENSION`): `callback` is
        called once, by the server's `Hangups` task, when the caller goes;
        None stops that. A caller already known gone is told at once."""
        conn = self.conn
        assert conn.hangups is not None
        if callback is None:
            self._on_gone = None
            conn.hangups.unwatch(conn.sock)
        elif conn.gone:
            callback()
        else:
            self._on_gone = callback
            conn.hangups.watch(conn.sock, self._hung_up)

    def _hung_up(self) -> None:
        """The caller went: the connection is marked gone first, as `receive`
        marks it on the caller's end, so nothing more is written to it (an
        app that stops without answering gets no 500 written for it)."""
        self.conn.gone = True
        callback, self._on_gone = self._on_gone, None
        if callback is not None:
            callback()

    async def _until_disconnect(self) -> dict[str, Any]:
        """After the body: wait until the caller goes. Bytes it sends meanwhile
        (a pipelined request) are kept for the next cycle, up to the header
        bound; past it, nothing more is read until this request is over."""
        conn = self.conn
        if conn.gone or self.ended:
            return DISCONNECT
        while True:
            held = len(conn.buffered) if self.plain else len(conn.h11.trailing_data[0])
            if held > conn.limits.max_header_bytes:
                await trio.sleep_forever()  # the app cancels its watcher as it answers
            data = await conn.read()
            if not data:
                conn.gone = True
                return DISCONNECT
            if self.plain:
                conn.buffered += data
            else:
                conn.h11.receive_data(data)

    def _to_h11(self) -> None:
        """Bring h11 to where it would be had it read this plain request:
        waiting for the answer to a keep-alive HTTP/1.1 request of this
        method, its body read (the body itself stays counted here)."""
        if self.plain_answer:
            self.plain_answer = False
            machine = self.conn.h11
            machine.receive_data(b"%s / HTTP/1.1\r\nhost: _\r\n\r\n" % self.method.encode())
            request, end = machine.next_event(), machine.next_event()
            assert type(request) is h11.Request and type(end) is h11.EndOfMessage

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            await self.conn.write(self._body_bytes(message))
        elif kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.status = message["status"]
            self._head = list(message.get("headers", ()))
            self.started = True
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r} on an HTTP request")

    def send_now(self, message: dict[str, Any]) -> str:
        """The `SEND_NOW_EXTENSION`: an ``http.response.body`` message with
        more to come (an SSE chunk), written from the calling step without
        awaiting: SENT (written, or dropped with the caller gone) or OWED
        (not all taken: the app's next `send`, if only an empty body, must
        follow and writes the rest first)."""
        if message["type"] != "http.response.body" or not message.get("more_body", False):
            raise RuntimeError("send_now takes an http.response.body with more_body")
        return self.conn.write_or_owe(self._body_bytes(message))

    def _body_bytes(self, message: dict[str, Any]) -> bytes:
        """What an ``http.response.body`` message puts on the wire (the status
        line and headers with the first)."""
        if not self.started or self.ended:
            raise RuntimeError(
                f"http.response.body {'before the start' if not self.started else 'after the end'}"
            )
        body = message.get("body", b"")
        more = message.get("more_body", False)
        if self.plain_answer:
            if self._head is not None:
                data = _plain_head(self.status, self._head, body, more)
                if data is None:  # not a plain answer: h11 writes it
                    self._to_h11()
                    return self._body_bytes(message)
                self._head = None
                self._chunked = data.endswith(_CHUNKED_HEAD_END)
                if self._chunked:
                    if body:
                        data += b"%x\r\n%b\r\n" % (len(body), body)
                    if not more:
                        data += b"0\r\n\r\n"
                else:
                    data += body
            elif body:  # chunked: a Content-Length answer is whole in one message
                data = b"%x\r\n%b\r\n" % (len(body), body)
                if not more:
                    data += b"0\r\n\r\n"
            elif not more:
                data = b"0\r\n\r\n"
            else:
                data = b""
            if not more:
                self.ended = True
            self.sent_bytes += len(data)
            return data
        machine = self.conn.h11
        parts = []
        if self._head is not None:
            head, self._head = self._head, None
            head.append((b"date", _date()))
            parts.append(machine.send(h11.Response(status_code=self.status, headers=head)))
            self._chunked = type(getattr(machine, "_writer", None)) is _ChunkedWriter
        if body and not self._head_only:
            if self._chunked:
                # A chunk is stateless for h11 (its SEND_BODY state stays): the
                # same bytes as h11's ChunkedWriter without its event and
                # state-machine round, which cost more than the rest of an
                # SSE burst's write. A Content-Length body goes through h11,
                # which counts it.
                parts.append(b"%x\r\n%b\r\n" % (len(body), body))
            else:
                parts.append(machine.send(h11.Data(data=body)))
        if not more:
            parts.append(machine.send(h11.EndOfMessage()))
            self.ended = True
        data = b"".join(parts)  # type: ignore[arg-type]
        self.sent_bytes += len(data)
        return data

    def nothing_written(self) -> bool:
        """No byte of an answer is written yet (a 500 may still be given)."""
        if self.plain_answer:
            return self._head is not None or not self.started
        return self.conn.h11.our_state is h11.SEND_RESPONSE

    async def answer_plain(self, status: int, code: str, message: str) -> None:
        """A JSON error answer from the front itself (the app did not answer)."""
        if not self.nothing_written():
            self.conn.gone = True
            return
        self._to_h11()
        if self.conn.h11.our_state is not h11.SEND_RESPONSE:
            self.conn.gone = True
            return
        self.status, self.started, self.ended = status, True, True
        await self.conn.write(_plain_response(self.conn.h11, status, code, message))


#: The token and field-value rules of RFC 9110 as h11 has them (`h11._abnf`).
_TOKEN = rb"[-!#$%&'*+.^_`|~0-9a-zA-Z]+"
_FIELD_CONTENT = rb"[^\x00\s]+(?:[ \t]+[^\x00\s]+)*"
#: A request head h11 reads as it is: an HTTP/1.1 request line, then header
#: lines with nothing h11 would fold or refuse (to the blank line, excluded).
_REQUEST_HEAD = re.compile(
    rb"(%s) ([\x21-\x7e]+) HTTP/1\.1(?:\r\n%s:[ \t]*(?:%s[ \t]*)?)*"
    % (_TOKEN, _TOKEN, _FIELD_CONTENT)
)
#: Header lines as h11 writes an answer's, each a valid name and value.
_RESPONSE_LINES = re.compile(rb"(?:%s: (?:%s)?\r\n)*\r\n" % (_TOKEN, _FIELD_CONTENT))
#: Request headers a plain request has no more than one of, or none.
_PLAIN_ONCE = frozenset((b"host", b"content-length"))
#: Request headers that leave the request to h11 (framing, upgrades, 100-continue).
_NOT_PLAIN = frozenset((b"transfer-encoding", b"upgrade", b"expect"))
#: Answer headers that h11 sets or acts on: such an answer is h11's.
_ANSWER_FRAMING = frozenset((b"content-length", b"transfer-encoding", b"connection", b"host"))
_CHUNKED_HEAD_END = b"Transfer-Encoding: chunked\r\n\r\n"


def parse_request(
    data: bytes, max_head: int
) -> tuple[bytes, bytes, list[tuple[bytes, bytes]], int, int] | None:
    """The request at the start of `data` if it is a plain one, read as h11
    reads it: (method, target, headers as h11 gives them, where its body
    starts in `data`, its Content-Length). A plain request is a keep-alive
    HTTP/1.1 request (not HEAD nor CONNECT) whose head is whole in `data`
    and at most `max_head` bytes, with one Host, at most one Content-Length
    (digits), and no Transfer-Encoding, Upgrade, Expect, Connection: close
    or line h11 would fold or refuse. Anything else is None: h11 reads it
    (tests/test_front_plain.py holds both roads equal)."""
    end = data.find(b"\r\n\r\n", 0, max_head + 4)
    if end < 0:
        return None
    head = data[:end]
    if _REQUEST_HEAD.fullmatch(head) is None:
        return None
    lines = head.split(b"\r\n")
    method, target, _ = lines[0].split(b" ")
    if method == b"HEAD" or method == b"CONNECT":
        return None
    headers = []
    seen: set[bytes] = set()
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.lower()
        value = value.strip(b" \t")
        if name in _PLAIN_ONCE:
            if name in seen:
                return None
            seen.add(name)
            if name == b"content-length":
                if len(value) > 20 or not value.isdigit():
                    return None
                length = int(value)
        elif name in _NOT_PLAIN or (name == b"connection" and b"close" in value.lower()):
            return None
        headers.append((name, value))
    if b"host" not in seen:
        return None
    return method, target, headers, end + 4, length


def _plain_head(
    status: Any, headers: list[tuple[bytes, bytes]], body: bytes, more: bool
) -> bytes | None:
    """The status line and headers h11 would write for this answer to a
    plain request (Date appended, and Transfer-Encoding: chunked when no
    Content-Length is given), or None if h11 must write it: a status h11
    treats apart, a header it sets or acts on (except one Content-Length
    that the whole body, in this one message, matches), a name or value
    it would refuse."""
    if type(status) is not int or not 200 <= status < 600 or status == 204 or status == 304:
        return None
    lines = [b"HTTP/1.1 %d \r\n" % status]
    length = -1
    for name, value in headers:
        if type(name) is not bytes or type(value) is not bytes:
            return None
        if name.lower() in _ANSWER_FRAMING:
            if name.lower() != b"content-length" or length >= 0 or more:
                return None
            if len(value) > 20 or not value.isdigit() or int(value) != len(body):
                return None
            length = len(body)
        lines.append(b"%s: %s\r\n" % (name, value))
    lines.append(b"date: %s\r\n" % _date())
    lines.append(_CHUNKED_HEAD_END if length < 0 else b"\r\n")
    data = b"".join(lines)
    if _RESPONSE_LINES.fullmatch(data, len(lines[0])) is None:
        return None
    return data


def _head_size(request: h11.Request) -> int:
    return len(request.target) + sum(len(name) + len(value) + 4 for name, value in request.headers)


def _finish_buffered_body(machine: h11.Connection) -> None:
    """Read the rest of a request the app did not read (a GET's end, a body
    it did not need) as far as it is already buffered, so the connection can
    be kept; nothing more is read from the socket for it."""
    try:
        while machine.their_state is h11.SEND_BODY:
            event = machine.next_event()
            if event is h11.NEED_DATA or event is h11.PAUSED:
                return
    except h11.RemoteProtocolError:
        return


def _plain_response(machine: h11.Connection, status: int, code: str, message: str) -> bytes:
    import json

    body = json.dumps({"error": {"status": status, "code": code, "message": message}}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
        (b"date", _date()),
    ]
    head = machine.send(h11.Response(status_code=status, headers=headers))
    return b"".join(
        (
            head or b"",
            machine.send(h11.Data(data=body)) or b"",
            machine.send(h11.EndOfMessage()) or b"",
        )
    )


_date_cache: tuple[int, bytes] = (0, b"")


def _date() -> bytes:
    """The Date header's value, formatted once a second."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, formatdate(now, usegmt=True).encode())
    return _date_cache[1]


def _address(address: Any) -> tuple[str, int] | None:
    if isinstance(address, tuple) and len(address) >= 2:
        return (str(address[0]), int(address[1]))
    return None
