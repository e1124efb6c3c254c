"""The provider side's link machine (protocol/provider_link.py), with no trio
and no socket: funduq's messages in, actions out. funduq's frames are made
the way its own side makes them (frames.encode_frame, its identity's
signatures), so a handshake here is one funduq would conduct."""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

import pytest

from funduq_trio import identity
from funduq_trio.protocol import frames as f
from funduq_trio.protocol import link as L
from funduq_trio.protocol import provider_link as P

FUNDUQ = identity.Identity.from_private_hex("d1" * 32)
IMPOSTOR = identity.Identity.from_private_hex("e2" * 32)
PROVIDER = identity.Identity.from_private_hex("a5" * 32)
NONCE = "b7" * 16  # funduq's, in its hello
PNONCE = "c9" * 16  # the provider's, in its connect
AGENTS = [f.AgentSpec(name="echo")]
OFFERINGS = [f.LlmOffering(name="fake")]


def text(frame: Any) -> str:
    return f.encode_frame(frame)


def hello(key: str = FUNDUQ.public_key_hex, extensions: list[str] | None = None) -> str:
    return text(f.Hello(funduq_key=key, nonce=NONCE, extensions=extensions))


def connect_ok(signer: identity.Identity | None = FUNDUQ, *, pnonce: str = PNONCE) -> str:
    answer = None
    if signer is not None:
        answer = signer.sign(identity.funduq_connect_payload(NONCE, pnonce))
    return text(f.ConnectOk(answer=answer))


def machine(**kw: Any) -> P.ProviderLinkMachine:
    kw.setdefault("max_concurrent_runs", 2)
    return P.ProviderLinkMachine(PROVIDER, PNONCE, **kw)


def attached(extensions: list[str] | None = None, **kw: Any) -> P.ProviderLinkMachine:
    m = machine(**kw)
    m.receive(hello(extensions=extensions))
    assert m.receive(connect_ok()) == [P.Attached("batch" in (extensions or ()))]
    assert m.state is P.State.ATTACHED
    return m


def sent(actions: list[P.Action]) -> list[Any]:
    return [a.frame for a in actions if isinstance(a, P.Send)]


def ends(actions: list[P.Action]) -> list[P.End]:
    return [a for a in actions if isinstance(a, P.End)]


def offer(offer_id: str = "o1", run_id: str = "r1") -> f.Offer:
    run = {
        "runId": run_id,
        "threadId": "t1",
        "agentName": "echo",
        "runInput": {"threadId": "t1", "runId": run_id, "messages": []},
    }
    return f.Offer(id=offer_id, run=f.OfferRun.model_validate(run))


def complete(completion_id: str = "c1") -> f.Complete:
    return f.Complete.model_validate(
        {
            "kind": "complete",
            "id": completion_id,
            "runId": "r1",
            "agent": {"providerKey": PROVIDER.public_key_hex, "name": "echo"},
            "llm": "fake",
            "body": {"messages": []},
        }
    )


# --- the handshake ---------------------------------------------------------


def test_the_handshake_proves_this_key_over_this_connections_hello_and_attaches():
    m = machine()
    (connect,) = sent(m.receive(hello(extensions=["batch"])))
    assert m.state is P.State.AWAIT_CONNECT_OK
    assert isinstance(connect, f.Connect)
    assert (connect.public_key, connect.nonce) == (PROVIDER.public_key_hex, PNONCE)
    assert connect.max_concurrent_runs == 2 and connect.extensions == list(f.EXTENSIONS)
    payload = identity.provider_connect_payload(FUNDUQ.public_key_hex, NONCE, PNONCE)
    assert identity.verify(PROVIDER.public_key_hex, payload, connect.proof)
    assert m.receive(connect_ok()) == [P.Attached(peer_takes_batches=True)]
    assert m.state is P.State.ATTACHED


def test_the_connect_it_sends_is_accepted_by_funduqs_own_machine():
    """Both ends of the handshake, machine to machine: the proof verifies on
    funduq's side and funduq's answer verifies on this side."""
    server = L.LinkMachine(FUNDUQ, NONCE)
    m = machine()
    (connect,) = [a for a in m.receive(text(server.hello().frame)) if isinstance(a, P.Send)]
    replies = server.receive(connect.text)
    assert server.state is L.State.ATTACHED and server.peer_takes_batches
    (ok,) = [a.frame for a in replies if isinstance(a, L.Send)]
    assert m.receive(text(ok)) == [P.Attached(peer_takes_batches=True)]


