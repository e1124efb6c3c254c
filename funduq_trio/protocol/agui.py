"""AG-UI, as funduq reads it: which events are known, malformed or merely new,
what a finished stream says, and the RUN_ERROR funduq writes when a run fails
without saying so itself. I/O-free; event names come from ag-ui's EventType."""

from __future__ import annotations

import functools
import math
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
    """A body that does not validate as RunAgentInput (`errors`: pydantic's
    account), or that the provider link cannot carry (`not_carriable`: what
    and where). The message says which, for the broker's callers."""

    def __init__(
        self,
        message: str,
        *,
        not_carriable: str | None = None,
        errors: ValidationError | None = None,
    ) -> None:
        super().__init__(message)
        self.not_carriable = not_carriable
        self.errors = errors


class RunInput(dict[str, Any]):
    """A RunAgentInput `read_run_input` has read, kept as read by whoever read
    it (the AG-UI door, which answers a body's refusals its own way): read
    again, it is taken as it is, so a body is validated once on its way in."""


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


def _validates_plainly(model: type[BaseModel]) -> bool:
    """No validator, post-init or strictness of the model's own: a value its
    fields' types take is taken as it is."""
    decorators = model.__pydantic_decorators__
    if decorators.validators or decorators.field_validators or decorators.model_validators:
        return False
    if model.model_post_init is not BaseModel.model_post_init:
        return False
    config = model.model_config
    return not (config.get("strict") or any(k.startswith("str_") for k in config))


def _string_fields(model: type[BaseModel], skip: str = "type") -> _Shape | None:
    """For a model whose every field but `skip` may hold a plain string: its
    `_Shape`. None when a required field takes more than a plain string
    (then every value of the model is validated)."""
    if not _validates_plainly(model):
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
    form (camelCase, no nulls), a new dict. A `RunInput` was read already."""
    if type(raw) is RunInput:
        return dict(raw)
    plain = _plain_input(raw)
    if plain is not None:
        return plain
    return _read_run_input_validated(raw)


def _read_run_input_validated(raw: Any) -> dict[str, Any]:
    """`read_run_input`'s long road, which decides every input `_plain_input`
    does not take: carriable, then ag-ui's model and its dump."""
    problem = carriable.problem(raw)
    if problem is not None:
        raise InvalidInput(
            INVALID_INPUT_PREFIX + f"it cannot be carried to a provider: {problem}",
            not_carriable=problem,
        )
    try:
        model = RunAgentInput.model_validate(raw)
    except ValidationError as exc:
        raise InvalidInput(INVALID_INPUT_PREFIX + _short(exc), errors=exc) from None
    return model.model_dump(mode="json", by_alias=True)


