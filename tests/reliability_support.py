"""Helpers for the reliability suite (test_crash_restart, test_provider_faults,
test_random_cancels, test_fuzz, test_slow_consumers) and its soak scripts.

Everything here plays a party funduq talks to over the network -- a provider
on the real WebSocket link (`Peer`), callers on the real doors (`A2A`,
`AguiStream`), the server itself as a subprocess (`server_process`) -- and
records what that party observed, so the tests assert only observable facts:
frames a provider received, ids and events a caller was told, the record as
`GET /runs` serves it, the SQLite file after the server stopped.

`Figures` collects what a scenario drove and every invariant it found broken;
`Figures.report()` prints one line of figures and `Figures.check()` fails the
test listing the violations.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import socket
import subprocess
import sys
from collections import defaultdict
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import trio
from httpx_sse import EventSource
from trio_websocket import ConnectionClosed, HandshakeError, connect_websocket_url

from funduq_trio.identity import Identity, new_nonce, provider_connect_payload

#: A safety net against a hung test, never a behaviour clock.
SAFETY = 60.0
HTTP_TIMEOUT = 30.0

#: One sequence for every offer any `Peer` of this process receives: the
#: order the peers' receive loops read them in (across links and peers).
_offers_received = itertools.count(1)

TERMINAL = frozenset({"completed", "failed", "cancelled"})
ACTIVE = frozenset({"queued", "offering", "running", "cancelling", "input-required"})
SETTLED_OR_PAUSED = TERMINAL | {"input-required"}
ORPHAN_SOURCES = frozenset({"offering", "running", "cancelling"})

RUN_STARTED, RUN_FINISHED, RUN_ERROR = "RUN_STARTED", "RUN_FINISHED", "RUN_ERROR"

#: funduq's own failure reasons (DESIGN §2); any other reason is a refusal's, verbatim.
FUNDUQ_REASONS = frozenset(
    {
        "agent_offline",
        "no_provider_took_it",
        "provider_left_holding_it",
        "provider_stream_ended_without_finishing",
        "orphaned_by_restart",
        "provider sent a malformed AG-UI event",
    }
)

A2A_V1 = {"A2A-Version": "1.0"}
TASK_NOT_FOUND, TASK_NOT_CANCELABLE = -32001, -32002
CANCEL_REQUESTED = "funduq/cancelRequested"


# ----------------------------------------------------------------------------- figures


@dataclass
class Figures:
    """What a scenario drove, and every invariant it saw broken."""

    name: str
    runs_driven: int = 0
    faults: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    runs_lost: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    def fault(self, kind: str, n: int = 1) -> None:
        self.faults[kind] += n

    def violate(self, message: str) -> None:
        self.violations.append(message)

    def lost(self, run_id: str, why: str) -> None:
        self.runs_lost.append(run_id)
        self.violations.append(f"run lost: {run_id}: {why}")

    def expect(self, condition: bool, message: str) -> bool:
        if not condition:
            self.violate(message)
        return condition

    @property
    def faults_injected(self) -> int:
        return sum(self.faults.values())

    def line(self) -> str:
        faults = ", ".join(f"{k}={v}" for k, v in sorted(self.faults.items()))
        extra = "".join(f", {k}={v}" for k, v in self.extra.items())
        return (
            f"[{self.name}] runs driven={self.runs_driven}, faults injected="
            f"{self.faults_injected} ({faults}), runs lost={len(self.runs_lost)}, "
            f"invariants violated={len(self.violations)}{extra}"
        )

    def report(self) -> None:
        print(self.line(), flush=True)
        for v in self.violations[:40]:
            print(f"  VIOLATION: {v}", flush=True)

    def check(self) -> None:
        self.report()
        assert not self.runs_lost and not self.violations, f"{self.line()}\n" + "\n".join(
            self.violations[:40]
        )


# ----------------------------------------------------------------------------- waiting


async def eventually(
    predicate: Callable[[], Awaitable[bool]],
    what: str,
    *,
    timeout: float = SAFETY,
    poll: float = 0.02,
) -> None:
    """Poll an observable condition (a record, a roster) until it holds. The
    timeout is a safety net for a broken server, not a behaviour clock."""
    with trio.move_on_after(timeout):
        while not await predicate():
            await trio.sleep(poll)
        return
    raise AssertionError(f"gave up waiting ({timeout}s) for: {what}")


# ----------------------------------------------------------------------------- the record


async def get_run(http: httpx.AsyncClient, run_id: str) -> dict[str, Any] | None:
    r = await http.get(f"/runs/{run_id}")
    if r.status_code == 404:
        return None
    r.raise_for_status()
    return r.json()


async def get_runs(http: httpx.AsyncClient, run_ids: Iterable[str]) -> dict[str, dict | None]:
    out: dict[str, dict | None] = {}
    limit = trio.CapacityLimiter(16)

    async def one(run_id: str) -> None:
        async with limit:
            out[run_id] = await get_run(http, run_id)

    async with trio.open_nursery() as nursery:
        for run_id in run_ids:
            nursery.start_soon(one, run_id)
    return out


async def wait_status(
    http: httpx.AsyncClient, run_id: str, statuses: Iterable[str], *, timeout: float = SAFETY
) -> dict[str, Any]:
    wanted = frozenset(statuses)
    found: dict[str, Any] = {}

    async def reached() -> bool:
        run = await get_run(http, run_id)
        if run is not None:
            found.update(run)
        return run is not None and run["status"] in wanted

    await eventually(
        reached,
        f"run {run_id} reaching {sorted(wanted)} (last: {found.get('status')})",
        timeout=timeout,
    )
    return found


def event_types(run: dict[str, Any]) -> list[str]:
    return [e["event"].get("type") for e in run["events"]]


def record_problems(run: dict[str, Any]) -> list[str]:
    """What is wrong with one run record on its own (any status)."""
    rid, status = run["runId"], run["status"]
    out = []
    seqs = [e["seq"] for e in run["events"]]
    if seqs != list(range(1, len(seqs) + 1)):
        out.append(f"{rid}: event seqs are not 1..n: {seqs[:10]}...")
    metadata = run.get("metadata") or {}
    types = event_types(run)
    if status not in TERMINAL | ACTIVE:
        out.append(f"{rid}: unknown status {status!r}")
    if status in TERMINAL and not run.get("completedAt"):
        out.append(f"{rid}: {status} without completedAt")
    if status == "failed":
        reason = metadata.get("failureReason")
        if not isinstance(reason, str) or not reason:
            out.append(f"{rid}: failed without a failureReason: {metadata}")
        if RUN_ERROR not in types:
            out.append(f"{rid}: failed ({reason}) without any RUN_ERROR in its events")
    elif metadata.get("failureReason") is not None:
        out.append(f"{rid}: {status} carries failureReason {metadata.get('failureReason')!r}")
    if status == "completed" and RUN_FINISHED not in types:
        out.append(f"{rid}: completed without a RUN_FINISHED")
    if status in ("cancelled", "completed", "input-required"):
        synthesized = [
            e["event"]
            for e in run["events"]
            if e["event"].get("type") == RUN_ERROR and e["event"].get("code") in FUNDUQ_REASONS
        ]
        if synthesized:
            out.append(f"{rid}: {status} but carries funduq's RUN_ERROR {synthesized}")
    if status == "cancelled" and "cancelRequestedBy" not in (metadata.get("funduq") or {}):
        out.append(f"{rid}: cancelled but no cancel was ever recorded as requested: {metadata}")
    if status == "input-required" and not metadata.get("interrupts"):
        out.append(f"{rid}: input-required without interrupts")
    if status in ("queued",) and run.get("startedAt") and not metadata.get("interrupts"):
        pass  # a reopened pause keeps its first startedAt
    return out


def seen_problems(
    run_id: str, seen: list[dict[str, Any]], run: dict[str, Any] | None, *, complete: bool = False
) -> list[str]:
    """Events an AG-UI caller saw on its stream must be the record's, in seq
    order from seq 1 (the door may open with a RUN_STARTED of its own when the
    run's first recorded event is not one). `complete`: the stream ended
    cleanly, so it must hold every event."""
    if run is None:
        return [f"{run_id}: a caller saw {len(seen)} events of a run not in the record"]
    recorded = [e["event"] for e in run["events"]]
    shown = list(seen)
    if (
        shown
        and shown[0].get("type") == RUN_STARTED
        and (not recorded or recorded[0].get("type") != RUN_STARTED)
    ):
        shown = shown[1:]
    for i, event in enumerate(shown):
        if i >= len(recorded):
            return [
                (
                    f"{run_id}: caller saw event #{i + 1} {event} that the record lacks "
                    f"(record has {len(recorded)})"
                )
            ]
        if recorded[i] != event:
            return [f"{run_id}: caller saw seq {i + 1} as {event}, the record has {recorded[i]}"]
    if complete and len(shown) != len(recorded):
        return [
            (
                f"{run_id}: the stream ended cleanly after {len(shown)} events, the record has "
                f"{len(recorded)}"
            )
        ]
    return []


# ----------------------------------------------------------------------------- callers


class A2A:
    """Raw JSON-RPC (A2A 1.0 method names) over httpx at one agent's endpoint."""

    _ids = itertools.count(1)

    def __init__(self, http: httpx.AsyncClient, url: str) -> None:
        self.http = http
        self.url = url

    async def call(self, method: str, params: dict[str, Any]) -> dict[str, Any]:
        body = {"jsonrpc": "2.0", "id": next(self._ids), "method": method, "params": params}
        r = await self.http.post(self.url, json=body, headers=A2A_V1)
        assert r.status_code == 200, (r.status_code, r.text)
        return r.json()

    async def send(
        self,
        text: str,
        *,
        message_id: str,
        context_id: str | None = None,
        task_id: str | None = None,
        immediately: bool = True,
    ) -> dict[str, Any]:
        """SendMessage; returns the JSON-RPC answer (`result.task` or `error`)."""
        message: dict[str, Any] = {
            "messageId": message_id,
            "role": "ROLE_USER",
            "parts": [{"text": text}],
        }
        if context_id:
            message["contextId"] = context_id
        if task_id:
            message["taskId"] = task_id
        return await self.call(
            "SendMessage", {"message": message, "configuration": {"returnImmediately": immediately}}
        )

    async def cancel(self, task_id: str) -> dict[str, Any]:
        return await self.call("CancelTask", {"id": task_id})

    async def get(self, task_id: str) -> dict[str, Any]:
        return await self.call("GetTask", {"id": task_id})


class AguiStream:
    """One AG-UI POST: `await nursery.start(stream.run, http, url, body)`
    returns once the response headers arrived (the run exists and its place in
    its thread is fixed); the events are read on in the background."""

    def __init__(self, label: str = "") -> None:
        self.label = label
        self.status: int | None = None
        self.events: list[dict[str, Any]] = []
        self.error_body: Any = None
        self.ended_cleanly = False
        self.cut: BaseException | None = None
        self.done = trio.Event()

    @property
    def run_id(self) -> str | None:
        return self.events[0].get("runId") if self.events else None

    @property
    def thread_id(self) -> str | None:
        return self.events[0].get("threadId") if self.events else None

    async def run(
        self,
        http: httpx.AsyncClient,
        url: str,
        body: Any,
        *,
        task_status: trio.TaskStatus[AguiStream] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        started = False
        try:
            async with http.stream("POST", url, json=body) as response:
                self.status = response.status_code
                started = True
                task_status.started(self)
                if not response.headers.get("content-type", "").startswith("text/event-stream"):
                    await response.aread()
                    self.error_body = response.json()
                    self.ended_cleanly = True
                    return
                async for sse in EventSource(response).aiter_sse():
                    self.events.append(json.loads(sse.data))
                self.ended_cleanly = True
        except (httpx.TransportError, httpx.StreamError) as exc:
            self.cut = exc
            if not started:
                raise
        finally:
            self.done.set()


def user_input(text: str, *, thread_id: str, message_id: str, **extra: Any) -> dict[str, Any]:
    return {
        "threadId": thread_id,
        "runId": "caller-run",
        "messages": [{"id": message_id, "role": "user", "content": text}],
        **extra,
    }


# ----------------------------------------------------------------------------- providers


def started_event(offer: Offer) -> dict[str, Any]:
    return {"type": RUN_STARTED, "threadId": offer.thread_id, "runId": offer.run_id}


def finished_event(offer: Offer, **extra: Any) -> dict[str, Any]:
    return {"type": RUN_FINISHED, "threadId": offer.thread_id, "runId": offer.run_id, **extra}


def text_events(message_id: str, *deltas: str) -> list[dict[str, Any]]:
    return [
        {"type": "TEXT_MESSAGE_START", "messageId": message_id, "role": "assistant"},
        *({"type": "TEXT_MESSAGE_CONTENT", "messageId": message_id, "delta": d} for d in deltas),
        {"type": "TEXT_MESSAGE_END", "messageId": message_id},
    ]


def interrupt_outcome(offer: Offer) -> dict[str, Any]:
    return {
        "type": "interrupt",
        "interrupts": [
            {
                "id": f"ask-{offer.run_id}",
                "reason": "approval",
                "message": "go on?",
                "expiresAt": "2099-01-01T00:00:00Z",
            }
        ],
    }


@dataclass(eq=False)
class Offer:
    """One `offer` frame a peer received, on the link it came on."""

    offer_id: str
    run: dict[str, Any]
    link: Link
    answers: list[str] = field(default_factory=list)
    #: A `cancel` naming this run came on this link after this offer (and
    #: before any newer offer of the run): the stop is for this offer's play.
    #: A cancel names a run, not an offer, so one that came before the offer
    #: was about an earlier play (e.g. a late acceptance) -- never this one.
    cancelled: bool = False
    #: Where this offer falls among every offer this process's peers read
    #: (`_offers_received`), taken when the receive loop read its frame.
    received: int = field(default_factory=lambda: next(_offers_received))

    @property
    def run_id(self) -> str:
        return self.run["runId"]

    @property
    def thread_id(self) -> str:
        return self.run["threadId"]

    @property
    def message_id(self) -> str | None:
        messages = self.run["runInput"].get("messages") or []
        return messages[-1].get("id") if messages else None

    @property
    def text(self) -> str:
        messages = self.run["runInput"].get("messages") or []
        content = messages[-1].get("content") if messages else ""
        return content if isinstance(content, str) else ""

    @property
    def resume(self) -> Any:
        return self.run["runInput"].get("resume")

    async def answer(self, verdict: str, reason: str | None = None) -> bool:
        self.answers.append(verdict)
        ok = await self.link.send(
            {
                "kind": "ok",
                "id": self.offer_id,
                "verdict": verdict,
                "reason": reason,
                "payload": None,
            }
        )
        if ok and verdict == "accepted":
            self.link.accepted.add(self.run_id)
        return ok

    async def report(self, event: dict[str, Any]) -> bool:
        return await self.link.send(
            {"kind": "report", "runId": self.run_id, "event": event, "seq": None}
        )

    async def finish(self) -> bool:
        return await self.link.send({"kind": "finish", "runId": self.run_id})

    async def play(self, events: list[dict[str, Any]], *, finish: bool = True) -> bool:
        for event in events:
            if not await self.report(event):
                return False
        return await self.finish() if finish else True


class Link:
    """One connection of a `Peer`."""

    def __init__(self, peer: Peer, ws: Any, number: int, nursery: trio.Nursery) -> None:
        self.peer = peer
        self.ws = ws
        self.number = number
        self.nursery = nursery
        self.closed = trio.Event()
        self.close_reason: Any = None
        #: trio times: when funduq confirmed the link (register answered ok), and
        #: the earliest moment funduq may have stopped counting it attached.
        self.attached_at: float | None = None
        self.closing_at: float | None = None
        self.accepted: set[str] = set()
        self.cancels: list[str] = []
        #: run id -> the newest offer of it received on this link
        self.latest_offer: dict[str, Offer] = {}
        self.replies: dict[str, dict[str, Any]] = {}
        self._replied = trio.Event()
        self._send_lock = trio.Lock()

    async def send(self, frame: dict[str, Any]) -> bool:
        """Send a frame; False when the link is gone."""
        if self.closed.is_set():
            return False
        try:
            async with self._send_lock:
                await self.ws.send_message(json.dumps(frame))
            return True
        except (ConnectionClosed, trio.BrokenResourceError, trio.ClosedResourceError, OSError):
            return False

    async def request(self, frame: dict[str, Any]) -> dict[str, Any] | None:
        """A frame with a fresh id; funduq's reply, or None if the link died."""
        frame = {**frame, "id": f"{frame['kind']}-{next(self.peer._ids)}"}
        if not await self.send(frame):
            return None
        while frame["id"] not in self.replies:
            if self.closed.is_set():
                return None
            with trio.move_on_after(0.5):
                await self._replied.wait()
        return self.replies.pop(frame["id"])

    def mark_risky(self) -> None:
        """This link is about to send something funduq may close it for."""
        if self.closing_at is None:
            self.closing_at = trio.current_time()

    async def drop(self) -> None:
        """Close the link from the provider's side (mid-run, if it holds runs)."""
        self.mark_risky()
        with trio.move_on_after(5):
            await self.ws.aclose(code=1001, reason="provider dropping the link")
        self.closed.set()


class Peer:
    """A provider played over the real link by a test: it logs every frame the
    provider receives and hands each offer to `on_offer` (run in the link's own
    nursery, so dropping the link stops its runs, as a provider process would).

    `serve()` keeps one link up, reconnecting under the same key after the link
    is lost (by `drop()`, by funduq closing it, or by the server going away)
    while `reconnect` is true."""

    def __init__(
        self,
        url: str,
        agents: Iterable[str],
        *,
        identity: Identity | None = None,
        max_concurrent_runs: int | None = None,
        name: str = "peer",
        on_offer: Callable[[Offer], Awaitable[None]] | None = None,
        reconnect_delay: float = 0.02,
    ) -> None:
        self.url = url
        self.agents = list(agents)
        self.identity = identity or Identity.generate()
        self.max_concurrent_runs = max_concurrent_runs
        self.name = name
        self.on_offer = on_offer
        self.reconnect_delay = reconnect_delay
        self.reconnect = True
        self.links: list[Link] = []
        self.link: Link | None = None
        self.offer_log: list[Offer] = []
        self.cancel_log: list[tuple[str, int]] = []
        self.connect_failures = 0
        self._ids = itertools.count(1)
        self._attached = trio.Event()
        self._offered = trio.Event()
        self._cancelled = trio.Event()

    @property
    def key(self) -> str:
        return self.identity.public_key_hex

    @property
    def fingerprint(self) -> str:
        return self.identity.fingerprint

    def set_url(self, url: str) -> None:
        self.url = url

    async def serve(self, *, task_status: trio.TaskStatus[Peer] = trio.TASK_STATUS_IGNORED) -> None:
        first = True
        while True:
            try:
                async with trio.open_nursery() as nursery:
                    link = await self._connect(nursery)
                    if link is not None:
                        self.link = link
                        self._attached.set()
                        if first:
                            first = False
                            task_status.started(self)
                        await link.closed.wait()
                    nursery.cancel_scope.cancel()
            except* (OSError, HandshakeError, ConnectionClosed, trio.BrokenResourceError):
                self.connect_failures += 1
            self.link = None
            self._attached = trio.Event()
            if not self.reconnect:
                await trio.sleep_forever()
            await trio.sleep(self.reconnect_delay)

    async def attached(self) -> Link:
        while self.link is None or self.link.closed.is_set():
            await self._attached.wait()
        return self.link

    async def _connect(self, nursery: trio.Nursery) -> Link | None:
        ws = await connect_websocket_url(nursery, self.url, max_message_size=64 * 1024 * 1024)
        hello = json.loads(await ws.get_message())
        assert hello["kind"] == "hello", hello
        nonce = new_nonce()
        payload = provider_connect_payload(hello["funduqKey"], hello["nonce"], nonce)
        await ws.send_message(
            json.dumps(
                {
                    "kind": "connect",
                    "publicKey": self.key,
                    "nonce": nonce,
                    "proof": self.identity.sign(payload),
                    "maxConcurrentRuns": self.max_concurrent_runs,
                }
            )
        )
        answer = json.loads(await ws.get_message())
        assert answer["kind"] == "connect.ok", answer
        link = Link(self, ws, len(self.links) + 1, nursery)
        self.links.append(link)
        nursery.start_soon(self._receive_loop, link)
        reply = await link.request(
            {
                "kind": "register",
                "agents": [
                    {"name": n, "description": f"{n} ({self.name})", "card": None, "metadata": None}
                    for n in self.agents
                ],
            }
        )
        if reply is None:
            return None
        assert reply["kind"] == "ok", reply
        link.attached_at = trio.current_time()
        return link

    def detached_windows(self) -> list[tuple[float, float]]:
        """Spans of trio time in which funduq may have had no link of this
        provider attached: from a link's `closing_at` to the next's `attached_at`."""
        windows = []
        for i, link in enumerate(self.links):
            if link.closing_at is None:
                continue
            nxt = next((n.attached_at for n in self.links[i + 1 :] if n.attached_at), None)
            windows.append((link.closing_at, nxt if nxt is not None else float("inf")))
        return windows

    async def _receive_loop(self, link: Link) -> None:
        try:
            while True:
                frame = json.loads(await link.ws.get_message())
                kind = frame.get("kind")
                if kind == "offer":
                    offer = Offer(frame["id"], frame["run"], link)
                    self.offer_log.append(offer)
                    link.latest_offer[offer.run_id] = offer
                    self._offered.set()
                    self._offered = trio.Event()
                    if self.on_offer is not None:
                        link.nursery.start_soon(self.on_offer, offer)
                elif kind == "cancel":
                    link.cancels.append(frame["runId"])
                    if (current := link.latest_offer.get(frame["runId"])) is not None:
                        current.cancelled = True
                    self.cancel_log.append((frame["runId"], link.number))
                    self._cancelled.set()
                    self._cancelled = trio.Event()
                elif kind in ("ok", "err") and frame.get("id") is not None:
                    link.replies[frame["id"]] = frame
                    link._replied.set()
                    link._replied = trio.Event()
        except ConnectionClosed as exc:
            link.close_reason = exc.reason
        finally:
            link.mark_risky()
            link.closed.set()
            link._replied.set()

    async def re_register(self) -> bool:
        """Publish the agents again on the current link (wakes declined heads)."""
        link = self.link
        if link is None:
            return False
        reply = await link.request(
            {
                "kind": "register",
                "agents": [
                    {"name": n, "description": f"{n} ({self.name})", "card": None, "metadata": None}
                    for n in self.agents
                ],
            }
        )
        return reply is not None and reply["kind"] == "ok"

    def cancelled(self, run_id: str) -> bool:
        return any(r == run_id for r, _ in self.cancel_log)

    async def wait_cancel(self, run_id: str, *, timeout: float = SAFETY) -> None:
        with trio.move_on_after(timeout):
            while not self.cancelled(run_id):
                await self._cancelled.wait()
            return
        raise AssertionError(f"{self.name}: no cancel frame for {run_id} within {timeout}s")

    def offers_of(self, run_id: str) -> list[Offer]:
        return [o for o in self.offer_log if o.run_id == run_id]

    async def wait_offer(
        self, predicate: Callable[[Offer], bool], *, after: int = 0, timeout: float = SAFETY
    ) -> Offer:
        """The first offer (from index `after` of the log) matching `predicate`."""
        with trio.move_on_after(timeout):
            i = after
            while True:
                while i < len(self.offer_log):
                    if predicate(self.offer_log[i]):
                        return self.offer_log[i]
                    i += 1
                await self._offered.wait()
        raise AssertionError(f"{self.name}: no matching offer within {timeout}s")


# ----------------------------------------------------------------------------- the server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: The start banner's first line (server.banner).
BANNER = re.compile(r"funduq-trio \S* ?serving on (http://\S+)")


class ServerProcess:
    """`python -m funduq_trio serve` as a child process, its stderr drained
    into `lines` (and a log file) so it can never block. On a fixed ``port``
    its URLs are known before it starts (a restart keeps them); on port 0
    its URL is read from the start banner."""

    def __init__(
        self, data_dir: Path, port: int, log_path: Path, *, name: str = "server", **settings: Any
    ) -> None:
        self.name = name
        self.data_dir = data_dir
        self.port = port
        self.log_path = log_path
        self.settings = settings
        self.process: trio.Process | None = None
        self.url: str | None = None
        self.lines: list[str] = []
        #: Set (and replaced) each time `lines` grows: `wait_logged` waits on it.
        self._more_lines = trio.Event()
        self._serving = trio.Event()
        self.exited = trio.Event()

    @property
    def base_url(self) -> str:
        if self.port:
            return f"http://127.0.0.1:{self.port}"
        assert self.url is not None, f"{self.name} is not serving"
        return self.url

    @property
    def provider_url(self) -> str:
        return "ws" + self.base_url[len("http") :] + "/ws/provider"

    def argv(self) -> list[str]:
        args = [sys.executable, "-m", "funduq_trio", "serve", "--host", "127.0.0.1"]
        args += ["--port", str(self.port), "--data-dir", str(self.data_dir)]
        for name, value in self.settings.items():
            args += ["--" + name.replace("_", "-"), str(value)]
        return args

    async def start(self, nursery: trio.Nursery) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith("FUNDUQ_")}
        env["PYTHONUNBUFFERED"] = "1"
        self.process = await trio.lowlevel.open_process(
            self.argv(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            env=env,
        )
        self._more_lines = trio.Event()  # a restart's lines are to come
        nursery.start_soon(self._drain)
        with trio.move_on_after(SAFETY):
            await self._serving.wait()
        if self.url is None:  # no banner: still starting after SAFETY, or exited
            self.kill9()
            raise AssertionError(f"{self.name} did not start:\n" + "\n".join(self.lines[-30:]))

    async def _drain(self) -> None:
        assert self.process is not None and self.process.stderr is not None
        buffer = b""
        async with await trio.open_file(self.log_path, "ab") as log:
            async for chunk in self.process.stderr:
                # The lines first, the file after: the file's write is a worker
                # thread's, which a busy host may leave waiting a while.
                buffer += chunk
                *complete, buffer = buffer.split(b"\n")
                for raw in complete:
                    line = raw.decode("utf-8", "replace")
                    self.lines.append(line)
                    found = BANNER.search(line)
                    if found and self.url is None:
                        self.url = found.group(1)
                        self._serving.set()
                if complete:
                    self._more_lines.set()
                    self._more_lines = trio.Event()
                await log.write(chunk)
        self._more_lines.set()  # no more to come: a waiter stops waiting
        await self.process.wait()
        self.exited.set()
        self._serving.set()

    def logged(self, text: str) -> list[str]:
        """The lines read so far holding ``text``. Lines reach here through a
        pipe and a task of this process, after the server wrote them: what the
        server did next (a metric, a frame) may be seen first. To check that a
        line was written, `wait_logged`; this is for what must not be."""
        return [line for line in self.lines if text in line]

    async def wait_logged(self, text: str, *, timeout: float = SAFETY) -> list[str]:
        """The lines holding ``text``, once one was read. The timeout is a
        safety net for a server that never writes it."""
        with trio.move_on_after(timeout):
            while not (found := self.logged(text)):
                more = self._more_lines
                if more.is_set():
                    break  # the server's stderr ended without it
                await more.wait()
            else:
                return found
        raise AssertionError(
            f"{self.name} logged no line with {text!r} (within {timeout}s):\n"
            + "\n".join(self.lines[-30:])
        )

    def kill9(self) -> None:
        """SIGKILL: no shutdown path runs, the record is left as the crash left
        it (on a shared record, its leases are left to lapse)."""
        if self.process is not None and self.process.returncode is None:
            self.process.send_signal(signal.SIGKILL)

    async def stop(self) -> int | None:
        """SIGTERM and wait: the orderly shutdown."""
        if self.process is None:
            return None
        if self.process.returncode is None:
            self.process.send_signal(signal.SIGTERM)
        with trio.move_on_after(SAFETY):
            await self.process.wait()
        if self.process.returncode is None:
            self.kill9()
        return await self.wait_dead()

    async def wait_dead(self) -> int | None:
        assert self.process is not None
        await self.process.wait()
        await self.exited.wait()
        return self.process.returncode


def sqlite_integrity(path: Path) -> str:
    """`PRAGMA integrity_check` of the SQLite file (the server must be stopped)."""
    import sqlite3

    conn = sqlite3.connect(path)
    try:
        rows = conn.execute("PRAGMA integrity_check").fetchall()
    finally:
        conn.close()
    return "; ".join(r[0] for r in rows)
