"""What a waiting run holds in the server, broken down: the scale bench's
setup (a full provider, `--waiting` A2A callers, `streaming` ones each
holding an SSE stream), with the server's Python heap looked at from inside.

The server is `funduq-trio serve` in a child process, run through this
script's `serve-traced` mode: the same CLI, with `tracemalloc` started first
(`--frames` deep; 0: off, then only RSS and object counts) and, on SIGUSR1, a
dump of the heap (a tracemalloc snapshot) and of every object the collector
tracks, counted by type (coroutines, generators and trio tasks by name). One
dump before the callers come, one once all their runs wait; the figures are
the differences, per waiting run:

- RSS (with tracemalloc on, this is its own bookkeeping too: compare
  `bench/scale.py` for the real figure, or run with `--frames 0`);
- objects by type, trio tasks by name, coroutines (a waiting task's stack);
- the heap by *owner*: each allocation goes to the innermost frame of its
  traceback in a named package (funduq's modules one by one, hypercorn, h11,
  quart, werkzeug, protobuf, ...), so trio's and the standard library's
  allocations count for whoever called them; then the top allocation sites.

    python bench/held_memory.py                          # 1,000 streaming callers
    python bench/held_memory.py --callers detached --waiting 2000
    python bench/held_memory.py --callers blocking       # each waiting in SendMessage
    python bench/held_memory.py --frames 0               # RSS and counts, no tracemalloc

Slow with tracemalloc on (a few minutes at 1,000 streams on 2 cores).
"""

from __future__ import annotations

import argparse
import collections
import json
import linecache
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import harness as h
import trio

#: Where an allocation is charged: the innermost frame in one of these.
OWNERS = (
    "funduq_trio/",
    "hypercorn/",
    "h11/",
    "quart_trio/",
    "quart/",
    "werkzeug/",
    "google/protobuf/",
    "a2a/",
    "wsproto/",
    "blinker/",
)


def serve_traced_main(argv: list[str]) -> int:
    """`held_memory.py serve-traced OUT FRAMES -- <funduq-trio args>`."""
    import gc
    import tracemalloc

    out, frames, _, *cli_args = argv
    depth = int(frames)
    if depth:
        tracemalloc.start(depth)
    dumps = [0]

    def dump(signum: int, frame: Any) -> None:
        dumps[0] += 1
        n = dumps[0]
        gc.collect()
        counts: collections.Counter[str] = collections.Counter()
        for obj in gc.get_objects():
            kind = type(obj)
            counts[f"{kind.__module__}.{kind.__qualname__}"] += 1
            if kind.__name__ == "coroutine":
                counts["coroutine " + obj.cr_code.co_qualname] += 1
            elif kind.__name__ == "async_generator":
                counts["async generator " + obj.ag_code.co_qualname] += 1
            elif kind.__name__ == "Task" and kind.__module__.startswith("trio"):
                counts["task " + str(obj.name).split(" at ")[0].split(" thread_")[0]] += 1
        with open(f"{out}/objects{n}.json", "w") as fh:
            json.dump(counts, fh)
        if depth:
            tracemalloc.take_snapshot().dump(f"{out}/heap{n}.bin")
        Path(f"{out}/done{n}").write_text("ok")

    signal.signal(signal.SIGUSR1, dump)
    from funduq_trio.cli import main

    return main(cli_args)


def start_server(workdir: Path, frames: int, waiting: int) -> tuple[subprocess.Popen[bytes], str]:
    data = workdir / "data"
    data.mkdir(parents=True)
    log_path = data / "server.log"
    room = str(max(10_000, waiting))
    env = h.child_env({"FUNDUQ_MAX_QUEUED_RUNS_PER_AGENT": room, "FUNDUQ_MAX_QUEUED_RUNS": room})
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [
                *h.DIE_WITH_PARENT,
                sys.executable,
                str(Path(__file__).resolve()),
                "serve-traced",
                str(workdir),
                str(frames),
                "--",
                "serve",
                "--host",
                h.HOST,
                "--port",
                "0",
                "--data-dir",
                str(data),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=data,
        )
    url = h._wait_in_log(
        proc, log_path, r"funduq-trio \S* ?serving on (http://\S+)", "server", proc.kill, 300
    )
    return proc, url


async def drive(
    args: argparse.Namespace, proc: subprocess.Popen[bytes], url: str
) -> dict[str, Any]:
    import scale

    from funduq_trio.identity import Identity

    workdir = Path(args.workdir)

    async def dump(n: int) -> None:
        os.kill(proc.pid, signal.SIGUSR1)
        while not (workdir / f"done{n}").exists():
            await trio.sleep(0.1)

    identity = Identity.generate()
    path = f"/a2a/{identity.fingerprint}/echo"
    ws_url = "ws" + url[len("http") :] + "/ws/provider"
    stamps: dict[str, dict[str, float]] = {}
    out: dict[str, Any] = {}
    async with trio.open_nursery() as nursery:
        # Warm-up with room (every code path of a whole run loaded), then full.
        provider = await scale.start_provider(nursery, identity, ws_url, None, 8, stamps)
        warm = h.RawHTTP(url)
        for i in range(args.warmup):
            body = h.a2a_send_body(i, scale.text_of(i), f"warm-{i}", None)
            await warm.json("POST", path, body, h.A2A_HEADERS)
        await warm.aclose()
        await provider.stop()
        await scale.start_provider(nursery, identity, ws_url, 0, 8, stamps)
        await trio.sleep(1)
        out["rss_before"] = h.proc_status(proc.pid)["VmRSS"]
        await dump(1)
        callers = scale.Callers(args, url, path)
        if args.callers == "streaming":
            nursery.start_soon(callers.streaming, nursery)
        elif args.callers == "blocking":  # each waits in SendMessage for its run's end
            nursery.start_soon(callers.blocking, nursery)
        else:
            await callers.detached()
        await callers.all_queued.wait()
        await trio.sleep(2)
        out["rss_waiting"] = h.proc_status(proc.pid)["VmRSS"]
        await dump(2)
        out["errors"] = list(callers.errors)
        proc.kill()
        nursery.cancel_scope.cancel()
    return out


