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
from urllib.parse import urlsplit

MiB = 1024 * 1024

#: What an operator token may look like: it rides a header, a query and a cookie.
OPERATOR_TOKEN = re.compile(r"[A-Za-z0-9._-]{16,256}")
#: What a node's readable name may look like: it rides log lines and the record.
NODE_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
#: The bounds of docs/limits.md that count something: each at least 1.
LIMITS_AT_LEAST_ONE = (
    "max_queued_input_bytes",
    "max_queued_runs",
    "max_queued_runs_per_agent",
    "max_feed_events",
    "max_agents_per_provider",
    "max_unauthenticated_links",
    "max_connections",
)


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
    lane_inbox_reports: int = 4096
    max_frame_bytes: int = MiB
    max_body_bytes: int = MiB
    provider_keys: frozenset[str] | None = field(default=None)
    operator_token: str | None = None
    sse_keepalive_seconds: float = 15.0
    # Bounds on what callers and providers can make funduq hold (docs/limits.md).
    max_queued_input_bytes: int = 256 * MiB
    max_queued_runs: int = 10_000
    max_queued_runs_per_agent: int = 1000
    max_feed_events: int = 1000
    max_agents_per_provider: int = 100
    handshake_timeout_seconds: float = 10.0
    max_unauthenticated_links: int = 256
    #: Connections (HTTP, SSE streams, provider links) open at once; one more
    #: is answered 503 `too_many_connections` and closed.
    max_connections: int = 10_000
    body_timeout_seconds: float = 30.0
    max_chain_hops: int = 16
    max_spent_proofs: int = 100_000
    # A provider's history queries (query.threadMessages): at most this many
    # in flight per link, each answering at most this many (newest) messages.
    max_thread_queries_per_link: int = 4
    max_thread_messages_per_query: int = 1000
    #: KYOK completions one run may have in flight at once (each holds a
    #: chunk buffer and a slot on the LLM provider's link).
    kyok_completions_per_run: int = 4
    #: KYOK (docs/kyok.md): the HMAC secret of completion tokens (unset: one
    #: generated on first start, kept in the data dir) and the URL agents
    #: reach funduq at (unset: where it serves).
    kyok_secret: str | None = None
    public_url: str | None = None
    push_allow_private: bool = False
    push_max_attempts: int = 8
    push_backoff_seconds: float = 1.0
    push_timeout_seconds: float = 10.0
    push_configs_per_task: int = 4
    push_max_active: int = 1000
    # -- what an operator sees (issue #15) --
    cors_origins: frozenset[str] | None = None
    log_level: str = "info"
    log_format: str = "text"
    access_log: bool = False
    # -- several nodes on one PostgreSQL (docs/cluster.md) --
    #: A readable prefix for this process's node id (the id itself is always
    #: random per start: two processes never share one).
    node_name: str | None = None
    #: How long a thread's lease lasts unrenewed: at most this long a dead
    #: node's threads wait before another node takes them over.
    lease_seconds: float = 10.0
    #: Where the other nodes reach this one (its forwarded calls): unset,
    #: the URL it serves on (as its start banner says).
    node_url: str | None = None

    @property
    def database_is_postgres(self) -> bool:
        """FUNDUQ_DATABASE_URL names a PostgreSQL database (postgresql://...)."""
        return (self.database_url or "").startswith(POSTGRES_SCHEMES)

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
        raise ValueError(f"FUNDUQ_DATABASE_URL={shown_url(url)}: not a SQLite URL (sqlite:///path)")

    def problems(self) -> list[str]:
        """What is wrong with these values, each naming its variable (empty: fine)."""
        found = []
        if not 0 <= self.port <= 65535:
            found.append(f"{env_name('port')}={self.port}: a port is 0..65535 (0 = any free port)")
        # Every number of seconds (sse_keepalive_seconds: 0 = never).
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            # nan compares false with everything: it would pass every bound below
            # and fail later, inside a lane; inf never times out.
            if f.type == "float" and not math.isfinite(value):
                found.append(f"{env_name(f.name)}={value}: must be a finite number")
            elif f.type == "float" and value < 0:
                found.append(f"{env_name(f.name)}={value}: must not be negative")
        at_least_one = (
            "quality_allowance",
            "thread_queue_limit",
            "max_frame_bytes",
            "max_body_bytes",
            "lane_inbox_reports",
            "max_chain_hops",
            "max_spent_proofs",
            "push_max_attempts",
            "push_configs_per_task",
            "push_max_active",
        )
        at_least_one += LIMITS_AT_LEAST_ONE
        at_least_one += (
            "max_thread_queries_per_link",
            "max_thread_messages_per_query",
            "kyok_completions_per_run",
        )
        for name in at_least_one:
            if getattr(self, name) < 1:
                found.append(f"{env_name(name)}={getattr(self, name)}: must be at least 1")
        # Seconds that must be more than 0: below 0 and nan were said above.
        for name in (
            "handshake_timeout_seconds",
            "body_timeout_seconds",
            "push_timeout_seconds",
        ):
            if getattr(self, name) == 0:
                found.append(f"{env_name(name)}={getattr(self, name)}: must be more than 0")
        # A lease is renewed every third of it: under a second, one slow
        # database round trip would hand a node's threads to another.
        if 0 <= self.lease_seconds < 1:
            found.append(f"{env_name('lease_seconds')}={self.lease_seconds}: must be at least 1")
        for key in self.provider_keys or ():
            if len(key) != 64 or any(c not in "0123456789abcdef" for c in key):
                found.append(
                    f"{env_name('provider_keys')}: {key!r} is not a 64-hex Ed25519 public key"
                )
        if self.operator_token is not None and not OPERATOR_TOKEN.fullmatch(self.operator_token):
            found.append(
                f"{env_name('operator_token')}: must be 16 to 256 characters of "
                "letters, digits, '-', '_' or '.'"
            )
        if self.kyok_secret is not None and len(self.kyok_secret) < 32:
            found.append(f"{env_name('kyok_secret')}: at least 32 characters, please")
        for name in ("public_url", "node_url"):
            value = getattr(self, name)
            if value is not None and not _absolute_http_url(value):
                found.append(
                    f"{env_name(name)}={value!r}: an absolute http(s) URL without query or "
                    "fragment (and a port, if any, of 1..65535)"
                )
        if self.node_name is not None and not NODE_NAME.fullmatch(self.node_name):
            found.append(
                f"{env_name('node_name')}={self.node_name!r}: 1 to 64 letters, digits, "
                "'-', '_' or '.'"
            )
        if self.identity_key is not None and not re.fullmatch(
            r"[0-9a-fA-F]{64}", self.identity_key.strip()
        ):
            # The key itself is never echoed: only its length.
            found.append(
                f"{env_name('identity_key')}=<{len(self.identity_key)} characters>: "
                "must be 64 hex characters (an Ed25519 private key)"
            )
        for origin in self.cors_origins or ():
            if origin != "*" and not re.fullmatch(r"https?://[^/\s]+", origin):
                found.append(
                    f"{env_name('cors_origins')}={origin}: an origin is scheme://host[:port] (or *)"
                )
        if self.log_level not in LOG_LEVELS:
            found.append(
                f"{env_name('log_level')}={self.log_level}: one of " + ", ".join(LOG_LEVELS)
            )
        if self.log_format not in ("text", "json"):
            found.append(f"{env_name('log_format')}={self.log_format}: text or json")
        if self.database_is_postgres:
            found += _postgres_problems(self.database_url or "")
        elif self.database_url is not None and not self.database_url.startswith("sqlite:///"):
            found.append(
                f"{env_name('database_url')}={shown_url(self.database_url)}: give "
                "sqlite:///path or postgresql://user@host:port/database"
            )
        elif self.database_url is not None:
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

