"""KYOK, the completion relay ("keep your own key", DESIGN §9, docs/kyok.md).

An agent's code calls an LLM through funduq, paid by the LLM provider the
run's *caller* opted into, without the agent ever holding that provider's key.
This module holds everything of the relay that is not HTTP:

* the run-scoped **token** (`mint_token` / `read_token`): an HMAC under a
  secret only funduq keeps, naming the run, the agent and an expiry;
* the caller's **opt-in** (`Kyok.read_opt_in`), checked at the door;
* the **call signature** (`check_call_signature`) by the agent's provider key;
* the **LLM providers** attached over the provider link (`LlmSession`), their
  published offerings and their counters (`completions`, `refused`,
  `failed`; no consequence, unlike a provider's quality counters);
* the **completions in flight** (`Completion`): each relays its chunks through
  a bounded memory channel, and is ended by funduq when the run is
  cancel-requested or ends, or when its reader goes.

The seed's rule lives in `Kyok.cancel_requested`: the facade marks a run there
the moment `Funduq.cancel_run` accepts a cancel (before the lane writes
`cancelling`), and that same mark ends the run's completions in flight. The
checks a call passes are ordered as DESIGN §9 orders them; the web route
(`web/kyok.py`) calls them and the facade answers "is this run active, not
cancel-requested, this agent's" (`Funduq.kyok_run`).
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import trio

from ..identity import fingerprint_of, kyok_call_payload
from ..secret_file import load_or_create
from .authority import SIGNATURE_WINDOW_SECONDS, Spender, SpentProofs, check_signed_request
from .errors import InvalidKyokOptIn, NotAuthorized, ProofsBusy, RecordUnavailable
from .metrics import Metrics
from .spends import Spends
from .store import Store, dumps

__all__ = [
    "COMPLETION_BUFFER_CHUNKS",
    "COUNTERS",
    "TOKEN_SECONDS",
    "Completion",
    "Grant",
    "InvalidKyokOptIn",
    "Kyok",
    "KyokRefusal",
    "LlmLink",
    "LlmSession",
    "check_call_signature",
    "mint_token",
    "read_token",
]

log = logging.getLogger("funduq.kyok")

#: A token's lifetime from the offer that carried it (it also dies with the run).
TOKEN_SECONDS = 3600
#: Chunks of one completion held while its reader (the agent) catches up. A
#: reader that falls further behind loses the completion (abandoned): the LLM
#: provider's link is shared by every completion it serves and never waits.
COMPLETION_BUFFER_CHUNKS = 256
#: An LLM provider's counters, kept in the record. None has a consequence.
COUNTERS = ("completions", "refused", "failed")
#: The longest token read at all (a real one is ~200 characters).
MAX_TOKEN_CHARS = 2048

_HEX64 = re.compile(r"[0-9a-f]{64}")
_FINGERPRINT = re.compile(r"[0-9a-f]{16}")
_B64URL = re.compile(r"[A-Za-z0-9_-]+")


class KyokRefusal(Exception):  # noqa: N818 -- a refusal, answered with its status
    """A completion call refused: `status` and `code` are what the caller reads."""

    def __init__(
        self, status: int, code: str, message: str, refusal: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.refusal = status, code, message, refusal

    def body(self) -> dict[str, Any]:
        error: dict[str, Any] = {
            "status": self.status,
            "code": self.code,
            "type": self.code,
            "message": self.message,
        }
        if self.refusal is not None:
            error["refusal"] = self.refusal
        return {"error": error}


# -- tokens (pure) ------------------------------------------------------------------


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _mac(secret: bytes, first: str) -> str:
    return hmac.new(secret, first.encode("ascii"), hashlib.sha256).hexdigest()


def mint_token(secret: bytes, run_id: str, agent: str, exp: int) -> str:
    """`base64url(JSON {runId, agent, exp}) "." hex HMAC-SHA256(first part)`."""
    claims = json.dumps({"runId": run_id, "agent": agent, "exp": exp}, separators=(",", ":"))
    first = _b64url(claims.encode("utf-8"))
    return f"{first}.{_mac(secret, first)}"


@dataclass(frozen=True)
class Grant:
    """What a valid token says."""

    token: str
    run_id: str
    agent: str  # "{providerKey}/{name}"
    exp: int


def _unauthorized(message: str) -> KyokRefusal:
    return KyokRefusal(401, "invalid_token", message)


def read_token(secret: bytes, token: object, now: float) -> Grant:
    """The grant a token carries, or KyokRefusal 401 (tampered, malformed or
    expired: `now` at or past `exp`)."""
    if not isinstance(token, str) or not 0 < len(token) <= MAX_TOKEN_CHARS:
        raise _unauthorized("no KYOK token: send Authorization: Bearer {token}")
    first, dot, mac = token.partition(".")
    if (
        not dot
        or not _B64URL.fullmatch(first)
        or not hmac.compare_digest(
            mac.encode("ascii", "replace"), _mac(secret, first).encode("ascii")
        )
    ):
        raise _unauthorized("KYOK token does not verify")
    try:
        claims = json.loads(base64.urlsafe_b64decode(first + "=" * (-len(first) % 4)))
    except ValueError:
        raise _unauthorized("KYOK token does not verify") from None
    run_id, agent, exp = (
        claims.get(k) if isinstance(claims, dict) else None for k in ("runId", "agent", "exp")
    )
    if (
        not isinstance(run_id, str)
        or not isinstance(agent, str)
        or not isinstance(exp, int)
        or isinstance(exp, bool)
    ):
        raise _unauthorized("KYOK token does not verify")
    if not now < exp:
        raise _unauthorized("KYOK token has expired")
    return Grant(token, run_id, agent, exp)


def _bad_signature(window: float) -> KyokRefusal:
    """The one answer to a bad, stale or spent call signature."""
    return KyokRefusal(
        401,
        "invalid_signature",
        "Funduq-Signature must be the agent's provider key's signature over "
        "funduq-kyok-call:{token}:{Funduq-Timestamp}:{sha256hex(body)}, "
        f"timestamped within {window:g} s",
    )


def check_call_signature(
    public_key: str,
    token: str,
    timestamp: str | None,
    signature: str | None,
    body: bytes,
    now: float,
    window: float = SIGNATURE_WINDOW_SECONDS,
    spent: Spender | None = None,
) -> None:
    """The call is signed by the agent's provider key over
    `funduq-kyok-call:{token}:{timestamp}:{sha256hex(body)}`, within `window`
    seconds of `now`, and (when `spent` keeps count) not used before: a
    captured call does not replay. Else KyokRefusal 401 (503 while `spent`
    is full)."""
    bad = _bad_signature(window)
    if (
        timestamp is None
        or signature is None
        or not timestamp.isascii()
        or not timestamp.isdigit()
        or len(timestamp) > 12
    ):
        raise bad
    stamp = int(timestamp)
    proof = {"publicKey": public_key, "timestamp": stamp, "signature": signature}
    try:
        check_signed_request(
            proof, kyok_call_payload(token, stamp, body), (public_key,), now, window, spent
        )
    except NotAuthorized:  # a bad, stale or spent signature: one answer
        raise bad from None
    except ProofsBusy as exc:
        raise KyokRefusal(503, "proofs_busy", str(exc)) from None


# -- LLM providers -------------------------------------------------------------------


class LlmLink(Protocol):
    """What the relay needs from a provider link; neither call may block."""

    def send_complete(self, completion_id: str, request: dict[str, Any]) -> None: ...
    def send_abandon(self, completion_id: str) -> None: ...


@dataclass(eq=False)
class Completion:
    """One completion in flight. Its chunks go through a bounded channel; its
    end is `outcome` (set once), after which the channel is closed."""

    id: str
    run_id: str
    offering: tuple[str, str]  # (provider key, name)
    session: LlmSession
    kyok: Kyok
    chunks: trio.MemoryReceiveChannel[str] = field(init=False)
    _send: trio.MemorySendChannel[str] = field(init=False)
    #: None while in flight; then ("completed",) | ("failed", message, refusal)
    #: | ("stopped", KyokRefusal) -- the last when funduq ended it.
    outcome: tuple[Any, ...] | None = None
    relayed: int = 0  # chunks handed to the reader

    def __post_init__(self) -> None:
        self._send, self.chunks = trio.open_memory_channel[str](COMPLETION_BUFFER_CHUNKS)

    @property
    def done(self) -> bool:
        return self.outcome is not None

    def _end(self, outcome: tuple[Any, ...], metric: str) -> None:
        if self.outcome is not None:
            return
        self.outcome = outcome
        self._send.close()
        self.session.completions.pop(self.id, None)
        self.kyok._forget(self, metric)

    # -- from the LLM provider --

    def chunk(self, data: str) -> None:
        if self.outcome is not None:
            return
        try:
            data.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: no reader could be handed it
            self.stop(
                KyokRefusal(
                    502, "llm_bad_chunk", "the LLM provider sent a chunk that is not valid Unicode"
                )
            )
            return
        try:
            self._send.send_nowait(data)
        except trio.WouldBlock:
            self.stop(
                KyokRefusal(
                    502,
                    "reader_too_slow",
                    f"the completion outran its reader by more than "
                    f"{COMPLETION_BUFFER_CHUNKS} chunks",
                )
            )

    def completed(self) -> None:
        if self.outcome is None:
            self.kyok._count(self.offering[0], "completions")
            self._end(("completed",), "completed")

    def failed(self, message: str, refusal: dict[str, Any] | None) -> None:
        if self.outcome is None:
            counter = "refused" if refusal is not None else "failed"
            self.kyok._count(self.offering[0], counter)
            self._end(("failed", message, refusal), counter)

    # -- from funduq --

    def stop(self, why: KyokRefusal) -> None:
        """Funduq ends it (cancel requested, run ended, reader gone): the LLM
        provider is asked to stop spending (`abandon`)."""
        if self.outcome is None:
            self.session.abandon(self.id)
            self._end(("stopped", why), "abandoned")

    def lost(self) -> None:
        """The LLM provider's link went: nothing to abandon."""
        self._end(
            (
                "stopped",
                KyokRefusal(
                    502, "llm_provider_left", "the LLM provider left during the completion"
                ),
            ),
            "lost",
        )


