"""Soak: provider faults under a bigger load than the test suite's 200 runs
(see tests/test_provider_faults.py).

    python tests/soak/soak_provider_faults.py --seeds 5 --threads 100 --runs 20
"""

from __future__ import annotations

import sys

from _soak import parser, soak
from test_provider_faults import faults_scenario


def main() -> int:
    p = parser(__doc__ or "")
    p.add_argument("--threads", type=int, default=100)
    p.add_argument("--runs", type=int, default=20, help="runs per thread")
    p.add_argument("--cancel-chance", type=float, default=0.12)
    args = p.parse_args()

    async def scenario(tmp, seed):
        return await faults_scenario(
            tmp, seed=seed, threads=args.threads, runs=args.runs, cancel_chance=args.cancel_chance
        )

    return soak(args, scenario)


if __name__ == "__main__":
    sys.exit(main())
