"""A websocket on the connection's own task: the upgrade, then wsproto.

`serve_websocket` checks the handshake (RFC 6455 §4.2.1; a request that is not
a valid one is answered 400), gives the app an ASGI ``websocket`` scope, and
answers its ``websocket.accept`` with the 101 and the accept token. From then
on `receive` parses whatever one socket read holds and hands the app each
whole message in turn without reading again: the common frame (one whole
masked text or binary message) is read by `ws_frames.ClientFrames`, every
other frame by wsproto, which stays the authority on the protocol; a message
is written as one frame built here (wsproto's bytes, without its events and
copies). Pings are answered as they are parsed; a close frame is answered
and reported as ``websocket.disconnect`` with the peer's code (1006 when
the connection simply ended). A message over ``max_message_bytes`` is
refused with close 1009. Closing before accepting is a 403 (the ASGI rule),
or the app's own answer through the ``websocket.http.response`` extension.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any

import h11
from wsproto.connection import Connection as WsConnection
from wsproto.connection import ConnectionState, ConnectionType
from wsproto.events import CloseConnection, Message, Ping, TextMessage
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import generate_accept_token

from .http import SENT, Connection, _date, _plain_response
from .ws_frames import ClientFrames, ForWsproto, server_frame

log = logging.getLogger("funduq_trio.server")

#: The ASGI extension by which the app writes a message from the step that
#: made it, without awaiting (`web/provider_socket.py`, as asyncio's
#: transports write first): its value is `WebSocket.send_now`. When it
#: answers "owed", the app's next `send` must follow, if only a
#: ``{"type": FLUSH}``, which writes the owed rest.
SEND_NOW_EXTENSION = "funduq.websocket.send_now"
FLUSH = "funduq.websocket.flush"
#: The ASGI extension by which an app that only reads messages (the provider
#: link) takes the next one as its text (or bytes) itself, without
#: ``receive``'s dict: its value is `WebSocket.receive_message`, which
#: answers None where ``receive`` has something else to say (the app then
#: calls ``receive``, which says it).
RECEIVE_MESSAGE_EXTENSION = "funduq.websocket.receive_message"


def is_upgrade(request: h11.Request) -> bool:
    """A websocket upgrade request (the rest of the handshake is checked by
    `serve_websocket`)."""
    for name, value in request.headers:
        if name == b"upgrade":
            return value.lower() == b"websocket"
    return False


def _handshake_problem(request: h11.Request, headers: dict[bytes, bytes]) -> str | None:
    if request.method != b"GET":
        return "a websocket handshake is a GET"
    if b"upgrade" not in [t.strip() for t in headers.get(b"connection", b"").lower().split(b",")]:
        return "a websocket handshake needs Connection: upgrade"
    if headers.get(b"sec-websocket-version") != b"13":
        return "only websocket version 13 is spoken"
    if not headers.get(b"sec-websocket-key"):
        return "a websocket handshake needs Sec-WebSocket-Key"
    return None


async def serve_websocket(conn: Connection, request: h11.Request) -> None:
    """Serve the upgrade request `request` on `conn`, to the end of the socket."""
    try:
        end = await conn.next_event()
    except h11.RemoteProtocolError:
        return
    headers = dict(request.headers)
    problem = _handshake_problem(request, headers) if type(end) is h11.EndOfMessage else "a body"
    if problem is not None:
        if conn.h11.our_state is h11.SEND_RESPONSE:
            await conn.write(_plain_response(conn.h11, 400, "bad_request", problem))
        conn.gone = True
        return
    scope = conn.scope(request, "websocket")
    protocols = headers.get(b"sec-websocket-protocol", b"")
    scope["subprotocols"] = [p.strip() for p in protocols.decode("latin-1").split(",") if p.strip()]
    socket = WebSocket(conn, headers[b"sec-websocket-key"])
    scope["extensions"] = {
        "websocket.http.response": {},
        SEND_NOW_EXTENSION: socket.send_now,
        RECEIVE_MESSAGE_EXTENSION: socket.receive_message,
    }
    try:
        await conn.app(scope, socket.receive, socket.send)
    except Exception:
        log.exception("the app failed on websocket %s", scope["path"])
    await socket.finish()


class WebSocket:
    """The ASGI ``websocket`` calls over one connection."""

    __slots__ = (
        "conn",
        "key",
        "ws",
        "state",
        "close_code",
        "_frames",
        "_ready",
        "_parts",
        "_size",
        "_denial",
    )

    def __init__(self, conn: Connection, key: bytes) -> None:
        self.conn = conn
        self.key = key
        self.ws: WsConnection | None = None
        #: "new" (connect not yet said), "connecting" (the app has not answered
        #: the handshake), "answered" (refused with an HTTP answer), "open",
        #: "closing" (our close sent, the peer's awaited), "closed".
        self.state = "new"
        self.close_code = 1006
        self._frames = ClientFrames(conn.limits.max_message_bytes)
        #: Messages parsed and not yet handed over (their text or bytes).
        self._ready: deque[str | bytes] = deque()
        self._parts: list[Any] = []  # the message being assembled
        self._size = 0
        self._denial: list[Any] = []  # status, headers, body parts

    async def receive(self) -> dict[str, Any]:
        if self.state == "new":
            self.state = "connecting"
            return {"type": "websocket.connect"}
        while True:
            if self._ready or self.state == "open" or self.state == "closing":
                message = await self.receive_message()
                if type(message) is str:
                    return {"type": "websocket.receive", "text": message}
                if message is not None:
                    return {"type": "websocket.receive", "bytes": message}
            elif self.state == "connecting" or self.state == "answered":
                # Before the handshake's answer only the caller's end can
                # come; bytes it sends early wait in h11 for the socket.
                data = await self.conn.read()
                if data:
                    self.conn.h11.receive_data(data)
                else:
                    self.state = "closed"
            else:
                return {"type": "websocket.disconnect", "code": self.close_code}

    async def receive_message(self) -> str | bytes | None:
        """The next message, as the text or bytes `receive` would hand over
        in a ``websocket.receive``; None when `receive` has anything else to
        say next (a disconnect), or before the handshake's answer."""
        ready = self._ready
        while True:
            if ready:
                return ready.popleft()
            if self.state != "open" and self.state != "closing":
                return None
            data = await self.conn.read()
            if data:
                items = self._frames.feed(data)
                del data
                if len(items) == 1 and type(items[0]) is str:
                    # One whole text message in the read (a provider's
                    # message when the server keeps up): handed over as it is.
                    return items[0]
                await self._take_items(items)
            else:
                assert self.ws is not None
                self.ws.receive_data(None)  # the end, reported as 1006
                await self._take_events()

    async def _take(self, data: bytes) -> None:
        """Parse `data`: the common frames here, the rest by wsproto, in order."""
        await self._take_items(self._frames.feed(data))

    async def _take_items(self, items: list[str | bytes | ForWsproto]) -> None:
        """The messages of `ClientFrames.feed`'s `items` made ready, in order;
        bytes for wsproto parsed by it."""
        ready = self._ready
        for item in items:
            kind = type(item)
            if kind is str or kind is bytes:
                ready.append(item)  # type: ignore[arg-type]  # (not a ForWsproto)
            else:
                assert self.ws is not None and isinstance(item, ForWsproto)
                self.ws.receive_data(item.data)
                await self._take_events()
                if self.state == "closed":
                    return

    async def _take_events(self) -> None:
        ws = self.ws
        assert ws is not None
        limit = self.conn.limits.max_message_bytes
        for event in ws.events():
            if isinstance(event, Message):
                self._size += len(event.data)
                if self._size > limit:
                    await self._close_now(CloseReason.MESSAGE_TOO_BIG, "message too big")
                    self.state = "closed"
                    return
                self._parts.append(event.data)
                if event.message_finished:
                    parts, self._parts, self._size = self._parts, [], 0
                    if type(event) is TextMessage:
                        self._ready.append("".join(parts))
                    else:
                        self._ready.append(b"".join(parts))
            elif isinstance(event, Ping):
                # After our close only the peer's close is awaited: a ping
                # then goes unanswered (wsproto refuses to send a pong).
                if ws.state is ConnectionState.OPEN:
                    await self.conn.write(ws.send(event.response()))
            elif isinstance(event, CloseConnection):
                if ws.state is ConnectionState.REMOTE_CLOSING:
                    await self.conn.write(ws.send(event.response()))
                elif ws.state is ConnectionState.OPEN:  # a frame wsproto could not parse
                    await self._close_now(event.code, event.reason or "")
                self.state, self.close_code = "closed", event.code
                return

    async def _close_now(self, code: int, reason: str) -> None:
        assert self.ws is not None
        if self.ws.state is ConnectionState.OPEN:
            await self.conn.write(self.ws.send(CloseConnection(code=code, reason=reason)))
        self.close_code = code
        self._parts, self._size = [], 0

    async def send(self, message: dict[str, Any]) -> None:
        kind = message["type"]
        if kind == "websocket.send":
            if self.state != "open" or self.ws is None:
                return  # the peer is gone or going; the app learns it from receive
            text = message.get("text")
            if text is not None:
                await self.conn.write(server_frame(0x1, text.encode()))
            else:
                await self.conn.write(server_frame(0x2, message.get("bytes") or b""))
        elif kind == FLUSH:
            await self.conn.write(b"")
        elif kind == "websocket.accept":
            await self._accept(message)
        elif kind == "websocket.close":
            if self.state in ("new", "connecting"):
                await self._answer_http(403, [], b"")
            elif self.state == "open":
                await self._close_now(message.get("code") or 1000, message.get("reason") or "")
                self.state = "closing"
        elif kind == "websocket.http.response.start" and self.state in ("new", "connecting"):
            self.state = "answered"
            self._denial = [message["status"], list(message.get("headers", ()))]
        elif kind == "websocket.http.response.body" and self.state == "answered":
            self._denial.append(message.get("body", b""))
            if not message.get("more_body", False):
                status, headers, *body = self._denial
                await self._answer_http(status, headers, b"".join(body))
        else:
            raise RuntimeError(f"unexpected ASGI message {kind!r} in websocket state {self.state}")

    def send_now(self, message: dict[str, Any]) -> str:
        """A ``websocket.send`` written at once, never awaiting: "sent",
        "owed" (its rest goes first with the next `send`) or "busy" (nothing
        taken: `send` it). See `Connection.write_now`."""
        if message["type"] != "websocket.send":
            raise RuntimeError(f"send_now takes websocket.send, not {message['type']!r}")
        if self.state != "open" or self.ws is None:
            return SENT  # the peer is gone or going, as in `send`
        text = message.get("text")
        if text is not None:
            return self.conn.write_now(server_frame(0x1, text.encode()))
        return self.conn.write_now(server_frame(0x2, message.get("bytes") or b""))

    async def _accept(self, message: dict[str, Any]) -> None:
        if self.state not in ("new", "connecting"):
            raise RuntimeError("websocket.accept after the handshake was answered")
        machine = self.conn.h11
        headers = [
            (b"upgrade", b"websocket"),
            (b"connection", b"Upgrade"),
            (b"sec-websocket-accept", generate_accept_token(self.key)),
        ]
        if message.get("subprotocol"):
            headers.append((b"sec-websocket-protocol", message["subprotocol"].encode()))
        headers.extend(message.get("headers", ()))
        response = h11.InformationalResponse(status_code=101, headers=headers)
        await self.conn.write(machine.send(response) or b"")
        self.ws = WsConnection(ConnectionType.SERVER)
        self.state = "open"
        if machine.trailing_data[0]:
            await self._take(machine.trailing_data[0])  # frames that came with the handshake

    async def _answer_http(self, status: int, headers: list[Any], body: bytes) -> None:
        machine = self.conn.h11
        headers = [
            *headers,
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
            (b"date", _date()),
        ]
        parts = (
            machine.send(h11.Response(status_code=status, headers=headers)),
            machine.send(h11.Data(data=body)) if body else b"",
            machine.send(h11.EndOfMessage()),
        )
        await self.conn.write(b"".join(p or b"" for p in parts))
        self.state = "closed"

    async def finish(self) -> None:
        """After the app: a handshake it never answered is a 500; a socket it
        left open is closed (1000)."""
        if self.state in ("new", "connecting"):
            await self._answer_http(500, [], b"")
        elif self.state == "open":
            await self._close_now(1000, "")


__all__ = ["FLUSH", "SEND_NOW_EXTENSION", "WebSocket", "is_upgrade", "serve_websocket"]
