"""`text/event-stream` responses for the doors (AG-UI, A2A streaming).

One event is one frame: ``data: <compact JSON>\\n\\n``. JSON never contains a raw
newline, so every event is exactly one ``data:`` line. An event wrapped in
`Identified` also carries an ``id: <n>`` line (the run's event seq), which an
SSE client sends back as ``Last-Event-ID`` to pick the stream up after it
(docs/doors.md, "Streams that survive"). A stream's source
yields *bursts* (lists of events that are ready together) and each burst is
written as one chunk: one trip through the ASGI server and one socket write
for a provider's batch of events, instead of one each.

A caller that disconnects ends only its own stream: the server cancels the
task sending the response, the body generator is closed, and that closes the
source it was following (a ``Funduq.follow`` generator). Following is reading;
nothing a stream does can end or change the run it follows.

Usage from a route::

    async def bursts():
        async with contextlib.aclosing(funduq.follow(run_id)) as stream:
            async for burst in stream:
                yield [Identified(seq, event) for seq, event in burst]

    return sse_response(bursts())

Everything that can fail with a status code (404, 429, ...) must be decided
*before* returning ``sse_response``: once the stream starts the status is 200.

Keepalive: a stream that has written nothing for the app's
``SSE_KEEPALIVE_SECONDS`` (FUNDUQ_SSE_KEEPALIVE_SECONDS) writes the comment
``: keepalive``, so a proxy with a read timeout does not cut a run that waits
in the queue or thinks. SSE clients ignore comments.

Serving: a stream lasts as long as the run it follows, which may wait in a
queue for hours, so what it holds meanwhile is paid per waiting caller. In an
app wrapped by `serve_streams` (`web/app.py` does), quart answers the request
as any other -- routing, the door's checks, errors, the after-request hooks
(CORS) and the response's status and headers -- and then hands the stream
over: the response body quart iterates is empty, and iterating it leaves the
stream in the ASGI scope. `serve_streams` then writes the stream itself on
the connection's own task, straight onto hypercorn's ``send``, with one
watcher task that reads ``receive`` (a disconnect cancels the writer, which
closes the source) and writes the keepalive comments. Quart's request and
response objects, its two tasks per request and its context are gone by
then (bench/README.md, "What an open stream holds"). Without `serve_streams`
(an app that mounts the doors on its own) the response streams through quart,
its source read by a task in the app's nursery (`with_keepalive`): a
generator cannot be read with a timeout (cancelling its ``__anext__`` ends
it).

The doors' run POSTs (`web/asgi_doors.py`) go further: their sources wait in
a `broker/quiet.py` Quiet (each wait for news in a cancel scope with the
keepalive's deadline; one that ends without news yields an empty burst), and
funduq's front says when the caller goes (`HANGUP_EXTENSION`), so such a
stream is served by `SseStream` on the connection's task with no watcher
beside it (bench/README.md, "A waiting stream on one task").
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable, Mapping
from typing import Any

import trio
from quart import Response, current_app, request

from ..broker.quiet import Quiet

SSE_CONTENT_TYPE = "text/event-stream"

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    # Tell buffering reverse proxies (nginx) to pass frames through as produced.
    "X-Accel-Buffering": "no",
}


#: The comment a silent stream writes (SSE clients skip lines starting ":").
KEEPALIVE = b": keepalive\n\n"

#: The app config key holding the keepalive interval in seconds (0: none).
KEEPALIVE_CONFIG = "SSE_KEEPALIVE_SECONDS"


class StreamCut(Exception):
    """A stream's source stopped without ending (see `with_keepalive`)."""


class Identified:
    """An event with its SSE ``id`` (a run's event seq): ``id: <n>`` precedes
    its ``data:`` line."""

    __slots__ = ("id", "data")

    def __init__(self, event_id: int, data: Any) -> None:
        self.id = event_id
        self.data = data

    def __repr__(self) -> str:
        return f"Identified({self.id!r}, {self.data!r})"


