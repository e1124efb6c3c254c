"""The signed agent card and funduq's JWKS (issue 13 item 6), and the JOSE
helpers behind them: JCS agrees with a2a-sdk's own canonicalizer; the card's
signature verifies with the key from `/.well-known/jwks.json`, computed here
independently of funduq's code (the SDK's JCS, `cryptography`'s Ed25519)."""

from __future__ import annotations

import json
import struct
from typing import Any

import pytest
from a2a.types import a2a_pb2 as pb
from a2a.utils._jcs import canonicalize as sdk_canonicalize
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from google.protobuf.json_format import MessageToDict, ParseDict
from hypothesis import given
from hypothesis import strategies as st
from support import http_client
from test_a2a_door import a2a_door_mounted, broker_with_agents  # noqa: F401 (fixture)

from funduq_trio import jose
from funduq_trio.identity import Identity
from funduq_trio.protocol import a2a

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**53) + 1, 2**53 - 1)
    | st.text()
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=12,
)


@given(json_values)
def test_jcs_agrees_with_the_sdks_canonicalizer(value: Any) -> None:
    assert jose.canonical_json(value).decode("utf-8") == sdk_canonicalize(value)


def test_jcs_numbers_and_key_order() -> None:
    assert (
        jose.canonical_json(
            {"b": [1e21, 1.5e-6, 100.0, -0.0, 1e-7], "\u20ac": 1, "\U0001f600": 2, "a": "\n"}
        )
        == b'{"a":"\\n","b":[1e+21,0.0000015,100,0,1e-7],"\xe2\x82\xac":1,"\xf0\x9f\x98\x80":2}'
    )
    with pytest.raises(ValueError):
        jose.canonical_json(float("nan"))
    with pytest.raises(ValueError):
        jose.canonical_json(2**53)
    for bits in (0x7FEFFFFFFFFFFFFF, 0x0000000000000001, 0x4350000000000001):
        value = struct.unpack(">d", bits.to_bytes(8, "big"))[0]
        assert jose.canonical_json(value).decode() == sdk_canonicalize(value)


def test_compact_jws_round_trips_and_refuses_tampering() -> None:
    identity = Identity.generate()
    token = jose.compact_jws(identity, b'{"x":1}')
    header, payload = jose.verify_compact_jws(token, jose.jwk_of(identity))
    assert header == {"alg": "EdDSA", "kid": identity.fingerprint, "typ": "JWT"}
    assert payload == b'{"x":1}'
    protected, body, signature = token.split(".")
    other = jose.b64url(b'{"x":2}')
    forged = f"{protected}.{other}.{signature}"
    with pytest.raises(ValueError):
        jose.verify_compact_jws(forged, jose.jwk_of(identity))
    with pytest.raises(ValueError):
        jose.verify_compact_jws(token, jose.jwk_of(Identity.generate()))


def _without_empty(value: Any) -> Any:
    # A2A's canonical card drops empty strings, lists and objects (as the
    # SDK's verifier does before canonicalizing).
    if isinstance(value, dict):
        kept = {k: c for k, v in value.items() if (c := _without_empty(v)) is not None}
        return kept or None
    if isinstance(value, list):
        kept = [c for v in value if (c := _without_empty(v)) is not None]
        return kept or None
    return None if value == "" else value


def _b64url_decode(text: str) -> bytes:
    import base64

    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


async def test_the_card_is_signed_by_the_key_in_jwks(tmp_path) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        fp = agents.provider.fingerprint
        async with http_client(info) as http:
            served = (await http.get(f"/a2a/{fp}/echo/.well-known/agent-card.json")).json()
            jwks = (await http.get("/.well-known/jwks.json")).json()
    (key,) = jwks["keys"]
    assert key["kty"] == "OKP" and key["crv"] == "Ed25519"
    assert key["kid"] == info.funduq.identity.fingerprint
    assert served["capabilities"]["pushNotifications"] is True
    # What a client reads: the card as a 1.0 AgentCard.
    card = ParseDict(served, pb.AgentCard(), ignore_unknown_fields=True)
    (signature,) = card.signatures
    header = json.loads(_b64url_decode(signature.protected))
    assert header["alg"] == "EdDSA" and header["kid"] == key["kid"]
    unsigned = MessageToDict(card)
    unsigned.pop("signatures")
    canonical = sdk_canonicalize(_without_empty(unsigned)).encode("utf-8")
    signing_input = f"{signature.protected}.{jose.b64url(canonical)}".encode("ascii")
    public = Ed25519PublicKey.from_public_bytes(_b64url_decode(key["x"]))
    public.verify(_b64url_decode(signature.signature), signing_input)  # raises if bad
    # A changed card no longer verifies.
    card.description += "!"
    changed = MessageToDict(card)
    changed.pop("signatures")
    tampered = sdk_canonicalize(_without_empty(changed)).encode("utf-8")
    with pytest.raises(Exception):  # noqa: B017 - cryptography's InvalidSignature
        public.verify(
            _b64url_decode(signature.signature),
            f"{signature.protected}.{jose.b64url(tampered)}".encode("ascii"),
        )


async def test_a2a_sdks_own_verifier_accepts_the_served_card(tmp_path) -> None:
    from a2a.utils.signing import InvalidSignaturesError, create_signature_verifier
    from jwt.api_jwk import PyJWK

    async with broker_with_agents(tmp_path) as (info, agents):
        fp = agents.provider.fingerprint
        async with http_client(info) as http:
            served = (await http.get(f"/a2a/{fp}/echo/.well-known/agent-card.json")).json()
            (jwk,) = (await http.get("/.well-known/jwks.json")).json()["keys"]
    asked: list[Any] = []

    def key_of(kid: str | None, jku: str | None) -> PyJWK:
        asked.append(kid)
        return PyJWK(jwk)

    verify = create_signature_verifier(key_of, ["EdDSA"])
    card = ParseDict(served, pb.AgentCard(), ignore_unknown_fields=True)
    verify(card)
    assert asked == [jwk["kid"]]
    card.skills[0].description = "something else"
    with pytest.raises(InvalidSignaturesError):
        verify(card)


def test_the_card_declares_both_bindings() -> None:
    card = a2a.agent_card(
        name="echo", description="d", rpc_url="http://x/a2a/p/echo", rest_url="http://x/a2a/p/echo"
    )
    bindings = {(i["protocolBinding"], i["protocolVersion"]) for i in card["supportedInterfaces"]}
    assert bindings == {("JSONRPC", "1.0"), ("JSONRPC", "0.3"), ("HTTP+JSON", "1.0")}
