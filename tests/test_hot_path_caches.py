"""The per-run fast paths (bench/README.md, "inprocess after the run
machine") change no output: cached stamps and fingerprints read the same as
computed afresh, and a bad key is still refused after good ones were cached."""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from funduq_trio.broker.store import dumps, iso
from funduq_trio.identity import Identity, fingerprint_of
from funduq_trio.protocol import agui


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


@settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))
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


@st.composite
def _run_inputs(draw: Any) -> Any:
    """Mostly near-plain RunAgentInputs: ids, a few messages of plain strings
    for their roles, now and then an odd value, a missing or extra key, tools."""
    odd = st.one_of(_ODD_VALUES, st.just([]), st.just({"id": "m", "role": "user"}))

    def value(usual: Any) -> Any:
        return draw(odd) if draw(st.integers(0, 11)) == 0 else draw(usual)

    messages = []
    for _ in range(draw(st.integers(0, 3))):
        role = draw(st.sampled_from([*sorted(agui._MESSAGE_SHAPES), "activity", "robot"]))
        shape = agui._MESSAGE_SHAPES.get(role)
        message: dict[str, Any] = {}
        keys = ["id", "role", *(sorted(shape.required) if shape else ["content"])]
        keys += draw(st.lists(st.sampled_from(["name", "toolCallId", "error", "x"]), max_size=1))
        for key in dict.fromkeys(keys):
            if key == "role":
                message[key] = value(st.just(role))
            elif draw(st.integers(0, 9)):
                message[key] = value(st.sampled_from(["u-1", "hello there", ""]))
        messages.append(message if draw(st.integers(0, 15)) else value(st.just(message)))
    raw: dict[str, Any] = {}
    for key in draw(st.permutations(["threadId", "runId", "messages", "parentRunId", "tools"])):
        if key == "messages":
            raw[key] = value(st.just(messages))
        elif key in ("parentRunId", "tools"):
            if draw(st.integers(0, 3)) == 0:
                raw[key] = value(st.sampled_from(["p-1", []]))
        elif draw(st.integers(0, 9)):
            raw[key] = value(st.sampled_from(["t-1", "r-1"]))
    return raw


def _read_input(read: Any, raw: Any) -> Any:
    try:
        return json.dumps(read(raw))  # in order: the record keeps the text
    except agui.InvalidInput as exc:
        return str(exc)


@settings(max_examples=3000, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=_run_inputs())
def test_plain_run_inputs_read_as_validated(raw: Any) -> None:
    """A RunAgentInput of plain strings is dumped without running ag-ui's
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
