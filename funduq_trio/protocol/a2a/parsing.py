"""A2A calls in, I/O-free: JSON-RPC bodies and REST requests as `Call`s.

`parse_call(body, version_header)` turns the HTTP body into a `Call` (the
request id, which of the two method-name sets, the operation, the request as
a 1.0 protobuf message), or raises `CallRejected` carrying the JSON-RPC
error response to send. Its checks run in the a2a-sdk server's order: JSON,
the JSON-RPC envelope, the method name, the params, the `A2A-Version` header,
required fields. `rest_call` makes the same checks for the HTTP+JSON binding.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from a2a.compat.v0_3 import conversions as v03
from a2a.compat.v0_3 import types as types_v03
from a2a.server import jsonrpc_models as rpc
from a2a.server.request_handlers.response_helpers import build_error_response
from a2a.types import a2a_pb2 as pb
from a2a.utils import constants
from a2a.utils.errors import (
    A2AError,
    ExtendedAgentCardNotConfiguredError,
    InvalidParamsError,
    InvalidRequestError,
    VersionNotSupportedError,
)
from a2a.utils.task import decode_page_token
from google.protobuf.json_format import ParseDict
from google.protobuf.message import Message as ProtoMessage
from jsonrpc.jsonrpc2 import JSONRPC20Request
from packaging.version import InvalidVersion, Version

from .. import carriable
from .calls import (
    CANCEL,
    EXTENDED_CARD,
    GET,
    LIST,
    PUSH_CREATE,
    PUSH_DELETE,
    PUSH_GET,
    PUSH_LIST,
    REST,
    SEND,
    STREAM,
    SUBSCRIBE,
    V03,
    V1,
    Call,
)
from .render import error_response, v03_error_envelope
from .required import validate_required_fields

if TYPE_CHECKING:
    from pydantic import BaseModel

#: 1.0 method name -> (operation, request type). Names as the SDK's dispatcher.
METHODS_V1: dict[str, tuple[str, type[ProtoMessage]]] = {
    "SendMessage": (SEND, pb.SendMessageRequest),
    "SendStreamingMessage": (STREAM, pb.SendMessageRequest),
    "GetTask": (GET, pb.GetTaskRequest),
    "ListTasks": (LIST, pb.ListTasksRequest),
    "CancelTask": (CANCEL, pb.CancelTaskRequest),
    "SubscribeToTask": (SUBSCRIBE, pb.SubscribeToTaskRequest),
    "CreateTaskPushNotificationConfig": (PUSH_CREATE, pb.TaskPushNotificationConfig),
    "GetTaskPushNotificationConfig": (PUSH_GET, pb.GetTaskPushNotificationConfigRequest),
    "ListTaskPushNotificationConfigs": (
        PUSH_LIST,
        pb.ListTaskPushNotificationConfigsRequest,
    ),
    "DeleteTaskPushNotificationConfig": (
        PUSH_DELETE,
        pb.DeleteTaskPushNotificationConfigRequest,
    ),
    "GetExtendedAgentCard": (EXTENDED_CARD, pb.GetExtendedAgentCardRequest),
}

#: 0.3 method name -> (operation, v0.3 request model, converter to the 1.0 request).
METHODS_V03: dict[str, tuple[str, type[BaseModel], Any]] = {
    "message/send": (SEND, types_v03.SendMessageRequest, v03.to_core_send_message_request),
    "message/stream": (
        STREAM,
        types_v03.SendStreamingMessageRequest,
        v03.to_core_send_message_request,
    ),
    "tasks/get": (GET, types_v03.GetTaskRequest, v03.to_core_get_task_request),
    "tasks/cancel": (CANCEL, types_v03.CancelTaskRequest, v03.to_core_cancel_task_request),
    "tasks/resubscribe": (
        SUBSCRIBE,
        types_v03.TaskResubscriptionRequest,
        v03.to_core_subscribe_to_task_request,
    ),
    "tasks/pushNotificationConfig/set": (
        PUSH_CREATE,
        types_v03.SetTaskPushNotificationConfigRequest,
        v03.to_core_create_task_push_notification_config_request,
    ),
    "tasks/pushNotificationConfig/get": (
        PUSH_GET,
        types_v03.GetTaskPushNotificationConfigRequest,
        v03.to_core_get_task_push_notification_config_request,
    ),
    "tasks/pushNotificationConfig/list": (
        PUSH_LIST,
        types_v03.ListTaskPushNotificationConfigRequest,
        v03.to_core_list_task_push_notification_config_request,
    ),
    "tasks/pushNotificationConfig/delete": (
        PUSH_DELETE,
        types_v03.DeleteTaskPushNotificationConfigRequest,
        v03.to_core_delete_task_push_notification_config_request,
    ),
    "agent/getAuthenticatedExtendedCard": (
        EXTENDED_CARD,
        types_v03.GetAuthenticatedExtendedCardRequest,
        None,
    ),
}


class CallRejected(Exception):
    """The call cannot be served; `response` is the JSON-RPC error answer."""

    def __init__(self, response: dict[str, Any]) -> None:
        super().__init__(response.get("error", {}).get("message", "rejected"))
        self.response = response


def _version_ok(actual: str, expected: str) -> bool:
    """The a2a-sdk's `validate_version` rule: same major version, or equal."""
    if actual == expected:
        return True
    try:
        return Version(actual).major == Version(expected).major
    except InvalidVersion:
        return False


