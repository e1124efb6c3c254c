"""The I/O-free rules of DESIGN §8: the two signed strings it adds (replayed
byte for byte from tests/data/access-vectors.json, a copy of
../shared/vectors/), the read proof header, spending proofs once, the hop
limit and the refusals that once crashed (deep claims, 400-digit timestamps).
The same behaviour through the real server is tests/test_access.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from funduq_trio.broker import authority
from funduq_trio.broker.errors import NotAuthorized, ProofsBusy
from funduq_trio.identity import (
    Identity,
    InvalidActorChain,
    _b64url,
    make_hop,
    present_payload,
    read_payload,
    verify,
    verify_chain,
)

DATA = Path(__file__).parent / "data" / "access-vectors.json"
SHARED = Path(__file__).resolve().parents[2] / "shared/vectors/access-vectors.json"
VECTORS = json.loads(DATA.read_text("utf-8"))
TEST_KEY = VECTORS["test_key"]
NOW = 1755500000.0


def _build(kind: str, inputs: dict, *, as_float: bool = False) -> str:
    ts = float(inputs["timestamp"]) if as_float else inputs["timestamp"]
    if kind == "read":
        return read_payload(inputs["thread_id"], ts)
    if kind == "present":
        return present_payload(
            inputs["provider_key"], inputs["agent_name"], inputs["message_id"], ts
        )
    raise AssertionError(f"no payload builder for vector kind {kind!r}: add one")


def test_vector_copy_matches_shared_original() -> None:
    if not SHARED.exists():
        pytest.skip(f"{SHARED} not present beside the repository")
    assert DATA.read_bytes() == SHARED.read_bytes()


def test_vectors_cover_both_new_payloads() -> None:
    assert {v["kind"] for v in VECTORS["vectors"]} == {"read", "present"}


@pytest.mark.parametrize("vector", VECTORS["vectors"], ids=lambda v: v["kind"])
def test_vector_payload_and_signature(vector: dict) -> None:
    identity = Identity.from_private_hex(TEST_KEY["private_key_hex"])
    assert identity.public_key_hex == TEST_KEY["public_key_hex"]
    payload = _build(vector["kind"], vector["inputs"])
    assert payload.encode("utf-8") == vector["payload_utf8"].encode("utf-8")
    assert _build(vector["kind"], vector["inputs"], as_float=True) == vector["payload_utf8"]
    assert identity.sign(payload) == vector["signature_hex"]
    assert verify(TEST_KEY["public_key_hex"], payload, vector["signature_hex"])


# --- read proofs ---------------------------------------------------------------


def header(signer: Identity, thread_id: str, ts: int = int(NOW)) -> str:
    return f"{signer.public_key_hex}:{ts}:{signer.sign(read_payload(thread_id, ts))}"


def test_a_read_proof_is_the_head_or_providers_fresh_signature_for_this_thread() -> None:
    head, provider, stranger = Identity.generate(), Identity.generate(), Identity.generate()
    keys = (head.public_key_hex, provider.public_key_hex)
    for signer in (head, provider):
        assert authority.check_read(header(signer, "t1"), "t1", keys, NOW) == signer.public_key_hex
    refused = {
        "no header": None,
        "a stranger": header(stranger, "t1"),
        "another thread": header(head, "t2"),
        "61 s old": header(head, "t1", int(NOW) - 61),
        "not three fields": "abc",
        "uppercase hex": header(head, "t1").upper(),
        "a signed timestamp": header(head, "t1").replace(f":{int(NOW)}:", f":+{int(NOW)}:"),
        "a 400-digit timestamp": f"{head.public_key_hex}:{'9' * 400}:{'0' * 128}",
    }
    for what, value in refused.items():
        with pytest.raises(NotAuthorized) as err:
            authority.check_read(value, "t1", keys, NOW)
        assert str(err.value) == authority.NOT_AUTHORIZED, what


def test_a_listing_proof_names_any_key_over_the_empty_thread_id() -> None:
    caller = Identity.generate()
    assert authority.check_listing(header(caller, ""), NOW) == caller.public_key_hex
    with pytest.raises(NotAuthorized):
        authority.check_listing(header(caller, "t1"), NOW)  # a thread's read proof is not one


# --- spent once ------------------------------------------------------------------


def test_every_kind_of_proof_works_once_and_its_reuse_reads_as_a_bad_proof() -> None:
    head = Identity.generate()
    keys = (head.public_key_hex,)
    spent = authority.SpentProofs(100)
    ts = int(NOW)
    cancel = {
        "publicKey": head.public_key_hex,
        "timestamp": ts,
        "signature": head.sign(f"funduq-cancel:r1:{ts}"),
    }
    resolution = {
        "publicKey": head.public_key_hex,
        "timestamp": ts,
        "signature": head.sign(f"funduq-resolve:r1:{ts}"),
    }
    checks = [
        lambda: authority.check_cancel(cancel, "r1", keys, NOW, spent=spent),
        lambda: authority.check_resolution(resolution, "r1", keys, NOW, spent=spent),
        lambda: authority.check_read(header(head, "t1"), "t1", keys, NOW, spent),
        lambda: authority.check_listing(header(head, ""), NOW, spent),
    ]
    for check in checks:
        assert check() == head.public_key_hex
        with pytest.raises(NotAuthorized) as err:
            check()
        assert str(err.value) == authority.NOT_AUTHORIZED
    assert len(spent) == 4


def test_spent_proofs_expire_with_their_freshness_and_are_capped() -> None:
    spent = authority.SpentProofs(2, window=60)
    spent.spend("k", "a", 1000, now=1000)
    spent.spend("k", "b", 1010, now=1000)
    with pytest.raises(ProofsBusy):  # full: refused clearly, nothing forgotten early
        spent.spend("k", "c", 1000, now=1000)
    with pytest.raises(NotAuthorized):
        spent.spend("k", "a", 1000, now=1060)  # still fresh at the boundary: still spent
    spent.spend("k", "c", 1061, now=1061)  # "a" went stale at 1060 and was let go
    assert len(spent) == 2
    with pytest.raises(NotAuthorized):
        spent.spend("k", "b", 1010, now=1061)


def test_one_key_cannot_take_the_whole_spent_store() -> None:
    spent = authority.SpentProofs(100, window=60, per_key=2)
    assert authority.SpentProofs(100, window=60).per_key == 120
    spent.spend("k", "a", 1000, now=1000)
    spent.spend("k", "b", 1000, now=1000)
    with pytest.raises(ProofsBusy):  # this key's share is full ...
        spent.spend("k", "c", 1000, now=1000)
    spent.spend("other", "c", 1000, now=1000)  # ... not anyone else's
    spent.spend("k", "c", 1061, now=1061)  # its proofs went stale: room again
    assert len(spent) == 1


def test_a_400_digit_timestamp_is_refused_not_an_overflow() -> None:
    head = Identity.generate()
    for ts in (10**400, -(10**400)):
        proof = {"publicKey": head.public_key_hex, "timestamp": ts, "signature": "0" * 128}
        with pytest.raises(NotAuthorized):
            authority.check_resolution(proof, "r1", (head.public_key_hex,), NOW)
        with pytest.raises(NotAuthorized):
            authority.check_cancel(proof, "r1", (head.public_key_hex,), NOW)


# --- presented chains --------------------------------------------------------------


def test_a_chain_is_presented_by_its_last_hop_for_one_agent_and_message() -> None:
    alice, bob = Identity.generate(), Identity.generate()
    hops = [make_hop(alice, None)]
    hops.append(make_hop(bob, hops[0]))
    provider = "ab" * 32
    ts = int(NOW)

    def by(signer: Identity, agent: str = "echo", message: str = "m1") -> dict:
        return {
            "timestamp": ts,
            "signature": signer.sign(present_payload(provider, agent, message, ts)),
        }

    spent = authority.SpentProofs(10)
    assert (
        authority.check_presented(hops, by(bob), provider, "echo", "m1", NOW, spent=spent)
        == alice.public_key_hex
    )
    for what, presenter in {
        "missing": None,
        "by the head, not the last hop": by(alice),
        "for another agent": by(bob, agent="other"),
        "for another message": by(bob, message="m2"),
        "spent": by(bob),
    }.items():
        with pytest.raises(InvalidActorChain) as err:
            authority.check_presented(hops, presenter, provider, "echo", "m1", NOW, spent=spent)
        assert err.value.reason == authority.NOT_PRESENTED, what


def test_hops_are_counted_before_any_signature_is_checked() -> None:
    alice = Identity.generate()
    hops = [make_hop(alice, None)]
    for _ in range(16):
        hops.append(make_hop(alice, hops[-1]))
    forged = ["x.y.z"] + hops[1:]  # hop 0 would fail its check, if it were made
    with pytest.raises(InvalidActorChain) as err:
        verify_chain(forged, max_hops=16)
    assert err.value.reason == "an actor chain has at most 16 hops"
    assert verify_chain(hops[:16], max_hops=16)[0] == alice.public_key_hex


def test_claims_nested_past_the_parser_are_an_invalid_chain_not_a_crash() -> None:
    alice = Identity.generate()
    header_b64 = _b64url(b'{"alg":"EdDSA","typ":"JWT"}')
    deep = _b64url(b"[" * 200_000 + b"]" * 200_000)
    signature = _b64url(bytes.fromhex(alice.sign(f"{header_b64}.{deep}")))
    with pytest.raises(InvalidActorChain) as err:
        verify_chain([f"{header_b64}.{deep}.{signature}"])
    assert err.value.reason == "hop 0 is not a compact JWT"


def test_the_new_settings_are_refused_at_start_when_bad() -> None:
    from funduq_trio.config import Settings

    assert Settings().max_chain_hops == 16 and Settings().max_spent_proofs == 100_000
    env = {"FUNDUQ_MAX_CHAIN_HOPS": "4", "FUNDUQ_MAX_SPENT_PROOFS": "10"}
    assert Settings.from_env(env).max_chain_hops == 4
    for name in ("max_chain_hops", "max_spent_proofs"):
        (problem,) = Settings().replace(**{name: 0}).problems()
        assert problem.startswith(f"FUNDUQ_{name.upper()}=0")
