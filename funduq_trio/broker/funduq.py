"""The ``Funduq`` facade: the one object the doors, the provider link and the
tests use. It owns the record, the provider registry, the live lanes and the
thread nurseries; everything a run goes through happens in its lane
(``lanes.py``) -- this module only starts lanes, routes requests to them and
reads the record.
"""

from __future__ import annotations

import bisect
import contextlib
import contextvars
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import trio

from ..config import OPERATOR_TOKEN, Settings
from ..identity import Identity, dispatch_hop, fingerprint_of
from ..protocol import agui, reasons
from ..protocol import statuses as st
from ..secret_file import load_or_create
from . import authority
from .errors import (
    AgentNotFound,
    InvalidRunInput,
    NotAuthorized,
    RunNotCancellable,
    RunNotFound,
    RunNotPaused,
    ThreadQueueFull,
    UnknownThread,
)
from .inbox import Cancel
from .lanes import Lane, ThreadLanes
from .metrics import Metrics
from .providers import AgentView, ProviderLink, Providers, ProviderSession
from .record import Record, dumps, iso, open_record

log = logging.getLogger("funduq")

#: Threads whose facts (segment head, message ids) stay cached while idle.
THREAD_CACHE = 16384

#: Request-level metadata keys that prove something to funduq; they are not
#: forwarded to providers.
PROOF_KEYS = ("cancel", "resolution")


@dataclass(frozen=True)
class RunTicket:
    run_id: str
    thread_id: str


@dataclass
class ThreadInfo:
    id: str
    key: str
    agent: str
    segment_head: str | None
    message_ids: set[str]
    message_count: int


_entropy = bytearray()


def _new_id(prefix: str) -> str:
    """``prefix_`` + 24 random hex digits. Ids are unguessable but never
    credentials; entropy is drawn from the OS in blocks, not per id."""
    global _entropy
    if len(_entropy) < 12:
        _entropy = bytearray(secrets.token_bytes(4096))
    chunk = _entropy[:12]
    del _entropy[:12]
    return f"{prefix}_{chunk.hex()}"


