"""The quart-trio app: every route of DESIGN §5 on one port, wired to the facade.

Error policy (one place for the whole app): every error is JSON, never an HTML
page. The body is ``{"error": {"status", "code", "message"[, "details"]}}``.

- HTTP errors (unknown route 404, wrong method 405, body over
  ``max_body_bytes`` 413, a door's own 400s) keep their status; ``code`` is the
  exception's ``error_code`` attribute if it has one, else its snake-cased name.
- A broker error (`FunduqError`) escaping a handler maps by class, see
  `BROKER_ERROR_STATUS`: unknown ids 404, refused input 400, full thread 429,
  missing authority 403, a run in the wrong state 409.
- Anything else is logged and answered 500.
"""

from __future__ import annotations

import re
from typing import Any

from quart import Response, jsonify
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from ..broker import errors
from ..broker.funduq import Funduq
from ..identity import InvalidActorChain
from .a2a_door import mount_a2a_door
from .agui_door import mount_agui_door
from .cors import mount_cors
from .operator import mount_operator_page
from .provider_socket import mount_provider_socket
from .reads import mount_reads

# Broker error class name -> (HTTP status, error code). Looked up along the
# exception's MRO, so a subclass the broker adds later inherits its parent's.
BROKER_ERROR_STATUS: dict[str, tuple[int, str]] = {
    "AgentNotFound": (404, "agent_not_found"),
    "UnknownThread": (404, "thread_not_found"),
    "RunNotFound": (404, "run_not_found"),
    "InvalidRunInput": (400, "invalid_run_input"),
    "ThreadQueueFull": (429, "thread_queue_full"),
    "NotAuthorized": (403, "not_authorized"),
    "InvalidActorChain": (403, "invalid_actor_chain"),
    "RunNotCancellable": (409, "run_not_cancellable"),
    "RunNotPaused": (409, "run_not_paused"),
    "FunduqError": (400, "bad_request"),
}


def error_body(
    status: int, code: str, message: str, details: Any = None
) -> dict[str, Any]:
    error: dict[str, Any] = {"status": status, "code": code, "message": message}
    if details is not None:
        error["details"] = details
    return {"error": error}


def json_error(status: int, code: str, message: str, details: Any = None) -> Response:
    """A JSON error response (for handlers that answer an error without raising)."""
    response = jsonify(error_body(status, code, message, details))
    response.status_code = status
    return response


def _snake(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def create_app(funduq: Funduq) -> QuartTrio:
    settings = funduq.settings
    app = QuartTrio("funduq_trio")
    app.config.update(
        # Bodies over the limit are refused 413 as soon as a handler reads them
        # (at once when Content-Length says so, else when the limit is passed).
        MAX_CONTENT_LENGTH=settings.max_body_bytes,
        # Streams (SSE) last as long as the run they follow: no response timeout.
        RESPONSE_TIMEOUT=None,
        PROPAGATE_EXCEPTIONS=False,
    )
    app.json.sort_keys = False  # keep the shapes' own key order
    # ensure_ascii stays on: a body may carry lone surrogates ("\ud800" is valid
    # JSON), which only escaped output can echo back without failing to encode.
    app.extensions["funduq"] = funduq

    @app.errorhandler(HTTPException)
    async def http_error(exc: HTTPException) -> Response:
        status = exc.code or 500
        if isinstance(exc, RequestEntityTooLarge):
            code = "body_too_large"
            message = (
                f"request body exceeds the limit of {settings.max_body_bytes} bytes "
                "(FUNDUQ_MAX_BODY_BYTES)"
            )
        else:
            code = getattr(exc, "error_code", None) or _snake(exc.name)
            message = exc.description or exc.name
        response = json_error(status, code, message, getattr(exc, "details", None))
        for name, value in exc.get_headers():
            if name.lower() != "content-type":
                response.headers[name] = value
        return response

    @app.errorhandler(errors.FunduqError)
    async def broker_error(exc: errors.FunduqError) -> Response:
        status, code = 400, "bad_request"
        for cls in type(exc).__mro__:
            if cls.__name__ in BROKER_ERROR_STATUS:
                status, code = BROKER_ERROR_STATUS[cls.__name__]
                break
        message = str(exc) or (type(exc).__doc__ or code).strip()
        return json_error(status, code, message, getattr(exc, "details", None))

    @app.errorhandler(InvalidActorChain)
    async def bad_actor_chain(exc: InvalidActorChain) -> Response:
        return json_error(403, "invalid_actor_chain", str(exc))

    mount_cors(app, settings.cors_origins)
    mount_reads(app, funduq)
    mount_operator_page(app, funduq)
    mount_a2a_door(app, funduq)
    mount_agui_door(app, funduq)
    mount_provider_socket(app, funduq)
    return app
