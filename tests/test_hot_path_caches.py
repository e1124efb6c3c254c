"""The per-run fast paths (bench/README.md, "inprocess after the run
machine") change no output: cached stamps and fingerprints read the same as
computed afresh, and a bad key is still refused after good ones were cached."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import trio
from a2a.types import a2a_pb2 as pb
from ag_ui.core import RunAgentInput
from google.protobuf import struct_pb2
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from funduq_trio.broker import funduq
from funduq_trio.broker.errors import InvalidRunInput
from funduq_trio.broker.store import dumps, iso
from funduq_trio.identity import Identity, fingerprint_of
from funduq_trio.protocol import agui, carriable
from funduq_trio.protocol.a2a.messages import run_input_from_message
from funduq_trio.web import agui_door

_BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.parametrize("ts", [0.0, 1.9995, 59.999, 1764750000.123, -1.5, 1e10 + 0.5])
def test_iso_reads_as_strftime(ts: float) -> None:
    fresh = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ts)) + f".{int(ts % 1 * 1000):03d}Z"
    assert iso(ts) == fresh
    assert iso(ts) == fresh  # the cached second too
    assert iso(None) is None


def test_fingerprint_cached_and_still_checked() -> None:
    key = Identity.generate().public_key_hex
    expected = hashlib.sha256(bytes.fromhex(key)).hexdigest()[:16]
    assert fingerprint_of(key) == fingerprint_of(key) == expected
    for bad in (key.upper(), key[:-1], "", ["not", "a", "key"], None):
        with pytest.raises(ValueError):
            fingerprint_of(bad)  # type: ignore[arg-type]


def test_dumps_reads_as_json_dumps() -> None:
    for value in (
        {"a": [1, 2.5, None, True, "\ud800", "é"]},
        "x",
        "\ud800é",
        [],
        {"k": {"n": [{}]}},
        {1: 2, "b": [1e300, -0.0, 10**30]},
        None,
        False,
        3.25,
        (1, "t"),
    ):
        assert dumps(value) == json.dumps(value, separators=(",", ":"))


_OTHER_KEYS = ["timestamp", "rawEvent", "message_id", "extra", "role", "delta", "threadId"]
_ODD_VALUES = st.one_of(
    st.sampled_from(["", "tool", "reasoning", "message", "é", "\ud800"]),
    st.text(max_size=4),
    st.none(),
    st.integers(-3, 3),
    st.floats(allow_nan=True),
    st.lists(st.text(max_size=2), max_size=2),
    st.dictionaries(st.text(max_size=2), st.text(max_size=2), max_size=2),
)


@st.composite
def _events(draw: Any) -> dict[str, Any]:
    """Mostly near-plain events of a string-field type: its fields, most of
    them ASCII strings the field takes, now and then a field left out, an
    odd value or a key it does not have; sometimes a type it does not cover."""
    kind = draw(st.sampled_from(sorted(agui._STRING_EVENTS) + ["RUN_ERRORS", "CUSTOM"]))
    shape = agui._STRING_EVENTS.get(kind)
    required, fields = (shape.required, shape.fields) if shape else (frozenset(), {})
    keys = [k for k in sorted(required) if draw(st.integers(0, 9))]  # each kept 9 times in 10
    keys += draw(st.lists(st.sampled_from(sorted(fields) or ["extra"]), max_size=2))
    keys += draw(st.lists(st.sampled_from(_OTHER_KEYS), max_size=1))
    event: dict[str, Any] = {"type": kind}
    for key in keys:
        allowed = fields.get(key)
        usual = st.sampled_from(sorted(allowed)) if allowed else st.sampled_from(["m-1", "x y"])
        odd = draw(st.integers(0, 9)) == 0
        event[key] = draw(_ODD_VALUES if odd else usual)
    return event


@settings(max_examples=1000, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=_events())
def test_plain_events_read_as_validated(raw: dict[str, Any]) -> None:
    """An event of plain strings is taken without running ag-ui's models
    (`agui._plain`); whatever the event, the answer is the long road's
    (carriable, then validation): the same event back, or refused."""
    assert _read(agui.read_event, raw) == _read(agui._read_validated, raw)


def _read(read: Any, raw: dict[str, Any]) -> Any:
    try:
        return read(raw)
    except agui.MalformedEvent:
        return agui.MalformedEvent


def test_the_commonest_events_take_the_short_road() -> None:
    """bench/inprocess.py's events (a provider's usual stream) skip validation."""
    for event in (
        {"type": "RUN_STARTED", "threadId": "t", "runId": "r"},
        {"type": "TEXT_MESSAGE_START", "messageId": "m", "role": "assistant"},
        {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "word "},
        {"type": "TEXT_MESSAGE_END", "messageId": "m"},
        {"type": "RUN_FINISHED", "threadId": "t", "runId": "r"},
    ):
        assert agui._plain(event)
        assert agui.read_event(event) == event == agui._read_validated(event)
    for event in (
        {"type": "TEXT_MESSAGE_START", "messageId": "m", "role": "tool"},
        {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m"},
        {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": 5},
        {"type": "TEXT_MESSAGE_END", "messageId": "\ud800"},
        {"type": "RUN_FINISHED", "threadId": "t", "runId": "r", "timestamp": 10**20},
    ):
        assert not agui._plain(event)
        with pytest.raises(agui.MalformedEvent):
            agui.read_event(event)


_PLAIN_KEYS = st.sampled_from(["a", "messageId", "dataParts", ""])
_PLAIN_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["m-1", "", "hello there"]),
)
_PLAIN_JSON = st.recursive(
    _PLAIN_SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_PLAIN_KEYS, inner, max_size=3),
    max_leaves=8,
)
#: What no plain JSON holds: a tuple, a key that is no string or not ASCII,
#: a non-finite float, a non-ASCII string, a lone surrogate.
_UNPLAIN_JSON = st.recursive(
    st.one_of(
        _PLAIN_SCALARS,
        st.sampled_from([math.nan, math.inf, -math.inf, "é", "\ud800"]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(_PLAIN_KEYS | st.sampled_from(["é", "\ud800"]), inner, max_size=3),
        st.tuples(inner),
        st.dictionaries(st.integers(0, 1), inner, max_size=1),
    ),
    max_leaves=8,
)


def _nested(depth: int) -> Any:
    """`depth` containers, around the quick path's bound."""
    value: Any = "x"
    for level in range(depth):
        value = {"a": value} if level % 2 else [value]
    return value