def _short(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors()[:3]:
        loc = ".".join(str(p) for p in err.get("loc", ()))
        parts.append(f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")))
    more = len(exc.errors()) - 3
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


class _Take(typing.NamedTuple):
    """What a field of a run input takes without validation, read off its type;
    each such value validates as it is and dumps as given (or copied)."""

    #: The strings it takes (None: any; `_NO_FIELD`: none), ASCII only.
    strings: frozenset[str] | None
    #: None, left out of the dump: an optional field defaulting to None.
    null: bool
    #: `[]`: a list field (whatever its items, none validate as `[]`).
    empty_list: bool
    #: Any plain JSON value (an `Any` field), dumped as a copy.
    json: bool
    #: An object of plain JSON values (a `Dict[str, Any]` field), copied.
    obj: bool


class _Form(typing.NamedTuple):
    """A model's plain form (wire names): what a value of it may hold that
    validates and dumps with no model run."""

    takes: dict[str, _Take]
    #: What a plain form must give: the required fields and those whose
    #: default is not None (a dump writes them even when absent).
    given: frozenset[str]
    #: Every field, in the order the model dumps them.
    order: tuple[str, ...]


#: Containers an `Any` or `Dict[str, Any]` field's plain value may nest (the
#: A2A door's `forwardedProps` is 2): far inside carriable's bound.
_JSON_DEPTH = 8

#: `typing.Any` as a field's annotation (or a union member) holds it.
_ANY: Any = Any


def _form(model: type[BaseModel], skip: str | None = None) -> _Form | None:
    """For a model validated and dumped plainly (no validator, no serializer
    but ag-ui's leaving out of valueless optional fields, wire names alike
    both ways): its `_Form`. None when a field it must be given takes
    nothing plain (then every value of the model is validated)."""
    decorators = model.__pydantic_decorators__
    if not _validates_plainly(model) or decorators.field_serializers:
        return None
    # ag-ui's one serializer leaves out the optional fields that default to
    # None when they hold None (GeneratedBaseModel); any other, and dumps
    # are no longer known without running it.
    if any(name != "_omit_fields_without_value" for name in decorators.model_serializers):
        return None
    takes: dict[str, _Take] = {}
    given: set[str] = set()
    order: list[str] = []
    for name, f in model.model_fields.items():
        if f.validation_alias is not None and not isinstance(f.validation_alias, str):
            return None  # AliasChoices, AliasPath: read the long way
        wire = f.validation_alias or f.alias or name
        if (f.serialization_alias or f.alias or name) != wire or f.exclude:
            return None
        order.append(wire)
        if wire == skip:
            continue
        must = f.is_required() or f.default is not None or f.default_factory is not None
        take = None if f.metadata else _take(f.annotation, null=not must)
        if take is None:
            if must:
                return None
            continue  # constrained (or of models): such values take the long road
        takes[wire] = take
        if must:
            given.add(wire)
    return _Form(takes, frozenset(given), tuple(order))


def _take(annotation: Any, *, null: bool) -> _Take | None:
    members = [annotation]
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        members = list(typing.get_args(annotation))
    null = null and (type(None) in members or _ANY in members)
    members = [m for m in members if m is not type(None)]
    if _ANY in members:
        return _Take(None, null, True, True, True)
    strings: frozenset[str] | None = _NO_FIELD
    if str in members:
        strings = None  # a union taking str keeps a str as it is
    else:
        literals = [m for m in members if typing.get_origin(m) is typing.Literal]
        if len(literals) == 1 and all(type(v) is str for v in typing.get_args(literals[0])):
            strings = frozenset(typing.get_args(literals[0]))
    empty_list = any(typing.get_origin(m) is list for m in members)
    obj = any(typing.get_origin(m) is dict and typing.get_args(m) == (str, _ANY) for m in members)
    if strings is _NO_FIELD and not (null or empty_list or obj):
        return None
    return _Take(strings, null, empty_list, False, obj)


def _message_forms() -> dict[str, _Form]:
    union = typing.get_args(typing.get_args(RunAgentInput.model_fields["messages"].annotation)[0])
    out = {}
    for model in typing.get_args(union[0]):
        form = _form(model)
        if form is not None and "role" in form.given:
            out[model.model_fields["role"].default] = form
    return out


#: RunAgentInput and its messages (by role) in their plain forms.
_INPUT_FORM = _form(RunAgentInput, skip="messages")
_MESSAGE_FORMS = _message_forms()

#: A value no plain form holds.
_NOT_PLAIN: Any = object()


def _plain_input(raw: Any) -> dict[str, Any] | None:
    """RunAgentInput's dump, made without running its model, for an input of
    plain values: ASCII strings its fields take, nulls for the optional ones
    (left out, as ag-ui's dump leaves them), `[]` for a list field, plain
    JSON (ASCII strings, ints, finite floats, bools, nulls, a few levels of
    objects and lists) for an `Any` one, messages each plain for its role's
    model (user, assistant, system, developer, tool...). Such an input
    validates as it is and dumps as the same values in the model's field
    order (it is also carriable: shallow, every string ASCII, every number
    finite) -- the A2A door's (`state: {}`, `tools: []`, `context: []`, a
    small `forwardedProps`) and an AG-UI client's usual one (`state: null`)
    included. None for anything else -- tools, an extra key, a non-ASCII
    string, a value a field does not take -- which takes the long road,
    which alone decides it. ~3 µs where validating and dumping is ~15."""
    if type(raw) is not dict or _INPUT_FORM is None:
        return None
    messages = raw.get("messages")
    if type(messages) is not list:
        return None
    dumped = []
    for message in messages:
        if type(message) is not dict:
            return None
        role = message.get("role")
        form = _MESSAGE_FORMS.get(role) if type(role) is str else None
        if form is None:
            return None
        out = _dumped(message, form)
        if out is None:
            return None
        dumped.append(out)
    return _dumped(raw, _INPUT_FORM, "messages", dumped)


def _dumped(
    raw: dict[str, Any], form: _Form, skip: str | None = None, skipped: Any = None
) -> dict[str, Any] | None:
    """The dump of `raw`, plain for `form` (`skip`'s value read already:
    `skipped`), or None."""
    takes = form.takes
    given = form.given
    values: dict[str, Any] = {}
    seen = 0
    for key, value in raw.items():
        if key == skip:
            values[key] = skipped
            continue
        take = takes.get(key)
        if take is None:
            return None
        kind = type(value)
        if kind is str:
            strings = take.strings
            if not value.isascii() or strings is _NO_FIELD:
                return None
            if strings is not None and value not in strings:
                return None
        elif value is None:
            if not take.null:
                return None
            continue  # left out of the dump
        elif take.json or (kind is dict and take.obj):
            value = _plain_json(value, _JSON_DEPTH)
            if value is _NOT_PLAIN:
                return None
        elif kind is list and not value and take.empty_list:
            value = []
        else:
            return None
        values[key] = value
        seen += key in given
    if seen != len(given):
        return None
    return {key: values[key] for key in form.order if key in values}


def _plain_json(value: Any, depth: int) -> Any:
    """A copy of `value` if it is plain JSON (exact types, ASCII strings and
    keys, finite floats, containers nested at most `depth`), the way an `Any`
    field dumps it; else `_NOT_PLAIN`."""
    kind = type(value)
    if kind is str:
        return value if value.isascii() else _NOT_PLAIN
    if kind is int or kind is bool or value is None:
        return value
    if kind is float:
        return value if math.isfinite(value) else _NOT_PLAIN
    if depth == 0:
        return _NOT_PLAIN
    if kind is dict:
        out = {}
        for key, item in value.items():
            if type(key) is not str or not key.isascii():
                return _NOT_PLAIN
            item = _plain_json(item, depth - 1)
            if item is _NOT_PLAIN:
                return _NOT_PLAIN
            out[key] = item
        return out
    if kind is list:
        items = []
        for item in value:
            item = _plain_json(item, depth - 1)
            if item is _NOT_PLAIN:
                return _NOT_PLAIN
            items.append(item)
        return items
    return _NOT_PLAIN
