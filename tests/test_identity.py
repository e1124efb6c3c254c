"""Identity, signed payloads, actor chains and the authority rules.

Every vector in tests/data/contract-vectors.json is replayed byte for byte:
the payload our builder makes and the signature the test key gives over it.
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import re
import stat
from pathlib import Path

import pytest

from funduq_trio.broker import authority
from funduq_trio.broker.authority import (
    NOT_AUTHORIZED,
    check_cancel,
    check_resolution,
    check_signed_request,
    may_write,
    segment_head_of,
)
from funduq_trio.broker.errors import NotAuthorized
from funduq_trio.identity import (
    Identity,
    IdentityFileError,
    InvalidActorChain,
    cancel_payload,
    delegation_payload,
    dispatch_hop,
    fingerprint_of,
    funduq_connect_payload,
    kyok_call_payload,
    make_hop,
    new_nonce,
    provider_connect_payload,
    resolve_payload,
    timestamp_digits,
    verify,
    verify_chain,
    verify_chain_claims,
)

DATA = Path(__file__).parent / "data" / "contract-vectors.json"
SHARED = Path(__file__).resolve().parents[2] / "shared/vectors/contract-vectors.json"
VECTORS = json.loads(DATA.read_text("utf-8"))
TEST_KEY = VECTORS["test_key"]
CHAIN = VECTORS["chains"][0]

TS = 1755500000
RUN = "run_2c26b46b68ffc68ff99b453c"


def _build(kind: str, inputs: dict, *, as_float: bool = False) -> str:
    def ts(value: int) -> int | float:
        return float(value) if as_float else value

    if kind == "kyok-call":
        return kyok_call_payload(
            inputs["bearer"], ts(inputs["timestamp"]), inputs["body_utf8"].encode("utf-8")
        )
    if kind == "provider-connect":
        return provider_connect_payload(
            inputs["funduq_public_key"], inputs["funduq_nonce"], inputs["provider_nonce"]
        )
    if kind == "funduq-connect":
        return funduq_connect_payload(inputs["funduq_nonce"], inputs["provider_nonce"])
    if kind == "delegation":
        return delegation_payload(inputs["delegate_public_key"], ts(inputs["expires_at"]))
    if kind == "resolution":
        return resolve_payload(inputs["run_id"], ts(inputs["timestamp"]))
    if kind == "cancel":
        return cancel_payload(inputs["run_id"], ts(inputs["timestamp"]))
    raise AssertionError(f"no payload builder for vector kind {kind!r}: add one")


@pytest.fixture(scope="module")
def test_identity() -> Identity:
    return Identity.from_private_hex(TEST_KEY["private_key_hex"])


@pytest.fixture(scope="module")
def other() -> Identity:
    return Identity.from_private_hex("b6" * 32)


@pytest.fixture(scope="module")
def stranger() -> Identity:
    return Identity.from_private_hex("c7" * 32)


# --- the vectors file --------------------------------------------------------


def test_vector_copy_matches_shared_original():
    if not SHARED.exists():
        pytest.skip(f"{SHARED} not present beside the repository")
    assert DATA.read_bytes() == SHARED.read_bytes()


def test_vectors_cover_every_payload_kind():
    kinds = {v["kind"] for v in VECTORS["vectors"]}
    assert kinds == {
        "kyok-call",
        "provider-connect",
        "funduq-connect",
        "delegation",
        "resolution",
        "cancel",
    }


def test_test_key_public_half_and_fingerprint(test_identity):
    assert test_identity.public_key_hex == TEST_KEY["public_key_hex"]
    expected = hashlib.sha256(bytes.fromhex(TEST_KEY["public_key_hex"])).hexdigest()[:16]
    assert test_identity.fingerprint == expected
    assert fingerprint_of(TEST_KEY["public_key_hex"]) == expected
    assert len(expected) == 16


@pytest.mark.parametrize("vector", VECTORS["vectors"], ids=lambda v: v["kind"])
def test_vector_payload_and_signature(vector, test_identity):
    payload = _build(vector["kind"], vector["inputs"])
    assert payload.encode("utf-8") == vector["payload_utf8"].encode("utf-8")
    signature = test_identity.sign(payload)
    assert signature == vector["signature_hex"]
    assert test_identity.sign(payload.encode("utf-8")) == vector["signature_hex"]
    assert verify(TEST_KEY["public_key_hex"], payload, vector["signature_hex"])
    assert verify(TEST_KEY["public_key_hex"], payload.encode(), vector["signature_hex"])
    assert not verify(TEST_KEY["public_key_hex"], payload + "x", vector["signature_hex"])


@pytest.mark.parametrize("vector", VECTORS["vectors"], ids=lambda v: v["kind"])
def test_vector_payload_from_integral_float_timestamps(vector):
    assert _build(vector["kind"], vector["inputs"], as_float=True) == vector["payload_utf8"]


def test_kyok_body_hash_is_the_vectors():
    (vector,) = [v for v in VECTORS["vectors"] if v["kind"] == "kyok-call"]
    body = vector["inputs"]["body_utf8"].encode("utf-8")
    assert hashlib.sha256(body).hexdigest() == vector["inputs"]["body_sha256_hex"]
    assert vector["payload_utf8"].endswith(":" + vector["inputs"]["body_sha256_hex"])


def test_provider_connect_without_funduq_key():
    assert provider_connect_payload(None, "aa", "bb") == "funduq-connect-provider::aa:bb"
    assert provider_connect_payload("", "aa", "bb") == "funduq-connect-provider::aa:bb"


@pytest.mark.parametrize(
    "value, digits",
    [(TS, "1755500000"), (float(TS), "1755500000"), (0, "0"), (-5.0, "-5")],
)
def test_timestamp_digits(value, digits):
    assert timestamp_digits(value) == digits


@pytest.mark.parametrize(
    "value", [1755500000.5, "1755500000", True, None, math.nan, math.inf, [TS]]
)
def test_timestamp_digits_refuses_non_integers(value):
    with pytest.raises(ValueError):
        timestamp_digits(value)
    with pytest.raises(ValueError):
        cancel_payload(RUN, value)


# --- keys ----------------------------------------------------------------------


def test_generate_signs_and_verifies():
    a, b = Identity.generate(), Identity.generate()
    assert a.public_key_hex != b.public_key_hex
    assert len(a.public_key_hex) == 64 and a.public_key_hex == a.public_key_hex.lower()
    sig = a.sign("hello")
    assert len(sig) == 128 and sig == sig.lower()
    assert verify(a.public_key_hex, b"hello", sig)
    assert not verify(b.public_key_hex, b"hello", sig)
    assert "private" not in repr(a) and a.fingerprint in repr(a)


@pytest.mark.parametrize("bad", ["", "a5" * 31, "a5" * 33, "zz" * 32, "a5 " * 32, None])
def test_from_private_hex_refuses_bad_keys(bad):
    with pytest.raises(ValueError):
        Identity.from_private_hex(bad)


@pytest.mark.parametrize(
    "key, payload, sig",
    [
        (None, b"x", "00" * 64),
        ("zz" * 32, b"x", "00" * 64),
        ("29e5", b"x", "00" * 64),
        (TEST_KEY["public_key_hex"].upper(), b"x", "00" * 64),
        (TEST_KEY["public_key_hex"], b"x", None),
        (TEST_KEY["public_key_hex"], b"x", "00" * 63),
        (TEST_KEY["public_key_hex"], b"x", "0g" * 64),
        (TEST_KEY["public_key_hex"], 12345, "00" * 64),
        (TEST_KEY["public_key_hex"], None, "00" * 64),
        ("00" * 32, b"x", "00" * 64),
    ],
)
def test_verify_never_raises(key, payload, sig):
    assert verify(key, payload, sig) is False


IDENTITY_POINT_KEY = "01" + "00" * 31
IDENTITY_POINT_SIG = "01" + "00" * 63  # R = identity, S = 0: "valid" for any message


def test_small_order_key_forgery_is_refused():
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    # the premise: the library alone accepts this forgery for any message
    raw = Ed25519PublicKey.from_public_bytes(bytes.fromhex(IDENTITY_POINT_KEY))
    raw.verify(bytes.fromhex(IDENTITY_POINT_SIG), b"funduq-cancel:run_x:1")
    assert not verify(IDENTITY_POINT_KEY, "funduq-cancel:run_x:1", IDENTITY_POINT_SIG)


@pytest.mark.parametrize(
    "key",
    [
        "00" * 32,
        "01" + "00" * 31,
        "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
        "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",
        "ec" + "ff" * 30 + "7f",
        "ed" + "ff" * 30 + "7f",
        "ee" + "ff" * 30 + "7f",
        "00" * 31 + "80",  # sign bit set
        "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac03fa",
    ],
)
def test_small_order_keys_never_verify(key):
    for sig in ("00" * 64, IDENTITY_POINT_SIG, key + "00" * 32):
        assert not verify(key, b"x", sig)


def test_chain_hop_under_small_order_key_is_refused():
    signing_input = (
        _segment({"alg": "EdDSA", "typ": "JWT"})
        + "."
        + _segment({"actorPublicKey": IDENTITY_POINT_KEY, "prevHash": None})
    )
    sig = base64.urlsafe_b64encode(bytes.fromhex(IDENTITY_POINT_SIG)).rstrip(b"=").decode()
    _expect_invalid([signing_input + "." + sig], "not signed")


def test_cancel_under_small_order_key_is_refused():
    proof = {"publicKey": IDENTITY_POINT_KEY, "timestamp": TS, "signature": IDENTITY_POINT_SIG}
    with pytest.raises(NotAuthorized):
        check_cancel(proof, RUN, [IDENTITY_POINT_KEY], now=TS)


def test_verify_refuses_uppercase_signature(test_identity):
    sig = test_identity.sign("p")
    assert verify(test_identity.public_key_hex, "p", sig)
    assert not verify(test_identity.public_key_hex, "p", sig.upper())


def test_new_nonce_is_fresh_hex():
    a, b = new_nonce(), new_nonce()
    assert a != b
    assert len(a) == 32 and bytes.fromhex(a) and a == a.lower()


def test_fingerprint_of_refuses_bad_key():
    with pytest.raises(ValueError):
        fingerprint_of("abc")


def test_load_or_create_creates_0600_then_loads(tmp_path):
    path = tmp_path / "sub" / "identity.key"
    first = Identity.load_or_create(path)
    assert path.exists()
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert Identity.load_or_create(path).public_key_hex == first.public_key_hex
    assert not [p for p in path.parent.iterdir() if p.name != "identity.key"]
    # the file holds the private key hex; the public key is derived from it
    again = Identity.from_private_hex(path.read_text())
    assert again.public_key_hex == first.public_key_hex


@pytest.mark.parametrize("content", [b"", b"not hex at all\n", b"a5" * 31, b"\xff\xfe"])
def test_load_or_create_refuses_corrupt_file(tmp_path, content):
    path = tmp_path / "identity.key"
    path.write_bytes(content)
    with pytest.raises(IdentityFileError, match="corrupt|cannot be read"):
        Identity.load_or_create(path)
    assert path.read_bytes() == content  # never silently replaced


# --- actor chains --------------------------------------------------------------


def _segment(value: dict) -> str:
    raw = json.dumps(value, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _hand_token(signer: Identity, header: dict, claims: dict) -> str:
    signing_input = _segment(header) + "." + _segment(claims)
    sig = bytes.fromhex(signer.sign(signing_input))
    return signing_input + "." + base64.urlsafe_b64encode(sig).rstrip(b"=").decode()


def _sha(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def test_chain_vector_verifies_to_its_keys():
    assert verify_chain(CHAIN["chain"]) == CHAIN["actor_public_keys"]
    assert segment_head_of(CHAIN["chain"]) == CHAIN["actor_public_keys"][0]


def test_make_hop_reproduces_chain_vector():
    first, second = (Identity.from_private_hex(k) for k in CHAIN["inputs"]["hop_private_keys_hex"])
    hop0 = make_hop(first, None)
    assert hop0 == CHAIN["chain"][0]
    hop1 = make_hop(second, hop0)
    assert hop1 == CHAIN["chain"][1]


def test_make_hop_refuses_reserved_claims(test_identity):
    with pytest.raises(ValueError):
        make_hop(test_identity, None, prevHash=None)
    with pytest.raises(ValueError):
        make_hop(test_identity, None, actorPublicKey="00" * 32)


def test_dispatch_hop_extends_chain(stranger):
    funduq = stranger
    provider_key = CHAIN["actor_public_keys"][1]
    hop = dispatch_hop(funduq, CHAIN["chain"][-1], provider_key, "echo")
    chain = CHAIN["chain"] + [hop]
    assert verify_chain(chain) == CHAIN["actor_public_keys"] + [funduq.public_key_hex]
    claims = verify_chain_claims(chain)[-1]
    assert claims == {
        "actorPublicKey": funduq.public_key_hex,
        "prevHash": _sha(CHAIN["chain"][-1]),
        "dispatchedTo": {"providerKey": provider_key, "name": "echo"},
    }
    # an unbound run: funduq's hop is hop 0
    assert verify_chain([dispatch_hop(funduq, None, provider_key, "échø")]) == [
        funduq.public_key_hex
    ]


def _expect_invalid(chain, reason_part: str):
    with pytest.raises(InvalidActorChain) as info:
        verify_chain(chain)
    assert reason_part in info.value.reason
    with pytest.raises(InvalidActorChain):
        segment_head_of(chain)


@pytest.mark.parametrize("chain", [[], None, "tok", {"0": "tok"}, tuple(CHAIN["chain"])])
def test_chain_must_be_nonempty_list(chain):
    _expect_invalid(chain, "non-empty list")


def test_chain_of_non_strings():
    _expect_invalid([CHAIN["chain"][0], 7], "hop 1 is not a string")


def test_reordered_chain():
    _expect_invalid(list(reversed(CHAIN["chain"])), "hop 0 must have a null prevHash")


def test_chain_missing_its_head():
    _expect_invalid(CHAIN["chain"][1:], "hop 0 must have a null prevHash")


def test_spliced_chain(stranger, other):
    foreign_head = make_hop(stranger, None)
    spliced_tail = make_hop(other, foreign_head)
    _expect_invalid([CHAIN["chain"][0], spliced_tail], "hop 1 does not follow hop 0")
    # a hop that skips one
    third = make_hop(stranger, CHAIN["chain"][0])
    _expect_invalid([CHAIN["chain"][0], CHAIN["chain"][1], third], "does not follow")


def test_forged_hop_claims_someone_elses_key(stranger):
    forged = _hand_token(
        stranger,
        {"alg": "EdDSA", "typ": "JWT"},
        {"actorPublicKey": TEST_KEY["public_key_hex"], "prevHash": None},
    )
    _expect_invalid([forged], "not signed by its actorPublicKey")


def test_tampered_claims():
    header, claims, sig = CHAIN["chain"][0].split(".")
    decoded = json.loads(base64.urlsafe_b64decode(claims + "=="))
    decoded["actorPublicKey"] = CHAIN["actor_public_keys"][1]
    _expect_invalid([f"{header}.{_segment(decoded)}.{sig}"], "not signed")


def test_tampered_signature():
    header, claims, sig = CHAIN["chain"][0].split(".")
    flipped = ("A" if sig[0] != "A" else "B") + sig[1:]
    _expect_invalid([f"{header}.{claims}.{flipped}"], "not signed")
    _expect_invalid([f"{header}.{claims}."], "not signed")


def test_signature_swapped_between_hops():
    h0, c0, _ = CHAIN["chain"][0].split(".")
    _, _, s1 = CHAIN["chain"][1].split(".")
    _expect_invalid([f"{h0}.{c0}.{s1}"], "not signed")


@pytest.mark.parametrize(
    "header",
    [
        {"alg": "none", "typ": "JWT"},
        {"alg": "HS256", "typ": "JWT"},
        {"typ": "JWT"},
        {"alg": "EdDSA", "typ": "JWE"},
    ],
)
def test_wrong_alg(test_identity, header):
    token = _hand_token(
        test_identity, header, {"actorPublicKey": test_identity.public_key_hex, "prevHash": None}
    )
    _expect_invalid([token], "not an EdDSA JWT")


_B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"


def _parts(token: str) -> list[str]:
    return token.split(".")


@pytest.mark.parametrize(
    "mangle",
    [
        pytest.param(lambda t: t + ".x", id="four segments"),
        pytest.param(lambda t: t.rsplit(".", 1)[0], id="two segments"),
        pytest.param(lambda t: "!!!" + t, id="not base64url"),
        pytest.param(lambda t: t.replace(".", "==.", 1), id="padded"),
        pytest.param(lambda t: "W10." + t.split(".", 1)[1], id="header a JSON list"),
        pytest.param(lambda t: "bm90anNvbg." + t.split(".", 1)[1], id="header not JSON"),
        pytest.param(lambda t: _parts(t)[0] + ".e30." + _parts(t)[2], id="claims empty object"),
        pytest.param(
            # same signature bytes, spelled with different unused trailing bits
            lambda t: t[:-1] + _B64[_B64.index(t[-1]) ^ 1],
            id="non-canonical base64url",
        ),
    ],
)
def test_bad_jwt_structure(mangle):
    _expect_invalid([mangle(CHAIN["chain"][0])], "hop 0")


def test_claims_need_key_and_prev_hash(test_identity):
    header = {"alg": "EdDSA", "typ": "JWT"}
    no_prev = _hand_token(test_identity, header, {"actorPublicKey": test_identity.public_key_hex})
    _expect_invalid([no_prev], "no prevHash")
    bad_key = _hand_token(test_identity, header, {"actorPublicKey": 5, "prevHash": None})
    _expect_invalid([bad_key], "no valid actorPublicKey")


# --- authority: signed cancels and answers -------------------------------------


HEAD = TEST_KEY["public_key_hex"]


def _proof(identity: Identity, run_id: str = RUN, ts: float = TS, build=cancel_payload):
    return {
        "publicKey": identity.public_key_hex,
        "timestamp": ts,
        "signature": identity.sign(build(run_id, ts)),
    }


def test_cancel_by_segment_head_and_by_provider(test_identity, other):
    allowed = authority.authorized_keys(HEAD, other.public_key_hex)
    assert check_cancel(_proof(test_identity), RUN, allowed, now=TS) == HEAD
    assert check_cancel(_proof(other), RUN, allowed, now=TS) == other.public_key_hex


def test_vector_cancel_signature_is_accepted():
    (vector,) = [v for v in VECTORS["vectors"] if v["kind"] == "cancel"]
    proof = {"publicKey": HEAD, "timestamp": TS, "signature": vector["signature_hex"]}
    assert check_cancel(proof, vector["inputs"]["run_id"], [HEAD], now=TS + 30) == HEAD


def test_resolution(test_identity):
    proof = _proof(test_identity, build=resolve_payload)
    assert check_resolution(proof, RUN, [HEAD], now=TS) == HEAD
    with pytest.raises(NotAuthorized):  # a resolution is not a cancel
        check_cancel(proof, RUN, [HEAD], now=TS)
    with pytest.raises(NotAuthorized):  # and a cancel is not a resolution
        check_resolution(_proof(test_identity), RUN, [HEAD], now=TS)


@pytest.mark.parametrize("offset", [0, 1, 59, 60, -1, -60, 60.0, -59.5])
def test_window_inside(test_identity, offset):
    assert check_cancel(_proof(test_identity), RUN, [HEAD], now=TS + offset) == HEAD


@pytest.mark.parametrize("offset", [61, -61, 60.001, -60.001, 3600, -3600, math.nan])
def test_window_outside(test_identity, offset):
    # offset > 0: the proof is that old; offset < 0: it is from the future
    with pytest.raises(NotAuthorized) as info:
        check_cancel(_proof(test_identity), RUN, [HEAD], now=TS + offset)
    assert str(info.value) == NOT_AUTHORIZED


def test_integral_float_timestamp_accepted(test_identity):
    # signed over the integer's digits, delivered as a double (protobuf Struct)
    proof = _proof(test_identity)
    proof["timestamp"] = float(TS)
    assert check_cancel(proof, RUN, [HEAD], now=TS) == HEAD
    signed_as_float = _proof(test_identity, ts=float(TS))
    assert signed_as_float["signature"] == proof["signature"]
    assert (
        check_resolution(
            _proof(test_identity, ts=float(TS), build=resolve_payload), RUN, [HEAD], now=TS + 60
        )
        == HEAD
    )


def test_custom_window(test_identity):
    with pytest.raises(NotAuthorized):
        check_cancel(_proof(test_identity), RUN, [HEAD], now=TS + 11, window=10)
    assert check_cancel(_proof(test_identity), RUN, [HEAD], now=TS + 10, window=10) == HEAD


def _bad_proofs(test_identity: Identity, stranger: Identity) -> dict[str, object]:
    good = _proof(test_identity)

    def without(field):
        return {k: v for k, v in good.items() if k != field}

    def with_(**changes):
        return {**good, **changes}

    sig = good["signature"]
    tampered = sig[:-1] + ("0" if sig[-1] != "0" else "1")
    return {
        "missing": None,
        "not a dict": "publicKey=...",
        "a list": [good["publicKey"], TS, sig],
        "empty dict": {},
        "no publicKey": without("publicKey"),
        "no timestamp": without("timestamp"),
        "no signature": without("signature"),
        "third key": _proof(stranger),
        "third key claiming the head": with_(signature=_proof(stranger)["signature"]),
        "61 s old": _proof(test_identity, ts=TS - 61),
        "61 s in the future": _proof(test_identity, ts=TS + 61),
        "another run id": _proof(test_identity, run_id="run_000000000000000000000000"),
        "tampered signature": with_(signature=tampered),
        "uppercase signature": with_(signature=sig.upper()),
        "uppercase key": with_(publicKey=HEAD.upper()),
        "fractional timestamp": with_(timestamp=TS + 0.5),
        "string timestamp": with_(timestamp=str(TS)),
        "bool timestamp": with_(timestamp=True),
        "signature not a string": with_(signature=None),
        "key not a string": with_(publicKey=7),
        "resolution signature": _proof(test_identity, build=resolve_payload),
    }


def test_every_bad_proof_refused_with_one_message(test_identity, stranger, other):
    allowed = [HEAD, other.public_key_hex]
    messages = {}
    for name, proof in _bad_proofs(test_identity, stranger).items():
        try:
            check_cancel(proof, RUN, allowed, now=TS)
        except NotAuthorized as exc:
            messages[name] = str(exc)
        else:
            pytest.fail(f"bad proof accepted: {name}")
    assert set(messages.values()) == {NOT_AUTHORIZED}, messages
    # and the good proof from the same helper passes, so the refusals are real
    assert check_cancel(_proof(test_identity), RUN, allowed, now=TS) == HEAD


def test_no_allowed_keys_refuses_everyone(test_identity):
    with pytest.raises(NotAuthorized, match="^" + re.escape(NOT_AUTHORIZED) + "$"):
        check_cancel(_proof(test_identity), RUN, [], now=TS)
    with pytest.raises(NotAuthorized):
        check_cancel(_proof(test_identity), RUN, [None], now=TS)


def test_check_signed_request_with_explicit_payload(test_identity):
    payload = cancel_payload(RUN, TS)
    proof = _proof(test_identity)
    assert check_signed_request(proof, payload, {HEAD}, now=TS) == HEAD
    with pytest.raises(NotAuthorized):
        check_signed_request(proof, cancel_payload("run_other", TS), {HEAD}, now=TS)


# --- authority: writing on a bound thread --------------------------------------


def test_may_write():
    provider = CHAIN["actor_public_keys"][1]
    assert may_write(None, None, provider)
    assert may_write(None, "ab" * 32, provider)
    assert may_write(HEAD, HEAD, provider)
    assert may_write(HEAD, provider, provider)
    assert not may_write(HEAD, None, provider)
    assert not may_write(HEAD, "ab" * 32, provider)


def test_a_writer_is_the_head_of_a_chain_that_verifies(stranger):
    """What the facade asks of a new utterance: its chain's head (the chain
    must verify, bound thread or not), then `may_write` for that head."""
    provider = "ab" * 32
    assert may_write(None, None, provider)
    assert segment_head_of(CHAIN["chain"]) == HEAD
    assert may_write(None, HEAD, provider) and may_write(HEAD, HEAD, provider)
    assert segment_head_of(CHAIN["chain"][:1]) == HEAD
    provider_chain = [make_hop(stranger, None)]
    assert segment_head_of(provider_chain) == stranger.public_key_hex
    assert may_write(HEAD, stranger.public_key_hex, stranger.public_key_hex)
    assert not may_write(HEAD, None, provider)
    assert not may_write(HEAD, stranger.public_key_hex, provider)
    # a malformed chain is refused before the thread is looked at
    with pytest.raises(InvalidActorChain):
        segment_head_of(list(reversed(CHAIN["chain"])))