#: What the doors' callers send in an optional field: null, empty, a small
#: object (the A2A door's forwardedProps), any plain JSON.
_FIELD_VALUES = st.one_of(
    st.sampled_from([None, [], {}, "p-1"]),
    st.just({"a2a": {"messageId": "m-1"}}),
    _PLAIN_JSON,
)
#: ... and now and then what is not: too deep, not plain, a tool.
_ODD_FIELD_VALUES = st.one_of(
    st.builds(_nested, st.integers(agui._JSON_DEPTH - 1, agui._JSON_DEPTH + 1)),
    _UNPLAIN_JSON,
    st.just([{"name": "t", "description": "d", "parameters": {}}]),
    st.just([{"name": "t"}]),
)


@st.composite
def _run_inputs(draw: Any) -> Any:
    """Mostly near-plain RunAgentInputs, as the doors' callers send them: ids,
    a few messages of plain values for their roles, the optional fields null,
    empty or small objects; now and then an odd value, a missing, snake-cased
    or extra key, a value too deep, non-ASCII or no JSON."""
    odd = st.one_of(_ODD_VALUES, st.just([]), st.just({"id": "m", "role": "user"}))

    def value(usual: Any) -> Any:
        return draw(odd) if draw(st.integers(0, 24)) == 1 else draw(usual)  # (0 comes often)

    def field_value(form: Any, key: str) -> Any:
        """Mostly a value of the kind the field takes, plain or not."""
        take = form.takes.get(key) if form else None
        if take is None or draw(st.integers(0, 9)) == 1:
            return draw(_ODD_FIELD_VALUES | _FIELD_VALUES)
        if take.json:
            return draw(_FIELD_VALUES)
        kinds = [st.none()] if take.null else []
        if take.strings is not agui._NO_FIELD:
            kinds.append(st.sampled_from(sorted(take.strings or ["u-1", "hello there", ""])))
        if take.empty_list:
            kinds.append(st.just([]))
        if take.obj:
            kinds.append(st.dictionaries(_PLAIN_KEYS, _PLAIN_JSON, max_size=3))
        return draw(st.one_of(kinds))

    messages = []
    for _ in range(draw(st.integers(0, 3))):
        role = draw(st.sampled_from([*sorted(agui._MESSAGE_FORMS)] * 3 + ["robot"]))
        form = agui._MESSAGE_FORMS.get(role)
        message: dict[str, Any] = {}
        keys = ["id", "role", *(sorted(form.given) if form else ["content"])]
        keys += draw(st.lists(st.sampled_from(sorted(form.takes) if form else ["x"]), max_size=2))
        keys += draw(st.lists(st.sampled_from(["toolCallId", "tool_call_id", "", "x"]), max_size=1))
        for key in dict.fromkeys(keys):
            if key == "role":
                message[key] = value(st.just(role))
            elif form is not None and key in form.takes:
                if key not in form.given or draw(st.integers(0, 19)) != 1:
                    message[key] = field_value(form, key)
            elif draw(st.integers(0, 19)):
                message[key] = value(st.sampled_from(["u-1", "hello there", ""]))
        messages.append(message if draw(st.integers(0, 15)) else value(st.just(message)))
    form = agui._INPUT_FORM
    assert form is not None
    optional = [k for k in form.order if k not in ("threadId", "runId", "messages")]
    raw: dict[str, Any] = {}
    keys = ["threadId", "runId", "messages", *optional, "thread_id", "forwarded_props", "x"]
    for key in draw(st.permutations(keys)):
        if key == "messages":
            raw[key] = value(st.just(messages))
        elif key in ("threadId", "runId"):
            if draw(st.integers(0, 39)) != 1:
                raw[key] = value(st.sampled_from(["t-1", "r-1", ""]))
        elif key in optional:
            if draw(st.integers(0, 2)) == 0:
                raw[key] = field_value(form, key)
        elif draw(st.integers(0, 19)) == 0:
            raw[key] = draw(_FIELD_VALUES)
    return raw


