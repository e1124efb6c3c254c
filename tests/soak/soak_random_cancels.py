"""Soak: seeded cancels at every status, more threads and steps than the test
suite runs (see tests/test_random_cancels.py).

    python tests/soak/soak_random_cancels.py --seeds 5 --threads 40 --steps 15
"""

from __future__ import annotations

import sys

from _soak import parser, soak
from test_random_cancels import cancels_scenario


def main() -> int:
    p = parser(__doc__ or "")
    p.add_argument("--threads", type=int, default=40)
    p.add_argument("--steps", type=int, default=15)
    args = p.parse_args()

    async def scenario(tmp, seed):
        return await cancels_scenario(tmp, seed=seed, threads=args.threads, steps=args.steps)

    return soak(args, scenario)


if __name__ == "__main__":
    sys.exit(main())
