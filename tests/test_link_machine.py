"""The provider link's state machine and frames, with no sockets: frames in,
actions out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from funduq_trio import identity
from funduq_trio.protocol import frames as f
from funduq_trio.protocol import link as L

FUNDUQ = identity.Identity.from_private_hex("d1" * 32)
PROVIDER = identity.Identity.from_private_hex("a5" * 32)
OTHER = identity.Identity.from_private_hex("b6" * 32)
NONCE = "b7" * 16
PNONCE = "c9" * 16

RUN = {
    "runId": "run_1",
    "threadId": "thread_1",
    "agentName": "echo",
    "runInput": {"threadId": "thread_1", "runId": "run_1", "messages": [], "state": None},
    "metadata": None,
}


def machine(**kw) -> L.LinkMachine:
    return L.LinkMachine(FUNDUQ, NONCE, **kw)


def connect_text(
    who=PROVIDER, *, funduq_key=FUNDUQ.public_key_hex, nonce=NONCE, pnonce=PNONCE, max_runs=2
) -> str:
    proof = who.sign(identity.provider_connect_payload(funduq_key, nonce, pnonce))
    return f.encode_frame(
        f.Connect(
            public_key=who.public_key_hex, nonce=pnonce, proof=proof, max_concurrent_runs=max_runs
        )
    )


def attached(**kw) -> L.LinkMachine:
    m = machine(**kw)
    m.receive(connect_text())
    assert m.state is L.State.ATTACHED
    return m


def sent(actions):
    return [a.frame for a in actions if isinstance(a, L.Send)]


def closes(actions):
    return [a for a in actions if isinstance(a, L.Close)]


# --- frames -----------------------------------------------------------------


def test_frames_are_camel_case_with_nulls_kept():
    text = f.encode_frame(f.Ok(id="x", verdict="declined"))
    assert json.loads(text) == {
        "kind": "ok",
        "id": "x",
        "verdict": "declined",
        "reason": None,
        "payload": None,
    }
    offer = json.loads(f.encode_frame(f.Offer(id="o", run=f.OfferRun.model_validate(RUN))))
    assert offer["run"]["runInput"]["state"] is None  # a RunAgentInput keeps its nulls
    assert offer["run"]["metadata"] is None and offer["run"]["agentName"] == "echo"


def test_agui_event_models_travel_without_their_unset_fields():
    from ag_ui.core import CustomEvent, TextMessageContentEvent

    text = f.encode_frame(
        f.Report(run_id="r", event=TextMessageContentEvent(message_id="m", delta="hi"), seq=1)
    )
    assert json.loads(text)["event"] == {
        "type": "TEXT_MESSAGE_CONTENT",
        "messageId": "m",
        "delta": "hi",
    }
    custom = json.loads(
        f.encode_frame(f.Report(run_id="r", event=CustomEvent(name="n", value=None)))
    )
    assert custom["event"] == {"type": "CUSTOM", "name": "n", "value": None}
    assert custom["seq"] is None


@pytest.mark.parametrize(
    "text, reason_part, frame_id",
    [
        ("{", "not JSON", None),
        ("[1]", "not a JSON object", None),
        ('{"id": "q"}', "no string 'kind'", "q"),
        ('{"kind": "zap", "id": "q"}', "unknown frame kind 'zap'", "q"),
        ('{"kind": "ok", "id": "q", "verdict": "maybe"}', "verdict", "q"),
        ('{"kind": "report", "runId": 5, "event": {}}', "runId", None),
        ('{"kind": "offer", "id": "o", "run": {}}', "not a frame this side accepts", "o"),
        ('{"kind": "finish", "runId": NaN}', "not JSON", None),
    ],
)
def test_decode_errors_carry_reason_and_id(text, reason_part, frame_id):
    with pytest.raises(f.FrameError) as info:
        f.decode_frame(text, accept=f.FROM_PROVIDER)
    assert reason_part in info.value.reason
    assert info.value.id == frame_id


def test_decode_round_trips_every_kind():
    samples = [
        f.Hello(funduq_key="0" * 64, nonce="n"),
        f.Connect(public_key="1" * 64, nonce="n", proof="2" * 128, max_concurrent_runs=None),
        f.ConnectOk(answer=None),
        f.ConnectErr(reason="no"),
        f.Register(id="r", agents=[f.AgentSpec(name="echo", description="d", card={"a": 1})]),
        f.Offer(id="o", run=f.OfferRun.model_validate(RUN)),
        f.Ok(id="o", verdict="refused", reason="never"),
        f.Err(id=None, reason="bad"),
        f.Report(run_id="r", event={"type": "X", "v": None}, seq=3),
        f.Finish(run_id="r"),
        f.Cancel(run_id="r"),
        f.QueryThreadMessages(id="q", thread_id="t", limit=None),
        f.Batch(frames=[{"kind": "finish", "runId": "r"}]),
        # KYOK (DESIGN §9)
        f.RegisterLlm(id="l", offerings=[f.LlmOffering(name="fake", metadata={"a": 1})]),
        f.Complete(
            id="c",
            run_id="r",
            agent=f.CompleteAgent(provider_key="1" * 64, name="a"),
            llm="fake",
            body={"model": "m"},
            context=None,
            actor_chain=["t"],
        ),
        f.Chunk(id="c", data="x"),
        f.CompletionEnd(id="c"),
        f.CompletionFailed(id="c", message="m", refusal={"why": "no"}),
        f.Abandon(id="c"),
    ]
    for frame in samples:
        assert f.decode_frame(f.encode_frame(frame)) == frame
    assert {s.kind for s in samples} == f.KINDS


def test_register_rejects_duplicate_and_unsafe_agent_names():
    for agents in ([{"name": "a"}, {"name": "a"}], [{"name": "a/b"}], [{"name": ""}]):
        with pytest.raises(f.FrameError) as info:
            f.decode_frame(json.dumps({"kind": "register", "id": "r1", "agents": agents}))
        assert info.value.id == "r1"


# --- handshake --------------------------------------------------------------


def test_hello_carries_funduq_key_and_this_connections_nonce():
    hello = machine().hello().frame
    assert hello == f.Hello(funduq_key=FUNDUQ.public_key_hex, nonce=NONCE, extensions=["batch"])


def test_good_connect_attaches_and_answers_with_funduqs_signature():
    m = machine()
    actions = m.receive(connect_text(max_runs=3))
    assert m.state is L.State.ATTACHED
    assert actions[1] == L.Attach(PROVIDER.public_key_hex, 3)
    ok = actions[0].frame
    assert isinstance(ok, f.ConnectOk)
    assert identity.verify(
        FUNDUQ.public_key_hex, identity.funduq_connect_payload(NONCE, PNONCE), ok.answer
    )


def test_contract_vector_for_the_provider_proof():
    vectors = json.loads((Path(__file__).parent / "data" / "contract-vectors.json").read_text())
    vec = next(v for v in vectors["vectors"] if v["kind"] == "provider-connect")
    key = identity.Identity.from_private_hex(vectors["test_key"]["private_key_hex"])
    funduq_pub = vec["inputs"]["funduq_public_key"]

    class PinnedFunduq:
        public_key_hex = funduq_pub

        def sign(self, payload):
            return FUNDUQ.sign(payload)

    m = L.LinkMachine(PinnedFunduq(), vec["inputs"]["funduq_nonce"])
    text = f.encode_frame(
        f.Connect(
            public_key=key.public_key_hex,
            nonce=vec["inputs"]["provider_nonce"],
            proof=vec["signature_hex"],
        )
    )
    m.receive(text)
    assert m.state is L.State.ATTACHED


@pytest.mark.parametrize(
    "text, reason_part",
    [
        (
            connect_text(OTHER).replace(OTHER.public_key_hex, PROVIDER.public_key_hex),
            "proof does not verify",
        ),
        (connect_text(nonce="ee" * 16), "proof does not verify"),  # another connection's nonce
        (connect_text(funduq_key=OTHER.public_key_hex), "proof does not verify"),
        (connect_text(funduq_key=""), "proof does not verify"),
        (f.encode_frame(f.Register(id="r", agents=[])), "expected a 'connect' frame first"),
        ('{"kind": "connect"}', "does not validate"),
        ("nope", "not JSON"),
    ],
)
def test_bad_connects_answer_connect_err_and_close(text, reason_part):
    m = machine()
    actions = m.receive(text)
    assert m.state is L.State.CLOSED
    err = sent(actions)
    assert len(err) == 1 and isinstance(err[0], f.ConnectErr) and reason_part in err[0].reason
    assert closes(actions)[0].code == L.CLOSE_POLICY
    assert not any(isinstance(a, (L.Attach, L.Detach)) for a in actions)
    assert m.connection_lost() == []  # never attached: nothing to detach


def test_allowlist_refuses_other_keys_and_admits_listed_ones():
    m = machine(allowed_keys=frozenset({OTHER.public_key_hex}))
    actions = m.receive(connect_text())
    assert sent(actions)[0] == f.ConnectErr(reason="key not allowed on this funduq")
    m = machine(allowed_keys=frozenset({PROVIDER.public_key_hex}))
    m.receive(connect_text())
    assert m.state is L.State.ATTACHED


def test_oversized_frame_closes_with_1009():
    m = attached(max_frame_bytes=400)
    actions = m.receive(f.encode_frame(f.Report(run_id="r", event={"type": "X", "pad": "x" * 400})))
    assert closes(actions) == [L.Close("frame larger than 400 bytes", L.CLOSE_TOO_BIG)]
    assert L.Detach() in actions
    assert m.state is L.State.CLOSED
    # multi-byte characters count as bytes, not characters
    m = attached(max_frame_bytes=400)
    text = '{"kind":"finish","runId":"' + "é" * 250 + '"}'
    assert len(text) < 400 and closes(m.receive(text))
    m = attached(max_frame_bytes=400)
    assert m.receive('{"kind":"finish","runId":"' + "é" * 150 + '"}') == [L.Finish("é" * 150)]


# --- attached ---------------------------------------------------------------


def test_register_and_query_round_trip_through_the_broker_call():
    m = attached()
    reg = f.Register(id="r1", agents=[f.AgentSpec(name="echo", description="says it back")])
    (action,) = m.receive(f.encode_frame(reg))
    assert action == L.Register(
        "r1", [{"name": "echo", "description": "says it back", "card": None, "metadata": None}]
    )
    assert sent(m.register_done("r1")) == [f.Ok(id="r1")]
    assert sent(m.register_done("r1", error="bad card")) == [f.Err(id="r1", reason="bad card")]
    (q,) = m.receive(f.encode_frame(f.QueryThreadMessages(id="q1", thread_id="t", limit=2)))
    assert q == L.QueryThreadMessages("q1", "t", 2)
    assert sent(m.query_done("q1", [{"id": "m"}])) == [
        f.Ok(id="q1", payload={"messages": [{"id": "m"}]})
    ]


def test_offer_answer_is_forwarded_once_and_a_second_answer_closes():
    m = attached()
    (send,) = m.offer("offer_1", RUN)
    assert send.frame.id == "offer_1" and send.frame.run.run_id == "run_1"
    assert m.outstanding_offers == {"offer_1"}
    ok = f.encode_frame(f.Ok(id="offer_1", verdict="accepted", reason="ignored"))
    assert m.receive(ok) == [L.Answer("offer_1", "accepted", None)]
    assert m.outstanding_offers == frozenset()
    actions = m.receive(ok)
    assert "second answer" in closes(actions)[0].reason
    assert L.Detach() in actions and m.state is L.State.CLOSED


def test_refusal_reason_is_forwarded_verbatim():
    m = attached()
    m.offer("o1", RUN)
    why = "input does not validate as RunAgentInput: messages: Field required"
    assert m.receive(f.encode_frame(f.Ok(id="o1", verdict="refused", reason=why))) == [
        L.Answer("o1", "refused", why)
    ]


@pytest.mark.parametrize(
    "frame, reason_part",
    [
        (f.Ok(id="never", verdict="accepted"), "never made"),
        (f.Err(id="never", reason="x"), "never made"),
        (f.Ok(id="o1"), "no verdict"),
        (f.Ok(id="o1", verdict="refused"), "no reason"),
        (
            f.Connect(public_key=PROVIDER.public_key_hex, nonce="n", proof="0" * 128),
            "second 'connect'",
        ),
    ],
)
def test_protocol_violations_close_and_detach_once(frame, reason_part):
    m = attached()
    m.offer("o1", RUN)
    actions = m.receive(f.encode_frame(frame))
    (close,) = closes(actions)
    assert reason_part in close.reason and close.code == L.CLOSE_POLICY
    assert actions.count(L.Detach()) == 1
    assert m.connection_lost() == []  # detach is never repeated
    assert m.receive(f.encode_frame(f.Finish(run_id="r"))) == []
    assert m.offer("o2", RUN) == [] and m.cancel("run_1") == []


def test_undecodable_frame_with_an_id_is_answered_err_and_the_link_stays():
    m = attached()
    actions = m.receive('{"kind": "register", "id": "r9", "agents": "lots"}')
    (err,) = sent(actions)
    assert err.id == "r9" and "agents" in err.reason
    assert m.state is L.State.ATTACHED
    actions = m.receive('{"kind": "hello", "id": "h1", "funduqKey": "x"}')
    assert sent(actions)[0].id == "h1"


def test_undecodable_frame_without_an_id_closes():
    m = attached()
    actions = m.receive('{"kind": "report", "runId": "r"}')
    assert "does not validate" in closes(actions)[0].reason
    assert L.Detach() in actions
    m = attached()
    assert closes(m.receive(b"\x00binary"))


def test_err_answering_an_offer_settles_it_without_telling_the_broker():
    m = attached()
    m.offer("o1", RUN)
    assert m.receive(f.encode_frame(f.Err(id="o1", reason="cannot parse"))) == []
    assert m.outstanding_offers == frozenset()
    assert (
        "second answer"
        in closes(m.receive(f.encode_frame(f.Ok(id="o1", verdict="declined"))))[0].reason
    )


def test_err_without_id_is_ignored():
    m = attached()
    assert m.receive(f.encode_frame(f.Err(reason="your cancel confused me"))) == []
    assert m.state is L.State.ATTACHED


def test_reports_and_finishes_go_to_the_broker():
    m = attached()
    event = {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "hi"}
    assert m.receive(f.encode_frame(f.Report(run_id="run_1", event=event, seq=1))) == [
        L.Report("run_1", event, 1)
    ]
    assert m.receive(f.encode_frame(f.Finish(run_id="run_1"))) == [L.Finish("run_1")]


# --- batches ------------------------------------------------------------------


def batch(*frames) -> str:
    return f.batch_text([x if isinstance(x, str) else f.encode_frame(x) for x in frames])


def test_a_batch_means_its_frames_one_after_another():
    m = attached()
    m.offer("o1", RUN)
    event = {"type": "RUN_STARTED", "threadId": "thread_1", "runId": "run_1"}
    alone = attached()
    alone.offer("o1", RUN)
    frames = [
        f.Ok(id="o1", verdict="accepted"),
        f.Report(run_id="run_1", event=event, seq=1),
        f.Report(run_id="run_1", event=event, seq=2),
        f.Finish(run_id="run_1"),
        f.Register(id="reg", agents=[f.AgentSpec(name="echo")]),
    ]
    one_by_one = [a for frame in frames for a in alone.receive(f.encode_frame(frame))]
    assert m.receive(batch(*frames)) == one_by_one
    assert one_by_one[0] == L.Answer("o1", "accepted", None)
    assert one_by_one[1:4] == [
        L.Report("run_1", event, 1),
        L.Report("run_1", event, 2),
        L.Finish("run_1"),
    ]
    assert isinstance(one_by_one[4], L.Register)
    assert m.state is L.State.ATTACHED and m.outstanding_offers == frozenset()


def test_a_bad_item_with_an_id_is_answered_err_and_the_rest_of_the_batch_is_read():
    m = attached()
    actions = m.receive(
        batch('{"kind": "register", "id": "r9", "agents": "lots"}', f.Finish(run_id="run_1"))
    )
    (err,) = sent(actions)
    assert err.id == "r9" and err.reason.startswith("batch item 0: ")
    assert actions[-1] == L.Finish("run_1") and m.state is L.State.ATTACHED


@pytest.mark.parametrize(
    "items, reason_part",
    [
        (['{"kind": "report", "runId": "r"}'], "batch item 0: 'report' frame does not validate"),
        (["[1]"], "batch item 0: frame is not a JSON object"),
        ([batch(f.Finish(run_id="r"))], "'batch' is not a frame this side accepts"),
        ([connect_text()], "'connect' is not a frame this side accepts"),
        ([f.Ok(id="never", verdict="accepted")], "never made"),
    ],
)
def test_a_violation_inside_a_batch_closes_and_nothing_after_it_is_read(items, reason_part):
    m = attached()
    actions = m.receive(batch(*items, f.Finish(run_id="run_1")))
    (close,) = closes(actions)
    assert reason_part in close.reason
    assert L.Finish("run_1") not in actions and actions.count(L.Detach()) == 1
    assert m.state is L.State.CLOSED


@pytest.mark.parametrize(
    "text", ['{"kind": "batch", "frames": []}', '{"kind": "batch", "frames": {"a": 1}}']
)
def test_an_empty_or_shapeless_batch_closes(text):
    m = attached()
    assert "'batch' frame does not validate" in closes(m.receive(text))[0].reason


def test_a_batch_cannot_stand_in_for_connect():
    m = machine()
    actions = m.receive(batch(connect_text()))
    assert "expected a 'connect' frame first" in sent(actions)[0].reason
    assert m.state is L.State.CLOSED


def test_an_oversized_batch_closes_with_1009():
    m = attached(max_frame_bytes=1000)
    finish = f.encode_frame(f.Finish(run_id="run_1"))
    (close,) = closes(m.receive(batch(*[finish] * 40)))
    assert close.code == L.CLOSE_TOO_BIG


def test_cancel_frame_and_offer_id_reuse():
    m = attached()
    assert sent(m.cancel("run_1")) == [f.Cancel(run_id="run_1")]
    m.offer("o1", RUN)
    with pytest.raises(ValueError):
        m.offer("o1", RUN)


def test_broker_close_detaches_only_when_the_socket_is_gone():
    m = attached()
    assert m.close("replaced by a newer connection") == [
        L.Close("replaced by a newer connection", L.CLOSE_NORMAL)
    ]
    assert m.state is L.State.CLOSED
    assert m.close("again") == []
    assert m.connection_lost() == [L.Detach()]
    assert m.connection_lost() == []


def test_connection_lost_while_attached_detaches_once():
    m = attached()
    assert m.connection_lost() == [L.Detach()]
    assert m.connection_lost() == []
    assert m.state is L.State.CLOSED


def test_late_answer_for_an_offer_the_broker_gave_up_on_still_goes_to_the_broker():
    # The machine does not know what the broker gave up on: every outstanding
    # offer's first answer is forwarded; the broker ignores late ones.
    m = attached()
    m.offer("o1", RUN)
    m.offer("o2", {**RUN, "runId": "run_2"})
    assert m.receive(f.encode_frame(f.Ok(id="o2", verdict="declined"))) == [
        L.Answer("o2", "declined", None)
    ]
    assert m.receive(f.encode_frame(f.Ok(id="o1", verdict="accepted"))) == [
        L.Answer("o1", "accepted", None)
    ]


def test_every_transition_is_in_the_table():
    for (state, _), to in L.TRANSITIONS.items():
        assert isinstance(state, L.State) and isinstance(to, L.State)
    assert all(to is not L.State.AWAIT_CONNECT for to in L.TRANSITIONS.values())