# (what the pin is, what funduq says in hello, who signs connect.ok) -> outcome
HANDSHAKES = [
    ("unpinned, answer by the hello's key", None, FUNDUQ, FUNDUQ, None),
    ("pinned, answer by the pinned key", FUNDUQ, FUNDUQ, FUNDUQ, None),
    ("pinned key in upper case", "UPPER", FUNDUQ, FUNDUQ, None),
    ("unpinned, no answer at all", None, FUNDUQ, None, None),
    ("pinned, no answer to prove it", FUNDUQ, FUNDUQ, None, P.Fault.KEY_MISMATCH),
    ("unpinned, answer by another key", None, FUNDUQ, IMPOSTOR, P.Fault.KEY_MISMATCH),
    ("pinned, an impostor replays the key", FUNDUQ, FUNDUQ, IMPOSTOR, P.Fault.KEY_MISMATCH),
]


@pytest.mark.parametrize(
    ("pin", "presents", "signer", "fault"),
    [h[1:] for h in HANDSHAKES],
    ids=[h[0] for h in HANDSHAKES],
)
def test_connect_ok_is_verified(pin, presents, signer, fault):
    if pin == "UPPER":
        pin_key = FUNDUQ.public_key_hex.upper()
    else:
        pin_key = pin.public_key_hex if pin is not None else None
    m = machine(funduq_key=pin_key)
    assert sent(m.receive(hello(presents.public_key_hex)))
    actions = m.receive(connect_ok(signer))
    if fault is None:
        assert actions == [P.Attached(False)] and m.state is P.State.ATTACHED
    else:
        assert [e.fault for e in ends(actions)] == [fault] and m.state is P.State.CLOSED


def test_an_answer_over_another_connections_nonces_does_not_verify():
    m = machine()
    m.receive(hello())
    (end,) = m.receive(connect_ok(pnonce="ff" * 16))
    assert end == P.End(
        "funduq's connect.ok answer does not verify under its key", P.Fault.KEY_MISMATCH
    )


def test_a_pinned_key_mismatch_ends_the_link_before_anything_is_sent():
    m = machine(funduq_key=FUNDUQ.public_key_hex)
    actions = m.receive(hello(IMPOSTOR.public_key_hex))
    assert not sent(actions)  # no proof for a funduq we did not mean to reach
    (end,) = ends(actions)
    assert end.fault is P.Fault.KEY_MISMATCH and IMPOSTOR.public_key_hex in end.reason
    assert m.state is P.State.CLOSED and m.receive(connect_ok()) == []


def test_connect_err_is_a_rejection_carrying_funduqs_reason():
    m = machine()
    m.receive(hello())
    assert m.receive(text(f.ConnectErr(reason="key not allowed on this funduq"))) == [
        P.End("key not allowed on this funduq", P.Fault.CONNECT_REJECTED)
    ]
    assert m.state is P.State.CLOSED


# (state set up, message) -> the protocol error's words; the link closes
HANDSHAKE_VIOLATIONS = [
    ("hello", text(offer()), "expected hello, got 'offer'"),
    ("hello", text(f.ConnectOk()), "expected hello, got 'connect.ok'"),
    ("hello", "not json", "frame is not JSON"),
    ("hello", b"{}", "not binary"),
    ("hello", text(f.Report(run_id="r", event={})), "'report' is not a frame this side accepts"),
    ("connect.ok", hello(), "expected connect.ok, got 'hello'"),
    ("connect.ok", text(f.Cancel(run_id="r1")), "expected connect.ok, got 'cancel'"),
    ("connect.ok", '{"kind": "connect.ok", "answer": 7}', "does not validate"),
]


@pytest.mark.parametrize(("awaiting", "message", "words"), HANDSHAKE_VIOLATIONS)
def test_anything_else_during_the_handshake_is_a_protocol_error(awaiting, message, words):
    m = machine()
    if awaiting == "connect.ok":
        m.receive(hello())
    (end,) = m.receive(message)
    assert end.fault is None and end.reason.startswith("protocol error: ") and words in end.reason
    assert m.state is P.State.CLOSED and m.end_reason == end.reason