def check_version(version_header: str | None, expected: str) -> None:
    """Raise the SDK's `VersionNotSupportedError` unless the `A2A-Version`
    header (missing = 0.3) speaks the method's protocol version."""
    actual = (version_header or "").strip() or V03
    if not _version_ok(actual, expected):
        raise VersionNotSupportedError(
            message=f"A2A version '{actual}' is not supported by this handler. "
            f"Expected version '{expected}'."
        )


def parse_call(body: bytes | str, version_header: str | None) -> Call:
    """Parse one HTTP body as an A2A JSON-RPC call, in the a2a-sdk server's order.

    Raises `CallRejected` with the error response: -32700 for JSON that does
    not parse, -32600 for a bad envelope (or a batch), -32601 for an unknown
    method, -32602 for params that do not parse or lack required fields (the
    0.3 names answer -32600 for params their models reject, as the SDK does),
    -32009 (1.0) for an `A2A-Version` the method's protocol does not speak.
    """
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        error = rpc.JSONParseError(message=str(exc))
        raise CallRejected(build_error_response(None, error)) from None
    except RecursionError:
        raise CallRejected(
            build_error_response(
                None, rpc.JSONParseError(message="JSON nested too deeply to parse")
            )
        ) from None

    plain = _plain_envelope(data)
    if plain is not None:
        method, request_id, params = plain
    else:
        method, request_id, params = _envelope(data)
    if method in METHODS_V03 or method in METHODS_V1:
        # Params the provider link could not carry (a lone surrogate, NaN, too
        # deep) are the params' fault, whichever field holds them: -32602
        # before anything reads them (request metadata is kept as sent).
        problem = carriable.problem(params)
        if problem is not None:
            not_carriable = InvalidParamsError(
                message=f"params cannot be carried to a provider: {problem}",
                data={"reason": "not_carriable"},
            )
            if method in METHODS_V03:
                raise CallRejected(v03_error_envelope(request_id, not_carriable))
            raise CallRejected(build_error_response(request_id, not_carriable))

    if method in METHODS_V03:
        return _parse_v03(data, method, request_id, params, version_header)
    if method not in METHODS_V1:
        raise CallRejected(build_error_response(request_id, rpc.MethodNotFoundError()))
    op, model = METHODS_V1[method]
    try:
        request = (
            plain_send_request(params) if model is pb.SendMessageRequest else None
        ) or ParseDict(params, model(), ignore_unknown_fields=True)
    except Exception as exc:  # noqa: BLE001 - any parse failure is the params' fault
        raise CallRejected(
            build_error_response(request_id, InvalidParamsError(data={"parseError": str(exc)}))
        ) from None
    call = Call(request_id, method, op, V1, request, params if isinstance(params, dict) else {})
    try:
        check_version(version_header, V1)
        _validate(call)
    except A2AError as exc:
        raise CallRejected(error_response(call, exc)) from None
    return call


