"""Who may write to, cancel, or answer on a bound thread. I/O-free rules.

A thread is bound when its first run carried an actor chain; hop 0's key is
its segment head. On a bound thread the keys with authority are the segment
head and the agent's own provider, and nobody else. A cancel or a pause's
answer proves that authority with a fresh signature (`{publicKey, timestamp,
signature}`); a read with the `Funduq-Proof` header; a new utterance with an
actor chain headed by one of the two and presented by its last hop.
Every refusal says the same thing, so a refusal teaches nothing about the
run, the thread or which check failed. Every accepted proof is spent
(`SpentProofs`): the same proof never works twice. Where several nodes share
the record, what a check spent here is also spent in the record
(`NotedSpends` notes it, `spends.Spends` writes it): that part is I/O and
lives outside this module. See docs/authority.md.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from funduq_trio.broker.errors import NotAuthorized, ProofsBusy
from funduq_trio.identity import (
    InvalidActorChain,
    cancel_payload,
    present_payload,
    read_payload,
    resolve_payload,
    timestamp_digits,
    verify,
    verify_chain,
)

__all__ = [
    "NOT_AUTHORIZED",
    "NOT_PRESENTED",
    "PROOF_HEADER",
    "SIGNATURE_WINDOW_SECONDS",
    "InvalidActorChain",  # re-exported: callers need import only this module
    "NotedSpends",
    "Reader",
    "Spender",
    "SpentProofs",
    "authorized_keys",
    "check_cancel",
    "check_listing",
    "check_presented",
    "check_read",
    "check_resolution",
    "check_signed_request",
    "may_write",
    "read_proof_fields",
    "segment_head_of",
]

#: The header a read of a bound thread carries: `{publicKey}:{timestamp}:{signature}`.
PROOF_HEADER = "Funduq-Proof"

#: Why a chain without its last hop's presenter proof is refused (as any forged chain).
NOT_PRESENTED = "not presented by its last hop to this agent with this message"

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


@dataclass(frozen=True)
class Reader:
    """Who asks to read, as far as the request shows: the `Funduq-Proof`
    header it carries (None: none), and whether it carries the operator token."""

    proof: str | None = None
    operator: bool = False


class SpentProofs:
    """The proofs funduq accepted, kept while their timestamp is fresh, so
    none is accepted twice (DESIGN §8). I/O-free: `now` is the caller's.

    An entry is the signer's key and the signed payload (not the signature
    bytes, so no re-spelling of a signature makes it new). It expires once its
    timestamp is older than the window: from then on the proof is refused as
    stale anyway. The count is capped; past the cap new proofs are refused
    with ProofsBusy (a clear "try again shortly"), never by forgetting early.
    Each signer key is capped too (`per_key`, by default two proofs a second
    over the window), so one key -- anyone can make one -- cannot take the
    whole store; many fresh keys are what the separate store for proofs by
    any key (listings, presenters) is for, see `Funduq.spent_by_anyone`.
    """

    def __init__(
        self, capacity: int, window: float = SIGNATURE_WINDOW_SECONDS, per_key: int | None = None
    ) -> None:
        self.capacity = capacity
        self.window = window
        self.per_key = per_key if per_key is not None else max(1, int(2 * window))
        self._expiry: dict[tuple[str, str], float] = {}
        self._heap: list[tuple[float, tuple[str, str]]] = []
        self._of_key: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._expiry)

    def _expire(self, now: float) -> None:
        heap, of_key = self._heap, self._of_key
        while heap and heap[0][0] < now:
            _, entry = heapq.heappop(heap)
            del self._expiry[entry]
            key = entry[0]
            of_key[key] -= 1
            if not of_key[key]:
                del of_key[key]

    def spend(self, key: str, payload: str, timestamp: int, now: float) -> None:
        """Accept this proof once; a second time NotAuthorized (the same
        refusal as any bad proof). `timestamp` is already within the window."""
        self._expire(now)
        entry = (key, payload)
        if entry in self._expiry:
            raise _refuse()
        if len(self._expiry) >= self.capacity:
            raise ProofsBusy(
                f"funduq holds {self.capacity} fresh proofs already (FUNDUQ_MAX_SPENT_PROOFS); "
                "retry in a few seconds"
            )
        if self._of_key.get(key, 0) >= self.per_key:
            raise ProofsBusy(
                f"funduq holds {self.per_key} fresh proofs by this key already; "
                "retry in a few seconds"
            )
        expires = timestamp + self.window
        self._expiry[entry] = expires
        self._of_key[key] = self._of_key.get(key, 0) + 1
        heapq.heappush(self._heap, (expires, entry))


class Spender(Protocol):
    """Where a check spends the proof it accepted: `SpentProofs`, or a
    `NotedSpends` around one."""

    def spend(self, key: str, payload: str, timestamp: int, now: float) -> None: ...


class NotedSpends:
    """`SpentProofs` that also notes each proof it accepted, as (signer key,
    payload, timestamp), for whoever must tell the other nodes (a check is
    I/O-free; `spends.Spends` records the notes in the shared record)."""

    __slots__ = ("local", "noted")

    def __init__(self, local: SpentProofs) -> None:
        self.local = local
        self.noted: list[tuple[str, str, int]] = []

    def spend(self, key: str, payload: str, timestamp: int, now: float) -> None:
        self.local.spend(key, payload, timestamp, now)
        self.noted.append((key, payload, timestamp))


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
    allowed_keys: Iterable[str | None] | None,
    now: float,
    window: float = SIGNATURE_WINDOW_SECONDS,
    spent: Spender | None = None,
) -> str:
    """Return the signer's key if `proof` is a valid signature over `payload`
    by one of `allowed_keys` (None: any key), timestamped within `window`
    seconds of `now` (either side; the boundary itself is inside), and not
    spent before (when `spent` keeps count; it is then spent). Otherwise
    NotAuthorized, always with the same message.

    `now` is wall-clock Unix seconds (time.time()), not trio's clock: the
    signer's timestamp is wall-clock too. `payload` must be built from this
    same proof's timestamp; check_cancel / check_resolution do that.
    """
    key, timestamp, signature = _proof_fields(proof)
    if allowed_keys is not None and key not in {k for k in allowed_keys if isinstance(k, str)}:
        raise _refuse()
    # Compared, never subtracted: an int timestamp of 400 digits against a
    # float `now` is exact, while `now - timestamp` would overflow. A NaN
    # `now` fails both comparisons.
    if not now - window <= timestamp <= now + window:
        raise _refuse()
    if not verify(key, payload, signature):
        raise _refuse()
    if spent is not None:
        spent.spend(key, payload, timestamp, now)
    return key


def _check_with(
    build: Callable[[str, object], str],
    proof: object,
    run_id: str,
    allowed_keys: Iterable[str | None],
    now: float,
    window: float,
    spent: Spender | None,
) -> str:
    _, timestamp, _ = _proof_fields(proof)
    return check_signed_request(proof, build(run_id, timestamp), allowed_keys, now, window, spent)


def check_cancel(
    proof: object,
    run_id: str,
    allowed_keys: Iterable[str | None],
    now: float,
    window: float = SIGNATURE_WINDOW_SECONDS,
    spent: Spender | None = None,
) -> str:
    """`metadata.cancel` over `funduq-cancel:{run_id}:{timestamp}`; returns the signer."""
    return _check_with(cancel_payload, proof, run_id, allowed_keys, now, window, spent)


def check_resolution(
    proof: object,
    run_id: str,
    allowed_keys: Iterable[str | None],
    now: float,
    window: float = SIGNATURE_WINDOW_SECONDS,
    spent: Spender | None = None,
) -> str:
    """`metadata.resolution` over `funduq-resolve:{run_id}:{timestamp}`; returns the signer."""
    return _check_with(resolve_payload, proof, run_id, allowed_keys, now, window, spent)


# A header value: 64-hex key, whole seconds (at most 20 digits), 128-hex signature.
_READ_PROOF = re.compile(r"([0-9a-f]{64}):([0-9]{1,20}):([0-9a-f]{128})")


def read_proof_fields(header: object) -> dict[str, object]:
    """The `Funduq-Proof` header as a proof object, or NotAuthorized."""
    match = _READ_PROOF.fullmatch(header) if isinstance(header, str) else None
    if match is None:
        raise _refuse()
    key, timestamp, signature = match.groups()
    return {"publicKey": key, "timestamp": int(timestamp), "signature": signature}


def check_read(
    header: object,
    thread_id: str,
    allowed_keys: Iterable[str | None],
    now: float,
    spent: Spender | None = None,
    window: float = SIGNATURE_WINDOW_SECONDS,
) -> str:
    """A read of a bound thread: `Funduq-Proof` over
    `funduq-read:{thread_id}:{timestamp}` by one of `allowed_keys` (its segment
    head or the agent's provider); returns the signer, else NotAuthorized."""
    proof = read_proof_fields(header)
    payload = read_payload(thread_id, proof["timestamp"])
    return check_signed_request(proof, payload, allowed_keys, now, window, spent)


def check_listing(
    header: object,
    now: float,
    spent: Spender | None = None,
    window: float = SIGNATURE_WINDOW_SECONDS,
) -> str:
    """A listing of "the threads bound to me": `Funduq-Proof` over
    `funduq-read::{timestamp}` (the read payload with an empty thread id) by
    any key; returns that key, whose threads the listing may show."""
    proof = read_proof_fields(header)
    return check_signed_request(
        proof, read_payload("", proof["timestamp"]), None, now, window, spent
    )


def segment_head_of(actor_chain: object, max_hops: int | None = None) -> str:
    """Hop 0's key of a verified actor chain. Raises InvalidActorChain."""
    return verify_chain(actor_chain, max_hops)[0]


def check_presented(
    actor_chain: object,
    presenter: object,
    provider_key: str,
    agent_name: str,
    message_id: str,
    now: float,
    *,
    max_hops: int | None = None,
    spent: Spender | None = None,
    window: float = SIGNATURE_WINDOW_SECONDS,
) -> str:
    """Verify a chain presented with a request and return its head.

    The chain must verify (at most `max_hops` hops, counted before any
    signature work) and `presenter` = `{timestamp, signature}` must be its
    *last* hop's fresh, unspent signature over
    `funduq-present:{provider_key}:{agent_name}:{message_id}:{timestamp}`.
    Otherwise InvalidActorChain: a chain someone was handed and presents again
    is as forged as one that does not verify.
    """
    keys = verify_chain(actor_chain, max_hops)
    if not isinstance(presenter, dict):
        raise InvalidActorChain(NOT_PRESENTED)
    proof = {**presenter, "publicKey": keys[-1]}
    try:
        _, timestamp, _ = _proof_fields(proof)
        payload = present_payload(provider_key, agent_name, message_id, timestamp)
        check_signed_request(proof, payload, (keys[-1],), now, window, spent)
    except NotAuthorized:
        raise InvalidActorChain(NOT_PRESENTED) from None
    return keys[0]


def may_write(segment_head: str | None, writer_key: str | None, provider_key: str) -> bool:
    """May a new utterance whose actor chain is headed by `writer_key` (None: no
    chain) be added to a thread whose segment head is `segment_head` (None:
    unbound)? Anyone may write to an unbound thread."""
    if segment_head is None:
        return True
    return writer_key is not None and writer_key in authorized_keys(segment_head, provider_key)
