"""Who is asking, as far as the web layer can tell: the operator (DESIGN §8).

The operator sees everything: unscoped listings and the operator's page.
They prove it with funduq's operator token, in `Authorization: Bearer …`,
or in `?token=` once on the operator page's own route (a page opened from the
start banner's URL), which sets a cookie so the page's own requests carry it.
`?token=` counts nowhere else: a token in a URL leaks into proxy logs and
Referer headers, so no API route invites it there. Compared in constant
time; a wrong or missing token is simply "not the operator".
"""

from __future__ import annotations

import hmac
from collections.abc import Mapping
from typing import Any

from ..broker.authority import PROOF_HEADER, Reader

__all__ = [
    "OPERATOR_COOKIE",
    "bearer_of",
    "is_operator",
    "of_agent",
    "operator_token_of",
    "reader_of",
    "remember_operator",
]

#: The cookie `?token=` sets (HttpOnly, SameSite=Strict, path /).
OPERATOR_COOKIE = "funduq_operator"


def bearer_of(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer ...` header (None: not one)."""
    if header is None or header[:7].lower() != "bearer ":
        return None
    return header[7:].strip()


def operator_token_of(request: Any, *, from_query: bool = False) -> str | None:
    """The token the request presents (None: none): its bearer header or the
    cookie, and `?token=` only where `from_query` (the operator page's route)."""
    bearer = bearer_of(request.headers.get("Authorization"))
    if bearer is not None:
        return bearer
    if from_query and request.args.get("token"):
        return str(request.args["token"])
    return request.cookies.get(OPERATOR_COOKIE)


def of_agent(record: Mapping[str, Any] | None, key: str, fingerprint: str, name: str) -> bool:
    """Is the run or thread `record` one of agent `name` of the provider with
    public key `key` (named by it or by its `fingerprint`)?"""
    if record is None:
        return False
    agent = record.get("agent") or {}
    return agent.get("name") == name and agent.get("provider") in (key, fingerprint)


def is_operator(funduq: Any, request: Any, *, from_query: bool = False) -> bool:
    """Does the request carry funduq's operator token?"""
    presented = operator_token_of(request, from_query=from_query)
    expected = funduq.operator_token
    return bool(presented and expected) and hmac.compare_digest(
        presented.encode("utf-8", "surrogatepass"), expected.encode("utf-8")
    )


def reader_of(funduq: Any, request: Any) -> Reader:
    """Who asks to read: the `Funduq-Proof` header and the operator token, as
    the facade's read checks (`Funduq.may_read`, `listing_scope`) take them."""
    return Reader(proof=request.headers.get(PROOF_HEADER), operator=is_operator(funduq, request))


def remember_operator(response: Any, funduq: Any) -> Any:
    """Set the cookie that lets the operator's page make its own requests."""
    response.set_cookie(
        OPERATOR_COOKIE, funduq.operator_token, httponly=True, samesite="Strict", path="/"
    )
    return response