def _plain_envelope(data: Any) -> tuple[str, Any, Any] | None:
    """`_envelope(data)` for the common envelope, read without the `jsonrpc`
    package: exactly the keys `jsonrpc` ("2.0"), `id` (a str or an int),
    `method` (a name of either table) and `params` (an object). None for
    anything else, which `_envelope` reads (and refuses, if it must);
    `tests/test_a2a_fast_paths.py` holds the two equal."""
    if type(data) is not dict or len(data) != 4 or data.get("jsonrpc") != "2.0":
        return None
    method = data.get("method")
    request_id = data.get("id")
    params = data.get("params")
    kind = type(request_id)
    if (
        (kind is str or kind is int)
        and type(method) is str
        and (method in METHODS_V1 or method in METHODS_V03)
        and type(params) is dict
    ):
        return method, request_id, params
    return None


def _envelope(data: Any) -> tuple[str, Any, Any]:
    """The call's method, id and params, the envelope checked as the
    a2a-sdk server checks it (`CallRejected` for what it refuses)."""
    request_id: Any = None
    if isinstance(data, dict):
        request_id = data.get("id")
        if isinstance(request_id, bool) or (
            request_id is not None and not isinstance(request_id, str | int)
        ):
            request_id = None
    try:
        envelope = JSONRPC20Request.from_data(data)
    except Exception as exc:  # noqa: BLE001 - the library's own rejection
        raise CallRejected(
            build_error_response(request_id, InvalidRequestError(data={"parseError": str(exc)}))
        ) from None
    if not isinstance(envelope, JSONRPC20Request):
        raise CallRejected(
            build_error_response(
                request_id, InvalidRequestError(message="Batch requests are not supported")
            )
        )
    if data.get("jsonrpc") != "2.0":
        raise CallRejected(
            build_error_response(
                request_id,
                InvalidRequestError(message="Invalid request: 'jsonrpc' must be exactly '2.0'"),
            )
        )
    if isinstance(envelope._id, bool):
        raise CallRejected(
            build_error_response(
                request_id,
                InvalidRequestError(
                    message="Invalid request: id must be a string, integer, or null"
                ),
            )
        )
    method = envelope.method
    request_id = envelope._id
    if not method:
        raise CallRejected(
            build_error_response(request_id, InvalidRequestError(message="Method is required"))
        )
    params = data.get("params", {})
    return method, request_id, params


#: The message fields a plain SendMessage sets, by their JSON names.
_PLAIN_MESSAGE_FIELDS = {"messageId": "message_id", "contextId": "context_id", "taskId": "task_id"}
_ROLES = {name: pb.Role.Value(name) for name in pb.Role.keys()}


