"""Run the broker and its web app on one port: `Funduq` + funduq's own front
(`funduq_trio/front`, h11 and wsproto on trio streams).

`serve(settings)` is the embeddable form (tests start it in a nursery and learn
the bound port from `task_status`); `run_server(settings)` is the command
line's, ending on SIGINT/SIGTERM.

Shutting down is cancelling: the web server stops first (open streams and
provider links end), then the broker closes its record. Runs in flight stay
as recorded; the next start settles them as the design says (restarts).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import signal
import socket
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import trio

from . import collector
from .broker.funduq import Funduq
from .broker.schema import SchemaTooNew
from .broker.store import RecordUnreachable, record_name
from .config import Settings, env_name, shown_url
from .front import FrontLimits, serve_asgi
from .secret_file import SecretFileError
from .web.app import create_app

#: How long an idle connection is kept (between requests, or before its
#: headers are complete); FUNDUQ_BODY_TIMEOUT_SECONDS lowers it.
KEEP_ALIVE_SECONDS = 5.0
#: Request line plus headers (h11's bound, its default made explicit).
MAX_HEADER_BYTES = 16 * 1024

log = logging.getLogger("funduq_trio.server")


class StartupError(Exception):
    """Serving cannot start; the message is one line naming the setting
    (by its variable: the CLI renames it to the flag when a flag was used)."""


@dataclass(frozen=True)
class ServerInfo:
    """Where a running server listens, and its broker (for in-process tests)."""

    url: str  # e.g. http://127.0.0.1:54321 (no trailing slash)
    port: int
    funduq: Funduq

    @property
    def provider_url(self) -> str:
        """The provider link's WebSocket URL."""
        return "ws" + self.url[len("http") :] + "/ws/provider"

    def a2a_url(self, provider: str, agent: str) -> str:
        return f"{self.url}/a2a/{provider}/{agent}"

    def agui_url(self, provider: str, agent: str) -> str:
        return f"{self.url}/agui/{provider}/{agent}"


def front_limits(settings: Settings) -> FrontLimits:
    return FrontLimits(
        # A connection between requests, or one whose request line and
        # headers have not all come, is idle: closed after this (never longer
        # than a body may take). A request's body is bounded by
        # FUNDUQ_BODY_TIMEOUT_SECONDS (the app's). Nothing cuts a quiet SSE
        # stream or provider link: they are idle by design.
        keep_alive_seconds=min(KEEP_ALIVE_SECONDS, settings.body_timeout_seconds),
        max_header_bytes=MAX_HEADER_BYTES,
        # The provider link enforces FUNDUQ_MAX_FRAME_BYTES itself (close 1009
        # with its reason); the front's bound sits above it so the link's check
        # is the one a provider meets, while a runaway message is still cut.
        max_message_bytes=2 * settings.max_frame_bytes,
        max_connections=settings.max_connections,
        access_log=logging.getLogger("funduq_trio.access") if settings.access_log else None,
    )


def listen_socket(settings: Settings) -> socket.socket:
    """Bind settings.host:port before anything else is made, so a port in use
    is one clear error and leaves no data directory or key behind."""
    host, port = settings.host, settings.port
    where = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    except OSError as exc:
        raise StartupError(f"{env_name('host')}={host}: cannot listen: {exc.strerror}") from None
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except (OSError, OverflowError) as exc:
        sock.close()
        strerror = getattr(exc, "strerror", None) or str(exc)
        if getattr(exc, "errno", None) in (errno.EADDRINUSE, errno.EACCES):
            raise StartupError(
                f"{env_name('port')}={port}: cannot listen on {where}: {strerror}"
            ) from None
        raise StartupError(
            f"{env_name('host')}={host}: cannot listen on {where}: {strerror}"
        ) from None
    return sock


