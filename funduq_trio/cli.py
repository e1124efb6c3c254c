"""`funduq-trio serve | provider | call | quality` (also `python -m funduq_trio ...`).

- `serve`: every Settings field is a FUNDUQ_* variable and a flag
  (FUNDUQ_PORT <-> --port); flags override the environment. Every way it
  cannot start is one line naming the setting as given, exit status 2.
- `provider ...`: the example provider, built on the SDK
  (`funduq_trio.provider.run_provider_cli`).
- `llm-provider ...`: KYOK offerings (a fake model, a forwarder), built on the
  SDK (`funduq_trio.provider.llm_cli`).
- `call --url <a2a url> "text"`: send one message with a2a-sdk's client and
  print the reply's text as it streams (`-v` ids, `--json` everything,
  `--thread` to continue one).
- `quality list | reset PROVIDER_KEY`: the record's quality counters, on either store
  (`funduq_trio.admin`), server stopped.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from typing import Any

from . import __version__
from .config import Settings, env_name, parse_value
from .runs_cli import add_parsers as add_run_parsers
from .runs_cli import runs_command, show_command

PROG = "funduq-trio"

FLAG_HELP = {
    "host": "interface to listen on",
    "port": "port to listen on (0 = any free port)",
    "data_dir": "directory for the SQLite file and funduq's identity key",
    "database_url": "sqlite:///path or postgresql://user@host:port/db "
    "(default: the SQLite file in the data directory)",
    "identity_key": "funduq's Ed25519 private key, hex (default: generated, kept in the data dir)",
    "unserved_grace_seconds": "how long queued runs of an agent that lost its provider wait",
    "deliver_timeout_seconds": "how long an offer waits for the provider's answer",
    "undelivered_window_seconds": "after this long an unended claimed run counts 'undelivered'",
    "quality_allowance": "a provider is withdrawn when a quality counter reaches this",
    "thread_queue_limit": "pending runs a thread may hold",
    "lane_inbox_reports": "reports one run may have waiting to be recorded before its "
    "provider's link stops reading",
    "max_frame_bytes": "largest provider-link frame",
    "max_body_bytes": "largest HTTP request body",
    "provider_keys": "comma-separated allowlist of provider public keys (default: any key)",
    "operator_token": "the operator's bearer token (default: generated, kept in the data dir)",
    "sse_keepalive_seconds": "silence before an SSE stream sends a keepalive comment (0 = never)",
    "max_queued_input_bytes": "input bytes held by waiting runs; past it new runs are refused",
    "max_queued_runs": "runs waiting in funduq (queued or offering); past it new runs are refused",
    "max_queued_runs_per_agent": "runs waiting for one agent; past it its new runs are refused",
    "max_feed_events": "events a live run keeps in memory (a follower behind reads the record)",
    "max_agents_per_provider": "agents one provider key may publish (and have recorded)",
    "handshake_timeout_seconds": "a provider link that has not said 'connect' by then is closed",
    "max_unauthenticated_links": "provider links waiting for 'connect' at once; more are refused",
    "max_connections": "connections open at once (HTTP, SSE streams, provider links); "
    "more are answered 503",
    "body_timeout_seconds": "a request body not fully received by then is answered 408 and cut",
    "max_chain_hops": "most hops an actor chain may have (counted before any signature work)",
    "max_spent_proofs": "most fresh accepted proofs kept to refuse their reuse; past it, 503",
    "max_thread_queries_per_link": "query.threadMessages in flight per provider link; past it, err",
    "max_thread_messages_per_query": "most (newest) messages one query.threadMessages answers",
    "kyok_completions_per_run": "KYOK completions one run may have in flight; past it, 429",
    "kyok_secret": "KYOK token secret, 32+ chars (default: generated, kept in the data dir)",
    "public_url": "URL agents reach funduq at, for KYOK's baseUrl (default: where it serves)",
    "push_allow_private": "allow A2A push notifications to loopback/private addresses (true/false)",
    "push_max_attempts": "attempts at one push notification before its config gives up",
    "push_backoff_seconds": "wait after a push notification's first failed attempt (doubles)",
    "push_timeout_seconds": "how long one push notification POST may take",
    "push_configs_per_task": "push notification configs one A2A task may hold",
    "push_max_active": "push notification configs delivering at once (all tasks)",
    "cors_origins": "comma-separated origins browsers may call the doors from (default: none)",
    "log_level": "debug, info, warning or error",
    "log_format": "text or json (one object per line)",
    "access_log": "log each HTTP request (true/false)",
    "node_name": "readable prefix of this process's node id in a cluster (default: node)",
    "node_url": "URL the other nodes of a cluster reach this one at (default: where it serves)",
    "lease_seconds": "a thread's lease lasts this long unrenewed; a dead node's threads "
    "move on after it (PostgreSQL)",
}


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _settings_parser(sub: Any) -> argparse.ArgumentParser:
    serve = sub.add_parser(
        "serve",
        help="run the broker (HTTP doors and the provider link on one port)",
        description="Run funduq. Every flag has an environment variable; flags win.",
    )
    for f in dataclasses.fields(Settings):
        default = f.default if f.default is not dataclasses.MISSING else None
        shown = "unset" if default is None else default
        serve.add_argument(
            flag_name(f.name),
            dest=f.name,
            metavar=env_name(f.name),
            default=None,
            help=f"{FLAG_HELP.get(f.name, f.name)} [env {env_name(f.name)}, default {shown}]",
        )
    return serve


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description="funduq: an agent broker on trio")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _settings_parser(sub)
    sub.add_parser(
        "provider",
        help="run the example provider (see `funduq-trio provider --help`)",
        add_help=False,
    )
    sub.add_parser(
        "llm-provider",
        help="serve KYOK LLM offerings (see `funduq-trio llm-provider --help`)",
        add_help=False,
    )
    call = sub.add_parser(
        "call",
        help="send one message over A2A and print the reply",
        description="Send one message with a2a-sdk's client and print the reply's text. "
        "Either --url is the agent's A2A URL (http://HOST:PORT/a2a/PROVIDER/AGENT), or "
        "--url is the server (http://HOST:PORT) and --agent names an online agent.",
    )
    call.add_argument(
        "--url", required=True, help="the agent's A2A URL, or the server's with --agent"
    )
    call.add_argument("--agent", default=None, help="look the agent up by name in GET /agents")
    call.add_argument(
        "--thread",
        "--context-id",
        dest="context_id",
        default=None,
        help="continue this thread (its id, the A2A contextId; see -v)",
    )
    call.add_argument("--no-stream", action="store_true", help="use SendMessage, not streaming")
    call.add_argument(
        "-v", "--verbose", action="store_true", help="print the run's and thread's ids (on stderr)"
    )
    call.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object: ids, state, reply and every response",
    )
    call.add_argument("text", help="the message text")
    _quality_parser(sub)
    add_run_parsers(sub)
    return parser


def _quality_parser(sub: Any) -> None:
    quality = sub.add_parser(
        "quality",
        help="list or reset providers' quality counters (in the record; server stopped)",
        description="Read or reset the providers' quality counters in the record (its "
        "SQLite file or PostgreSQL database, as serve opens it; never created). "
        "Stop the server first (every node, on PostgreSQL): a running funduq keeps "
        "its counters in memory and writes its own count back at its next strike.",
    )
    actions = quality.add_subparsers(dest="quality_command", required=True, metavar="ACTION")
    listing = actions.add_parser("list", help="every provider and its counters")
    listing.add_argument("--json", action="store_true", help="print JSON")
    reset = actions.add_parser("reset", help="zero one provider's counters")
    reset.add_argument(
        "provider",
        metavar="PROVIDER_KEY",
        help="the provider's 64-hex public key or 16-hex fingerprint",
    )
    for action in (listing, reset):
        for name in ("data_dir", "database_url"):
            action.add_argument(
                flag_name(name),
                dest=name,
                default=None,
                metavar=env_name(name),
                help=f"as for serve [env {env_name(name)}]",
            )


def as_given(message: str, flagged: set[str]) -> str:
    """Name each setting in `message` the way the user gave it: `--port 70000`
    for a flag, `FUNDUQ_PORT=70000` for a variable (messages are written with
    the variable's name); and keep it to one line."""
    for name in flagged:
        pattern = re.escape(env_name(name)) + r"(?![A-Z0-9_])(=?)"
        message = re.sub(pattern, lambda m, n=name: flag_name(n) + (" " if m[1] else ""), message)
    return " ".join(message.splitlines())


def flags_given(args: argparse.Namespace) -> set[str]:
    """The Settings fields set by a flag on this command line."""
    return {f.name for f in dataclasses.fields(Settings) if getattr(args, f.name, None) is not None}


def settings_from_args(args: argparse.Namespace, env: Any = None) -> Settings:
    """Environment first, flags over it; ValueError naming each bad setting as
    it was given (flag or variable)."""
    overrides = {}
    flagged = flags_given(args)
    for name in sorted(flagged):
        try:
            overrides[name] = parse_value(name, getattr(args, name))
        except ValueError as exc:
            raise ValueError(as_given(str(exc), flagged)) from None
    try:
        settings = Settings.from_env(env, **overrides)
    except ValueError as exc:
        raise ValueError(as_given(str(exc), flagged)) from None
    problems = settings.problems()
    if problems:
        raise ValueError(as_given("; ".join(problems), flagged))
    return settings


def agent_url(server: str, name: str) -> str:
    """The A2A URL of the one online agent called `name` on the server at `server`."""
    import httpx

    server = server.rstrip("/")
    try:
        response = httpx.get(f"{server}/agents", timeout=30)
        response.raise_for_status()
        roster = response.json()["agents"]
    except (httpx.HTTPError, ValueError, KeyError) as exc:
        raise ValueError(f"cannot read {server}/agents: {exc}") from None
    online = [a for a in roster if a.get("name") == name and a.get("online")]
    if not online:
        raise ValueError(f"no online agent named {name!r} at {server} (see {server}/agents)")
    if len(online) > 1:
        providers = ", ".join(a["fingerprint"] for a in online)
        raise ValueError(
            f"{len(online)} providers serve {name!r} ({providers}); pass the full "
            f"--url {server}/a2a/PROVIDER/{name}"
        )
    return f"{server}/a2a/{online[0]['fingerprint']}/{name}"


def card_problem(url: str) -> str | None:
    """What funduq says when the agent's card cannot be had (None: it can).
    a2a-sdk's own error for a missing card is a web link; funduq's JSON
    error says which agent or provider is unknown."""
    import httpx

    try:
        response = httpx.get(f"{url}/.well-known/agent-card.json", timeout=30)
    except httpx.HTTPError as exc:
        return f"cannot reach {url}: {exc}"
    if response.status_code == 200:
        return None
    try:
        error = response.json()["error"]
        return f"{error['message']} ({response.status_code} {error['code']})"
    except (ValueError, KeyError, TypeError):
        return f"{url}: HTTP {response.status_code}"


@dataclasses.dataclass
class CallResult:
    """What one `call` saw: the run's final state, its text, its ids."""

    state: str = "TASK_STATE_UNSPECIFIED"
    reply: str = ""
    error: str = ""
    run_id: str = ""
    thread_id: str = ""
    responses: list[dict[str, Any]] = dataclasses.field(default_factory=list)


def call(
    url: str,
    text: str,
    *,
    context_id: str | None = None,
    stream: bool = True,
    verbose: bool = False,
    as_json: bool = False,
) -> int:
    """Send `text` to the A2A agent at `url`; print the reply's text as it
    arrives (with `verbose`, the run's and thread's ids on stderr; with
    `as_json`, one JSON object with everything at the end). 0 when the task
    completed (or the agent answered with a message), 1 otherwise."""
    import asyncio
    import json

    url = url.rstrip("/")
    problem = card_problem(url)
    if problem is not None:
        print(f"{PROG} call: error: {problem}", file=sys.stderr)
        return 1
    shown = ""

    def on_reply(reply: str) -> None:
        nonlocal shown
        if as_json or not reply.startswith(shown):
            return
        sys.stdout.write(reply[len(shown) :])
        sys.stdout.flush()
        shown = reply

    def on_ids(run_id: str, thread_id: str) -> None:
        if verbose:
            print(f"run: {run_id}\nthread: {thread_id}", file=sys.stderr, flush=True)

    try:
        result = asyncio.run(_call(url, text, context_id, stream, on_reply, on_ids))
    except Exception as exc:  # noqa: BLE001 -- network, card, JSON-RPC: one line, no traceback
        if shown:
            print()
        print(f"{PROG} call: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    if as_json:
        print(
            json.dumps(
                {
                    "runId": result.run_id,
                    "threadId": result.thread_id,
                    "state": result.state,
                    "reply": result.reply,
                    "error": result.error,
                    "responses": result.responses,
                },
                indent=2,
            )
        )
    else:
        if result.reply != shown:  # a reply that did not extend what was shown
            sys.stdout.write(("\n" if shown else "") + result.reply)
        if result.reply:
            print()
        if result.error:
            print(f"{PROG} call: {result.state}: {result.error}", file=sys.stderr)
    return 0 if result.state in ("TASK_STATE_COMPLETED", "message") else 1


async def _call(
    url: str, text: str, context_id: str | None, stream: bool, on_reply: Any, on_ids: Any
) -> CallResult:
    import uuid

    from a2a.client import ClientConfig, create_client
    from a2a.types import Message, Part, Role, SendMessageRequest, TaskState
    from google.protobuf.json_format import MessageToDict

    def texts(parts: Any) -> str:
        return "".join(p.text for p in parts if p.HasField("text"))

    message = Message(message_id=uuid.uuid4().hex, role=Role.ROLE_USER, parts=[Part(text=text)])
    if context_id:
        message.context_id = context_id
    artifacts: dict[str, str] = {}
    result = CallResult()

    def saw_ids(run_id: str, thread_id: str) -> None:
        if run_id and not result.run_id:
            result.run_id, result.thread_id = run_id, thread_id
            on_ids(run_id, thread_id)

    client = await create_client(url, client_config=ClientConfig(streaming=stream))
    try:
        async for response in client.send_message(SendMessageRequest(message=message)):
            result.responses.append(MessageToDict(response))
            if response.HasField("message"):
                result.state, result.reply = "message", texts(response.message.parts)
                saw_ids(response.message.task_id, response.message.context_id)
                on_reply(result.reply)
                return result
            if response.HasField("task"):
                task = response.task
                saw_ids(task.id, task.context_id)
                artifacts = {a.artifact_id: texts(a.parts) for a in task.artifacts}
                status = task.status
            elif response.HasField("artifact_update"):
                update = response.artifact_update
                saw_ids(update.task_id, update.context_id)
                artifact = update.artifact
                before = artifacts.get(artifact.artifact_id, "") if update.append else ""
                artifacts[artifact.artifact_id] = before + texts(artifact.parts)
                on_reply("".join(artifacts.values()))
                continue
            elif response.HasField("status_update"):
                saw_ids(response.status_update.task_id, response.status_update.context_id)
                status = response.status_update.status
            else:
                continue
            on_reply("".join(artifacts.values()))
            result.state = TaskState.Name(status.state)
            result.error = texts(status.message.parts) if status.HasField("message") else ""
    finally:
        await client.close()
    if result.state == "TASK_STATE_COMPLETED":
        result.error = ""
    result.reply = "".join(artifacts.values())
    return result


def serve_command(args: argparse.Namespace) -> int:
    """`serve`: every way it cannot start is one line on stderr and status 2,
    and nothing is created before the settings are known to be good."""
    from .logs import configure_logging
    from .server import StartupError, listen_socket, prepare_storage, run_server

    flagged = flags_given(args)
    try:
        settings = settings_from_args(args)
        configure_logging(settings.log_level, settings.log_format)
        listener = listen_socket(settings)
        try:
            prepare_storage(settings)
        except BaseException:
            listener.close()
            raise
        return run_server(settings, listener, __version__)
    except (ValueError, StartupError) as exc:
        print(f"{PROG} serve: error: {as_given(str(exc), flagged)}", file=sys.stderr)
        return 2


def quality_command(args: argparse.Namespace) -> int:
    """`quality list | reset`: on the record `serve` would open (its SQLite
    file or its PostgreSQL database)."""
    import json

    from .admin import AdminError, list_quality, reset_quality

    flagged = {n for n in ("data_dir", "database_url") if getattr(args, n) is not None}
    try:
        overrides = {n: parse_value(n, getattr(args, n)) for n in flagged}
        settings = Settings.from_env(None, **overrides)
        # Only where the record is matters here (not the port, say).
        wrong = [p for p in settings.problems() if p.startswith(env_name("database_url"))]
        if wrong:
            raise ValueError(wrong[0])
        if args.quality_command == "reset":
            key = reset_quality(settings, args.provider)
            print(f"reset the quality counters of provider {key}")
            return 0
        providers = list_quality(settings)
    except (ValueError, AdminError) as exc:
        print(f"{PROG} quality: error: {as_given(str(exc), flagged)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"providers": providers}, indent=2))
        return 0
    from .broker.record import COUNTERS

    print("fingerprint       " + " ".join(f"{c:>11}" for c in COUNTERS) + "  key")
    for p in providers:
        print(
            f"{p['fingerprint']:<17} "
            + " ".join(f"{p[c]:>11}" for c in COUNTERS)
            + f"  {p['provider']}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["provider"]:
        from .provider import run_provider_cli

        return run_provider_cli(argv[1:]) or 0
    if argv[:1] == ["llm-provider"]:
        from .provider.llm_cli import run_llm_provider_cli

        return run_llm_provider_cli(argv[1:]) or 0

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve_command(args)
    if args.command == "call":
        url = args.url
        if args.agent is not None:
            try:
                url = agent_url(args.url, args.agent)
            except (ValueError, OSError) as exc:
                print(f"{PROG} call: error: {exc}", file=sys.stderr)
                return 1
        return call(
            url,
            args.text,
            context_id=args.context_id,
            stream=not args.no_stream,
            verbose=args.verbose,
            as_json=args.json,
        )
    if args.command == "quality":
        return quality_command(args)
    if args.command == "runs":
        return runs_command(args)
    if args.command == "show":
        return show_command(args)
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
