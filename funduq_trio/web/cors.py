"""CORS for the doors and the read routes (FUNDUQ_CORS_ORIGINS; off by default).

A browser on an allowed origin may call the A2A and AG-UI doors and read
runs, threads and the roster: preflights (OPTIONS with
Access-Control-Request-Method) are answered 204 here, before any route, and
every response to an allowed origin echoes it in Access-Control-Allow-Origin.
Credentials (cookies) are never allowed cross-origin: the operator's cookie
stays same-site; cross-origin callers prove who they are in headers.
"""

from __future__ import annotations

from typing import Any

from quart import Response, request

__all__ = ["ALLOWED_HEADERS", "EXPOSED_HEADERS", "allowed_origin", "cors_headers", "mount_cors"]

#: What the doors read from a request beyond the CORS-safelisted headers.
ALLOWED_HEADERS = "Content-Type, Authorization, Last-Event-ID, Funduq-Proof, A2A-Version"
#: What a browser script may read from a response.
EXPOSED_HEADERS = "Content-Type, Retry-After, A2A-Version, X-Accel-Buffering"
METHODS = "GET, POST, OPTIONS"
MAX_AGE = "600"


def allowed_origin(origins: frozenset[str], origin: str | None) -> str | None:
    """The Access-Control-Allow-Origin to send for this Origin (None: none)."""
    if not origin:
        return None
    if "*" in origins:
        return "*"
    return origin if origin.rstrip("/") in origins else None


def headers_for(allow: str) -> dict[str, str]:
    headers = {"Access-Control-Allow-Origin": allow}
    if allow != "*":
        headers["Vary"] = "Origin"
    return headers


def cors_headers(allow: str) -> dict[str, str]:
    """The headers every response to an allowed origin carries (`allow`:
    its Access-Control-Allow-Origin)."""
    return {**headers_for(allow), "Access-Control-Expose-Headers": EXPOSED_HEADERS}


def mount_cors(app: Any, origins: frozenset[str] | None) -> None:
    if not origins:
        return

    @app.before_request
    async def preflight() -> Response | None:
        if request.method != "OPTIONS" or "Access-Control-Request-Method" not in request.headers:
            return None
        response = Response("", status=204)
        allow = allowed_origin(origins, request.headers.get("Origin"))
        if allow is not None:  # else no CORS headers: the browser refuses
            response.headers.update(headers_for(allow))
            response.headers["Access-Control-Allow-Methods"] = METHODS
            response.headers["Access-Control-Allow-Headers"] = ALLOWED_HEADERS
            response.headers["Access-Control-Max-Age"] = MAX_AGE
        return response

    @app.after_request
    async def allow_origin(response: Response) -> Response:
        allow = allowed_origin(origins, request.headers.get("Origin"))
        if allow is not None and "Access-Control-Allow-Origin" not in response.headers:
            response.headers.update(cors_headers(allow))
        return response
