"""The A2A mapping (`funduq_trio.protocol.a2a`), pure: no server, no trio.

Shapes are checked by reading them back the way an A2A client would: through
a2a-sdk's own types (`ParseDict` into its protobuf messages, its v0.3 models),
and RunAgentInputs through ag-ui's own model.
"""

from __future__ import annotations

import base64
import json
import time
from typing import Any

import pytest
from a2a.client.card_resolver import parse_agent_card
from a2a.compat.v0_3 import types as types_v03
from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import (
    InvalidParamsError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from ag_ui.core import RunAgentInput
from google.protobuf.json_format import MessageToDict, ParseDict

from funduq_trio.broker import errors as broker_errors
from funduq_trio.protocol import a2a
from funduq_trio.web.door_errors import a2a_error

S = pb.TaskState

# -------------------------------------------------------------------- helpers


def record(status: str, events: list[dict[str, Any]] = (), **metadata: Any) -> dict[str, Any]:
    return {
        "runId": "run_1",
        "threadId": "thread_1",
        "agent": {"provider": "ab" * 32, "name": "echo"},
        "status": status,
        "metadata": metadata,
        "createdAt": "2024-05-01T10:00:00.000Z",
        "startedAt": "2024-05-01T10:00:01.000Z" if status != "queued" else None,
        "completedAt": "2024-05-01T10:00:02.250Z"
        if status in ("completed", "failed", "cancelled", "input-required")
        else None,
        "events": [{"seq": i + 1, "event": e} for i, e in enumerate(events)],
    }


def text(message_id: str, *deltas: str) -> list[dict[str, Any]]:
    return [
        {"type": "TEXT_MESSAGE_START", "messageId": message_id, "role": "assistant"},
        *({"type": "TEXT_MESSAGE_CONTENT", "messageId": message_id, "delta": d} for d in deltas),
        {"type": "TEXT_MESSAGE_END", "messageId": message_id},
    ]


STARTED = {"type": "RUN_STARTED", "threadId": "thread_1", "runId": "run_1"}
FINISHED = {"type": "RUN_FINISHED", "threadId": "thread_1", "runId": "run_1"}


def as_client_sees(task: pb.Task) -> pb.Task:
    """Round-trip through ProtoJSON, as the wire carries it."""
    return ParseDict(MessageToDict(task), pb.Task())


def rpc(method: str, params: Any = None, *, id: Any = 1) -> bytes:
    body: dict[str, Any] = {"jsonrpc": "2.0", "id": id, "method": method}
    if params is not None:
        body["params"] = params
    return json.dumps(body).encode()


def rejected(body: bytes | str, version: str | None) -> dict[str, Any]:
    with pytest.raises(a2a.CallRejected) as info:
        a2a.parse_call(body, version)
    return info.value.response


def message(**extra: Any) -> dict[str, Any]:
    return {"messageId": "m-1", "role": "ROLE_USER", "parts": [{"text": "hi"}], **extra}


# -------------------------------------------------------------------- statuses


@pytest.mark.parametrize(
    ("status", "state"),
    [
        ("queued", S.TASK_STATE_SUBMITTED),
        ("offering", S.TASK_STATE_SUBMITTED),
        ("running", S.TASK_STATE_WORKING),
        ("cancelling", S.TASK_STATE_WORKING),
        ("input-required", S.TASK_STATE_INPUT_REQUIRED),
        ("completed", S.TASK_STATE_COMPLETED),
        ("failed", S.TASK_STATE_FAILED),
        ("cancelled", S.TASK_STATE_CANCELED),
    ],
)
def test_every_run_status_reads_as_the_designed_task_state(status: str, state: int) -> None:
    task = as_client_sees(a2a.task_from_record(record(status)))
    assert task.id == "run_1"
    assert task.context_id == "thread_1"
    assert task.status.state == state
    marker = task.metadata.fields.get(a2a.CANCEL_REQUESTED_KEY)
    if status == "cancelling":
        assert marker is not None and marker.bool_value is True
    else:
        assert marker is None


def test_a_settled_task_carries_its_completion_time() -> None:
    task = as_client_sees(a2a.task_from_record(record("completed")))
    assert task.status.timestamp.ToJsonString() == "2024-05-01T10:00:02.250Z"


def test_failed_task_says_the_run_error_message() -> None:
    events = [STARTED, {"type": "RUN_ERROR", "message": "the model fell over", "code": "x"}]
    task = as_client_sees(a2a.task_from_record(record("failed", events, failureReason="whatever")))
    assert task.status.state == S.TASK_STATE_FAILED
    assert task.status.message.role == pb.Role.ROLE_AGENT
    assert [p.text for p in task.status.message.parts] == ["the model fell over"]


def test_failed_task_without_a_run_error_says_its_failure_reason() -> None:
    task = as_client_sees(a2a.task_from_record(record("failed", failureReason="agent_offline")))
    assert [p.text for p in task.status.message.parts] == ["agent_offline"]
    assert task.metadata.fields["failureReason"].string_value == "agent_offline"


def test_paused_task_carries_its_interrupts_verbatim() -> None:
    interrupts = [
        {
            "id": "int-1",
            "reason": "approval",
            "message": "Deploy to prod?",
            "expiresAt": "2030-01-01T00:00:00Z",
        }
    ]
    task = as_client_sees(a2a.task_from_record(record("input-required", interrupts=interrupts)))
    assert task.status.state == S.TASK_STATE_INPUT_REQUIRED
    assert MessageToDict(task.metadata)["interrupts"] == interrupts
    parts = task.status.message.parts
    assert parts[0].text == "Deploy to prod?"
    assert MessageToDict(parts[1].data)["interrupts"] == interrupts


@pytest.mark.parametrize("status", ["queued", "offering", "running", "cancelling"])
def test_an_accepted_cancel_answer_is_marked_pending(status: str) -> None:
    task = a2a.task_from_record(record(status), cancel_requested=True)
    assert task.metadata.fields[a2a.CANCEL_REQUESTED_KEY].bool_value is True


@pytest.mark.parametrize("status", ["completed", "failed", "cancelled", "input-required"])
def test_no_cancel_marker_once_nothing_is_pending(status: str) -> None:
    task = a2a.task_from_record(record(status), cancel_requested=True)
    assert a2a.CANCEL_REQUESTED_KEY not in task.metadata.fields


# -------------------------------------------------------------------- artifacts


def test_text_messages_become_text_artifacts_keyed_by_message_id() -> None:
    events = [STARTED, *text("msg-a", "Hel", "lo"), *text("msg-b", "again"), FINISHED]
    task = as_client_sees(a2a.task_from_record(record("completed", events)))
    assert [(a.artifact_id, [p.text for p in a.parts]) for a in task.artifacts] == [
        ("msg-a", ["Hello"]),
        ("msg-b", ["again"]),
    ]


def test_a2a_artifact_custom_event_becomes_an_artifact() -> None:
    artifact = {
        "artifactId": "report",
        "name": "Report",
        "parts": [
            {"data": {"rows": 3}},
            {"url": "https://example.com/r.pdf", "mediaType": "application/pdf"},
        ],
    }
    events = [STARTED, {"type": "CUSTOM", "name": "a2a.artifact", "value": artifact}, FINISHED]
    task = as_client_sees(a2a.task_from_record(record("completed", events)))
    (got,) = task.artifacts
    assert got.artifact_id == "report"
    assert got.name == "Report"
    assert MessageToDict(got.parts[0].data) == {"rows": 3}
    assert got.parts[1].url == "https://example.com/r.pdf"


def test_a2a_artifact_in_its_v0_3_form_is_read_too() -> None:
    artifact = {"artifactId": "old", "parts": [{"kind": "text", "text": "legacy"}]}
    events = [{"type": "CUSTOM", "name": "a2a.artifact", "value": artifact}]
    task = a2a.task_from_record(record("running", events))
    assert [(a.artifact_id, a.parts[0].text) for a in task.artifacts] == [("old", "legacy")]


def test_a_long_text_message_folds_in_linear_time() -> None:
    # A provider may stream one message as tens of thousands of small deltas;
    # GetTask, ListTasks, every subscriber and every push deliverer fold them
    # on the event loop. Growing the artifact's text per delta copied it every
    # time (40k deltas of 20 chars: a minute). Checked as a shape, not a speed:
    # a delta folded late must cost about what one folded early did (a copying
    # fold makes the last 5k deltas ~15x dearer than the first 5k), whatever
    # the machine's pace.
    projection = a2a.TaskProjection("run_1", "thread_1")
    projection.apply(1, STARTED)
    deltas, chunk, window = 40_000, "0123456789abcdefghij", 5_000
    cost = {}
    started = time.thread_time()
    for seq in range(2, deltas + 2):
        projection.apply(seq, {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": chunk})
        if seq - 1 in (window, deltas - window, deltas):
            cost[seq - 1] = time.thread_time()
    first = cost[window] - started
    last = cost[deltas] - cost[deltas - window]
    assert last < 4 * first + 0.05, (
        f"the last {window} deltas cost {last:.3f}s, the first {first:.3f}s"
    )
    (artifact,) = projection.task().artifacts
    assert [len(p.text) for p in artifact.parts] == [deltas * len(chunk)]


def test_text_deltas_after_an_artifact_of_the_same_id_extend_it() -> None:
    artifact = {"artifactId": "m", "parts": [{"text": "head "}]}
    events = [
        STARTED,
        {"type": "CUSTOM", "name": "a2a.artifact", "value": artifact},
        *text("m", "and", " tail"),
        {
            "type": "CUSTOM",
            "name": "a2a.artifact",
            "value": {"artifactId": "n", "parts": [{"data": {"k": 1}}]},
        },
        *text("n", "x", "y"),
    ]
    task = a2a.task_from_record(record("running", events))
    assert [
        (a.artifact_id, [p.WhichOneof("content") for p in a.parts]) for a in task.artifacts
    ] == [
        ("m", ["text"]),
        ("n", ["data", "text", "text"]),
    ]
    assert task.artifacts[0].parts[0].text == "head and tail"
    assert [p.text for p in task.artifacts[1].parts[1:]] == ["x", "y"]
    # A later artifact event with the same id replaces it, deltas and all.
    again = [*events, {"type": "CUSTOM", "name": "a2a.artifact", "value": artifact}]
    task = a2a.task_from_record(record("running", again))
    assert [p.text for p in task.artifacts[0].parts] == ["head "]


def test_a_custom_event_that_is_no_artifact_is_relayed_as_an_event() -> None:
    projection = a2a.TaskProjection("run_1", "thread_1")
    event = {"type": "CUSTOM", "name": "a2a.artifact", "value": {"nope": True}}
    (update,) = projection.apply(1, event)
    assert update.WhichOneof("payload") == "status_update"
    assert MessageToDict(update.status_update.metadata)[a2a.AGUI_EVENT_KEY] == event
    assert not projection.task().artifacts


# -------------------------------------------------------------------- stream updates


def test_events_become_stream_updates_in_order() -> None:
    projection = a2a.TaskProjection.from_record(record("queued"))
    updates = []
    for seq, event in enumerate(
        [STARTED, *text("msg-a", "Hel", "lo"), {"type": "MY_NEW_EVENT", "x": 1}, FINISHED],
        start=1,
    ):
        updates.extend(projection.apply(seq, event))
    kinds = [u.WhichOneof("payload") for u in updates]
    assert kinds == [
        "status_update",  # RUN_STARTED
        "status_update",  # TEXT_MESSAGE_START
        "artifact_update",
        "artifact_update",
        "status_update",  # TEXT_MESSAGE_END
        "status_update",  # an event funduq does not know, relayed untouched
    ]
    first, second = updates[2].artifact_update, updates[3].artifact_update
    assert (first.artifact.artifact_id, first.append, first.artifact.parts[0].text) == (
        "msg-a",
        False,
        "Hel",
    )
    assert (second.artifact.artifact_id, second.append, second.artifact.parts[0].text) == (
        "msg-a",
        True,
        "lo",
    )
    for update in (updates[0], updates[1], updates[4], updates[5]):
        assert update.status_update.status.state == S.TASK_STATE_WORKING
    assert MessageToDict(updates[5].status_update.metadata)[a2a.AGUI_EVENT_KEY] == {
        "type": "MY_NEW_EVENT",
        "x": 1,
    }

    final = projection.settle(record("completed", [STARTED, *text("msg-a", "Hel", "lo"), FINISHED]))
    assert final.status_update.status.state == S.TASK_STATE_COMPLETED
    assert MessageToDict(final.status_update.metadata)[a2a.AGUI_EVENT_KEY] == FINISHED
    assert [p.text for p in projection.task().artifacts[0].parts] == ["Hello"]


def test_a_stream_continuing_a_snapshot_appends_to_its_artifacts() -> None:
    projection = a2a.TaskProjection.from_record(
        record(
            "running", [STARTED, {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "a"}]
        )
    )
    assert projection.last_seq == 2
    assert (
        projection.apply(2, {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "a"}) == []
    )
    (update,) = projection.apply(
        3, {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "b"}
    )
    assert update.artifact_update.append is True


def test_a_cancelling_stream_keeps_its_pending_marker() -> None:
    projection = a2a.TaskProjection.from_record(record("cancelling"))
    (update,) = projection.apply(1, {"type": "STEP_STARTED", "stepName": "x"})
    assert update.status_update.metadata.fields[a2a.CANCEL_REQUESTED_KEY].bool_value is True
    final = projection.settle(record("cancelled"))
    assert final.status_update.status.state == S.TASK_STATE_CANCELED
    assert a2a.CANCEL_REQUESTED_KEY not in final.status_update.metadata.fields


# -------------------------------------------------------------------- message -> RunAgentInput


def parse_message(data: dict[str, Any]) -> pb.Message:
    return ParseDict(data, pb.Message())


def test_a_text_message_becomes_one_user_message_keeping_its_id() -> None:
    msg = parse_message(
        message(parts=[{"text": "line one"}, {"text": "line two"}], metadata={"mine": 1})
    )
    run_input = a2a.run_input_from_message(msg)
    parsed = RunAgentInput.model_validate(run_input)
    (user,) = parsed.messages
    assert user.id == "m-1"
    assert user.role == "user"
    assert user.content == "line one\nline two"
    assert user.metadata == {"mine": 1}
    assert parsed.resume is None


def test_data_and_file_parts_are_carried() -> None:
    png = b"\x89PNG..."
    msg = parse_message(
        message(
            parts=[
                {"text": "look"},
                {"data": {"k": [1, 2]}},
                {
                    "raw": base64.b64encode(png).decode(),
                    "mediaType": "image/png",
                    "filename": "a.png",
                },
                {"url": "https://example.com/doc.pdf", "mediaType": "application/pdf"},
            ]
        )
    )
    run_input = a2a.run_input_from_message(msg)
    parsed = RunAgentInput.model_validate(run_input)
    content = parsed.messages[0].content
    assert [c.type for c in content] == ["text", "image", "document"]
    assert content[0].text == "look"
    assert base64.b64decode(content[1].source.value) == png
    assert content[1].source.mime_type == "image/png"
    assert content[2].source.value == "https://example.com/doc.pdf"
    assert parsed.forwarded_props["a2a"]["dataParts"] == [{"k": [1, 2]}]


def test_an_answer_to_a_pause_resolves_each_interrupt() -> None:
    msg = parse_message(message(parts=[{"data": {"approved": True}}]))
    run_input = a2a.run_input_from_message(
        msg, interrupts=[{"id": "int-1", "reason": "approval"}, {"id": "int-2", "reason": "x"}]
    )
    parsed = RunAgentInput.model_validate(run_input)
    assert [(r.interrupt_id, r.status, r.payload) for r in parsed.resume] == [
        ("int-1", "resolved", {"approved": True}),
        ("int-2", "resolved", {"approved": True}),
    ]


# -------------------------------------------------------------------- JSON-RPC calls

SEND_PARAMS_CAMEL = {
    "message": message(contextId="thread_9", taskId="run_9"),
    "configuration": {"returnImmediately": True},
    "metadata": {"actorChain": ["tok"], "cancel": {"timestamp": 1700000000}},
}
SEND_PARAMS_SNAKE = {
    "message": {
        "message_id": "m-1",
        "role": "ROLE_USER",
        "parts": [{"text": "hi"}],
        "context_id": "thread_9",
        "task_id": "run_9",
    },
    "configuration": {"return_immediately": True},
    "metadata": {"actorChain": ["tok"], "cancel": {"timestamp": 1700000000}},
}


@pytest.mark.parametrize("params", [SEND_PARAMS_CAMEL, SEND_PARAMS_SNAKE])
def test_send_message_params_parse_in_either_case(params: dict[str, Any]) -> None:
    call = a2a.parse_call(rpc("SendMessage", params), "1.0")
    assert (call.op, call.dialect, call.request_id) == (a2a.SEND, "1.0", 1)
    msg = call.request.message
    assert (msg.message_id, msg.context_id, msg.task_id) == ("m-1", "thread_9", "run_9")
    assert call.request.configuration.return_immediately is True
    metadata = call.request_metadata()
    assert metadata == {"actorChain": ["tok"], "cancel": {"timestamp": 1700000000}}
    assert isinstance(metadata["cancel"]["timestamp"], int)


def test_v0_3_send_parses_to_the_same_request() -> None:
    params = {
        "message": {
            "kind": "message",
            "messageId": "m-1",
            "role": "user",
            "parts": [{"kind": "text", "text": "hi"}],
            "contextId": "thread_9",
        },
        "configuration": {"blocking": False},
        "metadata": {"actorChain": ["tok"]},
    }
    call = a2a.parse_call(rpc("message/send", params), None)
    assert (call.op, call.dialect) == (a2a.SEND, "0.3")
    assert call.request.message.parts[0].text == "hi"
    assert call.request.message.context_id == "thread_9"
    assert call.request.configuration.return_immediately is True
    assert call.request_metadata() == {"actorChain": ["tok"]}


@pytest.mark.parametrize(
    ("method", "params", "op", "dialect", "version"),
    [
        ("SendStreamingMessage", {"message": message()}, a2a.STREAM, "1.0", "1.0"),
        ("GetTask", {"id": "run_1"}, a2a.GET, "1.0", "1.0"),
        ("CancelTask", {"id": "run_1", "metadata": {"cancel": {}}}, a2a.CANCEL, "1.0", "1.0"),
        ("SubscribeToTask", {"id": "run_1"}, a2a.SUBSCRIBE, "1.0", "1.0"),
        ("ListTasks", {"contextId": "thread_1"}, a2a.LIST, "1.0", "1.0"),
        (
            "message/stream",
            {
                "message": {
                    "messageId": "m",
                    "role": "user",
                    "parts": [{"kind": "text", "text": "x"}],
                }
            },
            a2a.STREAM,
            "0.3",
            None,
        ),
        ("tasks/get", {"id": "run_1"}, a2a.GET, "0.3", None),
        ("tasks/cancel", {"id": "run_1"}, a2a.CANCEL, "0.3", "0.3"),
        ("tasks/resubscribe", {"id": "run_1"}, a2a.SUBSCRIBE, "0.3", None),
    ],
)
def test_both_method_name_sets_are_served(
    method: str, params: dict[str, Any], op: str, dialect: str, version: str | None
) -> None:
    call = a2a.parse_call(rpc(method, params, id="req-7"), version)
    assert (call.op, call.dialect, call.request_id) == (op, dialect, "req-7")
    assert call.streaming is (op in (a2a.STREAM, a2a.SUBSCRIBE))


@pytest.mark.parametrize(
    "body",
    [
        b'{"jsonrpc": "2.0", "id": 1, "method": ',
        b"\xff\xfe not utf-8 {",
        b"[" * 5000 + b"]" * 5000,  # JSON, but deeper than any parser here goes
    ],
)
def test_invalid_json_is_a_parse_error_with_null_id(body: bytes) -> None:
    response = rejected(body, "1.0")
    assert response["error"]["code"] == -32700
    assert response["id"] is None


@pytest.mark.parametrize(
    "body",
    [
        json.dumps({"id": 1, "method": "GetTask"}),  # no jsonrpc member
        json.dumps({"jsonrpc": "1.0", "id": 1, "method": "GetTask"}),
        json.dumps([{"jsonrpc": "2.0", "id": 1, "method": "GetTask"}]),  # batch
        json.dumps("GetTask"),
    ],
)
def test_bad_envelopes_are_invalid_requests(body: str) -> None:
    assert rejected(body, "1.0")["error"]["code"] == -32600


def test_unknown_method_is_method_not_found() -> None:
    response = rejected(rpc("tasks/explode", {}), "1.0")
    assert response["error"]["code"] == -32601
    assert response["id"] == 1


def test_missing_required_params_are_invalid_params_with_the_sdk_details() -> None:
    response = rejected(rpc("GetTask", {}), "1.0")
    error = response["error"]
    assert error["code"] == -32602
    info = error["data"][0]
    assert info["@type"] == "type.googleapis.com/google.rpc.ErrorInfo"
    assert info["reason"] == "INVALID_PARAMS"
    assert info["metadata"]["errors"] == [{"field": "id", "message": "Field is required."}]


def test_params_that_do_not_parse_are_invalid_params() -> None:
    assert rejected(rpc("GetTask", {"id": 5}), "1.0")["error"]["code"] == -32602
    assert (
        rejected(rpc("SendMessage", {"message": message(parts=[])}), "1.0")["error"]["code"]
        == -32602
    )


@pytest.mark.parametrize(("method", "version"), [("SendMessage", "1.0"), ("message/send", None)])
def test_metadata_nested_past_protobufs_limit_is_invalid_params(
    method: str, version: str | None
) -> None:
    deep: Any = 1
    for _ in range(150):
        deep = {"a": deep}
    msg = (
        message()
        if version
        else {
            "kind": "message",
            "messageId": "m",
            "role": "user",
            "parts": [{"kind": "text", "text": "x"}],
        }
    )
    response = rejected(rpc(method, {"message": msg, "metadata": deep}), version)
    assert response["error"]["code"] == -32602


def test_v0_3_params_its_models_reject_are_invalid_requests_as_the_sdk_answers() -> None:
    response = rejected(rpc("tasks/get", {}), None)
    assert response["error"]["code"] == -32600
    assert isinstance(response["error"]["data"], str)


def test_version_header_rules() -> None:
    # A 1.0 method needs a 1.x header; no header means 0.3.
    for version in (None, "", "0.3", "2.0", "banana"):
        error = rejected(rpc("GetTask", {"id": "r"}), version)["error"]
        assert error["code"] == -32009, version
        assert error["data"][0]["reason"] == "VERSION_NOT_SUPPORTED"
    for version in ("1.0", "1.1", "1.0.2"):
        assert a2a.parse_call(rpc("GetTask", {"id": "r"}), version).op == a2a.GET
    # A 0.3 method needs a 0.x header (or none); 0.3 has no -32009, so a 0.3
    # caller hears -32603 with the SDK's message, as the SDK's adapter answers.
    for version in (None, "0.3"):
        assert a2a.parse_call(rpc("tasks/get", {"id": "r"}), version).op == a2a.GET
    error = rejected(rpc("tasks/get", {"id": "r"}), "1.0")["error"]
    assert error["code"] == -32603
    assert "not supported" in error["message"]


def test_push_config_methods_parse_in_both_dialects() -> None:
    params = {"taskId": "run_1", "url": "https://example.com/hook"}
    call = a2a.parse_call(rpc("CreateTaskPushNotificationConfig", params), "1.0")
    assert call.op == a2a.PUSH_CREATE and call.request.url == "https://example.com/hook"
    old = {"taskId": "run_1", "pushNotificationConfig": {"url": "https://example.com/hook"}}
    call = a2a.parse_call(rpc("tasks/pushNotificationConfig/set", old), None)
    assert call.op == a2a.PUSH_CREATE and call.request.task_id == "run_1"
    call = a2a.parse_call(rpc("tasks/pushNotificationConfig/list", {"id": "run_1"}), None)
    assert call.op == a2a.PUSH_LIST and call.request.task_id == "run_1"


# -------------------------------------------------------------------- rendering


def test_results_render_in_each_dialect() -> None:
    task = a2a.task_from_record(record("completed", [STARTED, *text("m", "hey"), FINISHED]))
    v1 = a2a.result_response(
        a2a.parse_call(rpc("SendMessage", {"message": message()}), "1.0"), task
    )
    assert v1["jsonrpc"] == "2.0" and v1["id"] == 1
    assert ParseDict(v1["result"], pb.SendMessageResponse()).task.status.state == (
        S.TASK_STATE_COMPLETED
    )

    call = a2a.parse_call(rpc("tasks/get", {"id": "run_1"}), None)
    v03 = a2a.result_response(call, task)
    compat = types_v03.GetTaskSuccessResponse.model_validate(v03)
    assert compat.result.kind == "task"
    assert compat.result.status.state == types_v03.TaskState.completed
    assert compat.result.artifacts[0].parts[0].root.text == "hey"


def test_stream_frames_render_in_each_dialect() -> None:
    update = a2a.TaskProjection("run_1", "thread_1").apply(
        1, {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "x"}
    )[0]
    v1 = a2a.stream_frame(a2a.parse_call(rpc("SubscribeToTask", {"id": "r"}), "1.0"), update)
    assert (
        ParseDict(v1["result"], pb.StreamResponse()).artifact_update.artifact.parts[0].text == "x"
    )
    v03 = a2a.stream_frame(a2a.parse_call(rpc("tasks/resubscribe", {"id": "r"}), None), update)
    assert v03["result"]["kind"] == "artifact-update"


def test_errors_render_as_each_dialect_builds_them() -> None:
    v1_call = a2a.parse_call(rpc("GetTask", {"id": "r"}), "1.0")
    v1 = a2a.error_response(v1_call, TaskNotFoundError(data={"taskId": "r"}))
    assert v1["error"]["code"] == -32001
    assert v1["error"]["data"][0]["reason"] == "TASK_NOT_FOUND"
    assert v1["error"]["data"][0]["metadata"] == {"taskId": "r"}

    v03_call = a2a.parse_call(rpc("tasks/cancel", {"id": "r"}), None)
    v03 = a2a.error_response(v03_call, TaskNotCancelableError())
    assert v03["error"]["code"] == -32002
    assert v03["error"]["message"] == "Task cannot be canceled"


def test_broker_errors_map_to_sdk_errors() -> None:
    assert isinstance(a2a_error(broker_errors.RunNotFound("x")), TaskNotFoundError)
    assert isinstance(a2a_error(broker_errors.RunNotCancellable("x")), TaskNotCancelableError)
    unknown = a2a_error(broker_errors.UnknownThread("no such thread"))
    assert isinstance(unknown, InvalidParamsError)
    full = a2a_error(broker_errors.ThreadQueueFull("thread t holds 8 pending runs"))
    assert isinstance(full, UnsupportedOperationError)
    assert "8 pending" in full.message
    # Not authorized says the same thing whatever it was about.
    one = a2a_error(broker_errors.NotAuthorized("bad signature for a running run"))
    two = a2a_error(broker_errors.NotAuthorized("no proof on a paused run"))
    assert isinstance(one, InvalidParamsError)
    assert (one.message, one.data) == (two.message, two.data)
    assert "running" not in one.message and "paused" not in one.message


# -------------------------------------------------------------------- agent card


def test_agent_card_reads_back_through_the_sdk_client() -> None:
    published = {
        "version": "2.1.0",
        "skills": [
            {"id": "echo", "name": "Echo", "description": "says it back", "tags": ["demo"]},
            {"name": "nameless-id"},
        ],
    }
    url = "http://127.0.0.1:9/a2a/0123456789abcdef/echo"
    card_json = a2a.agent_card(name="echo", description="An echo", rpc_url=url, published=published)
    # Older clients read the 0.3 fields of the same document.
    assert card_json["url"] == url
    assert card_json["protocolVersion"] == "0.3"
    card = parse_agent_card(card_json)
    assert (card.name, card.description, card.version) == ("echo", "An echo", "2.1.0")
    assert card.capabilities.streaming is True
    assert [(i.url, i.protocol_binding, i.protocol_version) for i in card.supported_interfaces] == [
        (url, "JSONRPC", "1.0"),
        (url, "JSONRPC", "0.3"),
    ]
    assert [(s.id, s.name) for s in card.skills] == [
        ("echo", "Echo"),
        ("nameless-id", "nameless-id"),
    ]


def test_an_agent_without_published_skills_is_its_own_skill() -> None:
    card = parse_agent_card(
        a2a.agent_card(name="echo", description="An echo", rpc_url="http://x/a2a/p/echo")
    )
    assert [(s.id, s.description) for s in card.skills] == [("echo", "An echo")]


# -------------------------------------------------------------------- ListTasks


def test_list_pages_newest_first_with_status_filter() -> None:
    records = []
    for i, status in enumerate(["completed", "running", "completed", "failed", "completed"]):
        r = record(status)
        r["runId"] = f"run_{i}"
        r["createdAt"] = f"2024-05-01T10:00:0{i}.000Z"
        r["startedAt"] = r["createdAt"]
        r["completedAt"] = r["createdAt"] if status != "running" else None
        records.append(r)
    request = pb.ListTasksRequest(status=S.TASK_STATE_COMPLETED, page_size=2)
    first = a2a.select_page(request, records)
    assert [r["runId"] for r in first.records] == ["run_4", "run_2"]
    assert first.total_size == 3 and first.next_page_token
    request.page_token = first.next_page_token
    second = a2a.select_page(request, records)
    assert [r["runId"] for r in second.records] == ["run_0"]
    assert second.next_page_token == ""
    response = a2a.list_tasks_response(request, second, second.records)
    call = a2a.parse_call(rpc("ListTasks", {}), "1.0")
    rendered = a2a.result_response(call, response)["result"]
    assert [t["id"] for t in rendered["tasks"]] == ["run_0"]
    assert rendered["totalSize"] == 3


def test_a_snapshot_folds_every_kind_of_event_as_a_stream_does():
    """`task_from_record` folds a record without building stream updates; the
    Task must be the one a stream's projection reaches by applying the same
    events one by one (updates built)."""
    from funduq_trio.protocol.a2a.projection import (
        ARTIFACT_EVENT_NAME,
        TaskProjection,
        task_from_record,
    )

    ids = {"threadId": "thread_x", "runId": "run_x"}
    events = [
        {"type": "RUN_STARTED", **ids},
        {"type": "TEXT_MESSAGE_START", "messageId": "m", "role": "assistant"},
        {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "one "},
        {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": ""},
        {"type": "TEXT_MESSAGE_CHUNK", "delta": "two"},
        {"type": "TEXT_MESSAGE_CHUNK", "messageId": "n"},
        {"type": "TEXT_MESSAGE_END", "messageId": "m"},
        {
            "type": "CUSTOM",
            "name": ARTIFACT_EVENT_NAME,
            "value": {"artifactId": "a", "parts": [{"text": "whole"}]},
        },
        {"type": "SOMETHING_NEWER", "payload": [1, None]},
        {"type": "RUN_ERROR", "message": "it broke"},
    ]
    for status in ("completed", "failed", "running", "input-required"):
        record = {
            **{"runId": "run_x", "threadId": "thread_x", "status": status, "metadata": {}},
            "createdAt": "2026-12-03T10:00:00Z",
            "events": [{"seq": i + 1, "event": e} for i, e in enumerate(events)],
        }
        streamed = TaskProjection(task_id="run_x", context_id="thread_x")
        updates = [u for i, e in enumerate(events) for u in streamed.apply(i + 1, e)]
        streamed.observe(record)
        assert updates  # the stream's side did build them
        assert task_from_record(record) == streamed.task(), status
