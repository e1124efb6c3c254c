"""Shared runner for the soak scripts: put `tests/` on the path, run a scenario
for several seeds in fresh temporary directories, print each run's figures,
exit 1 if any run lost a run or broke an invariant.

The soak scripts are not collected by pytest (their names do not match
`test_*.py`); run them by hand, e.g. `python tests/soak/soak_provider_faults.py`.
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

TESTS = Path(__file__).resolve().parent.parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

import trio


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--seeds", type=int, default=3, help="how many seeds to run (default 3)")
    p.add_argument("--first-seed", type=int, default=1000, help="the first seed (default 1000)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directories")
    return p


def soak(args: argparse.Namespace, scenario: Callable[[Path, int], Awaitable[Any]]) -> int:
    """Run `scenario(tmp_dir, seed)` (returning a `Figures`) for each seed."""
    logging.basicConfig(level=logging.ERROR)
    failures = 0
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        tmp = Path(tempfile.mkdtemp(prefix=f"funduq-soak-{seed}-"))
        began = time.monotonic()
        fig = trio.run(scenario, tmp, seed)
        fig.extra["seed"] = seed
        fig.extra["seconds"] = round(time.monotonic() - began, 1)
        fig.report()
        if fig.runs_lost or fig.violations:
            failures += 1
            print(f"  (data kept in {tmp})", flush=True)
        elif not args.keep:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    print(f"{args.seeds - failures}/{args.seeds} seeds clean", flush=True)
    return 1 if failures else 0