def _read_input(read: Any, raw: Any) -> Any:
    try:
        return json.dumps(read(raw))  # in order: the record keeps the text
    except agui.InvalidInput as exc:
        return str(exc)


_IDS = {"threadId": "t", "runId": "r"}
_USER = {"id": "u", "role": "user", "content": "hi"}


@settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=_run_inputs())
@example(raw={**_IDS, "messages": [{**_USER, "": "kept, an extra key"}]})
@example(raw={**_IDS, "messages": [], "forwardedProps": {"a2a": {"\ud800": 1}}})
@example(raw={**_IDS, "messages": [], "state": {"n": [1.5, math.nan]}})
@example(raw={**_IDS, "messages": [], "state": {"n": (1,)}, "tools": None})
def test_plain_run_inputs_read_as_validated(raw: Any) -> None:
    """A RunAgentInput of plain values is dumped without running ag-ui's
    model (`agui._plain_input`); whatever the input, the answer is the long
    road's, keys in the same order, or the same refusal."""
    assert _read_input(agui.read_run_input, raw) == _read_input(agui._read_run_input_validated, raw)


def test_the_commonest_input_takes_the_short_road() -> None:
    raw = {
        "threadId": "t",
        "runId": "r",
        "messages": [{"id": "u", "role": "user", "content": "hi"}],
    }
    assert agui._plain_input(raw) == raw == agui._read_run_input_validated(raw)
    raw["messages"].append({"id": "a", "role": "assistant", "content": "é"})
    assert agui._plain_input(raw) is None


