"""The A2A door's shortcuts answer what the general paths they skip answer
(bench/README.md, "Step 4: the A2A handler's own work"): each is held equal
to the general path on generated input, malformed input included."""

from __future__ import annotations

import json
from typing import Any
from unittest import mock

from a2a.types import a2a_pb2 as pb
from google.protobuf.json_format import MessageToDict, ParseDict
from google.protobuf.timestamp_pb2 import Timestamp
from hypothesis import given, settings
from hypothesis import strategies as st

from funduq_trio.protocol.a2a import parsing
from funduq_trio.protocol.a2a.calls import REST, SEND, V03, V1, Call
from funduq_trio.protocol.a2a.parsing import CallRejected, parse_call, plain_send_request
from funduq_trio.protocol.a2a.projection import (
    TaskProjection,
    snapshot_of_record,
    task_from_record,
)
from funduq_trio.protocol.a2a.render import result_response
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


@settings(max_examples=1000, deadline=None)
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


@settings(max_examples=1000, deadline=None)
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


@settings(max_examples=600, deadline=None)
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


# ------------------------------------------------------- a blocking answer's Task

_IDS = st.sampled_from(["m1", "m2", "", None, 5, "m\u00e9"])
_DELTAS = st.sampled_from(["Hel", "lo", "", " ", "\u00e9t\u00e9", "\ud800", None, 3])
_TEXT_ARTIFACT = {"artifactId": "art-1", "parts": [{"text": "whole"}]}

agui_events = st.one_of(
    st.builds(
        lambda kind, mid, delta: {
            k: v
            for k, v in {"type": kind, "messageId": mid, "delta": delta}.items()
            if v is not None
        },
        st.sampled_from(["TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_CHUNK"]),
        _IDS,
        _DELTAS,
    ),
    st.builds(
        lambda kind, mid: {"type": kind, "messageId": mid, "role": "assistant"},
        st.sampled_from(["TEXT_MESSAGE_START", "TEXT_MESSAGE_END"]),
        _IDS,
    ),
    st.sampled_from(
        [
            {"type": "RUN_STARTED", "threadId": "t", "runId": "r"},
            {"type": "RUN_FINISHED", "threadId": "t", "runId": "r"},
            {"type": "RUN_ERROR", "message": "fell over"},
            {"type": "STEP_STARTED", "stepName": "s"},
            {"type": "CUSTOM", "name": "a2a.artifact", "value": _TEXT_ARTIFACT},
            {
                "type": "CUSTOM",
                "name": "a2a.artifact",
                "value": {"artifactId": "m1", "parts": [{"text": "x"}]},
            },
            {
                "type": "CUSTOM",
                "name": "a2a.artifact",
                "value": {"name": "n", "parts": [{"kind": "text", "text": "y"}]},
            },
            {"type": "CUSTOM", "name": "a2a.artifact", "value": "not json"},
            {"type": "CUSTOM", "name": "other", "value": 1},
            "not an event",
            None,
        ]
    ),
)

run_records = st.builds(
    lambda run_id, thread_id, status, metadata, stamps, events: {
        "runId": run_id,
        "threadId": thread_id,
        "agent": {"provider": "ab" * 32, "name": "echo"},
        "status": status,
        "metadata": metadata,
        "createdAt": stamps[0],
        "startedAt": stamps[1],
        "completedAt": stamps[2],
        "events": [{"seq": i + 1, "event": e} for i, e in enumerate(events)],
    },
    st.sampled_from(["run_1", "", "r\u00e9"]),
    st.sampled_from(["thread_1", "", "t\u00e9"]),
    st.sampled_from(
        [
            "queued",
            "offering",
            "running",
            "cancelling",
            "input-required",
            "completed",
            "failed",
            "cancelled",
            "bogus",
        ]
    ),
    st.sampled_from(
        [
            {},
            {"failureReason": "agent_offline"},
            {"interrupts": [{"id": "i1", "message": "ok?"}]},
            {"funduq": {"cancelRequestedBy": "k"}},
            {"other": 1},
        ]
    ),
    st.sampled_from(
        [
            ("2026-12-03T10:00:00.000Z", "2026-12-03T10:00:00.001Z", "2026-12-03T10:00:00.004Z"),
            ("2026-12-03T10:00:00.000Z", None, None),
            (None, None, None),
            (1_700_000_000.25, None, None),
            ("garbage", None, None),
        ]
    ),
    st.lists(agui_events, max_size=8),
)