class LlmSession:
    """One link's LLM side: the offerings it published, its completions."""

    def __init__(self, kyok: Kyok, key: str, link: LlmLink) -> None:
        self.kyok, self.key, self.link = kyok, key, link
        self.live = True
        self.offerings: set[str] = set()
        self.completions: dict[str, Completion] = {}

    async def register(self, offerings: list[dict[str, Any]]) -> None:
        """Publish (replace) the offerings this link serves."""
        await self.kyok._record_offerings(self.key, offerings)
        if self.live:
            self.offerings = {o["name"] for o in offerings}

    def abandon(self, completion_id: str) -> None:
        if self.live:
            self.link.send_abandon(completion_id)

    def chunk(self, completion_id: str, data: str) -> None:
        completion = self.completions.get(completion_id)
        if completion is not None:
            completion.chunk(data)

    def end(self, completion_id: str) -> None:
        completion = self.completions.get(completion_id)
        if completion is not None:
            completion.completed()

    def failed(self, completion_id: str, message: str, refusal: dict[str, Any] | None) -> None:
        completion = self.completions.get(completion_id)
        if completion is not None:
            completion.failed(message, refusal)

    def detach(self) -> None:
        """The link is gone. Idempotent."""
        if not self.live:
            return
        self.live = False
        if self.kyok.sessions.get(self.key) is self:
            del self.kyok.sessions[self.key]
        for completion in list(self.completions.values()):
            completion.lost()


