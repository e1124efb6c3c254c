"""The quart-trio app: every route of DESIGN §5 on one port, wired to the facade.

Error policy (one place for the whole app): every error is JSON, never an HTML
page. The body is ``{"error": {"status", "code", "message"[, "details"]}}``.

- HTTP errors (unknown route 404, wrong method 405, body over
  ``max_body_bytes`` 413 -- which also closes the connection, its body left
  unread -- a door's own 400s) keep their status; ``code`` is the
  exception's ``error_code`` attribute if it has one, else its snake-cased name.
- A broker error (`FunduqError`) escaping a handler maps by class, see
  `web/door_errors.py` `DOOR_ANSWERS`: unknown ids 404, refused input 400,
  full thread 429, missing authority 403, a run in the wrong state 409, a
  record that cannot write or funduq's own queue bounds reached 503
  (docs/limits.md).
- Anything else is logged and answered 500.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio
from quart import Response, jsonify
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

from ..broker import errors
from ..broker.funduq import Funduq
from ..identity import InvalidActorChain
from .a2a_door import mount_a2a_door
from .agui_door import mount_agui_door
from .asgi_doors import serve_doors
from .cluster_route import mount_cluster_route
from .cors import mount_cors
from .exchange import error_answer, error_body, quart_response
from .kyok import mount_kyok
from .operator import mount_operator_page
from .provider_socket import mount_provider_socket
from .reads import mount_reads
from .sse import compact_encoder, serve_streams


def json_error(status: int, code: str, message: str, details: Any = None) -> Response:
    """A JSON error response (for handlers that answer an error without raising)."""
    response = jsonify(error_body(status, code, message, details))
    response.status_code = status
    return response


def close_after(response: Response) -> Response:
    """Close the connection once `response` is sent. For a refusal that leaves
    the request's body unread (too large): on a keep-alive connection the
    server would otherwise wait for, or misread, the rest of that body and the
    connection wedges."""
    response.headers["Connection"] = "close"
    return response


#: How long the last write of a closing response may take once shielded (a
#: safety net: it is a memory-channel hand-off and a socket shutdown).
CLOSE_WRITE_SECONDS = 5.0


class CloseAfterResponse:
    """ASGI middleware: a response's last write is shielded, so a response
    that closes its connection really closes it.

    A refusal sent while the request's body is unread (a 413, 408 or 405)
    races quart-trio's own end of the request, which cancels the task doing
    the send: a write cut half way would leave the caller without its
    answer (the front then drops the connection). Shielding that last send
    (for at most CLOSE_WRITE_SECONDS) lets it be written whole; the front
    closes the connection after it (``Connection: close``, or the body not
    all read). Any server that writes from inside `send` gains the same.
    """

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return

        async def shielded_last_send(message: Any) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                with trio.move_on_after(CLOSE_WRITE_SECONDS) as cancel_scope:
                    cancel_scope.shield = True
                    await send(message)
                return
            await send(message)

        await self.app(scope, receive, shielded_last_send)


def create_app(funduq: Funduq) -> QuartTrio:
    settings = funduq.settings
    app = QuartTrio("funduq_trio")
    app.config.update(
        # Bodies over the limit are refused 413 as soon as a handler reads them
        # (at once when Content-Length says so, else when the limit is passed).
        MAX_CONTENT_LENGTH=settings.max_body_bytes,
        # A body not all received by then is cut: 408 (docs/limits.md).
        BODY_TIMEOUT=settings.body_timeout_seconds,
        # Streams (SSE) last as long as the run they follow: no response timeout.
        RESPONSE_TIMEOUT=None,
        PROPAGATE_EXCEPTIONS=False,
        # Read by web/sse.py: a silent stream's keepalive comment.
        SSE_KEEPALIVE_SECONDS=settings.sse_keepalive_seconds,
    )
    app.json.sort_keys = False  # keep the shapes' own key order
    # ensure_ascii stays on: a body may carry lone surrogates ("\ud800" is valid
    # JSON), which only escaped output can echo back without failing to encode.
    app.extensions["funduq"] = funduq
    app.asgi_app = CloseAfterResponse(app.asgi_app)  # type: ignore[method-assign]

    @app.errorhandler(HTTPException)
    @app.errorhandler(errors.FunduqError)
    @app.errorhandler(InvalidActorChain)
    async def error(exc: Exception) -> Response:
        response: Response = quart_response(error_answer(exc, settings))
        return response

    mount_cors(app, settings.cors_origins)
    mount_reads(app, funduq)
    mount_operator_page(app, funduq)
    mount_a2a_door(app, funduq)
    mount_agui_door(app, funduq)
    mount_provider_socket(app, funduq)
    mount_kyok(app, funduq)
    mount_cluster_route(app, funduq)

    # Outermost: SSE streams are written by serve_streams once quart (and every
    # layer above it, CloseAfterResponse and the provider link's router) has
    # answered, so none of their frames waits as long as a stream (web/sse.py).
    # Nobody cancels that writer during its last send: CloseAfterResponse's
    # shield is for quart's responses.
    app.asgi_app = serve_streams(app.asgi_app)
    # In front of all: the doors' run POSTs and /healthz, served without
    # quart (web/asgi_doors.py); it writes their streams itself.
    app.asgi_app = serve_doors(app.asgi_app, funduq, compact_dumps(app))
    return app


def compact_dumps(app: Any) -> Callable[[Any], str]:
    """`app.json.dumps(payload, separators=(",", ":"))` with the encoder made
    once: `json.dumps` with any option builds a `JSONEncoder` for each call,
    and every door answer is one (tests/test_asgi_doors.py holds them equal)."""
    provider = app.json
    return compact_encoder(
        default=provider.default,
        ensure_ascii=provider.ensure_ascii,
        sort_keys=provider.sort_keys,
    )