#: Characters JSON leaves raw that line readers other than SSE's own (Python's
#: str.splitlines, as httpx's aiter_lines uses) take for line breaks: escaped,
#: so a provider's text can never split a frame for any reader.
_LINE_BREAKERS = {0x85: "\\u0085", 0x2028: "\\u2028", 0x2029: "\\u2029"}


def compact_encoder(
    *,
    ensure_ascii: bool,
    default: Callable[[Any], Any] | None = None,
    sort_keys: bool = False,
) -> Callable[[Any], str]:
    """`json.dumps(data, separators=(",", ":"), ensure_ascii=..., default=...,
    sort_keys=...)` with the encoder made once. `json.dumps` with any option
    builds a `JSONEncoder` for each call, and `JSONEncoder.encode` builds
    json's C encoder (and a closure) for each call too: every event a caller
    is sent is one, every door's JSON answer too (bench/README.md, "The
    callers' side of a run, the run's start"). The C encoder is made here
    once, with what `encode` would give it, but without json's check for a
    cycle (as `broker/store.py`'s): what is sent is parsed JSON or built by
    funduq, and a cycle would be a bug (it fails as RecursionError, as
    `json.dumps(..., check_circular=False)` does)."""
    make = getattr(json.encoder, "c_make_encoder", None)
    if make is None:  # a Python without json's C speedups
        return json.JSONEncoder(
            separators=(",", ":"), ensure_ascii=ensure_ascii, default=default, sort_keys=sort_keys
        ).encode
    encode = make(
        None,  # no cycle check
        json.JSONEncoder().default if default is None else default,
        json.encoder.encode_basestring_ascii if ensure_ascii else json.encoder.encode_basestring,
        None,  # no indent
        ":",
        ",",
        sort_keys,
        False,  # skipkeys
        True,  # allow_nan
    )

    def dumps(data: Any) -> str:
        return "".join(encode(data, 0))

    return dumps


_compact = compact_encoder(ensure_ascii=False)
_compact_ascii = compact_encoder(ensure_ascii=True)


def sse_frame(data: Any, event_id: int | None = None) -> bytes:
    """One SSE frame carrying `data` as compact JSON (and `event_id` as its id)."""
    try:
        text = _compact(data)
        if not text.isascii() and ("\x85" in text or "\u2028" in text or "\u2029" in text):
            text = text.translate(_LINE_BREAKERS)
        body = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: only \u-escaped JSON can carry it
        body = _compact_ascii(data).encode("ascii")
    if event_id is None:
        return b"data: " + body + b"\n\n"
    return b"id: %d\ndata: %s\n\n" % (event_id, body)


def _frame(item: Any) -> bytes:
    if isinstance(item, Identified):
        return sse_frame(item.data, item.id)
    return sse_frame(item)


def burst_chunk(burst: list[Any]) -> bytes:
    """One burst of JSON-able items (or `Identified` ones) as one chunk of frames."""
    return b"".join([_frame(item) for item in burst])


async def sse_frames(bursts: AsyncIterable[list[Any]]) -> AsyncIterator[bytes]:
    """Encode each burst of JSON-able items (or `Identified` ones) as one
    chunk of frames; closing this closes `bursts`."""
    try:
        async for burst in bursts:
            yield burst_chunk(burst)
    finally:
        aclose = getattr(bursts, "aclose", None)
        if aclose is not None:
            await aclose()


async def with_keepalive(
    chunks: AsyncIterator[bytes], interval: float, nursery: trio.Nursery
) -> AsyncIterator[bytes]:
    """`chunks` as they come, plus `KEEPALIVE` whenever `interval` seconds
    pass without a write. A task in `nursery` reads `chunks`; closing this
    cancels it, and it closes `chunks`. An exception `chunks` raises is
    raised here, never in `nursery`."""
    send, receive = trio.open_memory_channel[bytes](0)
    reader = trio.CancelScope()
    failure: list[BaseException] = []
    read_all = False

    async def read() -> None:
        nonlocal read_all
        with reader:
            async with send, contextlib.aclosing(chunks):  # type: ignore[type-var]
                try:
                    async for chunk in chunks:
                        await send.send(chunk)
                    read_all = True
                except Exception as exc:  # noqa: BLE001 -- the stream raises it, not the nursery
                    failure.append(exc)

    nursery.start_soon(read, name="sse reader")
    try:
        while True:
            chunk = None
            with trio.move_on_after(interval):
                try:
                    chunk = await receive.receive()
                except trio.EndOfChannel:
                    break
            # Yield outside the timeout's scope: a generator must not be
            # suspended inside a cancel scope.
            yield KEEPALIVE if chunk is None else chunk
        if failure:
            raise failure[0]
        if not read_all:
            # The nursery was cancelled (the app shuts down): cut the response
            # rather than end it as if the stream were complete.
            raise StreamCut("the stream's source was cancelled")
    finally:
        reader.cancel()
        receive.close()


