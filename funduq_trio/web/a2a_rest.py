"""The A2A HTTP+JSON (REST) binding beside JSON-RPC, under the same agent URL
`/a2a/{provider}/{agent}`: the routes a2a-sdk's own server mounts
(`a2a.server.routes.rest_routes`), served by the JSON-RPC door's operations.

Each route only builds the 1.0 request message from its path, query and body
(`protocol.a2a.parsing.rest_call` checks it as a JSON-RPC call is checked) and hands
it to `A2ADoor`; answers are the bare 1.0 ProtoJSON (no envelope), streams
are SSE of `StreamResponse`s, errors are the binding's shape
(`{"error": {"code", "status", "message", "details"}}`) at the HTTP status
the SDK gives each error.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import (
    A2AError,
    ExtendedAgentCardNotConfiguredError,
    InternalError,
    InvalidParamsError,
    InvalidRequestError,
)
from a2a.utils.proto_utils import parse_params
from google.protobuf.json_format import ParseDict
from google.protobuf.message import Message as ProtoMessage
from quart import Response, jsonify, request
from werkzeug.exceptions import RequestEntityTooLarge

from ..protocol import carriable
from ..protocol.a2a.calls import (
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
    Call,
)
from ..protocol.a2a.parsing import rest_call
from ..protocol.a2a.render import error_response, result_response
from .door_errors import a2a_error
from .sse import sse_response

log = logging.getLogger("funduq_trio.a2a")

#: The binding's media type for JSON answers: A2A §11.1 says
#: `application/json`; a2a-sdk's server labels them `application/a2a+json`,
#: which a caller gets by naming it in `Accept` (the TCK's HTTP_JSON-SVC-001).
A2A_JSON = "application/a2a+json"
JSON = "application/json"


def mount_a2a_rest(app: Any, get_funduq: Callable[[], Any]) -> None:
    """Add the HTTP+JSON routes under every agent's A2A URL."""
    from .a2a_door import A2ADoor  # the door mounts this module

    base = "/a2a/<provider>/<agent>"

    def route(path: str, methods: list[str], op: str, build: Callable[..., Any]) -> None:
        async def endpoint(provider: str, agent: str, **path_args: str) -> Response:
            door = A2ADoor(get_funduq(), provider, agent, request)
            return await answer(door, op, build, path_args)

        endpoint.__name__ = f"a2a_rest_{op}_{'_'.join(methods).lower()}"
        app.add_url_rule(base + path, endpoint.__name__, endpoint, methods=methods)

    route("/message:send", ["POST"], SEND, _send)
    route("/message:stream", ["POST"], STREAM, _send)
    route("/tasks/<task_id>:cancel", ["POST"], CANCEL, _cancel)
    route("/tasks/<task_id>:subscribe", ["GET", "POST"], SUBSCRIBE, _subscribe)
    route("/tasks/<task_id>", ["GET"], GET, _get)
    route("/tasks", ["GET"], LIST, _list)
    route("/tasks/<task_id>/pushNotificationConfigs", ["POST"], PUSH_CREATE, _push_create)
    route("/tasks/<task_id>/pushNotificationConfigs", ["GET"], PUSH_LIST, _push_list)
    route("/tasks/<task_id>/pushNotificationConfigs/<push_id>", ["GET"], PUSH_GET, _push_get)
    route(
        "/tasks/<task_id>/pushNotificationConfigs/<push_id>", ["DELETE"], PUSH_DELETE, _push_delete
    )
    route("/extendedAgentCard", ["GET"], EXTENDED_CARD, _extended_card)


def _rest_json(payload: Any, status: int = 200) -> Response:
    response = jsonify(payload)
    response.status_code = status
    response.mimetype = request.accept_mimetypes.best_match([JSON, A2A_JSON]) or JSON
    return response


def _error(call: Call | None, exc: Exception) -> Response:
    from .a2a_door import CALLER_ERRORS, _task_id

    if isinstance(exc, CALLER_ERRORS):
        exc = a2a_error(exc, task_id=_task_id(call) if call is not None else None)
    elif not isinstance(exc, A2AError):
        log.exception("A2A REST call failed")
        exc = InternalError(message=str(exc) or None)
    stub = call or Call(None, "", "", REST, None)
    payload = error_response(stub, exc)
    return _rest_json(payload, int(payload["error"]["code"]))