#: The URL schemes of the PostgreSQL store.
POSTGRES_SCHEMES = ("postgresql://", "postgres://")


def _absolute_http_url(value: str) -> bool:
    """An http(s) URL with a host, no query or fragment, and a usable port."""
    url = urlsplit(value)
    try:
        port = url.port  # a port out of 0..65535 raises
    except ValueError:
        return False
    good_scheme = url.scheme in ("http", "https") and bool(url.hostname)
    return good_scheme and port != 0 and not url.query and not url.fragment


def shown_url(url: str) -> str:
    """A database URL as messages show it: its password (if any) masked."""
    return re.sub(r"^([a-z]+://[^:@/]*:)[^@/]*@", r"\1***@", url)


def _postgres_problems(url: str) -> list[str]:
    """A PostgreSQL URL's problems found without connecting: the driver
    missing, or a URL libpq cannot parse."""
    shown = shown_url(url)
    try:
        from psycopg import conninfo
    except ImportError:
        return [
            f"{env_name('database_url')}={shown}: the PostgreSQL store needs psycopg; "
            "install funduq-trio[postgres]"
        ]
    try:
        conninfo.conninfo_to_dict(url)
    except Exception as exc:  # noqa: BLE001 -- whatever libpq objects to
        reason = " ".join(str(exc).split()).replace(url, shown)
        return [
            f"{env_name('database_url')}={shown}: not a PostgreSQL URL libpq accepts ({reason})"
        ]
    return []


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
        if kind in ("bool",):
            lowered = raw.strip().lower()
            if lowered not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                raise ValueError("expected true or false")
            return lowered in ("1", "true", "yes", "on")
        if kind in ("int",):
            return int(raw)
        if kind in ("float",):
            return float(raw)
        if kind in ("bool",):
            return {
                "1": True,
                "true": True,
                "yes": True,
                "on": True,
                "0": False,
                "false": False,
                "no": False,
                "off": False,
            }[raw.strip().lower()]
        return raw
    except (ValueError, KeyError):
        what = {"int": "a whole number", "float": "a number", "bool": "true or false"}.get(
            str(kind), "a valid value"
        )
        raise ValueError(f"{env_name(name)}={raw}: must be {what}") from None