#: The header an SSE client re-attaches with: the last event id it received.
LAST_EVENT_ID = "Last-Event-ID"

#: Seqs are positive integers; a cursor longer than this is nobody's.
MAX_CURSOR_DIGITS = 15


def read_cursor(value: str | None) -> int | None:
    """A re-attach cursor (a `Last-Event-ID` value, or `?after=`): the seq of
    the last event the caller saw. None when absent or empty (SSE clients
    send no id before the first); ValueError when it is not a seq."""
    if value is None or value.strip() == "":
        return None
    value = value.strip()
    if not (value.isascii() and value.isdigit()) or len(value) > MAX_CURSOR_DIGITS:
        raise ValueError(f"a stream cursor is an event seq (digits), not {value[:40]!r}")
    return int(value)


def sse_response(
    bursts: AsyncIterable[list[Any]],
    *,
    status: int = 200,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """A streaming `text/event-stream` response relaying `bursts` (lists of
    JSON-able or `Identified` items, each written as one chunk), with a
    keepalive comment after the app's SSE_KEEPALIVE_SECONDS of silence.

    In an app wrapped by `serve_streams` the body is handed over to it (see
    the module's docstring); otherwise quart streams it. The response has no
    timeout: a stream lasts as long as what it follows (Quart's
    RESPONSE_TIMEOUT would otherwise cut it after 60 s).
    """
    interval = current_app.config.get(KEEPALIVE_CONFIG) or 0
    scope = request.scope
    body: Any
    if STREAM_SLOT in scope:
        body = _Handover(scope, SseStream(bursts, interval))
    else:
        body = sse_frames(bursts)
        # The app's nursery exists while hypercorn serves it (ASGI lifespan).
        nursery = getattr(current_app, "nursery", None)
        if interval > 0 and nursery is not None:
            body = with_keepalive(body, interval, nursery)
    response = Response(
        body,
        status=status,
        content_type=SSE_CONTENT_TYPE,
        headers={**SSE_HEADERS, **(headers or {})},
    )
    response.timeout = None
    return response


# ------------------------------------------------------------ served on ASGI

#: The ASGI extension (``scope["extensions"]``) by which a server says when
#: the caller goes without the app waiting on `receive`: a callable taking a
#: callback (called once, on the server's own task, when the caller has
#: gone) or None (no longer wanted). funduq's front offers it
#: (`front/http.py`); other servers do not, and their streams are watched
#: by a task reading `receive`.
HANGUP_EXTENSION = "funduq.hangup"

#: The ASGI scope key `serve_streams` sets on every HTTP request: present,
#: `sse_response` hands its stream over; the stream is left there once
#: quart has sent the response's start.
STREAM_SLOT = "funduq.sse_stream"

_END = {"type": "http.response.body", "body": b"", "more_body": False}
#: What writes the rest of a chunk `send_now` owed (an empty chunk writes nothing).
_FLUSH = {"type": "http.response.body", "body": b"", "more_body": True}

#: The ASGI extension by which funduq's front writes a body chunk without
#: awaiting (`front/http.py` `Exchange.send_now`): "sent", or "owed" (the
#: rest goes first with the next `send`, which must follow).
SEND_NOW_EXTENSION = "funduq.http.send_now"
SENT = "sent"

#: The ASGI extension by which funduq's front hands over a request's body
#: all at hand without awaiting (`front/http.py` `Exchange.body_now`):
#: called with the most bytes taken, it gives the body or None (then the
#: app reads it with `receive`, as on any server).
BODY_NOW_EXTENSION = "funduq.http.body_now"

Send = Callable[[Any], Awaitable[None]]
Receive = Callable[[], Awaitable[Any]]


class _Handover:
    """The body quart iterates for a handed-over stream: empty. quart iterates
    it only after sending the response's start (status and headers final), and
    that is when the stream is left in the scope for `serve_streams`; a
    response quart never sends hands nothing over."""

    __slots__ = ("scope", "stream")

    def __init__(self, scope: dict[str, Any], stream: SseStream) -> None:
        self.scope: dict[str, Any] | None = scope
        self.stream: SseStream | None = stream

    def __aiter__(self) -> _Handover:
        return self

    async def __anext__(self) -> bytes:
        if self.scope is not None:
            self.scope[STREAM_SLOT] = self.stream
            self.scope = self.stream = None
        raise StopAsyncIteration


class SseStream:
    """One handed-over stream, written on the connection's task (`serve`)."""

    __slots__ = ("bursts", "interval", "last_write", "writing", "wrote", "gone")

    def __init__(self, bursts: AsyncIterable[list[Any]], interval: float) -> None:
        self.bursts = bursts
        self.interval = interval
        self.last_write = 0.0
        self.writing = False  # the writer is in a send
        self.wrote = False  # something was sent (the head went with it)
        self.gone = False  # the caller disconnected

    def serve(
        self, receive: Receive, send: Send, quiet: Quiet | None = None, scope: Any = None
    ) -> Awaitable[None]:
        """Write the stream to its end, then end the response. A disconnect
        cancels the writer and closes the source; nothing more is sent. A
        cancellation from outside (the server shutting down) or an exception
        from the source leaves the response cut, never ended as if complete.

        A source that waits in `quiet` (`broker/quiet.py`), served by a
        server that says when the caller goes (`HANGUP_EXTENSION` in the ASGI
        `scope`'s extensions: funduq's front), is served on this task alone
        (`_serve_quiet`); otherwise a watcher task reads `receive` beside it."""
        # Not a coroutine itself: one frame less for as long as the stream waits.
        if quiet is not None and scope is not None:
            extensions = scope.get("extensions", {})
            on_hangup = extensions.get(HANGUP_EXTENSION)
            if on_hangup is not None:
                return self._serve_quiet(send, quiet, on_hangup, extensions.get(SEND_NOW_EXTENSION))
        return self._serve_watched(receive, send)

    async def _serve_watched(self, receive: Receive, send: Send) -> None:
        """`serve` with a watcher task reading `receive` beside the writer."""
        bursts, self.bursts = self.bursts, None  # type: ignore[assignment]
        self.last_write = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._watch, receive, send, nursery.cancel_scope)
            aclose = getattr(bursts, "aclose", None)
            try:
                async for burst in bursts:
                    chunk = burst_chunk(burst)
                    del burst  # not held while the next one is awaited
                    self.writing = True
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
                    del chunk
                    self.writing, self.wrote = False, True
                    self.last_write = trio.current_time()
            finally:
                if aclose is not None:
                    await aclose()
            nursery.cancel_scope.cancel()  # the stream ended: the watcher stops
        if not self.gone:
            await send(_END)

    async def _serve_quiet(
        self,
        send: Send,
        quiet: Quiet,
        on_hangup: Callable[[Callable[[], None] | None], None],
        send_now: Callable[[Any], str] | None = None,
    ) -> None:
        """`serve` with no task beside the writer: the source's waits end at
        the keepalive's deadline (it yields an empty burst: the keepalive is
        written) and when the front, which watches the connection, says the
        caller has gone (`quiet.end`: the wait or the write in progress is
        cancelled, the source closed, nothing more sent).

        With the front's `SEND_NOW_EXTENSION` a chunk is written from this
        step; only one the kernel does not take at once is awaited (in the
        cancel scope the caller's going ends). The source's own waits are
        the stream's checkpoints, as they were between two writes."""
        bursts, self.bursts = self.bursts, None  # type: ignore[assignment]
        interval = self.interval
        # The first wait that would block ends at once: the response's status
        # and headers, which the front writes with the first body, go out
        # then (an empty body), not with the first event, which a queued run
        # may not have for hours. A first burst already there takes them along.
        quiet.deadline = trio.current_time()
        head_sent = False
        on_hangup(quiet.end)
        aclose = getattr(bursts, "aclose", None)
        try:
            async for burst in bursts:
                if quiet.gone:
                    break
                if burst:
                    chunk = burst_chunk(burst)
                elif not head_sent:
                    chunk = b""
                elif interval > 0:
                    chunk = KEEPALIVE
                else:
                    continue  # no keepalives (a wait ended early, by someone else)
                del burst  # not held while the next one is awaited
                message = {"type": "http.response.body", "body": chunk, "more_body": True}
                del chunk
                if send_now is None or send_now(message) != SENT:
                    with quiet.waiting(math.inf):
                        await send(message if send_now is None else _FLUSH)
                del message
                head_sent = True
                if quiet.gone:
                    break
                quiet.deadline = trio.current_time() + interval if interval > 0 else math.inf
        finally:
            on_hangup(None)
            if aclose is not None:
                await aclose()
        if not quiet.gone:
            await send(_END)

    async def _watch(self, receive: Receive, send: Send, writer: trio.CancelScope) -> None:
        """Read the request's side until the caller goes (then cancel the
        writer); write a keepalive whenever `interval` passes without a write."""
        interval = self.interval
        while True:
            if not self.wrote and not self.writing:
                # Nothing written yet, nor being written: the source waits.
                # The status and headers go now (an empty body): a server that
                # writes its head with the first body, as funduq's front does,
                # would hold them until the first event, which a queued run
                # may not have for hours.
                self.wrote = True
                await send({"type": "http.response.body", "body": b"", "more_body": True})
                continue
            if interval <= 0:
                deadline = math.inf
            elif self.writing:  # a write in progress (a slow reader): look again later
                deadline = trio.current_time() + interval
            else:
                deadline = self.last_write + interval
            with trio.CancelScope(deadline=deadline):
                message = await receive()
                if message["type"] == "http.disconnect":
                    self.gone = True
                    writer.cancel()
                    return
                continue  # nothing else comes once the body is read
            if not self.writing and trio.current_time() >= self.last_write + interval:
                await send({"type": "http.response.body", "body": KEEPALIVE, "more_body": True})
                self.last_write = trio.current_time()


