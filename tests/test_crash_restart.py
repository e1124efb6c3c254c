"""Crash and restart: `kill -9` the real server (a child process) in the middle
of a load, start it again on the same data directory, and check what callers
and providers were told against what the record says.

The server runs as `python -m funduq_trio serve` on a fixed loopback port, so
providers reconnect to the same address after the restart. Two providers:

* `script` -- a provider played by hand over the link (`Peer`), which puts
  runs in every state a crash can find them in: completed, failed (refused),
  cancelled, paused (input-required), queued (behind an unanswered offer),
  offering (an offer it never answers), running (started, never finished) and
  cancelling (a cancel it ignores);
* `echo` -- the SDK's own `Provider` running the example echo agent, with
  room for a few runs, under a load of A2A and AG-UI callers.

Once every state is in place and the load has completed some runs, the server
is killed with SIGKILL. Then:

* at the kill (a copy of the SQLite files taken before anything reopens them):
  the copy passes `PRAGMA integrity_check`, every run id a caller was told is
  in it, and every event a caller saw on an SSE stream is in it at its seq;
* right after the restart: runs that were offering, running or cancelling are
  `failed` with `failureReason == "orphaned_by_restart"`, their events kept and
  one RUN_ERROR appended; settled and paused runs are exactly as they were;
  nothing orphaned is ever offered again;
* driven to the end (providers back, pauses answered): every run is in exactly
  one terminal status, queued runs ran, and the record is consistent;
* after an orderly stop, the SQLite file passes `PRAGMA integrity_check`.

`crash_scenario` is shared with `tests/soak/soak_crash_restart.py`, which runs
more cycles under more load.
"""

from __future__ import annotations

import json
import random
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import httpx
import trio
from reliability_support import (
    A2A,
    CANCEL_REQUESTED,
    HTTP_TIMEOUT,
    ORPHAN_SOURCES,
    RUN_ERROR,
    SETTLED_OR_PAUSED,
    TERMINAL,
    AguiStream,
    Figures,
    Offer,
    Peer,
    ServerProcess,
    eventually,
    finished_event,
    free_port,
    get_runs,
    interrupt_outcome,
    record_problems,
    seen_problems,
    sqlite_integrity,
    started_event,
    text_events,
    user_input,
    wait_status,
)

from funduq_trio.identity import Identity
from funduq_trio.provider import Backoff, Provider, make_echo

REFUSAL = "script refuses this one, verbatim"

#: Fixture kind -> the status it must have at the kill.
FIXTURES = {
    "done": "completed",
    "refuse": "failed",
    "pause": "input-required",
    "hold-offer": "offering",
    "queued-behind": "queued",
    "cancel-queued": "cancelled",
    "hold-run": "running",
    "ignore-cancel": "cancelling",
}


class Script:
    """The `script` provider's behaviour, by the first word of the run's text."""

    def __init__(self) -> None:
        self.restarted = False

    async def on_offer(self, offer: Offer) -> None:
        kind = offer.text.split(":", 1)[0]
        if self.restarted or offer.resume or kind in ("done", "queued-behind", "cancel-queued"):
            await offer.answer("accepted")
            await offer.play(
                [
                    started_event(offer),
                    *text_events(f"m-{offer.run_id}", "ok"),
                    finished_event(offer),
                ]
            )
        elif kind == "refuse":
            await offer.answer("refused", REFUSAL)
        elif kind == "pause":
            await offer.answer("accepted")
            await offer.play(
                [started_event(offer), finished_event(offer, outcome=interrupt_outcome(offer))]
            )
        elif kind == "hold-offer":
            pass  # never answered: offering until the crash
        elif kind in ("hold-run", "ignore-cancel"):
            await offer.answer("accepted")
            await offer.play(
                [started_event(offer), *text_events(f"m-{offer.run_id}", "half")[:2]], finish=False
            )
        else:  # pragma: no cover - the test sends no other kind
            raise AssertionError(f"unexpected run text {offer.text!r}")


