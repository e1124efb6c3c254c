"""Scale benchmark: many threads each holding a queued run for an agent whose
provider is full, then the drain once room appears.

1. The server runs as a child process (fresh data directory, SQLite on disk).
   An SDK provider runs in this process's trio loop; after a short warm-up it
   reconnects declaring `maxConcurrentRuns = --room-before` (default 0: full),
   so nothing can be offered.
2. `--waiting` threads (default 10,000) each get one run, over the A2A door:
   - `--callers detached` (default): `SendMessage` with `returnImmediately`,
     answered at once with the task SUBMITTED; no connection is held.
   - `--callers streaming`: `SendStreamingMessage`; each caller keeps its own
     connection and SSE stream open until its run ends (10,000 open streams).
   - `--callers blocking`: `SendMessage` without `returnImmediately`; each
     caller's connection waits for the answer, which comes when its run ends.
   Server RSS is read before and once all are queued:
   RSS per waiting run = (RSS with the runs - RSS before) / waiting.
3. Room appears: the provider reconnects with `--room-after` (default:
   unlimited). Drain time = from that link's registration to the last run's
   `completedAt` in the record (detached) or the last stream's end (streaming).
   Every run is checked through `GET /runs/{id}`: completed, all its events.

Baselines in the same run: the intake rate (runs queued per second) against
the drain rate; and the RSS per waiting run of the bare skeleton the design
card prescribes (per run a thread task holding a nursery and a lane task
waiting on its memory channel inside a deadline), measured in a fresh trio
process with as many runs.

    python bench/scale.py                     # 10,000 waiting runs, detached callers
    python bench/scale.py --waiting 2000 --callers streaming

The callers here use a lean h11 client (`harness.RawHTTP`): thousands of
connections from one process are too heavy for an httpx client each.
"""

from __future__ import annotations

import argparse
import calendar
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import harness as h
import trio

from funduq_trio.identity import Identity
from funduq_trio.provider import Provider, make_echo


def note(text: str) -> None:
    print(f"[scale] {text}", file=sys.stderr, flush=True)


def text_of(i: int) -> str:
    return f"waiting run {i:06d}: hello there".ljust(48, ".")


def iso_epoch(stamp: str) -> float:
    """'2026-12-02T12:57:13.026Z' -> seconds since the epoch."""
    whole, _, frac = stamp.rstrip("Z").partition(".")
    return calendar.timegm(time.strptime(whole, "%Y-%m-%dT%H:%M:%S")) + float("0." + (frac or "0"))


