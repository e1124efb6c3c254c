"""Soak: the three fuzzers of tests/test_fuzz.py with many more examples and
random (not derandomized) generation, so each run explores new inputs.

    python tests/soak/soak_fuzz.py --examples 2000
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import _soak  # noqa: F401 - puts tests/ on the path
import test_fuzz
import trio
from hypothesis import settings


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--examples", type=int, default=2000)
    args = p.parse_args()
    test_fuzz.FUZZ_SETTINGS = settings(
        test_fuzz.FUZZ_SETTINGS, max_examples=args.examples, derandomize=False
    )
    failed = 0
    for name in (
        "test_fuzzed_provider_frames",
        "test_fuzzed_jsonrpc_bodies",
        "test_fuzzed_agui_bodies",
    ):
        tmp = Path(tempfile.mkdtemp(prefix="funduq-soak-fuzz-"))
        try:
            trio.run(getattr(test_fuzz, name), tmp)
            print(f"{name}: ok", flush=True)
        except BaseException as exc:  # noqa: BLE001 - report and go on to the next
            failed += 1
            print(f"{name}: FAILED: {exc!r}"[:2000], flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
