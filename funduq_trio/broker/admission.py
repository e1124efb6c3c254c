"""How much funduq lets callers make it hold: the runs waiting in it (queued
or offering) and the bytes of their input, in all and per agent.

An I/O-free core. The facade *charges* a run here before it records it and
*releases* the charge when the run's lane ends; a charge is refused past a
bound, so a refused run is never recorded (see docs/limits.md).

A run stops waiting when a provider takes it, which only its lane sees (the
lane is the one owner of a run, and this module does not reach into it).
So charges of runs that were taken are dropped lazily: only when a bound
would be passed does the core ask ``still_waiting`` about each charged run
and drop those that moved on. The counts are therefore an upper bound that
is exact whenever it matters -- at the bound.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .errors import AgentQueuedRunsLimit, QueuedInputLimit, QueuedRunsLimit

#: (provider key, agent name)
Agent = tuple[str, str]


@dataclass(frozen=True, slots=True)
class _Charge:
    agent: Agent
    size: int


class WaitingRuns:
    """The bounded count (and input bytes) of runs waiting in funduq."""

    def __init__(
        self,
        *,
        max_runs: int,
        max_runs_per_agent: int,
        max_bytes: int,
        still_waiting: Callable[[str], bool],
    ) -> None:
        self.max_runs = max_runs
        self.max_runs_per_agent = max_runs_per_agent
        self.max_bytes = max_bytes
        self._still_waiting = still_waiting
        self._charges: dict[str, _Charge] = {}
        self._per_agent: dict[Agent, int] = {}
        self.bytes = 0

    @property
    def runs(self) -> int:
        return len(self._charges)

    def of_agent(self, agent: Agent) -> int:
        return self._per_agent.get(agent, 0)

    def charge(self, run_id: str, agent: Agent, size: int, *, force: bool = False) -> None:
        """Count a run about to wait (``size``: the bytes of its stored input).
        Raises a ``QueueLimitReached`` past a bound, counting nothing; with
        ``force`` (runs already recorded, queued again at a restart) never."""
        if not force and self._over(agent, size):
            self._drop_moved_on()
            if self.runs + 1 > self.max_runs:
                raise QueuedRunsLimit(
                    f"funduq already holds {self.runs} waiting runs (FUNDUQ_MAX_QUEUED_RUNS="
                    f"{self.max_runs}); retry once some are taken",
                    limit=self.max_runs,
                )
            if self.of_agent(agent) + 1 > self.max_runs_per_agent:
                raise AgentQueuedRunsLimit(
                    f"agent {agent[1]!r} already has {self.of_agent(agent)} waiting runs "
                    f"(FUNDUQ_MAX_QUEUED_RUNS_PER_AGENT={self.max_runs_per_agent}); retry once "
                    "some are taken",
                    limit=self.max_runs_per_agent,
                )
            if self.bytes + size > self.max_bytes:
                raise QueuedInputLimit(
                    f"the input of waiting runs would pass FUNDUQ_MAX_QUEUED_INPUT_BYTES="
                    f"{self.max_bytes} (this run's is {size} bytes); retry once some are taken",
                    limit=self.max_bytes,
                )
        self.release(run_id)  # a run is charged once (a reopened run's old charge goes)
        self._charges[run_id] = _Charge(agent, size)
        self._per_agent[agent] = self._per_agent.get(agent, 0) + 1
        self.bytes += size

    def release(self, run_id: str) -> None:
        """The run no longer waits (its lane ended, or it was never recorded)."""
        charge = self._charges.pop(run_id, None)
        if charge is None:
            return
        left = self._per_agent[charge.agent] - 1
        if left:
            self._per_agent[charge.agent] = left
        else:
            del self._per_agent[charge.agent]
        self.bytes -= charge.size

    def _over(self, agent: Agent, size: int) -> bool:
        return (
            self.runs + 1 > self.max_runs
            or self.of_agent(agent) + 1 > self.max_runs_per_agent
            or self.bytes + size > self.max_bytes
        )

    def _drop_moved_on(self) -> None:
        for run_id in [r for r in self._charges if not self._still_waiting(r)]:
            self.release(run_id)
