"""The record's trips a run takes, counted (deterministic, unlike CPU): group
commits, writes by kind, and trio task steps by task, per run, over
bench/inprocess.py's broker and provider (SQLite on disk).

    python bench/write_counts.py --runs 1000 --threads 1    # one run at a time
    python bench/write_counts.py --runs 2000 --threads 100  # saturated
"""

from __future__ import annotations

import argparse
import collections
import sys
import tempfile
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))

import inprocess  # noqa: E402

from funduq_trio.broker.store import SqlStore  # noqa: E402


class Steps(trio.abc.Instrument):
    def __init__(self) -> None:
        self.by_task: collections.Counter[str] = collections.Counter()

    def before_task_step(self, task: trio.lowlevel.Task) -> None:
        name = task.name.rsplit(".", 1)[-1]
        if name.startswith("thread "):
            name = "thread (ThreadLanes.hold)"
        self.by_task[name] += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--deltas", type=int, default=8)
    args = parser.parse_args()
    kinds: collections.Counter[str] = collections.Counter()
    for name in ("write", "write_soon"):
        original = getattr(SqlStore, name)

        def counted(self: Any, fn: Any, _original: Any = original, **kw: Any) -> Any:
            kind = fn.__qualname__.split(".<locals>")[0].rsplit(".", 1)[-1]
            kinds[("chained " if kw.get("after") else "") + kind] += 1
            return _original(self, fn, **kw)

        setattr(SqlStore, name, counted)
    steps = Steps()
    commits: list[int] = []
    real_run = inprocess.broker_run

    async def measured(*a: Any) -> dict[str, float]:
        trio.lowlevel.add_instrument(steps)
        result = await real_run(*a)
        trio.lowlevel.remove_instrument(steps)
        commits.append(int(result["commits"]))
        return result

    with tempfile.TemporaryDirectory(prefix="funduq-counts-") as tmp:
        result = trio.run(measured, Path(tmp), args.runs, args.threads, args.deltas)
    runs = args.runs
    print(f"measuring {inprocess.Funduq.__module__} from {sys.modules['funduq_trio'].__file__}")
    print(f"{runs} runs over {args.threads} threads, {result['runs_per_s']:.0f} runs/s")
    print(f"  group commits per run {commits[0] / runs:6.2f}")
    print(f"  writes per run        {sum(kinds.values()) / runs:6.2f}")
    for kind, n in kinds.most_common():
        print(f"    {kind:22s} {n / runs:6.2f}")
    print(f"  task steps per run    {sum(steps.by_task.values()) / runs:6.2f}")
    for name, n in steps.by_task.most_common(8):
        print(f"    {name[:40]:40s} {n / runs:6.2f}")


if __name__ == "__main__":
    main()