class ProviderRun:
    """One connection episode of the in-process SDK provider."""

    def __init__(
        self,
        identity: Identity,
        url: str,
        room: int | None,
        deltas: int,
        stamps: dict[str, dict[str, float]],
    ) -> None:
        self.provider = Provider(
            identity, url, max_concurrent_runs=room, connector=h.stamping_connector(stamps)
        )
        self.provider.add_agent(make_echo(deltas), name="echo")
        self.scope = trio.CancelScope()
        self.ended = trio.Event()

    async def run(self, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
        try:
            with self.scope:
                await self.provider.run(task_status=task_status)
        finally:
            self.ended.set()

    async def stop(self) -> None:
        self.scope.cancel()
        await self.ended.wait()


async def start_provider(
    nursery: trio.Nursery,
    identity: Identity,
    url: str,
    room: int | None,
    deltas: int,
    stamps: dict[str, dict[str, float]],
) -> ProviderRun:
    run = ProviderRun(identity, url, room, deltas, stamps)
    await nursery.start(run.run)  # returns once the link has published the agent
    return run


async def pool(count: int, concurrency: int, work: Any) -> None:
    """work(i) for i in range(count), at most `concurrency` at once."""
    next_index = 0

    async def worker() -> None:
        nonlocal next_index
        while next_index < count:
            i = next_index
            next_index += 1
            await work(i)

    async with trio.open_nursery() as nursery:
        for _ in range(min(count, concurrency)):
            nursery.start_soon(worker)


class Callers:
    def __init__(self, args: argparse.Namespace, url: str, path: str) -> None:
        self.args = args
        self.url = url
        self.path = path
        self.run_ids: list[str | None] = [None] * args.waiting
        self.queued = 0
        self.all_queued = trio.Event()
        self.ended: dict[int, tuple[float, str]] = {}  # streaming: i -> (time, final state)
        self.all_ended = trio.Event()
        self.errors: list[str] = []
        self.connections: list[h.RawHTTP] = []

    def _queued(self, i: int, task: dict[str, Any]) -> None:
        if task["status"]["state"] != "TASK_STATE_SUBMITTED":
            self.errors.append(f"run {i}: {task['status']['state']} when queued, not SUBMITTED")
        self.run_ids[i] = task["id"]
        self.queued += 1
        if self.queued == self.args.waiting:
            self.all_queued.set()

    async def detached(self) -> None:
        """SendMessage(returnImmediately) from `--concurrency` keep-alive connections."""
        clients = [h.RawHTTP(self.url) for _ in range(self.args.concurrency)]
        free = list(clients)

        async def one(i: int) -> None:
            client = free.pop()
            try:
                body = h.a2a_send_body(i, text_of(i), f"w-{i}", None, return_immediately=True)
                status, data = await client.json("POST", self.path, body, h.A2A_HEADERS)
                if status != 200 or "result" not in data:
                    raise RuntimeError(f"HTTP {status}: {data}")
                self._queued(i, data["result"]["task"])
            except (OSError, RuntimeError, ValueError, KeyError) as exc:
                self.errors.append(f"run {i}: {type(exc).__name__}: {exc}")
                self.queued += 1
                if self.queued == self.args.waiting:
                    self.all_queued.set()
            finally:
                free.append(client)

        await pool(self.args.waiting, self.args.concurrency, one)
        for client in clients:
            await client.aclose()

    async def blocking(self, nursery: trio.Nursery) -> None:
        """One connection per run, each waiting in a blocking `SendMessage`
        (no answer until the run ends). A caller sees nothing of its run
        while it waits, so a run counts as queued by the server's count of
        runs started (`GET /metrics`); its id and final state come with the
        answer."""
        opening = trio.Semaphore(self.args.concurrency)
        started_before = await runs_started(self.url)

        async def one(i: int) -> None:
            client = h.RawHTTP(self.url)
            state = "no answer"
            try:
                body = h.a2a_send_body(i, text_of(i), f"w-{i}", None)
                async with opening:
                    await client.connect()
                status, chunks = await client.request(
                    "POST", self.path, json.dumps(body).encode(), h.A2A_HEADERS
                )
                data = json.loads(b"".join([c async for c in chunks]))
                if status != 200 or "result" not in data:
                    raise RuntimeError(f"HTTP {status}: {data}")
                task = data["result"]["task"]
                self.run_ids[i] = task["id"]
                state = task["status"]["state"]
            except (OSError, RuntimeError, ValueError, KeyError) as exc:
                self.errors.append(f"run {i}: {type(exc).__name__}: {exc}")
            finally:
                self.ended[i] = (time.monotonic(), state)
                if len(self.ended) == self.args.waiting:
                    self.all_ended.set()
                await client.aclose()

        for i in range(self.args.waiting):
            nursery.start_soon(one, i)
        while True:
            self.queued = await runs_started(self.url) - started_before
            if self.queued >= self.args.waiting or len(self.ended) == self.args.waiting:
                break
            await trio.sleep(0.2)
        self.all_queued.set()

    async def streaming(self, nursery: trio.Nursery) -> None:
        """One connection and SSE stream per run, held until the run ends.
        At most `--concurrency` streams are being opened at once. A2A
        callers (SendStreamingMessage) count a run queued at its opening
        Task; AG-UI callers (`--door agui`) at the response's status, since
        an AG-UI stream says nothing until its run starts (its run id then
        comes with RUN_STARTED)."""
        opening = trio.Semaphore(self.args.concurrency)
        agui = getattr(self.args, "door", "a2a") == "agui"

        async def one(i: int, task_status: Any = trio.TASK_STATUS_IGNORED) -> None:
            client = h.RawHTTP(self.url)
            state = "no final status"
            try:
                if agui:
                    body = h.agui_body(f"w-{i}", text_of(i), f"w-{i}")
                    path, headers = self.path.replace("/a2a/", "/agui/", 1), {}
                else:
                    body = h.a2a_send_body(i, text_of(i), f"w-{i}", None)
                    body["method"] = "SendStreamingMessage"
                    path, headers = self.path, h.A2A_HEADERS
                async with opening:
                    status, chunks = await client.request(
                        "POST", path, json.dumps(body).encode(), headers
                    )
                    if status != 200:
                        raise RuntimeError(f"HTTP {status}")
                    events = h.sse_events(chunks)
                    if agui:
                        self.queued += 1
                        if self.queued == self.args.waiting:
                            self.all_queued.set()
                    else:
                        first = await events.__anext__()
                        self._queued(i, first["result"]["task"])
                async for frame in events:
                    if agui:
                        kind = frame.get("type")
                        if kind == "RUN_STARTED" and self.run_ids[i] is None:
                            self.run_ids[i] = frame["runId"]
                        elif kind in ("RUN_FINISHED", "RUN_ERROR"):
                            state = kind
                        continue
                    result = frame.get("result", {})
                    update = result.get("statusUpdate")
                    if update is not None:
                        state = update["status"]["state"]
                    elif "error" in frame:
                        state = f"error {frame['error']}"
            except (OSError, RuntimeError, ValueError, KeyError, StopAsyncIteration) as exc:
                self.errors.append(f"run {i}: {type(exc).__name__}: {exc}")
                if self.run_ids[i] is None and not agui:
                    self.queued += 1
                    if self.queued == self.args.waiting:
                        self.all_queued.set()
            finally:
                self.ended[i] = (time.monotonic(), state)
                if len(self.ended) == self.args.waiting:
                    self.all_ended.set()
                await client.aclose()

        for i in range(self.args.waiting):
            nursery.start_soon(one, i)


async def runs_started(url: str) -> int:
    """The server's count of runs started (`GET /metrics`)."""
    client = h.RawHTTP(url)
    try:
        status, chunks = await client.request("GET", "/metrics")
        text = b"".join([c async for c in chunks]).decode()
    finally:
        await client.aclose()
    for line in text.splitlines():
        if line.startswith("funduq_runs_started_total "):
            return int(float(line.split()[1]))
    raise RuntimeError(f"no funduq_runs_started_total in /metrics (HTTP {status})")


async def verify(url: str, run_ids: list[str], events_per_run: int) -> dict[str, Any]:
    """GET /runs/{id} for every run: statuses, short runs, the last completedAt."""
    statuses: dict[str, int] = {}
    reasons: dict[str, int] = {}
    short = 0
    last_completed = 0.0
    clients = [h.RawHTTP(url) for _ in range(16)]

    async def one(i: int) -> None:
        nonlocal short, last_completed
        client = clients.pop()
        try:
            _, record = await client.json("GET", f"/runs/{run_ids[i]}")
        finally:
            clients.append(client)
        status = record.get("status", "missing")
        statuses[status] = statuses.get(status, 0) + 1
        reason = (record.get("metadata") or {}).get("failureReason")
        if reason:
            reasons[reason] = reasons.get(reason, 0) + 1
        if status == "completed":
            if len(record["events"]) != events_per_run:
                short += 1
            last_completed = max(last_completed, iso_epoch(record["completedAt"]))

    await pool(len(run_ids), 16, one)
    for client in clients:
        await client.aclose()
    return {
        "statuses": statuses,
        "reasons": reasons,
        "short": short,
        "last_completed": last_completed,
    }


async def settle_rss(pid: int, seconds: float = 1.0) -> int:
    await trio.sleep(seconds)
    return h.proc_status(pid)["VmRSS"]


async def drive(args: argparse.Namespace, server: h.Server) -> list[dict[str, Any]]:
    identity = Identity.generate()
    path = f"/a2a/{identity.fingerprint}/echo"
    stamps: dict[str, dict[str, float]] = {}
    rounds = []
    async with trio.open_nursery() as nursery:
        # Warm-up with room, so the code paths of a whole run are loaded.
        provider = await start_provider(nursery, identity, server.ws_url, None, args.deltas, stamps)
        warm = h.RawHTTP(server.url)
        for i in range(args.warmup):
            _, data = await warm.json(
                "POST", path, h.a2a_send_body(i, text_of(i), f"warm-{i}", None), h.A2A_HEADERS
            )
            if data["result"]["task"]["status"]["state"] != "TASK_STATE_COMPLETED":
                raise SystemExit(f"warm-up run did not complete: {data}")
        await warm.aclose()
        await provider.stop()
        for number in range(1, args.rounds + 1):
            note(f"round {number}: queueing {args.waiting} runs")
            rounds.append(await one_round(args, server, nursery, identity, path, stamps))
    return rounds


async def one_round(
    args: argparse.Namespace,
    server: h.Server,
    nursery: trio.Nursery,
    identity: Identity,
    path: str,
    stamps: dict[str, dict[str, float]],
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    # Full: the provider is attached but has no room.
    provider = await start_provider(
        nursery, identity, server.ws_url, args.room_before, args.deltas, stamps
    )
    out["rss_before"] = await settle_rss(server.pid)

    callers = Callers(args, server.url, path)
    stamped_before = set(stamps)
    cpu = h.CpuWatch({"server": server.pid, "bench (callers + provider)": os.getpid()})
    cpu.start()
    began = time.monotonic()
    with trio.fail_after(args.time_limit):
        if args.callers == "detached":
            await callers.detached()
        elif args.callers == "blocking":
            nursery.start_soon(callers.blocking, nursery)
        else:
            nursery.start_soon(callers.streaming, nursery)
        await callers.all_queued.wait()
    out["intake_seconds"] = time.monotonic() - began
    out["intake_cpu"] = cpu.shares()
    out["rss_waiting"] = await settle_rss(server.pid, 2.0)
    held = [r for r in callers.run_ids if r is not None]
    out["held"] = len(held)
    # Nothing may have been offered to a full provider.
    out["offered_while_full"] = sum(1 for r in held if r in stamps)
    if args.door == "agui" or args.callers == "blocking":
        # Run ids come once the runs start (or end): count what was offered.
        out["held"] = callers.queued - len(callers.errors)
        out["offered_while_full"] = len(set(stamps) - stamped_before)

    # Room appears: the provider comes back with room.
    note(
        "all queued; the provider comes back with room "
        f"{'unlimited' if args.room_after is None else args.room_after}"
    )
    await provider.stop()
    cpu.start()
    reconnect_began = time.monotonic()
    if args.door == "agui" or args.callers == "blocking":
        held = []  # known as their streams see them start, or their answers come
    provider = await start_provider(
        nursery, identity, server.ws_url, args.room_after, args.deltas, stamps
    )
    room_at, room_wall = time.monotonic(), time.time()
    out["reconnect_seconds"] = room_at - reconnect_began
    held_set = set(held)
    with trio.fail_after(args.time_limit):
        if args.callers in ("streaming", "blocking"):
            await callers.all_ended.wait()
            out["last_end"] = max(t for t, _ in callers.ended.values()) - room_at
            finals: dict[str, int] = {}
            for _, state in callers.ended.values():
                finals[state] = finals.get(state, 0) + 1
            out["stream_finals"] = finals
        else:
            last_note = time.monotonic()
            while True:
                seen = [stamps.get(r, {}) for r in held_set]
                finished = sum(1 for s in seen if "finish" in s)
                if finished == len(held_set):
                    break
                if time.monotonic() - last_note > 5:
                    last_note = time.monotonic()
                    note(
                        f"draining: {sum(1 for s in seen if 'offer' in s)} offered, "
                        f"{sum(1 for s in seen if 'answer' in s)} answered, {finished} "
                        f"finished of {len(held_set)}; provider link: "
                        f"{provider.provider.last_end_reason or 'up'}"
                    )
                await trio.sleep(0.05)
    out["provider_done"] = (
        max(
            (stamps[r]["finish"] for r in held_set if "finish" in stamps.get(r, {})),
            default=room_at,
        )
        - room_at
    )
    if args.door == "agui" or args.callers == "blocking":
        held = [r for r in callers.run_ids if r is not None]
        held_set = set(held)
        out["provider_done"] = (
            max(
                (stamps[r]["finish"] for r in held_set if "finish" in stamps.get(r, {})),
                default=room_at,
            )
            - room_at
        )
    out["drain_cpu"] = cpu.shares()
    out["answer"] = [
        stamps[r]["answer"] - stamps[r]["offer"]
        for r in held_set
        if "answer" in stamps.get(r, {}) and "offer" in stamps[r]
    ]
    out["errors"] = list(callers.errors)
    if args.callers == "detached":
        # A finish is committed a moment after the provider sends it: wait
        # until the runs finished last are completed in the record.
        last = sorted(held, key=lambda r: stamps[r]["finish"])[-20:]
        with trio.fail_after(120):
            while (await verify(server.url, last, args.deltas + 4))["statuses"].get(
                "completed", 0
            ) < len(last):
                await trio.sleep(0.2)
    note("drained; checking every run in the record")
    out["verify"] = v = await verify(server.url, held, args.deltas + 4)
    out["drain_seconds"] = v["last_completed"] - room_wall
    out["rss_drained"] = await settle_rss(server.pid)
    out["hwm"] = h.proc_status(server.pid)["VmHWM"]
    await provider.stop()
    return out


def room(text: str) -> int | None:
    return None if text == "unlimited" else int(text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiting", type=int, default=10_000, help="threads, one queued run each")
    parser.add_argument(
        "--callers", choices=["detached", "streaming", "blocking"], default="detached"
    )
    parser.add_argument(
        "--door",
        choices=["a2a", "agui"],
        default="a2a",
        help="streaming callers' door: A2A SendStreamingMessage or an AG-UI run POST",
    )
    parser.add_argument(
        "--concurrency", type=int, default=100, help="requests being made at once while queueing"
    )
    parser.add_argument("--deltas", type=int, default=8, help="text deltas per run (events = +4)")
    parser.add_argument(
        "--room-before",
        type=int,
        default=0,
        help="the provider's maxConcurrentRuns while the runs queue",
    )
    parser.add_argument(
        "--room-after",
        type=room,
        default=100,
        help="its maxConcurrentRuns once room appears, or 'unlimited' "
        "(default %(default)s; see bench/README.md on unlimited)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="queue-and-drain rounds on the same server (RSS reuse)",
    )
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--no-baseline", action="store_true")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=600,
        help="seconds allowed for queueing, and again for draining",
    )
    args = parser.parse_args()
    if args.callers == "detached" and args.door == "agui":
        parser.error("--door agui is for streaming callers")

    build = h.describe_build()
    with h.fresh_dir("funduq-scale-") as tmp:
        workdir = Path(tmp)
        floor = None if args.no_baseline else h.trio_floor(args.waiting)
        # The bounds on waiting runs (docs/limits.md) are raised to the size
        # asked for: at the defaults (1,000 per agent) the rest are refused.
        room_for = str(max(10_000, args.waiting))
        server = h.Server(
            workdir / "data",
            env={
                "FUNDUQ_MAX_QUEUED_RUNS_PER_AGENT": room_for,
                "FUNDUQ_MAX_QUEUED_RUNS": room_for,
            },
        )
        try:
            rounds = trio.run(drive, args, server)
        except* trio.TooSlowError:
            server.stop()
            trouble = server.errors_in_log()
            print(
                f"scale: gave up after --time-limit {args.time_limit:.0f} s (see the [scale] "
                f"progress lines above); server log: {len(trouble)} lines of trouble"
            )
            for line in trouble[:10]:
                print(f"  {line}")
            sys.exit(1)
        finally:
            server.stop()
        log_trouble = server.errors_in_log()

    after = "unlimited" if args.room_after is None else args.room_after
    print(
        f"scale: {args.waiting} threads each holding one queued run ({args.callers} "
        f"{'AG-UI' if args.door == 'agui' else 'A2A'} "
        f"callers), provider room {args.room_before} -> {after}, "
        f"{args.deltas + 4} events a run, {args.rounds} round(s); server and SQLite file in "
        "a child process, SDK provider in this one"
    )
    print(f"  measuring {build}")
    not_completed = 0
    for number, out in enumerate(rounds, 1):
        not_completed += report(args, number, out, floor)
    if log_trouble:
        print(f"server log: {len(log_trouble)} lines of trouble, first: {log_trouble[:3]}")
    sys.stdout.flush()
    if not_completed:
        sys.exit(1)


def report(args: argparse.Namespace, number: int, out: dict[str, Any], floor: float | None) -> int:
    n = args.waiting
    v = out["verify"]
    completed = v["statuses"].get("completed", 0) - v["short"]
    per_run = (out["rss_waiting"] - out["rss_before"]) / max(1, out["held"])
    residual = (out["rss_drained"] - out["rss_before"]) / max(1, out["held"])
    intake_rate = out["held"] / out["intake_seconds"]
    drain = out["last_end"] if args.callers in ("streaming", "blocking") else out["drain_seconds"]
    drain_rate = completed / drain if drain > 0 else float("nan")
    print(f" round {number}")
    print(
        f"  queued              {out['held']:10d} runs in {out['intake_seconds']:.2f} s "
        f"= {intake_rate:.1f} runs/s   (CPU {h.format_shares(out['intake_cpu'])})"
    )
    print(f"  offered while full  {out['offered_while_full']:10d}   (must be 0)")
    print(
        f"  server RSS          {out['rss_before'] / 1024:10.1f} MiB before, "
        f"{out['rss_waiting'] / 1024:.1f} MiB with the runs waiting, "
        f"{out['rss_drained'] / 1024:.1f} MiB after the drain, peak {out['hwm'] / 1024:.1f} MiB"
    )
    print(f"  RSS per waiting run {per_run:10.2f} KiB")
    print(f"  RSS kept per run    {residual:10.2f} KiB   (after the drain, over before)")
    print(
        f"  reconnect           {out['reconnect_seconds'] * 1e3:10.1f} ms   (provider dial to "
        "its agents published, with the runs waiting)"
    )
    what = {"streaming": "last stream ended", "blocking": "last answer read"}.get(
        args.callers, "last completedAt in the record"
    )
    print(
        f"  drain time          {drain:10.2f} s    (room appeared -> {what})"
        f" = {drain_rate:.1f} runs/s"
    )
    print(
        f"  provider finished   {out['provider_done']:10.2f} s    (room appeared -> last "
        "finish frame sent)"
    )
    if out["answer"]:
        print(
            f"  provider answer     {h.ms(out['answer'], 0.5):10.3f} ms   p99 "
            f"{h.ms(out['answer'], 0.99):.3f} ms   (offer read -> its ok written, as the "
            "provider saw it)"
        )
    print(
        f"  CPU while draining  {h.format_shares(out['drain_cpu'])} (100% = one core; "
        f"{os.cpu_count()} cores)"
    )
    if args.callers in ("streaming", "blocking"):
        print(f"  callers ended       {out['stream_finals']}")
    print(f"  record              {v['statuses']}, {v['short']} completed with events missing")
    if v["reasons"]:
        print(f"  failure reasons     {v['reasons']}")
    print(f"  runs not completed  {n - completed:10d}   (caller errors: {len(out['errors'])})")
    for line in out["errors"][:5]:
        print(f"    {line}")
    print(f"  baseline, intake: drain rate / intake rate = {drain_rate / intake_rate:.3f}")
    if floor is not None:
        print(
            f"  baseline, the bare task-per-run skeleton in a fresh trio process (per run: a "
            f"thread task with its nursery, a lane task waiting on its channel): "
            f"{floor:.2f} KiB; RSS per waiting run / skeleton = {per_run / floor:.2f}"
        )
    return n - completed


if __name__ == "__main__":
    main()