def _doors_inputs() -> list[dict[str, Any]]:
    """What the A2A door builds of a caller's message (text, with a data part,
    with metadata of its own) and what bench/e2e.py's AG-UI callers post."""
    text = pb.Part(text="hello there")
    data = pb.Part(data=struct_pb2.Value(string_value="a value"))
    inputs = [
        run_input_from_message(pb.Message(message_id="m-1", role=pb.ROLE_USER, parts=[text])),
        run_input_from_message(
            pb.Message(message_id="m-2", context_id="c-1", role=pb.ROLE_USER, parts=[text, data])
        ),
    ]
    with_metadata = pb.Message(message_id="m-3", role=pb.ROLE_USER, parts=[text])
    with_metadata.metadata.update({"origin": "test", "n": 2})
    inputs.append(run_input_from_message(with_metadata))
    harness = sys.modules.get("harness")
    if harness is None:
        spec = importlib.util.spec_from_file_location("harness", _BENCH / "harness.py")
        assert spec is not None and spec.loader is not None
        harness = sys.modules["harness"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(harness)
    inputs.append(harness.agui_body("thread-1", "hello there", "m-4"))
    return inputs


def test_the_doors_usual_inputs_take_the_short_road() -> None:
    """The A2A door's inputs (`state: {}`, `tools: []`, `context: []`, a
    `forwardedProps` object) and an AG-UI client's (`state: null`) are dumped
    without validation, as validation dumps them."""
    inputs = _doors_inputs()
    assert inputs[0]["forwardedProps"] == {"a2a": {"messageId": "m-1"}}
    assert inputs[1]["forwardedProps"]["a2a"]["dataParts"] == ["a value"]
    assert inputs[2]["messages"][0]["metadata"] == {"origin": "test", "n": 2.0}
    assert inputs[3]["state"] is None
    for raw in inputs:
        plain = agui._plain_input(raw)
        assert plain is not None
        assert json.dumps(plain) == json.dumps(agui._read_run_input_validated(raw))


def test_a_read_input_is_taken_as_read() -> None:
    """What `read_run_input` answers is read again as it is (the AG-UI door
    reads a body once, the broker takes what the door read)."""
    raw = {
        "threadId": "t",
        "runId": "r",
        "messages": [],
        "tools": [{"name": "t", "description": "d", "parameters": {}}],
    }
    read = agui.RunInput(agui.read_run_input(raw))
    again = agui.read_run_input(read)
    assert again == read and type(again) is dict and again is not read
    assert agui.read_run_input(dict(read)) == read


class _Reached(Exception):
    """The door got past its reading, to the broker."""


class _Broker:
    """What `agui_door.run_post` asks of the broker, up to the call it hands
    the input to: an agent that exists, then the input, caught."""

    def find_agent(self, provider: str, agent: str) -> Any:
        return SimpleNamespace(key="k" * 64, fingerprint="f" * 16)

    async def start_run(self, provider: str, agent: str, run_input: Any, **_: Any) -> Any:
        raise _Reached(run_input)

    async def get_thread(self, thread_id: str) -> Any:
        raise _Reached("a resume, answered as the thread's")


def _door_answer(body: bytes) -> Any:
    """How the AG-UI door answers `body` as far as its reading goes: the
    refusal (its class, message and details), or the input handed on."""
    try:
        trio.run(agui_door.run_post, _Broker(), "p", "echo", body, None)
    except _Reached as reached:
        return ("handed on", reached.args[0])
    except (agui_door.InvalidJSON, InvalidRunInput) as exc:
        return (type(exc).__name__, str(exc), getattr(exc, "details", None))
    raise AssertionError("the door neither refused nor handed the input on")


def _door_answer_validating_twice(body: bytes) -> Any:
    """The door's reading before it read once: carriable, then ag-ui's model,
    the body then handed on (and read again by the broker)."""
    try:
        raw = carriable.loads(body)
    except ValueError:
        return _door_answer(body)  # not JSON: unchanged, not what is compared
    problem = carriable.problem(raw)
    if problem is not None:
        exc: Exception = agui_door.InvalidJSON(
            f"request body cannot be carried to a provider: {problem}"
        )
        return (type(exc).__name__, str(exc), None)
    try:
        RunAgentInput.model_validate(raw)
    except ValidationError as error:
        exc = agui_door.invalid_input(error)
        return (type(exc).__name__, str(exc), exc.details)  # type: ignore[attr-defined]
    return ("handed on", raw)


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=_run_inputs())
def test_the_agui_door_reads_a_body_once_and_refuses_as_before(raw: Any) -> None:
    """The AG-UI door reads a body once (the broker takes what it read, a
    `RunInput`, with no validation run again) and refuses exactly what it
    refused when it validated the body itself, with the same answers."""
    body = json.dumps(raw).encode()
    answer = _door_answer(body)
    before = _door_answer_validating_twice(body)
    if before[0] != "handed on":
        assert answer == before
        return
    assert answer[0] == "handed on"
    handed = answer[1]
    if type(handed) is str:
        return  # a resume: the door asks about the thread first
    assert type(handed) is agui.RunInput
    assert json.dumps(handed) == json.dumps(agui._read_run_input_validated(before[1]))
    validations = []
    validate = RunAgentInput.model_validate
    try:
        RunAgentInput.model_validate = lambda *a, **k: validations.append(1) or validate(*a, **k)  # type: ignore[method-assign]
        assert funduq._read_run_input(handed) == handed  # the broker's reading
    finally:
        RunAgentInput.model_validate = validate  # type: ignore[method-assign]
    assert validations == []