# --- attached: funduq's requests ---------------------------------------------------


# message -> the actions it becomes (the link stays up)
ATTACHED_INPUTS = [
    ("offer", text(offer()), [P.OfferArrived(offer())]),
    ("cancel", text(f.Cancel(run_id="r9")), [P.CancelArrived("r9")]),
    ("complete", text(complete()), [P.CompletionRequested(complete())]),
    ("abandon", text(f.Abandon(id="c1")), [P.CompletionAbandoned("c1")]),
    ("err without id", text(f.Err(reason="bad seq")), [P.Notice("funduq complained: bad seq")]),
    (
        "ok to an id never asked",
        text(f.Ok(id="register-9")),
        [P.Notice("funduq answered 'register-9', which this provider never asked")],
    ),
    (
        "err to an id never asked",
        text(f.Err(id="x", reason="no")),
        [P.Notice("funduq answered 'x', which this provider never asked")],
    ),
    ("undecodable, with an id", '{"kind": "offer", "id": "o7", "run": {}}', "err o7"),
    ("unknown kind, with an id", '{"kind": "teleport", "id": "t1"}', "err t1"),
    ("a provider's kind, with an id", text(f.Register(id="r", agents=[])), "err r"),
]


@pytest.mark.parametrize(
    ("message", "expected"), [i[1:] for i in ATTACHED_INPUTS], ids=[i[0] for i in ATTACHED_INPUTS]
)
def test_attached_inputs(message, expected):
    m = attached()
    actions = m.receive(message)
    if isinstance(expected, str):  # "err ID": answered err {id}, the link stays up
        (err,) = sent(actions)
        assert isinstance(err, f.Err) and err.id == expected.split()[1] and err.reason
        assert len(actions) == 1
    else:
        assert actions == expected
    assert m.state is P.State.ATTACHED


ATTACHED_VIOLATIONS = [
    ("a second hello", hello(), "unexpected 'hello' on an attached link"),
    ("connect.ok again", connect_ok(), "unexpected 'connect.ok' on an attached link"),
    ("connect.err", text(f.ConnectErr(reason="x")), "unexpected 'connect.err'"),
    ("undecodable, no id", '{"kind": "cancel"}', "'cancel' frame does not validate"),
    ("not json", "{", "frame is not JSON"),
    ("binary", b'{"kind": "cancel", "runId": "r"}', "not binary"),
]


@pytest.mark.parametrize(
    ("message", "words"),
    [v[1:] for v in ATTACHED_VIOLATIONS],
    ids=[v[0] for v in ATTACHED_VIOLATIONS],
)
def test_attached_protocol_violations_end_the_link(message, words):
    m = attached()
    (end,) = m.receive(message)
    assert end.fault is None and end.reason.startswith("protocol error: ") and words in end.reason
    assert m.state is P.State.CLOSED
    assert m.receive(text(offer())) == [] and m.connection_lost("gone") == []


# --- batches: the same reading as funduq's side --------------------------------------


def batch(*items: Any) -> str:
    return json.dumps(
        {
            "kind": "batch",
            "frames": [i if isinstance(i, (dict, list)) else json.loads(text(i)) for i in items],
        }
    )


def test_a_batch_means_its_frames_one_after_another():
    m = attached(["batch"])
    actions = m.receive(batch(offer("o1", "r1"), f.Cancel(run_id="r0"), offer("o2", "r2")))
    assert actions == [
        P.OfferArrived(offer("o1", "r1")),
        P.CancelArrived("r0"),
        P.OfferArrived(offer("o2", "r2")),
    ]
    assert m.outstanding_offers == {"o1", "o2"}


