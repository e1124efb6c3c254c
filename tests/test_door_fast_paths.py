"""The doors' per-run shortcuts answer what the paths they skip answer
(bench/README.md, "The doors' own work per run"): each is held equal to the
general path -- the library's, or the code as it was before the shortcut,
kept here as the reference -- on generated input, malformed input included."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Any
from unittest import mock

import pytest
import trio
import trio.testing
from a2a.types import a2a_pb2 as pb
from google.protobuf.json_format import ParseDict
from hypothesis import given, settings
from hypothesis import strategies as st
from jsonrpc.jsonrpc2 import JSONRPC20Response
from test_a2a_fast_paths import agui_events, folded_one_by_one, parsed, record_like, run_records

from funduq_trio.protocol import carriable
from funduq_trio.protocol.a2a import messages, parsing, render
from funduq_trio.protocol.a2a.calls import REST, STREAM, V1, Call
from funduq_trio.protocol.a2a.projection import TaskProjection
from funduq_trio.protocol.a2a.structs import json_timestamp, proto_timestamp, struct_dict
from funduq_trio.web import a2a_door, asgi_doors
from funduq_trio.web.exchange import AsgiRequest, _Headers

# ------------------------------------------------------------ a status stamp


def stamp_by_protobuf(value: Any) -> str | None:
    ts = proto_timestamp(value)
    return None if ts is None else ts.ToJsonString()


@settings(max_examples=1500, deadline=None)
@given(
    st.one_of(
        record_like,
        st.text(max_size=40),
        st.sampled_from(["", "Z", None, True, 0, 1.5, 1_700_000_000.25, -5, 2**80]),
    )
)
def test_a_stamp_writes_as_protobuf_writes_it(value: Any) -> None:
    try:
        expected: Any = stamp_by_protobuf(value)
    except ValueError as exc:  # out of Timestamp's range: both refuse alike
        expected = repr(exc)
    try:
        got: Any = json_timestamp(value)
    except ValueError as exc:
        got = repr(exc)
    assert got == expected


def test_the_record_stamps_write_the_same() -> None:
    for text in (
        "2026-12-04T10:39:03.103Z",
        "2026-12-04T10:39:03.000Z",
        "2026-12-04T10:39:03Z",
        "2026-12-04T10:39:03.1Z",
        "2026-12-04T10:39:03.123456Z",
        "2026-12-04T10:39:03.123450Z",
        "2026-12-04T10:39:03.999999999Z",
        "2026-12-04T10:39:03.000000001Z",
        "0001-01-01T00:00:00.000Z",
        "9999-12-31T23:59:59.999Z",
        "2026-02-30T10:00:00.004Z",
        "2026-12-04T10:39:60.000Z",
    ):
        assert json_timestamp(text) == stamp_by_protobuf(text), text
    assert json_timestamp("2026-12-04T10:39:03.103Z") == "2026-12-04T10:39:03.103Z"


# ------------------------------------------------------------ the JSON-RPC envelope

_IDS = st.one_of(
    st.integers(-(2**70), 2**70),
    st.text(max_size=4),
    st.sampled_from([None, True, False, 1.5, [], {}]),
)
_METHODS = st.one_of(
    st.sampled_from(
        [
            "SendMessage",
            "SendStreamingMessage",
            "GetTask",
            "ListTasks",
            "message/send",
            "tasks/get",
            "rpc.x",
            "",
            "Nope",
        ]
    ),
    st.sampled_from([None, 1, ["SendMessage"]]),
)
_PARAMS = st.one_of(
    st.sampled_from(
        [
            {"message": {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "hi"}]}},
            {"message": {"messageId": "m", "role": "user", "kind": "message", "parts": []}},
            {"id": "run_1"},
            {},
            [],
            [1],
            None,
            "x",
            {"a": float("nan")},
        ]
    ),
)

envelopes = st.one_of(
    st.fixed_dictionaries(
        {},
        optional={
            "jsonrpc": st.sampled_from(["2.0", "1.0", 2.0, None]),
            "id": _IDS,
            "method": _METHODS,
            "params": _PARAMS,
            "extra": st.just(1),
        },
    ),
    st.builds(
        lambda i, m, p: {"jsonrpc": "2.0", "id": i, "method": m, "params": p},
        _IDS,
        _METHODS,
        _PARAMS,
    ),
    st.sampled_from([[], [{"jsonrpc": "2.0", "id": 1, "method": "GetTask"}], "x", 1, None]),
)


@settings(max_examples=1500, deadline=None)
@given(envelopes, st.sampled_from(["1.0", None, "0.3"]))
def test_an_envelope_parses_the_same_either_way(data: Any, version: Any) -> None:
    body = json.dumps(data).encode()
    fast = parsed(body, version)
    with mock.patch.object(parsing, "_plain_envelope", lambda data: None):
        general = parsed(body, version)
    assert fast == general


def test_the_common_envelope_takes_the_shortcut() -> None:
    data = {"jsonrpc": "2.0", "id": 7, "method": "SendMessage", "params": {}}
    assert parsing._plain_envelope(data) == ("SendMessage", 7, {})
    assert parsing._plain_envelope({**data, "id": True}) is None


@settings(max_examples=500, deadline=None)
@given(_IDS, st.sampled_from([{"task": {"id": "t"}}, None, [], "x"]))
def test_a_result_envelope_is_the_packages(request_id: Any, result: Any) -> None:
    try:
        expected: Any = JSONRPC20Response(result=result, _id=request_id).data
    except ValueError as exc:
        expected = repr(exc)
    try:
        got: Any = render._jsonrpc_result(result, request_id)
    except ValueError as exc:
        got = repr(exc)
    assert json.dumps(got) == json.dumps(expected)


# ------------------------------------------------------------ a message as RunAgentInput


def run_input_as_it_was(
    message: pb.Message, *, interrupts: Iterable[Mapping[str, Any]] = ()
) -> dict[str, Any]:
    """`run_input_from_message` before its parts were read in one pass."""
    text_parts: list[dict[str, Any]] = []
    files: list[dict[str, Any]] = []
    for part in message.parts:
        which = part.WhichOneof("content")
        if which == "text":
            text_parts.append({"type": "text", "text": part.text})
        elif which in ("raw", "url"):
            files.append(messages._media_part(part))
    text = messages.message_text(message)
    content: Any = text if not files else [*text_parts, *files]
    user: dict[str, Any] = {"id": message.message_id, "role": "user", "content": content}
    own_metadata = struct_dict(message, "metadata")
    if own_metadata:
        user["metadata"] = own_metadata
    run_input: dict[str, Any] = {
        "threadId": message.context_id or "",
        "runId": "",
        "state": {},
        "messages": [user],
        "tools": [],
        "context": [],
    }
    data = messages.message_data(message)
    a2a_props: dict[str, Any] = {"messageId": message.message_id}
    if data:
        a2a_props["dataParts"] = data
    if message.reference_task_ids:
        a2a_props["referenceTaskIds"] = list(message.reference_task_ids)
    run_input["forwardedProps"] = {"a2a": a2a_props}
    interrupts = [i for i in interrupts if isinstance(i, Mapping) and i.get("id")]
    if interrupts:
        payload: Any = data[0] if len(data) == 1 and not text else text
        run_input["resume"] = [
            {"interruptId": str(i["id"]), "status": "resolved", "payload": payload}
            for i in interrupts
        ]
    return run_input


a2a_parts = st.lists(
    st.one_of(
        st.builds(lambda t: {"text": t}, st.text(max_size=4)),
        st.sampled_from(
            [
                {"data": {"k": 1}},
                {"data": [1, "x"]},
                {"data": "s"},
                {"url": "https://example.com/a.png", "mediaType": "image/png"},
                {"url": "https://example.com/doc", "filename": "doc"},
                {"raw": "aGVsbG8=", "mediaType": "audio/wav", "metadata": {"m": 1}},
                {"text": "t", "metadata": {"x": True}},
            ]
        ),
    ),
    max_size=5,
)
a2a_messages = st.builds(
    lambda parts, extra: ParseDict(
        {"messageId": "m1", "role": "ROLE_USER", "parts": parts, **extra}, pb.Message()
    ),
    a2a_parts,
    st.fixed_dictionaries(
        {},
        optional={
            "contextId": st.sampled_from(["ctx", ""]),
            "metadata": st.sampled_from([{}, {"a": 1}]),
            "referenceTaskIds": st.sampled_from([["r1"], []]),
        },
    ),
)


@settings(max_examples=700, deadline=None)
@given(
    a2a_messages,
    st.sampled_from([(), [{"id": "i1"}], [{"id": "i1"}, {"id": ""}, "x", {"id": "i2"}]]),
)
def test_a_message_reads_as_it_did(message: pb.Message, interrupts: Any) -> None:
    assert json.dumps(messages.run_input_from_message(message, interrupts=interrupts)) == (
        json.dumps(run_input_as_it_was(message, interrupts=interrupts))
    )


# ------------------------------------------------------------ a snapshot's fold

more_events = st.one_of(
    agui_events,
    st.sampled_from(
        [
            {"type": "SOMETHING_NEW", "x": 1},
            {"type": 5},
            {"type": None},
            {},
            {"type": "STATE_SNAPSHOT", "snapshot": {}},
            {"type": "TOOL_CALL_START", "toolCallId": "c", "toolCallName": "f"},
            {"type": "RUN_STARTED", "threadId": "t", "runId": "r"},
            {"type": "RUN_ERROR", "message": "again"},
        ]
    ),
)


@settings(max_examples=700, deadline=None)
@given(run_records, st.lists(more_events, max_size=12), st.sampled_from(["seq", "back", "zero"]))
def test_a_snapshot_folds_every_kind_as_apply_does(
    record: dict[str, Any], events: list[Any], numbering: str
) -> None:
    seqs = list(range(1, len(events) + 1))
    if numbering == "back":
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


# ------------------------------------------------------------ a body's JSON


def loads_as_it_was(text: Any) -> Any:
    return json.loads(text, parse_constant=carriable._refuse_constant)


def outcome(loads: Any, text: Any) -> Any:
    try:
        value = loads(text)
    except (ValueError, TypeError, RecursionError) as exc:
        return (type(exc).__name__, str(exc))
    return ("ok", json.dumps(value), repr(value))


json_texts = st.one_of(
    st.text(max_size=30),
    st.recursive(
        st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=4)),
        lambda inner: st.one_of(
            st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)
        ),
        max_leaves=8,
    ).map(json.dumps),
    st.sampled_from(
        ['{"a": NaN}', "[Infinity]", "-Infinity", '"\\ud800"', "\ufeff{}", "{", "[" * 50, ""]
    ),
)


@settings(max_examples=1000, deadline=None)
@given(
    json_texts,
    st.sampled_from(["str", "utf-8", "utf-16", "utf-16-le", "utf-32", "bytearray", "latin-1"]),
)
def test_a_body_loads_as_json_loads_it(text: str, form: str) -> None:
    value: Any = text
    try:
        if form == "bytearray":
            value = bytearray(text.encode("utf-8", "surrogatepass"))
        elif form != "str":
            value = text.encode(form, "surrogatepass")
    except UnicodeEncodeError:
        return
    assert outcome(carriable.loads, value) == outcome(loads_as_it_was, value)


def test_a_body_that_is_not_text_is_refused_alike() -> None:
    for value in (None, 5, ["x"], memoryview(b"{}")):
        assert outcome(carriable.loads, value) == outcome(loads_as_it_was, value)
    with pytest.raises(carriable.NotCarriable):
        carriable.loads(b'{"a": NaN}')
    assert math.isinf(json.loads("1e999"))  # (a float out of range is json's, not ours)


# ------------------------------------------------------------ a request's headers


def headers_as_they_were(pairs: list[tuple[bytes, bytes]]) -> dict[str, str]:
    headers = _Headers()
    for raw_name, raw_value in pairs:
        name = raw_name.decode("latin-1").lower()
        value = raw_value.decode("latin-1")
        if name in headers:
            separator = "; " if name == "cookie" else ", "
            value = dict.__getitem__(headers, name) + separator + value
        dict.__setitem__(headers, name, value)
    return headers


header_pairs = st.lists(
    st.tuples(
        st.sampled_from(
            [b"content-type", b"Content-Type", b"cookie", b"Cookie", b"a2a-version", b"x-\xe9"]
        ),
        st.binary(max_size=6),
    ),
    max_size=6,
)


@settings(max_examples=500, deadline=None)
@given(header_pairs)
def test_a_requests_headers_read_as_they_did(pairs: list[tuple[bytes, bytes]]) -> None:
    request = AsgiRequest({"headers": pairs})
    expected = headers_as_they_were(pairs)
    assert type(request.headers) is _Headers
    assert list(request.headers.items()) == list(expected.items())
    assert request.headers.get("Content-Type") == expected.get("content-type")
    # Any iterable of pairs, as ASGI allows, is read once.
    assert list(AsgiRequest({"headers": iter(pairs)}).headers.items()) == list(expected.items())


# ------------------------------------------------------------ the body under the hang-up watch


async def test_a_body_read_under_the_hang_up_watch_times_out_as_read_body_does(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """`_read_until_hung_up`'s one scope: the body's deadline cuts a body that
    does not come (RequestTimeout, nothing watched); once the body is read
    the deadline is gone (a door slower than it is not cut) and the hang-up
    is watched until the door returns; a hang-up then is `_Gone`."""
    watched: list[Any] = []
    scope = {"headers": [(b"content-length", b"4")]}

    async def trickle() -> dict[str, Any]:
        await trio.sleep(10)
        return {"type": "http.request", "body": b"ab", "more_body": True}

    async def door(body: bytes) -> Any:
        raise AssertionError("no door without a body")

    with pytest.raises(asgi_doors.RequestTimeout):
        await asgi_doors._read_until_hung_up(scope, trickle, 10, 5.0, watched.append, door)
    assert watched == []

    async def whole() -> dict[str, Any]:
        return {"type": "http.request", "body": b"abcd", "more_body": False}

    async def slow_door(body: bytes) -> Any:
        await trio.sleep(60)  # past the body's deadline
        return body

    answer = await asgi_doors._read_until_hung_up(scope, whole, 10, 5.0, watched.append, slow_door)
    assert answer == b"abcd"
    assert [callable(w) for w in watched] == [True, False]  # watched, then dropped

    watched.clear()

    async def hung_up_door(body: bytes) -> Any:
        watched[0]()  # the front's Hangups task calls it
        await trio.sleep(60)
        raise AssertionError("not cancelled")

    with pytest.raises(asgi_doors._Gone):
        await asgi_doors._read_until_hung_up(scope, whole, 10, 5.0, watched.append, hung_up_door)
    assert watched[1:] == [None]

    with pytest.raises(asgi_doors.RequestEntityTooLarge):
        await asgi_doors._read_until_hung_up(scope, whole, 3, 5.0, watched.append, door)


# ------------------------------------------------------------ a stream's text deltas

stream_events = st.one_of(
    more_events,
    st.builds(
        lambda kind, mid, delta: {
            k: v
            for k, v in {"type": kind, "messageId": mid, "delta": delta}.items()
            if v is not None
        },
        st.sampled_from(["TEXT_MESSAGE_CONTENT", "TEXT_MESSAGE_CHUNK"]),
        st.sampled_from(["m1", "m1", "m2", "", None, 0, 7, "m\u00e9", "\ud800"]),
        st.sampled_from(["a", "bc ", "", "\u00e9", "\ud800", None, 5, "x" * 40]),
    ),
)


def framed_by_protobuf(call: Any, projection: TaskProjection, seq: int, event: Any) -> list[Any]:
    return [render.stream_frame(call, update) for update in projection.apply(seq, event)]


@settings(max_examples=1000, deadline=None)
@given(
    run_records,
    st.lists(stream_events, max_size=14),
    st.sampled_from(["seq", "back", "zero", "dup"]),
    st.sampled_from([V1, REST]),
    st.booleans(),
)
def test_a_streamed_delta_frames_as_protobuf_frames_it(
    record: dict[str, Any], events: list[Any], numbering: str, dialect: str, cancel: bool
) -> None:
    """`A2ADoor.stream`'s frames, built with `plain_updates` where it takes
    an event, are those of `apply` and `stream_frame` alone, byte for byte,
    and the projection ends the same (its snapshot and its final status)."""
    seqs = list(range(1, len(events) + 1))
    if numbering == "back":
        seqs = seqs[::-1][: len(seqs) // 2] + seqs[len(seqs) // 2 :]
    elif numbering == "zero":
        seqs = [0] * len(events)
    elif numbering == "dup":
        seqs = [max(1, s - 2) for s in seqs]
    opening = {**record, "events": record["events"][:2]}
    fast = TaskProjection.from_record(opening)
    slow = TaskProjection.from_record(opening)
    fast.cancel_requested = slow.cancel_requested = cancel
    call = Call(11, "SendStreamingMessage", STREAM, dialect, None, {})
    burst = list(zip(seqs, events, strict=True))
    got = [json.dumps(f.data) + f"@{f.id}" for f in a2a_door._frames(call, fast, burst, True)]
    expected = [
        json.dumps(frame) + f"@{seq}"
        for seq, event in burst
        for frame in framed_by_protobuf(call, slow, seq, event)
    ]
    assert got == expected
    assert fast == slow
    assert fast.task().SerializeToString(deterministic=True) == slow.task().SerializeToString(
        deterministic=True
    )
    assert render.stream_frame(call, fast.settle(record)) == render.stream_frame(
        call, slow.settle(record)
    )


def test_an_echo_runs_deltas_take_the_plain_way() -> None:
    projection = TaskProjection(task_id="run_1", context_id="thread_1")
    first = projection.plain_updates(
        3, {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "he"}
    )
    again = projection.plain_updates(
        4, {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "y"}
    )
    assert first == [
        {
            "artifactUpdate": {
                "taskId": "run_1",
                "contextId": "thread_1",
                "artifact": {"artifactId": "m", "parts": [{"text": "he"}]},
            }
        }
    ]
    assert again is not None and again[0]["artifactUpdate"]["append"] is True
    assert projection.plain_updates(5, {"type": "TEXT_MESSAGE_END", "messageId": "m"}) is None


@settings(max_examples=500, deadline=None)
@given(run_records, st.sampled_from([V1, REST]), st.booleans())
def test_a_streams_opening_snapshot_frames_as_protobuf_frames_it(
    record: dict[str, Any], dialect: str, cancel: bool
) -> None:
    projection = TaskProjection.from_record(record)
    projection.cancel_requested = cancel
    call = Call(11, "SendStreamingMessage", STREAM, dialect, None, {})
    frame = a2a_door._opening_frame(call, projection, True)
    expected = render.stream_frame(call, pb.StreamResponse(task=projection.task()))
    assert (frame.id, json.dumps(frame.data)) == (projection.last_seq, json.dumps(expected))


async def test_a_body_whose_last_bytes_come_as_its_deadline_passes_is_answered(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The race `read_body` answers as a body read in time: the last bytes
    wake the reader, and the deadline expires before it runs. The door is
    answered (in a scope of its own), not taken for a hang-up."""
    watched: list[Any] = []
    scope = {"headers": []}
    arrived = trio.Event()

    async def receive() -> dict[str, Any]:
        await arrived.wait()
        return {"type": "http.request", "body": b"late", "more_body": False}

    async def door(body: bytes) -> Any:
        await trio.sleep(1)  # a checkpoint the deadline would cut
        return body

    async def sender() -> None:
        await trio.sleep(4.5)
        arrived.set()  # the reader is woken...
        autojump_clock.jump(1)  # ...and the deadline (5 s) expires before it runs

    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender)
        answer = await asgi_doors._read_until_hung_up(scope, receive, 10, 5.0, watched.append, door)
    assert answer == b"late"
    assert [callable(w) for w in watched] == [True, False]