async def answer(
    door: Any, op: str, build: Callable[..., Any], path_args: dict[str, str]
) -> Response:
    call: Call | None = None
    try:
        try:
            raw = await request.get_data()
        except RequestEntityTooLarge:
            raise InvalidRequestError(message="Payload too large") from None
        body = _body(raw)
        message = build(body, **path_args)
        call = rest_call(op, message, body, request.headers.get("A2A-Version"))
        door.view = door.funduq.find_agent(door.provider, door.agent)
        if door.view is None:
            raise InvalidRequestError(
                message=f"No agent {door.agent!r} is published by provider "
                f"{door.provider!r} at this funduq",
                data={"reason": "agent_not_found"},
            )
        if call.streaming:
            return sse_response(await door.open_stream(call))
        return _rest_json(result_response(call, await door.perform(call)))
    except Exception as exc:  # noqa: BLE001 - every failure answers in the binding's shape
        return _error(call, exc)


def _body(raw: bytes) -> dict[str, Any]:
    if not raw.strip():
        return {}
    try:
        body = carriable.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise InvalidParamsError(message=f"body is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidParamsError(message="body must be a JSON object")
    # What the JSON-RPC binding refuses in params, this one refuses in the body.
    problem = carriable.problem(body)
    if problem is not None:
        raise InvalidParamsError(
            message=f"body cannot be carried to a provider: {problem}",
            data={"reason": "not_carriable"},
        )
    return body


def _parse(body: dict[str, Any], message: ProtoMessage) -> Any:
    try:
        return ParseDict(body, message, ignore_unknown_fields=True)
    except Exception as exc:  # noqa: BLE001 - any parse failure is the body's fault
        raise InvalidParamsError(data={"parseError": str(exc)}) from None


def _query(message: ProtoMessage) -> Any:
    try:
        parse_params(request.args, message)
    except Exception as exc:  # noqa: BLE001 - the query's fault
        raise InvalidParamsError(data={"parseError": str(exc)}) from None
    return message


def _send(body: dict[str, Any]) -> pb.SendMessageRequest:
    return _parse(body, pb.SendMessageRequest())


def _cancel(body: dict[str, Any], task_id: str) -> pb.CancelTaskRequest:
    req = _parse(body, pb.CancelTaskRequest())  # its metadata may carry a cancel proof
    req.id = task_id
    return req


def _subscribe(body: dict[str, Any], task_id: str) -> pb.SubscribeToTaskRequest:
    return pb.SubscribeToTaskRequest(id=task_id)


def _get(body: dict[str, Any], task_id: str) -> pb.GetTaskRequest:
    req = _query(pb.GetTaskRequest())
    req.id = task_id
    return req


def _list(body: dict[str, Any]) -> pb.ListTasksRequest:
    return _query(pb.ListTasksRequest())


def _push_create(body: dict[str, Any], task_id: str) -> pb.TaskPushNotificationConfig:
    req = _parse(body, pb.TaskPushNotificationConfig())
    req.task_id = task_id
    return req


def _push_list(body: dict[str, Any], task_id: str) -> pb.ListTaskPushNotificationConfigsRequest:
    req = _query(pb.ListTaskPushNotificationConfigsRequest())
    req.task_id = task_id
    return req


def _push_get(
    body: dict[str, Any], task_id: str, push_id: str
) -> pb.GetTaskPushNotificationConfigRequest:
    return pb.GetTaskPushNotificationConfigRequest(task_id=task_id, id=push_id)


def _push_delete(
    body: dict[str, Any], task_id: str, push_id: str
) -> pb.DeleteTaskPushNotificationConfigRequest:
    return pb.DeleteTaskPushNotificationConfigRequest(task_id=task_id, id=push_id)


def _extended_card(body: dict[str, Any]) -> pb.GetExtendedAgentCardRequest:
    raise ExtendedAgentCardNotConfiguredError()
