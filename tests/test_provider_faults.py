"""Provider faults under load, against the real server: several providers
serving the same agent name, 200 runs over 20 threads from A2A and AG-UI
callers, while the providers misbehave in every way the link allows:

* dropping the link mid-run (and reconnecting under the same key),
* declining ("full right now") and refusing (permanently, with a reason),
* never answering an offer (the delivery timeout, short here, puts it back),
* answering an offer twice (accepted twice, or declined then accepted),
* complying with a cancel, or ignoring it and finishing anyway,

and callers cancel some runs at random moments. One provider is the SDK's own
runtime (echo agent). Every provider decision is a function of the seed and
the offer, so a failure replays.

Afterwards every run is driven to the end (providers behave, re-publish to
wake declined heads) and the suite checks only what callers and providers can
observe:

* no run is lost: each thread holds exactly the runs its caller was told of,
  in the order it sent them;
* every run is in exactly one terminal status, its record consistent
  (`record_problems`), and it stays there;
* per thread, offers reach providers in arrival order: once a run of a thread
  has been offered, no earlier run of that thread is offered again;
* never "recorded cancelled and handed over": a run recorded `cancelled` that
  a provider got to hold (funduq recorded it started, or kept events of it)
  had its cancel relayed, as a `cancel` frame, to the provider that accepted
  it; a run cancelled before that holds no events;
* a refusal's reason is recorded verbatim; `provider_left_holding_it` only for
  runs whose link really went away; no run fails for a reason no provider
  gave cause to;
* every event an AG-UI caller saw is the record's, at its seq.

`faults_scenario` is shared with `tests/soak/soak_provider_faults.py`.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import trio
from reliability_support import (
    A2A,
    CANCEL_REQUESTED,
    FUNDUQ_REASONS,
    HTTP_TIMEOUT,
    TASK_NOT_CANCELABLE,
    TERMINAL,
    AguiStream,
    Figures,
    Offer,
    Peer,
    eventually,
    finished_event,
    get_runs,
    record_problems,
    seen_problems,
    started_event,
    user_input,
    wait_status,
)
from support import raw_provider, running_server

from funduq_trio.identity import Identity
from funduq_trio.provider import Backoff, Provider, make_echo


@dataclass(frozen=True)
class Faults:
    """Chances, per offer, of each misbehaviour (the rest is a plain accept)."""

    mute: float = 0.0
    refuse: float = 0.0
    decline: float = 0.0
    twice: float = 0.0
    drop: float = 0.0
    ignore_cancel: float = 0.5


def thread_and_index(message_id: str | None) -> tuple[int, int]:
    """Our message ids are `t{thread}-r{index}` (index = the caller's send order)."""
    assert message_id and message_id.startswith("t"), message_id
    thread, index = message_id[1:].split("-r")
    return int(thread), int(index.split("-")[0])


class FaultyProvider:
    """A hand-played provider that misbehaves by the seed (see `Faults`)."""

    def __init__(self, name: str, url: str, faults: Faults, seed: int, fig: Figures) -> None:
        self.name = name
        self.faults = faults
        self.seed = seed
        self.fig = fig
        self.behave = False  # the end phase: no more faults
        self.peer = Peer(url, ["work"], name=name, on_offer=self.on_offer, reconnect_delay=0.02)
        self.refusals: dict[str, str] = {}
        self.active: dict[int, set[str]] = {}  # link number -> runs it is playing
        #: run id -> the offer whose play is current. A run offered again while
        #: being played means funduq never took the earlier answer (it came after
        #: the delivery timeout): that play is for nobody, and stops before
        #: sending anything more -- a provider runs one play per run id.
        self.current: dict[str, Offer] = {}
        self._seen: dict[str, int] = {}

    def rng(self, offer: Offer) -> random.Random:
        n = self._seen[offer.run_id] = self._seen.get(offer.run_id, 0) + 1
        return random.Random(f"{self.seed}:{self.name}:{offer.message_id}:{n}")

    def choose(self, rng: random.Random) -> str:
        f = self.faults
        roll = rng.random()
        for kind, chance in (
            ("mute", f.mute),
            ("refuse", f.refuse),
            ("decline", f.decline),
            ("twice", f.twice),
            ("drop", f.drop),
        ):
            if roll < chance:
                return kind
            roll -= chance
        return "accept"

    async def on_offer(self, offer: Offer) -> None:
        prev = self.current.get(offer.run_id)
        if prev is not None and offer.run_id in self.active.get(prev.link.number, ()):
            self.fig.fault("late_accept_superseded")
        self.current[offer.run_id] = offer
        rng = self.rng(offer)
        kind = "accept" if self.behave else self.choose(rng)
        if kind == "decline" and not self.active.get(offer.link.number):
            kind = "accept"  # "full right now" only while it holds something
        if kind == "mute":
            self.fig.fault("never_answered")
        elif kind == "refuse":
            reason = f"{self.name} will never take {offer.message_id} (#{self._seen[offer.run_id]})"
            self.refusals[offer.run_id] = reason
            self.fig.fault("refused")
            await offer.answer("refused", reason)
        elif kind == "decline":
            self.fig.fault("declined")
            await offer.answer("declined")
        elif kind == "twice":
            self.fig.fault("answered_twice")
            first = rng.choice(["accepted", "declined"])
            offer.link.mark_risky()  # a second answer may close the link
            await offer.answer(first)
            await offer.answer("accepted")
            if first == "accepted":
                await self.play(offer, rng, drop=False)
        else:
            await offer.answer("accepted")
            await self.play(offer, rng, drop=kind == "drop")

    async def play(self, offer: Offer, rng: random.Random, *, drop: bool) -> None:
        link = offer.link
        active = self.active.setdefault(link.number, set())
        active.add(offer.run_id)
        try:
            ignore_cancel = rng.random() < self.faults.ignore_cancel
            events = [
                started_event(offer),
                {
                    "type": "TEXT_MESSAGE_START",
                    "messageId": f"m-{offer.run_id}",
                    "role": "assistant",
                },
            ]
            events += [
                {"type": "TEXT_MESSAGE_CONTENT", "messageId": f"m-{offer.run_id}", "delta": f"{i} "}
                for i in range(rng.randint(1, 6))
            ]
            events += [
                {"type": "TEXT_MESSAGE_END", "messageId": f"m-{offer.run_id}"},
                finished_event(offer),
            ]
            drop_at = rng.randint(1, len(events) - 1) if drop else None
            for i, event in enumerate(events):
                if self.current.get(offer.run_id) is not offer:
                    return  # superseded: no checkpoint between this and the send below
                if i == drop_at:
                    self.fig.fault("link_dropped_mid_run")
                    await link.drop()
                    return
                if offer.cancelled and not ignore_cancel and not self.behave:
                    self.fig.fault("cancel_complied")
                    await offer.finish()  # stopped as asked: no RUN_FINISHED
                    return
                if not await offer.report(event):
                    return
                await trio.sleep(rng.uniform(0, 0.004))
            if self.current.get(offer.run_id) is offer:
                await offer.finish()
        finally:
            active.discard(offer.run_id)


class SdkEcho:
    """The SDK's provider with its echo agent, logging what it admitted (in
    offer order: the runtime admits while it answers) and which runs saw a
    cancel."""

    def __init__(self, url: str) -> None:
        self.admitted: list[tuple[str, str | None]] = []  # (run id, message id)
        self.cancel_seen: set[str] = set()
        self.provider = Provider(
            Identity.generate(),
            url,
            max_concurrent_runs=3,
            backoff=Backoff(initial=0.02, maximum=0.2, jitter=0.0),
        )
        inner = make_echo(deltas=4, delay=0.002)

        async def work(run_input: Any, ctx: Any) -> Any:
            try:
                async for event in inner(run_input):
                    yield event
            finally:
                if ctx.cancel_requested:
                    self.cancel_seen.add(ctx.run_id)

        def admit(ctx: Any) -> None:
            messages = ctx.run_input.messages
            self.admitted.append((ctx.run_id, messages[-1].id if messages else None))

        work.admit = admit  # type: ignore[attr-defined]
        self.provider.add_agent(work, name="work")


class Caller:
    """Everything callers were told, per thread and send index."""

    def __init__(self, threads: int, runs: int) -> None:
        self.thread_ids: dict[int, str] = {}
        self.a2a_ids: dict[tuple[int, int], str] = {}
        self.streams: dict[tuple[int, int], AguiStream] = {}
        self.cancels: dict[str, dict[str, Any]] = {}  # run id -> the answer to CancelTask
        #: (thread, index) -> trio times the send left and its answer (or headers) came
        self.sent: dict[tuple[int, int], tuple[float, float]] = {}
        self.threads, self.runs = threads, runs


async def drive_thread(
    t: int,
    fp: str,
    http: httpx.AsyncClient,
    caller: Caller,
    rng: random.Random,
    cancel_chance: float,
    fig: Figures,
    nursery: trio.Nursery,
) -> None:
    """One caller per thread sends its runs one after another (each send
    answered before the next leaves), so arrival order is send order."""
    a2a = A2A(http, f"/a2a/{fp}/work")
    began = trio.current_time()
    first = await a2a.send(f"thread {t} run 0", message_id=f"t{t}-r0")
    caller.sent[(t, 0)] = (began, trio.current_time())
    assert "result" in first, first
    task = first["result"]["task"]
    caller.thread_ids[t] = task["contextId"]
    caller.a2a_ids[(t, 0)] = task["id"]
    for j in range(1, caller.runs):
        await trio.sleep(rng.uniform(0, 0.01))
        mid = f"t{t}-r{j}"
        began = trio.current_time()
        if rng.random() < 0.5:
            answer = await a2a.send(
                f"thread {t} run {j}", message_id=mid, context_id=task["contextId"]
            )
            assert "result" in answer, answer
            caller.a2a_ids[(t, j)] = answer["result"]["task"]["id"]
        else:
            stream = AguiStream(mid)
            caller.streams[(t, j)] = stream
            await nursery.start(
                stream.run,
                http,
                f"/agui/{fp}/work",
                user_input(f"thread {t} run {j}", thread_id=task["contextId"], message_id=mid),
            )
            assert stream.status == 200, (stream.status, stream.error_body)
        caller.sent[(t, j)] = (began, trio.current_time())
        if rng.random() < cancel_chance:
            nursery.start_soon(cancel_later, a2a, caller, (t, j), rng.uniform(0, 0.03), fig)
    if rng.random() < cancel_chance:
        nursery.start_soon(cancel_later, a2a, caller, (t, 0), 0.0, fig)


async def cancel_later(
    a2a: A2A, caller: Caller, key: tuple[int, int], delay: float, fig: Figures
) -> None:
    await trio.sleep(delay)
    run_id = caller.a2a_ids.get(key)
    if run_id is None:  # an AG-UI run: its id comes with its first event
        stream = caller.streams[key]
        while stream.run_id is None and not stream.done.is_set():
            await trio.sleep(0.005)
        run_id = stream.run_id
        if run_id is None:
            return
    answer = await a2a.cancel(run_id)
    caller.cancels[run_id] = answer
    fig.fault("caller_cancel")
    seen = fig.extra.setdefault("cancel_answers", {})
    state = "error" if "error" in answer else answer["result"]["status"]["state"][11:]
    seen[state] = seen.get(state, 0) + 1
    if "error" in answer:
        fig.expect(
            answer["error"]["code"] == TASK_NOT_CANCELABLE,
            f"{run_id}: cancel answered with an unexpected error {answer['error']}",
        )
        return
    task = answer["result"]
    state = task["status"]["state"]
    fig.expect(
        state == "TASK_STATE_CANCELED"
        or (task.get("metadata") or {}).get(CANCEL_REQUESTED) is True,
        f"{run_id}: an accepted cancel answered {state} without the pending-cancel marker: {task}",
    )


async def faults_scenario(
    tmp_path: Path,
    *,
    seed: int = 7,
    threads: int = 20,
    runs: int = 10,
    cancel_chance: float = 0.12,
    fig: Figures | None = None,
) -> Figures:
    fig = fig or Figures("provider_faults")
    rng = random.Random(seed)
    async with (
        running_server(
            tmp_path,
            deliver_timeout_seconds=0.5,
            quality_allowance=1_000_000,
            thread_queue_limit=64,
            unserved_grace_seconds=30,
        ) as info,
        httpx.AsyncClient(base_url=info.url, timeout=HTTP_TIMEOUT) as http,
    ):
        raw = [
            FaultyProvider(
                "dropper", info.provider_url, Faults(drop=0.08, decline=0.05, mute=0.02), seed, fig
            ),
            FaultyProvider(
                "decliner",
                info.provider_url,
                Faults(decline=0.25, refuse=0.08, ignore_cancel=0.3),
                seed,
                fig,
            ),
            FaultyProvider(
                "mute-twice",
                info.provider_url,
                Faults(mute=0.08, twice=0.10, refuse=0.02),
                seed,
                fig,
            ),
        ]
        sdk = SdkEcho(info.provider_url)
        fingerprints = [p.peer.fingerprint for p in raw] + [sdk.provider.identity.fingerprint]
        caller = Caller(threads, runs)
        async with trio.open_nursery() as providers:
            for p in raw:
                await providers.start(p.peer.serve)
            await providers.start(sdk.provider.run)

            # -- the load, with faults
            async with trio.open_nursery() as callers:
                for t in range(threads):
                    callers.start_soon(
                        drive_thread,
                        t,
                        fingerprints[t % len(fingerprints)],
                        http,
                        caller,
                        random.Random(rng.getrandbits(32)),
                        cancel_chance,
                        fig,
                        callers,
                    )

            # -- drive it to the end: providers behave, and re-publish to wake
            # declined heads (a decline by itself wakes nothing)
            for p in raw:
                p.behave = True
            snapshots: dict[int, dict[str, Any]] = {}

            async def all_settled() -> bool:
                for t, tid in caller.thread_ids.items():
                    snapshots[t] = (await http.get(f"/threads/{tid}")).json()
                if any(r["status"] not in TERMINAL for s in snapshots.values() for r in s["runs"]):
                    for p in raw:
                        await p.peer.re_register()
                    return False
                return True

            await eventually(all_settled, "every run settled", poll=0.2)
            run_ids = [r["runId"] for s in snapshots.values() for r in s["runs"]]
            final = await get_runs(http, run_ids)
            again = await get_runs(http, run_ids)
            providers.cancel_scope.cancel()

    check_runs(caller, snapshots, final, again, fig)
    check_offer_order(raw, sdk, fig)
    index = {
        r["runId"]: (t, j) for t, snap in snapshots.items() for j, r in enumerate(snap["runs"])
    }
    served_by = {
        t: (raw[t % len(fingerprints)] if t % len(fingerprints) < len(raw) else None)
        for t in range(threads)
    }
    check_cancels_and_reasons(raw, sdk, caller, final, index, served_by, fig)
    fig.runs_driven = len(final)
    fig.fault("reconnected", sum(max(0, len(p.peer.links) - 1) for p in raw))
    fig.extra["final"] = _counts(r["status"] for r in final.values() if r)
    fig.extra["reasons"] = _counts(
        r["metadata"]["failureReason"].split(" will never")[0]
        for r in final.values()
        if r and r["status"] == "failed"
    )
    return fig


def _counts(items: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for item in items:
        out[item] = out.get(item, 0) + 1
    return dict(sorted(out.items()))


def check_runs(
    caller: Caller,
    snapshots: dict[int, dict[str, Any]],
    final: dict[str, dict | None],
    again: dict[str, dict | None],
    fig: Figures,
) -> None:
    for t in range(caller.threads):
        if t not in snapshots:
            fig.lost(f"thread {t}", "its caller never learned its thread")
            continue
        in_record = [r["runId"] for r in snapshots[t]["runs"]]
        fig.expect(
            len(in_record) == caller.runs,
            f"thread {t}: {len(in_record)} runs in the record, the caller sent {caller.runs}",
        )
        for j in range(caller.runs):
            told = caller.a2a_ids.get((t, j)) or (
                caller.streams[(t, j)].run_id if (t, j) in caller.streams else None
            )
            if told is None:
                fig.violate(f"thread {t} run {j}: the caller was never told its id")
            elif told not in in_record:
                fig.lost(told, f"thread {t} run {j} told to its caller, not on its thread")
            elif in_record.index(told) != j:
                fig.violate(f"thread {t}: run sent {j}th arrived {in_record.index(told)}th")
    for rid, run in final.items():
        if run is None:
            fig.lost(rid, "listed on its thread, but GET /runs does not know it")
            continue
        fig.expect(run["status"] in TERMINAL, f"{rid}: still {run['status']} at the end")
        fig.violations.extend(record_problems(run))
        fig.violations.extend(play_shape_problems(run))
        fig.expect(again.get(rid) == run, f"{rid}: record changed after it settled")
    for (t, j), stream in caller.streams.items():
        rid = stream.run_id
        if rid is None:
            fig.violate(
                f"thread {t} run {j}: the AG-UI stream showed no event at all (cut: {stream.cut!r})"
            )
            continue
        fig.expect(stream.ended_cleanly, f"{rid}: AG-UI stream cut: {stream.cut!r}")
        fig.violations.extend(
            seen_problems(rid, stream.events, final.get(rid), complete=stream.ended_cleanly)
        )
        if stream.events:
            last = stream.events[-1].get("type")
            status = (final.get(rid) or {}).get("status")
            # AG-UI has no cancelled event: a cancelled run's stream just ends.
            fig.expect(
                (status == "completed" and last == "RUN_FINISHED")
                or (status == "failed" and last == "RUN_ERROR")
                or (status == "cancelled" and last not in ("RUN_FINISHED", "RUN_ERROR")),
                f"{rid}: stream ended on {last} for a run recorded {status}",
            )


def play_shape_problems(run: dict[str, Any]) -> list[str]:
    """Every provider here plays a run as RUN_STARTED, text, RUN_FINISHED (or a
    prefix of that, when stopped); funduq may append its own RUN_ERROR. Events
    of two plays mixed in one record would mean reports of a superseded
    acceptance reached the run."""
    types = [e["event"].get("type") for e in run["events"]]
    ours = {*FUNDUQ_REASONS, run["metadata"].get("failureReason")}
    if types and types[-1] == "RUN_ERROR" and run["events"][-1]["event"].get("code") in ours:
        types = types[:-1]  # funduq's own, for a failure nobody reported
    if not types:
        return []
    body = types[1:-1] if types[-1] == "RUN_FINISHED" else types[1:]
    if types[0] != "RUN_STARTED" or any(t in ("RUN_STARTED", "RUN_FINISHED") for t in body):
        return [f"{run['runId']}: events are not one play: {types}"]
    return []


def check_offer_order(raw: list[FaultyProvider], sdk: SdkEcho, fig: Figures) -> None:
    """Per thread, offers reach providers in arrival order."""
    logs: dict[int, list[int]] = {}
    for p in raw:
        for offer in p.peer.offer_log:
            t, j = thread_and_index(offer.message_id)
            logs.setdefault(t, []).append(j)
    for _run_id, mid in sdk.admitted:
        t, j = thread_and_index(mid)
        logs.setdefault(t, []).append(j)
    offers = 0
    for t, order in sorted(logs.items()):
        offers += len(order)
        for a, b in itertools.pairwise(order):
            if b < a:
                fig.violate(
                    f"thread {t}: run {b} offered after run {a} had been "
                    f"(offers in order received: {order})"
                )
                break
    fig.extra["offers"] = offers


def check_cancels_and_reasons(
    raw: list[FaultyProvider],
    sdk: SdkEcho,
    caller: Caller,
    final: dict[str, dict | None],
    index: dict[str, tuple[int, int]],
    served_by: dict[int, FaultyProvider | None],
    fig: Figures,
) -> None:
    accepted_on: dict[str, list[Any]] = {}  # run id -> links that sent it `accepted`
    for p in raw:
        for link in p.peer.links:
            for rid in link.accepted:
                accepted_on.setdefault(rid, []).append(link)
    sdk_runs = {rid for rid, _ in sdk.admitted}
    refusals = {rid: reason for p in raw for rid, reason in p.refusals.items()}
    for rid, run in final.items():
        if run is None:
            continue
        status, meta = run["status"], run["metadata"]
        handed_over = run.get("startedAt") is not None or bool(run["events"])
        if status == "cancelled":
            fig.expect(rid in caller.cancels, f"{rid}: cancelled, but no caller asked")
            if handed_over:
                # A cancel frame that came after an offer of the run this provider
                # accepted (one that came before was about an earlier play).
                relayed = rid in sdk.cancel_seen or any(
                    offer.cancelled and "accepted" in offer.answers
                    for p in raw
                    for offer in p.peer.offers_of(rid)
                )
                fig.expect(
                    relayed,
                    f"{rid}: recorded cancelled after being handed over "
                    f"(startedAt={run.get('startedAt')}, "
                    f"{len(run['events'])} events) but its provider never got "
                    f"a cancel frame",
                )
                fig.expect(
                    rid in accepted_on or rid in sdk_runs,
                    f"{rid}: handed over to nobody who accepted it",
                )
            else:
                fig.expect(not run["events"], f"{rid}: cancelled unstarted but has events")
        if status == "failed":
            reason = meta.get("failureReason")
            if reason == "provider_left_holding_it":
                gone = [link for link in accepted_on.get(rid, []) if link.closed.is_set()]
                fig.expect(
                    bool(gone),
                    f"{rid}: provider_left_holding_it, but no link that held it went away",
                )
            elif reason == "agent_offline":
                # Only a run that arrived while its provider was between links.
                t, j = index[rid]
                began, told = caller.sent[(t, j)]
                provider = served_by[t]
                windows = provider.peer.detached_windows() if provider else []
                fig.expect(
                    any(start <= told and end >= began for start, end in windows),
                    f"{rid}: failed agent_offline, but its provider was attached from "
                    f"before it was sent until after it was answered "
                    f"(sent {began:.3f}-{told:.3f}, provider away: {windows})",
                )
                fig.fault("arrived_while_provider_away")
            elif reason in FUNDUQ_REASONS:
                fig.violate(f"{rid}: failed {reason!r}, which no provider gave cause for")
            else:
                fig.expect(
                    refusals.get(rid) == reason,
                    f"{rid}: failed with {reason!r}, not a refusal's reason verbatim "
                    f"(refused with {refusals.get(rid)!r})",
                )
        if status == "completed":
            fig.expect(
                rid in accepted_on or rid in sdk_runs,
                f"{rid}: completed, but no provider accepted it",
            )


async def test_providers_misbehaving_under_load_lose_nothing(tmp_path: Path) -> None:
    fig = await faults_scenario(tmp_path, seed=7, threads=20, runs=10)
    fig.check()
    assert fig.runs_driven == 200
    # The faults really happened (a scenario that injects nothing proves nothing).
    for kind in (
        "never_answered",
        "refused",
        "declined",
        "answered_twice",
        "link_dropped_mid_run",
        "caller_cancel",
    ):
        assert fig.faults[kind] > 0, (kind, fig.line())


async def test_a_late_acceptance_does_not_stop_the_play_of_the_next_offer(tmp_path: Path) -> None:
    """The interleaving behind this scenario's rare `provider_stream_ended_without
    _finishing` under load, forced over the real link: the provider accepts the
    run's first offer only after funduq offered the run again. A cancel names a
    run, not an offer; had funduq answered the stale acceptance with one, it
    would arrive after the second offer, and a provider that stops as asked
    (the SDK's runtime does) would end the play funduq holds without a
    RUN_FINISHED -- failed, with no cancel ever asked."""
    async with (
        running_server(tmp_path, deliver_timeout_seconds=0.2) as info,
        httpx.AsyncClient(base_url=info.url, timeout=HTTP_TIMEOUT) as http,
        raw_provider(info, ["work"]) as p,
    ):
        answer = await A2A(http, f"/a2a/{p.fingerprint}/work").send("hi", message_id="m1")
        run_id = answer["result"]["task"]["id"]
        first = await p.next_offer()
        second = await p.next_offer()  # the first was left unanswered: offered afresh
        assert first["runId"] == second["runId"] == run_id
        await p.answer(first, "accepted")  # too late
        await p.answer(second, "accepted")
        # A round trip: whatever funduq sent for the two answers is in by its reply.
        await p.register(["work"])
        stopped = []
        while True:
            try:
                stopped.append(p.cancels.receive_nowait())
            except trio.WouldBlock:
                break
        events = [
            {"type": "RUN_STARTED", "threadId": second["threadId"], "runId": run_id},
            {"type": "RUN_FINISHED", "threadId": second["threadId"], "runId": run_id},
        ]
        # Stop as asked (no RUN_FINISHED), or play to the end.
        await p.play(second, [] if run_id in stopped else events)
        run = await wait_status(http, run_id, TERMINAL)
        assert run["status"] == "completed", run["metadata"]
        assert stopped == []
