"""One-thread benchmark: many utterances on a single conversation, the
per-thread offer path.

funduq offers a thread's runs one at a time in arrival order: the next run is
offered only once the head has left the queue (accepted or settled). So the
runs of one thread are bounded by that path, however idle the server is.

The server runs as a child process (fresh data directory, SQLite on disk), one
SDK provider as another (stamping offer arrival, answer and finish on
CLOCK_MONOTONIC), and the caller in this process (httpx, A2A `SendMessage`
blocking, or `--door agui`).

1. sequential: `--runs` utterances on one thread, each sent once the previous
   one's answer is in (one caller, one connection).
2. windowed: `--runs` more on another thread from `--window` callers at once
   (default 8, the thread queue limit), so the thread always has runs queued
   behind the head: the rate is the per-thread offer cadence. The provider's
   stamps give "answer -> next offer": from the provider writing `accepted`
   to the next run's offer arriving, when that run was already waiting.

Baseline in the same run: `GET /healthz` round trips, one connection for the
sequential figure and `--window` connections for the windowed one.

    python bench/one_thread.py                 # 500 utterances, A2A
    python bench/one_thread.py --door agui --runs 200
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import harness as h
import httpx
import trio


def text_of(phase: str, i: int) -> str:
    return f"{phase} utterance {i:05d} on one thread, hello".ljust(48, ".")


class Thread:
    """One conversation through one door."""

    def __init__(self, url: str, fingerprint: str, door: str, deltas: int) -> None:
        self.url = f"{url}/{door}/{fingerprint}/echo"
        self.door = door
        self.context: str | None = None if door == "a2a" else f"bench-one-thread-{time.time()}"
        self.events_per_run = deltas + 4
        self.results: list[dict[str, Any]] = []
        self.errors: list[str] = []

    async def say(self, client: httpx.AsyncClient, phase: str, i: int) -> None:
        text = text_of(phase, i)
        result: dict[str, Any] = {"began": time.monotonic(), "ok": False, "run_id": None}
        try:
            if self.door == "a2a":
                body = h.a2a_send_body(i, text, f"{phase}-{i}", self.context)
                data = (await client.post(self.url, json=body, headers=h.A2A_HEADERS)).json()
                if "result" not in data:
                    raise RuntimeError(f"A2A error {data.get('error')}")
                task = data["result"]["task"]
                result["run_id"] = task["id"]
                self.context = task["contextId"]
                reply = "".join(
                    p.get("text", "") for a in task.get("artifacts", []) for p in a["parts"]
                )
                result["ok"] = task["status"]["state"] == "TASK_STATE_COMPLETED" and reply == text
            else:
                assert self.context is not None
                events = []
                async with client.stream(
                    "POST", self.url, json=h.agui_body(self.context, text, f"{phase}-{i}")
                ) as response:
                    if response.status_code != 200:
                        raise RuntimeError(f"AG-UI HTTP {response.status_code}")
                    async for line in response.aiter_lines():
                        if line.startswith("data: "):
                            events.append(json.loads(line[6:]))
                result["run_id"] = events[0]["runId"]
                self.context = events[0]["threadId"]
                result["ok"] = (
                    len(events) == self.events_per_run and events[-1]["type"] == "RUN_FINISHED"
                )
            if not result["ok"]:
                raise RuntimeError(f"run {result['run_id']} did not complete as expected")
        except (httpx.HTTPError, RuntimeError, ValueError, KeyError, IndexError) as exc:
            self.errors.append(f"{phase} {i}: {type(exc).__name__}: {exc}")
        result["done"] = time.monotonic()
        self.results.append(result)


async def sequential(url: str, fingerprint: str, args: argparse.Namespace) -> tuple[Thread, float]:
    thread = Thread(url, fingerprint, args.door, args.deltas)
    async with h.caller_client() as client:
        await client.get(f"{url}/healthz")
        began = time.monotonic()
        for i in range(args.runs):
            await thread.say(client, "sequential", i)
        return thread, time.monotonic() - began


async def windowed(url: str, fingerprint: str, args: argparse.Namespace) -> tuple[Thread, float]:
    thread = Thread(url, fingerprint, args.door, args.deltas)
    async with h.caller_client() as client:
        await thread.say(client, "opening", 0)  # the thread exists before the window opens
    thread.results.clear()
    next_index = 0

    async def caller() -> None:
        nonlocal next_index
        async with h.caller_client() as client:
            await client.get(f"{url}/healthz")
            await start.wait()
            while next_index < args.runs:
                i = next_index
                next_index += 1
                await thread.say(client, "windowed", i)

    start = trio.Event()
    async with trio.open_nursery() as nursery:
        for _ in range(args.window):
            nursery.start_soon(caller)
        await trio.sleep(0.2)
        began = time.monotonic()
        start.set()
    return thread, time.monotonic() - began


async def drive(
    args: argparse.Namespace, server: h.Server, provider: h.ProviderChild
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with httpx.AsyncClient(timeout=60) as client:
        await h.wait_online(client, server.url, [provider.fingerprint])
    # Warm-up on a thread of its own.
    warm = Thread(server.url, provider.fingerprint, args.door, args.deltas)
    async with h.caller_client() as client:
        for i in range(args.warmup):
            await warm.say(client, "warm", i)
    if warm.errors:
        raise SystemExit(f"warm-up failed: {warm.errors[:3]}")
    out["healthz_1"] = await h.healthz_baseline(server.url, max(args.runs, 500), 1)
    out["healthz_w"] = await h.healthz_baseline(server.url, max(args.runs, 500) * 2, args.window)
    cpu = h.CpuWatch({"server": server.pid, "provider": provider.pid, "caller": os.getpid()})
    with trio.fail_after(args.time_limit):
        cpu.start()
        out["sequential"] = await sequential(server.url, provider.fingerprint, args)
        out["cpu_sequential"] = cpu.shares()
        cpu.start()
        out["windowed"] = await windowed(server.url, provider.fingerprint, args)
        out["cpu_windowed"] = cpu.shares()
    out["rss"] = h.proc_status(server.pid)
    return out


def offer_cadence(thread: Thread, stamps: dict[str, dict[str, float]]) -> dict[str, list[float]]:
    """From the provider's stamps: offer->answer, and answer -> the next run's
    offer where the next run's caller had sent it before that answer."""
    runs = sorted(
        (stamps[r["run_id"]]["offer"], r)
        for r in thread.results
        if r["run_id"] in stamps and "offer" in stamps[r["run_id"]]
    )
    answer, handoff, to_offer = [], [], []
    for index, (offered, result) in enumerate(runs):
        s = stamps[result["run_id"]]
        to_offer.append(offered - result["began"])
        if "answer" in s:
            answer.append(s["answer"] - offered)
            if index + 1 < len(runs):
                next_offered, next_result = runs[index + 1]
                if next_result["began"] < s["answer"]:
                    handoff.append(next_offered - s["answer"])
    return {"answer": answer, "handoff": handoff, "to_offer": to_offer}


