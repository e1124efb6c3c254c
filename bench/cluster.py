"""A cluster on one host (issue #12 item 6, docs/cluster.md): the same load
through 1, 2 and 3 `funduq-trio serve` nodes on one PostgreSQL, beside
1 node on PostgreSQL and 1 node on SQLite, measured in the same run.

- Each configuration gets fresh nodes (`python -m funduq_trio serve`
  children, each with its own data directory) and, on PostgreSQL, a fresh
  schema, dropped afterwards.
- `--providers` SDK provider keys (the example echo agent, `--deltas` text
  deltas = deltas + 4 events a run); each key is attached to every node: one
  provider child per key per node, all children of a key sharing its key
  file (a provider with one link per node, as `Provider` attaches to
  several).
- `--threads` conversations, spread round-robin over the nodes; each
  thread's caller is pinned to its node (forwarding between nodes is not
  built yet: a thread's follow-ups must reach the node leading it) and sends
  its share of `--runs` utterances one after another. Even threads use the
  A2A door, odd ones AG-UI, on keep-alive connections with the lean h11
  client (`harness.Caller`), as `bench/e2e.py --client lean`.
- Every run is then read back from the record (`GET /runs/{id}` on the
  first node): completed with all its events, or the bench fails.
- The cross-node hop of event relay is `bench/cluster_relay.py`'s lockstep
  measurement (a caller on the run's leader and one on another node, same
  run), once per round. Offers do not cross nodes yet (a node offers only to
  providers attached to it), so the offer round trip has no hop to measure;
  its figure per configuration is each node's own histogram, summed.

Printed: per configuration the median over `--rounds` rounds (the
configurations alternate within each round) of runs/s, funduq server CPU
per run (all nodes), per node, caller latency p50/p99 and the offer round
trip; then each round's runs/s and the CPU shares of the host.

    python bench/cluster.py                        # 600 runs / 60 threads, 3 rounds
    python bench/cluster.py --runs 1000 --threads 90 --rounds 5

Needs the `postgres` extra and a PostgreSQL at FUNDUQ_TEST_POSTGRES_URL
(default postgresql://postgres@127.0.0.1:5432/test), like the tests.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import cluster_relay
import e2e
import harness as h
import httpx
import trio

#: (name, store, nodes), in the order of each round's first pass.
CONFIGS = (
    ("sqlite, 1 node", "sqlite", 1),
    ("postgres, 1 node", "postgres", 1),
    ("postgres, 2 nodes", "postgres", 2),
    ("postgres, 3 nodes", "postgres", 3),
)


def backend_pids(app: str) -> set[int]:
    """The PostgreSQL server processes serving connections named ``app``."""
    import psycopg

    with psycopg.connect(cluster_relay.POSTGRES_URL, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (app,)
        ).fetchall()
    return {int(r[0]) for r in rows}


def cpu_of(pids: set[int]) -> dict[int, float]:
    out = {}
    for pid in pids:
        try:
            out[pid] = h.proc_cpu(pid)
        except OSError:
            pass  # gone meanwhile
    return out


class Cluster:
    """`nodes` servers on one record, each with every provider key attached."""

    def __init__(
        self,
        work: Path,
        nodes: int,
        database_url: str | None,
        providers: int,
        deltas: int,
        app: str | None = None,
    ):
        #: The nodes' PostgreSQL connections carry this application_name.
        self.app = app
        self.servers: list[h.Server] = []
        self.providers: list[h.ProviderChild] = []
        try:
            for n in range(nodes):
                env = {"FUNDUQ_NODE_NAME": f"bench{n}"}
                if database_url is not None:
                    env["FUNDUQ_DATABASE_URL"] = database_url
                self.servers.append(h.Server(work / f"node{n}", env=env))
            for n, server in enumerate(self.servers):
                pdir = work / f"providers{n}"
                pdir.mkdir()
                for k in range(providers):
                    if n:  # the same key on every node
                        shutil.copy(work / "providers0" / f"provider-{k}.key", pdir)
                    self.providers.append(h.ProviderChild(server.ws_url, pdir, k, deltas=deltas))
        except BaseException:
            self.stop()
            raise
        self.fingerprints = sorted({p.fingerprint for p in self.providers})

    def stop(self) -> None:
        for p in self.providers:
            p.stop()
        for s in self.servers:
            s.stop()


async def offer_histogram(client: httpx.AsyncClient, urls: list[str]) -> list[tuple[float, int]]:
    """Every node's offer round trip histogram, summed bucket by bucket."""
    total: list[tuple[float, int]] = []
    for url in urls:
        one = await h.offer_round_trips(client, url)
        total = (
            one if not total else [(le, n + m) for (le, n), (_, m) in zip(one, total, strict=True)]
        )
    return total


