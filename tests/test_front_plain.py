"""The front's own road for plain HTTP/1.1 requests (`front/http.py`
`parse_request`, `_plain_head`, `Exchange`'s plain body and answer) is held
equal to h11's road: hypothesis builds pipelined requests on every edge h11
draws (framing headers, Host, 100-continue, upgrades, HTTP/1.0, HEAD, bad
lines, folded lines, bare newlines, bodies short or long) and answers on
every edge of h11's writer (framing headers, statuses it treats apart, names
and values it refuses, bodies over or under their Content-Length, apps that
fail), cuts the caller's bytes into reads at arbitrary points, and serves
them once as the front does and once with every request read by h11 (its
old road): what the app is given and every byte written back must be equal.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import h11
import pytest
import trio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from funduq_trio.front import http as front_http
from funduq_trio.front.limits import FrontLimits

_DATE = b"Fri, 04 Dec 2026 10:00:00 GMT"


class _Unbound:
    def getsockname(self) -> Any:
        raise OSError


class _Scripted(front_http.Connection):
    """A connection whose reads are `pieces` in turn (then the caller's
    end) and whose writes are kept."""

    def __init__(self, pieces: list[bytes], app: Any, at_hand: list[bool] | None = None) -> None:
        super().__init__(_Unbound(), ("127.0.0.1", 1), app, FrontLimits())  # type: ignore[arg-type]
        self.pieces = list(pieces)
        self.out: list[bytes] = []
        #: Whether each read's bytes are already here when the front looks
        #: for the next request without waiting (`read_now`), in turn.
        self.at_hand = list(at_hand or [])

    async def read(self) -> bytes:
        await trio.lowlevel.checkpoint()
        return self.pieces.pop(0) if self.pieces else b""

    def read_now(self) -> bytes | None:
        if self.at_hand and self.at_hand.pop(0):
            return self.pieces.pop(0) if self.pieces else b""
        return None

    async def read_when_ready(self) -> bytes:
        return await self.read()

    async def write(self, data: bytes) -> None:
        await trio.lowlevel.checkpoint()
        if not self.gone and data:
            self.out.append(data)

    async def _close(self) -> None:
        pass


def _serve(
    pieces: list[bytes],
    answers: list[dict[str, Any]],
    plain: bool,
    at_hand: list[bool] | None = None,
) -> Any:
    """Serve `pieces` with an app answering request i as `answers[i]`; what
    the app saw, the bytes written, whether the connection was gone.
    `at_hand`: which of the reads for a next request find their bytes
    already there (read without a wait, so outside the idle bound's scope)."""
    seen: list[Any] = []

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        answer = answers[len(seen) % len(answers)]
        record: dict[str, Any] = {
            k: scope[k]
            for k in ("type", "http_version", "method", "path", "raw_path", "query_string")
        }
        record["headers"] = [tuple(h) for h in scope["headers"]]
        seen.append(record)
        body = []
        for _ in range(answer["reads"]):
            message = await receive()
            body.append(message.get("body", b""))
            record.setdefault("kinds", []).append(message["type"])
            if message["type"] == "http.disconnect" or not message.get("more_body"):
                break
        record["body"] = b"".join(body)
        if answer["fail"] == "before":
            raise RuntimeError("the app fails before answering")
        if answer["fail"] == "silent":
            return
        await send(
            {
                "type": "http.response.start",
                "status": answer["status"],
                "headers": answer["headers"],
            }
        )
        if answer["fail"] == "after start":
            raise RuntimeError("the app fails after its start")
        parts = answer["parts"]
        for i, part in enumerate(parts):
            await send(
                {"type": "http.response.body", "body": part, "more_body": i < len(parts) - 1}
            )
        if answer["fail"] == "after":
            raise RuntimeError("the app fails after answering")

    async def main() -> Any:
        conn = _Scripted(pieces, app, at_hand)
        await conn.serve()
        return conn

    real_parse = front_http.parse_request
    with (
        mock.patch.object(front_http, "_date", lambda: _DATE),
        mock.patch.object(
            front_http, "parse_request", real_parse if plain else (lambda *args: None)
        ),
        mock.patch.object(front_http.log, "exception"),
    ):
        conn = trio.run(main)
    return seen, b"".join(conn.out), conn.gone


# ------------------------------------------------------------------ requests
# Each part of a request or an answer is mostly the plain one (so that most
# examples sit on the plain road or one step off it), else one of the edges.


def _mostly(plain: Any, *edges: Any) -> Any:
    return st.sampled_from([plain] * (2 * len(edges) + 2) + list(edges))


_methods = _mostly(b"POST", b"GET", b"PUT", b"HEAD", b"CONNECT", b"DeLeTe", b"B@D", b"")
_targets = _mostly(
    b"/a2a/p/a", b"/", b"/x?y=1&z=%20", b"/%E2%82%AC?", b"*", b"/a b", b"/\x7f", b"/\xc3\xa9"
)
_versions = _mostly(b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"http/1.1")
_framings = _mostly(
    "length", "none", "short", "long", "two equal", "two unequal", "plus", "spaced", "comma",
    "chunked", "chunked bad", "huge",
)  # fmt: skip
_extras = st.lists(
    st.one_of(
        st.tuples(
            _mostly(b"content-type", b"X-Custom", b"bad name", b"x:y", b"", b" folded", b"\tf"),
            _mostly(b": ", b":", b" : ", b":\t"),
            _mostly(b"application/json", b"", b" padded ", b"a  b", b"\x01", b"\x00", b"\xff"),
        ).map(b"".join),
        st.sampled_from(
            [
                b"Connection: close",
                b"connection: keep-alive",
                b"Connection: Close",
                b"connection: upgrade",
                b"connection: closed",
                b"connection: keep-alive, close",
                b"expect: 100-continue",
                b"expect: other",
                b"upgrade: h2c",
                b"no colon",
                b"x: a\rb",
                b"Host: again",
            ]
        ),
    ),
    max_size=2,
)


@st.composite
def _request(draw: Any) -> bytes:
    body = draw(st.binary(max_size=40))
    headers = [b"host: 127.0.0.1:8000"] * draw(_mostly(1, 0, 2))
    framing = draw(_framings)
    if framing == "length":
        headers.append(b"content-length: %d" % len(body))
    elif framing == "none":
        body = b""
    elif framing == "short":  # the caller ends before its body does
        headers.append(b"content-length: %d" % (len(body) + 5))
    elif framing == "long":  # bytes past the body: the next request's (garbage)
        headers.append(b"content-length: %d" % max(0, len(body) - 3))
    elif framing == "two equal":
        headers += [b"content-length: %d" % len(body)] * 2
    elif framing == "two unequal":
        headers += [b"content-length: %d" % len(body), b"content-length: %d" % (len(body) + 1)]
    elif framing == "plus":
        headers.append(b"content-length: +%d" % len(body))
    elif framing == "spaced":
        headers.append(b"Content-Length:   %d  " % len(body))
    elif framing == "comma":
        headers.append(b"content-length: %d, %d" % (len(body), len(body)))
    elif framing == "chunked":
        headers.append(b"transfer-encoding: chunked")
        body = (b"%x\r\n%b\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
    elif framing == "chunked bad":
        headers.append(b"Transfer-Encoding: chunked")
    else:
        headers.append(b"content-length: 1" + b"0" * 20)
    headers += draw(_extras)
    order = draw(st.permutations(headers))
    newline = draw(_mostly(b"\r\n", b"\n"))
    head = draw(_methods) + b" " + draw(_targets) + b" " + draw(_versions) + newline
    head += b"".join(h + newline for h in order) + newline
    return head + body


_header = st.one_of(
    st.sampled_from(
        [
            (b"content-type", b"text/event-stream"),
            (b"Cache-Control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            (b"content-type", b"text/event-stream"),
            (b"Cache-Control", b"no-cache"),
            (b"x-accel-buffering", b"no"),
            (b"x-odd", b" padded"),
            (b"x-odd", b"a\r\nb"),
            (b"bad name", b"x"),
            (b"x-empty", b""),
            (b"transfer-encoding", b"chunked"),
            (b"Transfer-Encoding", b"gzip"),
            (b"connection", b"close"),
            (b"Connection", b"keep-alive"),
            (b"host", b"example.org"),
            (b"date", b"yesterday"),
            ("x-str", "text"),
            (b"content-length", b"+1"),
        ]
    ),
    st.tuples(st.sampled_from([b"x-a", b"X-B"]), st.binary(max_size=4)),
)


@st.composite
def _answer(draw: Any) -> dict[str, Any]:
    parts = draw(st.lists(st.binary(max_size=12), min_size=1, max_size=3))
    headers = draw(st.lists(_header, max_size=3))
    length = draw(_mostly("none", "right", "right", "wrong", "two"))
    total = sum(len(p) for p in parts)
    if length == "right":
        headers.append((b"Content-Length", b"%d" % total))
    elif length == "wrong":
        headers.append((b"content-length", b"%d" % (total + draw(st.sampled_from([-1, 1])))))
    elif length == "two":
        headers += [(b"content-length", b"%d" % total)] * 2
    return {
        "status": draw(_mostly(200, 201, 204, 304, 404, 500, 599, 600, 100, True)),
        "headers": draw(st.permutations(headers)),
        "parts": parts,
        "reads": draw(_mostly(1, 0, 3)),
        "fail": draw(_mostly(None, "before", "after start", "silent", "after")),
    }


def _cut(requests: list[bytes], how: str, cuts: list[int]) -> list[bytes]:
    """The caller's bytes as reads: all in one, one a request, a head and its
    body apart (as the lean caller writes them), or cut at `cuts`."""
    if how == "whole":
        return [b"".join(requests)]
    if how == "per request":
        return requests
    if how == "head and body":
        pieces = []
        for r in requests:
            end = r.find(b"\r\n\r\n") + 4 or len(r)
            pieces += [r[:end], r[end:]]
        return [p for p in pieces if p]
    data = b"".join(requests)
    points = sorted({c % (len(data) + 1) for c in cuts})
    pieces, last = [], 0
    for p in points:
        if p > last:
            pieces.append(data[last:p])
            last = p
    pieces.append(data[last:])
    return [p for p in pieces if p]


_PLAIN_POST = (
    b"POST /a2a/p/a HTTP/1.1\r\nhost: h\r\ncontent-length: 2\r\n"
    b"content-type: application/json\r\n\r\n{}"
)
_SSE = {
    "status": 200,
    "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
    "parts": [b"", b"data: {}\n\n", b""],
    "reads": 1,
    "fail": None,
}


@settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    requests=st.lists(_request(), min_size=1, max_size=3),
    answers=st.lists(_answer(), min_size=1, max_size=3),
    how=st.sampled_from(["whole", "per request", "head and body", "cut"]),
    cuts=st.lists(st.integers(0, 400), max_size=4),
    at_hand=st.lists(st.booleans(), max_size=6),
)
@example(requests=[_PLAIN_POST, _PLAIN_POST], answers=[_SSE], how="whole", cuts=[], at_hand=[])
@example(requests=[_PLAIN_POST, _PLAIN_POST], answers=[_SSE], how="cut", cuts=[60, 120], at_hand=[])
@example(
    requests=[_PLAIN_POST, _PLAIN_POST],
    answers=[_SSE],
    how="cut",
    cuts=[20, 60, 120],
    at_hand=[True, True, True],
)
def test_plain_road_equals_h11(
    requests: list[bytes],
    answers: list[dict[str, Any]],
    how: str,
    cuts: list[int],
    at_hand: list[bool],
) -> None:
    """The plain road serves what h11's does; and a next request's bytes
    read at once (no wait, so no idle bound's scope) serve what the same
    bytes read after a wait do, on either road."""
    pieces = _cut(requests, how, cuts)
    reference = _serve(pieces, answers, plain=False)
    assert _serve(pieces, answers, plain=True) == reference
    assert _serve(pieces, answers, plain=True, at_hand=at_hand) == reference
    assert _serve(pieces, answers, plain=False, at_hand=at_hand) == reference


def test_the_common_request_takes_the_plain_road() -> None:
    """A door's run POST and its SSE answer never reach h11 (a regression to
    the slow road would pass the equality test), also when its body comes in
    a read of its own (the lean caller writes head and body apart)."""
    called: list[str] = []
    real_next, real_send = h11.Connection.next_event, h11.Connection.send

    def next_event(self: h11.Connection) -> Any:
        called.append("next_event")
        return real_next(self)

    def send(self: h11.Connection, event: Any) -> Any:
        called.append("send")
        return real_send(self, event)

    with (
        mock.patch.object(h11.Connection, "next_event", next_event),
        mock.patch.object(h11.Connection, "send", send),
    ):
        cut = _PLAIN_POST.index(b"\r\n\r\n") + 4
        pieces = [_PLAIN_POST, _PLAIN_POST[:cut], _PLAIN_POST[cut:]]
        for at_hand in ([], [True, True, True, True]):
            called.clear()
            seen, out, gone = _serve(pieces, [_SSE], True, at_hand)
            assert [r["body"] for r in seen] == [b"{}", b"{}"]
            assert out.count(b"HTTP/1.1 200 \r\n") == 2
            assert out.endswith(b"a\r\ndata: {}\n\n\r\n0\r\n\r\n")
            # Only the caller's end, after the two requests, is h11's to read.
            assert called == ["next_event"]


def test_plain_answer_bytes() -> None:
    """The plain road's bytes, written out: what h11 writes for them."""
    seen, out, gone = _serve([_PLAIN_POST], [_SSE], True)
    assert out == (
        b"HTTP/1.1 200 \r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
        b"date: " + _DATE + b"\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"a\r\ndata: {}\n\n\r\n0\r\n\r\n"
    )
    json_answer = {
        "status": 404,
        "headers": [(b"content-type", b"application/json"), (b"content-length", b"2")],
        "parts": [b"{}"],
        "reads": 1,
        "fail": None,
    }
    assert _serve([_PLAIN_POST], [json_answer], True)[1] == (
        b"HTTP/1.1 404 \r\ncontent-type: application/json\r\ncontent-length: 2\r\n"
        b"date: " + _DATE + b"\r\n\r\n{}"
    )


@pytest.mark.parametrize(
    "head",
    [
        b"GET / HTTP/1.1\r\nhost: a\r\nx: " + b"v" * 9000 + b"\r\n\r\n",
        b"GET / HTTP/1.1\r\nhost: a\r\n" + b"x: y\r\n" * 3000 + b"\r\n",
    ],
)
def test_large_heads_are_h11s(head: bytes) -> None:
    """A head over half the bound is h11's to read (and to refuse, 431, over
    the bound)."""
    bound = FrontLimits().max_header_bytes
    assert front_http.parse_request(head, bound >> 1) is None
    plain = _serve([head], [_SSE], True)
    assert plain == _serve([head], [_SSE], False)
    status = plain[1].split(b"\r\n")[0]
    assert status == (b"HTTP/1.1 431 " if len(head) > bound else b"HTTP/1.1 200 ")