def test_a_bad_item_with_an_id_is_answered_err_and_the_batch_goes_on():
    m = attached(["batch"])
    actions = m.receive(
        batch(offer("o1"), {"kind": "offer", "id": "bad", "run": {}}, f.Cancel(run_id="r1"))
    )
    assert actions[0] == P.OfferArrived(offer("o1"))
    (err,) = sent(actions)
    assert err.id == "bad" and err.reason.startswith("batch item 1: ")
    assert actions[2] == P.CancelArrived("r1") and m.state is P.State.ATTACHED


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ({"kind": "cancel"}, "batch item 1: 'cancel' frame does not validate"),
        (
            {"kind": "batch", "frames": [json.loads(text(f.Cancel(run_id="r")))]},
            "batch item 1: 'batch' is not a frame this side accepts",
        ),  # a batch never nests
        (json.loads(hello()), "batch item 1: 'hello' is not a frame this side accepts"),
        ([1, 2], "batch item 1: frame is not a JSON object"),
    ],
)
def test_a_violation_mid_batch_ends_the_link_and_nothing_after_it_is_read(bad, words):
    m = attached(["batch"])
    actions = m.receive(batch(f.Cancel(run_id="r0"), bad, offer("o9")))
    cancel, end = actions
    assert cancel == P.CancelArrived("r0") and end.fault is None
    assert end.reason.startswith(f"protocol error: {words}") and m.state is P.State.CLOSED
    assert m.outstanding_offers == frozenset()  # o9 was never read


def test_both_sides_read_a_batch_through_the_one_rule():
    """The same nested batch, read by funduq's machine and the provider's:
    both refuse it with the same words (frames.read_message)."""
    nested = {"kind": "batch", "frames": [{"kind": "finish", "runId": "r"}]}
    server = L.LinkMachine(FUNDUQ, NONCE)
    proof = PROVIDER.sign(identity.provider_connect_payload(FUNDUQ.public_key_hex, NONCE, PNONCE))
    server.receive(text(f.Connect(public_key=PROVIDER.public_key_hex, nonce=PNONCE, proof=proof)))
    server_close = [
        a
        for a in server.receive(json.dumps({"kind": "batch", "frames": [nested]}))
        if isinstance(a, L.Close)
    ]
    m = attached(["batch"])
    (end,) = m.receive(json.dumps({"kind": "batch", "frames": [nested]}))
    assert end.reason == f"protocol error: {server_close[0].reason}"


def test_an_empty_or_oversized_batch_does_not_decode():
    m = attached(["batch"])
    (end,) = m.receive('{"kind": "batch", "frames": []}')
    assert "'batch' frame does not validate" in end.reason


# --- attached: replies to this side's requests ----------------------------------------


def test_request_ids_are_fresh_and_name_their_request():
    m = attached()
    llm_id, llm_actions = m.register_llm(OFFERINGS)
    reg_id, reg_actions = m.register(AGENTS)
    query_id, _ = m.query_thread_messages("t1", 5)
    assert (llm_id, reg_id, query_id) == ("register.llm-1", "register-2", "query-3")
    assert sent(llm_actions) == [f.RegisterLlm(id=llm_id, offerings=OFFERINGS)]
    assert sent(reg_actions) == [f.Register(id=reg_id, agents=AGENTS)]
    assert m.outstanding_requests == {
        llm_id: P.Request.REGISTER_LLM,
        reg_id: P.Request.REGISTER,
        query_id: P.Request.QUERY,
    }


# (request, reply) -> the actions (and whether the link ends with REGISTER_REJECTED)
REPLIES = [
    ("register ok", "register", f.Ok, [P.Registered()]),
    ("register err", "register", f.Err, [P.End("no agents", P.Fault.REGISTER_REJECTED)]),
    ("register.llm ok", "register.llm", f.Ok, []),
    ("register.llm err", "register.llm", f.Err, [P.End("no agents", P.Fault.REGISTER_REJECTED)]),
    ("query ok", "query", f.Ok, [P.QueryAnswered("ID", [{"role": "user"}])]),
    ("query err", "query", f.Err, [P.QueryAnswered("ID", None, "no agents")]),
]


@pytest.mark.parametrize(
    ("request_kind", "reply", "expected"), [r[1:] for r in REPLIES], ids=[r[0] for r in REPLIES]
)
def test_replies_to_this_sides_requests(request_kind, reply, expected):
    m = attached()
    ask = {
        "register": lambda: m.register(AGENTS),
        "register.llm": lambda: m.register_llm(OFFERINGS),
        "query": lambda: m.query_thread_messages("t1", None),
    }[request_kind]
    request_id, _ = ask()
    if reply is f.Ok:
        frame = f.Ok(id=request_id, payload={"messages": [{"role": "user"}]})
    else:
        frame = f.Err(id=request_id, reason="no agents")
    expected = [
        dataclasses.replace(a, request_id=request_id) if isinstance(a, P.QueryAnswered) else a
        for a in expected
    ]
    assert m.receive(text(frame)) == expected
    assert request_id not in m.outstanding_requests
    rejected = any(isinstance(a, P.End) for a in expected)
    assert m.state is (P.State.CLOSED if rejected else P.State.ATTACHED)
    if not rejected:  # a second reply to the same id: funduq answered twice
        assert m.receive(text(frame)) == [
            P.Notice(f"funduq answered {request_id!r}, which this provider never asked")
        ]


