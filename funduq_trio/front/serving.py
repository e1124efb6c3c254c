"""Serve an ASGI app on a listening socket: the lifespan, then a task per
connection (`front/http.py`), until cancelled."""

from __future__ import annotations

import logging
import socket
from collections.abc import Awaitable
from typing import Any

import trio

from .http import Connection
from .limits import FrontLimits
from .sockets import Hangups, accept_forever

log = logging.getLogger("funduq_trio.server")

#: Connections the kernel may hold before funduq accepts them.
BACKLOG = 1024

_LIFESPAN = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}}


async def serve_asgi(
    app: Any,
    listening: socket.socket,
    limits: FrontLimits,
    *,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run `app`'s lifespan startup, then serve every connection `listening`
    (a bound socket) accepts; report started once connections are taken.
    Runs until cancelled."""
    listening.listen(BACKLOG)

    hangups = Hangups() if Hangups.available else None

    def serve_connection(sock: socket.socket, client: tuple[str, int] | None) -> Awaitable[None]:
        # The connection's own coroutine, not one awaiting it: a frame less
        # for every connection held open (it logs its own failure).
        return Connection(sock, client, app, limits, hangups).serve()

    async with trio.open_nursery() as nursery:
        if hangups is not None:
            nursery.start_soon(hangups.run)
        await nursery.start(_lifespan, app)
        nursery.start_soon(accept_forever, listening, serve_connection, nursery)
        task_status.started()


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
