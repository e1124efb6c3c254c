"""Soak: several kill -9 / restart cycles on one data directory, under more load
than the test suite's single cycle (see tests/test_crash_restart.py).

    python tests/soak/soak_crash_restart.py --seeds 3 --cycles 5 --callers 12
"""

from __future__ import annotations

import sys

from _soak import parser, soak
from test_crash_restart import crash_scenario


def main() -> int:
    p = parser(__doc__ or "")
    p.add_argument("--cycles", type=int, default=5)
    p.add_argument("--callers", type=int, default=12)
    p.add_argument(
        "--min-background", type=int, default=150, help="background runs completed before each kill"
    )
    args = p.parse_args()

    async def scenario(tmp, seed):
        return await crash_scenario(
            tmp,
            seed=seed,
            cycles=args.cycles,
            callers_n=args.callers,
            min_background=args.min_background,
            fixtures_each=3,
        )

    return soak(args, scenario)


if __name__ == "__main__":
    sys.exit(main())
