"""What the front bounds, from funduq's settings (docs/limits.md)."""

from __future__ import annotations

import logging
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class FrontLimits:
    #: How long a connection may sit between requests, or take to send a
    #: request's line and headers, before it is closed.
    keep_alive_seconds: float = 5.0
    #: Request line plus headers: more is refused 431 (h11's bound).
    max_header_bytes: int = 16 * 1024
    #: A websocket message larger than this closes the connection with 1009.
    max_message_bytes: int = 16 * 1024 * 1024
    #: Connections served at once; one more is answered 503 and closed.
    max_connections: int = 10_000
    #: One line per HTTP request when set (``funduq_trio.access``).
    access_log: logging.Logger | None = None
