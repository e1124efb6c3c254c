"""The A2A door's shortcuts answer what the general paths they skip answer
(bench/README.md, "The A2A handler"): each is held equal to the general path
on generated input, malformed input included."""

from __future__ import annotations

from typing import Any

from google.protobuf.timestamp_pb2 import Timestamp
from hypothesis import given, settings
from hypothesis import strategies as st

from funduq_trio.protocol.a2a.structs import proto_timestamp


def timestamp_by_protobuf(value: Any) -> Any:
    """`proto_timestamp` as it was: every text through `FromJsonString`."""
    ts = Timestamp()
    try:
        if isinstance(value, bool) or value is None:
            return None
        if isinstance(value, int | float):
            ts.FromNanoseconds(int(value * 1_000_000_000))
            return ts
        if isinstance(value, str) and value:
            text = value.replace("+00:00", "Z")
            if not text.endswith("Z") and "+" not in text[10:] and "-" not in text[10:]:
                text += "Z"
            ts.FromJsonString(text)
            return ts
    except (ValueError, TypeError, OverflowError):
        return None
    return None


def _two(low: int, high: int) -> st.SearchStrategy[str]:
    return st.integers(low, high).map(lambda n: f"{n:02d}")


#: Stamps shaped like the record's, with fields out of range now and then.
record_like = st.builds(
    lambda y, mo, d, h, mi, s, frac, tail: f"{y:04d}-{mo}-{d}T{h}:{mi}:{s}{frac}{tail}",
    st.integers(0, 9999),
    _two(0, 13),
    _two(0, 32),
    _two(0, 25),
    _two(0, 60),
    _two(0, 61),
    st.one_of(st.just(""), st.from_regex(r"\.[0-9]{0,11}", fullmatch=True)),
    st.sampled_from(["Z", "", "+00:00", "+01:30", "-02:00", "z", "ZZ", " Z"]),
)


@settings(max_examples=3000, deadline=None)
@given(
    st.one_of(record_like, st.text(max_size=40), st.sampled_from(["", "Z", "1970-01-01T00:00:00Z"]))
)
def test_a_stamp_reads_as_protobuf_reads_it(text: str) -> None:
    assert proto_timestamp(text) == timestamp_by_protobuf(text)


def test_the_record_stamps_read_the_same() -> None:
    for text in (
        "2026-12-03T10:00:00.004Z",
        "2026-12-03T10:00:00Z",
        "2026-12-03T10:00:00.999999999Z",
        "2026-12-03T10:00:00.000000001Z",
        "0001-01-01T00:00:00.000Z",
        "9999-12-31T23:59:59.999Z",
        "2026-02-30T10:00:00.004Z",
    ):
        assert proto_timestamp(text) == timestamp_by_protobuf(text), text
