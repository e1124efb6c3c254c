"""`WS /ws/provider`: the thin trio shell over `protocol/link.py`.

One connection is one `ProviderSocket`. Its reader loop feeds each message to
the link's state machine and performs the actions it answers; a writer task
drains a memory channel onto the socket, so the broker's side of the port
(`send_offer`, `send_cancel`, `close`) only queues and never blocks. Every
rule of the link (handshake, ids, violations, size limit) lives in the
machine; this module only does I/O.

Mounting: `mount_provider_socket(app, funduq)` (or
`register_provider_socket(app, lambda: funduq)` where the facade is found
later) adds the route to a quart-trio app.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio
from quart import websocket

from funduq_trio.identity import fingerprint_of, new_nonce
from funduq_trio.protocol import link as L
from funduq_trio.protocol.frames import Outgoing, encode_frame

__all__ = ["OUTBOX_FRAMES", "ProviderSocket", "mount_provider_socket", "register_provider_socket"]

log = logging.getLogger("funduq_trio.provider_socket")

#: Frames queued for one provider and not yet written. A provider that stops
#: reading while funduq keeps queueing past this is closed (1008), so a stuck
#: peer cannot grow the server's memory without bound.
OUTBOX_FRAMES = 10_000
#: How long a closing link keeps reading for the provider to go.
CLOSE_GRACE_SECONDS = 2.0
_CLOSE_REASON_BYTES = 123  # RFC 6455: a close reason fits in 123 bytes


def _close_reason(reason: str) -> str:
    data = reason.encode("utf-8")
    if len(data) <= _CLOSE_REASON_BYTES:
        return reason
    return data[: _CLOSE_REASON_BYTES - 3].decode("utf-8", "ignore") + "..."


class ProviderSocket:
    """One provider connection; implements the broker's `ProviderLink` port."""

    def __init__(self, ws: Any, funduq: Any) -> None:
        settings = funduq.settings
        self._ws = ws
        self._funduq = funduq
        self.machine = L.LinkMachine(
            funduq.identity,
            new_nonce(),
            allowed_keys=settings.provider_keys,
            max_frame_bytes=settings.max_frame_bytes,
        )
        self._out_send, self._out_receive = trio.open_memory_channel[Any](OUTBOX_FRAMES)
        self._session: Any = None
        self._nursery: trio.Nursery | None = None
        self._close: L.Close | None = None  # how this side closes the socket

    # -- the broker's port (ProviderLink): never blocks ------------------------

    def send_offer(self, offer_id: str, run: dict[str, Any]) -> None:
        self._perform(self.machine.offer(offer_id, run))

    def send_cancel(self, run_id: str) -> None:
        self._perform(self.machine.cancel(run_id))

    def close(self, reason: str) -> None:
        self._perform(self.machine.close(reason))

    # -- performing the machine's actions -------------------------------------

    def _perform(self, actions: list[L.Action]) -> None:
        """Do actions that need no waiting, in order. (Register and
        QueryThreadMessages come only from `receive`; the reader loop does
        those itself, in their place among the others.)"""
        for action in actions:
            if isinstance(action, L.Send):
                self._queue(action.frame)
            elif isinstance(action, L.Report):
                if self._session is not None and not self._session.report(
                    action.run_id, action.event
                ):
                    log.info(
                        "provider %s reported for run %s, which it does not hold: ignored",
                        self.machine.public_key,
                        action.run_id,
                    )
            elif isinstance(action, L.Finish):
                if self._session is not None and not self._session.finish(action.run_id):
                    log.info(
                        "provider %s finished run %s, which it does not hold: ignored",
                        self.machine.public_key,
                        action.run_id,
                    )
            elif isinstance(action, L.Answer):
                if self._session is not None:
                    self._session.answer(action.offer_id, action.verdict, action.reason)
            elif isinstance(action, L.Attach):
                self._session = self._funduq.attach_provider(
                    action.public_key, action.max_concurrent_runs, self
                )
                log.info("provider %s attached (key %s, max concurrent runs %s)",
                         self._session.fingerprint, action.public_key,
                         action.max_concurrent_runs or "unlimited")
            elif isinstance(action, L.Detach):
                if self._session is not None:
                    self._session.detach()
            elif isinstance(action, L.Close):
                self._begin_close(action)
            else:
                raise AssertionError(f"{action!r} needs the reader loop")  # pragma: no cover

    def _queue(self, frame: Any) -> None:
        if self._close is not None:
            return
        try:
            self._out_send.send_nowait(frame)
        except trio.WouldBlock:
            log.warning("provider %s is not reading its frames: closing", self.machine.public_key)
            self._perform(self.machine.close("provider is not reading its frames"))
            # The outbox is full, so the close cannot queue behind it: stop now.
            if self._nursery is not None:
                self._nursery.cancel_scope.cancel()
        except (trio.ClosedResourceError, trio.BrokenResourceError):
            pass

    def _begin_close(self, close: L.Close) -> None:
        if self._close is not None:
            return
        try:
            # Behind whatever is already queued (a connect.err goes out first).
            self._out_send.send_nowait(close)
        except (trio.WouldBlock, trio.ClosedResourceError, trio.BrokenResourceError):
            if self._nursery is not None:
                self._nursery.cancel_scope.cancel()
        self._close = close

    # -- the connection's tasks -------------------------------------------------

    async def run(self) -> None:
        """Serve the connection until either side closes it."""
        await self._ws.accept()
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer)
                self._perform([self.machine.hello()])
                await self._reader(nursery)
                nursery.cancel_scope.cancel()
            if self._close is not None:
                with trio.move_on_after(CLOSE_GRACE_SECONDS):
                    async with trio.open_nursery() as closing:
                        closing.start_soon(self._discard_frames)
                        await self._ws.close(self._close.code, _close_reason(self._close.reason))
                        # Until the provider is gone: a full inbound queue would
                        # hold the server's disconnect back forever.
                        await trio.sleep(CLOSE_GRACE_SECONDS)
        except Exception:
            log.exception("provider link failed")
            raise
        finally:
            why = self.machine.close_reason or self._peer_close()
            self._perform(self.machine.connection_lost())
            self._log_end(why)

    def _peer_close(self) -> str:
        """Why the link ended when funduq did not end it. A disconnect event
        (see `remember_close_codes`) means the provider's side closed the
        stream; hypercorn reports a provider's own close frame as 1006 too,
        so the code is shown only when it says more than that."""
        scope = getattr(self._ws, "scope", None) or {}
        if CLOSE_CODE_KEY not in scope:
            return "connection lost"
        code = scope[CLOSE_CODE_KEY]
        return "the provider closed the connection" + (
            f" (close code {code})" if code not in (1000, 1001, 1005, 1006, None) else "")

    def _log_end(self, why: str) -> None:
        if self.machine.public_key is not None:
            log.info("provider %s left: %s", fingerprint_of(self.machine.public_key), why)
        elif self.machine.claimed_key is not None:
            log.info("refused a provider link claiming key %r: %s",
                     self.machine.claimed_key[:80], why)
        else:
            log.info("refused a provider link before it claimed a key: %s", why)

    async def _writer(self) -> None:
        """Write queued frames in order. To a provider that takes batches,
        whatever is queued when the socket frees up goes as one `batch`: each
        websocket message costs a few scheduler rounds to send, so one frame
        per message left offers queueing behind each other under load."""
        nursery = self._nursery
        assert nursery is not None
        held: Any = None  # taken from the outbox, next to go
        try:
            while True:
                item = held if held is not None else await self._out_receive.receive()
                held = None
                if isinstance(item, L.Close):
                    break
                out = Outgoing()
                out.add(encode_frame(item))
                while self.machine.peer_takes_batches:
                    try:
                        item = self._out_receive.receive_nowait()
                    except trio.WouldBlock:
                        break
                    if isinstance(item, L.Close) or not out.add(encode_frame(item)):
                        held = item
                        break
                await self._ws.send(out.message())
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.EndOfChannel,
                OSError) as exc:
            log.info("provider link write failed: %r", exc)
        nursery.cancel_scope.cancel()

    async def _reader(self, nursery: trio.Nursery) -> None:
        while self.machine.state is not L.State.CLOSED:
            message = await self._ws.receive()
            if message is None:  # quart-trio hands an empty binary frame over as None
                message = b""
            # In order, the waiting ones included: a batch's frames take effect
            # exactly as if they had come one by one.
            for action in self.machine.receive(message):
                if isinstance(action, L.Register):
                    await self._register(action)
                elif isinstance(action, L.QueryThreadMessages):
                    nursery.start_soon(self._query, action)
                else:
                    self._perform([action])
        # Closing: the writer sends what is queued, then the close. Meanwhile
        # keep reading (and dropping) what the provider still sends, so its
        # frames never back up into the server's queues and wedge the close.
        await self._discard_frames()

    async def _discard_frames(self) -> None:
        while True:
            await self._ws.receive()

    async def _register(self, action: L.Register) -> None:
        error: str | None = None
        try:
            await self._session.register(action.agents)
        except Exception as exc:
            log.exception("register from provider %s failed", self.machine.public_key)
            error = f"funduq could not register these agents: {exc}"
        self._perform(self.machine.register_done(action.request_id, error))

    async def _query(self, action: L.QueryThreadMessages) -> None:
        try:
            messages = await self._session.thread_messages(action.thread_id, action.limit)
        except Exception as exc:  # noqa: BLE001 - any failure is answered, not fatal
            log.info("query.threadMessages from %s failed: %r", self.machine.public_key, exc)
            self._perform(self.machine.query_done(action.request_id, error=str(exc) or repr(exc)))
            return
        self._perform(self.machine.query_done(action.request_id, messages))