class Callers:
    """What callers were told: run ids, and the events each AG-UI stream showed."""

    def __init__(self) -> None:
        self.told: dict[str, str] = {}  # run id -> how the caller learned it
        self.streams: list[AguiStream] = []
        self.completed = 0
        self.refused_loudly = 0

    def tell(self, run_id: str | None, how: str) -> None:
        if run_id:
            self.told.setdefault(run_id, how)


async def background_caller(
    i: int,
    http: httpx.AsyncClient,
    echo_a2a: A2A,
    agui_url: str,
    callers: Callers,
    stop: trio.Event,
    rng: random.Random,
) -> None:
    """Alternates A2A sends (not waiting for the run) on its own thread and
    AG-UI runs on fresh threads (reading each stream to its end) until `stop`."""
    context_id = None
    n = 0
    while not stop.is_set():
        n += 1
        try:
            if rng.random() < 0.5:
                answer = await echo_a2a.send(
                    f"bg {i}.{n}", message_id=f"bg-{i}-{n}", context_id=context_id
                )
                if "error" in answer:
                    callers.refused_loudly += 1  # a full thread, refused loudly
                    context_id = None
                    continue
                task = answer["result"]["task"]
                context_id = task["contextId"]
                callers.tell(task["id"], "a2a")
            else:
                stream = AguiStream(f"bg-{i}-{n}")
                callers.streams.append(stream)
                await stream.run(
                    http,
                    agui_url,
                    user_input(
                        f"bg {i}.{n}", thread_id=f"caller-{i}-{n}", message_id=f"bg-{i}-{n}"
                    ),
                )
                callers.tell(stream.run_id, "agui")
                if (
                    stream.ended_cleanly
                    and stream.events
                    and stream.events[-1].get("type") == "RUN_FINISHED"
                ):
                    callers.completed += 1
        except (httpx.TransportError, httpx.StreamError, AssertionError):
            if stop.is_set():
                return
            raise


def snapshot_record(db: Path, into: Path) -> tuple[str, dict[str, dict[str, Any]]]:
    """Copy the SQLite files as the crash left them and read every run from the
    copy (the original stays untouched for the restart to recover)."""
    into.mkdir(parents=True, exist_ok=True)
    for suffix in ("", "-wal"):
        source = Path(str(db) + suffix)
        if source.exists():
            shutil.copyfile(source, into / (db.name + suffix))
    copy = into / db.name
    integrity = sqlite_integrity(copy)
    conn = sqlite3.connect(copy)
    try:
        runs = {}
        for rid, status, metadata, started, completed in conn.execute(
            "SELECT id, status, metadata, started_at, completed_at FROM runs"
        ):
            events = [
                {"seq": s, "event": json.loads(e)}
                for s, e in conn.execute(
                    "SELECT seq, event FROM events WHERE run_id=? ORDER BY seq", (rid,)
                )
            ]
            runs[rid] = {
                "runId": rid,
                "status": status,
                "metadata": json.loads(metadata),
                "startedAt": started,
                "completedAt": completed,
                "events": events,
            }
    finally:
        conn.close()
    return integrity, runs


