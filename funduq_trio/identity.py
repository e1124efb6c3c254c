"""Ed25519 identities, every signed payload funduq knows, and actor chains.

Shared by the server and the provider SDK, so it imports nothing but the
standard library and `cryptography`. Keys and signatures travel as lowercase
hex; every payload builder here produces the exact bytes pinned by
`tests/data/contract-vectors.json` (see docs/authority.md).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import math
import os
import re
import secrets
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import (
    Ed25519PrivateKey,
    Ed25519PublicKey,
)
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    PublicFormat,
)

from funduq_trio.secret_file import SecretFileError, load_or_create

__all__ = [
    "Identity",
    "IdentityFileError",
    "InvalidActorChain",
    "cancel_payload",
    "delegation_payload",
    "dispatch_hop",
    "fingerprint_of",
    "funduq_connect_payload",
    "kyok_call_payload",
    "make_hop",
    "new_nonce",
    "present_payload",
    "provider_connect_payload",
    "read_payload",
    "resolve_payload",
    "timestamp_digits",
    "verify",
    "verify_chain",
    "verify_chain_claims",
]

_KEY_HEX = re.compile(r"[0-9a-f]{64}")
_ANY_CASE_KEY_HEX = re.compile(r"[0-9a-fA-F]{64}")
_SIG_HEX = re.compile(r"[0-9a-f]{128}")
_B64URL = re.compile(r"[A-Za-z0-9_-]*")


class IdentityFileError(ValueError):
    """An identity key file exists but does not hold a usable private key."""


class InvalidActorChain(ValueError):
    """An actor chain that does not verify. `reason` says which rule it broke."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"invalid actor chain: {reason}")
        self.reason = reason


# --- keys --------------------------------------------------------------------


def _raw_public(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(Encoding.Raw, PublicFormat.Raw)


def _as_bytes(payload: bytes | str) -> bytes:
    if isinstance(payload, str):
        return payload.encode("utf-8")
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return bytes(payload)
    raise TypeError(f"payload must be bytes or str, not {type(payload).__name__}")


def fingerprint_of(public_key_hex: str) -> str:
    """First 16 hex chars of the sha256 of the raw 32-byte public key."""
    if not isinstance(public_key_hex, str) or not _KEY_HEX.fullmatch(public_key_hex):
        raise ValueError("a public key is 64 lowercase hex characters")
    return _fingerprint(public_key_hex)


@functools.lru_cache(maxsize=1024)
def _fingerprint(public_key_hex: str) -> str:
    # Cached (bounded): every run asks for its provider's, and the same few
    # keys come back again and again.
    return hashlib.sha256(bytes.fromhex(public_key_hex)).hexdigest()[:16]


class Identity:
    """An Ed25519 private key, and what it can say."""

    __slots__ = ("_private", "fingerprint", "public_key_hex")

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._private = private_key
        self.public_key_hex: str = _raw_public(private_key.public_key()).hex()
        self.fingerprint: str = fingerprint_of(self.public_key_hex)

    @classmethod
    def generate(cls) -> Identity:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_private_hex(cls, private_key_hex: str) -> Identity:
        """The identity whose raw 32-byte private key (seed) is this hex."""
        if not isinstance(private_key_hex, str) or not _ANY_CASE_KEY_HEX.fullmatch(
            private_key_hex.strip()
        ):
            raise ValueError("a private key is 64 hex characters")
        raw = bytes.fromhex(private_key_hex.strip())
        return cls(Ed25519PrivateKey.from_private_bytes(raw))

    @classmethod
    def load_or_create(cls, path: str | os.PathLike[str]) -> Identity:
        """Load the key kept at `path` (its private key as hex), or create it
        there (mode 0600) if absent; see `secret_file`. A file that exists but
        holds no key raises IdentityFileError rather than being replaced:
        losing a key changes who this is."""
        try:
            return load_or_create(path, lambda: cls.generate()._private_hex(), cls.from_private_hex)
        except SecretFileError as exc:
            raise IdentityFileError(
                f"identity key file {exc}: it must hold a 64-hex-character Ed25519 private "
                "key; move it aside to generate a new identity (which changes this party's "
                "public key)"
            ) from None

    def _private_hex(self) -> str:
        return self._private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()).hex()

    def sign(self, payload: bytes | str) -> str:
        """Lowercase hex Ed25519 signature over the payload (str is UTF-8)."""
        return self._private.sign(_as_bytes(payload)).hex()

    def __repr__(self) -> str:
        return f"Identity(fingerprint={self.fingerprint!r})"


