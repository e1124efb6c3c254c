"""A2A answers out, I/O-free: results, stream frames and errors, each in the
dialect of its call (1.0 ProtoJSON in a JSON-RPC envelope, 0.3 pydantic JSON,
or the HTTP+JSON binding's bare 1.0 shapes)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, get_args

from a2a.compat.v0_3 import conversions as v03
from a2a.compat.v0_3 import types as types_v03
from a2a.server import jsonrpc_models as rpc
from a2a.server.request_handlers.response_helpers import build_error_response
from a2a.types import a2a_pb2 as pb
from a2a.utils.error_handlers import build_rest_error_payload
from a2a.utils.errors import JSON_RPC_ERROR_CODE_MAP, A2AError
from google.protobuf.json_format import MessageToDict
from jsonrpc.jsonrpc2 import JSONRPC20Response

from .calls import (
    CANCEL,
    GET,
    LIST,
    PUSH_CREATE,
    PUSH_DELETE,
    PUSH_GET,
    PUSH_LIST,
    REST,
    SEND,
    V03,
    V1,
    Call,
)
from .projection import TaskProjection

if TYPE_CHECKING:
    from pydantic import BaseModel

# Error codes v0.3 defines, derived from its models as the SDK's adapter does;
# a 1.0-only code (e.g. -32009) reaches a 0.3 caller as -32603.
_V03_ERROR_CODES = frozenset(
    cls.model_fields["code"].default
    for cls in get_args(types_v03.A2AError.model_fields["root"].annotation)
)


def v03_error_envelope(request_id: Any, error: A2AError | rpc.JSONRPCError) -> dict[str, Any]:
    if isinstance(error, rpc.JSONRPCError):
        err = error.model_dump(by_alias=True)
    else:
        code = JSON_RPC_ERROR_CODE_MAP.get(type(error), -32603)
        if code not in _V03_ERROR_CODES:
            code = -32603
        err = types_v03.JSONRPCError(code=code, message=error.message, data=error.data).model_dump(
            by_alias=True
        )
    return {"jsonrpc": "2.0", "id": request_id, "error": err}


def error_response(
    call: Call | None, error: A2AError | rpc.JSONRPCError, *, request_id: Any = None
) -> dict[str, Any]:
    """The JSON-RPC error answer to `call`, shaped as its dialect's SDK shapes it
    (1.0: `error.data` is the typed-details list with a google.rpc.ErrorInfo
    whose metadata is the error's data; 0.3: `error.data` as given)."""
    rid = call.request_id if call is not None else request_id
    if call is not None and call.dialect == REST:
        # A JSON-RPC-only error has no REST shape: the SDK's "unknown exception" 500.
        return build_rest_error_payload(
            error if isinstance(error, A2AError) else Exception(error.message)
        )
    if call is not None and call.dialect == V03:
        return v03_error_envelope(rid, error)
    return build_error_response(rid, error)


def _jsonrpc_result(result: Any, request_id: str | int | None) -> dict[str, Any]:
    """A JSON-RPC 2.0 success envelope (the `jsonrpc` package's rendering,
    written directly for an id it takes as it is: a str, an int, None)."""
    kind = type(request_id)
    if kind is str or kind is int or request_id is None:
        return {"result": result, "id": request_id, "jsonrpc": "2.0"}
    envelope: dict[str, Any] = JSONRPC20Response(result=result, _id=request_id).data
    return envelope


def _v1_result(call: Call, result: Any) -> Any:
    if call.op == SEND:
        if isinstance(result, pb.Task):
            return MessageToDict(pb.SendMessageResponse(task=result))
        return MessageToDict(pb.SendMessageResponse(message=result))
    if call.op == PUSH_DELETE:
        return None
    if call.op == LIST:
        rendered = MessageToDict(
            result,
            preserving_proto_field_name=False,
            always_print_fields_with_no_presence=True,
        )
        if not call.request.include_artifacts:
            for task in rendered.get("tasks", []):
                task.pop("artifacts", None)
        return rendered
    return MessageToDict(result, preserving_proto_field_name=False)


def result_response(call: Call, result: Any) -> dict[str, Any]:
    """The JSON-RPC success answer to a non-streaming call.

    `result` is a 1.0 `Task` (SendMessage, GetTask, CancelTask) or the
    `TaskProjection` it would be built from,
    `ListTasksResponse` (ListTasks), `TaskPushNotificationConfig` (create,
    get), `ListTaskPushNotificationConfigsResponse` (list) or None (delete);
    0.3 calls get the v0.3 shapes the SDK's converters make of it.
    """
    if isinstance(result, TaskProjection):
        # A Task still as its projection: the common one is written without
        # building the protobuf Task (`plain_task_json`), the rest are built.
        plain = result.plain_task_json() if call.op == SEND and call.dialect != V03 else None
        if plain is not None:
            if call.dialect == REST:
                return {"task": plain}
            return _jsonrpc_result({"task": plain}, call.request_id)
        result = result.task()
    if call.dialect == REST:
        rendered = _v1_result(call, result)
        return {} if rendered is None else rendered
    if call.dialect == V1:
        return _jsonrpc_result(_v1_result(call, result), call.request_id)
    compat: BaseModel
    if call.op == SEND:
        compat = v03.to_compat_send_message_response(
            pb.SendMessageResponse(task=result), call.request_id
        )
    elif call.op == GET:
        compat = types_v03.GetTaskResponse(
            root=types_v03.GetTaskSuccessResponse(
                id=call.request_id, result=v03.to_compat_task(result)
            )
        )
    elif call.op in (PUSH_CREATE, PUSH_GET):
        config = v03.to_compat_task_push_notification_config(result)
        response = (
            types_v03.SetTaskPushNotificationConfigSuccessResponse
            if call.op == PUSH_CREATE
            else types_v03.GetTaskPushNotificationConfigSuccessResponse
        )
        compat = response(id=call.request_id, result=config)
    elif call.op == PUSH_LIST:
        compat = types_v03.ListTaskPushNotificationConfigSuccessResponse(
            id=call.request_id,
            result=[v03.to_compat_task_push_notification_config(c) for c in result.configs],
        )
    elif call.op == PUSH_DELETE:
        compat = types_v03.DeleteTaskPushNotificationConfigSuccessResponse(
            id=call.request_id, result=None
        )
    elif call.op == CANCEL:
        compat = types_v03.CancelTaskResponse(
            root=types_v03.CancelTaskSuccessResponse(
                id=call.request_id, result=v03.to_compat_task(result)
            )
        )
    else:  # pragma: no cover - parse_call admits no other 0.3 operation
        raise ValueError(f"no 0.3 result for {call.method}")
    return compat.model_dump(mode="json", by_alias=True, exclude_none=True)


def stream_frame(call: Call, update: pb.StreamResponse) -> dict[str, Any]:
    """One streamed JSON-RPC answer (an SSE frame's data) in the call's dialect."""
    if call.dialect in (REST, V1):
        result: dict[str, Any] = MessageToDict(update, preserving_proto_field_name=False)
        return result if call.dialect == REST else _jsonrpc_result(result, call.request_id)
    compat = v03.to_compat_stream_response(update, call.request_id)
    return compat.model_dump(mode="json", by_alias=True, exclude_none=True)


def stream_result(call: Call, result: dict[str, Any]) -> dict[str, Any]:
    """`stream_frame` of an update given as its 1.0 JSON (`MessageToDict`'s,
    `TaskProjection.plain_updates`), for the dialects that write it as it is
    (1.0 JSON-RPC, REST); a 0.3 call's frames are converted, never this."""
    if call.dialect == REST:
        return result
    assert call.dialect == V1, call.dialect
    return _jsonrpc_result(result, call.request_id)


def stream_snapshot(task: pb.Task) -> pb.StreamResponse:
    return pb.StreamResponse(task=task)