def plain_send_request(params: Any) -> pb.SendMessageRequest | None:
    """The `SendMessageRequest` that `ParseDict(params, ...,
    ignore_unknown_fields=True)` makes of the common shape, built directly
    (ParseDict walks the descriptors field by field: 27 µs of a 120 µs
    handler); None for anything else, which ParseDict then parses.

    The common shape: params with a `message` and optionally `metadata` (an
    object) and a `configuration` of `returnImmediately` alone; the message's
    `messageId`, `contextId`, `taskId` strings, a `role` by name, and `parts`
    of text alone. Anything else -- another key, another type, null, a role by
    number or unknown -- goes the general way, errors included.
    `tests/test_a2a_fast_paths.py` holds the two equal."""
    if not isinstance(params, dict) or not isinstance(message := params.get("message"), dict):
        return None
    fields: dict[str, Any] = {}
    for key, value in message.items():
        if key == "parts":
            if not isinstance(value, list):
                return None
            for part in value:
                if type(part) is not dict or len(part) != 1 or type(part.get("text")) is not str:
                    return None
            fields["parts"] = [pb.Part(text=part["text"]) for part in value]
        elif key == "role":
            if type(value) is not str or value not in _ROLES:
                return None
            fields["role"] = _ROLES[value]
        elif key in _PLAIN_MESSAGE_FIELDS and type(value) is str:
            fields[_PLAIN_MESSAGE_FIELDS[key]] = value
        else:
            return None
    try:
        request = pb.SendMessageRequest(message=pb.Message(**fields))
        for key, value in params.items():
            if key == "metadata" and isinstance(value, dict):
                request.metadata.SetInParent()  # present even when empty, as ParseDict leaves it
                ParseDict(value, request.metadata)
            elif (
                key == "configuration"
                and isinstance(value, dict)
                and value.keys() == {"returnImmediately"}
            ):
                flag = value["returnImmediately"]
                if type(flag) is not bool:
                    return None
                request.configuration.SetInParent()
                request.configuration.return_immediately = flag
            elif key != "message":
                return None
    except Exception:  # noqa: BLE001 - ParseDict then says what is wrong
        return None
    return request


def _parse_v03(
    data: dict[str, Any],
    method: str,
    request_id: Any,
    params: Any,
    version_header: str | None,
) -> Call:
    op, model, to_core = METHODS_V03[method]
    try:
        compat = model.model_validate(data)
    except Exception as exc:  # noqa: BLE001 - the v0.3 models' own rejection
        raise CallRejected(
            v03_error_envelope(request_id, rpc.InvalidRequestError(data=str(exc)))
        ) from None
    try:
        core = to_core(compat) if to_core is not None else None
    except Exception as exc:  # noqa: BLE001 - e.g. metadata nested past protobuf's limit
        raise CallRejected(
            v03_error_envelope(request_id, InvalidParamsError(data={"parseError": str(exc)}))
        ) from None
    call = Call(request_id, method, op, V03, core, params if isinstance(params, dict) else {})
    try:
        check_version(version_header, V03)
        _validate(call)
    except A2AError as exc:
        raise CallRejected(error_response(call, exc)) from None
    return call


def rest_call(op: str, request: ProtoMessage, params: Any, version_header: str | None) -> Call:
    """A call of the HTTP+JSON binding (`request` built from its path, query
    and body), checked as `parse_call` checks a JSON-RPC one; raises the
    A2AError to answer."""
    call = Call(None, op, op, REST, request, params if isinstance(params, dict) else {})
    check_version(version_header, V1)
    _validate(call)
    return call


def _validate(call: Call) -> None:
    """The checks the SDK's request handler makes before doing anything."""
    if call.op == EXTENDED_CARD:
        raise ExtendedAgentCardNotConfiguredError()
    request = call.request
    validate_required_fields(request)
    if call.op in (SEND, STREAM):
        config = request.configuration
        if config.HasField("history_length") and config.history_length < 0:
            raise InvalidParamsError(message="history length must be non-negative")
    if call.op in (GET, LIST) and request.HasField("history_length") and request.history_length < 0:
        raise InvalidParamsError(message="history length must be non-negative")
    if call.op == LIST and request.HasField("page_size"):
        if request.page_size < 1:
            raise InvalidParamsError(message="minimum page size is 1")
        if request.page_size > constants.MAX_LIST_TASKS_PAGE_SIZE:
            raise InvalidParamsError(
                message=f"maximum page size is {constants.MAX_LIST_TASKS_PAGE_SIZE}"
            )
    if call.op == LIST and request.page_token:
        decode_page_token(request.page_token)  # InvalidParamsError when not a token
