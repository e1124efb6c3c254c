"""The provider runtime: serve agents over the provider link.

An agent is an async generator of AG-UI events::

    async def echo(run_input: RunAgentInput) -> AsyncIterator[Event]: ...
    async def chatty(run_input: RunAgentInput, ctx: RunContext) -> AsyncIterator[Event]: ...

(the second form also gets the run's context: ids, offer metadata, whether a
cancel was asked for, and `await ctx.thread_messages(limit)`). Events may be
ag-ui-protocol models or plain JSON dicts.

`Provider` connects out to funduq, proves its key, optionally checks funduq's
key against a pinned one, publishes its agents and then:

* answers every offer at once, from what it already knows, never awaiting an
  agent: `refused` for an agent it does not serve or an input that does not
  validate as RunAgentInput, `declined` when it already holds
  `max_concurrent_runs` runs, otherwise `accepted`;
* when its writer is idle, lets an accepted run's agent start only once the
  answer is written, so the answer does not wait behind the agent's first
  events (when the writer is busy the answer queues behind what waits and
  the agent starts at once);
* runs each accepted run in its own task, reporting each event with a 1-based
  per-run `seq`, and always sending `finish` at the end, whether the agent
  returned, raised (a RUN_ERROR is reported first) or was cancelled;
* cancels a run's task when a `cancel` frame names it;
* serves KYOK offerings (`add_offering`, see `provider/llm.py`): publishes
  them with `register.llm`, runs each `complete` in its own task sending
  `chunk`s and `completion.end` / `completion.failed`, and cancels it on
  `abandon`;
* when funduq's hello lists the `batch` extension, writes whatever frames are
  queued when the socket is free as one `batch` message (at most
  `frames.BATCH_BYTES`), so a busy link carries a run's reports in a few messages
  rather than one each; a lone frame still goes out as itself;
* reconnects with exponential backoff when the link drops. Runs held on a
  dropped link are cancelled: funduq has already failed them
  (`provider_left_holding_it`) and would ignore anything more about them.

What is protocol (the handshake and its checks, decoding, batches, request
ids, what is a violation) is decided by `protocol/provider_link.py`'s
I/O-free `ProviderLinkMachine`; this module is its trio shell: it feeds the
machine each message and performs the actions it answers (docs/provider-link.md,
"The SDK's machine").

This package imports only trio, trio-websocket, pydantic, ag-ui-protocol,
cryptography, `funduq_trio.protocol` (frames, carriable, provider_link) and
`funduq_trio.identity`.
"""

from __future__ import annotations

import contextvars
import inspect
import itertools
import logging
import math
import random
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, aclosing, nullcontext
from dataclasses import dataclass, field
from typing import Any

import trio
from ag_ui.core import RunAgentInput, RunErrorEvent
from pydantic import BaseModel, ValidationError

from funduq_trio.identity import Identity, new_nonce
from funduq_trio.protocol import frames as f
from funduq_trio.protocol import provider_link as P

from . import llm
from .transport import Connection, Connector, LinkLost, websocket_connector

__all__ = [
    "Backoff",
    "ConnectRejected",
    "FunduqKeyMismatch",
    "Provider",
    "ProviderIdentity",
    "QueryFailed",
    "RegisterRejected",
    "RunContext",
    "current_run",
    "describe_validation_error",
]

log = logging.getLogger("funduq_trio.provider")

#: A provider's identity is an Ed25519 key like funduq's own.
ProviderIdentity = Identity

MiB = 1024 * 1024

_current_run: contextvars.ContextVar[RunContext] = contextvars.ContextVar("funduq_run")


def current_run() -> RunContext:
    """The context of the run whose task is calling (LookupError outside one)."""
    return _current_run.get()


class ConnectRejected(Exception):
    """funduq answered the handshake with `connect.err` (bad proof, key not allowed)."""


class FunduqKeyMismatch(Exception):
    """The funduq reached is not the pinned one (or could not prove it is)."""


