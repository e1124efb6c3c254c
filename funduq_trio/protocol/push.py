"""Push notifications, I/O-free: which targets funduq may POST to, the retry
schedule, what a delivery is signed with, and the order updates go out in
(DESIGN §10; docs/doors.md "Push notifications").

`broker/pushes.py` is the trio shell (the durable outbox, one deliverer per
config, the HTTP POSTs); everything decidable without a socket is here.
"""

from __future__ import annotations

import hashlib
import ipaddress
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_TOKEN_CHARS",
    "SIGNATURE_HEADER",
    "auth_problem",
    "authorization_of",
    "header_value_ok",
    "MAX_URL_CHARS",
    "SETTLE",
    "Target",
    "TargetRefused",
    "address_blocked",
    "backoff_delay",
    "check_target",
    "delivery_claims",
    "delivery_id",
]

#: Longest push URL accepted (a URL is stored and sent with every update).
MAX_URL_CHARS = 2048
#: Longest notification token (`X-A2A-Notification-Token`) accepted.
MAX_TOKEN_CHARS = 1024
#: Longest config id a caller may choose.
MAX_ID_CHARS = 128

#: The header every delivery's JWS rides in, whether or not `Authorization`
#: carries it too (it does not when the config's `authentication` takes it).
SIGNATURE_HEADER = "Funduq-Signature"

_TCHARS = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def header_value_ok(value: str) -> bool:
    """Whether a caller's string may be sent as an HTTP header value as is:
    visible ASCII and inner spaces only (no CR/LF to split the request)."""
    return value == value.strip() and all(" " <= ch <= "~" for ch in value)


def authorization_of(scheme: str, credentials: str) -> str | None:
    """The `Authorization` value a config's `authentication` asks for (as
    a2a-sdk's own sender: `{scheme} {credentials}`), or None when it names no
    scheme or no credentials. Both are checked at the door (`auth_problem`)."""
    if not scheme or not credentials:
        return None
    return f"{scheme} {credentials}"


def auth_problem(scheme: str, credentials: str) -> str | None:
    """Why a config's `authentication` cannot become an `Authorization`
    header, or None: the scheme must be an HTTP token, the credentials
    printable ASCII."""
    if scheme and not all(ch in _TCHARS for ch in scheme):
        return "push authentication scheme must be an HTTP token (e.g. Bearer)"
    if not header_value_ok(credentials):
        return "push authentication credentials must be printable ASCII"
    return None


#: A delivery's place in the task's update order is (event seq, index among
#: the updates that event became); the status update closing a turn (the run
#: settled or paused) comes after every update of its last event.
SETTLE = 1 << 30
#: Longest wait between two attempts at one update, however many failed.
MAX_BACKOFF_SECONDS = 300.0


class TargetRefused(ValueError):
    """A push URL funduq will not POST to (the reason is the message)."""


@dataclass(frozen=True)
class Target:
    url: str
    scheme: str
    host: str
    port: int


def check_target(url: object) -> Target:
    """The parts of a push URL funduq may POST to, or `TargetRefused`:
    http/https only, a host, no credentials in the URL, at most MAX_URL_CHARS.
    Whether its host is a private address is `address_blocked`'s (the host
    must be resolved first)."""
    if not isinstance(url, str) or not url:
        raise TargetRefused("a push notification config needs a url")
    if len(url) > MAX_URL_CHARS:
        raise TargetRefused(f"push url longer than {MAX_URL_CHARS} characters")
    if any(ord(c) < 0x21 or ord(c) == 0x7F for c in url):
        raise TargetRefused("push url contains spaces or control characters")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise TargetRefused(f"push url does not parse: {exc}") from None
    if parts.scheme not in ("http", "https"):
        raise TargetRefused("push url must be http or https")
    if not parts.hostname:
        raise TargetRefused("push url has no host")
    if parts.username is not None or parts.password is not None:
        raise TargetRefused("push url must not carry credentials")
    default = 443 if parts.scheme == "https" else 80
    return Target(url, parts.scheme, parts.hostname, port or default)


def address_blocked(address: str) -> bool:
    """Whether an IP address is not a public unicast destination: loopback,
    private, link-local (cloud metadata), shared, reserved, multicast or
    unspecified. An IPv4-mapped IPv6 address is judged by its IPv4 address;
    anything that is not an address is blocked."""
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return True
    mapped = getattr(ip, "ipv4_mapped", None)
    if mapped is not None:
        ip = mapped
    return (
        not ip.is_global
        or ip.is_loopback
        or ip.is_link_local
        or ip.is_multicast
        or ip.is_reserved
        or ip.is_unspecified
    )


def any_blocked(addresses: Iterable[str]) -> bool:
    """A host is refused when any address it resolves to is blocked (or it
    resolves to none): a POST could reach any of them."""
    found = list(addresses)
    return not found or any(address_blocked(a) for a in found)


def backoff_delay(failed_attempts: int, base_seconds: float) -> float:
    """The wait before the next attempt after `failed_attempts` failures of
    one update: base, 2x base, 4x base, ... at most MAX_BACKOFF_SECONDS."""
    if failed_attempts < 1:
        return 0.0
    return min(base_seconds * 2.0 ** min(failed_attempts - 1, 62), MAX_BACKOFF_SECONDS)


def delivery_id(config_id: str, task_id: str, key: tuple[int, int]) -> str:
    """The delivery's `jti`: the same for every attempt at one update of one
    config, so a receiver can drop a repeat (see docs/doors.md)."""
    seq, index = key
    place = f"{seq}.settle" if index == SETTLE else f"{seq}.{index}"
    return f"{task_id}/{config_id}/{place}"


def delivery_claims(
    *, issuer: str, task_id: str, config_id: str, key: tuple[int, int], body: bytes, now: float
) -> dict[str, Any]:
    """The JWT claims of a delivery's `Authorization: Bearer` token."""
    return {
        "iss": issuer,
        "iat": int(now),
        "jti": delivery_id(config_id, task_id, key),
        "taskId": task_id,
        "configId": config_id,
        "bodySha256": hashlib.sha256(body).hexdigest(),
    }
