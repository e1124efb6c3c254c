"""Settings: every knob is a FUNDUQ_* environment variable and a matching
`serve` flag (FUNDUQ_PORT <-> --port). Defaults are the design's."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MiB = 1024 * 1024

#: What an operator token may look like: it rides a header, a query and a cookie.
OPERATOR_TOKEN = re.compile(r"[A-Za-z0-9._-]{16,256}")


@dataclass(frozen=True)
class Settings:
    host: str = "127.0.0.1"
    port: int = 8000
    data_dir: Path = Path("./funduq-data")
    database_url: str | None = None
    identity_key: str | None = None
    unserved_grace_seconds: float = 45.0
    deliver_timeout_seconds: float = 5.0
    undelivered_window_seconds: float = 1800.0
    quality_allowance: int = 3
    thread_queue_limit: int = 8
    max_frame_bytes: int = MiB
    max_body_bytes: int = MiB
    provider_keys: frozenset[str] | None = field(default=None)
    operator_token: str | None = None
    # -- what an operator sees (issue #15) --
    cors_origins: frozenset[str] | None = None
    log_level: str = "info"
    log_format: str = "text"
    access_log: bool = False

    @property
    def database_path(self) -> Path:
        """The SQLite file: FUNDUQ_DATABASE_URL (sqlite:///path) or the data dir's."""
        url = self.database_url
        if url is None:
            return self.data_dir / "funduq.sqlite3"
        if url.startswith("sqlite:///"):
            path = url[len("sqlite:///") :]
            if path in ("", ":memory:") or path.startswith(("file:", ":memory:")):
                raise ValueError(
                    f"FUNDUQ_DATABASE_URL={url}: the record must be a file that outlives "
                    "the process (sqlite:///relative/path or sqlite:////absolute/path)"
                )
            return Path(path)
        raise ValueError(
            f"FUNDUQ_DATABASE_URL={url}: only sqlite:///path is supported by this build"
        )

    def problems(self) -> list[str]:
        """What is wrong with these values, each naming its variable (empty: fine)."""
        found = []
        if not 0 <= self.port <= 65535:
            found.append(f"{env_name('port')}={self.port}: a port is 0..65535 (0 = any free port)")
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            # nan compares false with everything: it would pass every bound below
            # and fail later, inside a lane; inf never times out.
            if f.type == "float" and not math.isfinite(value):
                found.append(f"{env_name(f.name)}={value}: must be a finite number")
            elif f.type == "float" and value < 0:
                found.append(f"{env_name(f.name)}={value}: must not be negative")
        at_least_one = ("quality_allowance", "thread_queue_limit", "max_frame_bytes",
                        "max_body_bytes")
        for name in at_least_one:
            if getattr(self, name) < 1:
                found.append(f"{env_name(name)}={getattr(self, name)}: must be at least 1")
        for key in self.provider_keys or ():
            if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
                found.append(
                    f"{env_name('provider_keys')}: {key!r} is not a 64-hex Ed25519 public key"
                )
        if self.operator_token is not None and not OPERATOR_TOKEN.fullmatch(self.operator_token):
            found.append(f"{env_name('operator_token')}: must be 16 to 256 characters of "
                         "letters, digits, '-', '_' or '.'")
        if self.identity_key is not None and not re.fullmatch(
                r"[0-9a-fA-F]{64}", self.identity_key.strip()):
            # The key itself is never echoed: only its length.
            found.append(f"{env_name('identity_key')}=<{len(self.identity_key)} characters>: "
                         "must be 64 hex characters (an Ed25519 private key)")
        for origin in self.cors_origins or ():
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                found.append(f"{env_name('cors_origins')}={origin}: an origin is "
                             "scheme://host[:port] (or *)")
        if self.log_level not in LOG_LEVELS:
            found.append(f"{env_name('log_level')}={self.log_level}: one of "
                         + ", ".join(LOG_LEVELS))
        if self.log_format not in ("text", "json"):
            found.append(f"{env_name('log_format')}={self.log_format}: text or json")
        if self.database_url is not None:
            try:
                _ = self.database_path
            except ValueError as exc:
                found.append(str(exc))
        return found

    def replace(self, **changes: Any) -> Settings:
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read FUNDUQ_* variables; explicit overrides (flags) win."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            raw = env.get(env_name(f.name))
            if raw is not None and raw != "":
                values[f.name] = parse_value(f.name, raw)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


#: The --log-level choices, least to most quiet.
LOG_LEVELS = ("debug", "info", "warning", "error")


def env_name(field_name: str) -> str:
    return "FUNDUQ_" + field_name.upper()


def parse_value(name: str, raw: str) -> Any:
    """Turn a variable's or flag's text into the field's type, with a clear error."""
    kind = {f.name: f.type for f in dataclasses.fields(Settings)}[name]
    try:
        if name == "provider_keys":
            keys = frozenset(k.strip().lower() for k in raw.split(",") if k.strip())
            return keys or None
        if name == "cors_origins":
            origins = frozenset(o.strip().rstrip("/") for o in raw.split(",") if o.strip())
            return origins or None
        if name in ("log_level", "log_format"):
            return raw.strip().lower()
        if name == "data_dir":
            return Path(raw)
        if kind in ("int",):
            return int(raw)
        if kind in ("float",):
            return float(raw)
        if kind in ("bool",):
            return {"1": True, "true": True, "yes": True, "on": True,
                    "0": False, "false": False, "no": False, "off": False}[raw.strip().lower()]
        return raw
    except (ValueError, KeyError):
        what = {"int": "a whole number", "float": "a number",
                "bool": "true or false"}.get(str(kind), "a valid value")
        raise ValueError(f"{env_name(name)}={raw}: must be {what}") from None