class RegisterRejected(Exception):
    """funduq refused the agents this provider published."""


class QueryFailed(Exception):
    """funduq answered a query with `err`."""


#: The machine's faults, as the exceptions `Provider.run` raises.
_FAULTS: dict[P.Fault, type[Exception]] = {
    P.Fault.CONNECT_REJECTED: ConnectRejected,
    P.Fault.KEY_MISMATCH: FunduqKeyMismatch,
    P.Fault.REGISTER_REJECTED: RegisterRejected,
}


@dataclass(frozen=True)
class Backoff:
    """Delays between reconnection attempts: `initial * factor**attempt`, capped
    at `maximum`, each spread by +/- `jitter` (a fraction) so a fleet of
    providers does not reconnect in lockstep. Reset once a link registers."""

    initial: float = 0.5
    factor: float = 2.0
    maximum: float = 30.0
    jitter: float = 0.1

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        base = min(self.maximum, self.initial * self.factor ** min(attempt, 64))
        if self.jitter:
            base *= 1 + (rng or random).uniform(-self.jitter, self.jitter)
        return max(0.0, base)


def describe_validation_error(error: ValidationError) -> str:
    parts = []
    for item in error.errors(include_url=False, include_input=False):
        where = ".".join(str(p) for p in item["loc"]) or "input"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


@dataclass(eq=False)
class RunContext:
    """What a run's agent may know about the run besides its input."""

    run_id: str
    thread_id: str
    agent_name: str
    run_input: RunAgentInput
    metadata: dict[str, Any] | None
    arrival: int  # this runtime's count of accepted runs, in acceptance order
    cancel_requested: bool = False
    _link: _Link | None = field(default=None, repr=False)
    _identity: Identity | None = field(default=None, repr=False)

    @property
    def kyok(self) -> dict[str, str] | None:
        """The run's KYOK grant `{token, baseUrl}`, or None (no opt-in)."""
        return llm.kyok_grant(self.run_input)

    def kyok_client(self, **kwargs: Any) -> Any:
        """An `openai.AsyncOpenAI` spending this run's KYOK grant, each call
        signed with the provider's key (needs the `kyok` extra)."""
        grant = self.kyok
        if grant is None:
            raise LookupError(
                f"run {self.run_id} carries no KYOK grant: its caller opted into no LLM provider"
            )
        if self._identity is None:
            raise LookupError("this run context has no provider identity to sign with")
        return llm.kyok_client(grant, self._identity, **kwargs)

    async def thread_messages(self, limit: int | None = None) -> list[dict[str, Any]]:
        """The thread's messages as funduq recorded them (`limit` = the most
        recent N; None = all). For agents that keep no history of their own."""
        if self._link is None:
            raise LinkLost("this run's link is gone")
        return await self._link.query_thread_messages(self.thread_id, limit)


@dataclass
class _AgentEntry:
    name: str
    fn: Callable[..., Any]
    spec: f.AgentSpec
    wants_ctx: bool


@dataclass(eq=False)
class _Run:
    ctx: RunContext
    entry: _AgentEntry
    scope: trio.CancelScope = field(default_factory=trio.CancelScope)
    #: Set once the run's verdict is written; the agent starts after it
    #: (None: at once). See `_Link.verdict_written`.
    verdict_written: trio.Event | None = None


@dataclass
class _Offering:
    name: str
    fn: Callable[..., Any]
    spec: f.LlmOffering


@dataclass
class _Pending:
    """A query waiting for funduq's answer (P.QueryAnswered)."""

    done: trio.Event = field(default_factory=trio.Event)
    answer: P.QueryAnswered | None = None


def _wants_ctx(fn: Callable[..., Any]) -> bool:
    """Whether an agent takes (run_input, ctx) rather than (run_input). A
    wrapper may say so itself with a `funduq_wants_ctx` attribute."""
    declared = getattr(fn, "funduq_wants_ctx", None)
    if isinstance(declared, bool):
        return declared
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return False
    positional = [
        p
        for p in sig.parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.VAR_POSITIONAL)
    ]
    return len(positional) >= 2 or any(p.kind is p.VAR_POSITIONAL for p in positional)


