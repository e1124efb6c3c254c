"""AG-UI, as funduq reads it: which events are known, malformed or merely new,
what a finished stream says, and the RUN_ERROR funduq writes when a run fails
without saying so itself. I/O-free; event names come from ag-ui's EventType."""

from __future__ import annotations

import functools
from typing import Any

from ag_ui.core import Event, EventType, RunAgentInput
from pydantic import BaseModel, TypeAdapter, ValidationError

from . import carriable
from .reasons import INVALID_INPUT_PREFIX, MALFORMED_EVENT

KNOWN_TYPES = frozenset(t.value for t in EventType)
RUN_STARTED = EventType.RUN_STARTED.value
RUN_FINISHED = EventType.RUN_FINISHED.value
RUN_ERROR = EventType.RUN_ERROR.value

MALFORMED = MALFORMED_EVENT

_event = TypeAdapter(Event)

#: Deepest nesting of JSON containers in an event funduq records.
EVENT_MAX_NESTING = 256


class MalformedEvent(ValueError):
    """A known event type that fails validation, or an event with no string type."""


class InvalidInput(ValueError):
    """A body that does not validate as RunAgentInput."""


def read_event(raw: Any) -> dict[str, Any]:
    """The event as funduq records and relays it.

    A known type is validated and re-serialized the way ag-ui does (optional
    fields without a value left out); an unknown type is newer AG-UI than
    ours and passes untouched -- skipping it is the caller's call, not ours.
    """
    if not isinstance(raw, dict) or not isinstance(raw.get("type"), str):
        raise MalformedEvent("event has no string 'type'")
    # A string that is not UTF-8 (a lone surrogate) can be neither stored nor
    # relayed. Deep nesting is stored as sent (the A2A views degrade past
    # theirs), up to EVENT_MAX_NESTING: far below where the recursive JSON
    # encoders (record, streams) could fail at whatever stack depth they run.
    problem = carriable.problem(raw, max_nesting=EVENT_MAX_NESTING)
    if problem is not None:
        raise MalformedEvent(f"event holds {problem}")
    if raw["type"] not in KNOWN_TYPES:
        return raw
    try:
        model = _event.validate_python(raw)
    except ValidationError as exc:
        raise MalformedEvent(_short(exc)) from None
    # Relay it as produced, less the optional fields it sent as null (ag-ui's
    # own serializer leaves those out; a meaningful null stays).
    omittable = _omittable(type(model))
    return {k: v for k, v in raw.items() if v is not None or k not in omittable}


@functools.cache
def _omittable(model: type[BaseModel]) -> frozenset[str]:
    names: set[str] = set()
    for name, f in model.model_fields.items():
        if not f.is_required() and f.default is None:
            names.update(n for n in (name, f.alias) if n)
    return frozenset(names)


def outcome_of(event: dict[str, Any]) -> str | None:
    """For a RUN_FINISHED: its outcome type ('success' when absent); else None."""
    if event.get("type") != RUN_FINISHED:
        return None
    outcome = event.get("outcome")
    return outcome.get("type", "success") if isinstance(outcome, dict) else "success"


def interrupts_of(event: dict[str, Any]) -> list[Any]:
    """A RUN_FINISHED interrupt outcome's interrupts, verbatim (expiresAt included)."""
    return list((event.get("outcome") or {}).get("interrupts") or [])


def run_error(reason: str) -> dict[str, Any]:
    """The RUN_ERROR funduq writes for a run that failed without reporting one."""
    return {"type": RUN_ERROR, "message": reason, "code": reason}


def read_run_input(raw: Any) -> dict[str, Any]:
    """Validate a RunAgentInput the provider link can carry; return it in wire
    form (camelCase, no nulls)."""
    problem = carriable.problem(raw)
    if problem is not None:
        raise InvalidInput(INVALID_INPUT_PREFIX + f"it cannot be carried to a provider: {problem}")
    try:
        model = RunAgentInput.model_validate(raw)
    except ValidationError as exc:
        raise InvalidInput(INVALID_INPUT_PREFIX + _short(exc)) from None
    return model.model_dump(mode="json", by_alias=True)


def _short(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    more = len(exc.errors()) - 3
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")
