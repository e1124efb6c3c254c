"""Serve an ASGI app on a listening socket: the lifespan, then a task per
connection (`front/http.py`), until cancelled."""

from __future__ import annotations

import json
import logging
import socket
from typing import Any, Protocol

import trio

from .http import Connection
from .limits import FrontLimits
from .sockets import Hangups, accept_forever, refuse_at_once

log = logging.getLogger("funduq_trio.server")

#: Connections the kernel may hold before funduq accepts them.
BACKLOG = 1024


class ConnectionCounts(Protocol):
    """Where the front counts its connections (funduq's metrics)."""

    connections_open: int
    connections_refused: int


class _Counts:
    connections_open = 0
    connections_refused = 0


_LIFESPAN = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}}


async def serve_asgi(
    app: Any,
    listening: socket.socket,
    limits: FrontLimits,
    *,
    counts: ConnectionCounts | None = None,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run `app`'s lifespan startup, then serve every connection `listening`
    (a bound socket) accepts, at most `limits.max_connections` at once;
    report started once connections are taken. Runs until cancelled."""
    listening.listen(BACKLOG)
    counted: ConnectionCounts = counts if counts is not None else _Counts()
    refusal = too_many_connections(limits.max_connections)

    hangups = Hangups() if Hangups.available else None

    def release() -> None:
        counted.connections_open -= 1

    def take(sock: socket.socket, client: tuple[str, int] | None) -> None:
        # Refused without a task: a flood of connections past the bound costs
        # a send and a close each, and what is already served goes on.
        if counted.connections_open >= limits.max_connections:
            counted.connections_refused += 1
            refuse_at_once(sock, refusal)
            return
        connection = Connection(sock, client, app, limits, hangups, release)
        counted.connections_open += 1
        # The connection's own coroutine, not one awaiting it: a frame less
        # for every connection held open (it logs its own failure, and calls
        # `release` when it has closed).
        nursery.start_soon(connection.serve)

    async with trio.open_nursery() as nursery:
        if hangups is not None:
            nursery.start_soon(hangups.run)
        await nursery.start(_lifespan, app)
        nursery.start_soon(accept_forever, listening, take)
        task_status.started()


def too_many_connections(limit: int) -> bytes:
    """The answer to a connection past the bound: a JSON 503 in the front's
    error shape, written before any request is read (so, HTTP/1.1)."""
    body = json.dumps(
        {
            "error": {
                "status": 503,
                "code": "too_many_connections",
                "message": f"{limit} connections are open, the most this server takes;"
                " try again later",
            }
        }
    ).encode()
    return (
        b"HTTP/1.1 503 Service Unavailable\r\n"
        b"content-type: application/json\r\n"
        b"content-length: %d\r\n"
        b"connection: close\r\n"
        b"retry-after: 1\r\n"
        b"\r\n" % len(body)
    ) + body


async def _lifespan(app: Any, *, task_status: trio.TaskStatus[None]) -> None:
    """The app's ASGI lifespan: startup, then held until the server is
    cancelled (shutting down is cancelling, as it was under hypercorn)."""
    said = False
    started = False

    async def receive() -> dict[str, Any]:
        nonlocal said
        if not said:
            said = True
            return {"type": "lifespan.startup"}
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        nonlocal started
        if message["type"] == "lifespan.startup.complete" and not started:
            started = True
            task_status.started()
        elif message["type"] == "lifespan.startup.failed":
            raise RuntimeError(f"the app did not start: {message.get('message', '')}")

    await app(dict(_LIFESPAN), receive, send)
    if not started:  # an app that ignores lifespan
        task_status.started()
    await trio.sleep_forever()
