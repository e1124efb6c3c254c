"""What a door reads of a request and what it answers, apart from how it is served.

The doors' POST routes are served two ways: by quart (an app that mounts the
doors itself) and, in funduq's own app, straight on ASGI by `web/asgi_doors.py`
(quart's request machinery costs about as much CPU as the rest of a run,
bench/README.md). Both hand a door the same things -- the body's bytes and a
request object with `headers`, `cookies`, `args` and `mimetype` (quart's own
`request`, or `AsgiRequest` here) -- and take back an `Answer`: `Json` or
`Streamed`. The error answers of the app (`error_answer`) are written here
once for both, from the one table in `web/door_errors.py`.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterable
from dataclasses import dataclass, field
from typing import Any

from quart import jsonify
from werkzeug.exceptions import (
    HTTPException,
    InternalServerError,
    RequestEntityTooLarge,
    RequestTimeout,
)
from werkzeug.sansio.http import parse_cookie

from ..broker import errors
from ..broker.quiet import Quiet
from ..identity import InvalidActorChain
from .door_errors import door_answer
from .sse import sse_response

__all__ = [
    "Answer",
    "AsgiRequest",
    "Json",
    "Streamed",
    "error_answer",
    "error_body",
    "quart_response",
]


@dataclass(slots=True)
class Json:
    """A JSON answer: `payload` with `status` and extra `headers`."""

    payload: Any
    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)


@dataclass(slots=True)
class Streamed:
    """An SSE answer (status 200): `bursts` as `web/sse.py` writes them."""

    bursts: AsyncIterable[list[Any]]
    #: The `broker/quiet.py` the source waits in, if it takes one: the
    #: stream is then served on one task (`web/sse.py` `SseStream.serve`).
    quiet: Quiet | None = None


Answer = Json | Streamed


def quart_response(answer: Answer) -> Any:
    """`answer` as a quart response (inside a quart request)."""
    if isinstance(answer, Streamed):
        return sse_response(answer.bursts)
    response = jsonify(answer.payload)
    response.status_code = answer.status
    for name, value in answer.headers.items():
        response.headers[name] = value
    return response


def error_body(status: int, code: str, message: str, details: Any = None) -> dict[str, Any]:
    error: dict[str, Any] = {"status": status, "code": code, "message": message}
    if details is not None:
        error["details"] = details
    return {"error": error}


def _snake(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def error_answer(exc: BaseException, settings: Any) -> Json:
    """The app's JSON answer to an exception a route raised (web/app.py's
    error policy): an HTTP error keeps its status, a broker error answers by
    its row in `DOOR_ANSWERS`; anything else is a 500 (the caller logs it)."""
    if isinstance(exc, errors.FunduqError | InvalidActorChain):
        answer = door_answer(exc)
        message = str(exc) or (type(exc).__doc__ or answer.code).strip()
        return Json(
            error_body(answer.http_status, answer.code, message, getattr(exc, "details", None)),
            answer.http_status,
        )
    if not isinstance(exc, HTTPException):
        exc = InternalServerError()
    status = exc.code or 500
    headers: dict[str, str] = {}
    if isinstance(exc, RequestEntityTooLarge):
        code = "body_too_large"
        message = (
            f"request body exceeds the limit of {settings.max_body_bytes} bytes "
            "(FUNDUQ_MAX_BODY_BYTES)"
        )
    elif isinstance(exc, RequestTimeout):
        code = "body_timeout"
        message = (
            f"request body not received within {settings.body_timeout_seconds:g} s "
            "(FUNDUQ_BODY_TIMEOUT_SECONDS)"
        )
    else:
        code = getattr(exc, "error_code", None) or _snake(exc.name)
        message = exc.description or exc.name
    for name, value in exc.get_headers():
        if name.lower() != "content-type":
            headers[name] = value
    if isinstance(exc, RequestEntityTooLarge | RequestTimeout):
        # The body is left unread (or still trickles in): on a keep-alive
        # connection the server would wait for, or misread, the rest of it.
        headers["Connection"] = "close"
    return Json(error_body(status, code, message, getattr(exc, "details", None)), status, headers)


class _Headers(dict[str, str]):
    """A request's headers by lowercased name (repeated ones joined by ", ")."""

    def get(self, name: str, default: Any = None) -> Any:  # type: ignore[override]
        return dict.get(self, name.lower(), default)

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and dict.__contains__(self, name.lower())

    def __getitem__(self, name: str) -> str:
        return dict.__getitem__(self, name.lower())


def _joined(pairs: Any) -> _Headers:
    """ASGI header pairs by name, a repeated one's values joined as werkzeug
    joins them."""
    headers = _Headers()
    for raw_name, raw_value in pairs:
        name = raw_name.decode("latin-1").lower()
        value = raw_value.decode("latin-1")
        if dict.__contains__(headers, name):
            separator = "; " if name == "cookie" else ", "
            value = dict.__getitem__(headers, name) + separator + value
        dict.__setitem__(headers, name, value)
    return headers


class AsgiRequest:
    """What a door reads of an HTTP request, from its ASGI scope: the parts of
    quart's `request` the doors' POST routes use (headers, cookies, the
    media type), cookies decoded only when asked for."""

    __slots__ = ("scope", "headers", "_cookies")

    def __init__(self, scope: dict[str, Any]) -> None:
        self.scope = scope
        pairs = scope["headers"]
        if type(pairs) is not list:
            pairs = list(pairs)  # an iterable of pairs (ASGI): read once
        headers = _Headers(
            (raw_name.decode("latin-1").lower(), raw_value.decode("latin-1"))
            for raw_name, raw_value in pairs
        )
        if len(headers) != len(pairs):  # a name repeated: read again, joining
            headers = _joined(pairs)
        self.headers = headers
        self._cookies: Any = None

    @property
    def mimetype(self) -> str:
        content_type = self.headers.get("content-type", "")
        return str(content_type.split(";", 1)[0].strip().lower())

    @property
    def cookies(self) -> Any:
        if self._cookies is None:
            self._cookies = parse_cookie(self.headers.get("cookie"))
        return self._cookies