async def serve_provider_link(ws: Any, funduq: Any) -> None:
    """Serve one accepted-or-not websocket as a provider link."""
    await ProviderSocket(ws, funduq).run()


#: Where `remember_close_codes` leaves the close code in a websocket's scope.
CLOSE_CODE_KEY = "funduq.close_code"


def remember_close_codes(asgi_app: Any) -> Any:
    """Wrap an ASGI app so a websocket's scope keeps the close code of its
    `websocket.disconnect`: quart cancels the handler without telling it, and
    a provider that says goodbye (1000) is not a lost connection."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "websocket":
            await asgi_app(scope, receive, send)
            return

        async def receiving() -> Any:
            event = await receive()
            if event.get("type") == "websocket.disconnect":
                scope[CLOSE_CODE_KEY] = event.get("code")
            return event

        await asgi_app(scope, receiving, send)

    return app


def register_provider_socket(app: Any, funduq_getter: Callable[[], Any]) -> None:
    """Add `WS /ws/provider` to a quart-trio app; `funduq_getter()` returns the
    `Funduq` facade when a connection arrives."""
    app.asgi_app = remember_close_codes(app.asgi_app)

    @app.websocket("/ws/provider")
    async def provider_socket() -> None:
        await serve_provider_link(websocket._get_current_object(), funduq_getter())


def mount_provider_socket(app: Any, funduq: Any) -> None:
    """Add `WS /ws/provider`, served by this facade."""
    register_provider_socket(app, lambda: funduq)
