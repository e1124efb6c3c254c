"""Forwarding between the nodes of a cluster (docs/cluster.md, "Forwarding").

A caller's request that another node must carry out -- a new message for a
thread that node leads, or for an agent only its provider links serve; a
pause's answer; a cancel -- is sent there over the internal route
``POST /internal/cluster/{op}``, signed with the cluster's secret (kept in the
shared record, made once by the first node). The node that receives it runs
the facade's call itself (authority, limits and all) and answers its result,
or the broker error it raised (class and message), which the sending node
raises again as the same exception: the caller's door answers exactly as if
the call had been carried out where it arrived.

The pure parts (signing, reading a signature, errors to and from JSON) are
here; ``Forwarder`` is the HTTP client.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import time
from typing import Any

import httpx

from ..identity import InvalidActorChain
from . import errors

#: Headers of a forwarded call: the signer's clock and the HMAC.
TIME_HEADER = "Funduq-Cluster-Time"
SIGNATURE_HEADER = "Funduq-Cluster-Signature"
#: The route's prefix; the op follows.
ROUTE = "/internal/cluster/"
#: The calls a node forwards.
OPS = frozenset({"start_run", "answer_pause", "cancel_run", "kyok_complete"})
#: A signature is taken only while its time is this close to the receiver's.
FRESH_SECONDS = 60.0
#: Who signed a call between nodes, as the spent proofs name it: each signed
#: call is taken once, by one node (``Funduq.spend_cluster_call``).
CLUSTER_SIGNER = "funduq-cluster"
#: How long a forwarded call may take (a cancel waits for its lane to read it).
FORWARD_TIMEOUT_SECONDS = 30.0
#: Marks an answer to ``kyok_complete`` as the leader's KYOK answer, to pass
#: on as it is (any other answer is the route's own: not signed, no record).
RELAYED_HEADER = "Funduq-Cluster-Relayed"
#: How long a relayed completion may wait to connect; its answer may take
#: as long as the LLM does (the agent going away ends it).
RELAY_TIMEOUT = httpx.Timeout(None, connect=FORWARD_TIMEOUT_SECONDS)


def sign(secret: str, op: str, stamp: str, body: bytes) -> str:
    """The HMAC-SHA256 (hex) of one forwarded call."""
    message = f"{op}\n{stamp}\n".encode() + body
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


def signed(secret: str, op: str, stamp: str | None, signature: str | None, body: bytes) -> bool:
    """Whether a call's signature is the cluster's, made recently."""
    if not secret or not stamp or not signature:
        return False
    try:
        at = float(stamp)
    except ValueError:
        return False
    if abs(time.time() - at) > FRESH_SECONDS:
        return False
    return hmac.compare_digest(sign(secret, op, stamp, body), signature)


def cluster_kyok_secret(secret: str) -> bytes:
    """The KYOK token secret of every node of the cluster (unless each is
    given FUNDUQ_KYOK_SECRET): derived from the cluster's secret, so a token
    one node minted is read by any."""
    return (
        hmac.new(secret.encode(), b"funduq-kyok-token-secret", hashlib.sha256).hexdigest().encode()
    )


def _error_classes() -> dict[str, type[Exception]]:
    found: dict[str, type[Exception]] = {"InvalidActorChain": InvalidActorChain}
    pending: list[type[Exception]] = [errors.FunduqError]
    while pending:
        cls = pending.pop()
        found[cls.__name__] = cls
        pending.extend(cls.__subclasses__())
    return found


def error_json(exc: Exception) -> dict[str, Any]:
    """A broker error as the forwarding node reads it back."""
    details = getattr(exc, "details", None)
    return {
        "class": type(exc).__name__,
        "message": str(exc),
        "details": details if isinstance(details, dict) else None,
    }


def error_from_json(found: Any) -> Exception:
    """The exception a forwarded call's error stands for: the same class
    (the nearest the broker knows) with the same message and details."""
    if not isinstance(found, dict):
        return errors.FunduqError("a forwarded call failed")
    cls = _error_classes().get(str(found.get("class")), errors.FunduqError)
    exc = cls.__new__(cls)
    Exception.__init__(exc, str(found.get("message") or ""))
    if isinstance(found.get("details"), dict):
        exc.details = found["details"]  # type: ignore[attr-defined]
    return exc


class Unreachable(Exception):
    """No node the call was for answered it (down, or refused it)."""


class Forwarder:
    """Sends forwarded calls to other nodes (one HTTP client per node)."""

    def __init__(self, secret: str) -> None:
        self.secret = secret
        self._client: httpx.AsyncClient | None = None

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    def _headers(self, op: str, body: bytes) -> dict[str, str]:
        stamp = repr(time.time())
        return {
            "Content-Type": "application/json",
            TIME_HEADER: stamp,
            SIGNATURE_HEADER: sign(self.secret, op, stamp, body),
        }

    async def open(self, url: str, op: str, args: dict[str, Any]) -> httpx.Response:
        """Send ``op`` to one node and return its answer with the body not
        read yet (the caller reads and closes it): for a call whose answer is
        relayed as it comes. ``Unreachable`` when the node does not answer,
        or answers with anything but the relayed call's own answer."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=FORWARD_TIMEOUT_SECONDS)
        body = json.dumps(args, separators=(",", ":")).encode()
        request = self._client.build_request(
            "POST",
            url.rstrip("/") + ROUTE + op,
            content=body,
            headers=self._headers(op, body),
            timeout=RELAY_TIMEOUT,
        )
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise Unreachable(f"{url}: {exc or type(exc).__name__}") from None
        if RELAYED_HEADER not in response.headers:
            await response.aclose()
            raise Unreachable(f"{url}: HTTP {response.status_code}")
        return response

    async def call(self, urls: list[str], op: str, args: dict[str, Any]) -> Any:
        """Carry out ``op`` on the first of ``urls`` that answers: its result,
        or the broker error it raised, raised here. ``Unreachable`` when none
        answers (each is tried once)."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=FORWARD_TIMEOUT_SECONDS)
        body = json.dumps(args, separators=(",", ":")).encode()
        problems = []
        for url in urls:
            try:
                response = await self._client.post(
                    url.rstrip("/") + ROUTE + op, content=body, headers=self._headers(op, body)
                )
            except httpx.HTTPError as exc:
                problems.append(f"{url}: {exc or type(exc).__name__}")
                continue
            if response.status_code != 200:
                problems.append(f"{url}: HTTP {response.status_code}")
                continue
            answer = response.json()
            if "error" in answer:
                raise error_from_json(answer["error"])
            return answer.get("ok")
        raise Unreachable("; ".join(problems) or "no node to reach")
