"""The A2A door's shortcuts answer what the general paths they skip answer
(bench/README.md, "The A2A handler"): each is held equal to the general path
on generated input, malformed input included."""

from __future__ import annotations

import json
from typing import Any
from unittest import mock

from a2a.types import a2a_pb2 as pb
from google.protobuf.json_format import ParseDict
from google.protobuf.timestamp_pb2 import Timestamp
from hypothesis import given, settings
from hypothesis import strategies as st

from funduq_trio.protocol.a2a import parsing
from funduq_trio.protocol.a2a.parsing import CallRejected, parse_call, plain_send_request
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


# ------------------------------------------------------- a plain SendMessage

ANY_VALUE = st.sampled_from(["", "x", "thread_1", None, 0, 1, True, 1.5, [], {}, ["x"], {"a": 1}])

parts = st.lists(
    st.one_of(
        st.builds(lambda t: {"text": t}, st.one_of(st.text(max_size=5), ANY_VALUE)),
        st.sampled_from(
            [
                {"text": "a", "metadata": {}},
                {"url": "https://example.com/x"},
                {"data": {"k": 1}},
                {},
                "text",
                None,
                {"kind": "text", "text": "0.3 shape"},
            ]
        ),
    ),
    max_size=3,
)

message_values: dict[str, st.SearchStrategy[Any]] = {
    "messageId": st.one_of(st.text(max_size=5), ANY_VALUE),
    "contextId": st.one_of(st.sampled_from(["ctx", ""]), ANY_VALUE),
    "taskId": st.one_of(st.sampled_from(["run_1", ""]), ANY_VALUE),
    "role": st.one_of(
        st.sampled_from(["ROLE_USER", "ROLE_AGENT", "ROLE_UNSPECIFIED", "user", "BOGUS", 1, 7]),
        ANY_VALUE,
    ),
    "parts": st.one_of(parts, ANY_VALUE),
    "metadata": st.sampled_from([{}, {"a": 1}, None, "x"]),
    "message_id": st.just("snake"),
    "referenceTaskIds": st.sampled_from([["a"], [], "a"]),
    "kind": st.just("message"),
    "extensions": st.sampled_from([["e"], []]),
}

plain_messages = st.fixed_dictionaries(
    {},
    optional={
        "messageId": st.text(max_size=5),
        "role": st.sampled_from(["ROLE_USER", "ROLE_AGENT"]),
        "parts": st.lists(st.builds(lambda t: {"text": t}, st.text(max_size=5)), max_size=3),
        "contextId": st.text(max_size=5),
        "taskId": st.text(max_size=5),
    },
)
any_messages = st.one_of(
    plain_messages, st.fixed_dictionaries({}, optional=message_values), ANY_VALUE
)

send_params = st.one_of(
    st.fixed_dictionaries(
        {"message": any_messages},
        optional={
            "metadata": st.one_of(
                st.sampled_from(
                    [
                        {},
                        {"actorChain": "x.y"},
                        {"n": {"deep": [1, 2.5, None, True, "s"]}},
                        {"big": 2**70},
                        None,
                        [],
                        "s",
                    ]
                ),
            ),
            "configuration": st.sampled_from(
                [
                    {"returnImmediately": True},
                    {"returnImmediately": False},
                    {"returnImmediately": "true"},
                    {"returnImmediately": None},
                    {"returnImmediately": 1},
                    {"historyLength": 3},
                    {"returnImmediately": True, "historyLength": -1},
                    {},
                    None,
                ]
            ),
            "tenant": st.sampled_from(["t", "", None]),
            "bogus": st.just(1),
        },
    ),
    st.fixed_dictionaries({}, optional={"metadata": st.just({})}),
    ANY_VALUE,
)


def by_parse_dict(params: Any) -> Any:
    try:
        return ParseDict(params, pb.SendMessageRequest(), ignore_unknown_fields=True)
    except Exception:  # noqa: BLE001 - the general path refuses it
        return None


@settings(max_examples=3000, deadline=None)
@given(send_params)
def test_a_plain_send_request_is_what_parse_dict_makes(params: Any) -> None:
    fast = plain_send_request(params)
    if fast is None:
        return  # ParseDict's own
    full = by_parse_dict(params)
    assert full is not None, "the shortcut took what ParseDict refuses"
    assert fast == full
    assert fast.SerializeToString(deterministic=True) == full.SerializeToString(deterministic=True)


def test_the_common_shapes_take_the_shortcut() -> None:
    message = {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "hi"}]}
    for params in (
        {"message": message},
        {"message": {**message, "contextId": "c", "taskId": "t"}},
        {"message": message, "configuration": {"returnImmediately": True}},
        {"message": message, "metadata": {"actorChain": "x"}},
    ):
        fast = plain_send_request(params)
        assert fast is not None, params
        assert fast.SerializeToString(deterministic=True) == by_parse_dict(
            params
        ).SerializeToString(deterministic=True)


def parsed(body: bytes, version: str | None) -> Any:
    """What parse_call answers, as bytes: the call, or the refusal's JSON."""
    try:
        call = parse_call(body, version)
    except CallRejected as rejected:
        return json.dumps(rejected.response, sort_keys=False)
    return (
        call.request_id,
        call.method,
        call.op,
        call.dialect,
        call.request.SerializeToString(deterministic=True),
        json.dumps(call.params),
        json.dumps(call.request_metadata()),
    )


@settings(max_examples=1500, deadline=None)
@given(
    send_params,
    st.sampled_from(["SendMessage", "SendStreamingMessage"]),
    st.sampled_from(["1.0", None, "0.3", "1.2"]),
)
def test_a_send_call_parses_the_same_either_way(params: Any, method: str, version: Any) -> None:
    body = json.dumps({"jsonrpc": "2.0", "id": 7, "method": method, "params": params}).encode()
    fast = parsed(body, version)
    with mock.patch.object(parsing, "plain_send_request", lambda params: None):
        general = parsed(body, version)
    assert fast == general
