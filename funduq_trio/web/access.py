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
from typing import Any

from ..broker.authority import PROOF_HEADER, Reader

__all__ = ["OPERATOR_COOKIE", "operator_token_of", "is_operator", "reader_of",
           "remember_operator"]

#: The cookie `?token=` sets (HttpOnly, SameSite=Strict, path /).
OPERATOR_COOKIE = "funduq_operator"


def operator_token_of(request: Any, *, from_query: bool = False) -> str | None:
    """The token the request presents (None: none): its bearer header or the
    cookie, and `?token=` only where `from_query` (the operator page's route)."""
    auth = request.headers.get("Authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    if from_query and request.args.get("token"):
        return str(request.args["token"])
    return request.cookies.get(OPERATOR_COOKIE)


def is_operator(funduq: Any, request: Any, *, from_query: bool = False) -> bool:
    """Does the request carry funduq's operator token?"""
    presented = operator_token_of(request, from_query=from_query)
    expected = funduq.operator_token
    return bool(presented and expected) and hmac.compare_digest(
        presented.encode("utf-8", "surrogatepass"), expected.encode("utf-8"))


def reader_of(funduq: Any, request: Any) -> Reader:
    """Who asks to read: the `Funduq-Proof` header and the operator token, as
    the facade's read checks (`Funduq.may_read`, `listing_scope`) take them."""
    return Reader(proof=request.headers.get(PROOF_HEADER), operator=is_operator(funduq, request))


def remember_operator(response: Any, funduq: Any) -> Any:
    """Set the cookie that lets the operator's page make its own requests."""
    response.set_cookie(OPERATOR_COOKIE, funduq.operator_token, httponly=True,
                        samesite="Strict", path="/")
    return response