#: Reports queued back to back before the runtime yields to the scheduler.
REPORTS_PER_YIELD = 64


class _Link:
    """One attached connection's trio side: its machine, its outbox, the
    runs and completions running on it, and the queries waiting for replies.
    Dies with the connection."""

    def __init__(
        self,
        conn: Connection,
        machine: P.ProviderLinkMachine,
        nursery: trio.Nursery,
        *,
        report_window: int,
        batch: bool = False,
    ) -> None:
        self.conn = conn
        self.machine = machine
        self.nursery = nursery
        self.batch = batch
        #: (text, a report?, set once written): what the writer sends.
        self.out_send, self.out_receive = trio.open_memory_channel[
            tuple[str, bool, trio.Event | None]
        ](math.inf)
        self.credits = trio.Semaphore(report_window)
        self._unyielded = 0  # reports queued since this link last yielded
        self.runs: dict[str, _Run] = {}
        self.completions: dict[str, trio.CancelScope] = {}  # KYOK, by completion id
        self.pending: dict[str, _Pending] = {}
        self.end_reason: str | None = None
        self.fatal: BaseException | None = None
        self._written: trio.Event | None = None  # see verdict_written

    def end(self, reason: str, fatal: BaseException | None = None) -> None:
        if self.end_reason is None:
            self.end_reason = reason
            self.fatal = fatal
        for pending in self.pending.values():
            pending.done.set()
        self.nursery.cancel_scope.cancel()

    def queue(self, actions: list[P.Action], written: trio.Event | None = None) -> None:
        """Queue the control frames of the machine's Send actions (never
        blocks, never waits behind credits); `written` is set once the last
        of them is written. Only Sends are expected here."""
        for index, action in enumerate(actions, 1):
            assert isinstance(action, P.Send) and not action.flow, action
            try:
                self.out_send.send_nowait(
                    (action.text, False, written if index == len(actions) else None)
                )
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                pass
        if written is not None and not actions:
            written.set()  # nothing to write (the link is closing): nothing to wait for

    def verdict_written(self) -> trio.Event | None:
        """What a run accepted in the message being answered waits for before
        its agent starts: the message's replies written. Only when the writer
        is idle now, so the write is the writer's next step: had the run's
        task started at once, its first step (often its whole agent) would
        run in the same scheduler round and, half the time, before the write
        (bench/README.md, "An offer answered before its run starts"). With
        the writer busy (None), the verdict queues behind what waits and the
        agent starts at once."""
        if self._written is None and self.out_receive.statistics().tasks_waiting_receive:
            self._written = trio.Event()
        return self._written

    def reply(self, actions: list[P.Action]) -> None:
        """Queue the replies to one message from funduq; the runs it accepted
        start their agents once the last is written."""
        written, self._written = self._written, None
        self.queue(actions, written)

    async def _send_flow(self, actions: list[P.Action]) -> None:
        """Queue a report or chunk under a credit (none when the link is gone)."""
        for action in actions:
            assert isinstance(action, P.Send) and action.flow, action
            await self._credit()
            try:
                self.out_send.send_nowait((action.text, True, None))
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                self.credits.release()

    async def _credit(self) -> None:
        """Take a report credit. With one free, yield to the scheduler only
        every `REPORTS_PER_YIELD` reports (a cancel still lands at once): an
        agent that yields its events back to back then queues them in one go,
        and the writer sends them as one batch instead of one message each."""
        await trio.lowlevel.checkpoint_if_cancelled()
        try:
            self.credits.acquire_nowait()
        except trio.WouldBlock:
            await self.credits.acquire()
            return
        self._unyielded += 1
        if self._unyielded >= REPORTS_PER_YIELD:
            self._unyielded = 0
            await trio.lowlevel.cancel_shielded_checkpoint()

    async def report(self, run_id: str, event: Any, seq: int) -> None:
        if not isinstance(event, (dict, BaseModel)):
            raise TypeError(f"the agent yielded {type(event).__name__}, not an AG-UI event")
        await self._send_flow(self.machine.report(run_id, event, seq))

    async def chunk(self, completion_id: str, data: str) -> None:
        """A KYOK chunk: flow-controlled like a report."""
        await self._send_flow(self.machine.chunk(completion_id, data))

    async def query_thread_messages(
        self, thread_id: str, limit: int | None
    ) -> list[dict[str, Any]]:
        request_id, actions = self.machine.query_thread_messages(thread_id, limit)
        if not actions:  # the machine is closed: the link is gone
            raise LinkLost(self.end_reason or "link lost")
        pending = self.pending[request_id] = _Pending()
        self.queue(actions)
        await pending.done.wait()
        self.pending.pop(request_id, None)
        answer = pending.answer
        if answer is None:
            raise LinkLost(self.end_reason or "link lost")
        if answer.error is not None:
            raise QueryFailed(answer.error)
        return list(answer.messages or [])


