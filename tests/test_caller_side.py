"""The callers' side of a run without the waits it does not need (each
shortcut held equal to the general path it skips, bench/README.md "The
callers' side of a run"):

- a request body all at hand is handed over by the front
  (`Exchange.body_now`, the `funduq.http.body_now` extension) without the
  read's wait, so the doors take it without the body timeout's cancel scope;
- a quiet follower's wait that would end at once (`Quiet.due`: its deadline
  passed, as a stream's first wait's has, or the caller gone) is not made:
  `Funduq.follow` yields its empty burst without the scope, the trip through
  the scheduler and the `Cancelled`;
- an A2A stream's final status is written from the run's lane, as the
  blocking answer is, once the lane has settled the run (no record read).
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import trio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_front_plain import _PLAIN_POST, _cut, _request, _Scripted

from funduq_trio.front import http as front_http
from funduq_trio.web import asgi_doors, sse

# ------------------------------------------------------- a body at hand


def _serve_bodies(pieces: list[bytes], limit: int, take_now: bool, peek: bool) -> Any:
    """Serve `pieces` (pipelined requests) with an app that reads each
    body as the doors do -- with `body_now` first when `take_now`, then
    `read_body` -- and answers with what it got (when `peek`, after asking
    `receive` once more: a body read is not read again); what the app saw,
    the bytes written, whether the connection was gone."""
    seen: list[Any] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        body_now = scope["extensions"].get(front_http.BODY_NOW_EXTENSION)
        assert body_now is not None
        got: Any = body_now(limit) if take_now else None
        try:
            if got is None:
                got = await asgi_doors.read_body(scope, receive, limit, 30.0)
        except asgi_doors.RequestEntityTooLarge:
            got = "too large"
        except asgi_doors._Gone:
            got = "gone"
        seen.append(got)
        if got == "gone":
            return
        if peek and not seen[1:]:  # the first request's: it reads all that follows
            seen.append(await receive())
        answer = b"413" if got == "too large" else b"%d:%b" % (len(got), got[:8])
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-length", b"%d" % len(answer))],
            }
        )
        await send({"type": "http.response.body", "body": answer, "more_body": False})
        # Whatever receive says next is the same either way.
        with trio.move_on_after(0):
            seen.append((await receive())["type"])

    async def main() -> Any:
        conn = _Scripted(pieces, app)
        await conn.serve()
        return conn

    with (
        mock.patch.object(front_http, "_date", lambda: b"Fri, 04 Dec 2026 10:00:00 GMT"),
        mock.patch.object(front_http.log, "exception"),
    ):
        conn = trio.run(main)
    return seen, b"".join(conn.out), conn.gone


@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(_request(), min_size=1, max_size=3),
    how=st.sampled_from(["whole", "per request", "head and body", "cut"]),
    cuts=st.lists(st.integers(0, 400), max_size=4),
    limit=st.sampled_from([0, 1, 2, 5, 40, 1 << 20]),
    peek=st.booleans(),
)
@example(requests=[_PLAIN_POST, _PLAIN_POST], how="whole", cuts=[], limit=1 << 20, peek=False)
@example(requests=[_PLAIN_POST, _PLAIN_POST], how="whole", cuts=[], limit=1 << 20, peek=True)
@example(requests=[_PLAIN_POST], how="head and body", cuts=[], limit=1 << 20, peek=False)
@example(requests=[_PLAIN_POST], how="whole", cuts=[], limit=1, peek=False)
def test_a_body_taken_at_once_is_the_body_read(
    requests: list[bytes], how: str, cuts: list[int], limit: int, peek: bool
) -> None:
    """Whatever the requests and however their bytes come, an app that
    takes each body with `body_now` first sees what one that reads it sees
    (the body, the refusal, the caller gone, what `receive` says after),
    and the same bytes go back."""
    pieces = _cut(requests, how, cuts)
    assert _serve_bodies(pieces, limit, True, peek) == _serve_bodies(pieces, limit, False, peek)


def test_a_body_at_hand_is_given_once_and_a_long_one_not_at_all() -> None:
    exchange = front_http.Exchange(
        mock.Mock(gone=False), b"POST", b"/a2a/p/a", body=b"{}", body_left=0
    )
    assert exchange.body_now(1) is None  # longer than the limit: left to receive
    assert exchange.body_now(2) == b"{}"
    assert exchange.body_now(2) is None  # taken
    still = front_http.Exchange(mock.Mock(gone=False), b"POST", b"/", body=b"{", body_left=1)
    assert still.body_now(10) is None  # not all here


def test_the_front_and_the_doors_name_the_same_body_extension() -> None:
    assert front_http.BODY_NOW_EXTENSION == sse.BODY_NOW_EXTENSION
