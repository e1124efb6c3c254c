"""Who may write to, cancel, or answer on a bound thread. I/O-free rules.

A thread is bound when its first run carried an actor chain; hop 0's key is
its segment head. On a bound thread the keys with authority are the segment
head and the agent's own provider, and nobody else. A cancel or a pause's
answer proves that authority with a fresh signature (`{publicKey, timestamp,
signature}`); a new utterance with an actor chain headed by one of the two.
Every refusal says the same thing, so a refusal teaches nothing about the
run, the thread or which check failed. See docs/authority.md.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from funduq_trio.broker.errors import NotAuthorized
from funduq_trio.identity import (
    InvalidActorChain,
    cancel_payload,
    resolve_payload,
    timestamp_digits,
    verify,
    verify_chain,
)

__all__ = [
    "NOT_AUTHORIZED",
    "SIGNATURE_WINDOW_SECONDS",
    "InvalidActorChain",  # re-exported: callers need import only this module
    "authorized_keys",
    "check_cancel",
    "check_resolution",
    "check_signed_request",
    "check_write",
    "may_write",
    "segment_head_of",
]

SIGNATURE_WINDOW_SECONDS = 60.0

#: The one message every refusal carries, whatever failed.
NOT_AUTHORIZED = (
    "not authorized: this request needs the authority of the thread's "
    "segment head or of the agent's provider"
)


def _refuse() -> NotAuthorized:
    return NotAuthorized(NOT_AUTHORIZED)


def authorized_keys(segment_head: str | None, provider_key: str | None) -> frozenset[str]:
    """The keys with authority on a thread: its segment head and the agent's provider."""
    return frozenset(k for k in (segment_head, provider_key) if isinstance(k, str))


def _proof_fields(proof: object) -> tuple[str, int, str]:
    """(publicKey, timestamp as int, signature) or NotAuthorized."""
    if not isinstance(proof, dict):
        raise _refuse()
    key = proof.get("publicKey")
    signature = proof.get("signature")
    if not isinstance(key, str) or not isinstance(signature, str):
        raise _refuse()
    try:
        timestamp = int(timestamp_digits(proof.get("timestamp")))
    except ValueError:
        raise _refuse() from None
    return key, timestamp, signature


def check_signed_request(
    proof: object,
    payload: str,
    allowed_keys: Iterable[str | None],
    now: float,
    window: float = SIGNATURE_WINDOW_SECONDS,
) -> str:
    """Return the signer's key if `proof` is a valid signature over `payload`
    by one of `allowed_keys`, timestamped within `window` seconds of `now`
    (either side; the boundary itself is inside). Otherwise NotAuthorized,
    always with the same message.

    `now` is wall-clock Unix seconds (time.time()), not trio's clock: the
    signer's timestamp is wall-clock too. `payload` must be built from this
    same proof's timestamp; check_cancel / check_resolution do that.
    """
    key, timestamp, signature = _proof_fields(proof)
    allowed = {k for k in allowed_keys if isinstance(k, str)}
    if key not in allowed:
        raise _refuse()
    if not abs(now - timestamp) <= window:  # also refuses a NaN `now`
        raise _refuse()
    if not verify(key, payload, signature):
        raise _refuse()
    return key


def _check_with(
    build: Callable[[str, object], str],
    proof: object,
    run_id: str,
    allowed_keys: Iterable[str | None],
    now: float,
    window: float,
) -> str:
    _, timestamp, _ = _proof_fields(proof)
    return check_signed_request(proof, build(run_id, timestamp), allowed_keys, now, window)


def check_cancel(
    proof: object,
    run_id: str,
    allowed_keys: Iterable[str | None],
    now: float,
    window: float = SIGNATURE_WINDOW_SECONDS,
) -> str:
    """`metadata.cancel` over `funduq-cancel:{run_id}:{timestamp}`; returns the signer."""
    return _check_with(cancel_payload, proof, run_id, allowed_keys, now, window)


def check_resolution(
    proof: object,
    run_id: str,
    allowed_keys: Iterable[str | None],
    now: float,
    window: float = SIGNATURE_WINDOW_SECONDS,
) -> str:
    """`metadata.resolution` over `funduq-resolve:{run_id}:{timestamp}`; returns the signer."""
    return _check_with(resolve_payload, proof, run_id, allowed_keys, now, window)


def segment_head_of(actor_chain: object) -> str:
    """Hop 0's key of a verified actor chain. Raises InvalidActorChain."""
    return verify_chain(actor_chain)[0]


def may_write(segment_head: str | None, writer_key: str | None, provider_key: str) -> bool:
    """May a new utterance whose actor chain is headed by `writer_key` (None: no
    chain) be added to a thread whose segment head is `segment_head` (None:
    unbound)? Anyone may write to an unbound thread."""
    if segment_head is None:
        return True
    return writer_key is not None and writer_key in authorized_keys(segment_head, provider_key)


def check_write(segment_head: str | None, actor_chain: object, provider_key: str) -> str | None:
    """Authorize a new utterance on an existing thread; return its chain's head.

    A chain that is present must verify (InvalidActorChain) whether or not the
    thread is bound, so the answer to a malformed chain never depends on the
    thread. On a bound thread the chain's head must be the segment head or the
    agent's provider; otherwise (no chain included) NotAuthorized.
    """
    head = None if actor_chain is None else segment_head_of(actor_chain)
    if not may_write(segment_head, head, provider_key):
        raise _refuse()
    return head
