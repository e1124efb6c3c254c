"""The link's short road for its commonest frames (frames.plain_report,
plain_finish, plain_ok; LinkMachine.receive taking them without a model) is
held equal to the long road (frames.decode_object, LinkMachine._read): the
same fields, the same actions, the same errors and the same state after,
for objects made to sit on the edge of what decodes."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from funduq_trio import identity
from funduq_trio.protocol import frames as f
from funduq_trio.protocol import link as L

FUNDUQ = identity.Identity.from_private_hex("d1" * 32)
PROVIDER = identity.Identity.from_private_hex("a5" * 32)
NONCE = "b7" * 16
PNONCE = "c9" * 16

# Strings on every edge a field has: empty, the id limit, non-ASCII, a lone
# surrogate (pydantic refuses it where it validates a string).
_strings = st.one_of(
    st.sampled_from(
        [
            "",
            "r1",
            "o1",
            "o2",
            "x" * f.MAX_ID_CHARS,
            "x" * (f.MAX_ID_CHARS + 1),
            "é",
            "run-\ud800",
            "accepted",
            "declined",
            "refused",
            "report",
            "finish",
            "ok",
        ]
    ),
    st.text(max_size=6),
)
_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-3, max_value=3),
    st.sampled_from([2**64, 1.0, 0.5]),
    _strings,
)
_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(_strings, inner, max_size=3)
    ),
    max_leaves=6,
)
#: Values on the edge of what some field takes.
_EDGES = st.sampled_from(
    [0, 1, -1, 2**64, True, False, None, 1.0, "", "r1", "é", "run-\ud800", "x" * 257, {}, []]
)
_KEYS = {
    "report": ["runId", "event", "seq"],
    "finish": ["runId"],
    "ok": ["id", "verdict", "reason", "payload"],
}
_ODD_KEYS = ["kind", "run_id", "id", "runId", "extra"]


@st.composite
def _frames(draw: st.DrawFn) -> dict[str, Any]:
    """A well-formed report, finish or ok, then bent in at most two places
    (mostly its own fields): a key dropped, or a value swapped for anything."""
    kind = draw(st.sampled_from(["report", "finish", "ok"]))
    obj: dict[str, Any] = {"kind": kind}
    if kind == "report":
        seq = draw(st.sampled_from([1, 7, None, "absent"]))
        obj.update(runId="r1", event={"type": "TEXT_MESSAGE_CONTENT", "delta": "hi"})
        if seq != "absent":
            obj["seq"] = seq
    elif kind == "finish":
        obj.update(runId="r1")
    else:
        obj.update(id=draw(st.sampled_from(["o1", "o2", "o3"])))
        obj.update(verdict=draw(st.sampled_from(["accepted", "declined", "refused", None])))
        obj.update(reason=draw(st.sampled_from([None, "busy", ""])))
        if draw(st.booleans()):
            obj["payload"] = None
    for _ in range(draw(st.integers(min_value=0, max_value=2))):
        key = draw(st.sampled_from(_KEYS[kind] * 3 + _ODD_KEYS))
        if draw(st.integers(min_value=0, max_value=3)) == 0:
            obj.pop(key, None)
        else:
            obj[key] = draw(st.one_of(_EDGES, _values))
    return obj


def _attached() -> L.LinkMachine:
    m = L.LinkMachine(FUNDUQ, NONCE)
    proof = PROVIDER.sign(identity.provider_connect_payload(FUNDUQ.public_key_hex, NONCE, PNONCE))
    connect = f.Connect(public_key=PROVIDER.public_key_hex, nonce=PNONCE, proof=proof)
    m.receive(f.encode_frame(connect))
    run = {"runId": "r1", "threadId": "t1", "agentName": "echo", "runInput": {}}
    m.offer("o1", run)
    m.offer("o2", run)
    m.receive('{"kind":"ok","id":"o2","verdict":"declined"}')  # o2: answered once
    assert m.state is L.State.ATTACHED
    return m


def _long_road(obj: dict[str, Any]) -> Any:
    try:
        return f.decode_object(obj, accept=f.FROM_PROVIDER)
    except f.FrameError as exc:
        return exc


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(_frames())
def test_plain_readers_take_only_what_decodes_and_read_it_alike(obj: dict[str, Any]) -> None:
    frame = _long_road(obj)
    report, finish, ok = f.plain_report(obj), f.plain_finish(obj), f.plain_ok(obj)
    assert [report, finish, ok].count(None) >= 2
    if report is not None:
        assert isinstance(frame, f.Report)
        assert report == (frame.run_id, frame.event, frame.seq)
    if finish is not None:
        assert isinstance(frame, f.Finish)
        assert finish == frame.run_id
    if ok is not None:
        assert isinstance(frame, f.Ok)
        assert ok == (frame.id, frame.verdict, frame.reason)


def _state(m: L.LinkMachine) -> Any:
    return (
        m.state,
        m.close_reason,
        dict(m._outstanding),
        list(m._answered),
        m._detached,
    )


@settings(max_examples=600, suppress_health_check=[HealthCheck.too_slow])
@given(_frames(), st.booleans())
def test_the_machine_acts_on_a_frame_as_the_long_road_does(
    obj: dict[str, Any], ascii_only: bool
) -> None:
    text = json.dumps(obj, ensure_ascii=ascii_only)
    short, long = _attached(), _attached()
    assert short.receive(text) == long._read(text)
    assert _state(short) == _state(long)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(_frames(), st.booleans())
def test_take_gives_a_bare_report_only_where_the_long_road_reports(
    obj: dict[str, Any], ascii_only: bool
) -> None:
    # The provider socket's reader takes a plain report as a bare tuple
    # (`LinkMachine.take`): it must be the long road's one Report, and
    # anything else the long road's actions.
    text = json.dumps(obj, ensure_ascii=ascii_only)
    short, long = _attached(), _attached()
    got, want = short.take(text), long._read(text)
    if isinstance(got, tuple):
        assert want == [L.Report(*got)]
    else:
        assert got == want
    assert _state(short) == _state(long)


def test_messages_that_do_not_parse_are_answered_alike() -> None:
    for text in ["", "{", "\ufeff{}", "NaN", '{"kind":"report","seq":Infinity}', "[]", "3", b"{}"]:
        short, long = _attached(), _attached()
        assert short.receive(text) == long._read(text), text
        assert _state(short) == _state(long)


def test_parse_json_is_json_loads() -> None:
    for text in ['{"a":[1,2.5,null,true]}', '"\\ud800"', " 1 "]:
        assert f.parse_json(text) == json.loads(text)
    for bad in ["NaN", "-Infinity", "\ufeff1", "1 2", ""]:
        try:
            json.loads(bad, parse_constant=f._no_constants)
        except ValueError as exc:
            expected = str(exc)
        try:
            f.parse_json(bad)
        except ValueError as exc:
            assert str(exc) == expected
        else:  # pragma: no cover
            raise AssertionError(bad)


def _loads(text: str | bytes) -> tuple[str, str]:
    """What `json.loads` (with parse_constant) gives: its value's repr (1 and
    1.0, -0.0 and 0.0 told apart) or the exception's type and message."""
    try:
        return "value", repr(json.loads(text, parse_constant=f._no_constants))
    except (ValueError, RecursionError, TypeError) as exc:
        return type(exc).__name__, str(exc)


