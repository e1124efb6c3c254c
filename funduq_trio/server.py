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
from urllib.parse import urlsplit

import hypercorn.trio
import trio
from hypercorn.config import Config as HypercornConfig

from .broker.funduq import Funduq
from .config import Settings
from .web.app import create_app


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
    return config


async def serve(
    settings: Settings, *, task_status: trio.TaskStatus[ServerInfo] = trio.TASK_STATUS_IGNORED
) -> None:
    """Open the broker, serve the app on settings.host:port (0 = any free port),
    then report `ServerInfo`. Runs until cancelled."""
    async with Funduq(settings) as funduq:
        app = create_app(funduq)
        async with trio.open_nursery() as nursery:
            binds: list[str] = await nursery.start(
                partial(hypercorn.trio.serve, app, hypercorn_config(settings), mode="asgi")
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
