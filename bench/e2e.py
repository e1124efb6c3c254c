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
import os
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
        #: --rate: each run's due start time (time.monotonic) comes through here.
        self.tickets: trio.MemoryReceiveChannel[float] | None = None

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
            due = None
            if self.tickets is not None:
                due = await self.tickets.receive()  # --rate: wait for this run's slot
            text = utterance(thread, k)
            result: dict[str, Any] = {
                "door": door,
                "ok": False,
                "run_id": None,
                "began": time.monotonic(),
            }
            if due is not None:
                result["due"] = due
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
                send, self.tickets = trio.open_memory_channel[float](0)
                nursery.start_soon(self.ticker, send, runs, rate)
            for i in range(threads):
                nursery.start_soon(self.caller, i, runs // threads + (i < runs % threads))
        return time.monotonic() - began

    @staticmethod
    async def ticker(send: trio.MemorySendChannel[float], runs: int, rate: float) -> None:
        """Run n is due at start + n / rate, evenly spaced (no bursts by
        design). A ticket late because no caller was free or this process
        was busy leaves as soon as it can, so late runs bunch up: the
        callers' "start lag" (due -> request sent) shows how much."""
        start = trio.current_time()
        offset = time.monotonic() - start  # trio's clock -> time.monotonic
        async with send:
            for n in range(runs):
                due = start + n / rate
                await trio.sleep_until(due)
                await send.send(due + offset)


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

        out["rate"] = args.rate
        if args.rate == "half":
            # What this host carries now, as fast as the callers go, then
            # the measured load offered at half of it.
            saturating = Load(args, server.url, fingerprints)
            with trio.fail_after(args.time_limit):
                seconds = await saturating.run(args.runs, args.threads)
            if saturating.errors:
                raise SystemExit(f"saturating load failed: {saturating.errors[:3]}")
            out["saturating"] = len(saturating.results) / seconds
            out["rate"] = out["saturating"] / 2
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
        waited_before = {name: h.runqueue_wait(pid) for name, pid in pids.items()}
        server_cpu_before = h.proc_cpu(server.pid)
        round_trips_before = await h.offer_round_trips(client, server.url)
        cpu.start()
        out["window"] = [time.monotonic()]
        with trio.fail_after(args.time_limit):
            out["seconds"] = await load.run(args.runs, args.threads, out["rate"])
        out["window"].append(time.monotonic())
        out["cpu"] = cpu.shares()
        out["runqueue"] = {
            name: (h.runqueue_wait(pid) - waited_before[name]) / out["seconds"]
            for name, pid in pids.items()
        }
        if args.trace:
            out["trace"] = server.trace()
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
            out["sched"]["by_task"] = {
                name: n - sched_before["by_task"].get(name, 0)
                for name, n in after["by_task"].items()
            }
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


def _overlap(spans: list[tuple[float, float]], a: float, b: float) -> float:
    """Seconds of `spans` ((start, seconds) each) that fall inside [a, b]."""
    return sum(max(0.0, min(b, t + d) - max(a, t)) for t, d in spans)


def trace_report(
    trace: dict[str, Any],
    window: list[float],
    results: list[dict[str, Any]],
    stamps: dict[str, dict[str, float]],
    provider_gc: list[list[float]],
) -> str:
    """Where the offer round trip went (`--trace`): each offer's timeline in
    the server beside the provider's stamps, and what the server did meanwhile."""
    lo, hi = window
    lines = ["server trace during the load (--trace; all CLOCK_MONOTONIC):"]

    def dist(values: list[float]) -> str:
        if not values:
            return "none"
        return (
            f"p50 {h.ms(values, 0.5):.2f}, p99 {h.ms(values, 0.99):.2f}, "
            f"max {max(values) * 1e3:.2f} ms ({len(values)})"
        )

    commits = [c for c in trace["commits"] if lo <= c[0] <= hi]
    checkpoints = [c for c in trace["checkpoints"] if lo <= c[0] <= hi]

    def split(items: list[Any], wall: int, cpu: int, rq: int) -> str:
        """Where the wall time of `items` went: CPU, run queue, blocked."""
        w = sum(i[wall] for i in items)
        c = sum(i[cpu] for i in items)
        q = sum(i[rq] for i in items)
        return (
            f"{w * 1e3:.0f} ms wall = CPU {c * 1e3:.0f} + run queue {q * 1e3:.0f} + "
            f"blocked (I/O, GIL) {(w - c - q) * 1e3:.0f}"
        )

    lines.append(f"  group commit on the loop   {dist([c[1] for c in commits])}")
    lines.append(f"    its thread CPU           {dist([c[4] for c in commits])}")
    lines.append(f"    all of them              {split(commits, 1, 4, 5)}")
    slow = [c for c in commits if c[1] > 0.002]
    lines.append(f"    the {len(slow)} over 2 ms       {split(slow, 1, 4, 5)}")
    reads = [r for r in trace.get("reads", []) if lo <= r[0] <= hi]
    spans = [(r[0], r[1]) for r in reads]
    with_read = [c for c in commits if _overlap(spans, c[0], c[0] + c[1]) > 0]
    lines.append(
        f"    beside a read (worker)   {split(with_read, 1, 4, 5)}; "
        f"{sum(c[1] > 0.002 for c in with_read)} of them over 2 ms"
    )
    lines.append(
        f"  reads (worker threads)     {dist([r[1] for r in reads])}, their CPU "
        f"{sum(r[2] for r in reads) * 1e3:.0f} ms in all"
    )
    during = [
        c[1] for c in commits if _overlap([(k[0], k[1]) for k in checkpoints], c[0], c[0] + c[1])
    ]
    lines.append(f"    while a checkpoint ran   {dist(during)}")
    lines.append(
        f"  writes per commit          p50 {h.percentile([c[2] for c in commits], 0.5):.0f}, "
        f"max {max((c[2] for c in commits), default=0)}; "
        f"{sum(c[2] for c in commits)} writes in {len(commits)} commits in all"
    )
    lines.append(f"  a write queued -> durable  {dist(trace['waits'])}   (whole server life)")
    lines.append(
        f"  checkpoints (worker thr.)  {dist([c[1] for c in checkpoints])}, "
        f"log frames max {max((c[2] for c in checkpoints), default=0)}"
    )
    gcs = [g for g in trace["gc"] if lo <= g[0] <= hi]
    for gen in (0, 1, 2):
        pauses = [g[1] for g in gcs if g[2] == gen]
        collected = sum(g[3] for g in gcs if g[2] == gen)
        lines.append(f"  gc generation {gen} pauses    {dist(pauses)}, {collected} collected")
        lines.append(f"    their thread CPU         {dist([g[4] for g in gcs if g[2] == gen])}")
        lines.append(
            f"    all of them              {split([g for g in gcs if g[2] == gen], 1, 4, 5)}"
        )
    pgc = [g for g in provider_gc if lo <= g[0] <= hi]
    for gen in (0, 1, 2):
        pauses = [g[1] for g in pgc if g[2] == gen]
        lines.append(f"  providers' gc generation {gen} {dist(pauses)}")
    heap = trace["heap"]
    lines.append(
        f"  gc heap after the load     thresholds {heap['thresholds']}, {heap['frozen']} frozen, "
        f"{heap['generation2_total']} in generation 2; most: "
        + ", ".join(f"{k} {n}" for k, n in heap["generation2_kinds"][:8])
    )
    lines.append(
        "  a full gc pass after it    "
        + ", then ".join(f"{c * 1e3:.2f} ms CPU ({n} collected)" for c, n in heap["full_passes"])
    )
    rounds = [r for r in trace["rounds"] if lo <= r[0] <= hi]
    slow = sorted(rounds, key=lambda r: -r[1])[:5]
    lines.append(
        f"  scheduler rounds > 2 ms    {len(rounds)}; longest: "
        + "; ".join(
            f"{r[1] * 1e3:.1f} ms wall / {r[2] * 1e3:.1f} ms CPU / {r[6] * 1e3:.1f} ms run "
            f"queue, {r[3]} steps, "
            f"longest step {r[4] * 1e3:.1f} ms ({r[5].rsplit('.', 1)[-1]})"
            for r in slow
        )
    )
    lines.append(f"    all of them              {split(rounds, 1, 2, 6)}")
    # Each offer: handed to the link -> message started -> written -> provider
    # read it -> provider wrote its ok -> the server read the answer.
    legs: dict[str, list[float]] = {k: [] for k in ("link", "to_provider", "provider", "to_server")}
    rtts: list[tuple[float, str, list[Any]]] = []
    for offer_id, (run_id, sent, started, written, answered, *_) in trace["offers"].items():
        s = stamps.get(run_id, {})
        if not (lo <= sent <= hi) or answered is None or written is None or "answer" not in s:
            continue
        rtts.append((answered - sent, offer_id, trace["offers"][offer_id]))
        legs["link"].append(started - sent)
        legs["to_provider"].append(s["offer"] - started)
        legs["provider"].append(s["answer"] - s["offer"])
        legs["to_server"].append(answered - s["answer"])
    sent = [m for m in trace.get("link_messages", ()) if lo <= m[0] <= hi]
    if sent:
        offers_in = [m[2] for m in sent if m[2]]
        by_how = {h: sum(1 for m in sent if m[1] == h) for h in ("writer", "now", "now, in part")}
        lines.append(
            f"  messages to providers      {len(sent)}: "
            + ", ".join(f"{n} {h}" for h, n in by_how.items())
            + f"; {len(offers_in)} with offers, {sum(offers_in) / max(1, len(offers_in)):.2f}"
            " offers in each"
        )
    lines.append(f"  offer round trip           {dist([r[0] for r in rtts])}")
    if rtts:
        n = len(rtts)
        cpu = sum(r[2][5] for r in rtts) / n
        rq = sum(r[2][6] for r in rtts) / n
        mean = sum(r[0] for r in rtts) / n
        lines.append(
            f"    mean {mean * 1e3:.2f} ms: the loop thread's CPU {cpu * 1e3:.2f}, its run queue "
            f"{rq * 1e3:.2f}, waiting on I/O {(mean - cpu - rq) * 1e3:.2f}"
        )
    names = {
        "link": "handed to link -> message send starts (server's loop)",
        "to_provider": "send starts -> provider read it (hypercorn, socket, provider)",
        "provider": "provider read -> its ok written",
        "to_server": "ok written -> server read the answer (server's loop)",
    }
    for key, label in names.items():
        lines.append(f"    {label:54s} {dist(legs[key])}")
    for bound in (0.005, 0.010):
        tail = [r for r in rtts if r[0] > bound]
        if not tail:
            lines.append(f"  offers over {bound * 1e3:g} ms: none")
            continue
        worst_leg: dict[str, int] = {}
        overlaps = {
            "gc": 0.0,
            "provider gc": 0.0,
            "commits": 0.0,
            "checkpoint": 0,
            "long rounds": 0.0,
        }
        loop = [0.0, 0.0, 0.0]  # the loop thread during these offers: CPU, run queue, idle
        for rtt, _, (run_id, sent, started, _written, answered, cpu, rq) in tail:
            loop[0] += cpu
            loop[1] += rq
            loop[2] += rtt - cpu - rq
            st = stamps[run_id]
            parts = {
                "link": started - sent,
                "to_provider": st["offer"] - started,
                "provider": st["answer"] - st["offer"],
                "to_server": answered - st["answer"],
            }
            worst = max(parts, key=lambda k: parts[k])
            worst_leg[worst] = worst_leg.get(worst, 0) + 1
            overlaps["gc"] += _overlap([(g[0], g[1]) for g in gcs], sent, answered)
            overlaps["provider gc"] += _overlap([(g[0], g[1]) for g in pgc], sent, answered)
            overlaps["commits"] += _overlap([(c[0], c[1]) for c in commits], sent, answered)
            overlaps["checkpoint"] += any(
                _overlap([(c[0], c[1])], sent, answered) > 0 for c in checkpoints
            )
            overlaps["long rounds"] += _overlap([(r[0], r[1]) for r in rounds], sent, answered)
        n = len(tail)
        lines.append(
            f"  offers over {bound * 1e3:g} ms: {n} ({n / len(rtts) * 100:.1f}%); their longest "
            "leg: "
            + ", ".join(f"{k} {v}" for k, v in sorted(worst_leg.items(), key=lambda i: -i[1]))
        )
        lines.append(
            f"    meanwhile, per such offer: gc {overlaps['gc'] / n * 1e3:.2f} ms (the providers' "
            f"{overlaps['provider gc'] / n * 1e3:.2f} ms), commits "
            f"{overlaps['commits'] / n * 1e3:.2f} ms, rounds > 2 ms "
            f"{overlaps['long rounds'] / n * 1e3:.2f} ms; a checkpoint ran during "
            f"{overlaps['checkpoint']:.0f} of them"
        )
        lines.append(
            f"    the loop thread meanwhile, per such offer: CPU {loop[0] / n * 1e3:.2f} ms, "
            f"run queue (no core) {loop[1] / n * 1e3:.2f} ms, waiting on I/O (the provider's "
            f"side) {loop[2] / n * 1e3:.2f} ms"
        )
        lines.append(f"    {_episodes(sorted(r[2][1] for r in tail), lo, hi)}")
    return "\n".join(lines)


#: Slow offers sent closer together than this are one episode.
EPISODE_GAP = 0.1


def _episodes(sent: list[float], lo: float, hi: float) -> str:
    """Whether the slow offers are a few stalls or spread over the load:
    they are grouped into episodes (sent less than EPISODE_GAP apart)."""
    groups: list[list[float]] = []
    for t in sent:
        if groups and t - groups[-1][-1] < EPISODE_GAP:
            groups[-1].append(t)
        else:
            groups.append([t])
    biggest = sorted(groups, key=len, reverse=True)[:3]
    return (
        f"sent in {len(groups)} episode(s) ({EPISODE_GAP * 1e3:g} ms apart or more) over the "
        f"load's {hi - lo:.1f} s; the largest: "
        + ", ".join(f"{len(g)} offers in {(g[-1] - g[0]) * 1e3:.0f} ms" for g in biggest)
    )


def rate_arg(text: str) -> float | str:
    return text if text == "half" else float(text)


def server_gc_setting(value: str) -> str:
    """`--server-gc`: on, off, or a positive young-pass threshold."""
    if value in ("on", "off") or (value.isdigit() and int(value) > 0):
        return value
    raise argparse.ArgumentTypeError(f"on, off or a positive number, not {value!r}")


def idle_line(value: str) -> int:
    """`--idle-line`: 0 or a positive count."""
    if value.isdigit():
        return int(value)
    raise argparse.ArgumentTypeError(f"0 or a positive number, not {value!r}")


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
        type=rate_arg,
        default=None,
        metavar="RUNS_PER_S",
        help="offer the load at this rate (runs start on a clock) instead of "
        "as fast as the callers go; --threads is then the most in flight. "
        "'half': first a saturating load of --runs, then the measured one at "
        "half the runs/s it reached",
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
        "--trace",
        action="store_true",
        help="diagnostic: trace the server (harness.ServerTrace: GC passes, group "
        "commits, checkpoints, each offer's timeline, long scheduler rounds) and "
        "lay the offers over the provider's stamps: where the round trip's tail goes",
    )
    parser.add_argument(
        "--server-gc",
        type=server_gc_setting,
        default="on",
        help="diagnostic: off turns the server's cyclic GC off once it has started; "
        "a number sets its young pass's threshold (CPython's default 700; the server's "
        "own: collector.YOUNG_PASS_THRESHOLD)",
    )
    parser.add_argument(
        "--checkpoint-seconds",
        type=float,
        default=None,
        help="diagnostic: the SQLite record's checkpoint period (a large value: none "
        "during the load)",
    )
    parser.add_argument(
        "--idle-line",
        type=idle_line,
        default=None,
        metavar="N",
        help="diagnostic: the server's idle young passes start at N counted containers "
        "(0: no idle passes; the server's own: collector.IDLE_PASS_LINE)",
    )
    parser.add_argument(
        "--server-switch-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="diagnostic: run the server with sys.setswitchinterval(SECONDS) "
        "(CPython's default is 0.005)",
    )
    parser.add_argument(
        "--nice-load",
        type=int,
        default=0,
        metavar="N",
        help="a different measurement: the load generator (this process, its "
        "threads and children) runs at nice N, so the server gets a core first, "
        "as it would with callers on other machines. Printed in the header; "
        "compare only with runs at the same N",
    )
    parser.add_argument(
        "--nice-providers",
        type=int,
        default=0,
        metavar="N",
        help="likewise for the provider processes (the offer round trip includes "
        "the provider's answer: a provider at nice N waits longer for a core)",
    )
    parser.add_argument(
        "--split-cores",
        action="store_true",
        help="a different measurement: the server (every thread) on core 0, the "
        "load generator (callers and providers) on core 1, so neither waits for "
        "the other's core, as with callers and providers on other machines. "
        "Printed in the header; compare only with runs split alike",
    )
    args = parser.parse_args()
    if args.split_cores and (os.cpu_count() or 1) < 2:
        parser.error("--split-cores needs two cores")

    build = h.describe_build()
    with h.fresh_dir("funduq-e2e-") as tmp:
        workdir = Path(tmp)
        server = h.Server(
            workdir / "data",
            switch_interval=args.server_switch_interval,
            sched_stats=args.sched_stats,
            trace=args.trace,
            env={
                **({"FUNDUQ_BENCH_GC": args.server_gc} if args.server_gc != "on" else {}),
                **(
                    {"FUNDUQ_BENCH_CHECKPOINT_SECONDS": str(args.checkpoint_seconds)}
                    if args.checkpoint_seconds is not None
                    else {}
                ),
                **(
                    {"FUNDUQ_BENCH_IDLE_LINE": str(args.idle_line)}
                    if args.idle_line is not None
                    else {}
                ),
            },
        )
        providers: list[h.ProviderChild] = []
        stamps: dict[str, dict[str, float]] = {}
        provider_gc: list[list[float]] = []
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
            # After the server started (it keeps nice 0); every thread of the
            # process (nice is per thread on Linux).
            niced = [(os.getpid(), args.nice_load)] if args.nice_load else []
            if args.nice_providers:
                niced += [(p.proc.pid, args.nice_providers) for p in providers]
            for pid, nice in niced:
                for tid in os.listdir(f"/proc/{pid}/task"):
                    os.setpriority(os.PRIO_PROCESS, int(tid), nice)
            if args.split_cores:
                # Affinity, like nice, is per thread; threads made later
                # inherit their maker's.
                cores = [(server.pid, {0}), (os.getpid(), {1})]
                cores += [(p.proc.pid, {1}) for p in providers]
                for pid, cpus in cores:
                    for tid in os.listdir(f"/proc/{pid}/task"):
                        os.sched_setaffinity(int(tid), cpus)
            out = trio.run(drive, args, server, providers, workdir)
            hwm_kib = server.status()["VmHWM"]
        finally:
            for p in providers:
                stamps.update(p.stop())
                provider_gc.extend(p.gc_passes)
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
        + (f", offered at {out['rate']:.1f} runs/s" if out["rate"] else ", as fast as they go")
    )
    if args.nice_load or args.nice_providers:
        print(
            f"  NOTE callers at nice {args.nice_load}, providers at nice "
            f"{args.nice_providers}, the server at 0 (callers/providers on other "
            "machines, modelled): not the same measurement as without"
        )
    if args.split_cores:
        print(
            "  NOTE the server on core 0, callers and providers on core 1 (callers and "
            "providers on other machines, modelled): not the same measurement as without"
        )
    if "saturating" in out:
        print(
            f"  saturating load     {out['saturating']:10.1f} runs/s   (as fast as the callers "
            f"go, just before; the load below is offered at half of it)"
        )
    print(f"  wall time           {seconds:10.2f} s")
    print(f"  runs/s              {runs_per_s:10.1f}")
    if not out["rate"]:
        print(
            f"  saturating load     {runs_per_s:10.1f} runs/s   (half: {runs_per_s / 2:.1f}; "
            "`--rate half` measures there)"
        )
    else:
        lag = [r["began"] - r["due"] for r in results if "due" in r]
        starts = sorted(r["began"] for r in results)
        bunched = sum(b - a < 0.001 for a, b in zip(starts, starts[1:], strict=False))
        print(
            f"  start lag           {h.ms(lag, 0.5):10.2f} ms   p99 {h.ms(lag, 0.99):8.2f} ms   "
            f"(run due on the clock -> request sent; {bunched} of {len(starts)} runs "
            f"started < 1 ms after the one before, {1e3 / out['rate']:.1f} ms apart if on time)"
        )
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
    # The load's own counts, for bench/pooled.py to add up over rounds.
    print("  offer round trip le " + h.bucket_counts(*out["round_trips"]))
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
        per_run = max(1, len(ok))
        busiest = sorted(sc["by_task"].items(), key=lambda item: -item[1])[:5]
        short = {name: ".".join(name.split(".")[-2:]) for name, _ in busiest}
        print(
            f"  a run's rounds, steps {sc['rounds'] / per_run:6.2f}, "
            f"{sc['steps'] / per_run:.2f}; steps by task: "
            + ", ".join(f"{n / per_run:.2f} {short[name]}" for name, n in busiest)
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
    print(
        "  run-queue wait      "
        + ", ".join(f"{n} {w * 1e3:.0f} ms/s" for n, w in out["runqueue"].items())
        + "   (runnable, waiting for a core: /proc/<pid>/task/*/schedstat)"
    )
    if "trace" in out:
        print(trace_report(out["trace"], out["window"], results, stamps, provider_gc))
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
