"""The doors' run POSTs served straight on ASGI, in front of quart.

A run starts with one POST: `POST /a2a/{provider}/{agent}[/]` (JSON-RPC) or
`POST /agui/{provider}/{agent}` (a RunAgentInput). quart's request machinery
around such a request -- routing, the request and response objects, context
locals, two tasks, one ASGI message per chunk -- cost the server about as
much CPU as the door's own work (bench/README.md, "Where a run's
milliseconds go"). `serve_doors` takes those requests before quart does and
serves them with the same door code (`A2ADoor.answer`, `agui_door.run_post`)
and the same answers: the body read within `max_body_bytes` and
`body_timeout_seconds` (413 or the JSON-RPC "Payload too large", and 408,
each closing the connection), the app's error answers (`exchange.error_answer`,
whose broker rows are `door_errors.DOOR_ANSWERS`), the CORS headers of
`web/cors.py`, JSON as the app's JSON provider writes it, and streams written
by `web/sse.py`'s `SseStream` as `serve_streams` writes them. Every other
request -- other methods and paths, preflights included -- goes to quart.

`GET /healthz` is answered here as well, as the cheapest request the server
serves: it is the unit in which bench/e2e.py prices a run.

A caller that disconnects before its answer stops the door's wait, as
quart's cancelling its handler did: a blocking SendMessage whose caller has
gone stops waiting for its run (the run itself goes on), so a caller that
connects, asks and leaves holds nothing here once it left; a stream notices
the disconnect itself and ends. On a server that says when the caller goes
(the `funduq.hangup` extension: funduq's own front, on Linux) the wait runs
in a cancel scope that the hang-up cancels; elsewhere (hypercorn) a watcher
task beside it reads `receive` for the disconnect. The AG-UI door never waits for a run (its
answer is a stream, or a thread's snapshot), so its POST is answered without
that watch: a task and a nursery less a run, and a caller gone meanwhile is
noticed by its stream as it opens.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge, RequestTimeout

from ..broker.errors import FunduqError
from ..identity import InvalidActorChain
from .a2a_door import A2ADoor, payload_too_large
from .agui_door import run_post
from .cors import allowed_origin, cors_headers
from .exchange import Answer, AsgiRequest, Json, Streamed, error_answer
from .sse import (
    BODY_NOW_EXTENSION,
    HANGUP_EXTENSION,
    SSE_CONTENT_TYPE,
    SSE_HEADERS,
    Receive,
    Send,
    SseStream,
)

log = logging.getLogger("funduq_trio.web")

#: How long the last write of a response that closes its connection may take
#: once shielded (see `web/app.py` `CloseAfterResponse`).
CLOSE_WRITE_SECONDS = 5.0

_JSON_TYPE = (b"content-type", b"application/json")
_SSE_START_HEADERS = [
    (b"content-type", SSE_CONTENT_TYPE.encode()),
    *((name.lower().encode(), value.encode()) for name, value in SSE_HEADERS.items()),
]
_HEALTHZ = {"status": "ok"}


#: What a door raises on purpose: answered without a traceback in the log.
REFUSALS = (HTTPException, FunduqError, InvalidActorChain)


class _Gone(Exception):
    """The caller disconnected before its request's body was all read."""


async def read_body(scope: Any, receive: Receive, limit: int, timeout: float | None) -> bytes:
    """The request's body, as quart reads it: refused at once when its
    Content-Length is over `limit`, else as soon as the bytes read pass it;
    cut when it has not all come within `timeout` seconds."""
    with trio.move_on_after(math.inf if timeout is None else timeout):
        return await _body(scope, receive, limit)
    raise RequestTimeout