async def crash_scenario(
    tmp_path: Path,
    *,
    seed: int = 1,
    cycles: int = 1,
    callers_n: int = 6,
    min_background: int = 30,
    fixtures_each: int = 2,
    fig: Figures | None = None,
) -> Figures:
    """`cycles` times: attach, put runs in every state, load, kill -9, restart
    and check; then drive everything to the end, stop, and check the file."""
    fig = fig or Figures("crash_restart")
    rng = random.Random(seed)
    data_dir = tmp_path / "data"
    db = data_dir / "funduq.sqlite3"
    port = free_port()
    settings = {"deliver_timeout_seconds": 600, "thread_queue_limit": 16}
    script = Script()
    callers = Callers()
    echo_runs: list[tuple[int, str]] = []  # (server start number, run id) the echo agent ran
    start_no = 0
    peer = Peer(
        f"ws://127.0.0.1:{port}/ws/provider",
        ["script"],
        name="script",
        on_offer=script.on_offer,
        reconnect_delay=0.05,
    )
    echo_provider = Provider(
        Identity.generate(),
        f"ws://127.0.0.1:{port}/ws/provider",
        max_concurrent_runs=4,
        backoff=Backoff(initial=0.05, maximum=0.3, jitter=0.0),
    )
    inner_echo = make_echo(deltas=4, delay=0.002)

    async def echo(run_input: Any) -> Any:
        echo_runs.append((start_no, run_input.run_id))
        async for event in inner_echo(run_input):
            yield event

    echo_provider.add_agent(echo, name="echo")
    snapshots: list[dict[str, dict[str, Any]]] = []
    orphaned: dict[str, int] = {}  # run id -> the start (restart number) that orphaned it
    fixtures: dict[str, str] = {}  # run id -> fixture kind, every cycle
    offers_at_start: list[int] = []

    async with (
        trio.open_nursery() as outer,
        httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=HTTP_TIMEOUT) as http,
    ):
        script_a2a = A2A(http, f"/a2a/{peer.fingerprint}/script")
        echo_a2a = A2A(http, f"/a2a/{echo_provider.identity.fingerprint}/echo")
        agui_url = f"/agui/{echo_provider.identity.fingerprint}/echo"

        async def both_online() -> bool:
            roster = (await http.get("/agents")).json()["agents"]
            return {"script", "echo"} <= {a["name"] for a in roster if a["online"]}

        for cycle in range(cycles + 1):
            server = ServerProcess(data_dir, port, tmp_path / f"server-{cycle}.log", **settings)
            offers_at_start.append(len(peer.offer_log))
            start_no = cycle
            async with trio.open_nursery() as nursery:
                await server.start(nursery)
                if cycle == 0:
                    await outer.start(peer.serve)
                    await outer.start(echo_provider.run)
                await eventually(both_online, "both providers attached")
                if snapshots:
                    await check_after_restart(http, snapshots[-1], fig, orphaned, cycle)
                if cycle == cycles:
                    # -- the last start: drive the whole record to the end, then stop
                    ids = set(callers.told) | set().union(*(s.keys() for s in snapshots))
                    await drive_to_the_end(http, script, script_a2a, fixtures, ids, fig)
                    final = await get_runs(http, ids)
                    again = await get_runs(http, ids)
                    returncode = await server.stop()
                    fig.expect(returncode == 0, f"orderly stop exited {returncode}")
                    break

                # -- every state a crash can find a run in, on the script provider
                made = await make_fixtures(http, peer, script_a2a, fixtures_each, cycle)
                fixtures.update(made)

                # -- load on the echo provider, until the kill
                stop = trio.Event()
                async with trio.open_nursery() as load:
                    for i in range(callers_n):
                        load.start_soon(
                            background_caller,
                            cycle * 100 + i,
                            http,
                            echo_a2a,
                            agui_url,
                            callers,
                            stop,
                            random.Random(rng.getrandbits(32)),
                        )
                    goal = callers.completed + min_background

                    async def loaded(goal: int = goal) -> bool:
                        return callers.completed >= goal

                    await eventually(loaded, f"{min_background} background runs completed")
                    server.kill9()
                    fig.fault("kill_9")
                    stop.set()
                await server.wait_dead()

            integrity, snap = snapshot_record(db, tmp_path / f"snapshot-{cycle}")
            fig.expect(
                integrity == "ok",
                f"cycle {cycle}: the file as the kill left it fails integrity_check: {integrity}",
            )
            snapshots.append(snap)
            check_at_kill(snap, callers, made, fig, cycle)

        outer.cancel_scope.cancel()

    for rid, how in callers.told.items():
        if final.get(rid) is None:
            fig.lost(rid, f"told to a caller ({how}) but not in the final record")
    for rid, run in final.items():
        if run is None:
            if rid not in callers.told:
                fig.lost(rid, "in the record at a kill but not in the final record")
            continue
        fig.expect(
            run["status"] in TERMINAL, f"{rid}: left {run['status']} after being driven to the end"
        )
        fig.violations.extend(record_problems(run))
        if again.get(rid) != run:
            fig.violate(f"{rid}: the record changed between two reads of a settled run")
    for stream in callers.streams:
        if stream.run_id:
            fig.violations.extend(
                seen_problems(stream.run_id, stream.events, final.get(stream.run_id))
            )
    # Nothing orphaned is offered (or run) again, by either provider.
    for cycle, first in enumerate(offers_at_start[1:], start=1):
        gone = {rid for rid, at in orphaned.items() if at <= cycle}
        again_offered = sorted({o.run_id for o in peer.offer_log[first:]} & gone)
        fig.expect(
            not again_offered, f"orphaned runs offered again after restart {cycle}: {again_offered}"
        )
    rerun = sorted(rid for n, rid in echo_runs if rid in orphaned and n >= orphaned[rid])
    fig.expect(not rerun, f"orphaned runs run again by the echo provider: {rerun}")
    integrity = sqlite_integrity(db)
    fig.expect(
        integrity == "ok", f"the file after an orderly stop fails integrity_check: {integrity}"
    )
    fig.runs_driven = len(final)
    fig.fault("orphaned_by_restart", len(orphaned))
    fig.extra.update(
        told=len(callers.told),
        agui_streams=len(callers.streams),
        loud_refusals=callers.refused_loudly,
        final=_status_counts(final),
    )
    return fig


