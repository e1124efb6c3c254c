"""How the provider runtime reaches funduq: a small connection interface and
its WebSocket implementation (trio-websocket). Tests plug in an in-memory
connection instead."""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import Protocol

import trio
import trio_websocket

__all__ = ["Connection", "Connector", "LinkLost", "websocket_connector"]

log = logging.getLogger("funduq_trio.provider")


class LinkLost(Exception):
    """The link to funduq is gone (or could not be opened)."""


class Connection(Protocol):
    async def send(self, text: str) -> None:
        """Send one text message; raise LinkLost when the link is gone."""

    async def receive(self) -> str | bytes:
        """The next message; raise LinkLost when the link is gone."""

    async def aclose(self, reason: str = "") -> None:
        """Close the link (idempotent, never raises)."""


#: `await connector(nursery, url)` opens a connection whose background tasks
#: (if any) live in `nursery`; raises LinkLost when it cannot.
Connector = Callable[[trio.Nursery, str], Awaitable[Connection]]


class _WebSocketConnection:
    def __init__(self, ws: trio_websocket.WebSocketConnection) -> None:
        self._ws = ws

    async def send(self, text: str) -> None:
        try:
            await self._ws.send_message(text)
        except (trio_websocket.ConnectionClosed, trio.BrokenResourceError, OSError) as exc:
            raise LinkLost(_closed_reason(exc)) from None

    async def receive(self) -> str | bytes:
        try:
            return await self._ws.get_message()
        except (trio_websocket.ConnectionClosed, trio.BrokenResourceError, OSError) as exc:
            raise LinkLost(_closed_reason(exc)) from None

    async def aclose(self, reason: str = "") -> None:
        # Being cancelled (the runtime is stopping), the connection's reader
        # task is cancelled too and funduq's close reply would never be read:
        # send the close frame but do not wait long for the reply.
        stopping = trio.current_effective_deadline() == -math.inf
        with trio.move_on_after(0.05 if stopping else 2) as scope:
            scope.shield = True
            try:
                await self._ws.aclose(1000, reason[:120] or None)
            except Exception as exc:  # noqa: BLE001 - closing a broken link must not raise
                log.debug("closing the link failed: %r", exc)


def _closed_reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", None)
    if reason is not None:
        code = getattr(reason, "code", None)
        text = getattr(reason, "reason", None)
        return f"link closed by funduq ({code}{': ' + text if text else ''})"
    return f"link broken: {exc!r}"


def websocket_connector(
    *, max_message_size: int = 16 * 1024 * 1024, connect_timeout: float = 30.0
) -> Connector:
    """A connector over trio-websocket (`ws://` or `wss://`)."""

    async def connect(nursery: trio.Nursery, url: str) -> Connection:
        try:
            with trio.fail_after(connect_timeout):
                ws = await trio_websocket.connect_websocket_url(
                    nursery, url, max_message_size=max_message_size, message_queue_size=64
                )
        except (
            OSError,
            trio.TooSlowError,
            trio_websocket.HandshakeError,
            trio_websocket.ConnectionClosed,
        ) as exc:
            raise LinkLost(f"cannot connect to {url}: {exc!r}") from None
        return _WebSocketConnection(ws)

    return connect