async def _body(scope: Any, receive: Receive, limit: int) -> bytes:
    """`read_body` without its timeout (the caller's cancel scope has it)."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            if int(value) > limit:  # h11 has checked it is digits
                raise RequestEntityTooLarge
            break
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _Gone
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise RequestEntityTooLarge
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _read_until_hung_up(
    scope: Any,
    receive: Receive,
    limit: int,
    timeout: float | None,
    on_hangup: Callable[[Callable[[], None] | None], None],
    door: Callable[[bytes], Awaitable[Answer]],
) -> Answer:
    """The body read and the door's answer to it, on a server that says when
    the caller goes (the `HANGUP_EXTENSION`, funduq's front): the door runs
    in a cancel scope that the hang-up cancels, on this task alone -- no
    watcher task, no nursery. The body is read in the same scope, with its
    deadline (`read_body`'s timeout) until it is all read and none after:
    a cancel scope is the dearest part of reading a body (bench/README.md,
    "The doors' own work per run"). The hang-up is watched once the body
    is read. A refusal is raised as it is; `RequestTimeout` when the body
    did not come in time, `_Gone` if the caller went."""
    cancel = trio.CancelScope(
        deadline=math.inf if timeout is None else trio.current_time() + timeout
    )
    watching = False
    body: bytes | None = None
    try:
        with cancel:
            body = await _body(scope, receive, limit)
            # No checkpoint since the last receive. If the deadline passed
            # meanwhile (the body's last bytes came as it expired), the body
            # still counts as read in time, as `read_body` counts it, and the
            # door is answered in a scope of its own (below).
            if not cancel.cancel_called:
                cancel.deadline = math.inf
                on_hangup(cancel.cancel)
                watching = True
                reply = await door(body)
    except Exception:
        if not (watching and cancel.cancel_called):
            raise
        # The door failed on its way out of the cancelled wait: the caller
        # has gone, which is what `_until_gone` says too.
    finally:
        if watching:
            on_hangup(None)
    if not watching:
        if body is None:
            raise RequestTimeout  # the body's deadline passed
        return await _until_hung_up(on_hangup, door, body)
    if cancel.cancel_called:
        raise _Gone
    return reply


async def _until_hung_up(
    on_hangup: Callable[[Callable[[], None] | None], None],
    door: Callable[[bytes], Awaitable[Answer]],
    body: bytes,
) -> Answer:
    """`door`'s answer to `body` (read already) in a cancel scope of its own
    that the hang-up cancels: `_read_until_hung_up` when the body's deadline
    passed just as the body came in."""
    scope = trio.CancelScope()
    on_hangup(scope.cancel)
    try:
        with scope:
            reply = await door(body)
    except Exception:
        if not scope.cancel_called:
            raise
    finally:
        on_hangup(None)
    if scope.cancel_called:
        raise _Gone
    return reply


async def _until_gone(
    receive: Receive, door: Callable[[bytes], Awaitable[Answer]], body: bytes
) -> Answer:
    """`door`'s answer to `body`; `_Gone` if the caller disconnects first
    (the door's wait is cancelled then). The body has all been read, so the
    next ASGI message can only be the disconnect. A task reads `receive`
    beside the door: for servers without the hang-up extension (hypercorn)."""
    gone = False
    refusal: Exception | None = None
    reply: Answer | None = None
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            nonlocal gone
            while (await receive())["type"] != "http.disconnect":
                pass
            gone = True
            nursery.cancel_scope.cancel()

        nursery.start_soon(watch)
        try:
            reply = await door(body)
        except Exception as exc:  # noqa: BLE001 -- raised below as it is, not in a group
            refusal = exc
        nursery.cancel_scope.cancel()
    if gone:
        raise _Gone
    if refusal is not None:
        raise refusal
    assert reply is not None
    return reply


def serve_doors(app: Any, funduq: Any, dumps: Callable[[Any], str]) -> Any:
    """ASGI middleware in front of `app` (the quart app's ASGI callable):
    the doors' run POSTs and `GET /healthz` are answered here (see the
    module's docstring); everything else goes to `app`. `dumps` writes a
    JSON body as the app's JSON provider does."""
    settings = funduq.settings
    limit = settings.max_body_bytes
    timeout = settings.body_timeout_seconds
    keepalive = settings.sse_keepalive_seconds or 0
    origins = settings.cors_origins or None

    def extra_headers(scope: Any) -> list[tuple[bytes, bytes]]:
        """The CORS hook's headers for this request's Origin (none if CORS is off)."""
        if origins is None:
            return []
        origin = None
        for name, value in scope["headers"]:
            if name == b"origin":
                origin = value.decode("latin-1")
                break
        allow = allowed_origin(origins, origin)
        if allow is None:
            return []
        return [(k.lower().encode(), v.encode()) for k, v in cors_headers(allow).items()]

    async def answer_json(scope: Any, send: Send, answer: Json) -> None:
        body = (dumps(answer.payload) + "\n").encode()
        headers = [_JSON_TYPE, (b"content-length", b"%d" % len(body))]
        closing = False
        for name, value in answer.headers.items():
            closing = closing or (name.lower() == "connection" and value.lower() == "close")
            headers.append((name.lower().encode(), value.encode("latin-1")))
        headers += extra_headers(scope)
        await send({"type": "http.response.start", "status": answer.status, "headers": headers})
        last = {"type": "http.response.body", "body": body, "more_body": False}
        if not closing:
            await send(last)
            return
        # The connection closes from inside this send, the body maybe unread:
        # shielded, so the close finishes (see web/app.py CloseAfterResponse).
        with trio.move_on_after(CLOSE_WRITE_SECONDS) as cancel_scope:
            cancel_scope.shield = True
            await send(last)

    async def serve(
        scope: Any,
        receive: Receive,
        send: Send,
        door: Callable[[bytes], Awaitable[Answer]],
        too_large: Callable[[], Json] | None = None,
        *,
        waits: bool = True,
    ) -> Streamed | None:
        """Read the body, let `door` answer it, and write the answer if it is
        JSON; a stream is returned for the caller to serve. A refusal raised
        is answered as the app's error handlers answer it, a body over the
        limit with `too_large()` if given. A door that `waits` (for a run to
        end) is stopped when its caller disconnects meanwhile; one that does
        not is let finish."""
        try:
            extensions = scope.get("extensions") or {}
            on_hangup = extensions.get(HANGUP_EXTENSION) if waits else None
            # The body all at hand (funduq's front, the common POST): taken
            # without a wait, so without the deadline's cancel scope.
            body_now = extensions.get(BODY_NOW_EXTENSION)
            body = None if body_now is None else body_now(limit)
            if on_hangup is not None:
                if body is not None:
                    reply = await _until_hung_up(on_hangup, door, body)
                else:
                    # The body's timeout and the hang-up watch in one scope.
                    reply = await _read_until_hung_up(
                        scope, receive, limit, timeout, on_hangup, door
                    )
            else:
                if body is None:
                    body = await read_body(scope, receive, limit, timeout)
                if not waits:
                    reply = await door(body)
                else:
                    reply = await _until_gone(receive, door, body)
            del body  # not held for as long as a stream lasts
        except _Gone:
            return None
        except RequestEntityTooLarge as exc:
            refusal = error_answer(exc, settings) if too_large is None else too_large()
            await answer_json(scope, send, refusal)
            return None
        except Exception as exc:  # noqa: BLE001 -- answered as the app answers it
            if not isinstance(exc, REFUSALS):
                log.exception("Exception on request %s %s", scope["method"], scope["path"])
            await answer_json(scope, send, error_answer(exc, settings))
            return None
        if isinstance(reply, Json):
            await answer_json(scope, send, reply)
            return None
        return reply

    async def a2a(
        scope: Any, receive: Receive, send: Send, provider: str, agent: str
    ) -> Streamed | None:
        async def door(body: bytes) -> Answer:
            return await A2ADoor(funduq, provider, agent, AsgiRequest(scope)).answer(body)

        return await serve(scope, receive, send, door, payload_too_large)

    async def agui(
        scope: Any, receive: Receive, send: Send, provider: str, agent: str
    ) -> Streamed | None:
        async def door(body: bytes) -> Answer:
            return await run_post(funduq, provider, agent, body, AsgiRequest(scope))

        # It starts a run (or answers a pause) and returns: it never waits
        # for the run, so there is no wait for a disconnect to stop.
        return await serve(scope, receive, send, door, waits=False)

    async def route(scope: Any, receive: Receive, send: Send) -> Streamed | None | bool:
        """Serve a door's POST or /healthz: None once answered, the stream to
        serve if the answer is one, False if the request is not for here."""
        method = scope["method"]
        path = scope["path"]
        if method == "POST":
            parts = path.split("/")
            if len(parts) in (4, 5) and parts[0] == "" and parts[2] and parts[3]:
                door, provider, agent = parts[1], parts[2], parts[3]
                bare = len(parts) == 4  # no trailing slash (the A2A door takes one)
                slash = not bare and parts[4] == ""
                if door == "a2a" and (bare or slash):
                    return await a2a(scope, receive, send, provider, agent)
                if door == "agui" and bare:
                    return await agui(scope, receive, send, provider, agent)
        elif method == "GET" and path == "/healthz":
            await answer_json(scope, send, Json(_HEALTHZ))
            return None
        return False

    async def asgi_app(scope: Any, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        # The door's answer is decided in `route`, whose frames (the door,
        # its request, the body) are gone by the time a stream is served
        # here: only this frame and the stream's wait as long as it lasts.
        stream = await route(scope, receive, send)
        if stream is None:
            return
        if stream is False:
            await app(scope, receive, send)
            return
        assert isinstance(stream, Streamed)
        headers = _SSE_START_HEADERS + extra_headers(scope)
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        serving = SseStream(stream.bursts, keepalive).serve(receive, send, stream.quiet, scope)
        # Nothing of the request is held while the stream waits (hours, if
        # its run is queued): `serving` has taken what it needs of it.
        del headers, scope, stream
        await serving

    #: What is behind this layer (quart, with its own routes for the same
    #: doors): tests compare both ways of serving a request.
    asgi_app.behind = app  # type: ignore[attr-defined]
    return asgi_app