def report(
    name: str,
    thread: Thread,
    seconds: float,
    base: dict[str, Any],
    cpu: dict[str, float],
    stamps: dict[str, dict[str, float]],
) -> None:
    ok = [r for r in thread.results if r["ok"]]
    lat = [r["done"] - r["began"] for r in ok]
    rate = len(ok) / seconds
    c = offer_cadence(thread, stamps)
    print(f"  {name}: {len(ok)}/{len(thread.results)} runs completed in {seconds:.2f} s")
    print(f"    runs/s              {rate:10.1f}")
    print(f"    latency p50         {h.ms(lat, 0.5):10.2f} ms   p99 {h.ms(lat, 0.99):8.2f} ms")
    if c["to_offer"]:
        print(
            f"    caller -> offer     {h.ms(c['to_offer'], 0.5):10.2f} ms   "
            f"p99 {h.ms(c['to_offer'], 0.99):8.2f} ms"
        )
        print(
            f"    provider answer     {h.ms(c['answer'], 0.5):10.3f} ms   "
            f"p99 {h.ms(c['answer'], 0.99):8.3f} ms   (offer read -> ok written)"
        )
    if c["handoff"]:
        print(
            f"    answer -> next offer{h.ms(c['handoff'], 0.5):10.2f} ms   "
            f"p99 {h.ms(c['handoff'], 0.99):8.2f} ms   ({len(c['handoff'])} hand-offs "
            "to a run already waiting)"
        )
    print(f"    CPU                 {h.format_shares(cpu)}")
    print(
        f"    baseline GET /healthz, same connections: {base['per_s']:.1f} req/s "
        f"(p50 {base['p50_ms']:.2f} ms); runs/s / healthz req/s = {rate / base['per_s']:.3f}"
    )
    for line in thread.errors[:5]:
        print(f"    error: {line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=500, help="utterances per phase")
    parser.add_argument("--window", type=int, default=8, help="callers at once in phase 2")
    parser.add_argument("--door", choices=["a2a", "agui"], default="a2a")
    parser.add_argument("--deltas", type=int, default=8, help="text deltas per run (events = +4)")
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--time-limit", type=float, default=600)
    args = parser.parse_args()

    build = h.describe_build()
    with h.fresh_dir("funduq-one-thread-") as tmp:
        workdir = Path(tmp)
        server = h.Server(workdir / "data")
        provider = None
        stamps: dict[str, dict[str, float]] = {}
        try:
            provider = h.ProviderChild(server.ws_url, workdir, 0, deltas=args.deltas)
            out = trio.run(drive, args, server, provider)
        finally:
            if provider is not None:
                stamps = provider.stop()
            server.stop()
        log_trouble = server.errors_in_log()

    print(f"  measuring {build}")
    print(
        f"one thread: {args.runs} utterances per phase on one conversation ({args.door} door), "
        f"{args.deltas + 4} events each, server and SDK provider in their own processes"
    )
    seq, seq_s = out["sequential"]
    win, win_s = out["windowed"]
    report("sequential (one caller)", seq, seq_s, out["healthz_1"], out["cpu_sequential"], stamps)
    report(
        f"windowed ({args.window} callers on the thread)",
        win,
        win_s,
        out["healthz_w"],
        out["cpu_windowed"],
        stamps,
    )
    print(f"  server peak RSS (VmHWM) {out['rss']['VmHWM'] / 1024:.1f} MiB")
    failed = len(seq.errors) + len(win.errors)
    print(f"  runs not completed  {failed:10d}")
    if log_trouble:
        print(f"server log: {len(log_trouble)} lines of trouble, first: {log_trouble[:3]}")
    sys.stdout.flush()
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