async def measure(args: argparse.Namespace, cluster: Cluster) -> dict[str, Any]:
    urls = [s.url for s in cluster.servers]
    nodes = len(urls)
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=120) as client:
        for url in urls:
            await h.wait_online(client, url, cluster.fingerprints)
        loads = [e2e.Load(args, url, cluster.fingerprints) for url in urls]
        # Warm up every node: connections, code paths, each node's caches.
        warm = [e2e.Load(args, url, cluster.fingerprints) for url in urls]
        async with trio.open_nursery() as nursery:
            for i in range(nodes * 4):
                nursery.start_soon(warm[i % nodes].caller, i, max(1, args.warmup // (nodes * 4)))
        errors = [e for w in warm for e in w.errors]
        if errors:
            raise SystemExit(f"warm-up failed: {errors[:3]}")

        pids = {f"node{n}": s.pid for n, s in enumerate(cluster.servers)}
        pids["providers"] = cluster.providers[0].pid  # one of them, for scale
        pids["callers (this process)"] = os.getpid()
        cpu = h.CpuWatch(pids)
        backends = backend_pids(cluster.app) if cluster.app else set()
        backend_cpu = cpu_of(backends)
        node_cpu = [h.proc_cpu(s.pid) for s in cluster.servers]
        provider_cpu = sum(h.proc_cpu(p.pid) for p in cluster.providers)
        histogram = await offer_histogram(client, urls)
        cpu.start()
        began = time.monotonic()
        with trio.fail_after(args.time_limit):
            async with trio.open_nursery() as nursery:
                for i in range(args.threads):
                    count = args.runs // args.threads + (i < args.runs % args.threads)
                    nursery.start_soon(loads[i % nodes].caller, i, count)
        out["seconds"] = time.monotonic() - began
        out["cpu"] = cpu.shares()
        out["node_cpu_s"] = [
            h.proc_cpu(s.pid) - c for s, c in zip(cluster.servers, node_cpu, strict=True)
        ]
        out["provider_cpu_s"] = sum(h.proc_cpu(p.pid) for p in cluster.providers) - provider_cpu
        if cluster.app:
            # Backends made during the load count whole (they started in it).
            now = cpu_of(backends | backend_pids(cluster.app))
            out["pg_cpu_s"] = sum(c - backend_cpu.get(pid, 0.0) for pid, c in now.items())
        out["offer"] = (histogram, await offer_histogram(client, urls))
        results = [r for load in loads for r in load.results]
        out["errors"] = [e for load in loads for e in load.errors]
        out["node_runs"] = [len(load.results) for load in loads]
        out["latency"] = [r["done"] - r["began"] for r in results if r["ok"]]
        run_ids = [r["run_id"] for r in results if r["run_id"]]
        verified = await verify(urls[0], run_ids, loads[0].events_per_run)
        out["completed"] = verified["statuses"].get("completed", 0) - len(verified["short"])
        out["statuses"] = verified["statuses"]
    return out


async def verify(url: str, run_ids: list[str], events_per_run: int) -> dict[str, Any]:
    """`e2e.verify` on a client of its own, a request retried once when its
    pooled connection turns out closed (seen after long loads)."""
    statuses: dict[str, int] = {}
    short: list[str] = []
    queue = list(run_ids)

    async def worker(client: httpx.AsyncClient) -> None:
        while queue:
            run_id = queue.pop()
            for attempt in range(3):
                try:
                    response = await client.get(f"{url}/runs/{run_id}")
                    break
                except httpx.TransportError as exc:
                    if attempt == 2:
                        raise
                    print(f"  GET /runs/{run_id}: {exc!r}; again", file=sys.stderr)
                    await trio.sleep(0.2)
            record = response.json()
            status = record.get("status", "missing")
            statuses[status] = statuses.get(status, 0) + 1
            if status == "completed" and len(record["events"]) != events_per_run:
                short.append(run_id)

    limits = httpx.Limits(max_connections=8, max_keepalive_connections=8)
    async with httpx.AsyncClient(limits=limits, timeout=120) as client:
        async with trio.open_nursery() as nursery:
            for _ in range(8):
                nursery.start_soon(worker, client)
    return {"statuses": statuses, "short": short}


async def one_config(
    args: argparse.Namespace, store: str, nodes: int, work: Path
) -> dict[str, Any]:
    schema = url = app = None
    if store == "postgres":
        schema, url = cluster_relay.new_schema()
        app = schema  # the nodes' connections, named for pg_stat_activity
        url += f"&application_name={app}"
    try:
        # On this thread, blocking: the children die with the thread that
        # started them (PR_SET_PDEATHSIG follows the parent thread), and a
        # worker thread of trio's ends once idle a while.
        cluster = Cluster(work, nodes, url, args.providers, args.deltas, app)
        try:
            return await measure(args, cluster)
        finally:
            cluster.stop()
    finally:
        if schema is not None:
            cluster_relay.drop_schema(schema)


async def relay_hop(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    with cluster_relay.scratch_schema() as url:
        ns = argparse.Namespace(events=args.relay_events, warmup=20)
        return await cluster_relay.measure(ns, url, work)


async def main_async(args: argparse.Namespace) -> int:
    rounds: list[dict[str, dict[str, Any]]] = []
    hops: list[dict[str, Any]] = []
    for r in range(args.rounds):
        # Alternate the order from round to round, so no configuration is
        # always the one measured while the host is busiest.
        order = CONFIGS if r % 2 == 0 else tuple(reversed(CONFIGS))
        this: dict[str, dict[str, Any]] = {}
        for name, store, nodes in order:
            with h.fresh_dir("funduq-cluster-") as work:
                this[name] = await one_config(args, store, nodes, Path(work))
            got = this[name]
            print(
                f"  round {r + 1} {name:<18} {args.runs / got['seconds']:7.1f} runs/s  "
                f"other processes {got['cpu']['other processes'] * 100:4.0f}%",
                file=sys.stderr,
            )
        rounds.append(this)
        if args.relay_events:
            with h.fresh_dir("funduq-cluster-relay-") as work:
                hops.append(await relay_hop(args, Path(work)))
    report(args, rounds, hops)
    failed = [
        (r, name)
        for r, this in enumerate(rounds)
        for name, got in this.items()
        if got["completed"] != args.runs or got["errors"]
    ]
    for r, name in failed:
        got = rounds[r][name]
        print(
            f"round {r + 1} {name}: {args.runs - got['completed']} runs not completed; "
            f"statuses {got['statuses']}; errors {got['errors'][:3]}"
        )
    return 1 if failed or not all(hop["in_order"] for hop in hops) else 0


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def report(
    args: argparse.Namespace, rounds: list[dict[str, dict[str, Any]]], hops: list[dict[str, Any]]
) -> None:
    print(
        f"cluster: {args.runs} runs over {args.threads} threads, {args.deltas + 4} events a run, "
        f"{args.providers} provider keys on every node, lean callers pinned round-robin; "
        f"{h.describe_build()}"
    )
    print(
        f"medians of {len(rounds)} rounds (the host's 2 cores are shared: single rounds move by "
        "tens of percent; read the medians and the same-round ratios)"
    )
    head = (
        f"{'configuration':<18} {'runs/s':>7} {'vs pg 1':>7} {'CPU/run':>8} "
        f"{'per node (ms/run there)':>24} {'p50 ms':>7} {'p99 ms':>7} "
        f"{'offer p50<=':>11} {'p99<=':>7} {'PG/run':>7}"
    )
    print(head)
    for name, _store, _nodes in CONFIGS:
        got = [this[name] for this in rounds]
        rate = median([args.runs / g["seconds"] for g in got])
        ratio = median(
            [
                (args.runs / this[name]["seconds"])
                / (args.runs / this["postgres, 1 node"]["seconds"])
                for this in rounds
            ]
        )
        cpu = median([sum(g["node_cpu_s"]) / args.runs * 1e3 for g in got])
        per_node = [
            median([g["node_cpu_s"][n] / max(1, g["node_runs"][n]) * 1e3 for g in got])
            for n in range(len(got[0]["node_cpu_s"]))
        ]
        p50 = median([h.ms(g["latency"], 0.5) for g in got])
        p99 = median([h.ms(g["latency"], 0.99) for g in got])
        o50 = median([h.histogram_quantile(*g["offer"], 0.5)[0] * 1e3 for g in got])
        o99 = median([h.histogram_quantile(*g["offer"], 0.99)[0] * 1e3 for g in got])
        nodes_text = " ".join(f"{v:.2f}" for v in per_node)
        pg = (
            f"{median([g['pg_cpu_s'] / args.runs * 1e3 for g in got]):5.2f}ms"
            if "pg_cpu_s" in got[0]
            else "      -"
        )
        print(
            f"{name:<18} {rate:7.1f} {ratio:7.2f} {cpu:6.2f}ms {nodes_text:>24} "
            f"{p50:7.1f} {p99:7.1f} {o50:9.1f}ms {o99:5.0f}ms {pg}"
        )
    print("each round (runs/s; other processes' CPU, 100% = one core):")
    for r, this in enumerate(rounds):
        cells = "  ".join(
            f"{name.replace('postgres', 'pg')}: {args.runs / g['seconds']:.0f} "
            f"({g['cpu']['other processes'] * 100:.0f}%)"
            for name, g in this.items()
        )
        print(f"  {r + 1}: {cells}")
    if hops:
        print(
            "event relay across nodes (bench/cluster_relay.py lockstep, "
            f"{args.relay_events} events a round, provider send -> caller read; "
            f"medians of {len(hops)} rounds):"
        )
        for key, name in (
            ("same", "caller on the run's leader"),
            ("other", "caller on another node"),
            ("hop", "the hop (other - leader)"),
        ):
            p50 = median([h.ms(hop[key], 0.5) for hop in hops])
            p99 = median([h.ms(hop[key], 0.99) for hop in hops])
            print(f"  {name:<28} p50 {p50:6.2f} ms  p99 {p99:6.2f} ms")
        print(f"  every event on both callers in seq order: {all(hop['in_order'] for hop in hops)}")
    print(
        "CPU/run: the funduq nodes' CPU / runs; per node: a node's CPU / the runs its callers "
        "made; PG/run: the PostgreSQL backends serving the nodes' connections / runs"
    )
    print(
        "offer round trip: no cross-node hop exists (a node offers only to providers attached "
        "to it); the figure above is every node's own histogram, summed"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=600)
    parser.add_argument("--threads", type=int, default=60)
    parser.add_argument("--deltas", type=int, default=8, help="text deltas a run (events = +4)")
    parser.add_argument(
        "--providers", type=int, default=2, help="provider keys, each on every node"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=24, help="runs before each load")
    parser.add_argument("--relay-events", type=int, default=200, help="0: skip the relay hop")
    parser.add_argument("--time-limit", type=float, default=300, help="per load, seconds")
    args = parser.parse_args()
    args.door, args.client = "mix", "lean"  # what e2e.Load reads
    if (why := cluster_relay.postgres_missing()) is not None:
        print(why, file=sys.stderr)
        return 2
    return trio.run(main_async, args)


if __name__ == "__main__":
    raise SystemExit(main())
