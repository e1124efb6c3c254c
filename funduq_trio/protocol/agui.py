"""AG-UI, as funduq reads it: which events are known, malformed or merely new,
what a finished stream says, and the RUN_ERROR funduq writes when a run fails
without saying so itself. I/O-free; event names come from ag-ui's EventType."""

from __future__ import annotations

import functools
import types
import typing
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
    if _plain(raw):
        return dict(raw)  # what validation would give back: no nulls to leave out
    return _read_validated(raw)


def _read_validated(raw: dict[str, Any]) -> dict[str, Any]:
    """`read_event`'s long road, which decides every event `_plain` does not
    take: carriable, then ag-ui's models."""
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


#: What `fields.get` answers for a key that is no string field (no string
#: is in it, so "not a field" and "takes no string" read alike).
_NO_FIELD: frozenset[str] = frozenset()


class _Shape(typing.NamedTuple):
    """A model's plain-string form, read off its fields (wire names)."""

    required: frozenset[str]
    #: Each string field and the strings it takes (None: any).
    fields: dict[str, frozenset[str] | None]
    #: Optional fields whose default is not None (a dump writes them even
    #: when absent): a plain form must give them.
    defaulted: frozenset[str]
    #: Every field, in the order the model dumps them.
    order: tuple[str, ...]
    #: What a plain form must give: the required and the defaulted fields.
    given: frozenset[str]


def _string_fields(model: type[BaseModel], skip: str = "type") -> _Shape | None:
    """For a model whose every field but `skip` may hold a plain string: its
    `_Shape`. None when a required field takes more than a plain string
    (then every value of the model is validated)."""
    decorators = model.__pydantic_decorators__
    if decorators.validators or decorators.field_validators or decorators.model_validators:
        return None
    if model.model_post_init is not BaseModel.model_post_init:
        return None
    if model.model_config.get("strict") or any(k.startswith("str_") for k in model.model_config):
        return None
    required: set[str] = set()
    defaulted: set[str] = set()
    fields: dict[str, frozenset[str] | None] = {}
    order: list[str] = []
    for name, f in model.model_fields.items():
        if f.validation_alias is not None and not isinstance(f.validation_alias, str):
            return None  # AliasChoices, AliasPath: read the long way
        wire = f.validation_alias or f.alias or name
        order.append(wire)
        if wire == skip:
            continue
        if not f.is_required() and (f.default is not None or f.default_factory is not None):
            defaulted.add(wire)
        if f.metadata:  # constrained (timestamp's bounds): such values take the long road
            if f.is_required():
                return None
            continue
        annotation = f.annotation
        members = [annotation]
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            members = [a for a in typing.get_args(annotation) if a is not type(None)]
        allowed: frozenset[str] | None
        if str in members:
            allowed = None  # a union taking str keeps a str as it is
        elif (
            len(members) == 1
            and typing.get_origin(members[0]) is typing.Literal
            and all(type(v) is str for v in typing.get_args(members[0]))
        ):
            allowed = frozenset(typing.get_args(members[0]))
        elif f.is_required() or wire in defaulted:
            return None
        else:
            continue
        fields[wire] = allowed
        if f.is_required():
            required.add(wire)
    return _Shape(
        frozenset(required),
        fields,
        frozenset(defaulted),
        tuple(order),
        frozenset(required) | frozenset(defaulted),
    )


def _string_events() -> dict[str, _Shape]:
    out = {}
    for model in typing.get_args(typing.get_args(Event)[0]):
        shape = _string_fields(model)
        if shape is not None:
            out[model.model_fields["type"].default.value] = shape
    return out


#: The event types whose commonest form is a flat object of plain strings
#: (RUN_STARTED, TEXT_MESSAGE_CONTENT, ...), read off ag-ui's own models.
_STRING_EVENTS = _string_events()


def _plain(raw: dict[str, Any]) -> bool:
    """True for an event ag-ui's models would take as it is, with no
    validation run: a known type, its required fields there, no field but
    its string fields, each an ASCII `str` the field takes (so it is also
    carriable: flat, every string UTF-8). Anything else -- an extra or
    non-string field, a null, a non-ASCII string, a wrong value -- is read
    the long way (carriable, then validated), which decides it alone. Every
    provider event is read here; this is ~0.5 µs where validation is ~3."""
    shape = _STRING_EVENTS.get(raw["type"])
    return shape is not None and _plain_strings(raw, shape, "type", shape.required)


def _plain_strings(raw: dict[str, Any], shape: _Shape, skip: str, needed: frozenset[str]) -> bool:
    """Every field of ``raw`` but ``skip`` is an ASCII `str` that ``shape``'s
    field takes, and every field of ``needed`` is there."""
    fields = shape.fields
    seen = 0
    for key, value in raw.items():
        if key == skip:
            continue
        if type(value) is not str or not value.isascii():
            return False
        allowed = fields.get(key, _NO_FIELD)
        if allowed is _NO_FIELD or (allowed is not None and value not in allowed):
            return False
        seen += key in needed
    return seen == len(needed)


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
    plain = _plain_input(raw)
    if plain is not None:
        return plain
    return _read_run_input_validated(raw)


def _read_run_input_validated(raw: Any) -> dict[str, Any]:
    """`read_run_input`'s long road, which decides every input `_plain_input`
    does not take: carriable, then ag-ui's model and its dump."""
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


def _message_shapes() -> dict[str, _Shape]:
    union = typing.get_args(typing.get_args(RunAgentInput.model_fields["messages"].annotation)[0])
    out = {}
    for model in typing.get_args(union[0]):
        shape = _string_fields(model, skip="")
        if shape is not None and "role" in shape.defaulted:
            out[model.model_fields["role"].default] = shape
    return out


#: RunAgentInput and its messages (by role) in their plain-string forms.
_INPUT_SHAPE = _string_fields(RunAgentInput, skip="messages")
_MESSAGE_SHAPES = _message_shapes()


def _plain_input(raw: Any) -> dict[str, Any] | None:
    """RunAgentInput's dump, made without running its model, for an input of
    plain strings: every field a string field the model takes, ASCII, and
    messages each of plain strings for its role's model (user, assistant,
    system, developer, tool...). Such an input validates as it is and dumps
    as the same keys in the model's field order (it is also carriable:
    three levels, every string UTF-8). None for anything else -- tools,
    state, a null, an extra key, a non-ASCII string -- which takes the long
    road. ~2 µs where validating and dumping is ~10."""
    if type(raw) is not dict or _INPUT_SHAPE is None:
        return None
    messages = raw.get("messages")
    if type(messages) is not list:
        return None
    dumped = []
    for message in messages:
        if type(message) is not dict:
            return None
        role = message.get("role")
        shape = _MESSAGE_SHAPES.get(role) if type(role) is str else None
        if shape is None:
            return None
        out = _dumped(message, shape)
        if out is None:
            return None
        dumped.append(out)
    return _dumped(raw, _INPUT_SHAPE, "messages", dumped)


def _dumped(
    raw: dict[str, Any], shape: _Shape, skip: str = "", value: Any = None
) -> dict[str, Any] | None:
    if not _plain_strings(raw, shape, skip, shape.given):
        return None
    return {key: value if key == skip else raw[key] for key in shape.order if key in raw}
