"""`WS /ws/provider`: the thin trio shell over `protocol/link.py`.

One connection is one `ProviderSocket`. Its reader loop feeds each message to
the link's state machine and performs the actions it answers. The broker's
side of the port (`send_offer`, `send_cancel`, `close`) never blocks: on
funduq's front a frame for an idle link is written at once with a
non-blocking send (`_queue`), and whatever the kernel does not take goes
through a memory channel to a writer task, which owns the socket until the
channel is empty again. Every
rule of the link (handshake, ids, violations, size limit) lives in the
machine; this module only does I/O.

Mounting: `mount_provider_socket(app, funduq)` (or
`register_provider_socket(app, lambda: funduq)` where the facade is found
later) adds the route to a quart-trio app. The route is served straight on
ASGI (`AsgiWebsocket`), in front of quart: quart-trio moves every websocket
message through a task of its own, a blinker signal and a second memory
channel, which cost more server CPU than the link's own work for a provider
that sends one frame per event (bench/README.md, "Where a run's milliseconds
go"). Other websocket paths still reach quart (and its 404).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from funduq_trio.broker.errors import FunduqError
from funduq_trio.identity import fingerprint_of, new_nonce
from funduq_trio.protocol import link as L
from funduq_trio.protocol.frames import Outgoing, encode_frame

__all__ = [
    "OUTBOX_FRAMES",
    "PROVIDER_LINK_PATH",
    "AsgiWebsocket",
    "ProviderSocket",
    "WaitingLinks",
    "mount_provider_socket",
    "register_provider_socket",
]

log = logging.getLogger("funduq_trio.provider_socket")

#: Frames queued for one provider and not yet written. A provider that stops
#: reading while funduq keeps queueing past this is closed (1008), so a stuck
#: peer cannot grow the server's memory without bound.
OUTBOX_FRAMES = 10_000
#: Where providers dial in (DESIGN §5).
PROVIDER_LINK_PATH = "/ws/provider"
#: How long a closing link keeps reading for the provider to go.
CLOSE_GRACE_SECONDS = 2.0
#: funduq's front lets a frame be written from the step that made it
#: (front/websocket.py); elsewhere (hypercorn) every frame goes through the
#: writer task.
SEND_NOW_EXTENSION = "funduq.websocket.send_now"
#: funduq's front hands a message over as its text, without an ASGI dict.
RECEIVE_MESSAGE_EXTENSION = "funduq.websocket.receive_message"
_FLUSH_MESSAGE = {"type": "funduq.websocket.flush"}
_CLOSE_REASON_BYTES = 123  # RFC 6455: a close reason fits in 123 bytes


def _close_reason(reason: str) -> str:
    data = reason.encode("utf-8")
    if len(data) <= _CLOSE_REASON_BYTES:
        return reason
    return data[: _CLOSE_REASON_BYTES - 3].decode("utf-8", "ignore") + "..."


class _Flush:
    """In the outbox: a message written at once in part; the writer writes
    its rest before anything queued after it."""


_FLUSH = _Flush()

#: A link to a provider that takes batches, which wrote a frame first less
#: than this long ago, queues the next one for its writer, which sends
#: whatever queued meanwhile as one `batch`:
#: at half load nearly every offer is still written first, at saturation the
#: offers of a scheduler round still share a message (bench/README.md,
#: "Write first on the provider link": one offer a message cost the SDK
#: providers ~50% more CPU a run and the server some too).
WRITE_FIRST_GAP_SECONDS = 0.001


class WaitingLinks:
    """The links of one server that have not said `connect` yet: at most
    FUNDUQ_MAX_UNAUTHENTICATED_LINKS of them, each for at most
    FUNDUQ_HANDSHAKE_TIMEOUT_SECONDS, so strangers cannot hold sockets open."""

    def __init__(self) -> None:
        self.count = 0

    def enter(self, limit: int) -> bool:
        if self.count >= limit:
            return False
        self.count += 1
        return True

    def leave(self) -> None:
        self.count -= 1


class ProviderSocket:
    """One provider connection; implements the broker's `ProviderLink` port."""

    def __init__(self, ws: Any, funduq: Any, waiting: WaitingLinks | None = None) -> None:
        settings = funduq.settings
        self._ws = ws
        self._funduq = funduq
        self._waiting = waiting if waiting is not None else WaitingLinks()
        self._counted = False  # this link is one of self._waiting's
        self.machine = L.LinkMachine(
            funduq.identity,
            new_nonce(),
            allowed_keys=settings.provider_keys,
            max_frame_bytes=settings.max_frame_bytes,
        )
        self._out_send, self._out_receive = trio.open_memory_channel[Any](OUTBOX_FRAMES)
        #: The writer waits on an empty outbox and no bytes are owed: a frame
        #: may be written from the step that made it (`_queue`).
        self._writer_idle = False
        self._wrote_first_at = -math.inf
        self._write_first = bool(getattr(ws, "can_send_now", False))
        self._session: Any = None
        self._llm: Any = None  # the KYOK side, once the link publishes offerings
        self._nursery: trio.Nursery | None = None
        self._close: L.Close | None = None  # how this side closes the socket
        self._queries = 0  # query.threadMessages in flight

    # -- the broker's port (ProviderLink): never blocks ------------------------

    def send_offer(self, offer_id: str, run: dict[str, Any]) -> None:
        self._perform(self.machine.offer(offer_id, run))

    def send_cancel(self, run_id: str) -> None:
        self._perform(self.machine.cancel(run_id))

    def close(self, reason: str) -> None:
        self._perform(self.machine.close(reason))

    # -- the KYOK relay's port (LlmLink): never blocks --------------------------

    def send_complete(self, completion_id: str, request: dict[str, Any]) -> None:
        self._perform(self.machine.complete(completion_id, request))

    def send_abandon(self, completion_id: str) -> None:
        self._perform(self.machine.abandon(completion_id))

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
                    self._not_held("reported for", action.run_id)
            elif isinstance(action, L.Finish):
                if self._session is not None and not self._session.finish(action.run_id):
                    self._not_held("finished", action.run_id)
            elif isinstance(action, L.Answer):
                if self._session is not None:
                    self._session.answer(action.offer_id, action.verdict, action.reason)
            elif isinstance(action, L.Attach):
                self._stop_waiting()
                self._session = self._funduq.attach_provider(
                    action.public_key, action.max_concurrent_runs, self
                )
                log.info(
                    "provider %s attached (key %s, max concurrent runs %s)",
                    self._session.fingerprint,
                    action.public_key,
                    action.max_concurrent_runs or "unlimited",
                )
            elif isinstance(action, L.Chunk):
                if self._llm is not None:
                    self._llm.chunk(action.completion_id, action.data)
            elif isinstance(action, L.CompletionEnd):
                if self._llm is not None:
                    self._llm.end(action.completion_id)
            elif isinstance(action, L.CompletionFailed):
                if self._llm is not None:
                    self._llm.failed(action.completion_id, action.message, action.refusal)
            elif isinstance(action, L.Detach):
                if self._session is not None:
                    self._session.detach()
                if self._llm is not None:
                    self._llm.detach()
            elif isinstance(action, L.Close):
                self._begin_close(action)
            else:
                raise AssertionError(f"{action!r} needs the reader loop")  # pragma: no cover

    def _not_held(self, what: str, run_id: str) -> None:
        log.info(
            "provider %s %s run %s, which it does not hold: ignored",
            self.machine.public_key,
            what,
            run_id,
        )

    def _queue(self, frame: Any) -> None:
        if self._close is not None:
            return
        if self._writer_idle and (
            not self.machine.peer_takes_batches
            or trio.current_time() - self._wrote_first_at >= WRITE_FIRST_GAP_SECONDS
        ):
            # Write first (as asyncio's transports do): the frame goes from
            # this step, not the writer's next one in a round full of other
            # runs' work. What the kernel does not take at once goes to the
            # writer, which then owns the socket until its outbox is empty.
            text = _encoded(frame)
            if text is None:
                return
            sent = self._ws.send_now(text)
            if sent == "sent":
                self._wrote_first_at = trio.current_time()
                return
            frame = _FLUSH if sent == "owed" else text
        self._writer_idle = False  # the writer has a frame: what follows goes behind it
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
        self._writer_idle = False
        self._close = close

    # -- the connection's tasks -------------------------------------------------

    async def run(self) -> None:
        """Serve the connection until either side closes it."""
        await self._ws.accept()
        settings = self._funduq.settings
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._writer)
                if self._waiting.enter(settings.max_unauthenticated_links):
                    self._counted = True
                    self._perform([self.machine.hello()])
                    nursery.start_soon(self._handshake_deadline, settings.handshake_timeout_seconds)
                else:
                    log.warning(
                        "provider link refused: %d links already wait for 'connect'",
                        self._waiting.count,
                    )
                    self._perform(self.machine.no_room_to_wait(settings.max_unauthenticated_links))
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
            self._stop_waiting()
            why = self.machine.close_reason or self._peer_close()
            self._perform(self.machine.connection_lost())
            self._log_end(why)

    def _peer_close(self) -> str:
        """Why the link ended when funduq did not end it. A disconnect event
        (`AsgiWebsocket.disconnected`) means the provider's side closed the
        stream (with its close frame's code, 1006 when it sent none); the
        code is shown only when it says more than a goodbye."""
        if not getattr(self._ws, "disconnected", False):
            return "connection lost"
        code = self._ws.close_code
        return "the provider closed the connection" + (
            f" (close code {code})" if code not in (1000, 1001, 1005, 1006, None) else ""
        )

    def _log_end(self, why: str) -> None:
        if self.machine.public_key is not None:
            log.info("provider %s left: %s", fingerprint_of(self.machine.public_key), why)
        elif self.machine.claimed_key is not None:
            log.info(
                "refused a provider link claiming key %r: %s", self.machine.claimed_key[:80], why
            )
        else:
            log.info("refused a provider link before it claimed a key: %s", why)

    def _stop_waiting(self) -> None:
        if self._counted:
            self._counted = False
            self._waiting.leave()

    async def _handshake_deadline(self, seconds: float) -> None:
        """A link still waiting for `connect` after `seconds` is refused."""
        await trio.sleep(seconds)
        self._perform(self.machine.handshake_timed_out(seconds))

    async def _writer(self) -> None:
        """Write queued frames in order. To a provider that takes batches,
        whatever is queued when the socket frees up goes as one `batch`: each
        websocket message costs a few scheduler rounds to send, so one frame
        per message left offers queueing behind each other under load. With
        the outbox empty the writer is idle and `_queue` writes first."""
        nursery = self._nursery
        assert nursery is not None
        receive = self._out_receive
        held: Any = None  # taken from the outbox, next to go
        try:
            while True:
                if held is not None:
                    item, held = held, None
                else:
                    try:
                        item = receive.receive_nowait()
                    except trio.WouldBlock:
                        self._writer_idle = self._write_first and self._close is None
                        item = await receive.receive()
                if isinstance(item, L.Close):
                    break
                if item is _FLUSH:
                    await self._ws.flush()
                    continue
                out = Outgoing()
                text = _encoded(item)
                if text is None:
                    continue
                out.add(text)
                while self.machine.peer_takes_batches:
                    try:
                        item = receive.receive_nowait()
                    except trio.WouldBlock:
                        break
                    if isinstance(item, (L.Close, _Flush)):
                        held = item
                        break
                    text = _encoded(item)
                    if text is not None and not out.add(text):
                        held = item
                        break
                await self._ws.send(out.message())
        except (
            trio.BrokenResourceError,
            trio.ClosedResourceError,
            trio.EndOfChannel,
            OSError,
        ) as exc:
            log.info("provider link write failed: %r", exc)
        finally:
            self._writer_idle = False
        nursery.cancel_scope.cancel()

    async def _reader(self, nursery: trio.Nursery) -> None:
        machine = self.machine
        while machine.state is not L.State.CLOSED:
            message = await self._ws.receive()
            if message is None:  # quart-trio hands an empty binary frame over as None
                message = b""
            got = machine.take(message)
            if type(got) is tuple:
                # A plain report, the commonest message: straight to the
                # session (`_perform`'s own case for it, less the `Report`,
                # its list and the type tests before it).
                session = self._session
                if session is not None:
                    if not session.report(got[0], got[1]):
                        self._not_held("reported for", got[0])
                if self._session is not None and self._session.behind:
                    await self._session.can_read()  # backpressure, as below
                continue
            # In order, the waiting ones included: a batch's frames take effect
            # exactly as if they had come one by one.
            for action in got:
                session = self._session
                if type(action) is L.Report and session is not None:
                    # The commonest action, straight to the session (`_perform`'s
                    # own case for it, less the list and the type tests before it).
                    if not session.report(action.run_id, action.event):
                        self._not_held("reported for", action.run_id)
                elif isinstance(action, L.Register):
                    await self._register(action)
                elif isinstance(action, L.RegisterLlm):
                    await self._register_llm(action)
                elif isinstance(action, L.QueryThreadMessages):
                    if self._queries >= self._funduq.settings.max_thread_queries_per_link:
                        # One task and one history read each: past the bound
                        # the provider is told at once, the link stays up.
                        self._perform(
                            self.machine.query_done(
                                action.request_id, error=_TOO_MANY_QUERIES.format(self._queries)
                            )
                        )
                    else:
                        self._queries += 1
                        nursery.start_soon(self._query, action)
                else:
                    self._perform([action])
            if self._session is not None and self._session.behind:
                # Backpressure: funduq is behind recording this provider's
                # reports; read no more from it until it has caught up.
                await self._session.can_read()
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
        except FunduqError as exc:  # refused on purpose (e.g. past a bound): the provider's to fix
            log.info("register from provider %s refused: %s", self.machine.public_key, exc)
            error = str(exc)
        except Exception as exc:
            log.exception("register from provider %s failed", self.machine.public_key)
            error = f"funduq could not register these agents: {exc}"
        self._perform(self.machine.register_done(action.request_id, error))

    async def _register_llm(self, action: L.RegisterLlm) -> None:
        error: str | None = None
        try:
            if self._llm is None:
                self._llm = self._funduq.kyok.attach(self.machine.public_key, self)
            await self._llm.register(action.offerings)
        except Exception as exc:
            log.exception("register.llm from provider %s failed", self.machine.public_key)
            error = f"funduq could not register these offerings: {exc}"
        self._perform(self.machine.register_llm_done(action.request_id, error))

    async def _query(self, action: L.QueryThreadMessages) -> None:
        cap = self._funduq.settings.max_thread_messages_per_query
        limit = cap if action.limit is None else min(action.limit, cap)
        try:
            messages = await self._session.thread_messages(action.thread_id, limit)
        except Exception as exc:  # noqa: BLE001 - any failure is answered, not fatal
            log.info("query.threadMessages from %s failed: %r", self.machine.public_key, exc)
            self._perform(self.machine.query_done(action.request_id, error=str(exc) or repr(exc)))
            return
        finally:
            self._queries -= 1
        self._perform(self.machine.query_done(action.request_id, messages))