def serve_streams(app: Any) -> Any:
    """ASGI middleware in front of the quart app: a response made by
    `sse_response` is written here once quart has sent its start (see the
    module's docstring). Every other request and response passes through
    untouched."""

    async def asgi_app(scope: Any, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        stream = await _answer(app, scope, receive, send)
        if stream is not None:
            await stream.serve(receive, send)

    return asgi_app


async def _answer(app: Any, scope: Any, receive: Receive, send: Send) -> SseStream | None:
    """Let quart answer the request; the stream it handed over, if any (None
    also when the caller left meanwhile). Nothing of quart's outlives this."""
    exchange = _Exchange(scope, receive, send)
    scope[STREAM_SLOT] = None
    await app(scope, exchange.receive, exchange.send)
    stream: SseStream | None = scope.pop(STREAM_SLOT, None)
    return None if exchange.gone else stream


class _Exchange:
    """One request's `receive` and `send` as quart sees them: the end of a
    handed-over response is held back (the stream writes it), and a
    disconnect quart read is remembered (the stream is then not served)."""

    __slots__ = ("_scope", "_receive", "_send", "gone")

    def __init__(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        self._scope = scope
        self._receive = receive
        self._send = send
        self.gone = False

    async def receive(self) -> Any:
        message = await self._receive()
        if message["type"] == "http.disconnect":
            self.gone = True
        return message

    async def send(self, message: Any) -> None:
        if (
            message["type"] == "http.response.body"
            and not message.get("more_body", False)
            and self._scope.get(STREAM_SLOT) is not None
        ):
            return  # the handed-over stream ends the response itself
        await self._send(message)