async def make_fixtures(
    http: httpx.AsyncClient, peer: Peer, a2a: A2A, each: int, cycle: int
) -> dict[str, str]:
    """`each` runs in every state of FIXTURES, checked through GET /runs."""
    made: dict[str, str] = {}

    async def send(kind: str, n: int, context_id: str | None = None) -> dict[str, Any]:
        answer = await a2a.send(
            f"{kind}: {cycle}.{n}", message_id=f"{kind}-{cycle}-{n}", context_id=context_id
        )
        assert "result" in answer, answer
        task = answer["result"]["task"]
        made[task["id"]] = kind
        return task

    for n in range(each):
        for kind in ("done", "refuse", "pause", "hold-run", "ignore-cancel"):
            await send(kind, n)
        head = await send("hold-offer", n)
        await peer.wait_offer(lambda o, rid=head["id"]: o.run_id == rid)
        await send("queued-behind", n, head["contextId"])
        doomed = await send("cancel-queued", n, head["contextId"])
        cancelled = await a2a.cancel(doomed["id"])
        assert cancelled["result"]["status"]["state"] == "TASK_STATE_CANCELED", cancelled
    for rid, kind in made.items():
        if kind == "ignore-cancel":
            await wait_status(http, rid, ["running"])
            answer = await a2a.cancel(rid)
            assert answer["result"]["status"]["state"] == "TASK_STATE_WORKING", answer
            assert answer["result"]["metadata"][CANCEL_REQUESTED] is True, answer
            await peer.wait_cancel(rid)
    for rid, kind in made.items():
        await wait_status(http, rid, [FIXTURES[kind]])
    return made


def check_at_kill(
    snap: dict[str, dict[str, Any]],
    callers: Callers,
    made: dict[str, str],
    fig: Figures,
    cycle: int,
) -> None:
    """The record as the kill left it holds everything callers were told."""
    for rid, how in callers.told.items():
        if rid not in snap:
            fig.lost(rid, f"cycle {cycle}: told to a caller ({how}), missing at the kill")
    for stream in callers.streams:
        if stream.run_id:
            fig.violations.extend(
                f"at kill {cycle}: {p}"
                for p in seen_problems(stream.run_id, stream.events, snap.get(stream.run_id))
            )
    for rid, kind in made.items():
        run = snap.get(rid)
        if run is None:
            fig.lost(rid, f"fixture {kind} missing at kill {cycle}")
        else:
            fig.expect(
                run["status"] == FIXTURES[kind],
                f"{rid}: fixture {kind} was {run['status']} at kill {cycle}",
            )
    fig.extra[f"at_kill_{cycle}"] = _status_counts(snap)