_TOO_MANY_QUERIES = (
    "{} query.threadMessages already in flight on this link "
    "(FUNDUQ_MAX_THREAD_QUERIES_PER_LINK); retry once one is answered"
)


def _encoded(frame: Any) -> str | None:
    """The frame's text, or None (logged) for one the link cannot encode. The
    machine and the lanes check what they send (protocol/carriable.py); this
    is the last line: one bad frame must not take the link and every run on
    it down."""
    if type(frame) is str:  # encoded already (`_queue` found the socket busy)
        return frame
    try:
        return encode_frame(frame)
    except ValueError:  # pydantic's serialization error (a lone surrogate) is one
        log.exception("a %s frame could not be encoded: not sent", getattr(frame, "kind", "?"))
        return None


async def serve_provider_link(ws: Any, funduq: Any, waiting: WaitingLinks | None = None) -> None:
    """Serve one accepted-or-not websocket as a provider link."""
    await ProviderSocket(ws, funduq, waiting).run()


class AsgiWebsocket:
    """The few websocket calls `ProviderSocket` makes, straight on an ASGI
    connection's `receive` / `send`: one await per message, no task or
    channel in between. Like quart-trio, a disconnect cancels the link's
    handler (`gone`), so `ProviderSocket.run` ends as it always has."""

    def __init__(
        self,
        receive: Any,
        send: Any,
        gone: Callable[[], None],
        send_now: Callable[[dict[str, Any]], str] | None = None,
        receive_message: Callable[[], Awaitable[str | bytes | None]] | None = None,
    ) -> None:
        self._receive = receive
        #: The server hands a message over as itself (funduq's front, see
        #: front/websocket.py; not hypercorn): None means ``receive`` says what came.
        self._receive_message = receive_message
        self._send = send
        self._gone = gone
        self._send_now = send_now
        #: The server offers `send_now` (funduq's front; not hypercorn).
        self.can_send_now = send_now is not None
        #: The provider's side closed the stream (and with which code): a
        #: provider that says goodbye is not a lost connection.
        self.disconnected = False
        self.close_code: int | None = None

    async def accept(self) -> None:
        await self._send({"type": "websocket.accept"})

    async def receive(self) -> str | bytes:
        if self._receive_message is not None:
            message = await self._receive_message()
            if message is not None:
                return message
        while True:
            event = await self._receive()
            kind = event["type"]
            if kind == "websocket.receive":
                text = event.get("text")
                return text if text is not None else (event.get("bytes") or b"")
            if kind == "websocket.disconnect":
                self.disconnected, self.close_code = True, event.get("code")
                self._gone()
                await trio.sleep_forever()  # cancelled at once: the handler's end

    async def send(self, data: str | bytes) -> None:
        if isinstance(data, str):
            await self._send({"type": "websocket.send", "text": data})
        else:
            await self._send({"type": "websocket.send", "bytes": data})

    def send_now(self, text: str) -> str:
        """Write a text message from this step: "sent", "owed" (`flush`
        must follow) or "busy" (nothing taken: `send` it)."""
        assert self._send_now is not None
        return self._send_now({"type": "websocket.send", "text": text})

    async def flush(self) -> None:
        """Write what `send_now` owes."""
        await self._send(_FLUSH_MESSAGE)

    async def close(self, code: int, reason: str = "") -> None:
        await self._send({"type": "websocket.close", "code": code, "reason": reason})


def register_provider_socket(app: Any, funduq_getter: Callable[[], Any]) -> None:
    """Serve `WS /ws/provider` for a quart-trio app, in front of its own
    routing (see the module's docstring); `funduq_getter()` returns the
    `Funduq` facade when a connection arrives."""
    waiting = WaitingLinks()  # this app's links that have not said connect yet
    quart_asgi = app.asgi_app

    async def asgi_app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "websocket" or scope["path"] != PROVIDER_LINK_PATH:
            await quart_asgi(scope, receive, send)
            return
        with trio.CancelScope() as handler:
            extensions = scope.get("extensions") or {}
            ws = AsgiWebsocket(
                receive,
                send,
                handler.cancel,
                extensions.get(SEND_NOW_EXTENSION),
                extensions.get(RECEIVE_MESSAGE_EXTENSION),
            )
            try:
                await serve_provider_link(ws, funduq_getter(), waiting)
            except Exception:  # noqa: BLE001 - logged by ProviderSocket.run; the server closes
                pass

    app.asgi_app = asgi_app


def mount_provider_socket(app: Any, funduq: Any) -> None:
    """Add `WS /ws/provider`, served by this facade."""
    register_provider_socket(app, lambda: funduq)
