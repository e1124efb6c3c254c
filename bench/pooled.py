"""The offer round trip over several `e2e.py` rounds, pooled.

One round's p99 is 40 offers of 4,000: a single stall of the host (50 ms
without a core, which one round in a few meets on a shared 2-core machine)
decides it. Pooled, the same offers estimate the load's p99 with that stall
weighed by how often it comes. This adds up the server's own histogram
(`GET /metrics`, the `offer round trip le` line each round prints) over the
rounds of each configuration and prints, per configuration, each round's p99
and the pooled p50, p99 and share of offers over 10 ms.

    python bench/pooled.py /tmp/logs/e2e-*.txt

A configuration is the round's header line (doors, provider kind, client;
the offered rate left out) with its NOTE lines (`--split-cores`, nice).
"""

from __future__ import annotations

import argparse
import re
import sys
from collections import defaultdict
from pathlib import Path

import harness as h

LINE = 0.010  # issue #16: the offer round trip's p99 under 10 ms


def read_round(path: Path) -> tuple[str, list[tuple[float, int]]] | None:
    """(configuration, cumulative bucket counts) of one e2e log, or None."""
    config: list[str] = []
    counts = None
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("e2e: "):
            config.append(re.sub(r", offered at [0-9.]+ runs/s", "", line[5:]))
        elif line.strip().startswith("NOTE "):
            config.append(line.strip())
        elif line.strip().startswith("offer round trip le "):
            counts = h.parse_bucket_counts(line.strip()[len("offer round trip le ") :])
    if counts is None or not config:
        return None
    return "\n  ".join(config), counts


def over(counts: list[tuple[float, int]], bound: float) -> int:
    """Observations above `bound` (one of the histogram's bounds)."""
    at = dict(counts)
    return counts[-1][1] - at[bound]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", nargs="+", type=Path)
    args = parser.parse_args()
    rounds: dict[str, list[list[tuple[float, int]]]] = defaultdict(list)
    for path in args.logs:
        found = read_round(path)
        if found is None:
            print(f"{path}: no offer round trip counts (not an e2e log, or an old one)")
            continue
        rounds[found[0]].append(found[1])
    if not rounds:
        sys.exit("no rounds")
    for config, got in rounds.items():
        zero = [(le, 0) for le, _ in got[0]]
        pooled = [(le, sum(c[i][1] for c in got)) for i, (le, _) in enumerate(zero)]
        per_round = [h.histogram_quantile(zero, c, 0.99)[0] for c in got]
        p50, total = h.histogram_quantile(zero, pooled, 0.5)
        p99, _ = h.histogram_quantile(zero, pooled, 0.99)
        within = sum(p <= LINE for p in per_round)
        print(config)
        print(
            f"  rounds {len(got)}; each round's p99 <= (ms): "
            f"{', '.join(f'{p * 1e3:g}' for p in per_round)}; "
            f"<= {LINE * 1e3:g} ms in {within} of {len(got)}"
        )
        slow = over(pooled, LINE)
        print(
            f"  pooled ({total} offers): p50 <= {p50 * 1e3:g} ms, p99 <= {p99 * 1e3:g} ms; "
            f"over {LINE * 1e3:g} ms: {slow} ({100 * slow / total:.2f}%)"
        )


if __name__ == "__main__":
    main()
