"""`funduq-trio provider`: run the example provider built on the SDK.

    funduq-trio provider --url ws://127.0.0.1:8000/ws/provider \
        --key-file provider.key --agent echo [--agent kyok] [--max-concurrent N]
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

import trio

from funduq_trio.identity import Identity, IdentityFileError

from .echo import make_echo
from .llm import kyok_chat
from .runtime import Backoff, ConnectRejected, FunduqKeyMismatch, Provider, RegisterRejected

__all__ = ["build_provider_parser", "run_provider_cli"]

PROG = "funduq-trio provider"


def _agents(args: argparse.Namespace) -> dict[str, Callable[..., Any]]:
    return {"echo": make_echo(args.echo_deltas, delay=args.echo_delay), "kyok": kyok_chat}


def build_provider_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Run the example provider: connect out to funduq, publish the chosen "
        "agents, serve their runs; reconnect when the link drops.",
    )
    add_link_arguments(parser, key_file="provider.key")
    parser.add_argument(
        "--agent",
        action="append",
        choices=["echo", "kyok"],
        help="an agent to serve (repeatable; default: echo). `kyok` answers by asking "
        "the LLM its caller opted into (KYOK; needs the `kyok` extra)",
    )
    parser.add_argument(
        "--max-concurrent",
        type=int,
        default=None,
        metavar="N",
        help="runs held at once (default: unlimited)",
    )
    parser.add_argument(
        "--funduq-key",
        default=None,
        metavar="HEX",
        help="pin funduq's public key: refuse a funduq that cannot prove it holds it",
    )
    parser.add_argument(
        "--echo-deltas",
        type=int,
        default=3,
        metavar="N",
        help="TEXT_MESSAGE_CONTENT events per echo run (events per run = N + 4)",
    )
    parser.add_argument(
        "--echo-delay",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="pause before each echo delta (default: none)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log the link's doings")
    return parser


def link_url_problem(url: str) -> str | None:
    """Why `url` cannot be funduq's provider link (None: it can)."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 -- raises ValueError on a bad port
    except ValueError as exc:
        return f"--url {url}: {exc}"
    if parts.scheme in ("http", "https"):
        ws = "ws" + url[len("http") :]
        return f"--url {url}: the provider link is a WebSocket URL (try {ws})"
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        return f"--url {url}: expected ws://HOST:PORT/ws/provider (or wss://)"
    return None


def add_link_arguments(parser: argparse.ArgumentParser, *, key_file: str) -> None:
    """The arguments every provider command takes: where funduq's link is, and
    which key this provider is."""
    parser.add_argument(
        "--url",
        default="ws://127.0.0.1:8000/ws/provider",
        help="funduq's provider link (default: %(default)s)",
    )
    parser.add_argument(
        "--key-file",
        default=key_file,
        help="the provider's Ed25519 key (hex); created if absent (default: %(default)s)",
    )


def serve_until_signal(provider: Provider, prog: str) -> int:
    """Run `provider` until SIGINT/SIGTERM; 1 when funduq refused it (one
    line on stderr), else 0."""
    status = 0

    async def serve(cancel_scope: trio.CancelScope) -> None:
        nonlocal status
        try:
            await provider.run()
        except (ConnectRejected, FunduqKeyMismatch, RegisterRejected) as exc:
            print(f"{prog}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
            status = 1
        cancel_scope.cancel()

    async def main() -> None:
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve, nursery.cancel_scope)
                async for signum in signals:
                    name = signal.Signals(signum).name
                    print(f"{prog}: {name}, stopping", file=sys.stderr, flush=True)
                    nursery.cancel_scope.cancel()
                    break

    trio.run(main)
    return status


def run_provider_cli(argv: list[str] | None = None) -> int:
    """The `funduq-trio provider` command. Returns the process exit status."""
    parser = build_provider_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.max_concurrent is not None and args.max_concurrent < 0:
        parser.error("--max-concurrent is a count (>= 0)")
    if args.echo_deltas < 1:
        parser.error("--echo-deltas is at least 1")
    problem = link_url_problem(args.url)
    if problem is not None:
        print(f"{PROG}: error: {problem}", file=sys.stderr)
        return 2
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    # Always say when the link attaches (again, after a reconnect) and when
    # it drops: the SDK logs both under its own logger.
    logging.getLogger("funduq_trio.provider").setLevel(logging.INFO)
    try:
        identity = Identity.load_or_create(args.key_file)
    except (IdentityFileError, OSError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    provider = Provider(
        identity,
        args.url,
        funduq_key=args.funduq_key,
        max_concurrent_runs=args.max_concurrent,
        backoff=Backoff(),
    )
    chosen = _agents(args)
    for name in args.agent or ["echo"]:
        provider.add_agent(chosen[name], name=name)
    # Serving is said once it is true: the SDK logs "attached to … serving …"
    # after funduq has taken the agents.
    print(
        f"{PROG}: key {identity.public_key_hex} (fingerprint {identity.fingerprint}); "
        f"connecting to {args.url}",
        file=sys.stderr,
        flush=True,
    )

    return serve_until_signal(provider, PROG)
