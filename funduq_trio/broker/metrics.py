"""What the broker counts about itself, for `GET /metrics` (Prometheus text).

Only what funduq observes on its own side: runs arriving and ending (by the
status they ended in), events recorded, offers answered (by verdict), and the
offer round trip -- funduq handing an offer to a provider's link until it
reads that provider's answer -- as a histogram. That round trip is the one
timing no caller or provider can see from outside. Counters live in memory
and start from zero at every start; the record holds the durable truth.

I/O-free: the broker bumps these, the web layer renders them.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable
from typing import Any

__all__ = ["OFFER_ROUND_TRIP_BUCKETS", "Histogram", "Metrics"]

#: Upper bounds (seconds) of the offer round trip histogram's buckets.
OFFER_ROUND_TRIP_BUCKETS = (
    0.0005,
    0.001,
    0.002,
    0.003,
    0.005,
    0.0075,
    0.01,
    0.015,
    0.02,
    0.03,
    0.05,
    0.075,
    0.1,
    0.2,
    0.5,
    1.0,
    2.0,
    5.0,
)


class Histogram:
    """A Prometheus histogram: counts per upper bound, a sum and a count."""

    __slots__ = ("bounds", "counts", "count", "sum")

    def __init__(self, bounds: Iterable[float]) -> None:
        self.bounds = tuple(sorted(bounds))
        self.counts = [0] * (len(self.bounds) + 1)  # the last one is +Inf
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.count += 1
        self.sum += value

    def cumulative(self) -> list[tuple[str, int]]:
        """(le, observations <= le) per bucket, as Prometheus lists them."""
        out, running = [], 0
        for bound, n in zip((*map(_number, self.bounds), "+Inf"), self.counts, strict=True):
            running += n
            out.append((bound, running))
        return out


class Metrics:
    """The broker's counters and the offer round trip histogram."""

    def __init__(self) -> None:
        self.runs_started = 0
        self.runs_ended: dict[str, int] = {}
        self.events_recorded = 0
        self.offers_answered: dict[str, int] = {}
        self.offer_round_trip = Histogram(OFFER_ROUND_TRIP_BUCKETS)
        #: KYOK completions by (offering "{fingerprint}/{name}", outcome).
        self.completions: dict[tuple[str, str], int] = {}
        #: Thread leases (docs/cluster.md), shown only when the record is shared.
        self.cluster = False
        self.lease_renewals = 0
        self.threads_taken_over = 0
        self.threads_let_go = 0
        self.threads_handed_over = 0
        self.offers_held = 0
        self.calls_forwarded = 0
        self.calls_taken = 0
        #: The front's (funduq_trio/front/serving.py counts them).
        self.connections_open = 0
        self.connections_refused = 0

    def run_ended(self, status: str) -> None:
        self.runs_ended[status] = self.runs_ended.get(status, 0) + 1

    def offer_answered(self, verdict: str, round_trip: float) -> None:
        self.offers_answered[verdict] = self.offers_answered.get(verdict, 0) + 1
        self.offer_round_trip.observe(round_trip)

    def completion_ended(self, offering: str, outcome: str) -> None:
        key = (offering, outcome)
        self.completions[key] = self.completions.get(key, 0) + 1

    def render(self, gauges: dict[str, tuple[str, float]]) -> str:
        """The Prometheus text exposition (format 0.0.4). `gauges` are the
        facade's current values: name -> (help, value)."""
        lines: list[str] = []

        def family(name: str, kind: str, help_text: str, samples: list[tuple[str, Any]]) -> None:
            lines.append(f"# HELP {name} {help_text}")
            lines.append(f"# TYPE {name} {kind}")
            lines.extend(f"{name}{labels} {_number(value)}" for labels, value in samples)

        family(
            "funduq_runs_started_total",
            "counter",
            "Runs that arrived at a door.",
            [("", self.runs_started)],
        )
        family(
            "funduq_runs_ended_total",
            "counter",
            "Runs that settled or paused, by the status they reached.",
            [(f'{{status="{s}"}}', n) for s, n in sorted(self.runs_ended.items())],
        )
        family(
            "funduq_events_recorded_total",
            "counter",
            "AG-UI events recorded (a provider's and funduq's own RUN_ERRORs).",
            [("", self.events_recorded)],
        )
        family(
            "funduq_offers_answered_total",
            "counter",
            "Offers a provider answered, by verdict.",
            [(f'{{verdict="{v}"}}', n) for v, n in sorted(self.offers_answered.items())],
        )
        hist = self.offer_round_trip
        # A histogram's samples: name + suffix (+ labels), as the format has them.
        family(
            "funduq_offer_round_trip_seconds",
            "histogram",
            "From funduq handing an offer to the provider's link to reading its answer.",
            [
                *((f'_bucket{{le="{le}"}}', n) for le, n in hist.cumulative()),
                ("_sum", hist.sum),
                ("_count", hist.count),
            ],
        )
        family(
            "funduq_kyok_completions_total",
            "counter",
            "KYOK completions relayed, by LLM offering and outcome (completed, refused, "
            "failed, abandoned by funduq, lost with the LLM provider's link).",
            [
                (f'{{offering="{o}",outcome="{r}"}}', n)
                for (o, r), n in sorted(self.completions.items())
            ],
        )
        family(
            "funduq_connections_refused_total",
            "counter",
            "Connections answered 503 too_many_connections (FUNDUQ_MAX_CONNECTIONS were open).",
            [("", self.connections_refused)],
        )
        family(
            "funduq_connections_open",
            "gauge",
            "Connections open: HTTP requests, SSE streams, provider links.",
            [("", self.connections_open)],
        )
        if self.cluster:
            family(
                "funduq_lease_renewals_total",
                "counter",
                "Renewals of this node's thread leases that the record took.",
                [("", self.lease_renewals)],
            )
            family(
                "funduq_threads_taken_over_total",
                "counter",
                "Threads whose lapsed (or unheld) lease this node claimed, restoring them.",
                [("", self.threads_taken_over)],
            )
            family(
                "funduq_threads_let_go_total",
                "counter",
                "Threads this node stopped acting for because another node took them over.",
                [("", self.threads_let_go)],
            )
            family(
                "funduq_threads_handed_over_total",
                "counter",
                "Threads this node let go because no link here serves their agent any "
                "more while another node's do (their queued runs go on there).",
                [("", self.threads_handed_over)],
            )
            family(
                "funduq_offers_held_total",
                "counter",
                "Offers held back because this node's own clock said its thread's lease "
                "may have lapsed (no renewal taken for a lease); sent once one was, or "
                "dropped when another node took the thread.",
                [("", self.offers_held)],
            )
            family(
                "funduq_calls_forwarded_total",
                "counter",
                "Callers' requests this node sent to another node to carry out.",
                [("", self.calls_forwarded)],
            )
            family(
                "funduq_calls_taken_total",
                "counter",
                "Requests another node forwarded here, signed, and carried out.",
                [("", self.calls_taken)],
            )
        for name, (help_text, value) in gauges.items():
            family(name, "gauge", help_text, [("", value)])
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    return repr(float(value))