class Provider:
    """A provider runtime. See the module docstring.

    `identity`: the provider's `ProviderIdentity`. `url`: funduq's
    `ws://host:port/ws/provider`. `funduq_key`: pin funduq's public key (hex);
    the link is refused unless funduq proves it holds it.
    `max_concurrent_runs`: how many runs this provider holds at once (None =
    unlimited). `backoff`, `connector`, `rng`: reconnection and transport,
    injectable for tests.
    """

    def __init__(
        self,
        identity: Identity,
        url: str,
        *,
        funduq_key: str | None = None,
        max_concurrent_runs: int | None = None,
        backoff: Backoff | None = None,
        connector: Connector | None = None,
        max_frame_bytes: int = MiB,
        report_window: int = 256,
        retry_rejected: bool = False,
        rng: random.Random | None = None,
    ) -> None:
        if max_concurrent_runs is not None and max_concurrent_runs < 0:
            raise ValueError("max_concurrent_runs is a count (>= 0) or None for unlimited")
        self.identity = identity
        self.url = url
        self.funduq_key = funduq_key.lower() if funduq_key else None
        self.max_concurrent_runs = max_concurrent_runs
        self.backoff = backoff or Backoff()
        self.connector = connector or websocket_connector()
        self.max_frame_bytes = max_frame_bytes
        self.report_window = report_window
        self.retry_rejected = retry_rejected
        self.rng = rng
        self.agents: dict[str, _AgentEntry] = {}
        self.offerings: dict[str, _Offering] = {}
        self.registrations = 0  # links that published our agents, ever
        self.last_end_reason: str | None = None
        self._registered = trio.Event()
        self._arrivals = itertools.count(1)
        self._link: _Link | None = None

    # -- agents ------------------------------------------------------------------

    def add_agent(
        self,
        agent: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        card: dict[str, Any] | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Callable[..., Any]:
        """Serve `agent` under `name` (default: its function name)."""
        name = name or getattr(agent, "__name__", None)
        if not name:
            raise ValueError("an agent needs a name")
        if description is None:
            description = inspect.getdoc(agent) or ""
        spec = f.AgentSpec(name=name, description=description, card=card, metadata=metadata)
        self.agents[name] = _AgentEntry(name, agent, spec, _wants_ctx(agent))
        return agent

    def add_offering(
        self,
        offering: Callable[..., Any],
        *,
        name: str,
        description: str | None = None,
        metadata: dict[str, Any] | None = None,
    ) -> Callable[..., Any]:
        """Serve the KYOK offering `name`: `offering(request)` yields a
        completion's chunks (see `provider/llm.py`)."""
        if description is None:
            description = inspect.getdoc(offering) or ""
        spec = f.LlmOffering(name=name, description=description, metadata=metadata)
        self.offerings[name] = _Offering(name, offering, spec)
        return offering

    def agent(self, name: str | None = None, **details: Any) -> Callable[[Any], Any]:
        """Decorator form of `add_agent`."""

        def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
            return self.add_agent(fn, name=name, **details)

        return decorate

    @property
    def held_runs(self) -> frozenset[str]:
        """Run ids this provider holds on its current link."""
        return frozenset(self._link.runs) if self._link else frozenset()

    async def wait_registered(self, count: int = 1) -> None:
        """Wait until `count` links (in total) have published this provider's agents."""
        while self.registrations < count:
            await self._registered.wait()

    # -- the connection loop ------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve until cancelled, reconnecting when the link drops. `task_status`
        is reported started once the first link has published the agents.

        Raises ConnectRejected (unless `retry_rejected`), FunduqKeyMismatch
        and RegisterRejected: retrying those would only repeat them."""
        attempt = 0
        started = False

        def on_registered() -> None:
            nonlocal started, attempt
            attempt = 0
            if not started:
                started = True
                task_status.started()

        while True:
            try:
                reason = await self.serve_once(on_registered=on_registered)
            except ConnectRejected as exc:
                if not self.retry_rejected:
                    raise
                reason = f"connect refused: {exc}"
            self.last_end_reason = reason
            delay = self.backoff.delay(attempt, self.rng)
            attempt += 1
            log.warning("link to %s ended (%s); reconnecting in %.2fs", self.url, reason, delay)
            await trio.sleep(delay)

    async def serve_once(self, *, on_registered: Callable[[], None] | None = None) -> str:
        """One connection, from dial to drop. Returns why it ended."""
        reason = "link ended"
        error: Exception | None = None
        # Outcomes leave the nursery as values: an exception raised inside it
        # would come out wrapped in an ExceptionGroup.
        async with trio.open_nursery() as conn_nursery:
            try:
                conn = await self.connector(conn_nursery, self.url)
            except LinkLost as exc:
                reason = str(exc)
            else:
                try:
                    reason = await self._serve(conn, on_registered)
                except (ConnectRejected, FunduqKeyMismatch, RegisterRejected) as exc:
                    error = exc
                finally:
                    await conn.aclose()
            conn_nursery.cancel_scope.cancel()
        if error is not None:
            raise error
        return reason

    async def _handshake(self, conn: Connection, machine: P.ProviderLinkMachine) -> bool:
        """Feed the machine until it attaches; True when funduq takes batches.
        Raises the machine's fault, or LinkLost with why the link ended."""
        while True:
            try:
                text = await conn.receive()
            except LinkLost as exc:
                machine.connection_lost(str(exc))
                raise
            for action in machine.receive(text):
                if isinstance(action, P.Send):
                    await conn.send(action.text)
                elif isinstance(action, P.Attached):
                    return action.peer_takes_batches
                elif isinstance(action, P.End):
                    if action.fault is P.Fault.KEY_MISMATCH:
                        raise FunduqKeyMismatch(f"{action.reason} (at {self.url})")
                    if action.fault is not None:
                        raise _FAULTS[action.fault](action.reason)
                    raise LinkLost(action.reason)
                else:  # pragma: no cover - the machine emits nothing else before attaching
                    raise AssertionError(f"unexpected {action!r} during the handshake")

    async def _serve(self, conn: Connection, on_registered: Callable[[], None] | None) -> str:
        machine = P.ProviderLinkMachine(
            self.identity,
            new_nonce(),
            funduq_key=self.funduq_key,
            max_concurrent_runs=self.max_concurrent_runs,
            max_frame_bytes=self.max_frame_bytes,
        )
        try:
            batch = await self._handshake(conn, machine)
        except LinkLost as exc:
            return str(exc)
        async with trio.open_nursery() as nursery:
            link = _Link(conn, machine, nursery, report_window=self.report_window, batch=batch)
            self._link = link
            nursery.start_soon(self._writer, link)
            nursery.start_soon(self._reader, link, on_registered)
            if self.offerings:
                # Before `register`: its ok then also says the offerings are in.
                _, actions = machine.register_llm([o.spec for o in self.offerings.values()])
                link.queue(actions)
            _, actions = machine.register([a.spec for a in self.agents.values()])
            link.queue(actions)
        if self._link is link:
            self._link = None
        if link.fatal is not None:
            raise link.fatal
        return link.end_reason or "link ended"

    async def _writer(self, link: _Link) -> None:
        held: tuple[str, bool, trio.Event | None] | None = None  # taken, next to go
        try:
            while True:
                first = held if held is not None else await link.out_receive.receive()
                held = None
                out, reports, written = f.Outgoing(), int(first[1]), [first[2]]
                out.add(first[0])
                while link.batch:
                    try:
                        item = link.out_receive.receive_nowait()
                    except trio.WouldBlock:
                        break
                    if not out.add(item[0]):
                        held = item
                        break
                    reports += item[1]
                    written.append(item[2])
                await link.conn.send(out.message())
                for _ in range(reports):
                    link.credits.release()
                for event in written:
                    if event is not None:
                        event.set()
        except LinkLost as exc:
            link.queue(self._perform(link, link.machine.connection_lost(str(exc)), None))

    async def _reader(self, link: _Link, on_registered: Callable[[], None] | None) -> None:
        try:
            while True:
                text = await link.conn.receive()
                link.reply(self._perform(link, link.machine.receive(text), on_registered))
        except LinkLost as exc:
            link.queue(self._perform(link, link.machine.connection_lost(str(exc)), on_registered))

    def _perform(
        self, link: _Link, actions: list[P.Action], on_registered: Callable[[], None] | None
    ) -> list[P.Action]:
        """Carry out the machine's actions for one message from funduq, in
        order; answer the frames to send back (`_Link.reply`)."""
        replies: list[P.Action] = []
        for action in actions:
            if isinstance(action, P.Send):
                replies.append(action)
            elif isinstance(action, P.OfferArrived):
                verdict, reason = self._answer(link, action.offer)
                replies += link.machine.answer(action.offer.id, verdict, reason)
            elif isinstance(action, P.CancelArrived):
                run = link.runs.get(action.run_id)
                if run is not None:
                    run.ctx.cancel_requested = True
                    run.scope.cancel()
            elif isinstance(action, P.CompletionRequested):
                self._complete(link, action.request)
            elif isinstance(action, P.CompletionAbandoned):
                scope = link.completions.get(action.completion_id)
                if scope is not None:
                    scope.cancel()
            elif isinstance(action, P.QueryAnswered):
                pending = link.pending.get(action.request_id)
                if pending is not None:
                    pending.answer = action
                    pending.done.set()
            elif isinstance(action, P.Registered):
                self._on_registered(on_registered)
            elif isinstance(action, P.Notice):
                log.warning("%s", action.message)
            elif isinstance(action, P.End):
                fatal = _FAULTS[action.fault](action.reason) if action.fault else None
                link.end(action.reason, fatal)
            else:  # pragma: no cover - Attached comes only during the handshake
                raise AssertionError(f"unexpected {action!r} on an attached link")
        return replies

    def _on_registered(self, on_registered: Callable[[], None] | None) -> None:
        self.registrations += 1
        self._registered.set()
        self._registered = trio.Event()
        log.info("attached to %s serving %s", self.url, ", ".join(self.agents) or "nothing")
        if on_registered is not None:
            on_registered()

    # -- offers and runs ------------------------------------------------------------

    def _answer(self, link: _Link, offer: f.Offer) -> tuple[str, str | None]:
        """Decide an offer from what is already known: (verdict, reason). Never awaits."""
        run = offer.run
        entry = self.agents.get(run.agent_name)
        if entry is None:
            return "refused", f"agent {run.agent_name!r} is not served by this provider"
        try:
            run_input = RunAgentInput.model_validate(run.run_input)
        except ValidationError as exc:
            return "refused", (
                "input does not validate as RunAgentInput: " + describe_validation_error(exc)
            )
        if run.run_id in link.runs:
            return "declined", None
        if self.max_concurrent_runs is not None and len(link.runs) >= self.max_concurrent_runs:
            return "declined", None
        ctx = RunContext(
            run_id=run.run_id,
            thread_id=run.thread_id,
            agent_name=run.agent_name,
            run_input=run_input,
            metadata=run.metadata,
            arrival=next(self._arrivals),
            _link=link,
            _identity=self.identity,
        )
        held = _Run(ctx, entry, verdict_written=link.verdict_written())
        link.runs[run.run_id] = held
        admit = getattr(entry.fn, "admit", None)
        if callable(admit):
            admit(ctx)
        link.nursery.start_soon(self._run_task, link, held, name=f"run {run.run_id}")
        return "accepted", None

    def _complete(self, link: _Link, frame: f.Complete) -> None:
        """A KYOK completion: runs in its own task, never awaited here."""
        offering = self.offerings.get(frame.llm)
        if offering is None or frame.id in link.completions:
            link.queue(
                link.machine.completion_failed(
                    frame.id, f"no offering {frame.llm!r} here", {"reason": "unknown offering"}
                )
            )
            return
        scope = link.completions[frame.id] = trio.CancelScope()
        link.nursery.start_soon(
            self._completion_task, link, offering, frame, scope, name=f"completion {frame.id}"
        )

    async def _completion_task(
        self, link: _Link, offering: _Offering, frame: f.Complete, scope: trio.CancelScope
    ) -> None:
        ended: list[P.Action] | None = None
        try:
            with scope:
                try:
                    request = llm.CompletionRequest.from_frame(frame)
                    async with _closing(offering.fn(request).__aiter__()) as stream:
                        async for item in stream:
                            await link.chunk(frame.id, llm.chunk_text(item))
                    ended = link.machine.completion_end(frame.id)
                except llm.Refusal as exc:
                    ended = link.machine.completion_failed(frame.id, exc.message, exc.refusal)
                except Exception as exc:
                    log.exception("offering %s failed on %s", offering.name, frame.id)
                    ended = link.machine.completion_failed(frame.id, f"{type(exc).__name__}: {exc}")
        finally:
            link.completions.pop(frame.id, None)
            if ended is not None:  # abandoned: funduq reads nothing more of it
                link.queue(ended)

    async def _run_task(self, link: _Link, held: _Run) -> None:
        ctx = held.ctx
        _current_run.set(ctx)
        seq = 0
        try:
            with held.scope:
                if held.verdict_written is not None:
                    await held.verdict_written.wait()
                try:
                    args = (ctx.run_input, ctx) if held.entry.wants_ctx else (ctx.run_input,)
                    events = held.entry.fn(*args)
                    if not hasattr(events, "__aiter__"):
                        if inspect.iscoroutine(events):
                            events.close()
                        raise TypeError(
                            f"agent {held.entry.name!r} returned {type(events).__name__}, "
                            "not an async iterator of AG-UI events"
                        )
                    async with _closing(events.__aiter__()) as stream:
                        async for event in stream:
                            seq += 1
                            await link.report(ctx.run_id, event, seq)
                except Exception as exc:
                    log.exception("agent %s failed on run %s", held.entry.name, ctx.run_id)
                    seq += 1
                    error = RunErrorEvent(
                        message=f"{type(exc).__name__}: {exc}", code="agent_error"
                    )
                    await link.report(ctx.run_id, error, seq)
        finally:
            link.runs.pop(ctx.run_id, None)
            release = getattr(held.entry.fn, "release", None)
            if callable(release):
                release(ctx)
            link.queue(link.machine.finish(ctx.run_id))


def _closing(iterator: Any) -> AbstractAsyncContextManager[Any]:
    """aclosing() for async generators; a plain async iterator has nothing to close."""
    return aclosing(iterator) if hasattr(iterator, "aclose") else nullcontext(iterator)