class Funduq:
    """The broker. ``async with Funduq(settings) as funduq: ...``"""

    def __init__(self, settings: Settings, *, identity: Identity | None = None) -> None:
        self.settings = settings
        self.identity = identity
        #: The operator's bearer token (see _load_operator_token).
        self.operator_token = ""
        self.record: Record
        self.providers: Providers
        self.lanes: dict[str, Lane] = {}
        self.threads: dict[str, ThreadLanes] = {}
        self.metrics = Metrics()
        self._thread_info: dict[str, ThreadInfo] = {}
        self._reserved: dict[str, int] = {}
        self._answering: dict[str, int] = {}
        self._arrival = 0
        self._nursery: trio.Nursery | None = None
        #: The context lanes start in (see _start_lane).
        self._context = contextvars.Context()
        self._stack = contextlib.AsyncExitStack()
        self.running = False

    # -- life ----------------------------------------------------------------------

    async def __aenter__(self) -> Funduq:
        await self._stack.__aenter__()
        try:
            self.record = await self._stack.enter_async_context(
                open_record(self.settings.database_path))
            if self.identity is None:
                self.identity = await trio.to_thread.run_sync(self._load_identity)
            self.operator_token = await trio.to_thread.run_sync(self._load_operator_token)
            self.providers = Providers(self.record, self.settings.quality_allowance,
                                       self._provider_thread_messages, self.metrics)
            self.providers.load()
            self._nursery = await self._stack.enter_async_context(trio.open_nursery())
            self._context = contextvars.copy_context()
            self._stack.callback(self._nursery.cancel_scope.cancel)
            await self._restore()
            self.running = True
        except BaseException:
            await self._stack.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(self, *exc: Any) -> bool | None:
        self.running = False
        return await self._stack.__aexit__(*exc)

    def _load_identity(self) -> Identity:
        if self.settings.identity_key:
            return Identity.from_private_hex(self.settings.identity_key)
        return Identity.load_or_create(self.settings.data_dir / "funduq.key")

    def _load_operator_token(self) -> str:
        """The token that lets the operator see everything (DESIGN §8):
        configured, or generated on first start and kept in the data directory."""
        if self.settings.operator_token:
            return self.settings.operator_token

        def read(text: str) -> str:
            if not OPERATOR_TOKEN.fullmatch(text):
                raise ValueError("it must hold one operator token")
            return text

        return load_or_create(self.settings.data_dir / "operator.token",
                              lambda: secrets.token_urlsafe(32), read)

    async def _restore(self) -> None:
        """After a restart: what nobody can still be holding fails
        ``orphaned_by_restart``; queued runs queue again in arrival order;
        paused runs stay answerable."""
        orphaned = tuple(st.ORPHANED_BY_RESTART)

        def read(conn: Any) -> tuple[int, list[Any], list[Any]]:
            arrival = conn.execute("SELECT COALESCE(MAX(arrival), 0) FROM runs").fetchone()[0]
            marks = ",".join("?" * len(orphaned))
            orphans = conn.execute(
                f"SELECT id, metadata, (SELECT COALESCE(MAX(seq), 0) FROM events e "
                f"WHERE e.run_id = r.id), EXISTS (SELECT 1 FROM events e WHERE e.run_id = r.id "
                f"AND json_extract(e.event, '$.type') = 'RUN_ERROR') "
                f"FROM runs r WHERE status IN ({marks})", orphaned).fetchall()
            queued = conn.execute(
                f"SELECT {_RUN_COLUMNS} FROM runs r WHERE status = ? ORDER BY arrival",
                (st.QUEUED,)).fetchall()
            return arrival, orphans, queued

        self._arrival, orphans, queued = await self.record.read(read)
        for run_id, metadata, last_seq, reported in orphans:
            metadata = json.loads(metadata)
            metadata["failureReason"] = reasons.ORPHANED_BY_RESTART
            error = agui.run_error(reasons.ORPHANED_BY_RESTART)
            events = [] if reported else [(last_seq + 1, error)]
            await self.record.move(run_id, st.FAILED, metadata=metadata, events=events,
                                   stamp=("completed_at", time.time()))
        for row in queued:
            row = _run_row(row)
            await self._thread(row["thread_id"])  # its history, for the replies it will add
            self._start_lane(row, arriving=False)
        if orphans or queued:
            log.info("restart: %d runs orphaned, %d queued again", len(orphans), len(queued))

    # -- lanes and threads ---------------------------------------------------------

    def _start_lane(self, row: dict[str, Any], *, arriving: bool) -> Lane:
        # A task inherits the context of whoever starts it, and a caller's
        # carries its whole HTTP request (quart keeps it in a context
        # variable): a waiting run would hold the request it came in on.
        # Lanes and thread tasks start in the broker's own context instead.
        return self._context.run(self._start_lane_here, row, arriving)

    def _start_lane_here(self, row: dict[str, Any], arriving: bool) -> Lane:
        lane = Lane(self, row, arriving=arriving)
        self.lanes[lane.run_id] = lane
        thread = self.threads.get(lane.thread_id)
        if thread is None:
            thread = self.threads[lane.thread_id] = ThreadLanes(lane.thread_id)
            self._nursery.start_soon(thread.hold, name=f"thread {lane.thread_id}")
        lane.thread = thread
        thread.enqueue(lane)
        thread.start(lane)
        return lane

    def _lane_ended(self, lane: Lane) -> None:
        log.debug("run %s ended %s%s", lane.run_id, lane.status,
                  f" ({lane.metadata['failureReason']})"
                  if "failureReason" in (lane.metadata or {}) else "")
        if self.lanes.get(lane.run_id) is lane:
            del self.lanes[lane.run_id]
        thread = lane.thread
        if thread is not None and thread.ended(lane) and self.threads.get(thread.id) is thread:
            del self.threads[thread.id]
            if len(self._thread_info) > max(THREAD_CACHE, 2 * len(self.threads)):
                self._forget_idle_threads()

    def _forget_idle_threads(self) -> None:
        """Keep the thread cache bounded: forget the least recently used
        threads nobody is using right now (the record still has them)."""
        keep = THREAD_CACHE * 3 // 4
        for tid in list(self._thread_info):
            if len(self._thread_info) <= keep:
                return
            if tid not in self.threads and tid not in self._reserved \
                    and tid not in self._answering:
                del self._thread_info[tid]

    def _offer_payload(self, lane: Lane) -> dict[str, Any]:
        run_input = json.loads(lane.run_input_json)
        caller_metadata = json.loads(lane.caller_metadata_json)
        forwarded = run_input.get("forwardedProps")
        if isinstance(forwarded, dict):
            # Proofs were for funduq; the provider gets the props without them.
            forwarded = {k: v for k, v in forwarded.items() if k not in PROOF_KEYS}
            run_input = {**run_input, "forwardedProps": forwarded}
        chain = caller_metadata.get("actorChain")
        if isinstance(chain, list) and chain:
            # The chain as funduq dispatched it: the caller's hops verbatim plus
            # one hop of funduq's naming where it went.
            hop = dispatch_hop(self.identity, chain[-1], lane.key, lane.agent)
            forwarded = dict(forwarded) if isinstance(forwarded, dict) else {}
            forwarded["actorChain"] = [*chain, hop]
            run_input = {**run_input, "forwardedProps": forwarded}
        metadata = {k: v for k, v in caller_metadata.items() if k not in PROOF_KEYS}
        return {"runId": lane.run_id, "threadId": lane.thread_id, "agentName": lane.agent,
                "runInput": run_input, "metadata": metadata}

    # -- providers (the port the link plugs into) -----------------------------------

    def attach_provider(self, public_key: str, max_concurrent_runs: int | None,
                        link: ProviderLink) -> ProviderSession:
        return self.providers.attach(public_key, max_concurrent_runs, link)

    def find_agent(self, provider: str, agent: str) -> AgentView | None:
        key = self.providers.resolve_key(provider)
        return None if key is None else self.providers.view(key, agent)

    async def roster(self) -> list[dict[str, Any]]:
        return [v.as_json() for v in self.providers.roster()]

    def provider_quality(self) -> list[dict[str, Any]]:
        """Every provider funduq has met: online or not, its quality counters
        and the allowance they are withdrawn at (the operator's view)."""
        providers = self.providers
        return [{"provider": key, "fingerprint": fingerprint_of(key),
                 "online": key in providers.sessions and providers.sessions[key].live,
                 "counters": dict(counts), "allowance": providers.allowance}
                for key, counts in sorted(providers.counters.items())]

    async def _provider_thread_messages(self, key: str, thread_id: str,
                                        limit: int | None) -> list[dict[str, Any]]:
        info = await self._thread(thread_id)
        if info is None or info.key != key:
            raise UnknownThread(thread_id)
        return await self._messages(thread_id, limit)

    # -- callers ---------------------------------------------------------------------

    async def start_run(
        self, provider: str, agent: str, run_input: Any, *, thread_id: str | None = None,
        metadata: dict[str, Any] | None = None, create_unknown_thread: bool = False,
    ) -> RunTicket:
        view = self.find_agent(provider, agent)
        if view is None:
            raise AgentNotFound(f"no agent {agent!r} published by provider {provider!r}")
        key = view.key
        try:
            run_input = agui.read_run_input(run_input)
        except agui.InvalidInput as exc:
            raise InvalidRunInput(str(exc)) from None
        metadata = dict(metadata or {})
        info = await self._thread(thread_id) if thread_id is not None else None
        if info is not None and (info.key, info.agent) != (key, agent):
            info = None
        if info is None and thread_id is not None and not create_unknown_thread:
            raise UnknownThread(f"unknown thread {thread_id!r} for this agent")
        chain = metadata.get("actorChain")
        if info is None:
            head = authority.segment_head_of(chain) if chain is not None else None
        else:
            authority.check_write(info.segment_head, chain, key)
        tid = info.id if info is not None else _new_id("thread")
        self._reserve(tid)
        try:
            run_id = _new_id("run")
            run_input["threadId"], run_input["runId"] = tid, run_id
            if info is None:
                info = ThreadInfo(tid, key, agent, head, set(), 0)
                self._thread_info[tid] = info
                new_thread = (tid, key, agent, head, time.time())
            else:
                new_thread = None
            messages = self._new_messages(info, run_input, run_id)
            self._arrival += 1
            # The input and the caller's metadata are kept as the record's JSON
            # text (read again only for the offer): a waiting run holds one
            # string each, not a tree of dicts.
            row = {"id": run_id, "thread_id": tid, "provider_key": key, "agent_name": agent,
                   "status": st.QUEUED, "input": dumps(run_input),
                   "caller_metadata": dumps(metadata), "metadata": {}, "next_seq": 1,
                   "arrival": self._arrival, "created_at": time.time()}
            await self.record.write(lambda c: _insert_run(c, row, new_thread, messages))
        finally:
            self._reserved[tid] -= 1
            if not self._reserved[tid]:
                del self._reserved[tid]
        self._start_lane(row, arriving=True)
        self.metrics.runs_started += 1
        log.debug("run %s queued on thread %s for %s/%s", run_id, tid, fingerprint_of(key), agent)
        return RunTicket(run_id, tid)

    def _reserve(self, thread_id: str) -> None:
        """Count a run against the thread's queue limit before any await, so
        two utterances racing cannot both take the last slot."""
        thread = self.threads.get(thread_id)
        pending = (len(thread.pending) if thread else 0) + self._reserved.get(thread_id, 0)
        if pending >= self.settings.thread_queue_limit:
            raise ThreadQueueFull(
                f"thread {thread_id} already holds {pending} pending runs "
                f"(limit {self.settings.thread_queue_limit}); retry once one is taken")
        self._reserved[thread_id] = self._reserved.get(thread_id, 0) + 1

    def _new_messages(self, info: ThreadInfo, run_input: dict[str, Any],
                      run_id: str) -> list[tuple[Any, ...]]:
        """Messages the thread has not seen yet. Earlier messages the thread
        holds are history a caller re-sent; the last one is always the new
        utterance, and keeps its caller's id unless the thread already holds it."""
        rows = []
        messages = run_input.get("messages") or []
        for i, message in enumerate(messages):
            mid = message.get("id")
            last = i == len(messages) - 1
            if mid in info.message_ids:
                if not last:
                    continue
                message["id"] = mid = _new_id("msg")
            rows.append((info.id, info.message_count, mid, run_id, dumps(message)))
            info.message_ids.add(mid)
            info.message_count += 1
        return rows

    def _replies_writer(self, lane: Lane) -> Any:
        """The write that appends a run's assistant replies to its thread's
        history, done in the same transaction as the run's settling."""
        info = self._thread_info.get(lane.thread_id)
        replies = lane.replies()
        if not replies or info is None:
            return None
        rows = []
        for message in replies:
            if message["id"] in info.message_ids:
                continue
            rows.append((info.id, info.message_count, message["id"], lane.run_id, dumps(message)))
            info.message_ids.add(message["id"])
            info.message_count += 1
        return lambda conn: conn.executemany(_INSERT_MESSAGE, rows)

    async def follow(self, run_id: str, after_seq: int = 0
                     ) -> AsyncIterator[list[tuple[int, dict[str, Any]]]]:
        """The run's events after ``after_seq`` as (seq, event), in order, each
        durable before it is yielded; ends once the run settles or pauses.

        Events come in bursts -- a non-empty list of whatever was recorded
        together -- so a stream can write a burst as one chunk: a provider's
        batch of a dozen events is then one socket write, not a dozen."""
        lane = self.lanes.get(run_id)
        if lane is None:
            if not await self._run_exists(run_id):
                raise RunNotFound(run_id)
            recorded = await self._events(run_id, after_seq)
            if recorded:
                yield recorded
            return
        feed = lane.feed
        if after_seq < feed.first_seq - 1:
            recorded = await self._events(run_id, after_seq, feed.first_seq)
            if recorded:
                yield recorded
        index = bisect.bisect_right(feed.events, after_seq, key=lambda item: item[0])
        while True:
            if index < len(feed.events):
                burst = feed.events[index:]
                index += len(burst)
                yield burst
                continue  # more may have come (and the feed closed) meanwhile
            if feed.closed:
                return
            await feed.changed()

    def gauges(self) -> dict[str, tuple[str, float]]:
        """The current values `GET /metrics` shows beside the counters."""
        return {
            "funduq_runs_live": ("Runs with a lane: queued, offering, running, cancelling.",
                                 len(self.lanes)),
            "funduq_threads_live": ("Threads with a live run.", len(self.threads)),
            "funduq_providers_attached": ("Provider links attached.",
                                          sum(s.live for s in self.providers.sessions.values())),
        }

    def live_record(self, run_id: str) -> dict[str, Any] | None:
        """A live run's record as its lane knows it, taken without awaiting
        anything -- so a stream opened right after ``start_run`` always starts
        from the run as it arrived. None when no lane has the whole record."""
        lane = self.lanes.get(run_id)
        return lane.snapshot() if lane is not None else None

    async def wait_run(self, run_id: str) -> dict[str, Any]:
        """Wait until the run settles or pauses; return its record."""
        lane = self.lanes.get(run_id)
        if lane is not None:
            await lane.ended()
            run = lane.snapshot()
            if run is not None:
                return run
        run = await self.get_run(run_id)
        if run is None:
            raise RunNotFound(run_id)
        return run

    async def cancel_run(self, run_id: str, *, proof: Any = None) -> dict[str, Any]:
        """Ask to stop a run. Authority is checked before anything about the
        run's state is revealed."""
        facts = await self._run_facts(run_id)
        if facts is None:
            raise RunNotFound(run_id)
        segment_head, key = facts
        by = None
        if segment_head is not None:
            by = authority.check_cancel(proof, run_id, (segment_head, key), time.time())
        lane = self.lanes.get(run_id)
        if lane is None or lane.status not in st.MOVES[st.CANCELLED] | st.HELD:
            raise _not_cancellable(run_id)
        cancel = Cancel(by)
        lane.tell(cancel)
        if not lane.awaiting_answer:
            # An offering run reads the cancel only after the provider's answer;
            # don't hold the caller for that.
            await cancel.seen.wait()
            if cancel.refused:
                raise _not_cancellable(run_id)
            if cancel.record is not None:
                return cancel.record
        run = await self.get_run(run_id)
        assert run is not None
        return run

    async def paused_run(self, thread_id: str) -> str | None:
        return await self.record.read(lambda c: _scalar(c.execute(
            "SELECT id FROM runs WHERE thread_id=? AND status=? ORDER BY arrival DESC LIMIT 1",
            (thread_id, st.INPUT_REQUIRED))))

    async def answer_pause(self, run_id: str, run_input: Any, *,
                           metadata: dict[str, Any] | None = None) -> RunTicket:
        """Answer a paused run: the same run id is queued again, offered in its
        thread's order, its event log continuing."""
        facts = await self._run_facts(run_id)
        if facts is None:
            raise RunNotFound(run_id)
        segment_head, key = facts
        metadata = dict(metadata or {})
        by = None
        if segment_head is not None:
            by = authority.check_resolution(metadata.get("resolution"), run_id,
                                            (segment_head, key), time.time())
        try:
            run_input = agui.read_run_input(run_input)
        except agui.InvalidInput as exc:
            raise InvalidRunInput(str(exc)) from None
        row = await self.record.read(lambda c: c.execute(
            f"SELECT {_RUN_COLUMNS} FROM runs r WHERE id=?", (run_id,)).fetchone())
        row = _run_row(row)
        if row["status"] != st.INPUT_REQUIRED or run_id in self.lanes:
            raise RunNotPaused(f"run {run_id} is not waiting for an answer")
        run_input = {**run_input, "threadId": row["thread_id"], "runId": run_id}
        marks = row["metadata"].setdefault("funduq", {})
        marks["answeredBy"] = by
        marks.pop("cancelRequestedBy", None)  # the new turn is nobody's to stop yet
        caller = dumps({**json.loads(row["caller_metadata"]),
                        **{k: v for k, v in metadata.items() if k not in PROOF_KEYS}})
        tid = row["thread_id"]
        info = await self._thread(tid)
        messages = self._new_messages(info, run_input, run_id) if info else []
        row["input"], row["caller_metadata"] = dumps(run_input), caller
        self._arrival += 1
        arrival = self._arrival
        self._answering[tid] = self._answering.get(tid, 0) + 1  # keep its info cached

        def reopen(conn: Any) -> bool:
            moved = conn.execute(
                "UPDATE runs SET status=?, input=?, metadata=?, caller_metadata=?, arrival=?, "
                "completed_at=NULL WHERE id=? AND status=?",
                (st.QUEUED, row["input"], dumps(row["metadata"]), caller, arrival,
                 run_id, st.INPUT_REQUIRED)).rowcount == 1
            if moved and messages:
                conn.executemany(_INSERT_MESSAGE, messages)
            return moved

        try:
            if not await self.record.write(reopen) or run_id in self.lanes:
                raise RunNotPaused(f"run {run_id} is not waiting for an answer")
            row["status"] = st.QUEUED
            self._start_lane(row, arriving=False)
        finally:
            self._answering[tid] -= 1
            if not self._answering[tid]:
                del self._answering[tid]
        return RunTicket(run_id, row["thread_id"])

    # -- reading the record ------------------------------------------------------------

    async def get_run(self, run_id: str) -> dict[str, Any] | None:
        def read(conn: Any) -> Any:
            row = conn.execute(
                "SELECT id, thread_id, provider_key, agent_name, status, metadata, created_at, "
                "started_at, completed_at FROM runs WHERE id=?", (run_id,)).fetchone()
            if row is None:
                return None
            events = conn.execute("SELECT seq, event FROM events WHERE run_id=? ORDER BY seq",
                                  (run_id,)).fetchall()
            return row, events

        found = await self.record.read(read)
        if found is None:
            return None
        row, events = found
        return {**_run_json(row), "events": [{"seq": s, "event": json.loads(e)} for s, e in events]}

    async def list_runs(self, *, thread_id: str | None = None, provider: str | None = None,
                        agent: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
        where, args = [], []
        if thread_id is not None:
            where.append("thread_id=?")
            args.append(thread_id)
        if provider is not None:
            where.append("provider_key=?")
            args.append(self.providers.resolve_key(provider) or provider)
        if agent is not None:
            where.append("agent_name=?")
            args.append(agent)
        sql = ("SELECT id, thread_id, provider_key, agent_name, status, metadata, created_at, "
               "started_at, completed_at FROM runs" + (" WHERE " + " AND ".join(where) if where
                                                       else "") + " ORDER BY arrival DESC LIMIT ?")
        rows = await self.record.read(lambda c: c.execute(sql, (*args, limit)).fetchall())
        return [_run_json(r) for r in rows]

    async def get_thread(self, thread_id: str) -> dict[str, Any] | None:
        info = await self._thread(thread_id)
        if info is None:
            return None

        def read(conn: Any) -> list[Any]:
            return conn.execute("SELECT id, status FROM runs WHERE thread_id=? ORDER BY arrival",
                                (thread_id,)).fetchall()

        runs = await self.record.read(read)
        return {"threadId": thread_id, "agent": {"provider": info.key, "name": info.agent},
                "segmentHead": info.segment_head, "messages": await self._messages(thread_id),
                "runs": [{"runId": r, "status": s} for r, s in runs]}

    async def ready(self) -> bool:
        """Readiness: the broker runs and the record answers."""
        if not self.running:
            return False
        try:
            await self.record.read(lambda c: c.execute("SELECT 1").fetchone())
        except Exception:  # noqa: BLE001 -- any failure means not ready
            return False
        return True

    async def _thread(self, thread_id: str) -> ThreadInfo | None:
        info = self._thread_info.pop(thread_id, None)
        if info is not None:
            self._thread_info[thread_id] = info  # most recently used last
            return info

        def read(conn: Any) -> Any:
            row = conn.execute("SELECT provider_key, agent_name, segment_head FROM threads "
                               "WHERE id=?", (thread_id,)).fetchone()
            if row is None:
                return None
            ids = [r[0] for r in conn.execute(
                "SELECT message_id FROM messages WHERE thread_id=?", (thread_id,))]
            return row, ids

        found = await self.record.read(read)
        if found is None:
            return None
        (key, agent, head), ids = found
        info = self._thread_info.setdefault(
            thread_id, ThreadInfo(thread_id, key, agent, head, set(ids), len(ids)))
        return info

    async def _messages(self, thread_id: str, limit: int | None = None) -> list[dict[str, Any]]:
        def read(conn: Any) -> list[Any]:
            if limit is None:
                return conn.execute("SELECT message FROM messages WHERE thread_id=? ORDER BY idx",
                                    (thread_id,)).fetchall()
            rows = conn.execute("SELECT message FROM messages WHERE thread_id=? "
                                "ORDER BY idx DESC LIMIT ?", (thread_id, limit)).fetchall()
            return rows[::-1]

        return [json.loads(m) for (m,) in await self.record.read(read)]

    async def _events(self, run_id: str, after: int, before: int | None = None
                      ) -> list[tuple[int, dict[str, Any]]]:
        def read(conn: Any) -> list[Any]:
            return conn.execute(
                "SELECT seq, event FROM events WHERE run_id=? AND seq>? AND seq<? ORDER BY seq",
                (run_id, after, before if before is not None else 2**62)).fetchall()

        return [(s, json.loads(e)) for s, e in await self.record.read(read)]

    async def _run_exists(self, run_id: str) -> bool:
        return await self.record.read(lambda c: c.execute(
            "SELECT 1 FROM runs WHERE id=?", (run_id,)).fetchone() is not None)

    async def _run_facts(self, run_id: str) -> tuple[str | None, str] | None:
        """(segment head of its thread, its provider key), or None."""
        lane = self.lanes.get(run_id)
        if lane is not None:
            info = await self._thread(lane.thread_id)
            return (info.segment_head if info else None), lane.key
        return await self.record.read(lambda c: c.execute(
            "SELECT t.segment_head, r.provider_key FROM runs r JOIN threads t "
            "ON t.id = r.thread_id WHERE r.id=?", (run_id,)).fetchone())


# -- SQL helpers -----------------------------------------------------------------------

_RUN_COLUMNS = ("id, thread_id, provider_key, agent_name, status, input, caller_metadata, "
                "metadata, arrival, created_at, started_at, "
                "(SELECT COALESCE(MAX(seq), 0) + 1 FROM events e WHERE e.run_id = r.id)")
_INSERT_MESSAGE = ("INSERT INTO messages (thread_id, idx, message_id, run_id, message) "
                   "VALUES (?,?,?,?,?)")


def _run_row(row: Any) -> dict[str, Any]:
    """A run's row; its input and caller metadata stay JSON text."""
    rid, tid, key, agent, status, run_input, caller, metadata, arrival, created, started, \
        next_seq = row
    return {"id": rid, "thread_id": tid, "provider_key": key, "agent_name": agent,
            "created_at": created, "started_at": started,
            "status": status, "input": run_input,
            "caller_metadata": caller, "metadata": json.loads(metadata),
            "arrival": arrival, "next_seq": next_seq}


def _run_json(row: Any) -> dict[str, Any]:
    rid, tid, key, agent, status, metadata, created, started, completed = row
    return {"runId": rid, "threadId": tid, "agent": {"provider": key, "name": agent},
            "status": status, "metadata": json.loads(metadata), "createdAt": iso(created),
            "startedAt": iso(started), "completedAt": iso(completed)}


def _insert_run(conn: Any, row: dict[str, Any], new_thread: tuple[Any, ...] | None,
                messages: list[tuple[Any, ...]]) -> None:
    if new_thread is not None:
        conn.execute("INSERT INTO threads (id, provider_key, agent_name, segment_head, created_at)"
                     " VALUES (?,?,?,?,?)", new_thread)
    conn.execute(
        "INSERT INTO runs (arrival, id, thread_id, provider_key, agent_name, status, input, "
        "caller_metadata, metadata, created_at) VALUES (?,?,?,?,?,?,?,?,?,?)",
        (row["arrival"], row["id"], row["thread_id"], row["provider_key"], row["agent_name"],
         row["status"], row["input"], row["caller_metadata"],
         dumps(row["metadata"]), row["created_at"]))
    if messages:
        conn.executemany(_INSERT_MESSAGE, messages)


def _not_cancellable(run_id: str) -> RunNotCancellable:
    return RunNotCancellable(f"run {run_id} is paused or has ended; nothing to stop")


def _scalar(cursor: Any) -> Any:
    row = cursor.fetchone()
    return None if row is None else row[0]


__all__ = ["Funduq", "RunTicket", "NotAuthorized"]
