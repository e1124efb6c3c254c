"""`web/sse.py` `sse_frame` with its encoders made once is held equal to the
`json.dumps` calls it replaced, for JSON values of every kind (non-ASCII,
lone surrogates, the characters other line readers split on)."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from funduq_trio.web import sse

_text = st.one_of(
    st.text(max_size=8),
    st.sampled_from(["é", "\u2028", "\x85", "a\u2029b", "\ud800", "\n", '"', "\\"]),
)
_values = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=True), _text),
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(_text, inner, max_size=3)),
    max_leaves=8,
)


def _old_frame(data: Any, event_id: int | None) -> bytes:
    try:
        text = json.dumps(data, separators=(",", ":"), ensure_ascii=False)
        if not text.isascii() and ("\x85" in text or "\u2028" in text or "\u2029" in text):
            text = text.translate(sse._LINE_BREAKERS)
        body = text.encode("utf-8")
    except UnicodeEncodeError:
        body = json.dumps(data, separators=(",", ":")).encode("ascii")
    if event_id is None:
        return b"data: " + body + b"\n\n"
    return b"id: %d\ndata: %s\n\n" % (event_id, body)


@settings(max_examples=400, deadline=None)
@given(data=_values, event_id=st.one_of(st.none(), st.integers(0, 2**53)))
def test_sse_frame_is_what_json_dumps_wrote(data: Any, event_id: int | None) -> None:
    assert sse.sse_frame(data, event_id) == _old_frame(data, event_id)
    burst = [data, sse.Identified(event_id or 1, data)]
    assert sse.burst_chunk(burst) == _old_frame(data, None) + _old_frame(data, event_id or 1)


@settings(max_examples=200, deadline=None)
@given(data=_values, sort_keys=st.booleans())
def test_the_encoders_write_what_json_dumps_writes_with_and_without_c_speedups(
    data: Any, sort_keys: bool
) -> None:
    """The C encoder made once (and the plain `JSONEncoder` where json has no
    C speedups) write each value as `json.dumps` with the same options
    (`web/app.py`'s `compact_dumps` gives it the app's `default`, held equal
    in tests/test_asgi_doors.py)."""
    for ensure_ascii in (False, True):
        want = json.dumps(
            data, separators=(",", ":"), ensure_ascii=ensure_ascii, sort_keys=sort_keys
        )
        options = {"ensure_ascii": ensure_ascii, "sort_keys": sort_keys}
        assert sse.compact_encoder(**options)(data) == want
        real = json.encoder.c_make_encoder  # type: ignore[attr-defined]
        json.encoder.c_make_encoder = None  # type: ignore[attr-defined]
        try:
            plain = sse.compact_encoder(**options)
        finally:
            json.encoder.c_make_encoder = real  # type: ignore[attr-defined]
        assert plain(data) == want
