"""`funduq-trio runs` and `funduq-trio show RUN_ID`: finding runs on a running
funduq through its read routes (`GET /runs`, `GET /runs/{id}`).

Who sees what is the server's rule (DESIGN §8): a listing names a thread, or
carries the operator's token to see everything. The token is `--token`, else
`FUNDUQ_OPERATOR_TOKEN`, else the `operator.token` file of the data directory
(`--data-dir` / `FUNDUQ_DATA_DIR`, as for `serve`) when this machine runs the
server; without one, `runs` lists only the `--thread` it names.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

PROG = "funduq-trio"


def add_parsers(sub: Any) -> None:
    runs = sub.add_parser(
        "runs",
        help="list runs, newest first (GET /runs)",
        description="List runs on a running funduq, newest first. Without the operator's "
        "token only the --thread named is listed.",
    )
    runs.add_argument("--thread", help="only this thread's runs")
    runs.add_argument("--agent", help="only this agent's runs")
    runs.add_argument("--provider", help="only runs of this provider (key or fingerprint)")
    runs.add_argument("--status", help="only runs in these statuses (comma-separated)")
    runs.add_argument("--limit", type=int, default=20, help="at most this many (default 20)")
    runs.add_argument("--cursor", help="the next page: the cursor the last page printed")
    show = sub.add_parser(
        "show",
        help="one run: status, metadata and every event",
        description="Show one run as funduq recorded it (GET /runs/RUN_ID).",
    )
    show.add_argument("run_id", metavar="RUN_ID")
    for parser in (runs, show):
        parser.add_argument(
            "--url",
            default="http://127.0.0.1:8000",
            help="the server (default http://127.0.0.1:8000)",
        )
        parser.add_argument(
            "--token",
            help="the operator's token (default: "
            "FUNDUQ_OPERATOR_TOKEN, else the data directory's operator.token)",
        )
        parser.add_argument(
            "--data-dir",
            help="where to find operator.token [env FUNDUQ_DATA_DIR, default ./funduq-data]",
        )
        parser.add_argument("--json", action="store_true", help="print the server's JSON")


def operator_token(args: argparse.Namespace, env: Any = None) -> str | None:
    env = os.environ if env is None else env
    if args.token:
        return str(args.token)
    if env.get("FUNDUQ_OPERATOR_TOKEN"):
        return str(env["FUNDUQ_OPERATOR_TOKEN"])
    path = Path(args.data_dir or env.get("FUNDUQ_DATA_DIR") or "./funduq-data") / "operator.token"
    try:
        return path.read_text("ascii").strip() or None
    except (OSError, UnicodeDecodeError):
        return None


def _get(args: argparse.Namespace, path: str, params: dict[str, Any] | None = None) -> Any:
    import httpx

    token = operator_token(args)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    url = args.url.rstrip("/") + path
    try:
        response = httpx.get(url, params=params, headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot reach {url}: {exc}") from None
    try:
        body = response.json()
    except ValueError:
        raise ValueError(f"{url} answered {response.status_code} without JSON") from None
    if response.status_code != 200:
        error = body.get("error", {}) if isinstance(body, dict) else {}
        raise ValueError(
            f"{url}: {response.status_code} {error.get('code', '')}: {error.get('message', body)}"
        )
    return body


def runs_command(args: argparse.Namespace) -> int:
    params = {
        k: v
        for k, v in (
            ("thread", args.thread),
            ("agent", args.agent),
            ("provider", args.provider),
            ("status", args.status),
            ("limit", args.limit),
            ("cursor", args.cursor),
        )
        if v is not None
    }
    try:
        page = _get(args, "/runs", params)
    except ValueError as exc:
        print(f"{PROG} runs: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(page, indent=2))
        return 0
    for run in page["runs"]:
        reason = (run.get("metadata") or {}).get("failureReason")
        print(
            f"{run['runId']}  {run['status']:<14} {run['agent']['name']:<16} "
            f"{run['threadId']}  {run['createdAt']}" + (f"  ({reason})" if reason else "")
        )
    if not page["runs"]:
        print(
            "no runs"
            + (
                ""
                if args.thread or operator_token(args)
                else " (name a --thread, or give the operator's --token to see all)"
            ),
            file=sys.stderr,
        )
    if page.get("nextCursor"):
        print(f"more: --cursor {page['nextCursor']}", file=sys.stderr)
    return 0


def show_command(args: argparse.Namespace) -> int:
    try:
        run = _get(args, f"/runs/{args.run_id}")
    except ValueError as exc:
        print(f"{PROG} show: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(run, indent=2))
        return 0
    print(
        f"run     {run['runId']}\nthread  {run['threadId']}\n"
        f"agent   {run['agent']['name']} (provider {run['agent']['provider']})\n"
        f"status  {run['status']}"
    )
    for key, value in (run.get("metadata") or {}).items():
        print(f"{key:<8}{json.dumps(value)}")
    print(f"created {run['createdAt']}  started {run['startedAt']}  completed {run['completedAt']}")
    for entry in run.get("events") or ():
        event = entry["event"]
        rest = {k: v for k, v in event.items() if k not in ("type", "threadId", "runId")}
        print(f"  {entry['seq']:>4} {event.get('type', '?'):<22} {json.dumps(rest)[:120]}")
    return 0
