"""The cross-node hop of event relay (issue #12, docs/cluster.md): what it adds
to an event's way from its provider to a caller when the caller is on
another node than the run's lane.

- Two `funduq-trio serve` children (A and B) on one PostgreSQL database (a
  fresh schema, dropped at the end), each with its own data directory.
- A provider played by hand over A's link, in this process; one run, started
  through A's AG-UI door (the POST's own stream is the caller on A: the
  same-node baseline, the lane's in-memory feed). A caller on B re-attaches
  to the run's stream (`GET /agui/runs/{id}/events`): B has no lane, so each
  event reaches it as A's commit's NOTIFY, B's LISTEN connection, B's read of
  the record by seq.
- Lockstep: the provider sends event k, both callers receive it, then k+1 is
  sent; so each figure is one event's unloaded latency, timed on this
  process's monotonic clock from the provider's send to each caller's read.
  The first `--warmup` events are left out.
- Then what the notifications cost the writer: `PostgresStore` in this
  process, `--lanes` tasks living runs (insert; queued -> offering ->
  running, with an event; 3 appends of 3 events; -> completed, with an
  event), alternately with its NOTIFYs and its own LISTEN connection
  draining them, and with neither (`--rounds` rounds of `--seconds` each,
  after a quarter of that to warm up): committed writes per second.

    python bench/cluster_relay.py                  # 300 events (+20 warm-up)
    python bench/cluster_relay.py --events 1000

Needs the `postgres` extra and a PostgreSQL at FUNDUQ_TEST_POSTGRES_URL
(default postgresql://postgres@127.0.0.1:5432/test), like the tests.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any
from urllib.parse import quote

import harness as h
import httpx
import trio

POSTGRES_URL = os.environ.get(
    "FUNDUQ_TEST_POSTGRES_URL", "postgresql://postgres@127.0.0.1:5432/test"
)


def new_schema() -> tuple[str, str]:
    import psycopg

    name = "funduq_bench_" + secrets.token_hex(6)
    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
    joiner = "&" if "?" in POSTGRES_URL else "?"
    return name, f"{POSTGRES_URL}{joiner}options={quote(f'-c search_path={name}')}"


def drop_schema(name: str) -> None:
    import psycopg

    with psycopg.connect(POSTGRES_URL, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA IF EXISTS {name} CASCADE")


@contextmanager
def scratch_schema() -> Iterator[str]:
    """A schema made for one bench, dropped after it: its URL."""
    schema, url = new_schema()
    try:
        yield url
    finally:
        drop_schema(schema)


def postgres_missing() -> str | None:
    """Why the benches' PostgreSQL cannot be used (None: it answers)."""
    try:
        import psycopg

        psycopg.connect(POSTGRES_URL, connect_timeout=3).close()
    except Exception as exc:  # noqa: BLE001 -- the reason is the message
        return f"no PostgreSQL at {POSTGRES_URL}: {exc}"
    return None


class Link:
    """A provider played by hand over the link: one agent, `echo`."""

    def __init__(self, ws: Any, fingerprint: str) -> None:
        self.ws = ws
        self.fingerprint = fingerprint

    @classmethod
    async def open(cls, nursery: trio.Nursery, ws_url: str) -> Link:
        import trio_websocket

        from funduq_trio.identity import Identity, new_nonce, provider_connect_payload

        identity = Identity.generate()
        ws = await trio_websocket.connect_websocket_url(nursery, ws_url, message_queue_size=1024)
        hello = json.loads(await ws.get_message())
        nonce = new_nonce()
        proof = identity.sign(provider_connect_payload(hello["funduqKey"], hello["nonce"], nonce))
        await ws.send_message(
            json.dumps(
                {
                    "kind": "connect",
                    "publicKey": identity.public_key_hex,
                    "nonce": nonce,
                    "proof": proof,
                    "maxConcurrentRuns": None,
                    "extensions": None,
                }
            )
        )
        assert json.loads(await ws.get_message())["kind"] == "connect.ok"
        agent = {"name": "echo", "description": "bench", "card": None, "metadata": None}
        await ws.send_message(json.dumps({"kind": "register", "id": "r1", "agents": [agent]}))
        assert json.loads(await ws.get_message())["kind"] == "ok"
        return cls(ws, identity.fingerprint)

    async def accept_next(self) -> dict[str, Any]:
        while True:
            frame = json.loads(await self.ws.get_message())
            if frame.get("kind") == "offer":
                break
        answer = {"kind": "ok", "id": frame["id"], "verdict": "accepted", "reason": None}
        await self.ws.send_message(json.dumps({**answer, "payload": None}))
        return dict(frame["run"])

    async def report(self, run_id: str, event: dict[str, Any]) -> None:
        frame = {"kind": "report", "runId": run_id, "event": event, "seq": None}
        await self.ws.send_message(json.dumps(frame))

    async def finish(self, run_id: str) -> None:
        await self.ws.send_message(json.dumps({"kind": "finish", "runId": run_id}))


