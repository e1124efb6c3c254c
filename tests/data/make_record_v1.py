"""Makes tests/data/record-v1.sqlite3: a record written by the code of commit
d2191a5 (the schema before versions, "version 1"), for the upgrade test in
tests/test_record_schema.py. Not a test; run it once against THAT code:

    mkdir /tmp/old && git archive d2191a5 | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old:/tmp/old/tests python tests/data/make_record_v1.py tests/data

It writes record-v1.sqlite3 and record-v1.json (the provider's key and the
ids the test looks for). What the file holds when the old broker stops:

- thread `done_then_paused`: a completed run, then a run paused on `ask-1`;
- thread `streaming`: a run accepted and streaming (the restart fails it);
- thread `busy`: a run offered and never answered (the restart fails it), two
  runs queued behind it;
- thread `declined`: a run the provider declined once (its `misdeclared`
  counter is 1), queued for the next offer.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

import trio
import trio.testing
from broker_support import (  # the OLD code's tests/broker_support.py
    Provider,
    accepted,
    broker,
    interrupt_finish,
    last_offer_for,
    quiet,
    reply,
    start,
    status_of,
)

ASK = [
    {
        "id": "ask-1",
        "reason": "approval",
        "message": "Proceed?",
        "expiresAt": "2030-06-01T00:00:00Z",
    }
]


async def make(out: Path) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        data = Path(scratch)
        async with broker(data) as funduq:
            p = await Provider(funduq).attach()
            done = await accepted(funduq, p, text="first")
            p.stream(done.run_id, *reply(done.run_id, done.thread_id, text="one"))
            paused = await accepted(funduq, p, thread_id=done.thread_id, text="second")
            events = reply(paused.run_id, paused.thread_id)[:-1]
            p.stream(paused.run_id, *events, interrupt_finish(paused.run_id, paused.thread_id, ASK))
            running = await accepted(funduq, p, text="streaming")
            p.stream(running.run_id, *reply(running.run_id, running.thread_id)[:3], finish=False)
            busy = await start(funduq, p, text="busy")  # offered, never answered
            queued = [
                await start(funduq, p, thread_id=busy.thread_id, text=f"q{i}") for i in range(2)
            ]
            declined = await start(funduq, p, text="declined")
            p.session.answer(last_offer_for(p.link, declined.run_id), "declined")
            await quiet()
            statuses = {
                t.run_id: await status_of(funduq, t.run_id)
                for t in (done, paused, running, busy, *queued, declined)
            }
            assert list(statuses.values()) == [
                "completed",
                "input-required",
                "running",
                "offering",
                "queued",
                "queued",
                "queued",
            ], statuses
        shutil.copyfile(data / "funduq.sqlite3", out / "record-v1.sqlite3")
    ids = {
        "provider_private_key": p.identity._private_hex(),
        "completed": done.run_id,
        "paused": paused.run_id,
        "running": running.run_id,
        "offering": busy.run_id,
        "queued": [t.run_id for t in queued],
        "declined": declined.run_id,
        "threads": {
            "done_then_paused": done.thread_id,
            "streaming": running.thread_id,
            "busy": busy.thread_id,
            "declined": declined.thread_id,
        },
    }
    (out / "record-v1.json").write_text(json.dumps(ids, indent=1) + "\n")


if __name__ == "__main__":
    trio.run(make, Path(sys.argv[1]), clock=trio.testing.MockClock(autojump_threshold=0))
