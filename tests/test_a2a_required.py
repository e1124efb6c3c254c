"""`protocol/a2a/required.py` answers exactly what the a2a-sdk's REQUIRED-field
walk answers, for every request the door parses and anything inside them."""

from __future__ import annotations

from typing import Any

import pytest
from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import InvalidParamsError
from a2a.utils.proto_utils import (
    _validate_proto_required_fields_internal,
    validate_proto_required_fields,
)
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from funduq_trio.protocol.a2a.parsing import METHODS_V1
from funduq_trio.protocol.a2a.required import required_field_errors, validate_required_fields

ROOTS = sorted({model.DESCRIPTOR.full_name: model for _, model in METHODS_V1.values()}.items()) + [
    ("a2a.v1.Task", pb.Task),
    ("a2a.v1.StreamResponse", pb.StreamResponse),
]

_SCALARS: dict[int, st.SearchStrategy[Any]] = {
    FieldDescriptor.TYPE_STRING: st.sampled_from(["", "x", "ctx-1"]),
    FieldDescriptor.TYPE_BYTES: st.sampled_from([b"", b"\x00", b"data"]),
    FieldDescriptor.TYPE_BOOL: st.booleans(),
    FieldDescriptor.TYPE_INT32: st.sampled_from([0, 1, -1]),
    FieldDescriptor.TYPE_INT64: st.sampled_from([0, 1, -1]),
    FieldDescriptor.TYPE_DOUBLE: st.sampled_from([0.0, 1.5]),
}


def _fill(draw: Any, msg: Any, depth: int) -> None:
    """Set a random subset of `msg`'s fields, nested messages `depth` deep."""
    desc: Descriptor = msg.DESCRIPTOR
    for field in desc.fields:
        if not draw(st.booleans()):
            continue
        name = field.name
        repeated = getattr(field, "is_repeated", False)
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            target = field.message_type
            if target.GetOptions().map_entry:
                value_field = target.fields_by_name["value"]
                container = getattr(msg, name)
                for key in draw(
                    st.lists(st.sampled_from(["a", "b", "c"]), max_size=2, unique=True)
                ):
                    if value_field.type == FieldDescriptor.TYPE_MESSAGE:
                        if depth > 0:
                            _fill(draw, container[key], depth - 1)
                        else:
                            container[key].SetInParent()
                    elif value_field.type in _SCALARS:
                        container[key] = draw(_SCALARS[value_field.type])
                continue
            if depth <= 0:
                continue
            if repeated:
                for _ in range(draw(st.integers(0, 2))):
                    _fill(draw, getattr(msg, name).add(), depth - 1)
            else:
                child = getattr(msg, name)
                child.SetInParent()
                _fill(draw, child, depth - 1)
        elif field.type == FieldDescriptor.TYPE_ENUM:
            values = [v.number for v in field.enum_type.values]
            if repeated:
                getattr(msg, name).extend(draw(st.lists(st.sampled_from(values), max_size=2)))
            else:
                setattr(msg, name, draw(st.sampled_from(values)))
        elif field.type in _SCALARS:
            strategy = _SCALARS[field.type]
            if repeated:
                getattr(msg, name).extend(draw(st.lists(strategy, max_size=2)))
            else:
                setattr(msg, name, draw(strategy))


@st.composite
def messages(draw: Any) -> Any:
    _, model = draw(st.sampled_from(ROOTS))
    msg = model()
    _fill(draw, msg, depth=draw(st.integers(0, 5)))
    return msg


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(messages())
def test_the_same_errors_as_the_sdk_walk(msg: Any) -> None:
    assert required_field_errors(msg) == _validate_proto_required_fields_internal(msg)


@pytest.mark.parametrize("name,model", ROOTS)
def test_an_empty_request_fails_as_the_sdk_fails(name: str, model: Any) -> None:
    def raised(check: Any) -> Any:
        try:
            check(model())
        except InvalidParamsError as exc:
            return (exc.message, exc.data)
        return None

    assert raised(validate_required_fields) == raised(validate_proto_required_fields)


def test_a_message_missing_its_parts_deep_inside() -> None:
    request = pb.SendMessageRequest()
    request.message.message_id = "m"
    request.message.role = pb.Role.ROLE_USER
    request.message.parts.add(text="hi")
    config = request.configuration.task_push_notification_config
    config.authentication.SetInParent()  # a push config with nothing in it
    expected = _validate_proto_required_fields_internal(request)
    assert expected, "the SDK finds something to refuse here"
    assert required_field_errors(request) == expected