def test_a_query_reply_without_a_messages_list_reads_as_no_messages():
    m = attached()
    query_id, _ = m.query_thread_messages("t1", None)
    assert m.receive(text(f.Ok(id=query_id, payload="odd"))) == [P.QueryAnswered(query_id, [])]


def test_replies_in_a_batch_are_read_like_lone_ones():
    m = attached(["batch"])
    reg_id, _ = m.register(AGENTS)
    assert m.receive(batch(f.Ok(id=reg_id), offer("o1"))) == [
        P.Registered(),
        P.OfferArrived(offer("o1")),
    ]


# --- the runtime's sends ------------------------------------------------------------


def test_an_offer_is_answered_exactly_once():
    m = attached()
    m.receive(text(offer("o1")))
    (ok,) = sent(m.answer("o1", "refused", "agent 'x' is not served"))
    assert ok == f.Ok(id="o1", verdict="refused", reason="agent 'x' is not served")
    with pytest.raises(ValueError, match="not awaiting an answer"):
        m.answer("o1", "accepted")
    with pytest.raises(ValueError, match="not awaiting an answer"):
        m.answer("never-offered", "accepted")


def test_reports_and_chunks_are_flow_controlled_and_checked_before_they_leave():
    m = attached(max_frame_bytes=200)
    (send,) = m.report("r1", {"type": "RUN_STARTED", "threadId": "t", "runId": "r1"}, 1)
    assert send.flow and json.loads(send.text)["seq"] == 1
    assert m.chunk("c1", "data: {}")[0].flow
    assert not m.finish("r1")[0].flow and not m.completion_end("c1")[0].flow
    with pytest.raises(ValueError, match="cannot be carried by the link"):
        m.report("r1", {"type": "CUSTOM", "name": "n", "value": math.nan}, 2)
    with pytest.raises(ValueError, match="cannot be carried by the link"):
        m.report("r1", {"type": "CUSTOM", "name": "\ud800", "value": 1}, 2)
    with pytest.raises(ValueError, match="over the link's frame limit of 200"):
        m.report("r1", {"type": "CUSTOM", "name": "n", "value": "x" * 300}, 3)
    with pytest.raises(ValueError, match="over the link's frame limit of 200"):
        m.chunk("c1", "x" * 300)
    assert m.state is P.State.ATTACHED  # a bad event fails its run, not the link


def test_a_closed_link_sends_nothing():
    m = attached()
    m.receive(text(offer("o1")))
    assert m.connection_lost("link broken") == [P.End("link broken")]
    assert m.connection_lost("again") == [] and m.close("stopping") == []
    request_id, actions = m.query_thread_messages("t1", None)
    assert request_id and actions == [] and m.outstanding_requests == {}
    assert m.register(AGENTS)[1] == [] and m.answer("o1", "accepted") == []
    assert m.report("r1", {"type": "RUN_STARTED"}, 1) == [] and m.finish("r1") == []
    assert m.chunk("c1", "x") == [] and m.completion_failed("c1", "gone") == []


def test_the_runtime_may_close_before_the_handshake_ends():
    m = machine()
    m.receive(hello())
    assert m.close("stopping") == [P.End("stopping")] and m.state is P.State.CLOSED


# --- the table ------------------------------------------------------------------------


def test_every_state_is_reachable_and_only_the_table_moves_the_machine():
    targets = {P.State.AWAIT_HELLO} | set(P.TRANSITIONS.values())
    sources = {state for state, _ in P.TRANSITIONS}
    assert targets == set(P.State)
    assert P.State.CLOSED not in sources  # nothing leaves CLOSED
    m = attached()
    with pytest.raises(RuntimeError, match="no transition from ATTACHED on 'hello'"):
        m._move("hello")
