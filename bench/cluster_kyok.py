"""What relaying a KYOK completion through another node costs (issue #12,
docs/cluster.md "KYOK from any node").

- Two `funduq-trio serve` children on one PostgreSQL database (a fresh
  schema, dropped at the end): B, then A with `FUNDUQ_PUBLIC_URL` = B's URL
  (B stands for a load balancer's address: every grant names B).
- In this process: an LLM provider (the SDK's `fake_model`) and an agent
  attached to A, which leads the run. The agent's one run makes `--calls`
  whole (non-streaming) completions one at a time, alternately straight to
  A (the baseline: the leader itself) and to B (relayed to A over the
  internal route), each signed by its provider key as the SDK signs; the
  first `--warmup` of each are left out. Each figure is one call's latency
  on this process's monotonic clock, request sent to answer read.

    python bench/cluster_kyok.py                 # 300 calls of each (+20 warm-up)

Needs the `postgres` and `kyok` extras and a PostgreSQL at
FUNDUQ_TEST_POSTGRES_URL (default postgresql://postgres@127.0.0.1:5432/test).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import harness as h
import httpx
import trio
from ag_ui.core import RunFinishedEvent, RunStartedEvent
from cluster_relay import postgres_missing, scratch_schema

from funduq_trio.identity import Identity
from funduq_trio.provider import Provider, fake_model
from funduq_trio.provider.llm import kyok_grant, kyok_http_client

AGENT = "timer"


async def measure(args: argparse.Namespace, url: str, work: Path) -> dict[str, list[float]]:
    b = h.Server(work / "b", env={"FUNDUQ_DATABASE_URL": url})
    try:
        a = h.Server(work / "a", env={"FUNDUQ_DATABASE_URL": url, "FUNDUQ_PUBLIC_URL": b.url})
        try:
            return await _run(args, a.url, a.ws_url)
        finally:
            a.stop()
    finally:
        b.stop()


async def _run(args: argparse.Namespace, url_a: str, ws_a: str) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {"leader": [], "relayed": []}
    agent_identity = Identity.generate()

    async def timer(run_input: Any, ctx: Any) -> Any:
        yield RunStartedEvent(thread_id=run_input.thread_id, run_id=run_input.run_id)
        grant = kyok_grant(run_input)
        assert grant is not None
        targets = {
            "leader": url_a + "/kyok/v1/chat/completions",
            "relayed": grant["baseUrl"] + "/chat/completions",
        }
        bearer = {"Authorization": f"Bearer {grant['token']}"}
        async with kyok_http_client(grant, agent_identity, headers=bearer) as client:
            for i in range(2 * (args.calls + args.warmup)):
                which = "leader" if i % 2 == 0 else "relayed"
                body = {"model": "m", "messages": [{"role": "user", "content": f"ping {i}"}]}
                started = time.monotonic()
                answer = await client.post(targets[which], json=body)
                took = time.monotonic() - started
                if answer.status_code != 200:
                    raise SystemExit(f"{which}: {answer.status_code} {answer.text}")
                if i >= 2 * args.warmup:
                    times[which].append(took)
        yield RunFinishedEvent(thread_id=run_input.thread_id, run_id=run_input.run_id)

    llm = Provider(Identity.generate(), ws_a)
    llm.add_offering(fake_model, name="fake")
    agent = Provider(agent_identity, ws_a)
    agent.add_agent(timer, name=AGENT)
    async with trio.open_nursery() as nursery:
        await nursery.start(llm.run)
        await nursery.start(agent.run)
        body = h.agui_body("bench-thread", "go", "m-1")
        body["forwardedProps"] = {
            "kyok": {
                "llmProvider": {"providerKey": llm.identity.public_key_hex, "name": "fake"},
                "context": None,
            }
        }
        async with (
            httpx.AsyncClient(timeout=600) as http,
            http.stream(
                "POST", f"{url_a}/agui/{agent_identity.fingerprint}/{AGENT}", json=body
            ) as response,
        ):
            if response.status_code != 200:
                raise SystemExit(f"the run was refused: {await response.aread()!r}")
            async for _ in response.aiter_lines():
                pass
        nursery.cancel_scope.cancel()
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=300, help="calls measured, of each")
    parser.add_argument("--warmup", type=int, default=20, help="calls made first, of each")
    args = parser.parse_args()
    if (why := postgres_missing()) is not None:
        print(why, file=sys.stderr)
        return 2
    with scratch_schema() as url, h.fresh_dir("funduq-cluster-kyok-") as work:
        times = trio.run(measure, args, url, Path(work))
    print(f"cluster kyok: {args.calls} whole completions of each, alternated; {h.describe_build()}")
    print(f"{'call':<34} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}")
    for name, label in (("leader", "to A, the run's leader"), ("relayed", "to B, relayed to A")):
        values = times[name]
        p50, p90, p99 = (h.ms(values, q) for q in (0.5, 0.9, 0.99))
        print(f"{label:<34} {p50:8.2f} {p90:8.2f} {p99:8.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
