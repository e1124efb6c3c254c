"""Random cancels at every status, under load, against the real server.

Many threads run at once, each a seeded sequence of steps. A step brings a
run to one status -- queued, offering, running, cancelling, input-required or
terminal -- through the real provider link (a hand-played provider answers
and reports exactly when the step says), cancels it over A2A (`CancelTask`),
and checks what the caller and the provider then observe against the seed's
rules (docs: runs-and-cancels-are-requests):

* queued -> cancelled at once: the answer is CANCELED, the run is never
  offered, its record holds no events;
* offering -> the cancel waits behind the answer: the answer is SUBMITTED with
  the `funduq/cancelRequested` marker and the run stays `offering`; then
  accepted -> the provider gets a `cancel` frame and the funnel decides
  (complied: cancelled; finished anyway: completed); declined -> cancelled
  here, never handed over, no cancel frame; refused -> failed with the
  refusal's reason (the refusal is the provider's answer, read first);
* running -> `cancelling` (WORKING + marker), a `cancel` frame, then the
  funnel: complied -> cancelled, RUN_FINISHED anyway -> completed, an
  interrupt -> input-required, a RUN_ERROR and no finish -> cancelled;
* cancelling -> asked again: still WORKING + marker, still cancelling;
* input-required and terminal -> refused with TaskNotCancelableError
  (-32002), the record untouched.

Meanwhile the SDK's echo provider serves a background load of AG-UI runs.
A second test cancels runs whose offers are never answered (short delivery
timeout): they end cancelled, and the provider's late acceptance and events
are ignored -- never "recorded cancelled and handed over".
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import stores
import trio
from reliability_support import (
    A2A,
    CANCEL_REQUESTED,
    HTTP_TIMEOUT,
    RUN_ERROR,
    TASK_NOT_CANCELABLE,
    TERMINAL,
    AguiStream,
    Figures,
    Offer,
    Peer,
    eventually,
    finished_event,
    get_run,
    get_runs,
    interrupt_outcome,
    record_problems,
    seen_problems,
    started_event,
    text_events,
    user_input,
    wait_status,
)
from support import running_server, sdk_provider

from funduq_trio.provider import make_echo

TARGETS = ("queued", "offering", "running", "cancelling", "input-required", "terminal")


@dataclass
class Expect:
    """What one run must end as, and whether its provider must (True), must
    not (False) or may (None) have received a `cancel` frame for it."""

    statuses: frozenset[str]
    cancel_frame: bool | None
    reason: str | None = None
    offers: int | None = None  # how many offers it may get (None: any)
    target: str = ""


@dataclass
class Thread:
    t: int
    rng: random.Random
    a2a: A2A
    http: httpx.AsyncClient
    peer: Peer
    fig: Figures
    expect: dict[str, Expect]
    context_id: str | None = None
    n: int = 0
    mids: dict[str, str] = field(default_factory=dict)  # run id -> message id

    async def send(self, label: str, *, task_id: str | None = None) -> dict[str, Any]:
        self.n += 1
        mid = f"c{self.t}-{self.n}-{label}"
        answer = await self.a2a.send(
            f"{label} {self.t}.{self.n}",
            message_id=mid,
            context_id=self.context_id,
            task_id=task_id,
        )
        assert "result" in answer, answer
        task = answer["result"]["task"]
        self.context_id = task["contextId"]
        self.mids[task["id"]] = mid
        return task

    async def offer(self, run_id: str) -> Offer:
        return await self.peer.wait_offer(lambda o: o.run_id == run_id)

    async def cancel(self, run_id: str) -> dict[str, Any]:
        self.fig.fault("cancel")
        return await self.a2a.cancel(run_id)

    def check_answer(
        self,
        run_id: str,
        answer: dict[str, Any],
        *,
        state: str | None = None,
        marker: bool | None = None,
        error: int | None = None,
    ) -> None:
        if error is not None:
            code = (answer.get("error") or {}).get("code")
            self.fig.expect(
                code == error, f"{run_id}: cancel should be refused ({error}), got {answer}"
            )
            return
        task = answer.get("result")
        if task is None:
            self.fig.violate(f"{run_id}: cancel refused unexpectedly: {answer}")
            return
        got = task["status"]["state"]
        self.fig.expect(got == state, f"{run_id}: cancel answered {got}, expected {state}")
        if marker is not None:
            has = (task.get("metadata") or {}).get(CANCEL_REQUESTED) is True
            self.fig.expect(
                has == marker, f"{run_id}: cancel answer marker {has}, expected {marker}: {task}"
            )

    async def status_is(self, run_id: str, status: str) -> dict[str, Any] | None:
        run = await get_run(self.http, run_id)
        self.fig.expect(
            run is not None and run["status"] == status,
            f"{run_id}: record says {run and run['status']}, expected {status}",
        )
        return run


async def complete(offer: Offer) -> None:
    await offer.answer("accepted")
    await offer.play(
        [started_event(offer), *text_events(f"m-{offer.run_id}", "done"), finished_event(offer)]
    )


async def held_ending(th: Thread, offer: Offer, label: str) -> Expect:
    """A held run whose cancel reached its provider: the provider ends it one
    of four ways, and the funnel decides."""
    how = th.rng.choice(["comply", "ignore", "pause", "error"])
    th.fig.fault(f"provider_{how}")
    if how == "comply":
        await offer.finish()
        return Expect(frozenset({"cancelled"}), True, target=label)
    if how == "ignore":
        await offer.play([*text_events(f"m-{offer.run_id}", "anyway"), finished_event(offer)])
        return Expect(frozenset({"completed"}), True, target=label)
    if how == "pause":
        await offer.play([finished_event(offer, outcome=interrupt_outcome(offer))])
        return Expect(frozenset({"input-required"}), True, target=label)
    await offer.play([{"type": RUN_ERROR, "message": "stopped with an error", "code": "x"}])
    return Expect(frozenset({"cancelled"}), True, target=label)


async def to_running(th: Thread) -> tuple[str, Offer]:
    task = await th.send("run")
    offer = await th.offer(task["id"])
    await offer.answer("accepted")
    await offer.report(started_event(offer))
    await wait_status(th.http, task["id"], ["running"])
    return task["id"], offer


async def step_queued(th: Thread) -> None:
    blocker = await th.send("blocker")
    blocker_offer = await th.offer(blocker["id"])  # the thread's head, offering
    task = await th.send("queued")
    rid = task["id"]
    th.check_answer(rid, await th.cancel(rid), state="TASK_STATE_CANCELED")
    run = await th.status_is(rid, "cancelled")
    th.fig.expect(
        run is None or (not run["events"] and run["startedAt"] is None),
        f"{rid}: cancelled while queued, yet started or has events",
    )
    th.expect[rid] = Expect(frozenset({"cancelled"}), False, offers=0, target="queued")
    await complete(blocker_offer)
    th.expect[blocker["id"]] = Expect(frozenset({"completed"}), False, target="blocker")


async def step_offering(th: Thread) -> None:
    task = await th.send("offering")
    rid = task["id"]
    offer = await th.offer(rid)
    th.check_answer(rid, await th.cancel(rid), state="TASK_STATE_SUBMITTED", marker=True)
    await th.status_is(rid, "offering")  # the cancel waits behind the answer
    verdict = th.rng.choice(["accepted", "declined", "refused"])
    th.fig.fault(f"answer_{verdict}_after_cancel")
    if verdict == "declined":
        await offer.answer("declined")
        th.expect[rid] = Expect(frozenset({"cancelled"}), False, offers=1, target="offering")
    elif verdict == "refused":
        reason = f"refused {rid} after a cancel"
        await offer.answer("refused", reason)
        th.expect[rid] = Expect(
            frozenset({"failed"}), False, reason=reason, offers=1, target="offering"
        )
    else:
        await offer.answer("accepted")
        await offer.report(started_event(offer))
        await th.peer.wait_cancel(rid)  # accepted: then asked to stop like any running run
        th.expect[rid] = await held_ending(th, offer, "offering")
        th.expect[rid].offers = 1
    await wait_status(th.http, rid, th.expect[rid].statuses)


async def step_running(th: Thread) -> None:
    rid, offer = await to_running(th)
    th.check_answer(rid, await th.cancel(rid), state="TASK_STATE_WORKING", marker=True)
    await th.status_is(rid, "cancelling")
    await th.peer.wait_cancel(rid)
    th.expect[rid] = await held_ending(th, offer, "running")
    await wait_status(th.http, rid, th.expect[rid].statuses)


async def step_cancelling(th: Thread) -> None:
    rid, offer = await to_running(th)
    th.check_answer(rid, await th.cancel(rid), state="TASK_STATE_WORKING", marker=True)
    await th.peer.wait_cancel(rid)
    await th.status_is(rid, "cancelling")
    th.check_answer(rid, await th.cancel(rid), state="TASK_STATE_WORKING", marker=True)
    await th.status_is(rid, "cancelling")
    th.expect[rid] = await held_ending(th, offer, "cancelling")
    await wait_status(th.http, rid, th.expect[rid].statuses)


async def step_input_required(th: Thread) -> None:
    task = await th.send("pause")
    rid = task["id"]
    offer = await th.offer(rid)
    await offer.answer("accepted")
    await offer.play(
        [started_event(offer), finished_event(offer, outcome=interrupt_outcome(offer))]
    )
    before = await wait_status(th.http, rid, ["input-required"])
    th.check_answer(rid, await th.cancel(rid), error=TASK_NOT_CANCELABLE)
    after = await get_run(th.http, rid)
    th.fig.expect(after == before, f"{rid}: a refused cancel changed a paused run")
    if th.rng.random() < 0.5:
        th.expect[rid] = Expect(frozenset({"input-required"}), False, target="input-required")
        return
    # Answer the pause: the same run is offered again and completes; a cancel
    # after that is refused as for any ended run.
    th.fig.fault("pause_answered")
    count = len(th.peer.offers_of(rid))
    await th.send("answer", task_id=rid)
    again = await th.peer.wait_offer(
        lambda o: o.run_id == rid and o.resume is not None and len(th.peer.offers_of(rid)) > count
    )
    await complete(again)
    done = await wait_status(th.http, rid, ["completed"])
    th.check_answer(rid, await th.cancel(rid), error=TASK_NOT_CANCELABLE)
    th.fig.expect(await get_run(th.http, rid) == done, f"{rid}: refused cancel changed it")
    th.expect[rid] = Expect(frozenset({"completed"}), False, target="input-required")


async def step_terminal(th: Thread) -> None:
    how = th.rng.choice(["completed", "failed", "cancelled"])
    task = await th.send(f"ends-{how}")
    rid = task["id"]
    offer = await th.offer(rid)
    if how == "completed":
        await complete(offer)
    elif how == "failed":
        await offer.answer("refused", "never this one")
    else:
        await th.cancel(rid)  # while offering ...
        await offer.answer("declined")  # ... declined: it ends here
    before = await wait_status(th.http, rid, [how])
    th.check_answer(rid, await th.cancel(rid), error=TASK_NOT_CANCELABLE)
    th.fig.expect(await get_run(th.http, rid) == before, f"{rid}: refused cancel changed it")
    th.expect[rid] = Expect(
        frozenset({how}),
        False,
        target="terminal",
        reason="never this one" if how == "failed" else None,
    )


STEPS = {
    "queued": step_queued,
    "offering": step_offering,
    "running": step_running,
    "cancelling": step_cancelling,
    "input-required": step_input_required,
    "terminal": step_terminal,
}


async def background_load(
    http: httpx.AsyncClient, url: str, stop: trio.Event, streams: list[AguiStream]
) -> None:
    n = 0
    while not stop.is_set():
        n += 1
        stream = AguiStream(f"bg-{n}")
        streams.append(stream)
        await stream.run(
            http, url, user_input(f"background {n}", thread_id=f"bg-{n}", message_id=f"bg-{n}")
        )


async def cancels_scenario(
    tmp_path: Path, *, seed: int = 11, threads: int = 12, steps: int = 6, fig: Figures | None = None
) -> Figures:
    fig = fig or Figures("random_cancels")
    rng = random.Random(seed)
    expect: dict[str, Expect] = {}
    targets: dict[str, int] = {}
    background: list[AguiStream] = []
    async with (
        running_server(tmp_path, thread_queue_limit=64, quality_allowance=1_000_000) as info,
        httpx.AsyncClient(base_url=info.url, timeout=HTTP_TIMEOUT) as http,
        sdk_provider(info, {"echo": make_echo(deltas=3, delay=0.001)}) as echo,
    ):
        peer = Peer(info.provider_url, ["ctl"], name="ctl")
        async with trio.open_nursery() as nursery:
            await nursery.start(peer.serve)
            a2a = A2A(http, f"/a2a/{peer.fingerprint}/ctl")
            stop = trio.Event()
            for _ in range(4):
                nursery.start_soon(
                    background_load,
                    http,
                    f"/agui/{echo.identity.fingerprint}/echo",
                    stop,
                    background,
                )

            async def thread(t: int) -> None:
                th = Thread(t, random.Random(rng.getrandbits(32)), a2a, http, peer, fig, expect)
                for _ in range(steps):
                    target = th.rng.choice(TARGETS)
                    targets[target] = targets.get(target, 0) + 1
                    await STEPS[target](th)

            async with trio.open_nursery() as scripted:
                for t in range(threads):
                    scripted.start_soon(thread, t)
            stop.set()
            while not all(s.done.is_set() for s in background):
                await trio.sleep(0.01)
            final = await get_runs(http, expect)
            bg_final = await get_runs(http, [s.run_id for s in background if s.run_id])
            nursery.cancel_scope.cancel()

    for rid, want in expect.items():
        run = final.get(rid)
        if run is None:
            fig.lost(rid, f"{want.target} run not in the record")
            continue
        fig.violations.extend(record_problems(run))
        fig.expect(
            run["status"] in want.statuses,
            f"{rid} ({want.target}): ended {run['status']}, rules say {sorted(want.statuses)}",
        )
        got_cancel = peer.cancelled(rid)
        if want.cancel_frame is not None:
            fig.expect(
                got_cancel == want.cancel_frame,
                f"{rid} ({want.target}): provider cancel frame {got_cancel}, rules say "
                f"{want.cancel_frame}",
            )
        if want.reason is not None:
            fig.expect(
                run["metadata"].get("failureReason") == want.reason,
                f"{rid}: failureReason {run['metadata'].get('failureReason')!r}, "
                f"the refusal said {want.reason!r}",
            )
        if want.offers is not None:
            n = len(peer.offers_of(rid))
            fig.expect(
                n == want.offers,
                f"{rid} ({want.target}): offered {n} times, expected {want.offers}",
            )
        if run["status"] == "cancelled" and (run["startedAt"] or run["events"]):
            fig.expect(
                got_cancel,
                f"{rid}: recorded cancelled after being handed over "
                f"without its cancel reaching the provider",
            )
    for stream in background:
        fig.expect(
            stream.ended_cleanly
            and bool(stream.events)
            and stream.events[-1].get("type") == "RUN_FINISHED",
            f"background run {stream.label} did not finish: {stream.cut!r}",
        )
        if stream.run_id:
            fig.violations.extend(
                seen_problems(
                    stream.run_id, stream.events, bg_final.get(stream.run_id), complete=True
                )
            )
    fig.runs_driven = len(expect) + len(background)
    fig.extra.update(
        targets=dict(sorted(targets.items())),
        background=len(background),
        final=_counts(r["status"] for r in final.values() if r),
    )
    return fig


def _counts(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


async def test_random_cancels_at_every_status_follow_the_rules(tmp_path: Path) -> None:
    fig = await cancels_scenario(tmp_path, seed=11, threads=12, steps=6)
    fig.check()
    assert all(fig.extra["targets"].get(t, 0) > 0 for t in TARGETS), fig.line()


async def test_cancel_of_an_offer_never_answered_ends_it_and_a_late_accept_is_asked_to_stop(
    tmp_path: Path,
) -> None:
    """The original bug: a cancel during an offer took the "nobody has it" path,
    was recorded cancelled, and the run was handed over anyway. Here the
    provider never answers in time; it accepts late and reports events for the
    run, which funduq must ignore -- and it asks the provider to stop."""
    fig = Figures("cancel_unanswered_offer")
    runs = 16
    async with (
        running_server(
            tmp_path,
            deliver_timeout_seconds=0.3,
            quality_allowance=1_000_000,
            thread_queue_limit=64,
        ) as info,
        httpx.AsyncClient(base_url=info.url, timeout=HTTP_TIMEOUT) as http,
    ):
        peer = Peer(info.provider_url, ["mute"], name="mute")
        async with trio.open_nursery() as nursery:
            await nursery.start(peer.serve)
            a2a = A2A(http, f"/a2a/{peer.fingerprint}/mute")

            async def one(i: int) -> str:
                answer = await a2a.send(f"nobody answers {i}", message_id=f"m-{i}")
                rid = answer["result"]["task"]["id"]
                offer = await peer.wait_offer(lambda o: o.run_id == rid)
                cancelled = await a2a.cancel(rid)
                fig.fault("cancel_while_offering")
                state = cancelled["result"]["status"]["state"]
                # Offering (the timeout has not fired yet), or queued again after it.
                fig.expect(
                    state in ("TASK_STATE_SUBMITTED", "TASK_STATE_CANCELED"),
                    f"{rid}: cancel answered {state}",
                )
                await wait_status(http, rid, ["cancelled"])
                # The provider finally answers, and plays the run as if it held it.
                await offer.answer("accepted")
                await offer.play(
                    [started_event(offer), *text_events("late", "too late"), finished_event(offer)]
                )
                fig.fault("late_accept")
                return rid

            ids: list[str] = []

            async def collect(i: int) -> None:
                ids.append(await one(i))

            async with trio.open_nursery() as group:
                for i in range(runs):
                    group.start_soon(collect, i)
            # The late frames were sent; a probe after them proves funduq read them.
            assert await peer.re_register()
            final = await get_runs(http, ids)
            nursery.cancel_scope.cancel()
    for rid, run in final.items():
        if run is None:
            fig.lost(rid, "not in the record")
            continue
        fig.violations.extend(record_problems(run))
        fig.expect(run["status"] == "cancelled", f"{rid}: ended {run['status']}")
        fig.expect(
            run["startedAt"] is None and not run["events"],
            f"{rid}: recorded cancelled and handed over (startedAt "
            f"{run['startedAt']}, events {[e['event']['type'] for e in run['events']]})",
        )
        # Its late acceptance is answered with a cancel: funduq asks it to stop
        # working for nobody (it never holds the run).
        fig.expect(peer.cancelled(rid), f"{rid}: a late acceptance was not asked to stop")
    fig.runs_driven = len(final)
    fig.check()
    assert len(final) == runs


async def test_a_cancel_read_after_the_provider_finished_is_not_answered_as_accepted(
    tmp_path: Path,
) -> None:
    """The race between a caller's cancel and the provider's `finish`, pinned
    down. The test holds SQLite's write lock (well inside the server's busy
    timeout; PostgreSQL's table locks on that store), so the run's lane is parked writing the provider's last reports
    while the `finish` waits in its inbox -- a probe on the link proves funduq
    has read it -- and the record still says `running`. The caller's cancel
    arrives behind the finish, the lock is released, and the run ends
    `completed` without its lane ever reading the cancel.

    The caller must not then be told its cancel was accepted: the answer is
    TaskNotCancelableError (the run ended), or -- should funduq read the
    cancel first -- the pending-cancel marker with a cancel frame relayed.
    (Seen in the provider-fault load as an accepted CancelTask answered with a
    COMPLETED or FAILED task.)"""
    fig = Figures("cancel_after_finish")
    async with (
        running_server(tmp_path) as info,
        httpx.AsyncClient(base_url=info.url, timeout=HTTP_TIMEOUT) as http,
        trio.open_nursery() as nursery,
    ):
        peer = Peer(info.provider_url, ["late"], name="late")
        await nursery.start(peer.serve)
        a2a = A2A(http, f"/a2a/{peer.fingerprint}/late")
        for attempt in range(3):
            task = (await a2a.send(f"late {attempt}", message_id=f"l-{attempt}"))["result"]["task"]
            rid = task["id"]
            offer = await peer.wait_offer(lambda o, rid=rid: o.run_id == rid)
            await offer.answer("accepted")
            await offer.report(started_event(offer))

            async def started(rid: str = rid) -> bool:
                run = await get_run(http, rid)
                return run is not None and run["status"] == "running" and len(run["events"]) == 1

            await eventually(started, f"{rid} running with its first event")
            answers: list[dict[str, Any]] = []
            with stores.writes_held(tmp_path):  # funduq's writer now waits
                await offer.play([*text_events(f"m-{rid}", "done"), finished_event(offer)])
                probe = await offer.link.request(
                    {"kind": "query.threadMessages", "threadId": "thread_none", "limit": 0}
                )
                assert probe is not None and probe["kind"] == "err", probe
                before = await get_run(http, rid)
                assert before is not None and before["status"] == "running", before

                async def cancel(rid: str = rid, answers: list = answers) -> None:
                    answers.append(await a2a.cancel(rid))

                nursery.start_soon(cancel)
                # Give the cancel time to reach the run (it then waits on the
                # parked lane); the lock is held far inside the busy timeout.
                await trio.sleep(0.5)
                fig.expect(
                    not answers,
                    f"{rid}: the cancel was answered while the run's lane was parked: {answers}",
                )
            run = await wait_status(http, rid, TERMINAL)

            async def answered(answers: list = answers) -> bool:
                return bool(answers)

            await eventually(answered, f"{rid}: the cancel's answer")
            answer = answers[0]
            fig.fault("cancel_behind_finish")
            fig.expect(run["status"] == "completed", f"{rid}: ended {run['status']}")
            if "error" in answer:
                fig.expect(
                    answer["error"]["code"] == TASK_NOT_CANCELABLE,
                    f"{rid}: unexpected error {answer['error']}",
                )
            else:
                state = answer["result"]["status"]["state"]
                marked = (answer["result"].get("metadata") or {}).get(CANCEL_REQUESTED) is True
                fig.expect(
                    marked and peer.cancelled(rid),
                    f"{rid}: the cancel was answered as accepted ({state}, marker "
                    f"{marked}) but never reached the provider (cancel frame: "
                    f"{peer.cancelled(rid)}); the run ended {run['status']}",
                )
        nursery.cancel_scope.cancel()
    fig.runs_driven = 3
    fig.check()
