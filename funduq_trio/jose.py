"""JOSE for funduq's own identity: its public key as a JWK, compact EdDSA JWS
(RFC 7515 / RFC 8037) signed by it, and JCS (RFC 8785) for signing JSON.

I/O-free. The b64url helpers are identity.py's (the actor-chain JWTs use the
same ones); this module adds what A2A needs: `/.well-known/jwks.json`, signed
push notifications (docs/doors.md "Push notifications") and the agent card's
`signatures` (A2A 1.0, a JWS over the card's JCS form, payload detached).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from .identity import Identity, _b64url, _b64url_decode, _compact_json, _json_object

__all__ = [
    "b64url",
    "b64url_decode",
    "canonical_json",
    "compact_jws",
    "detached_jws",
    "jwk_of",
    "jwks_of",
    "verify_compact_jws",
]

b64url = _b64url
b64url_decode = _b64url_decode

#: JCS numbers are IEEE doubles: integers past 2**53 - 1 have no exact spelling.
MAX_EXACT_INT = 2**53 - 1
#: Nesting JCS accepts (a card's extension params are caller-shaped JSON).
MAX_DEPTH = 64


def jwk_of(identity: Identity) -> dict[str, str]:
    """funduq's public key as an OKP/Ed25519 JWK; `kid` is its fingerprint."""
    return {
        "kty": "OKP",
        "crv": "Ed25519",
        "x": b64url(bytes.fromhex(identity.public_key_hex)),
        "kid": identity.fingerprint,
        "alg": "EdDSA",
        "use": "sig",
    }


def jwks_of(identity: Identity) -> dict[str, list[dict[str, str]]]:
    """The JWK Set served at `/.well-known/jwks.json`."""
    return {"keys": [jwk_of(identity)]}


def _header(identity: Identity, typ: str, extra: Mapping[str, Any] | None) -> dict[str, Any]:
    return {"alg": "EdDSA", "kid": identity.fingerprint, "typ": typ, **(extra or {})}


def compact_jws(
    identity: Identity,
    payload: bytes,
    *,
    typ: str = "JWT",
    header: Mapping[str, Any] | None = None,
) -> str:
    """`header.payload.signature`, each b64url, signed EdDSA by `identity`."""
    protected = b64url(_compact_json(_header(identity, typ, header)))
    body = b64url(payload)
    signature = bytes.fromhex(identity.sign(f"{protected}.{body}".encode("ascii")))
    return f"{protected}.{body}.{b64url(signature)}"


def detached_jws(
    identity: Identity, payload: bytes, *, header: Mapping[str, Any] | None = None
) -> tuple[str, str]:
    """(protected header, signature) of a JWS whose payload travels apart (the
    agent card's `signatures` entry: the payload is the card itself)."""
    protected, _, signature = compact_jws(identity, payload, typ="JOSE", header=header).split(".")
    return protected, signature


def verify_compact_jws(token: str, jwk: Mapping[str, Any]) -> tuple[dict[str, Any], bytes]:
    """Check an EdDSA compact JWS against an OKP/Ed25519 JWK; answer (header,
    payload). Raises ValueError for anything else (the receiver's side, and
    the tests' check of what funduq signs)."""
    if not isinstance(token, str) or token.count(".") != 2:
        raise ValueError("not a compact JWS")
    protected, body, signature = token.split(".")
    header = _json_object(protected)
    if header.get("alg") != "EdDSA":
        raise ValueError("not an EdDSA JWS")
    if jwk.get("kty") != "OKP" or jwk.get("crv") != "Ed25519":
        raise ValueError("not an Ed25519 JWK")
    key = Ed25519PublicKey.from_public_bytes(b64url_decode(str(jwk.get("x", ""))))
    try:
        key.verify(b64url_decode(signature), f"{protected}.{body}".encode("ascii"))
    except InvalidSignature:
        raise ValueError("bad signature") from None
    return header, b64url_decode(body)


# ---------------------------------------------------------------- JCS (RFC 8785)


def _number(value: int | float) -> str:
    """ECMAScript's Number-to-String, as JCS requires."""
    if isinstance(value, int):
        if abs(value) > MAX_EXACT_INT:
            raise ValueError(f"{value} is past the integers a JSON number holds exactly")
        return str(value)
    if not math.isfinite(value):
        raise ValueError("JCS has no spelling for NaN or infinities")
    if value == 0:
        return "0"
    text = repr(value)  # the shortest round-tripping digits, as ES picks
    if "e" not in text:
        return text.removesuffix(".0")
    mantissa, exponent = text.split("e")
    exp = int(exponent)
    if -7 < exp < 21:  # ES writes these without an exponent
        plain = format(Decimal(text), "f")  # the same digits, positioned
        return plain.rstrip("0").rstrip(".") if "." in plain else plain
    return f"{mantissa}e{'+' if exp > 0 else '-'}{abs(exp)}"


def _canonical(value: Any, depth: int) -> str:
    if depth > MAX_DEPTH:
        raise ValueError(f"JSON nested deeper than {MAX_DEPTH}")
    if value is None or isinstance(value, bool):
        return json.dumps(value)
    if isinstance(value, int | float):
        return _number(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, Mapping):
        # Keys sorted by their UTF-16 code units (RFC 8785 §3.2.3).
        keys = sorted(value, key=lambda k: str(k).encode("utf-16-be"))
        return (
            "{"
            + ",".join(
                json.dumps(str(k), ensure_ascii=False) + ":" + _canonical(value[k], depth + 1)
                for k in keys
            )
            + "}"
        )
    if isinstance(value, list | tuple):
        return "[" + ",".join(_canonical(v, depth + 1) for v in value) + "]"
    raise ValueError(f"{type(value).__name__} is not JSON")


def canonical_json(value: Any) -> bytes:
    """The RFC 8785 (JCS) bytes of a JSON value."""
    return _canonical(value, 1).encode("utf-8")