def _parse(text: str | bytes) -> tuple[str, str]:
    try:
        return "value", repr(f.parse_json(text))
    except (ValueError, RecursionError, TypeError) as exc:
        return type(exc).__name__, str(exc)


# JSON texts on the edges of the scanner's fast road: a whole value, then
# with whitespace, a BOM or a second value around it, cut short, with a
# constant, or with any characters at all.
_json_texts = st.one_of(
    st.builds(
        lambda value, before, after: before + json.dumps(value) + after,
        _values,
        st.sampled_from(["", " ", "\n", "\ufeff", "\t\r", "x", "1"]),
        st.sampled_from(["", " ", "\n ", "}", "]", ",", "1", " 2", "\x00", "\ufeff"]),
    ),
    st.builds(lambda value, cut: json.dumps(value)[:cut], _values, st.integers(0, 40)),
    st.builds(
        lambda value, c: json.dumps(value).replace("null", c, 1),
        _values,
        st.sampled_from(["NaN", "Infinity", "-Infinity", "nul", "1e999", "-0", "01"]),
    ),
    st.text(max_size=12),
    st.text(alphabet='{}[]":,0123456789.eE-+ truefalsn\\u\n', max_size=16),
)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(_json_texts)
def test_parse_json_is_json_loads_for_any_text(text: str) -> None:
    assert _parse(text) == _loads(text)


def test_parse_json_is_json_loads_on_deep_and_binary_input() -> None:
    deep = "[" * 100_000 + "]" * 100_000
    for text in [deep, deep + " ", '{"a":' * 50_000 + "1" + "}" * 50_000, b'{"a":1}', b"\xff"]:
        assert _parse(text) == _loads(text)


#: Batch items the short readers never take: each must be read (answered,
#: refused, or closing the link) as the long road reads it.
_ODD_ITEMS = st.sampled_from(
    [
        None,
        3,
        "report",
        [],
        {},
        {"kind": "batch", "frames": [{"kind": "finish", "runId": "r1"}]},
        {"kind": "connect", "id": "c1"},
        {"kind": "connect"},
        {"kind": "register", "id": "g1", "agents": [{"name": "echo"}]},
        {"kind": "register", "id": "g2"},
        {"kind": "nope", "id": "n1"},
        {"kind": "nope"},
        {"kind": "err", "id": "o1", "reason": "bad offer"},
        {"kind": "err", "reason": "about something"},
        {"kind": "query.threadMessages", "id": "q1", "threadId": "t1"},
    ]
)


@st.composite
def _batches(draw: st.DrawFn) -> dict[str, Any]:
    """A batch of bent frames and odd items; sometimes the batch itself bent
    (an extra key, no items, items that are not a list)."""
    items = draw(st.lists(st.one_of(_frames(), _frames(), _ODD_ITEMS), min_size=1, max_size=5))
    obj: dict[str, Any] = {"kind": "batch", "frames": items}
    bend = draw(st.integers(min_value=0, max_value=7))
    if bend == 0:
        obj["extra"] = 1
    elif bend == 1:
        obj["frames"] = []
    elif bend == 2:
        obj["frames"] = {"0": items[0]}
    elif bend == 3:
        del obj["frames"]
    return obj


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(_batches(), st.booleans())
def test_a_batch_is_read_as_the_long_road_reads_it(obj: dict[str, Any], ascii_only: bool) -> None:
    # A batch's items take the short readers where they can (LinkMachine._batch):
    # the same actions, in the same order, and the same state after, as the
    # long road's (every item through pydantic), a closing item included.
    text = json.dumps(obj, ensure_ascii=ascii_only)
    short, long = _attached(), _attached()
    assert short.take(text) == long._read(text)
    assert _state(short) == _state(long)


def test_a_batch_past_the_item_limit_is_refused_as_the_long_road_refuses_it() -> None:
    finish = {"kind": "finish", "runId": "r1"}
    for count in (f.MAX_BATCH_FRAMES, f.MAX_BATCH_FRAMES + 1):
        text = json.dumps({"kind": "batch", "frames": [finish] * count})
        short, long = _attached(), _attached()
        assert short.take(text) == long._read(text)
        assert _state(short) == _state(long)