def report(args: argparse.Namespace, out: dict[str, Any]) -> None:
    n = args.waiting
    workdir = Path(args.workdir)
    print(
        f"held_memory: {n} waiting runs ({args.callers} "
        f"{'AG-UI' if args.door == 'agui' else 'A2A'} callers), tracemalloc "
        f"{'off' if not args.frames else f'{args.frames} frames'}"
    )
    print(f"  measuring {h.describe_build()}")
    print(
        f"  RSS per waiting run  {(out['rss_waiting'] - out['rss_before']) / n:8.2f} KiB"
        + ("   (tracemalloc's own bookkeeping included)" if args.frames else "")
    )
    if out["errors"]:
        print(f"  caller errors: {len(out['errors'])}, first: {out['errors'][:3]}")
    before = json.loads((workdir / "objects1.json").read_text())
    after = json.loads((workdir / "objects2.json").read_text())
    grown = {k: after.get(k, 0) - before.get(k, 0) for k in set(before) | set(after)}

    def per_run(prefix: str, limit: int, plain: bool = False) -> None:
        rows = [
            (v / n, k)
            for k, v in grown.items()
            if (k.startswith(prefix) if prefix else " " not in k) and v / n >= 0.5
        ]
        for value, name in sorted(rows, reverse=True)[:limit]:
            print(f"    {value:7.2f}  {name[len(prefix) :] if prefix else name}")

    total = sum(v for k, v in grown.items() if " " not in k)
    print(f"  objects the collector tracks, per run: {total / n:.1f}; the commonest:")
    per_run("", 20)
    print("  trio tasks per run, by name:")
    per_run("task ", 20)
    print("  coroutines per run (each waiting task's stack):")
    per_run("coroutine ", 40)
    print("  async generators per run:")
    per_run("async generator ", 20)
    if not args.frames:
        return

    import tracemalloc

    first = tracemalloc.Snapshot.load(str(workdir / "heap1.bin"))
    second = tracemalloc.Snapshot.load(str(workdir / "heap2.bin"))
    owners: collections.Counter[str] = collections.Counter()
    sites: collections.Counter[tuple[str, int]] = collections.Counter()
    for stat in second.compare_to(first, "traceback"):
        if stat.size_diff <= 0:
            continue
        site = None
        for frame in reversed(list(stat.traceback)):  # innermost first
            name = frame.filename
            for owner in OWNERS:
                if owner in name:
                    site = (owner + name.split(owner, 1)[1], frame.lineno)
                    break
            if site:
                break
        if site is None:
            frame = stat.traceback[-1]
            site = ("(other) " + frame.filename.rsplit("site-packages/", 1)[-1], frame.lineno)
        file = site[0]
        owner = file if file.startswith("funduq_trio/") else file.split("/", 1)[0]
        owners[owner] += stat.size_diff
        sites[site] += stat.size_diff
    print(
        f"  heap grown per run (tracemalloc): {sum(owners.values()) / n / 1024:.2f} KiB, by owner:"
    )
    for owner, size in owners.most_common(25):
        print(f"    {size / n / 1024:6.2f} KiB  {owner}")
    print("  top allocation sites (innermost frame in a named package):")
    import funduq_trio

    root = Path(funduq_trio.__file__).resolve().parent.parent  # the tree measured
    for (file, line), size in sites.most_common(args.sites):
        source = ""
        for base in [root, *map(Path, sys.path)]:
            candidate = base / file
            if candidate.exists():
                source = linecache.getline(str(candidate), line).strip()
                break
        print(f"    {size / n / 1024:6.2f} KiB  {file}:{line}  {source[:80]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--waiting", type=int, default=1000)
    parser.add_argument(
        "--callers", choices=["streaming", "detached", "blocking"], default="streaming"
    )
    parser.add_argument(
        "--door",
        choices=["a2a", "agui"],
        default="a2a",
        help="streaming callers' door: A2A SendStreamingMessage or an AG-UI run POST",
    )
    parser.add_argument("--concurrency", type=int, default=50)
    parser.add_argument("--frames", type=int, default=12, help="tracemalloc depth (0: off)")
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--sites", type=int, default=40, help="allocation sites to print")
    args = parser.parse_args()
    with h.fresh_dir("funduq-held-") as tmp:
        args.workdir = tmp
        proc, url = start_server(Path(tmp), args.frames, args.waiting)
        try:
            out = trio.run(drive, args, proc, url)
        finally:
            proc.kill()
            proc.wait()
        report(args, out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve-traced"]:
        sys.exit(serve_traced_main(sys.argv[2:]))
    main()
