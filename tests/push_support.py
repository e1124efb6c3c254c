"""A real HTTP receiver for push notifications: raw trio sockets and h11 on a
loopback port, one request per connection (it answers `Connection: close`).

    async with push_receiver() as receiver:
        ... receiver.url ...
        await receiver.wait_for(3)
        receiver.received  # [(headers, body bytes), ...] in arrival order

`answers` decides each request's status: a list consumed one per request
(200 when empty). `down_after=n` closes the listener after the n-th 2xx, so
later connections are refused until `await receiver.up()` listens again on
the same port.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import h11
import trio


class Receiver:
    def __init__(self, nursery: trio.Nursery, host: str = "127.0.0.1", port: int = 0) -> None:
        self._nursery = nursery
        self.host = host
        self.port = port
        self.received: list[tuple[dict[str, str], bytes]] = []
        self.attempts = 0  # requests answered, whatever the status
        self.answers: list[int] = []
        self.down_after: int | None = None
        self._scope: trio.CancelScope | None = None
        self._changed = trio.Event()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}/hook"

    def bodies(self) -> list[Any]:
        return [json.loads(body) for _, body in self.received]

    async def up(self) -> None:
        listeners = await trio.open_tcp_listeners(self.port, host=self.host)
        self.port = listeners[0].socket.getsockname()[1]
        self._scope = trio.CancelScope()

        async def serve(scope: trio.CancelScope) -> None:
            with scope:
                await trio.serve_listeners(self._serve, listeners)

        self._nursery.start_soon(serve, self._scope)

    def down(self) -> None:
        """Stop listening: connections are refused from now on."""
        if self._scope is not None:
            self._scope.cancel()
            self._scope = None

    async def wait_for(self, count: int) -> None:
        while len(self.received) < count:
            await self._changed.wait()

    async def wait_attempts(self, count: int) -> None:
        while self.attempts < count:
            await self._changed.wait()

    def _note(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _serve(self, stream: trio.SocketStream) -> None:
        conn = h11.Connection(h11.SERVER)
        request: h11.Request | None = None
        body = b""
        async with stream:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = await stream.receive_some(65536)
                    conn.receive_data(data)
                    if not data:
                        return
                    continue
                if isinstance(event, h11.Request):
                    request = event
                elif isinstance(event, h11.Data):
                    body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    break
                else:
                    return
            assert request is not None
            status = self.answers.pop(0) if self.answers else 200
            self.attempts += 1
            if 200 <= status < 300:
                headers = {k.decode().lower(): v.decode() for k, v in request.headers}
                self.received.append((headers, body))
            response = h11.Response(
                status_code=status, headers=[("content-length", "0"), ("connection", "close")]
            )
            await stream.send_all(conn.send(response) + conn.send(h11.EndOfMessage()))
            self._note()
            if (
                self.down_after is not None
                and 200 <= status < 300
                and len(self.received) >= self.down_after
            ):
                self.down_after = None
                self.down()


@contextlib.asynccontextmanager
async def push_receiver(host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[Receiver]:
    async with trio.open_nursery() as nursery:
        receiver = Receiver(nursery, host, port)
        await receiver.up()
        yield receiver
        nursery.cancel_scope.cancel()
