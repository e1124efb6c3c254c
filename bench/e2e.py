"""End-to-end loopback benchmark: the real server process, real SDK providers
over websockets, real HTTP callers on both doors.

- `funduq-trio serve` runs as a child process (fresh data directory, the
  SQLite record on disk, port 0 on 127.0.0.1), so its peak RSS is its own
  (VmHWM in /proc/<pid>/status).
- `--providers` SDK providers (the example echo agent, `--deltas` text deltas
  = deltas + 4 events a run) run as child processes over websockets; they
  stamp offer arrival, answer and finish on CLOCK_MONOTONIC (one clock for all
  processes of a Linux host), which is how the offer figures below are had.
- Callers (httpx, in this process): `--threads` conversations, each sending
  its share of `--runs` utterances one after another on its own thread. Even
  threads use the A2A door (`SendMessage`, blocking, JSON-RPC over HTTP), odd
  threads the AG-UI door (POST a RunAgentInput, read the SSE stream to its
  end); `--door a2a|agui` sends them all through one door.
- Every run is then checked in the record (`GET /runs/{id}`): completed, with
  all its events. "not completed" must be 0.
- Baselines, measured in the same run against the same server before the
  load: `GET /healthz` round trips from the same number of concurrent callers
  (the raw HTTP rate: the front, routing, httpx); the same healthz served
  by quart-trio on hypercorn in a child process (the stack issue #16 was
  filed against, whose healthz is the issue's unit); and provider-link
  websocket round trips (a frame the link answers `err` at once: websocket
  read, frame decode, outbox, write; no broker). Ratios are printed.

    python bench/e2e.py                       # 1,000 runs over 100 threads, 12 events each
    python bench/e2e.py --runs 500 --threads 50 --profile /tmp/server.raw

Bounded: fixed counts, a `--time-limit` on the whole load, loopback only;
the child processes are stopped at the end.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import asgi_floor
import harness as h
import httpx
import profile_shares
import trio


def utterance(thread: int, index: int) -> str:
    return f"bench thread {thread:05d} utterance {index:05d}: hello there, echo me".ljust(64, ".")


class Load:
    """The callers and what they saw."""

    def __init__(self, args: argparse.Namespace, url: str, fingerprints: list[str]) -> None:
        self.args = args
        self.url = url
        self.fingerprints = fingerprints
        self.results: list[dict[str, Any]] = []
        self.errors: list[str] = []
        self.events_per_run = args.deltas + 4
        self.tickets: trio.MemoryReceiveChannel[None] | None = None

    def door_of(self, thread: int) -> str:
        if self.args.door != "mix":
            return self.args.door
        return "a2a" if thread % 2 == 0 else "agui"

    async def a2a_call(
        self,
        client: h.Caller,
        path: str,
        text: str,
        message_id: str,
        context: str | None,
        result: dict[str, Any],
    ) -> str | None:
        body = h.a2a_send_body(1, text, message_id, context)
        _, data = await client.post_json(path, body, h.A2A_HEADERS)
        if "result" not in data:
            raise RuntimeError(f"A2A error: {data.get('error')}")
        task = data["result"]["task"]
        result["run_id"] = task["id"]
        state = task["status"]["state"]
        reply = "".join(p.get("text", "") for a in task.get("artifacts", []) for p in a["parts"])
        result["ok"] = state == "TASK_STATE_COMPLETED" and reply == text
        if not result["ok"]:
            raise RuntimeError(f"A2A task {task['id']} ended {state}, reply {reply[:40]!r}")
        return task["contextId"]

    async def agui_call(
        self,
        client: h.Caller,
        path: str,
        text: str,
        message_id: str,
        context: str,
        result: dict[str, Any],
    ) -> str:
        status, events = await client.post_sse(
            path,
            h.agui_body(context, text, message_id),
            lambda: result.__setitem__("first", time.monotonic()),
        )
        if status != 200:
            raise RuntimeError(f"AG-UI HTTP {status}: {events[:1]!r}")
        result["run_id"] = events[0].get("runId") if events else None
        reply = "".join(e.get("delta", "") for e in events if e["type"] == "TEXT_MESSAGE_CONTENT")
        result["ok"] = (
            len(events) == self.events_per_run
            and events[-1]["type"] == "RUN_FINISHED"
            and reply == text
        )
        if not result["ok"]:
            raise RuntimeError(
                f"AG-UI stream of {len(events)} events ended {events[-1] if events else None}"
            )
        return events[0]["threadId"]

    async def caller(self, thread: int, count: int) -> None:
        async with h.Caller(self.url, self.args.client == "lean") as client:
            await client.get("/healthz")  # open the connection first
            await self.converse(client, thread, count)

    async def converse(self, client: h.Caller, thread: int, count: int) -> None:
        door = self.door_of(thread)
        fp = self.fingerprints[thread % len(self.fingerprints)]
        url = f"/{door}/{fp}/echo"
        context: str | None = None if door == "a2a" else f"bench-caller-thread-{thread}"
        for k in range(count):
            if self.tickets is not None:
                await self.tickets.receive()  # --rate: wait for this run's slot
            text = utterance(thread, k)
            result: dict[str, Any] = {
                "door": door,
                "ok": False,
                "run_id": None,
                "began": time.monotonic(),
            }
            try:
                if door == "a2a":
                    context = await self.a2a_call(
                        client, url, text, f"m-{thread}-{k}", context, result
                    )
                else:
                    context = await self.agui_call(
                        client, url, text, f"m-{thread}-{k}", context, result
                    )
            except (httpx.HTTPError, OSError, RuntimeError, ValueError, KeyError) as exc:
                self.errors.append(f"thread {thread} run {k}: {type(exc).__name__}: {exc}")
            result["done"] = time.monotonic()
            self.results.append(result)

    async def run(self, runs: int, threads: int, rate: float | None = None) -> float:
        """Each thread's caller on its own connection; returns the wall time.
        With `rate`, runs start at that many a second (a free caller takes the
        next slot), so the load is offered rather than as fast as it goes."""
        began = time.monotonic()
        async with trio.open_nursery() as nursery:
            if rate:
                send, self.tickets = trio.open_memory_channel[None](0)
                nursery.start_soon(self.ticker, send, runs, rate)
            for i in range(threads):
                nursery.start_soon(self.caller, i, runs // threads + (i < runs % threads))
        return time.monotonic() - began

    @staticmethod
    async def ticker(send: trio.MemorySendChannel[None], runs: int, rate: float) -> None:
        start = trio.current_time()
        async with send:
            for n in range(runs):
                await trio.sleep_until(start + n / rate)
                await send.send(None)


async def verify(
    client: httpx.AsyncClient, url: str, run_ids: list[str], concurrency: int, events_per_run: int
) -> dict[str, Any]:
    """GET /runs/{id} for each run: how many completed with all their events."""
    statuses: dict[str, int] = {}
    events = 0
    short: list[str] = []
    queue = list(run_ids)

    async def worker() -> None:
        nonlocal events
        while queue:
            run_id = queue.pop()
            record = (await client.get(f"{url}/runs/{run_id}")).json()
            status = record.get("status", "missing")
            statuses[status] = statuses.get(status, 0) + 1
            events += len(record.get("events", []))
            if status == "completed" and len(record["events"]) != events_per_run:
                short.append(run_id)

    async with trio.open_nursery() as nursery:
        for _ in range(min(concurrency, max(1, len(run_ids)))):
            nursery.start_soon(worker)
    return {"statuses": statuses, "events": events, "short": short}


async def drive(
    args: argparse.Namespace, server: h.Server, providers: list[h.ProviderChild], workdir: Path
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    async with httpx.AsyncClient(limits=limits, timeout=120) as client:
        fingerprints = [p.fingerprint for p in providers]
        await h.wait_online(client, server.url, fingerprints)

        # Warm up: open the connections, touch every code path once.
        warm = Load(args, server.url, fingerprints)
        await warm.run(min(args.warmup, args.runs), min(args.threads, args.warmup or 1))
        if warm.errors:
            raise SystemExit(f"warm-up failed: {warm.errors[:3]}")
        out["rss_before_kib"] = server.status()["VmRSS"]

        if not args.no_baseline:
            out["healthz"] = await h.healthz_baseline(
                server.url,
                args.baseline_requests,
                args.threads,
                server.pid,
                lean=args.client == "lean",
            )
            # The unit issue #16 was filed in: a healthz served by quart-trio on
            # hypercorn (funduq's stack then), measured now on this host.
            filed = asgi_floor.Child("quart", Path(workdir))
            try:
                out["filed_healthz"] = await h.healthz_baseline(
                    filed.url,
                    args.baseline_requests,
                    args.threads,
                    filed.proc.pid,
                    lean=args.client == "lean",
                )
            finally:
                filed.stop()
            out["ws"] = await h.websocket_baseline(
                server.ws_url,
                len(providers),
                max(1, args.threads // len(providers)),
                args.baseline_frames,
                server.pid,
            )

        load = Load(args, server.url, fingerprints)
        pids = {
            "server": server.pid,
            **{f"provider{i}": p.pid for i, p in enumerate(providers)},
            "callers (this process)": __import__("os").getpid(),
        }
        cpu = h.CpuWatch(pids)
        profiler = (
            h.Profiler(server.pid, Path(args.profile), rate=args.profile_rate)
            if args.profile
            else None
        )
        sched_before = server.scheduler() if args.sched_stats else None
        server_cpu_before = h.proc_cpu(server.pid)
        round_trips_before = await h.offer_round_trips(client, server.url)
        cpu.start()
        with trio.fail_after(args.time_limit):
            out["seconds"] = await load.run(args.runs, args.threads, args.rate)
        out["cpu"] = cpu.shares()
        out["server_cpu_s"] = h.proc_cpu(server.pid) - server_cpu_before
        out["round_trips"] = (round_trips_before, await h.offer_round_trips(client, server.url))
        if sched_before is not None:
            after = server.scheduler()
            out["sched"] = {
                k: after[k] - sched_before[k]
                for k in ("rounds", "steps", "busy", "rounds_over_20ms", "at")
            }
            # Over the server's life (the warm-up included): the worst stall.
            out["sched"]["longest_round"] = after["longest_round"]
            out["sched"]["longest_step"] = after["longest_step"]
        if profiler is not None:
            out["profiler_log"] = profiler.stop()
        out["rss_after_kib"] = server.status()["VmRSS"]
        out["load"] = load
        run_ids = [r["run_id"] for r in load.results if r["run_id"]]
        out["verify"] = await verify(client, server.url, run_ids, 16, load.events_per_run)
    return out


def offer_figures(
    results: list[dict[str, Any]], stamps: dict[str, dict[str, float]]
) -> dict[str, list[float]]:
    to_offer, answer, tail = [], [], []
    for r in results:
        s = stamps.get(r["run_id"] or "")
        if not s or "offer" not in s:
            continue
        to_offer.append(s["offer"] - r["began"])
        if "answer" in s:
            answer.append(s["answer"] - s["offer"])
        if "finish" in s:
            tail.append(r["done"] - s["finish"])
    return {"to_offer": to_offer, "answer": answer, "tail": tail}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument(
        "--threads", type=int, default=100, help="conversations (concurrent callers)"
    )
    parser.add_argument("--deltas", type=int, default=8, help="text deltas per run (events = +4)")
    parser.add_argument("--providers", type=int, default=2, help="provider processes")
    parser.add_argument(
        "--max-concurrent",
        type=int,
        default=None,
        help="each provider's maxConcurrentRuns (default unlimited)",
    )
    parser.add_argument("--door", choices=["mix", "a2a", "agui"], default="mix")
    parser.add_argument(
        "--rate",
        type=float,
        default=None,
        metavar="RUNS_PER_S",
        help="offer the load at this rate (runs start on a clock) instead of "
        "as fast as the callers go; --threads is then the most in flight",
    )
    parser.add_argument(
        "--client",
        choices=["httpx", "lean"],
        default="httpx",
        help="the callers' HTTP client (and the healthz baseline's): httpx, "
        "or a lean h11 client that leaves the server more of the cores",
    )
    parser.add_argument(
        "--provider",
        choices=["sdk", "raw"],
        default="sdk",
        help="sdk: the SDK provider, batching its frames; raw: the same agent "
        "with no batch extension on either side, one frame per websocket "
        "message (every event, ok and finish), as a third-party provider",
    )
    parser.add_argument(
        "--provider-cli",
        action="store_true",
        help="use `funduq-trio provider` itself (no offer stamps)",
    )
    parser.add_argument("--warmup", type=int, default=50, help="runs before measuring")
    parser.add_argument("--baseline-requests", type=int, default=5000)
    parser.add_argument("--baseline-frames", type=int, default=20000)
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument(
        "--profile",
        metavar="RAW",
        help="py-spy record --gil -f raw the server during the load into RAW",
    )
    parser.add_argument(
        "--profile-rate",
        type=int,
        default=200,
        help="py-spy samples a second (more: finer shares, more py-spy CPU)",
    )
    parser.add_argument("--time-limit", type=float, default=600, help="seconds for the load")
    parser.add_argument(
        "--sched-stats",
        action="store_true",
        help="diagnostic: count the server's trio scheduler rounds during the "
        "load (provider-link frames per round)",
    )
    parser.add_argument(
        "--server-switch-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="diagnostic: run the server with sys.setswitchinterval(SECONDS) "
        "(CPython's default is 0.005)",
    )
    args = parser.parse_args()

    build = h.describe_build()
    with h.fresh_dir("funduq-e2e-") as tmp:
        workdir = Path(tmp)
        server = h.Server(
            workdir / "data",
            switch_interval=args.server_switch_interval,
            sched_stats=args.sched_stats,
        )
        providers: list[h.ProviderChild] = []
        stamps: dict[str, dict[str, float]] = {}
        try:
            for i in range(args.providers):
                providers.append(
                    h.ProviderChild(
                        server.ws_url,
                        workdir,
                        i,
                        deltas=args.deltas,
                        max_concurrent=args.max_concurrent,
                        use_cli=args.provider_cli,
                        unbatched=args.provider == "raw",
                    )
                )
            out = trio.run(drive, args, server, providers, workdir)
            hwm_kib = server.status()["VmHWM"]
        finally:
            for p in providers:
                stamps.update(p.stop())
            server.stop()
        log_trouble = server.errors_in_log()

    load: Load = out["load"]
    results = load.results
    ok = [r for r in results if r["ok"]]
    lat = [r["done"] - r["began"] for r in ok]
    by_door = {d: [r["done"] - r["began"] for r in ok if r["door"] == d] for d in ("a2a", "agui")}
    first = [r["first"] - r["began"] for r in ok if "first" in r]
    v = out["verify"]
    completed = v["statuses"].get("completed", 0) - len(v["short"])
    not_completed = args.runs - completed
    seconds = out["seconds"]
    runs_per_s = len(ok) / seconds
    events_per_s = v["events"] / seconds

    print(f"  measuring {build}")
    print(
        f"e2e: {args.runs} runs over {args.threads} threads ({args.door} doors), "
        f"{load.events_per_run} events each, {args.providers} {args.provider} provider "
        f"process(es) over websockets, server in its own process, SQLite on disk, "
        f"{args.client} callers"
        + (f", offered at {args.rate:g} runs/s" if args.rate else ", as fast as they go")
    )
    print(f"  wall time           {seconds:10.2f} s")
    print(f"  runs/s              {runs_per_s:10.1f}")
    print(f"  events/s            {events_per_s:10.1f}   (events in the record / wall time)")
    print(f"  caller latency p50  {h.ms(lat, 0.5):10.2f} ms   p99 {h.ms(lat, 0.99):8.2f} ms")
    for door, values in by_door.items():
        if values:
            print(
                f"    {door:5s} p50         {h.ms(values, 0.5):10.2f} ms   "
                f"p99 {h.ms(values, 0.99):8.2f} ms   ({len(values)} runs)"
            )
    if first:
        print(
            f"  AG-UI first event   {h.ms(first, 0.5):10.2f} ms   p99 {h.ms(first, 0.99):8.2f} ms"
            "   (POST sent -> first SSE event read)"
        )
    f = offer_figures(results, stamps)
    if f["to_offer"]:
        print(
            f"  caller -> offer     {h.ms(f['to_offer'], 0.5):10.2f} ms   "
            f"p99 {h.ms(f['to_offer'], 0.99):8.2f} ms   (request sent -> offer frame read "
            "by the provider)"
        )
        print(
            f"  provider answer     {h.ms(f['answer'], 0.5):10.3f} ms   "
            f"p99 {h.ms(f['answer'], 0.99):8.3f} ms   (offer read -> its ok written)"
        )
        print(
            f"  finish -> caller    {h.ms(f['tail'], 0.5):10.2f} ms   "
            f"p99 {h.ms(f['tail'], 0.99):8.2f} ms   (finish written -> caller has the answer)"
        )
    else:
        print("  offer figures       (none: --provider-cli has no stamps)")
    p50, answered = h.histogram_quantile(*out["round_trips"], 0.5)
    p99, _ = h.histogram_quantile(*out["round_trips"], 0.99)
    print(
        f"  offer round trip    p50 <= {p50 * 1e3:g} ms, p99 <= {p99 * 1e3:g} ms   (server side, "
        f"GET /metrics buckets: offer handed to the link -> answer read; {answered} offers)"
    )
    cpu_per_run = out["server_cpu_s"] / max(1, len(ok)) * 1e3
    print(
        f"  server CPU per run  {cpu_per_run:10.2f} ms   (all its threads; a ceiling of "
        f"{1e3 / cpu_per_run:.0f} runs/s per core)"
    )
    if "sched" in out:
        sc = out["sched"]
        frames = len(ok) * (load.events_per_run + 2)  # its events, the ok, the finish
        print(
            f"  server scheduler    {sc['rounds'] / seconds:10.0f} rounds/s, "
            f"{sc['steps'] / max(1, sc['rounds']):.1f} task steps a round, busy "
            f"{sc['busy'] / seconds * 100:.0f}% of the wall time"
        )
        print(
            f"  link frames/round   {frames / max(1, sc['rounds']) / args.providers:10.2f}   "
            f"(frames from providers per scheduler round per provider link)"
        )
        step_s, step_task = sc["longest_step"]
        print(
            f"  longest round       {sc['longest_round'] * 1e3:10.1f} ms   "
            f"({sc['rounds_over_20ms']} rounds over 20 ms during the load; longest task "
            f"step {step_s * 1e3:.1f} ms in {step_task})"
        )
    print(
        f"  server RSS          {out['rss_before_kib'] / 1024:10.1f} MiB before the load, "
        f"{out['rss_after_kib'] / 1024:.1f} MiB after, peak (VmHWM) {hwm_kib / 1024:.1f} MiB"
    )
    print(
        f"  CPU during the load {h.format_shares(out['cpu'])} "
        "(100% = one core; this host has "
        f"{__import__('os').cpu_count()} cores)"
    )
    print(f"  record              {v['statuses']}, {len(v['short'])} completed with events missing")
    print(f"  runs not completed  {not_completed:10d}   (caller errors: {len(load.errors)})")
    for line in load.errors[:5]:
        print(f"    {line}")
    if "healthz" in out:
        hz, ws = out["healthz"], out["ws"]
        print(
            f"baseline, GET /healthz from {args.threads} concurrent callers: "
            f"{hz['per_s']:.1f} req/s (p50 {hz['p50_ms']:.2f} ms, p99 {hz['p99_ms']:.2f} ms)"
        )
        print(
            f"  runs/s / healthz req/s ratio: {runs_per_s / hz['per_s']:.3f}; server CPU "
            f"{hz['server_cpu_ms']:.2f} ms per healthz, a run costs "
            f"{cpu_per_run / hz['server_cpu_ms']:.1f} healthz of server CPU"
        )
        print(
            f"  in healthz units ({args.provider} provider): server CPU per run "
            f"{cpu_per_run / hz['server_cpu_ms']:.2f} healthz (goal <= 1.5), "
            f"runs/s / healthz req/s {runs_per_s / hz['per_s']:.3f} (goal >= 0.6)"
        )
        filed = out["filed_healthz"]["server_cpu_ms"]
        print(
            f"baseline, the healthz #16 was filed against (quart-trio on hypercorn, a child "
            f"process, the same callers): server CPU {filed:.2f} ms; a run costs "
            f"{cpu_per_run / filed:.2f} of it (goal <= 1.5)"
        )
        print(
            f"baseline, provider-link websocket round trips ({args.providers} links, "
            f"{max(1, args.threads // args.providers)} in flight each): {ws['per_s']:.1f} msg/s "
            f"(p50 {ws['p50_ms']:.2f} ms, p99 {ws['p99_ms']:.2f} ms)"
        )
        print(
            f"  events/s / websocket msg/s ratio: {events_per_s / ws['per_s']:.3f}; server CPU "
            f"{ws['server_cpu_ms']:.3f} ms per round trip"
        )
    if log_trouble:
        print(f"server log: {len(log_trouble)} lines of trouble, first: {log_trouble[:3]}")
    if args.profile:
        print(f"py-spy profile of the server during the load ({args.profile}):")
        print(h.summarize_profile(Path(args.profile)))
        print(
            "where the server's CPU went (bench/profile_shares.py), ms/run from the "
            "server CPU per run above:"
        )
        print(profile_shares.format_shares(Path(args.profile), cpu_per_run))
    sys.stdout.flush()
    if not_completed:
        sys.exit(1)


if __name__ == "__main__":
    main()
