"""Settings: every knob is a FUNDUQ_* environment variable and a matching
`serve` flag (FUNDUQ_PORT <-> --port). Defaults are the design's."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MiB = 1024 * 1024


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
    push_allow_private: bool = False
    push_max_attempts: int = 8
    push_backoff_seconds: float = 1.0
    push_timeout_seconds: float = 10.0
    push_configs_per_task: int = 4
    push_max_active: int = 1000

    @property
    def database_path(self) -> Path:
        """The SQLite file: FUNDUQ_DATABASE_URL (sqlite:///path) or the data dir's."""
        url = self.database_url
        if url is None:
            return self.data_dir / "funduq.sqlite3"
        if url.startswith("sqlite:///"):
            return Path(url[len("sqlite:///") :])
        raise ValueError(
            f"FUNDUQ_DATABASE_URL {url!r}: only sqlite:///path is supported by this build"
        )

    def problems(self) -> list[str]:
        """What is wrong with these values, each naming its variable (empty: fine)."""
        found = []
        if not 0 <= self.port <= 65535:
            found.append(f"{env_name('port')}={self.port}: a port is 0..65535 (0 = any free port)")
        for name in (
            "unserved_grace_seconds",
            "deliver_timeout_seconds",
            "undelivered_window_seconds",
            "push_backoff_seconds",
        ):
            if getattr(self, name) < 0:
                found.append(f"{env_name(name)}={getattr(self, name)}: must not be negative")
        at_least_one = ("quality_allowance", "thread_queue_limit", "max_frame_bytes",
                        "max_body_bytes", "push_max_attempts", "push_configs_per_task",
                        "push_max_active")
        for name in at_least_one:
            if getattr(self, name) < 1:
                found.append(f"{env_name(name)}={getattr(self, name)}: must be at least 1")
        for key in self.provider_keys or ():
            if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
                found.append(
                    f"{env_name('provider_keys')}: {key!r} is not a 64-hex Ed25519 public key"
                )
        if not self.push_timeout_seconds > 0:
            found.append(f"{env_name('push_timeout_seconds')}={self.push_timeout_seconds}: "
                         "must be more than 0")
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


def env_name(field_name: str) -> str:
    return "FUNDUQ_" + field_name.upper()


def parse_value(name: str, raw: str) -> Any:
    """Turn a variable's or flag's text into the field's type, with a clear error."""
    kind = {f.name: f.type for f in dataclasses.fields(Settings)}[name]
    try:
        if name == "provider_keys":
            keys = frozenset(k.strip().lower() for k in raw.split(",") if k.strip())
            return keys or None
        if name == "data_dir":
            return Path(raw)
        if kind in ("bool",):
            lowered = raw.strip().lower()
            if lowered not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError("expected true or false")
            return lowered in ("1", "true", "yes", "on")
        if kind in ("int",):
            return int(raw)
        if kind in ("float",):
            return float(raw)
        return raw
    except ValueError as exc:
        raise ValueError(f"{env_name(name)}={raw!r}: {exc}") from None
