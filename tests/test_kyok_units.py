"""KYOK's pure parts: tokens, the call signature, the link machine's KYOK
frames, the settings, the secret file, and the SDK importing without openai."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys

import pytest
from test_link_machine import attached, closes, sent

from funduq_trio.broker.kyok import (
    KyokRefusal,
    check_call_signature,
    load_or_create_secret,
    mint_token,
    read_token,
)
from funduq_trio.config import Settings
from funduq_trio.identity import Identity, kyok_call_payload
from funduq_trio.protocol import frames as f
from funduq_trio.protocol import link as L

SECRET = b"s" * 32
AGENT = Identity.from_private_hex("a5" * 32)
REQUEST = {
    "runId": "run_1",
    "agent": {"providerKey": AGENT.public_key_hex, "name": "chat"},
    "llm": "fake",
    "body": {"model": "m"},
    "context": {"c": 1},
    "actorChain": None,
}


def test_a_token_round_trips_and_expires_exactly_at_exp():
    token = mint_token(SECRET, "run_1", "k/agent", 1000)
    first, mac = token.split(".")
    assert len(mac) == 64 and mac == mac.lower()
    assert "=" not in first
    grant = read_token(SECRET, token, 999.5)
    assert (grant.run_id, grant.agent, grant.exp) == ("run_1", "k/agent", 1000)
    with pytest.raises(KyokRefusal) as expired:
        read_token(SECRET, token, 1000)
    assert expired.value.status == 401


@pytest.mark.parametrize(
    "token",
    [
        None,
        "",
        "nodot",
        "a.b",
        "x" * 5000,
        mint_token(b"t" * 32, "run_1", "k/agent", 1000),  # another funduq's secret
        mint_token(SECRET, "run_1", "k/agent", 1000)[:-1] + "0",
        mint_token(SECRET, "run_1", "k/agent", 1000).upper(),
    ],
)
def test_a_token_that_does_not_verify_is_401(token):
    with pytest.raises(KyokRefusal) as refused:
        read_token(SECRET, token, 0)
    assert refused.value.status == 401


def test_a_token_whose_claims_are_not_a_grant_is_401():
    import base64
    import hashlib
    import hmac

    first = (
        base64.urlsafe_b64encode(json.dumps({"runId": 1, "agent": "a", "exp": 5}).encode())
        .rstrip(b"=")
        .decode()
    )
    token = first + "." + hmac.new(SECRET, first.encode(), hashlib.sha256).hexdigest()
    with pytest.raises(KyokRefusal):
        read_token(SECRET, token, 0)


def test_the_call_signature_is_fresh_and_covers_the_body():
    body = b'{"a":1}'
    sig = AGENT.sign(kyok_call_payload("tok", 1000, body))
    check_call_signature(AGENT.public_key_hex, "tok", "1000", sig, body, 1060)
    for args in [
        ("tok", "1000", sig, body, 1061),
        ("tok", "1000", sig, b"{}", 1000),
        ("tok2", "1000", sig, body, 1000),
        ("tok", "1000.0", sig, body, 1000),
        ("tok", None, sig, body, 1000),
        ("tok", "1000", None, body, 1000),
    ]:
        with pytest.raises(KyokRefusal) as refused:
            check_call_signature(AGENT.public_key_hex, *args)
        assert refused.value.status == 401


def test_kyok_frames_decode_and_batch():
    for kind in ("register.llm", "chunk", "completion.end", "completion.failed"):
        assert kind in f.FROM_PROVIDER and kind in f.IN_BATCH
    for kind in ("complete", "abandon"):
        assert kind in f.FROM_FUNDUQ and kind in f.IN_FUNDUQ_BATCH
    with pytest.raises(f.FrameError) as twice:
        f.decode_frame(
            json.dumps(
                {"kind": "register.llm", "id": "r", "offerings": [{"name": "a"}, {"name": "a"}]}
            )
        )
    assert twice.value.id == "r"
    with pytest.raises(f.FrameError):
        f.decode_frame('{"kind":"chunk","id":"c","data":7}')


def test_the_link_machine_relays_a_completion_and_ignores_what_crosses_an_abandon():
    m = attached()
    [frame] = sent(m.complete("c1", REQUEST))
    assert frame.kind == "complete" and frame.context == {"c": 1}
    assert m.receive('{"kind":"chunk","id":"c1","data":"x"}') == [L.Chunk("c1", "x")]
    assert m.receive('{"kind":"completion.end","id":"c1"}') == [L.CompletionEnd("c1")]
    assert m.receive('{"kind":"chunk","id":"c1","data":"late"}') == []
    sent(m.complete("c2", REQUEST))
    assert [fr.kind for fr in sent(m.abandon("c2"))] == ["abandon"]
    assert m.abandon("c2") == []
    assert m.receive('{"kind":"completion.failed","id":"c2","message":"m","refusal":null}') == []
    with pytest.raises(ValueError):
        m.complete("c1", REQUEST)
    assert m.receive(
        json.dumps(
            {
                "kind": "register.llm",
                "id": "r1",
                "offerings": [{"name": "fake", "description": None, "metadata": None}],
            }
        )
    ) == [L.RegisterLlm("r1", [{"name": "fake", "description": None, "metadata": None}])]


def test_a_chunk_for_a_completion_never_asked_closes_the_link():
    m = attached()
    actions = m.receive('{"kind":"chunk","id":"nope","data":"x"}')
    assert closes(actions) and m.state is L.State.CLOSED
    assert any(isinstance(a, L.Detach) for a in actions)


def test_settings_refuse_a_short_secret_and_a_bad_public_url(tmp_path):
    assert Settings(kyok_secret="x" * 32, public_url="https://funduq.example/base").problems() == []
    problems = Settings(kyok_secret="short", public_url="ftp://x").problems()
    assert any("FUNDUQ_KYOK_SECRET" in p for p in problems)
    assert any("FUNDUQ_PUBLIC_URL" in p for p in problems)
    assert Settings(public_url="http://h/?q=1").problems()


def test_the_generated_secret_is_kept_with_mode_0600(tmp_path):
    path = tmp_path / "data" / "kyok.secret"
    secret = load_or_create_secret(path)
    assert len(secret) == 64
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_or_create_secret(path) == secret


async def test_the_public_url_sets_the_grants_base_url(tmp_path):
    from support import running_server

    async with running_server(tmp_path, public_url="https://funduq.example/x/") as info:
        assert info.funduq.kyok.base_url == "https://funduq.example/x/kyok/v1"
    async with running_server(tmp_path) as info:
        assert info.funduq.kyok.base_url == info.url + "/kyok/v1"


def test_the_sdk_imports_without_openai_or_the_server():
    code = (
        "import sys; import funduq_trio.provider, funduq_trio.provider.llm_cli; "
        "bad = [m for m in ('openai', 'quart', 'hypercorn', 'funduq_trio.broker') "
        "if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