@settings(max_examples=700, deadline=None)
@given(run_records, st.booleans())
def test_a_plain_task_is_what_protobuf_writes(record: dict[str, Any], cancel: bool) -> None:
    projection = snapshot_of_record(record, cancel_requested=cancel)
    plain = projection.plain_task_json()
    if plain is None:
        return  # written through protobuf
    expected = MessageToDict(pb.SendMessageResponse(task=projection.task()))["task"]
    assert json.dumps(plain) == json.dumps(expected)


@settings(max_examples=500, deadline=None)
@given(run_records, st.sampled_from([V1, V03, REST]))
def test_a_send_answer_is_the_same_from_the_projection(
    record: dict[str, Any], dialect: str
) -> None:
    call = Call(9, "SendMessage", SEND, dialect, pb.SendMessageRequest(), {})
    try:
        expected = json.dumps(result_response(call, task_from_record(record)))
    except Exception as exc:  # noqa: BLE001 - then both fail alike
        expected = repr(exc)
    try:
        got = json.dumps(result_response(call, snapshot_of_record(record)))
    except Exception as exc:  # noqa: BLE001
        got = repr(exc)
    assert got == expected


def test_an_echo_run_takes_the_plain_way() -> None:
    record = {
        "runId": "run_1",
        "threadId": "thread_1",
        "status": "completed",
        "metadata": {},
        "createdAt": "2026-12-03T10:00:00.000Z",
        "startedAt": "2026-12-03T10:00:00.001Z",
        "completedAt": "2026-12-03T10:00:00.004Z",
        "events": [
            {"seq": 1, "event": {"type": "RUN_STARTED", "threadId": "thread_1", "runId": "run_1"}},
            {
                "seq": 2,
                "event": {"type": "TEXT_MESSAGE_START", "messageId": "m", "role": "assistant"},
            },
            {"seq": 3, "event": {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "he"}},
            {"seq": 4, "event": {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "y"}},
            {"seq": 5, "event": {"type": "TEXT_MESSAGE_END", "messageId": "m"}},
            {"seq": 6, "event": {"type": "RUN_FINISHED", "threadId": "thread_1", "runId": "run_1"}},
        ],
    }
    plain = snapshot_of_record(record).plain_task_json()
    assert plain == MessageToDict(pb.SendMessageResponse(task=task_from_record(record)))["task"]
    assert plain["artifacts"] == [{"artifactId": "m", "parts": [{"text": "hey"}]}]


def folded_one_by_one(record: dict[str, Any]) -> TaskProjection:
    """`from_record` as it was: every event through `apply`."""
    projection = TaskProjection(task_id=str(record["runId"]), context_id=str(record["threadId"]))
    for entry in record.get("events") or ():
        projection.apply(int(entry.get("seq", 0)), entry.get("event"), updates=False)
    projection.observe(record)
    return projection


continuing_texts = st.lists(
    st.one_of(
        st.builds(
            lambda mid, delta: {"type": "TEXT_MESSAGE_CONTENT", "messageId": mid, "delta": delta},
            st.sampled_from(["m1", "m2", "", "m\u00e9"]),
            st.sampled_from(["a", "bc", "", "\u00e9", "\ud800"]),
        ),
        agui_events,
    ),
    max_size=12,
)


@settings(max_examples=700, deadline=None)
@given(run_records, continuing_texts, st.sampled_from(["seq", "shuffled", "zero"]))
def test_a_record_folds_as_event_by_event(
    record: dict[str, Any], events: list[Any], numbering: str
) -> None:
    seqs = list(range(1, len(events) + 1))
    if numbering == "shuffled":
        seqs = seqs[::-1][: len(seqs) // 2] + seqs[len(seqs) // 2 :]
    elif numbering == "zero":
        seqs = [0] * len(events)
    record = {
        **record,
        "events": [{"seq": s, "event": e} for s, e in zip(seqs, events, strict=True)],
    }
    fast, slow = TaskProjection.from_record(record), folded_one_by_one(record)
    assert fast == slow
    assert fast.task().SerializeToString(deterministic=True) == slow.task().SerializeToString(
        deterministic=True
    )
