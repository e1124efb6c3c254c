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
in the queue or thinks. SSE clients ignore comments. A generator cannot be
read with a timeout (cancelling its ``__anext__`` ends it), so the stream's
source is read by a task in the app's nursery and handed over a channel; the
response waits on the channel with the timeout, and closing the response
cancels that task, which closes the source.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from typing import Any

import trio
from quart import Response, current_app

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


def sse_frame(data: Any, event_id: int | None = None) -> bytes:
    """One SSE frame carrying `data` as compact JSON (and `event_id` as its id)."""
    try:
        text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
        if not text.isascii() and ("\x85" in text or "\u2028" in text or "\u2029" in text):
            text = text.translate(_LINE_BREAKERS)
        body = text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: only \u-escaped JSON can carry it
        body = json.dumps(data, separators=(",", ":")).encode("ascii")
    if event_id is None:
        return b"data: " + body + b"\n\n"
    return b"id: %d\ndata: %s\n\n" % (event_id, body)


def _frame(item: Any) -> bytes:
    if isinstance(item, Identified):
        return sse_frame(item.data, item.id)
    return sse_frame(item)


async def sse_frames(bursts: AsyncIterable[list[Any]]) -> AsyncIterator[bytes]:
    """Encode each burst of JSON-able items (or `Identified` ones) as one
    chunk of frames; closing this closes `bursts`."""
    try:
        async for burst in bursts:
            yield b"".join(_frame(item) for item in burst)
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

    The response has no timeout: a stream lasts as long as what it follows
    (Quart's RESPONSE_TIMEOUT would otherwise cut it after 60 s).
    """
    body: AsyncIterator[bytes] = sse_frames(bursts)
    interval = current_app.config.get(KEEPALIVE_CONFIG) or 0
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
