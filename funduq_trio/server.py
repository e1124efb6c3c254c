"""Run the broker and its web app on one port: `Funduq` + hypercorn's trio worker.

`serve(settings)` is the embeddable form (tests start it in a nursery and learn
the bound port from `task_status`); `run_server(settings)` is the command
line's, ending on SIGINT/SIGTERM.

Shutting down is cancelling: the web server stops first (open streams and
provider links end), then the broker closes its record. Runs in flight stay
as recorded; the next start settles them as the design says (restarts).
"""

from __future__ import annotations

import gc
import logging
import signal
import sys
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import hypercorn.trio
import trio
from hypercorn.config import Config as HypercornConfig

from .broker.funduq import Funduq
from .config import Settings
from .web.app import create_app

#: How long an idle connection is kept (between requests, or before its
#: headers are complete); FUNDUQ_BODY_TIMEOUT_SECONDS lowers it.
KEEP_ALIVE_SECONDS = 5.0
#: Request line plus headers (hypercorn's h11 bound, its default made explicit).
MAX_HEADER_BYTES = 16 * 1024


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


def hypercorn_config(settings: Settings) -> HypercornConfig:
    config = HypercornConfig()
    host = settings.host
    config.bind = [f"[{host}]:{settings.port}" if ":" in host else f"{host}:{settings.port}"]
    config.accesslog = None
    # Server errors go to the standard "hypercorn.error" logger (the CLI's
    # logging config shows them; tests capture them) rather than a private handler.
    config.errorlog = logging.getLogger("hypercorn.error")
    # The provider link enforces FUNDUQ_MAX_FRAME_BYTES itself (close 1009 with
    # its reason); hypercorn's own bound sits above it so the link's check is
    # the one a provider meets, while a runaway message is still cut (1009).
    config.websocket_max_message_size = 2 * settings.max_frame_bytes
    # A connection between requests, or one whose request line and headers
    # have not all come, is idle: hypercorn closes it after keep_alive_timeout
    # (never longer than a body may take). Headers are bounded in size too.
    # A request's body is bounded by FUNDUQ_BODY_TIMEOUT_SECONDS (the app's).
    # (hypercorn's read_timeout is not used: it would cut quiet SSE streams
    # and provider links, which are idle by design.)
    config.keep_alive_timeout = min(KEEP_ALIVE_SECONDS, settings.body_timeout_seconds)
    config.h11_max_incomplete_size = MAX_HEADER_BYTES
    return config


def shield_last_send(app: Any) -> Any:
    """The ASGI app, with the last message of each HTTP response sent shielded.

    When a response ends a connection (``Connection: close``, or a request
    body not all read, as after a 408), hypercorn closes the socket inside
    that last send. quart-trio cancels the request's tasks the moment the
    connection reports closing, which cancelled that close half-way: the
    socket then stayed open, answered and unused, for as long as the client
    kept it. Shielded, the close completes. (Hypercorn shields its own socket
    writes already; this adds only the close.)"""

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return

        async def send_last_shielded(message: Any) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                with trio.CancelScope(shield=True):
                    await send(message)
            else:
                await send(message)

        await app(scope, receive, send_last_shielded)

    return asgi


async def serve(
    settings: Settings, *, task_status: trio.TaskStatus[ServerInfo] = trio.TASK_STATUS_IGNORED
) -> None:
    """Open the broker, serve the app on settings.host:port (0 = any free port),
    then report `ServerInfo`. Runs until cancelled."""
    async with Funduq(settings) as funduq:
        app = create_app(funduq)
        async with trio.open_nursery() as nursery:
            binds: list[str] = await nursery.start(
                partial(hypercorn.trio.serve, shield_last_send(app), hypercorn_config(settings),
                        mode="asgi")
            )
            url = binds[0]
            port = urlsplit(url).port
            assert port is not None
            funduq.served_at(url)
            task_status.started(ServerInfo(url=url, port=port, funduq=funduq))


def freeze_startup_objects() -> None:
    """Leave what start-up made (modules, pydantic and protobuf schemas, the
    app: ~90,000 objects) out of the cyclic collector's full passes. Each
    full pass walked them all with the loop stopped: 64 ms, measured with
    gc.callbacks under bench/e2e.py at 150 runs/s; frozen, 11 ms. Only for
    the process the CLI owns: an embedding process (the tests) starts many
    servers and would keep each one's leftovers."""
    gc.collect()
    gc.freeze()


def run_server(settings: Settings) -> None:
    """Serve until SIGINT or SIGTERM, then shut down (the CLI's entry)."""

    async def main() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                info: ServerInfo = await nursery.start(serve, settings)
                freeze_startup_objects()
                print(f"funduq-trio serving on {info.url}", file=sys.stderr, flush=True)
                print(f"providers attach at {info.provider_url}", file=sys.stderr, flush=True)
                async for signum in signals:
                    print(
                        f"funduq-trio: {signal.Signals(signum).name}, shutting down",
                        file=sys.stderr,
                        flush=True,
                    )
                    nursery.cancel_scope.cancel()
                    break

    trio.run(main)