# Encodings (sign bit cleared) of the eight points of small order, canonical or
# not (y = 0, 1, p - 1, p, p + 1 and the two order-8 y values). Under such a
# "public key" a signature can be made for any message without any private
# key, so no key on this list ever verifies anything (libsodium refuses them
# the same way).
_SMALL_ORDER_KEYS = frozenset(
    bytes.fromhex(h)
    for h in (
        "00" * 32,
        "01" + "00" * 31,
        "26e8958fc2b227b045c3f489f2ef98f0d5dfac05d3c63339b13802886d53fc05",
        "c7176a703d4dd84fba3c0b760d10670f2a2053fa2c39ccc64ec7fd7792ac037a",
        "ec" + "ff" * 30 + "7f",
        "ed" + "ff" * 30 + "7f",
        "ee" + "ff" * 30 + "7f",
    )
)


def _small_order(raw_key: bytes) -> bool:
    return raw_key[:31] + bytes([raw_key[31] & 0x7F]) in _SMALL_ORDER_KEYS


def verify(public_key_hex: object, payload: object, signature_hex: object) -> bool:
    """True iff `signature_hex` is this key's signature over `payload`.

    Never raises: a key or signature that is not lowercase hex of the right
    length, a key of small order, or a payload that is neither bytes nor str,
    is simply False.
    """
    if not isinstance(public_key_hex, str) or not _KEY_HEX.fullmatch(public_key_hex):
        return False
    if not isinstance(signature_hex, str) or not _SIG_HEX.fullmatch(signature_hex):
        return False
    raw_key = bytes.fromhex(public_key_hex)
    if _small_order(raw_key):
        return False
    try:
        data = _as_bytes(payload)  # type: ignore[arg-type]
        key = Ed25519PublicKey.from_public_bytes(raw_key)
        key.verify(bytes.fromhex(signature_hex), data)
    except (InvalidSignature, TypeError, ValueError):
        return False
    return True


def new_nonce() -> str:
    """A fresh random nonce: 32 lowercase hex characters (16 bytes)."""
    return secrets.token_hex(16)


# --- signed payloads ---------------------------------------------------------


def timestamp_digits(timestamp: object) -> str:
    """The decimal digits a signed payload uses for a timestamp.

    An int is used as it is; an integral float (protobuf Struct numbers are
    doubles: 1755500000.0) is read as the integer it is. Anything else
    (a fraction, NaN, infinity, a string, a bool) raises ValueError.
    """
    if isinstance(timestamp, bool):
        raise ValueError("a timestamp is an integer number of seconds, not a bool")  # noqa: TRY004 (the contract: ValueError)
    if isinstance(timestamp, int):
        return str(timestamp)
    if isinstance(timestamp, float):
        if math.isfinite(timestamp) and timestamp.is_integer():
            return str(int(timestamp))
        raise ValueError(f"a timestamp is an integer number of seconds, not {timestamp!r}")
    raise ValueError(f"a timestamp is an integer number of seconds, not {type(timestamp).__name__}")


def provider_connect_payload(funduq_key: str | None, funduq_nonce: str, provider_nonce: str) -> str:
    """What a provider signs to prove its key on the link (`connect.proof`)."""
    return f"funduq-connect-provider:{funduq_key or ''}:{funduq_nonce}:{provider_nonce}"


def funduq_connect_payload(funduq_nonce: str, provider_nonce: str) -> str:
    """What funduq signs to answer a provider's nonce (`connect.ok.answer`)."""
    return f"funduq-connect-funduq:{funduq_nonce}:{provider_nonce}"


def cancel_payload(run_id: str, timestamp: object) -> str:
    """What `metadata.cancel.signature` signs on a bound thread."""
    return f"funduq-cancel:{run_id}:{timestamp_digits(timestamp)}"


def resolve_payload(run_id: str, timestamp: object) -> str:
    """What `metadata.resolution.signature` signs when answering a pause."""
    return f"funduq-resolve:{run_id}:{timestamp_digits(timestamp)}"


def read_payload(thread_id: str, timestamp: object) -> str:
    """What the `Funduq-Proof` header signs to read a bound thread (DESIGN §8).
    With an empty thread id it is a listing proof: "the threads bound to me"."""
    return f"funduq-read:{thread_id}:{timestamp_digits(timestamp)}"


def present_payload(provider_key: str, agent_name: str, message_id: str, timestamp: object) -> str:
    """What a chain's last hop signs to present the chain to one agent with one
    message (`presenter.signature`, DESIGN §8): a chain handed on cannot be reused."""
    return f"funduq-present:{provider_key}:{agent_name}:{message_id}:{timestamp_digits(timestamp)}"


def delegation_payload(delegate_public_key: str, expires_at: object) -> str:
    return f"funduq-delegate:{delegate_public_key}:{timestamp_digits(expires_at)}"


def kyok_call_payload(bearer: str, timestamp: object, body: bytes | str) -> str:
    body_hash = hashlib.sha256(_as_bytes(body)).hexdigest()
    return f"funduq-kyok-call:{bearer}:{timestamp_digits(timestamp)}:{body_hash}"


# --- actor chains ------------------------------------------------------------
#
# A hop is a compact JWS: b64url(header) "." b64url(claims) "." b64url(sig),
# unpadded. JSON is compact (no spaces) in insertion order, which is what the
# published vectors use, so make_hop reproduces them byte for byte.

