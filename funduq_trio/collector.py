"""The cyclic collector in the process the CLI owns: when its passes run.

CPython starts a young pass whenever 700 more containers have been made than
freed. A server in steady state frees what it makes, so that count is a
random walk that bursts of runs jolt, not a climb, and the time a random walk
takes to reach a line grows with the square of the line. Each pass walks what
was made since the last one and is still alive (the runs in flight, trio's
stale deadline entries, connections) and moves it up a generation, which is
what fed the middle and full passes.

* `tune()`: the start-up objects are frozen out of every pass, and the young
  line is `YOUNG_PASS_THRESHOLD` (10,000): at saturation 5 young passes where
  the default made 639, and no middle or full ones (bench/README.md, "The
  cyclic collector's young pass").
* `pass_when_idle()`: the line's price is the pass that does come. At half
  load one walked ~14,000 objects for 7-9 ms with the loop stopped, in the
  middle of whatever was running, and held every offer in flight. This task
  makes the young pass (and a middle or full one when CPython's own counts
  say it is due) when the loop has nothing else to do, once
  `IDLE_PASS_LINE` containers are counted: a short pass while the server
  would otherwise sleep. A saturated loop is never idle, so there the
  10,000 line still decides, as before (bench/README.md, "Young passes when
  the loop is idle").

Embedding processes (the tests) keep their own collector.
"""

from __future__ import annotations

import gc

import trio
import trio.testing

__all__ = ["IDLE_PASS_LINE", "IDLE_PASS_PERIOD", "YOUNG_PASS_THRESHOLD", "pass_when_idle", "tune"]

#: The young pass's automatic line; CPython's default is 700. At 700 the
#: count crossed the line 639 times in 3,000 runs (bench/e2e.py --trace, raw
#: providers, saturation), and 58 middle and 5 full passes followed: 230 ms of
#: CPU, 7-8% of the server's. At 10,000, 5 young passes and nothing else,
#: 28 ms. Cyclic garbage is rare (19 objects in 3,000 runs) and still meets a
#: pass: it counts toward the same line.
YOUNG_PASS_THRESHOLD = 10_000
#: A pass made at an idle moment once this many containers are counted.
IDLE_PASS_LINE = 1_000
#: At most one idle pass this often (seconds): the task's own cost is a wake.
IDLE_PASS_PERIOD = 0.1


def tune() -> None:
    """Leave what start-up made (modules, pydantic and protobuf schemas, the
    app: ~90,000 objects) out of the collector's passes, and run its young
    pass less often (`YOUNG_PASS_THRESHOLD`). Each full pass walked the
    start-up objects with the loop stopped: 64 ms, measured with gc.callbacks
    under bench/e2e.py at 150 runs/s; frozen, 11 ms."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_PASS_THRESHOLD, *gc.get_threshold()[1:])


def due_generation() -> int:
    """The oldest generation CPython's own counts say is due, as its
    automatic passes decide (0 when only the young one is)."""
    counts, thresholds = gc.get_count(), gc.get_threshold()
    for generation in (2, 1):
        if counts[generation] > thresholds[generation]:
            return generation
    return 0


async def pass_when_idle(*, line: int = IDLE_PASS_LINE, period: float = IDLE_PASS_PERIOD) -> None:
    """Run forever: every `period`, once `line` containers are counted, wait
    until no task is runnable, then make the pass that is due. Does nothing
    while the collector is disabled."""
    while True:
        await trio.sleep(period)
        if not gc.isenabled() or gc.get_count()[0] < line:
            continue
        await trio.testing.wait_all_tasks_blocked()
        gc.collect(due_generation())