def _status_counts(runs: dict[str, Any]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for run in runs.values():
        if run is not None:
            counts[run["status"]] = counts.get(run["status"], 0) + 1
    return dict(sorted(counts.items()))


async def check_after_restart(
    http: httpx.AsyncClient,
    snap: dict[str, dict[str, Any]],
    fig: Figures,
    orphaned: dict[str, int],
    restart: int,
) -> None:
    """Right after a restart: orphans failed with their events kept plus one
    RUN_ERROR; settled and paused runs exactly as they were."""
    now = await get_runs(http, snap)
    for rid, before in snap.items():
        after = now.get(rid)
        if after is None:
            fig.lost(rid, "in the record at the kill, gone after the restart")
            continue
        was = before["status"]
        if was in ORPHAN_SOURCES:
            orphaned[rid] = restart
            meta = after["metadata"]
            fig.expect(
                after["status"] == "failed" and meta.get("failureReason") == "orphaned_by_restart",
                f"{rid}: was {was} at the kill, after the restart {after['status']} "
                f"{meta.get('failureReason')!r}",
            )
            kept = after["events"][: len(before["events"])]
            fig.expect(kept == before["events"], f"{rid}: an orphan's events changed")
            added = after["events"][len(before["events"]) :]
            fig.expect(
                len(added) == 1
                and added[0]["event"].get("type") == RUN_ERROR
                and added[0]["event"].get("code") == "orphaned_by_restart",
                f"{rid}: an orphan must end on one RUN_ERROR orphaned_by_restart, got {added}",
            )
            fig.extra["orphans_checked"] = fig.extra.get("orphans_checked", 0) + 1
        elif was in SETTLED_OR_PAUSED:
            keys = ("status", "metadata", "events")
            fig.expect(
                {k: after[k] for k in keys} == {k: before[k] for k in keys},
                f"{rid}: was {was} at the kill and changed across the restart: "
                f"{was}/{len(before['events'])} events -> "
                f"{after['status']}/{len(after['events'])} events",
            )
        else:
            assert was == "queued", (rid, was)
            fig.fault("queued_across_restart")
            fig.expect(
                after["status"] != "failed"
                or after["metadata"].get("failureReason") != "orphaned_by_restart",
                f"{rid}: a queued run was orphaned",
            )
            fig.expect(
                after["events"][: len(before["events"])] == before["events"],
                f"{rid}: a queued run's events changed",
            )


async def drive_to_the_end(
    http: httpx.AsyncClient,
    script: Script,
    a2a: A2A,
    fixtures: dict[str, str],
    ids: set[str],
    fig: Figures,
) -> None:
    """Providers are back: queued runs run, and paused runs answered after the
    restart continue under the same id and complete."""
    script.restarted = True
    runs = await get_runs(http, fixtures)
    for rid, run in runs.items():
        if run is not None and run["status"] == "input-required":
            answer = await a2a.send("yes", message_id=f"answer-{rid}", task_id=rid)
            fig.expect(
                "result" in answer and answer["result"]["task"]["id"] == rid,
                f"{rid}: answering the pause after the restart: {answer}",
            )
            fig.fault("pause_answered_after_restart")
    for rid in ids:
        await wait_status(http, rid, TERMINAL)


async def test_kill_9_mid_load_then_restart_on_the_same_data(tmp_path: Path) -> None:
    fig = await crash_scenario(tmp_path, seed=20240501, cycles=1)
    fig.check()
    # hold-offer, hold-run and ignore-cancel, twice each, plus echo runs in flight.
    assert fig.extra["orphans_checked"] >= 6, fig.line()
