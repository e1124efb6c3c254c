"""`funduq-trio llm-provider`: serve KYOK offerings over the provider link.

    funduq-trio llm-provider --url ws://127.0.0.1:8000/ws/provider \
        --key-file llm.key --offering fake \
        [--offering forward --forward-url https://api.example/v1 \
         --forward-key-env OPENAI_API_KEY --forward-model gpt-x]

`fake` is a deterministic model (for tests and demos); `forward` relays each
completion to any OpenAI-compatible endpoint, with the API key read from an
environment variable (never a flag: flags show in `ps`).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from funduq_trio.identity import Identity, IdentityFileError

from .cli import add_link_arguments, serve_until_signal
from .llm import fake_model, make_forwarder
from .runtime import Backoff, Provider

__all__ = ["build_llm_provider_parser", "run_llm_provider_cli"]

PROG = "funduq-trio llm-provider"


def build_llm_provider_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Serve KYOK LLM offerings: connect out to funduq, publish them, answer "
        "each completion funduq relays; reconnect when the link drops.",
    )
    add_link_arguments(parser, key_file="llm-provider.key")
    parser.add_argument(
        "--offering",
        action="append",
        choices=["fake", "forward"],
        help="an offering to serve (repeatable; default: fake)",
    )
    parser.add_argument("--fake-name", default="fake", help="the fake model's offering name")
    parser.add_argument(
        "--forward-name",
        default="forward",
        help="the forwarder's offering name (default: %(default)s)",
    )
    parser.add_argument(
        "--forward-url", default=None, help="the OpenAI-compatible endpoint's base URL (…/v1)"
    )
    parser.add_argument(
        "--forward-key-env",
        default="OPENAI_API_KEY",
        metavar="VAR",
        help="environment variable holding its API key (default: %(default)s)",
    )
    parser.add_argument(
        "--forward-model",
        default=None,
        help="model to ask for, whatever the agent named (default: the agent's)",
    )
    parser.add_argument("--funduq-key", default=None, metavar="HEX", help="pin funduq's public key")
    parser.add_argument("-v", "--verbose", action="store_true", help="log the link's doings")
    return parser


def build_llm_provider(args: argparse.Namespace, env: dict[str, str] | None = None) -> Provider:
    """The provider the arguments describe (ValueError when they cannot work)."""
    env = dict(os.environ) if env is None else env
    identity = Identity.load_or_create(args.key_file)
    provider = Provider(identity, args.url, funduq_key=args.funduq_key, backoff=Backoff())
    for offering in args.offering or ["fake"]:
        if offering == "fake":
            provider.add_offering(
                fake_model, name=args.fake_name, description="a deterministic fake model"
            )
            continue
        if not args.forward_url:
            raise ValueError("--offering forward needs --forward-url")
        api_key = env.get(args.forward_key_env)
        if not api_key:
            raise ValueError(f"--offering forward: ${args.forward_key_env} is not set")
        provider.add_offering(
            make_forwarder(args.forward_url, api_key, model=args.forward_model),
            name=args.forward_name,
            description=f"forwards to {args.forward_url}",
        )
    return provider


def run_llm_provider_cli(argv: list[str] | None = None) -> int:
    parser = build_llm_provider_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(name)s %(levelname)s %(message)s",
    )
    try:
        provider = build_llm_provider(args)
    except (IdentityFileError, OSError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(
        f"{PROG}: key {provider.identity.public_key_hex} (fingerprint "
        f"{provider.identity.fingerprint}); offering {', '.join(provider.offerings)} at "
        f"{args.url}",
        file=sys.stderr,
        flush=True,
    )
    return serve_until_signal(provider, PROG)
