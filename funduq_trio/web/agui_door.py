"""The AG-UI door: `POST /agui/{provider}/{agent}`, a `RunAgentInput` in, an SSE
stream of the run's AG-UI events out (DESIGN §5).

- The body must be JSON (else 400 `invalid_json`) validating as ag-ui's
  `RunAgentInput` (else 400 `invalid_run_input` with pydantic's details).
  Either way nothing is recorded.
- Request-level metadata (`actorChain`, `resolution`, `kyok`) rides in `forwardedProps`.
- Without `resume` entries it starts a run: an unseen `threadId` starts a new
  funduq thread, and the caller's `runId` is replaced by funduq's. Both of
  funduq's ids ride every event.
- With `resume` entries it answers the thread's paused run (same run id, its
  event log continuing); the stream carries only what follows the answer. When
  the thread has no paused run nothing is started: the answer is the thread
  snapshot as JSON (200), the same body as `GET /threads/{id}`.
- The stream relays the run's recorded events as produced, unknown types
  untouched, and ends when the run ends or pauses. If the first event it would
  relay is not `RUN_STARTED` (an offline agent's run is only its `RUN_ERROR`)
  the door sends a `RUN_STARTED` first, so an AG-UI client always sees a run
  begin before it ends.
- There is no cancel here: AG-UI has no cancel signal.

Errors are the broker's own exceptions, answered as JSON by the app
(unknown agent/thread 404, full thread 429, missing authority 403).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

from ag_ui.core import EventType, RunAgentInput, RunStartedEvent
from pydantic import ValidationError
from quart import jsonify, request
from quart_trio import QuartTrio
from werkzeug.exceptions import BadRequest

from ..broker.errors import AgentNotFound, InvalidRunInput, UnknownThread
from ..broker.funduq import Funduq
from .sse import sse_response

# funduq's request-level keys, read off forwardedProps.
METADATA_KEYS = ("actorChain", "resolution", "kyok")


# Deeper bodies are refused before anything walks them recursively (validation,
# the record's serializer): no real RunAgentInput comes near it.
MAX_NESTING = 100


def nesting(value: Any) -> int:
    """How deep JSON containers nest in `value` (a scalar is 0), without recursing."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        deepest = max(deepest, depth)
        if deepest > MAX_NESTING:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


class InvalidJSON(BadRequest):
    error_code = "invalid_json"


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


def _same_agent(thread: dict[str, Any], key: str, fingerprint: str, name: str) -> bool:
    agent = thread.get("agent") or {}
    return agent.get("name") == name and agent.get("provider") in (key, fingerprint)


def mount_agui_door(app: QuartTrio, funduq: Funduq) -> None:
    @app.post("/agui/<provider>/<agent>")
    async def agui_run(provider: str, agent: str) -> Any:
        raw_body = await request.get_data()  # 413 past max_body_bytes
        try:
            body = json.loads(raw_body)
        except (UnicodeDecodeError, ValueError) as exc:
            raise InvalidJSON(f"request body is not valid JSON: {exc}") from None
        except RecursionError:  # nested past Python's own limit
            raise InvalidJSON(f"request body nests deeper than {MAX_NESTING} levels") from None
        if nesting(body) > MAX_NESTING:
            raise InvalidJSON(f"request body nests deeper than {MAX_NESTING} levels")
        try:
            run_input = RunAgentInput.model_validate(body)
        except ValidationError as exc:
            raise invalid_input(exc) from None

        view = funduq.find_agent(provider, agent)
        if view is None:
            raise AgentNotFound(f"no agent {agent!r} published by provider {provider!r}")
        metadata = request_metadata(run_input.forwarded_props)

        if run_input.resume:
            thread_id = run_input.thread_id
            thread = await funduq.get_thread(thread_id)
            if thread is None or not _same_agent(thread, view.key, view.fingerprint, agent):
                raise UnknownThread(f"no thread {thread_id!r} of agent {agent!r}")
            run_id = await funduq.paused_run(thread_id)
            if run_id is None:
                return jsonify(thread)
            record = await funduq.get_run(run_id)
            after_seq = max((e["seq"] for e in (record or {}).get("events", [])), default=0)
            ticket = await funduq.answer_pause(run_id, body, metadata=metadata)
        else:
            after_seq = 0
            ticket = await funduq.start_run(
                provider,
                agent,
                body,
                thread_id=run_input.thread_id,
                metadata=metadata,
                create_unknown_thread=True,
            )

        return sse_response(relay(funduq, ticket.thread_id, ticket.run_id, after_seq))


async def relay(
    funduq: Funduq, thread_id: str, run_id: str, after_seq: int
) -> AsyncIterator[list[dict[str, Any]]]:
    """The run's events after `after_seq` in bursts, opened by a RUN_STARTED if
    they aren't."""
    started = False
    async with contextlib.aclosing(funduq.follow(run_id, after_seq=after_seq)) as bursts:
        async for burst in bursts:
            events = [event for _seq, event in burst]
            if not started and events[0].get("type") != EventType.RUN_STARTED.value:
                opening = RunStartedEvent(thread_id=thread_id, run_id=run_id)
                events.insert(0, opening.model_dump(mode="json", by_alias=True,
                                                    exclude_none=True))
            started = True
            yield events
