"""`text/event-stream` responses for the doors (AG-UI, A2A streaming).

One event is one frame: ``data: <compact JSON>\\n\\n``. JSON never contains a raw
newline, so every event is exactly one ``data:`` line. A stream's source
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
                yield [event for _seq, event in burst]

    return sse_response(bursts())

Everything that can fail with a status code (404, 429, ...) must be decided
*before* returning ``sse_response``: once the stream starts the status is 200.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from typing import Any

from quart import Response

SSE_CONTENT_TYPE = "text/event-stream"

SSE_HEADERS = {
    "Cache-Control": "no-cache",
    # Tell buffering reverse proxies (nginx) to pass frames through as produced.
    "X-Accel-Buffering": "no",
}


def sse_frame(data: Any) -> bytes:
    """One SSE frame carrying `data` as compact JSON."""
    try:
        body = json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: only \u-escaped JSON can carry it
        body = json.dumps(data, separators=(",", ":")).encode("ascii")
    return b"data: " + body + b"\n\n"


async def sse_frames(bursts: AsyncIterable[list[Any]]) -> AsyncIterator[bytes]:
    """Encode each burst of JSON-able items as one chunk of frames; closing
    this closes `bursts`."""
    try:
        async for burst in bursts:
            yield b"".join(sse_frame(event) for event in burst)
    finally:
        aclose = getattr(bursts, "aclose", None)
        if aclose is not None:
            await aclose()


def sse_response(
    bursts: AsyncIterable[list[Any]],
    *,
    status: int = 200,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """A streaming `text/event-stream` response relaying `bursts` (lists of
    JSON-able items, each written as one chunk).

    The response has no timeout: a stream lasts as long as what it follows
    (Quart's RESPONSE_TIMEOUT would otherwise cut it after 60 s).
    """
    response = Response(
        sse_frames(bursts),
        status=status,
        content_type=SSE_CONTENT_TYPE,
        headers={**SSE_HEADERS, **(headers or {})},
    )
    response.timeout = None
    return response
