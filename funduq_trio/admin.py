"""`funduq-trio quality list | reset PROVIDER`: the providers' quality
counters, read and reset in the record -- the SQLite file or the PostgreSQL
database `serve` would open -- through the record's own interface (the
`Store`: no SQL here).

Run it with the server stopped. A running funduq keeps the counters in
memory (it reads them at start): a reset made under it takes effect only at
its next start, and its next strike on a counter writes its own count back.
With PostgreSQL, every node running on the database is such a server: the
reset is in the database at once, each node started afterwards reads it, and
each running node goes on counting from what it held, writing its count back
to a counter at its next strike there. So stop every node first.

The record is opened but never created: a wrong path is an error, not a new
empty record, and a PostgreSQL database without funduq's schema is an error
too. An older record is upgraded first, as `serve` would.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from .broker.schema import SchemaTooNew
from .broker.store import COUNTERS, NoRecord, RecordUnreachable, Store, open_store, record_name
from .config import Settings

__all__ = ["AdminError", "list_quality", "reset_quality"]

T = TypeVar("T")

#: What to give when no record was found where the settings point.
_WHERE_HINT = "give --data-dir or --database-url as for serve"


class AdminError(Exception):
    """The command cannot do what was asked; the message says why."""


def _on_record(settings: Settings, doing: str, fn: Callable[[Store], Awaitable[T]]) -> T:
    """Open the record `settings` name (never creating it), run `fn` on it,
    close it; every failure an AdminError of one line."""

    async def run() -> T:
        async with open_store(settings, create=False) as store:
            return await fn(store)

    try:
        return trio.run(run)
    except Exception as exc:
        cause = _only_cause(exc)
        if isinstance(cause, NoRecord):
            raise AdminError(f"{cause} ({_WHERE_HINT})") from None
        if isinstance(cause, RecordUnreachable | SchemaTooNew):
            raise AdminError(str(cause)) from None
        if not _medium_error(cause):
            raise
        reason = " ".join(str(cause).split()) or type(cause).__name__
        raise AdminError(f"cannot {doing} the record {record_name(settings)}: {reason}") from None


def _only_cause(exc: BaseException) -> BaseException:
    """The one exception a group (trio's nurseries wrap) holds, else `exc`."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc


def _medium_error(exc: BaseException) -> bool:
    import sqlite3
    import sys

    if isinstance(exc, sqlite3.Error):
        return True
    psycopg = sys.modules.get("psycopg")
    return psycopg is not None and isinstance(exc, psycopg.Error)


def list_quality(settings: Settings) -> list[dict[str, object]]:
    """Every provider in the record with its counters."""
    rows: list[Any] = _on_record(settings, "read", lambda store: store.quality_counters())
    return [
        {"provider": key, "fingerprint": fp, **dict(zip(COUNTERS, map(int, counts), strict=True))}
        for key, fp, *counts in rows
    ]


def reset_quality(settings: Settings, provider: str) -> str:
    """Zero the counters of `provider` (its 64-hex key or 16-hex fingerprint);
    returns its key."""
    provider = provider.strip().lower()
    if len(provider) not in (64, 16) or any(c not in "0123456789abcdef" for c in provider):
        raise AdminError(f"{provider!r} is neither a 64-hex provider key nor a 16-hex fingerprint")
    key = _on_record(settings, "write", lambda store: store.reset_quality(provider))
    if key is None:
        raise AdminError(f"no provider {provider} in the record {record_name(settings)}")
    return key