class Kyok:
    """The relay's state: LLM providers, offerings, counters, completions in
    flight, and the runs a cancel was accepted for."""

    def __init__(
        self,
        record: Store,
        secret: bytes,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.time,
        max_spent_calls: int = 100_000,
        completions_per_run: int = 4,
    ) -> None:
        self.record = record
        #: Completions one run may have in flight (FUNDUQ_KYOK_COMPLETIONS_PER_RUN).
        self.completions_per_run = completions_per_run
        self.secret = secret
        self.metrics = metrics
        #: Call signatures accepted while fresh, each once. A store of its
        #: own, with no per-key share: only an agent's provider holding a live
        #: grant can spend here, and one provider may make many calls.
        #: Spent on every node sharing the record (spends.py).
        self.spent = Spends(SpentProofs(max_spent_calls, per_key=max_spent_calls))
        self.spent.share(record)
        #: Wall-clock seconds (tokens and signatures carry Unix time); tests
        #: inject their own.
        self.clock = clock
        #: `{public URL}/kyok/v1`, set once the server knows where it serves.
        self.base_url: str | None = None
        self.sessions: dict[str, LlmSession] = {}
        self.offerings: dict[tuple[str, str], dict[str, Any]] = {}
        self.counters: dict[str, dict[str, int]] = {}
        self.cancel_requested: set[str] = set()
        self.by_run: dict[str, dict[str, Completion]] = {}

    async def load(self) -> None:
        providers, offerings = await self.record.llm_providers_and_offerings()
        for key, *counts in providers:
            self.counters[key] = dict(zip(COUNTERS, map(int, counts), strict=True))
        for key, name, description, metadata in offerings:
            self.offerings[(key, name)] = {
                "description": description,
                "metadata": json.loads(metadata),
            }

    # -- LLM providers --

    def attach(self, key: str, link: LlmLink) -> LlmSession:
        old = self.sessions.get(key)
        if old is not None and old.link is link:
            return old
        session = self.sessions[key] = LlmSession(self, key, link)
        if old is not None:
            old.detach()
            self.sessions[key] = session
        return session

    async def _record_offerings(self, key: str, offerings: list[dict[str, Any]]) -> None:
        rows = [
            (key, o["name"], o.get("description") or "", dumps(o.get("metadata") or {}))
            for o in offerings
        ]
        await self.record.record_offerings(key, rows)
        self.counters.setdefault(key, dict.fromkeys(COUNTERS, 0))
        for o in offerings:
            self.offerings[(key, o["name"])] = {
                "description": o.get("description") or "",
                "metadata": o.get("metadata") or {},
            }

    def attached(self, key: str, name: str) -> LlmSession | None:
        session = self.sessions.get(key)
        if session is not None and session.live and name in session.offerings:
            return session
        return None

    def roster(self) -> list[dict[str, Any]]:
        return [
            {
                "provider": key,
                "fingerprint": fingerprint_of(key),
                "name": name,
                "description": spec["description"],
                "metadata": spec["metadata"],
                "online": self.attached(key, name) is not None,
                "counters": dict(self.counters.get(key) or dict.fromkeys(COUNTERS, 0)),
            }
            for (key, name), spec in sorted(self.offerings.items())
        ]

    def _resolve(self, provider: str) -> str | None:
        provider = provider.lower()
        if _HEX64.fullmatch(provider):
            return provider if provider in self.counters else None
        if _FINGERPRINT.fullmatch(provider):
            return next((k for k in self.counters if fingerprint_of(k) == provider), None)
        return None

    def _count(self, key: str, counter: str) -> None:
        counts = self.counters.setdefault(key, dict.fromkeys(COUNTERS, 0))
        counts[counter] += 1
        value = counts[counter]
        self.record.set_llm_counter_soon(key, counter, value)

    # -- the door --

    def read_opt_in(self, value: object) -> dict[str, Any]:
        """The caller's `kyok = {llmProvider: {providerKey, name}, context}`,
        normalized (the full provider key), or InvalidKyokOptIn."""
        if not isinstance(value, dict):
            raise InvalidKyokOptIn(
                "kyok must be an object {llmProvider: {providerKey, name}, context}"
            )
        provider = value.get("llmProvider")
        context = value.get("context")
        if (
            not isinstance(provider, dict)
            or not isinstance(provider.get("providerKey"), str)
            or not isinstance(provider.get("name"), str)
        ):
            raise InvalidKyokOptIn("kyok.llmProvider must be {providerKey, name}")
        if context is not None and not isinstance(context, dict):
            raise InvalidKyokOptIn("kyok.context must be an object")
        key = self._resolve(provider["providerKey"])
        name = provider["name"]
        if key is None or (key, name) not in self.offerings:
            raise InvalidKyokOptIn(
                f"kyok.llmProvider names no LLM offering known to this "
                f"funduq: {provider['providerKey']!r}/{name!r} (see GET /llms)"
            )
        return {"llmProvider": {"providerKey": key, "name": name}, "context": context}

    def grant(self, run_id: str, key: str, agent: str) -> dict[str, Any]:
        """What the offer carries in `runInput.forwardedProps.kyok`."""
        exp = int(self.clock()) + TOKEN_SECONDS
        return {
            "token": mint_token(self.secret, run_id, f"{key}/{agent}", exp),
            "baseUrl": self.base_url,
        }

    def read_token(self, token: object) -> Grant:
        return read_token(self.secret, token, self.clock())

    async def check_signature(
        self, key: str, token: str, timestamp: str | None, signature: str | None, body: bytes
    ) -> None:
        """`check_call_signature`, the signature spent on every node sharing
        the record: one spent on another node is refused as any bad one."""
        try:
            await self.spent.check(
                lambda spent: check_call_signature(
                    key, token, timestamp, signature, body, self.clock(), spent=spent
                )
            )
        except NotAuthorized:
            raise _bad_signature(SIGNATURE_WINDOW_SECONDS) from None
        except RecordUnavailable as exc:
            raise KyokRefusal(503, "record_unavailable", str(exc)) from None

    # -- runs --

    def mark_cancel_requested(self, run_id: str) -> None:
        """A cancel was accepted: refuse the run's calls from now on, and end
        the ones in flight. Needs nobody's cooperation."""
        self.cancel_requested.add(run_id)
        self._stop_run(
            run_id,
            KyokRefusal(
                403,
                "run_cancel_requested",
                f"run {run_id} is cancel-requested: funduq funds no more of its completions",
            ),
        )

    def run_ended(self, run_id: str) -> None:
        """The run settled or paused: nothing is spent on it any more."""
        self.cancel_requested.discard(run_id)
        self._stop_run(run_id, KyokRefusal(403, "run_not_active", f"run {run_id} has ended"))

    def _stop_run(self, run_id: str, why: KyokRefusal) -> None:
        for completion in list(self.by_run.get(run_id, {}).values()):
            completion.stop(why)

    def start(self, run_id: str, offering: tuple[str, str], request: dict[str, Any]) -> Completion:
        """Ask the offering for a completion (KyokRefusal 503 when it is not
        attached). Never awaits: the checks before it and this start are one
        step, so no cancel can fall between them."""
        in_flight = len(self.by_run.get(run_id, ()))
        if in_flight >= self.completions_per_run:
            # Each holds a buffer of chunks and the LLM provider's attention;
            # an agent gets a bounded share, not whatever it asks for.
            raise KyokRefusal(
                429,
                "too_many_completions",
                f"run {run_id} already has {in_flight} completions in flight "
                "(FUNDUQ_KYOK_COMPLETIONS_PER_RUN); retry once one ends",
            )
        session = self.attached(*offering)
        if session is None:
            raise KyokRefusal(
                503,
                "llm_provider_unavailable",
                f"the LLM offering {offering[1]!r} of provider "
                f"{fingerprint_of(offering[0])} is not attached right now",
            )
        completion = Completion("cmpl_" + secrets.token_hex(12), run_id, offering, session, self)
        session.completions[completion.id] = completion
        self.by_run.setdefault(run_id, {})[completion.id] = completion
        session.link.send_complete(completion.id, request)
        return completion

    def _forget(self, completion: Completion, outcome: str) -> None:
        runs = self.by_run.get(completion.run_id)
        if runs is not None:
            runs.pop(completion.id, None)
            if not runs:
                del self.by_run[completion.run_id]
        key, name = completion.offering
        self.metrics.completion_ended(f"{fingerprint_of(key)}/{name}", outcome)


def load_or_create_secret(path: str | os.PathLike[str]) -> bytes:
    """The KYOK secret kept at `path` (hex, mode 0600), created when absent
    (see `secret_file`: atomic, a racing starter loads the winner's)."""

    def read(text: str) -> bytes:
        if len(text) < 32:
            raise ValueError("a KYOK secret is at least 32 characters")
        return text.encode("ascii")

    return load_or_create(path, lambda: secrets.token_hex(32), read)