_JWT_HEADER = {"alg": "EdDSA", "typ": "JWT"}


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64url_decode(segment: str) -> bytes:
    if not _B64URL.fullmatch(segment) or len(segment) % 4 == 1:
        raise ValueError("not unpadded base64url")
    raw = base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))
    if _b64url(raw) != segment:  # non-canonical trailing bits: one value, one spelling
        raise ValueError("not canonical base64url")
    return raw


def _compact_json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _no_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _json_object(segment: str) -> dict[str, Any]:
    value = json.loads(_b64url_decode(segment), object_pairs_hook=_no_duplicate_keys)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")  # noqa: TRY004 (caught as one of many decode failures)
    return value


def _token_hash(token: str) -> str:
    return hashlib.sha256(token.encode("ascii")).hexdigest()


def make_hop(identity: Identity, prev_token: str | None, **extra_claims: Any) -> str:
    """The next hop of an actor chain, signed by `identity`.

    Claims are `{actorPublicKey, prevHash, **extra_claims}`; prevHash is None
    for hop 0 and the sha256 hex of `prev_token` after it.
    """
    reserved = {"actorPublicKey", "prevHash"} & extra_claims.keys()
    if reserved:
        raise ValueError(f"extra claims may not set {sorted(reserved)}")
    claims: dict[str, Any] = {
        "actorPublicKey": identity.public_key_hex,
        "prevHash": None if prev_token is None else _token_hash(prev_token),
        **extra_claims,
    }
    signing_input = _b64url(_compact_json(_JWT_HEADER)) + "." + _b64url(_compact_json(claims))
    signature = bytes.fromhex(identity.sign(signing_input))
    return signing_input + "." + _b64url(signature)


def dispatch_hop(
    funduq_identity: Identity, prev_token: str | None, provider_key: str, agent_name: str
) -> str:
    """The hop funduq appends when it hands a run to a provider's agent."""
    return make_hop(
        funduq_identity,
        prev_token,
        dispatchedTo={"providerKey": provider_key, "name": agent_name},
    )


def _verify_hop(index: int, token: object, prev_token: str | None) -> dict[str, Any]:
    if not isinstance(token, str):
        raise InvalidActorChain(f"hop {index} is not a string")
    parts = token.split(".")
    if len(parts) != 3:
        raise InvalidActorChain(f"hop {index} is not a compact JWT")
    header_b64, claims_b64, sig_b64 = parts
    try:
        header = _json_object(header_b64)
        claims = _json_object(claims_b64)
        signature = _b64url_decode(sig_b64)
    except (ValueError, UnicodeDecodeError, RecursionError):
        # RecursionError: claims nested past the parser's depth are as
        # malformed as any other, not a crash.
        raise InvalidActorChain(f"hop {index} is not a compact JWT") from None
    if header.get("alg") != "EdDSA" or header.get("typ", "JWT") != "JWT":
        raise InvalidActorChain(f"hop {index} is not an EdDSA JWT")
    actor = claims.get("actorPublicKey")
    if not isinstance(actor, str) or not _KEY_HEX.fullmatch(actor):
        raise InvalidActorChain(f"hop {index} has no valid actorPublicKey")
    if not verify(actor, f"{header_b64}.{claims_b64}", signature.hex()):
        raise InvalidActorChain(f"hop {index} is not signed by its actorPublicKey")
    if "prevHash" not in claims:
        raise InvalidActorChain(f"hop {index} has no prevHash")
    prev_hash = claims["prevHash"]
    if prev_token is None:
        if prev_hash is not None:
            raise InvalidActorChain("hop 0 must have a null prevHash")
    elif prev_hash != _token_hash(prev_token):
        raise InvalidActorChain(f"hop {index} does not follow hop {index - 1}")
    return claims


def verify_chain_claims(tokens: object, max_hops: int | None = None) -> list[dict[str, Any]]:
    """Verify an actor chain and return each hop's claims, hop 0 first.

    `max_hops` (None: no limit) is checked before any signature work, so a
    chain too long to be honest costs nothing to refuse."""
    if not isinstance(tokens, list) or not tokens:
        raise InvalidActorChain("an actor chain is a non-empty list of compact JWTs")
    if max_hops is not None and len(tokens) > max_hops:
        raise InvalidActorChain(f"an actor chain has at most {max_hops} hops")
    claims: list[dict[str, Any]] = []
    prev: str | None = None
    for index, token in enumerate(tokens):
        claims.append(_verify_hop(index, token, prev))
        prev = token
    return claims


def verify_chain(tokens: object, max_hops: int | None = None) -> list[str]:
    """Verify an actor chain and return its actor keys in order (hop 0 = head)."""
    return [c["actorPublicKey"] for c in verify_chain_claims(tokens, max_hops)]
