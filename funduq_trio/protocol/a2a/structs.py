"""JSON values in and out of protobuf Structs, I/O-free.

A2A carries free-form JSON (metadata, data parts, AG-UI events riding a status
update) in `google.protobuf.Struct`s. `plain` reads one back as JSON-able
Python; `set_struct` fills one, degrading what a Struct cannot hold (a lone
surrogate, a huge integer, nesting past STRUCT_NESTING) and marking it
DEGRADED_KEY, so one odd event never fails a whole view.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Mapping
from typing import Any, cast

from google.protobuf.json_format import MessageToDict, ParseDict
from google.protobuf.message import Message as ProtoMessage
from google.protobuf.timestamp_pb2 import Timestamp

#: Metadata key: what this metadata carries was altered to fit an A2A answer
#: (see `_fit`); the run's record (`GET /runs/{id}`) holds it as sent.
DEGRADED_KEY = "funduq/degraded"
#: Deepest JSON nesting a Struct in an answer holds. Protobuf parsers stop at
#: 100 message levels, a JSON level is two of them (Struct, Value), and the
#: answer's own messages wrap the Struct: past this a caller's SDK could not
#: parse the answer even when funduq could build it.
STRUCT_NESTING = 32
#: What stands in for a container nested past STRUCT_NESTING.
TOO_DEEP = "(nested too deep for A2A metadata; the run's record holds it as sent)"


def plain(value: Any) -> Any:
    """JSON-able Python out of a protobuf Struct/Value (or anything JSON-like).

    Protobuf Struct numbers are doubles; an integral one is read as the integer
    it is (DESIGN §5: the signed bytes use the integer's digits).
    """
    if isinstance(value, ProtoMessage):
        value = MessageToDict(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def struct_dict(message: ProtoMessage, field_name: str) -> dict[str, Any] | None:
    """A Struct field as a plain dict, None when unset."""
    if not message.HasField(field_name):
        return None
    return cast("dict[str, Any]", plain(getattr(message, field_name)))  # a Struct: an object


def utf8(text: str) -> str:
    """`text` as protobuf can hold it: a lone surrogate (valid JSON, stored
    as sent) becomes U+FFFD."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def _fits(value: Any, depth: int = 0) -> bool:
    """Whether a Struct holds `value` as it is (recursion stops at STRUCT_NESTING)."""
    if isinstance(value, str):
        return value.isascii() or utf8(value) is value
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, int):
        return value.bit_length() <= 1023  # a double holds it (roughly)
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, Mapping):
        return depth < STRUCT_NESTING and all(
            isinstance(k, str) and _fits(k) and _fits(v, depth + 1) for k, v in value.items()
        )
    if isinstance(value, list | tuple):
        return depth < STRUCT_NESTING and all(_fits(v, depth + 1) for v in value)
    return False


def _fit(value: Any, depth: int = 0) -> Any:
    """A copy of `value` a Struct holds, relaying what it can: strings with
    lone surrogates get U+FFFD, numbers a double cannot hold become their
    digits, containers nested past STRUCT_NESTING become TOO_DEEP."""
    if isinstance(value, str):
        return utf8(value)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        if value.bit_length() <= 1023:
            return value
        try:
            return str(value)
        except ValueError:  # past Python's own digit limit
            return "(an integer too large to show)"
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, Mapping | list | tuple):
        if depth >= STRUCT_NESTING:
            return TOO_DEEP
        if isinstance(value, Mapping):
            return {utf8(str(k)): _fit(v, depth + 1) for k, v in value.items()}
        return [_fit(v, depth + 1) for v in value]
    return utf8(str(value))


def set_struct(target: Any, value: Mapping[str, Any]) -> None:
    """Fill a Struct from JSON-like `value`. What a Struct cannot hold (a stored
    provider event may be anything the link carried) is degraded by `_fit`
    and marked DEGRADED_KEY, so one odd event never fails a whole view."""
    if _fits(value):
        ParseDict(dict(value), target)
        return
    fitted = _fit(value)
    fitted[DEGRADED_KEY] = True
    target.Clear()
    ParseDict(fitted, target)


def proto_timestamp(value: Any) -> Any | None:
    """A protobuf Timestamp from a record time (ISO-8601 text or epoch seconds)."""
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
            stamp = _RECORD_STAMP.fullmatch(text)
            if stamp is not None:
                # What `FromJsonString` makes of it, its strptime paid once per
                # second: a snapshot reads three stamps, mostly of one second.
                seconds = _whole_seconds(stamp[1])
                if seconds is not None:
                    fraction = stamp[2]
                    ts.seconds = seconds
                    ts.nanos = round(float("0." + fraction) * 1e9) if fraction else 0
                    return ts
            ts.FromJsonString(text)
            return ts
    except (ValueError, TypeError, OverflowError):
        return None
    return None


#: The record's own stamps (`store.iso`): UTC, whole seconds and a fraction.
_RECORD_STAMP = re.compile(
    r"([0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2})(?:\.([0-9]{1,9}))?Z"
)


@functools.lru_cache(maxsize=256)
def _whole_seconds(text: str) -> int | None:
    """`Timestamp.FromJsonString`'s seconds for `YYYY-MM-DDTHH:MM:SS` UTC, or
    None where it refuses the text (it then refuses the whole stamp too)."""
    ts = Timestamp()
    try:
        ts.FromJsonString(text + "Z")
    except ValueError:
        return None
    return int(ts.seconds)


def json_timestamp(value: Any) -> str | None:
    """`proto_timestamp(value).ToJsonString()` (None where `proto_timestamp`
    is None): a record's own stamps (`store.iso`) written without building
    the Timestamp -- its seconds' text made once per second, the fraction
    as `ToJsonString` writes it (3, 6 or 9 digits, none for whole seconds).
    Anything else goes through the Timestamp. `tests/test_a2a_fast_paths.py`
    holds the two equal."""
    if type(value) is str:
        stamp = _RECORD_STAMP.fullmatch(value)
        if stamp is not None:
            whole = _json_seconds(stamp[1])
            fraction = stamp[2]
            nanos = round(float("0." + fraction) * 1e9) if fraction else 0
            if whole is not None and 0 <= nanos < 1_000_000_000:
                if nanos == 0:
                    return whole + "Z"
                if nanos % 1_000_000 == 0:
                    return f"{whole}.{nanos // 1_000_000:03d}Z"
                if nanos % 1_000 == 0:
                    return f"{whole}.{nanos // 1_000:06d}Z"
                return f"{whole}.{nanos:09d}Z"
    ts = proto_timestamp(value)
    return None if ts is None else str(ts.ToJsonString())


@functools.lru_cache(maxsize=256)
def _json_seconds(text: str) -> str | None:
    """`ToJsonString` of `YYYY-MM-DDTHH:MM:SS` UTC as `proto_timestamp` reads
    it, without its "Z"; None where that refuses it."""
    seconds = _whole_seconds(text)
    if seconds is None:
        return None
    ts = Timestamp(seconds=seconds)
    try:
        return str(ts.ToJsonString())[:-1]
    except ValueError:
        return None
