"""The AG-UI door: `POST /agui/{provider}/{agent}`, a `RunAgentInput` in, an SSE
stream of the run's AG-UI events out (DESIGN §5).

- The body must be JSON the provider link can carry (else 400 `invalid_json`:
  not JSON, NaN/Infinity, a lone surrogate anywhere, nesting past 100 levels;
  see `protocol/carriable.py`) validating as ag-ui's `RunAgentInput` (else
  400 `invalid_run_input` with pydantic's details). Either way nothing is
  recorded.
- Request-level metadata (`actorChain`, `presenter`, `resolution`, `kyok`) rides
  in `forwardedProps`.
- Without `resume` entries it starts a run: an unseen `threadId` starts a new
  funduq thread, and the caller's `runId` is replaced by funduq's. Both of
  funduq's ids ride every event.
- With `resume` entries it answers the thread's paused run (same run id, its
  event log continuing); the stream carries only what follows the answer. When
  the thread has no paused run nothing is started: the answer is the thread
  snapshot as JSON (200), the same body as `GET /threads/{id}`. On a bound
  thread the authority check comes first (DESIGN §8): without a valid
  resolution for its paused run *or* the `Funduq-Proof` read header, every
  resume answers 404 as an unknown thread, paused or not; with the read
  proof but no valid resolution, 403 (the reader may know the state).
- The stream relays the run's recorded events as produced, unknown types
  untouched, and ends when the run ends or pauses. If the first event it would
  relay is not `RUN_STARTED` (an offline agent's run is only its `RUN_ERROR`)
  the door sends a `RUN_STARTED` first, so an AG-UI client always sees a run
  begin before it ends.
- There is no cancel here: AG-UI has no cancel signal.
- Every event carries its run seq as the SSE `id`. `GET /agui/runs/{run_id}/events`
  re-attaches: with `Last-Event-ID` (or `?after=seq`) it relays the events after
  that seq, from the record and then live, until the run ends or pauses; it
  works for any run the record holds, across restarts. The synthesized
  `RUN_STARTED` carries the id of the cursor the stream opened at (0 for a new
  run) and is sent only by streams opened without a cursor, so re-attaching
  with any id received repeats nothing.

Errors are the broker's own exceptions, answered as JSON by the app
(unknown agent/thread 404, full thread 429, missing authority 403).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from ag_ui.core import EventType, RunStartedEvent
from pydantic import ValidationError
from quart import request
from quart_trio import QuartTrio
from werkzeug.exceptions import BadRequest

from ..broker.errors import (
    AgentNotFound,
    InvalidRunInput,
    NotAuthorized,
    RunNotFound,
    UnknownThread,
)
from ..broker.funduq import Funduq
from ..broker.quiet import Quiet
from ..protocol import agui, carriable
from .access import of_agent, reader_of
from .exchange import Answer, Json, Streamed, quart_response
from .sse import LAST_EVENT_ID, Identified, read_cursor, sse_response

# funduq's request-level keys, read off forwardedProps.
METADATA_KEYS = ("actorChain", "presenter", "resolution", "kyok")


# Deeper bodies are refused before anything walks them recursively (validation,
# the record's serializer): no real RunAgentInput comes near it.
MAX_NESTING = carriable.MAX_NESTING


class InvalidJSON(BadRequest):
    error_code = "invalid_json"


class InvalidCursor(BadRequest):
    error_code = "invalid_cursor"


async def readable_run(funduq: Funduq, run_id: str) -> dict[str, Any]:
    """The run's record for this request's reader, or RunNotFound (404) --
    the same answer for an unknown run and for a bound thread's run read
    without its proof (DESIGN §8)."""
    record = await funduq.read_run(run_id, reader_of(funduq, request))
    if record is None:
        raise RunNotFound(f"no run {run_id!r}")
    return record


def invalid_input(exc: ValidationError) -> InvalidRunInput:
    # What failed and where; not the offending input itself (it can be the whole body).
    details = [
        {"type": err["type"], "loc": list(err["loc"]), "msg": err["msg"]}
        for err in exc.errors(include_url=False, include_input=False, include_context=False)
    ]
    summary = "; ".join(
        f"{'.'.join(str(p) for p in err.get('loc', ())) or '(body)'}: {err.get('msg')}"
        for err in details[:5]
    )
    error = InvalidRunInput(f"input does not validate as RunAgentInput: {summary}")
    error.details = details  # type: ignore[attr-defined]
    return error


def request_metadata(forwarded_props: Any) -> dict[str, Any] | None:
    if not isinstance(forwarded_props, dict):
        return None
    metadata = {k: forwarded_props[k] for k in METADATA_KEYS if k in forwarded_props}
    return metadata or None


def mount_agui_door(app: QuartTrio, funduq: Funduq) -> None:
    @app.post("/agui/<provider>/<agent>")
    async def agui_run(provider: str, agent: str) -> Any:
        raw_body = await request.get_data()  # 413 past max_body_bytes
        return quart_response(await run_post(funduq, provider, agent, raw_body, request))

    @app.get("/agui/runs/<run_id>/events")
    async def agui_events(run_id: str) -> Any:
        """Re-attach to a run's stream after the cursor (see the module doc).
        Without a cursor it is the run's whole stream, opened as a POST's is."""
        header = request.headers.get(LAST_EVENT_ID)
        raw = header if header not in (None, "") else request.args.get("after")
        try:
            cursor = read_cursor(raw)
        except ValueError as exc:
            raise InvalidCursor(str(exc)) from None
        record = await readable_run(funduq, run_id)
        recorded = max((e["seq"] for e in record["events"]), default=0)
        if cursor is not None and cursor > recorded:
            raise InvalidCursor(f"cursor {cursor} is past the run's last event ({recorded})")
        return sse_response(
            relay(funduq, record["threadId"], run_id, cursor or 0, opening=cursor is None)
        )


async def run_post(
    funduq: Funduq, provider: str, agent: str, raw_body: bytes, request: Any
) -> Answer:
    """The answer to `POST /agui/{provider}/{agent}` with `raw_body` (see the
    module's doc): the run's stream, or the thread as JSON. Refusals raise
    (the app answers them, `web/exchange.py` `error_answer`)."""
    try:
        body = carriable.loads(raw_body)
    except (UnicodeDecodeError, ValueError) as exc:  # NotCarriable included
        raise InvalidJSON(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # nested past Python's own limit
        raise InvalidJSON(f"request body nests deeper than {MAX_NESTING} levels") from None
    # What the provider link cannot carry is refused here, before anything
    # is recorded: one such run used to break its provider's link for good.
    # Read once: the broker takes the input as read here (agui.RunInput).
    try:
        run_input = agui.RunInput(agui.read_run_input(body))
    except agui.InvalidInput as exc:
        if exc.errors is not None:
            raise invalid_input(exc.errors) from None
        raise InvalidJSON(
            f"request body cannot be carried to a provider: {exc.not_carriable}"
        ) from None

    view = funduq.find_agent(provider, agent)
    if view is None:
        raise AgentNotFound(f"no agent {agent!r} published by provider {provider!r}")
    metadata = request_metadata(run_input.get("forwardedProps"))
    thread_id = run_input["threadId"]

    if run_input.get("resume"):
        unknown = UnknownThread(f"no thread {thread_id!r} of agent {agent!r}")
        thread = await funduq.get_thread(thread_id)
        if not of_agent(thread, view.key, view.fingerprint, agent):
            raise unknown
        run_id = await funduq.paused_run(thread_id)
        bound = thread["segmentHead"] is not None
        if run_id is None:
            if bound and not await funduq.may_read(thread_id, reader_of(funduq, request)):
                raise unknown
            return Json(thread)
        record = await funduq.get_run(run_id)
        after_seq = max((e["seq"] for e in (record or {}).get("events", [])), default=0)
        try:
            ticket = await funduq.answer_pause(run_id, run_input, metadata=metadata)
        except NotAuthorized:
            # Refuse first, say nothing: only a reader of the thread may
            # learn that it has a paused run its answer failed to reach.
            if await funduq.may_read(thread_id, reader_of(funduq, request)):
                raise
            raise unknown from None
    else:
        after_seq = 0
        ticket = await funduq.start_run(
            provider,
            agent,
            run_input,
            thread_id=thread_id,
            metadata=metadata,
            create_unknown_thread=True,
        )

    quiet = Quiet()
    return Streamed(relay(funduq, ticket.thread_id, ticket.run_id, after_seq, quiet=quiet), quiet)


async def relay(
    funduq: Funduq,
    thread_id: str,
    run_id: str,
    after_seq: int,
    *,
    opening: bool = True,
    quiet: Quiet | None = None,
) -> AsyncIterator[list[Identified]]:
    """The run's events after `after_seq` in bursts, each with its seq as SSE id.
    An `opening` stream starts with a RUN_STARTED if the events don't: it is in
    no record, so it carries `after_seq`, the position it stands for, and a
    stream re-attached with that id (or any later) does not send it again.
    With a `quiet`, an empty burst when its wait ended without news."""
    started = not opening
    follow = funduq.follow(run_id, after_seq=after_seq, quiet=quiet)
    async with contextlib.aclosing(follow) as bursts:
        async for burst in bursts:
            if not burst:
                yield []
                continue
            events = [Identified(seq, event) for seq, event in burst]
            if not started and burst[0][1].get("type") != EventType.RUN_STARTED.value:
                opening_event = RunStartedEvent(thread_id=thread_id, run_id=run_id)
                events.insert(
                    0,
                    Identified(
                        after_seq,
                        opening_event.model_dump(mode="json", by_alias=True, exclude_none=True),
                    ),
                )
            started = True
            yield events