class Follower:
    """A caller's SSE stream: when each seq arrived."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.arrived: dict[int, float] = {}
        self.order: list[int] = []
        self._changed = trio.Event()
        self.done = trio.Event()

    async def read(self, client: httpx.AsyncClient, method: str, url: str, **kw: Any) -> None:
        async with client.stream(method, url, **kw) as response:
            assert response.status_code == 200, response.status_code
            seq = None
            async for line in response.aiter_lines():
                if line.startswith("id:"):
                    seq = int(line[3:].strip())
                elif line == "" and seq is not None:
                    self.arrived[seq] = time.monotonic()
                    self.order.append(seq)
                    seq = None
                    self._changed.set()
                    self._changed = trio.Event()
        self.done.set()  # the stream ended (the run settled)

    async def has(self, seq: int) -> None:
        while seq not in self.arrived:
            await self._changed.wait()


async def measure(args: argparse.Namespace, url: str, work: Path) -> dict[str, Any]:
    a = h.Server(work / "a", env={"FUNDUQ_DATABASE_URL": url})
    try:
        async with trio.open_nursery() as nursery:
            link = await Link.open(nursery, a.ws_url)
            # B starts once the agent is recorded (it reads the roster at
            # start) and before any run (each start settles runs it finds held).
            # Started on this thread, blocking: a child dies with the thread
            # that started it (PR_SET_PDEATHSIG), and trio retires idle
            # worker threads, which killed B in a long measurement.
            b = h.Server(work / "b", env={"FUNDUQ_DATABASE_URL": url})
            try:
                result = await lockstep(args, nursery, link, a.url, b.url)
            finally:
                nursery.cancel_scope.cancel()
                b.stop()
    finally:
        a.stop()
    return result


async def lockstep(
    args: argparse.Namespace, nursery: trio.Nursery, link: Link, url_a: str, url_b: str
) -> dict[str, Any]:
    on_a, on_b = Follower("A (the lane's node)"), Follower("B (another node)")
    client = httpx.AsyncClient(timeout=120)
    body = {
        "threadId": "t",
        "runId": "r",
        "messages": [{"id": "m1", "role": "user", "content": "relay bench"}],
    }
    nursery.start_soon(
        lambda: on_a.read(client, "POST", f"{url_a}/agui/{link.fingerprint}/echo", json=body)
    )
    run = await link.accept_next()
    run_id = run["runId"]
    await link.report(run_id, {"type": "RUN_STARTED", "threadId": run["threadId"], "runId": run_id})
    await on_a.has(1)
    nursery.start_soon(lambda: on_b.read(client, "GET", f"{url_b}/agui/runs/{run_id}/events"))
    await on_b.has(1)
    start = {"type": "TEXT_MESSAGE_START", "messageId": "m", "role": "assistant"}
    await link.report(run_id, start)
    await on_a.has(2)
    await on_b.has(2)
    sent: dict[int, float] = {}
    total = args.warmup + args.events
    for k in range(total):
        seq = 3 + k
        event = {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": f"chunk {k} "}
        sent[seq] = time.monotonic()
        await link.report(run_id, event)
        await on_a.has(seq)
        await on_b.has(seq)
    last = 3 + total
    await link.report(
        run_id, {"type": "RUN_FINISHED", "threadId": run["threadId"], "runId": run_id}
    )
    await link.finish(run_id)
    await on_a.done.wait()
    await on_b.done.wait()
    await client.aclose()
    measured = [3 + args.warmup + k for k in range(args.events)]
    same = [on_a.arrived[s] - sent[s] for s in measured]
    other = [on_b.arrived[s] - sent[s] for s in measured]
    hop = [on_b.arrived[s] - on_a.arrived[s] for s in measured]
    in_order = on_a.order == sorted(on_a.order) and on_b.order == list(range(1, last + 1))
    return {"same": same, "other": other, "hop": hop, "in_order": in_order}


async def writer_load(url: str, lanes: int, seconds: float, notify: bool) -> float:
    """Writes/s a PostgresStore commits, with or without its notifications
    (each run is 7 awaited writes)."""
    from funduq_trio.broker.postgres import PostgresStore
    from funduq_trio.broker.store import run_store

    store = PostgresStore(url)
    event = {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "x" * 40}

    async def lane(index: int) -> None:
        n = 0
        while True:
            n += 1
            run_id = f"run_{notify:d}_{index}_{n}_{secrets.token_hex(4)}"
            row = {
                "arrival": n,
                "id": run_id,
                "thread_id": f"thread_{index}",
                "provider_key": "k",
                "agent_name": "echo",
                "status": "queued",
                "input": "{}",
                "caller_metadata": "{}",
                "metadata": {},
                "created_at": time.time(),
            }
            await store.insert_run(row, None, [])
            await store.move(run_id, "offering")
            await store.move(run_id, "running", events=[(1, event)])
            for k in range(3):
                await store.append_events(run_id, [(2 + 3 * k + i, event) for i in range(3)])
            await store.move(run_id, "completed", events=[(11, event)])

    async with run_store(store):
        if not notify:
            store._changed = None  # the writer as it was before notifications
        async with trio.open_nursery() as nursery:
            if notify:
                await nursery.start(store.listen, lambda run_id: None, lambda: None)
            for index in range(lanes):
                nursery.start_soon(lane, index)
            await trio.sleep(seconds / 4)  # warm-up
            writes = store.writes
            await trio.sleep(seconds)
            writes = store.writes - writes
            nursery.cancel_scope.cancel()
    return writes / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=300, help="events measured")
    parser.add_argument("--warmup", type=int, default=20, help="events sent first, not measured")
    parser.add_argument("--lanes", type=int, default=64, help="writer load: concurrent runs")
    parser.add_argument("--seconds", type=float, default=4.0, help="writer load: per round")
    parser.add_argument("--rounds", type=int, default=3, help="writer load: rounds of each")
    args = parser.parse_args()
    if (why := postgres_missing()) is not None:
        print(why, file=sys.stderr)
        return 2
    with scratch_schema() as url:
        with h.fresh_dir("funduq-cluster-relay-") as work:
            result = trio.run(measure, args, url, Path(work))
        rates: dict[bool, list[float]] = {True: [], False: []}
        for _ in range(args.rounds):
            for notify in (True, False):
                rates[notify].append(trio.run(writer_load, url, args.lanes, args.seconds, notify))
    print(f"cluster relay: {args.events} events, one at a time, one run; {h.describe_build()}")
    print(f"{'caller':<32} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    rows = (
        ("on A, the lane's node (baseline)", result["same"]),
        ("on B, another node", result["other"]),
        ("B minus A, per event (the hop)", result["hop"]),
    )
    for name, values in rows:
        print(
            f"{name:<32} {h.ms(values, 0.5):8.2f} {h.ms(values, 0.9):8.2f} "
            f"{h.ms(values, 0.99):8.2f} {max(values) * 1e3:8.2f}"
        )
    print(f"every event on both callers, in seq order: {result['in_order']}")
    print(f"writer, {args.lanes} lanes, {args.rounds} x {args.seconds:g} s (writes/s each round):")
    for notify, name in ((True, "with NOTIFY + a LISTEN draining"), (False, "without")):
        per_round = ", ".join(f"{r:.0f}" for r in rates[notify])
        print(f"  {name:<34} median {h.percentile(rates[notify], 0.5):6.0f}  ({per_round})")
    ratio = h.percentile(rates[True], 0.5) / h.percentile(rates[False], 0.5)
    print(f"  with / without: {ratio:.2f}")
    return 0 if result["in_order"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
