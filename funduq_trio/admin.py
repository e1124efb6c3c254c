"""`funduq-trio quality list | reset PROVIDER`: the providers' quality
counters, read and reset in the record file itself.

Run it with the server stopped: a running funduq keeps the counters in
memory (it reads them at start), so a reset made under it takes effect only
at its next start, and its next strike writes its own count back.

The record is opened read-write but never created: a wrong path is an error,
not a new empty record.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from .broker.record import COUNTERS

__all__ = ["AdminError", "list_quality", "reset_quality"]


class AdminError(Exception):
    """The command cannot do what was asked; the message says why."""


def _open(path: Path) -> sqlite3.Connection:
    if not path.is_file():
        raise AdminError(f"no record at {path} (give --data-dir or --database-url as for serve)")
    try:
        return sqlite3.connect(f"file:{path}?mode=rw", uri=True, timeout=5)
    except sqlite3.Error as exc:
        raise AdminError(f"cannot open the record {path}: {exc}") from None


def list_quality(path: Path) -> list[dict[str, object]]:
    """Every provider in the record with its counters."""
    conn = _open(path)
    try:
        rows = conn.execute(
            "SELECT key, fingerprint, "
            + ", ".join(COUNTERS)
            + " FROM providers ORDER BY fingerprint"
        ).fetchall()
    except sqlite3.Error as exc:
        raise AdminError(f"cannot read the record {path}: {exc}") from None
    finally:
        conn.close()
    return [
        {"provider": key, "fingerprint": fp, **dict(zip(COUNTERS, counts, strict=True))}
        for key, fp, *counts in rows
    ]


def reset_quality(path: Path, provider: str) -> str:
    """Zero the counters of `provider` (its 64-hex key or 16-hex fingerprint);
    returns its key."""
    provider = provider.strip().lower()
    column = {64: "key", 16: "fingerprint"}.get(len(provider))
    if column is None or any(c not in "0123456789abcdef" for c in provider):
        raise AdminError(f"{provider!r} is neither a 64-hex provider key nor a 16-hex fingerprint")
    conn = _open(path)
    try:
        with conn:
            row = conn.execute(
                f"SELECT key FROM providers WHERE {column}=?", (provider,)
            ).fetchone()
            if row is None:
                raise AdminError(f"no provider {provider} in the record {path}")
            conn.execute(
                "UPDATE providers SET " + ", ".join(f"{c}=0" for c in COUNTERS) + " WHERE key=?",
                (row[0],),
            )
    except sqlite3.Error as exc:
        raise AdminError(f"cannot write the record {path}: {exc}") from None
    finally:
        conn.close()
    return str(row[0])