def _usable_dir(path: Path, setting: str, shown: str) -> None:
    """Make `path` a writable directory, or say in one line why not."""
    if path.exists() and not path.is_dir():
        raise StartupError(f"{setting}={shown}: {path} exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        # A real write: os.access says yes to root even on a read-only mount.
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise StartupError(
            f"{setting}={shown}: cannot create or write in {path}: {exc.strerror or exc}"
        ) from None


def prepare_storage(settings: Settings) -> None:
    """The data directory (and the record's directory) exist and take writes."""
    if not (settings.identity_key and settings.operator_token and settings.database_url):
        _usable_dir(settings.data_dir, env_name("data_dir"), str(settings.data_dir))
    if settings.database_url and not settings.database_is_postgres:
        path = settings.database_path
        if path.is_dir():
            raise StartupError(
                f"{env_name('database_url')}={settings.database_url}: {path} is a directory"
            )
        _usable_dir(path.parent, env_name("database_url"), settings.database_url)


async def serve(
    settings: Settings,
    *,
    listener: socket.socket | None = None,
    task_status: trio.TaskStatus[ServerInfo] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Open the broker, serve the app on settings.host:port (0 = any free port)
    or on `listener` (a bound socket, see `listen_socket`), then report
    `ServerInfo`. Runs until cancelled."""
    listening = listener if listener is not None else listen_socket(settings)
    host, port = listening.getsockname()[:2]
    url = f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"
    try:
        async with Funduq(settings) as funduq:
            app = create_app(funduq)
            async with trio.open_nursery() as nursery:
                # The app's ASGI callable itself, not the app (whose __call__
                # only awaits it): one frame less held by every connection.
                await nursery.start(
                    partial(
                        serve_asgi,
                        app.asgi_app,
                        listening,
                        front_limits(settings),
                        counts=funduq.metrics,
                    )
                )
                funduq.served_at(url)
                task_status.started(ServerInfo(url=url, port=port, funduq=funduq))
    finally:
        listening.close()


#: Files the process keeps for itself beside its connections: the record,
#: its journal, PostgreSQL's connections, outgoing pushes, logs.
FILES_BESIDE_CONNECTIONS = 256


def open_files_for(settings: Settings) -> str | None:
    """Raise the process's soft limit on open files so FUNDUQ_MAX_CONNECTIONS
    connections fit (up to the hard limit). A warning to print when they
    cannot: past it, accepting fails until a connection ends (the front
    pauses and goes on; nothing served is lost)."""
    try:
        import resource
    except ImportError:  # not on this platform: nothing to raise
        return None
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = settings.max_connections + FILES_BESIDE_CONNECTIONS
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < wanted:
        return (
            f"{env_name('max_connections')}={settings.max_connections}, but this process may "
            f"open only {soft} files (ulimit -n; the hard limit is {hard}): about "
            f"{max(soft - FILES_BESIDE_CONNECTIONS, 0)} connections fit"
        )
    return None


#: Settings the banner never prints, only whether they are set.
SECRET_SETTINGS = ("identity_key", "operator_token")


def changed_settings(settings: Settings) -> list[str]:
    """`FUNDUQ_X=value` for each setting that differs from its default."""
    changed = []
    for f in dataclasses.fields(Settings):
        value = getattr(settings, f.name)
        if value == f.default:
            continue
        if f.name in SECRET_SETTINGS:
            shown = "(set)"
        elif isinstance(value, frozenset):
            shown = ",".join(sorted(value))
        elif f.name == "database_url":
            shown = shown_url(str(value))  # a PostgreSQL URL may carry a password
        else:
            shown = str(value)
        changed.append(f"{env_name(f.name)}={shown}")
    return changed


def banner(info: ServerInfo, version: str) -> list[str]:
    """What the start says: where it serves, where it keeps its record, who
    it is, what was configured, and the operator's way in."""
    funduq = info.funduq
    settings = funduq.settings
    assert funduq.identity is not None
    lines = [
        f"funduq-trio {version} serving on {info.url}",
        f"providers attach at {info.provider_url}",
        f"record: {record_name(settings)}",
        f"funduq key: {funduq.identity.public_key_hex} (providers pin it with --funduq-key)",
        "settings: " + (", ".join(changed_settings(settings)) or "all defaults"),
        f"operator page: {info.url}/?token={funduq.operator_token}",
    ]
    if settings.database_is_postgres:
        lines.insert(
            3,
            f"node: {funduq.node} (thread leases of {settings.lease_seconds:g} s; docs/cluster.md)",
        )
    return lines


def _first_cause(exc: BaseException) -> BaseException:
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def run_server(settings: Settings, listener: socket.socket | None = None, version: str = "") -> int:
    """Serve until SIGINT or SIGTERM, then shut down (the CLI's entry).
    Returns the exit status: 0, or 2 when it could not start (said in one line)."""
    started = False
    short_of_files = open_files_for(settings)

    async def main() -> None:
        nonlocal started
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                info: ServerInfo = await nursery.start(partial(serve, settings, listener=listener))
                started = True
                # The collector's settings and its idle passes are this
                # process's own: an embedding process (the tests) starts many
                # servers, and its collector is its own (collector.py).
                collector.tune()
                nursery.start_soon(collector.pass_when_idle, name="collector")
                for line in banner(info, version):
                    log.info("%s", line)
                if short_of_files is not None:
                    log.warning("%s", short_of_files)
                async for signum in signals:
                    log.info("%s, shutting down", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                    break

    try:
        trio.run(main)
    except Exception as exc:  # noqa: BLE001 -- a start that fails is one line, not a traceback
        if started:
            raise
        cause = _first_cause(exc)
        # Errors written for a person already say what and where.
        said = isinstance(cause, SchemaTooNew | SecretFileError | RecordUnreachable)
        raise StartupError(str(cause) if said else f"{type(cause).__name__}: {cause}") from None
    return 0
