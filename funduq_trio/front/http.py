"""One HTTP/1.1 connection: h11 parses, the app answers on this task.

`Connection.serve` reads a request, builds its ASGI scope, awaits the app with
an `Exchange`'s `receive` and `send`, and goes on to the next request while
h11 says the connection may be kept. A websocket upgrade is handed to
`front/websocket.py` with what h11 read past the request.
"""

from __future__ import annotations

import logging
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
#: What `Connection.write_now` did with the bytes it was given.
SENT, OWED, BUSY = "sent", "owed", "busy"
_ASGI = {"version": "3.0", "spec_version": "2.3"}


class Connection:
    """One accepted TCP connection and the h11 state machine reading it."""

    __slots__ = (
        "app",
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

    # -- socket -----------------------------------------------------------------

    async def read(self) -> bytes:
        """The next bytes from the caller, b"" at its end (or a reset)."""
        return await sockets.read(self.sock)

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
        try:
            while True:
                request: Any = None  # stays None when the connection sits idle too long
                with trio.move_on_after(self.limits.keep_alive_seconds):
                    try:
                        request = await self.next_event()
                    except h11.RemoteProtocolError as exc:
                        await self._refuse_unreadable(exc)
                        return
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
                exchange = Exchange(self, request)
                scope = self.scope(request, "http")
                # The scope has all of it: h11's request is not held while the
                # app answers (an SSE stream may wait for hours), nor the scope
                # once the app is given it (the app keeps what it needs).
                del request
                if self.hangups is not None:
                    scope["extensions"][HANGUP_EXTENSION] = exchange.on_hangup
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
                del exchange
                _finish_buffered_body(conn)
                if self.gone or conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                    # Closing (Connection: close, HTTP/1.0), or a body left unread:
                    # the next bytes would not be a request.
                    return
                conn.start_next_cycle()
        except Exception:  # this connection's failure, never the server's
            log.exception("a connection failed")
        finally:
            try:
                await self._close()
            finally:
                if self.released is not None:
                    self.released()

    async def _answered(
        self, exchange: Exchange, began: float, logged: tuple[str, bytes, bytes] | None
    ) -> None:
        """After the app: an answer it did not give is given (500) or cut;
        the access log's line (`logged`: `_logged`'s, when it is on)."""
        if not exchange.ended:
            if self.h11.our_state is h11.SEND_RESPONSE:  # nothing of an answer written yet
                await exchange.answer_plain(500, "internal_error", "the server could not answer")
            else:
                self.gone = True  # a partial answer is cut, never ended as if whole
        if logged is not None:
            self._log_access(exchange, logged, time.monotonic() - began)

    def scope(self, request: h11.Request, kind: str) -> dict[str, Any]:
        raw_path, _, query = request.target.partition(b"?")
        return {
            "type": kind,
            "asgi": _ASGI,
            "http_version": request.http_version.decode(),
            "method": request.method.decode(),
            "scheme": "ws" if kind == "websocket" else "http",
            "path": unquote(raw_path.decode("latin-1")),
            "raw_path": raw_path,
            "query_string": query,
            "root_path": "",
            "headers": list(request.headers),
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
    """One request and its answer: the app's ASGI `receive` and `send`."""

    __slots__ = (
        "conn",
        "status",
        "started",
        "ended",
        "sent_bytes",
        "_body_done",
        "_chunked",
        "_head",
        "_head_only",
        "_on_gone",
        "target",
        "method",
    )

    def __init__(self, conn: Connection, request: h11.Request) -> None:
        self.conn = conn
        self.target = request.target.decode("latin-1")
        self.method = request.method.decode()
        self._head_only = request.method == b"HEAD"
        self._head: list[tuple[bytes, bytes]] | None = None
        self.status = 0
        self.started = self.ended = self._body_done = False
        self._chunked = False  # the answer's body goes out in chunks (h11's choice)
        self.sent_bytes = 0
        #: The app's hang-up callback while the server watches for it.
        self._on_gone: Callable[[], None] | None = None

    async def receive(self) -> dict[str, Any]:
        conn = self.conn
        if self._body_done or self.ended or conn.gone:
            return await self._until_disconnect()
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
            if len(conn.h11.trailing_data[0]) > conn.limits.max_header_bytes:
                await trio.sleep_forever()  # the app cancels its watcher as it answers
            data = await conn.read()
            if not data:
                conn.gone = True
                return DISCONNECT
            conn.h11.receive_data(data)

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "http.response.body":
            if not self.started or self.ended:
                raise RuntimeError(
                    f"{kind} {'before the start' if not self.started else 'after the end'}"
                )
            conn = self.conn
            machine = conn.h11
            parts = []
            if self._head is not None:
                head, self._head = self._head, None
                head.append((b"date", _date()))
                parts.append(machine.send(h11.Response(status_code=self.status, headers=head)))
                self._chunked = type(getattr(machine, "_writer", None)) is _ChunkedWriter
            body = message.get("body", b"")
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
            if not message.get("more_body", False):
                parts.append(machine.send(h11.EndOfMessage()))
                self.ended = True
            data = b"".join(parts)  # type: ignore[arg-type]
            self.sent_bytes += len(data)
            await conn.write(data)
        elif kind == "http.response.start":
            if self.started:
                raise RuntimeError("http.response.start sent twice")
            self.status = message["status"]
            self._head = list(message.get("headers", ()))
            self.started = True
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r} on an HTTP request")

    async def answer_plain(self, status: int, code: str, message: str) -> None:
        """A JSON error answer from the front itself (the app did not answer)."""
        if self.conn.h11.our_state is not h11.SEND_RESPONSE:
            self.conn.gone = True
            return
        self.status, self.started, self.ended = status, True, True
        await self.conn.write(_plain_response(self.conn.h11, status, code, message))


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
