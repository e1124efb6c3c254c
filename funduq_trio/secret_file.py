"""A secret kept in one file of the data directory (mode 0600), created on
first use: funduq's identity key, the operator token, the KYOK secret.

Creation is atomic: the secret is written to a temporary file and
hard-linked into place, so two starters racing either win or read the
winner's, and nobody reads half a file. A file that exists but does not hold
a usable secret is an error, never replaced: losing a secret changes who
funduq is (a key) or locks out whoever holds the old one (a token).

Standard library only: the provider SDK keeps its key this way too.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

__all__ = ["SecretFileError", "load_or_create"]

T = TypeVar("T")


class SecretFileError(ValueError):
    """A secret file exists but cannot be read or does not hold a usable secret."""


def load_or_create(
    path: str | os.PathLike[str], make: Callable[[], str], read: Callable[[str], T]
) -> T:
    """`read(text)` of the file at `path`, first creating it with `make()` when
    absent. `read` raises ValueError for text that is no usable secret."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, (make() + "\n").encode("ascii"))
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
        except FileExistsError:
            pass  # another starter won: read theirs
        finally:
            tmp.unlink(missing_ok=True)
    try:
        text = path.read_text("ascii")
    except (UnicodeDecodeError, OSError) as exc:
        raise SecretFileError(f"{path} cannot be read: {exc}") from None
    try:
        return read(text.strip())
    except ValueError as exc:
        raise SecretFileError(f"{path} is corrupt: {exc}") from None
