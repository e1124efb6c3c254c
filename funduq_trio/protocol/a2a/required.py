"""The a2a-sdk's REQUIRED-field check, with what it reads of the descriptors
worked out once per message type.

`a2a.utils.proto_utils.validate_proto_required_fields` walks every field of
the request and everything below it on each call, reading each field's
options (`GetOptions().Extensions[field_behavior]`) as it goes; for a plain
`SendMessageRequest` that was 75 µs, a third of the A2A door's handler
(bench/README.md, "Step 4: the A2A handler's own work").
`required_field_errors` makes the same walk in the same order and answers
the same list, but from a plan per message type: only the fields that are
REQUIRED or lead to a message type that has a REQUIRED field somewhere below
it (a request's `metadata` Struct, for one, has none, so it is never
entered). `tests/test_a2a_required.py` holds it
equal to the SDK's walk.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from a2a.utils.errors import InvalidParamsError
from google.api.field_behavior_pb2 import (  # type: ignore[import-untyped]
    FieldBehavior,
    field_behavior,
)
from google.protobuf.descriptor import Descriptor, FieldDescriptor

_REQUIRED = FieldBehavior.REQUIRED


@dataclass(frozen=True, slots=True)
class _Step:
    """What the walk does at one field: check it, enter it, or both."""

    name: str
    required: bool
    repeated: bool
    has_presence: bool
    default: Any
    #: Enter the field's message(s): "one", "list", "map" or "" (do not).
    enter: str


_PLANS: dict[str, tuple[_Step, ...]] = {}
_NEEDS_VISIT: dict[str, bool] = {}


def _repeated(field: FieldDescriptor) -> bool:
    # As the SDK's `_field_is_repeated` (protobuf 7 has `is_repeated`).
    is_repeated = getattr(field, "is_repeated", None)
    if is_repeated is not None:
        return bool(is_repeated)
    return bool(getattr(field, "label", None) == FieldDescriptor.LABEL_REPEATED)  # pragma: no cover


def _is_required(field: FieldDescriptor) -> bool:
    return bool(_REQUIRED in field.GetOptions().Extensions[field_behavior])


def _message_types_below(desc: Descriptor) -> set[str]:
    """Every message type reachable from `desc` through its fields, itself included."""
    seen: dict[str, Descriptor] = {}
    todo = [desc]
    while todo:
        current = todo.pop()
        if current.full_name in seen:
            continue
        seen[current.full_name] = current
        for field in current.fields:
            if field.type == FieldDescriptor.TYPE_MESSAGE and field.message_type is not None:
                todo.append(field.message_type)
    return {name for name, d in seen.items() if any(_is_required(f) for f in d.fields)}


def _needs_visit(desc: Descriptor) -> bool:
    """Whether a message of this type can hold a REQUIRED field, at any depth."""
    known = _NEEDS_VISIT.get(desc.full_name)
    if known is None:
        known = _NEEDS_VISIT[desc.full_name] = bool(_message_types_below(desc))
    return known


def _plan(desc: Descriptor) -> tuple[_Step, ...]:
    plan = _PLANS.get(desc.full_name)
    if plan is not None:
        return plan
    steps = []
    for field in desc.fields:
        required = _is_required(field)
        repeated = _repeated(field)
        enter = ""
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            target = field.message_type
            if not repeated:
                enter = "one" if _needs_visit(target) else ""
            elif target is not None and target.GetOptions().map_entry:
                value = target.fields_by_name["value"]
                if value.type == FieldDescriptor.TYPE_MESSAGE and _needs_visit(value.message_type):
                    enter = "map"
            elif _needs_visit(target):
                enter = "list"
        if required or enter:
            default = None if repeated or field.has_presence else field.default_value
            steps.append(_Step(field.name, required, repeated, field.has_presence, default, enter))
    plan = _PLANS[desc.full_name] = tuple(steps)
    return plan


def required_field_errors(msg: Any) -> list[dict[str, str]]:
    """The SDK's `_validate_proto_required_fields_internal(msg)`: one
    `{"field", "message"}` per REQUIRED field missing, nested ones with their
    path (`message.parts[0].text`), in the SDK's order."""
    errors: list[dict[str, str]] = []
    for step in _plan(msg.DESCRIPTOR):
        name = step.name
        if step.required:
            value = getattr(msg, name)
            if step.repeated:
                if not value:
                    errors.append(
                        {"field": name, "message": "Field must contain at least one element."}
                    )
            elif step.has_presence:
                if not msg.HasField(name):
                    errors.append({"field": name, "message": "Field is required."})
            elif value == step.default:
                errors.append({"field": name, "message": "Field is required."})
        if not step.enter:
            continue
        if step.enter == "one":
            if msg.HasField(name):
                _nested(errors, name, required_field_errors(getattr(msg, name)))
        elif step.enter == "map":
            for key, item in getattr(msg, name).items():
                _nested(errors, f"{name}[{key}]", required_field_errors(item))
        else:
            for index, item in enumerate(getattr(msg, name)):
                _nested(errors, f"{name}[{index}]", required_field_errors(item))
    return errors


def _nested(errors: list[dict[str, str]], prefix: str, below: list[dict[str, str]]) -> None:
    for sub in below:
        field = sub["field"]
        errors.append(
            {"field": f"{prefix}.{field}" if field else prefix, "message": sub["message"]}
        )


def validate_required_fields(msg: Any) -> None:
    """The SDK's `validate_proto_required_fields`: InvalidParamsError("Validation
    failed", data={"errors": [...]}) when a REQUIRED field is missing."""
    errors = required_field_errors(msg)
    if errors:
        raise InvalidParamsError(message="Validation failed", data={"errors": errors})
