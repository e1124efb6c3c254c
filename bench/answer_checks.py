"""The two checks the blocking answer and the offer gained (bench/README.md,
"A blocking answer and an offer: only what is true"), alone, in instructions:

- ``wait_run`` of a run whose lane here has ended having recorded its end
  (the common road: the lane's snapshot is the answer, no record read);
- ``Lane._send_offer`` on a record only this process writes (SQLite: no
  leases, so nothing more than a look at ``leased``).

Both run on stand-ins for what they touch (an ended lane, a session that
takes the offer), so only the code under test differs between trees. Run
each tree by ``PYTHONPATH`` under callgrind at two ``--calls`` and subtract::

    valgrind --tool=callgrind --callgrind-out-file=/tmp/x.%p \\
        .venv/bin/python bench/answer_checks.py --calls 20000
    (and --calls 60000; (Ir(60000) - Ir(20000)) / 40000 = instructions a
    wait_run plus a _send_offer)

``--only wait_run`` or ``--only send_offer`` measures one of them.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import trio

import funduq_trio
from funduq_trio.broker.funduq import Funduq
from funduq_trio.broker.lanes import Lane
from funduq_trio.config import Settings
from funduq_trio.protocol.statuses import Status


def ended_lane(funduq: Funduq) -> Lane:
    """A real lane that settled its run and recorded it, its feed closed
    (``wait_run``'s common road), without running it."""
    lane = Lane(
        funduq,
        {
            "id": "run_1",
            "thread_id": "thread_1",
            "provider_key": "key",
            "agent_name": "echo",
            "status": Status.COMPLETED,
            "input": "{}",
            "caller_metadata": "{}",
            "metadata": {},
            "next_seq": 1,
        },
        arriving=False,
    )
    lane.feed.close()
    return lane


class Session:
    def send(self, offer: Any, payload: Any) -> None:
        pass


class Host:
    """What ``_send_offer`` asks of the broker, on a record without leases."""

    def __init__(self) -> None:
        self.leased = False  # an instance attribute, as Funduq's
        self._payload = {"runInput": {"messages": []}, "metadata": {}}

    def offer_payload(self, lane: Any) -> dict[str, Any]:
        return self._payload


class OfferingLane:
    """Stands in for a lane whose offer is about to leave."""

    def __init__(self) -> None:
        self._place = Session()
        self._offer = object()
        self.f = Host()
        self.thread_id = "thread_1"
        self.run_id = "run_1"


async def main(calls: int, only: str | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        funduq = Funduq(Settings(data_dir=Path(tmp)))
        funduq.watchers = None
        funduq.lanes["run_1"] = ended_lane(funduq)
        lane = OfferingLane()
        send_offer = Lane._send_offer
        wait_run = funduq.wait_run
        for _ in range(calls):
            if only != "send_offer":
                await wait_run("run_1")
            if only != "wait_run":
                await send_offer(lane)  # type: ignore[arg-type]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--only", choices=["wait_run", "send_offer"])
    args = parser.parse_args()
    print(f"tree: {Path(funduq_trio.__file__).parent}")
    trio.run(main, args.calls, args.only)
