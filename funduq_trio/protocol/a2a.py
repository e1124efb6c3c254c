"""The A2A mapping, I/O-free: JSON-RPC calls in, run records and AG-UI events
out as A2A Tasks and stream updates (DESIGN §5 "A2A door").

Every shape here is built with a2a-sdk's own types -- its protobuf messages
(`a2a.types`) and `google.protobuf.json_format` for protocol 1.0, its v0.3
pydantic models and converters (`a2a.compat.v0_3`) for the 0.3 method names --
and every error is one of its error classes with the code and `error.data` its
own JSON-RPC server gives them. Nothing in this module touches a socket, the
clock or trio; `funduq_trio/web/a2a_door.py` is the thin shell that does.

The pieces, in the order a request meets them:

- `parse_call(body, version_header)` turns the HTTP body into a `Call` (the
  request id, which of the two method-name sets, the operation, the request as
  a 1.0 protobuf message), or raises `CallRejected` carrying the JSON-RPC
  error response to send. Its checks run in the a2a-sdk server's order: JSON,
  the JSON-RPC envelope, the method name, the params, the `A2A-Version` header,
  required fields.
- `task_from_record(record)` is the Task a run record (the `GET /runs/{id}`
  shape) reads as; `TaskProjection` is the same projection fed one event at a
  time, answering each with the stream updates the event becomes.
- `run_input_from_message(message)` is the AG-UI `RunAgentInput` (a camelCase
  dict) an A2A message asks for.
- `result_response`, `stream_frame`, `error_response` render answers in the
  dialect of the call (1.0 ProtoJSON or 0.3 pydantic JSON).

Status mapping (exactly DESIGN's table): queued/offering -> SUBMITTED, running
-> WORKING, cancelling -> WORKING with ``funduq/cancelRequested: true`` in the
Task's metadata, input-required -> INPUT_REQUIRED with ``interrupts``,
completed -> COMPLETED, failed -> FAILED with the RUN_ERROR's message as the
status message, cancelled -> CANCELED.
"""

from __future__ import annotations

import base64
import json
import logging
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, get_args

from a2a.compat.v0_3 import conversions as v03
from a2a.compat.v0_3 import types as types_v03
from a2a.server import jsonrpc_models as rpc
from a2a.server.request_handlers.response_helpers import (
    agent_card_to_dict,
    build_error_response,
)
from a2a.types import a2a_pb2 as pb
from a2a.utils import constants
from a2a.utils.error_handlers import build_rest_error_payload
from a2a.utils.errors import (
    JSON_RPC_ERROR_CODE_MAP,
    A2AError,
    ExtendedAgentCardNotConfiguredError,
    InvalidParamsError,
    InvalidRequestError,
    VersionNotSupportedError,
)
from a2a.utils.proto_utils import parse_lenient, validate_proto_required_fields
from a2a.utils.task import decode_page_token, encode_page_token
from ag_ui.core import EventType
from google.protobuf.json_format import MessageToDict, ParseDict
from google.protobuf.message import Message as ProtoMessage
from jsonrpc.jsonrpc2 import JSONRPC20Request, JSONRPC20Response
from packaging.version import InvalidVersion, Version

from .. import jose
from ..identity import Identity
from . import carriable, statuses

__all__ = [
    "AGUI_EVENT_KEY",
    "ARTIFACT_EVENT_NAME",
    "CANCEL_REQUESTED_KEY",
    "Call",
    "CallRejected",
    "TaskProjection",
    "agent_card",
    "error_response",
    "parse_call",
    "plain",
    "result_response",
    "run_input_from_message",
    "stream_frame",
    "task_from_record",
    "task_state",
]

log = logging.getLogger("funduq_trio.a2a")

#: Task metadata key: a cancel was asked for and the run has not settled yet.
CANCEL_REQUESTED_KEY = "funduq/cancelRequested"
#: Status-update metadata key carrying an AG-UI event that is not an artifact.
AGUI_EVENT_KEY = "funduq/aguiEvent"
#: The AG-UI CUSTOM event whose value is an A2A Artifact (DESIGN §5).
ARTIFACT_EVENT_NAME = "a2a.artifact"
#: Metadata key: what this metadata carries was altered to fit an A2A answer
#: (see `_fit`); the run's record (`GET /runs/{id}`) holds it as sent.
DEGRADED_KEY = "funduq/degraded"
#: Deepest JSON nesting a Struct in an answer holds. Protobuf parsers stop at
#: 100 message levels, a JSON level is two of them (Struct, Value), and the
#: answer's own messages wrap the Struct: past this a caller's SDK could not
#: parse the answer even when funduq could build it.
STRUCT_NESTING = 32
#: What stands in for a container nested past STRUCT_NESTING.
TOO_DEEP = "(nested too deep for A2A metadata; the run's record holds it as sent)"

V1 = constants.PROTOCOL_VERSION_1_0
V03 = constants.PROTOCOL_VERSION_0_3
#: The HTTP+JSON binding's "dialect": 1.0 shapes, no JSON-RPC envelope.
REST = "rest"

# AG-UI event type names, read off the package (never transcribed).
_TEXT_DELTA_TYPES = frozenset(
    {EventType.TEXT_MESSAGE_CONTENT.value, EventType.TEXT_MESSAGE_CHUNK.value}
)
_RUN_STARTED = EventType.RUN_STARTED.value
_RUN_FINISHED = EventType.RUN_FINISHED.value
_RUN_ERROR = EventType.RUN_ERROR.value
_CUSTOM = EventType.CUSTOM.value

# ---------------------------------------------------------------- statuses

_STATE_OF_STATUS: dict[str, int] = {
    statuses.QUEUED: pb.TaskState.TASK_STATE_SUBMITTED,
    statuses.OFFERING: pb.TaskState.TASK_STATE_SUBMITTED,
    statuses.RUNNING: pb.TaskState.TASK_STATE_WORKING,
    statuses.CANCELLING: pb.TaskState.TASK_STATE_WORKING,
    statuses.INPUT_REQUIRED: pb.TaskState.TASK_STATE_INPUT_REQUIRED,
    statuses.COMPLETED: pb.TaskState.TASK_STATE_COMPLETED,
    statuses.FAILED: pb.TaskState.TASK_STATE_FAILED,
    statuses.CANCELLED: pb.TaskState.TASK_STATE_CANCELED,
}
assert set(_STATE_OF_STATUS) == statuses.ALL, "every run status maps to a TaskState"


def task_state(status: str) -> int:
    """The A2A TaskState a run status reads as."""
    return _STATE_OF_STATUS.get(status, pb.TaskState.TASK_STATE_UNSPECIFIED)


def status_of_state(state: int) -> frozenset[str]:
    """The run statuses that read as `state` (ListTasks' status filter)."""
    return frozenset(s for s, st in _STATE_OF_STATUS.items() if st == state)


# ---------------------------------------------------------------- JSON helpers


def plain(value: Any) -> Any:
    """JSON-able Python out of a protobuf Struct/Value (or anything JSON-like).

    Protobuf Struct numbers are doubles; an integral one is read as the integer
    it is (DESIGN §5: the signed bytes use the integer's digits).
    """
    if isinstance(value, ProtoMessage):
        value = MessageToDict(value)
    if isinstance(value, float) and value.is_integer() and abs(value) < 2**63:
        return int(value)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def _struct(message: ProtoMessage, field_name: str) -> dict[str, Any] | None:
    """A Struct field as a plain dict, None when unset."""
    if not message.HasField(field_name):
        return None
    return plain(getattr(message, field_name))


def _utf8(text: str) -> str:
    """`text` as protobuf can hold it: a lone surrogate (valid JSON, stored
    as sent) becomes U+FFFD."""
    if text.isascii():
        return text
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-16", "surrogatepass").decode("utf-16", "replace")
    return text


def _fits(value: Any, depth: int = 0) -> bool:
    """Whether a Struct holds `value` as it is (recursion stops at STRUCT_NESTING)."""
    if isinstance(value, str):
        return value.isascii() or _utf8(value) is value
    if isinstance(value, bool) or value is None:
        return True
    if isinstance(value, int):
        return value.bit_length() <= 1023  # a double holds it (roughly)
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, Mapping):
        return depth < STRUCT_NESTING and all(
            isinstance(k, str) and _fits(k) and _fits(v, depth + 1) for k, v in value.items()
        )
    if isinstance(value, list | tuple):
        return depth < STRUCT_NESTING and all(_fits(v, depth + 1) for v in value)
    return False


def _fit(value: Any, depth: int = 0) -> Any:
    """A copy of `value` a Struct holds, relaying what it can: strings with
    lone surrogates get U+FFFD, numbers a double cannot hold become their
    digits, containers nested past STRUCT_NESTING become TOO_DEEP."""
    if isinstance(value, str):
        return _utf8(value)
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        if value.bit_length() <= 1023:
            return value
        try:
            return str(value)
        except ValueError:  # past Python's own digit limit
            return "(an integer too large to show)"
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, Mapping | list | tuple):
        if depth >= STRUCT_NESTING:
            return TOO_DEEP
        if isinstance(value, Mapping):
            return {_utf8(str(k)): _fit(v, depth + 1) for k, v in value.items()}
        return [_fit(v, depth + 1) for v in value]
    return _utf8(str(value))


def _set_struct(target: Any, value: Mapping[str, Any]) -> None:
    """Fill a Struct from JSON-like `value`. What a Struct cannot hold (a stored
    provider event may be anything the link carried) is degraded by `_fit`
    and marked DEGRADED_KEY, so one odd event never fails a whole view."""
    if _fits(value):
        ParseDict(dict(value), target)
        return
    fitted = _fit(value)
    fitted[DEGRADED_KEY] = True
    target.Clear()
    ParseDict(fitted, target)


def _timestamp(value: Any) -> Any | None:
    """A protobuf Timestamp from a record time (ISO-8601 text or epoch seconds)."""
    from google.protobuf.timestamp_pb2 import Timestamp

    ts = Timestamp()
    try:
        if isinstance(value, bool) or value is None:
            return None
        if isinstance(value, int | float):
            ts.FromNanoseconds(int(value * 1_000_000_000))
            return ts
        if isinstance(value, str) and value:
            text = value.replace("+00:00", "Z")
            if not text.endswith("Z") and "+" not in text[10:] and "-" not in text[10:]:
                text += "Z"
            ts.FromJsonString(text)
            return ts
    except (ValueError, TypeError, OverflowError):
        return None
    return None


# ---------------------------------------------------------------- record -> Task


def _text_message(text: str, *, task_id: str, context_id: str, message_id: str) -> pb.Message:
    return pb.Message(
        message_id=_utf8(message_id),
        task_id=task_id,
        context_id=context_id,
        role=pb.Role.ROLE_AGENT,
        parts=[pb.Part(text=_utf8(text))],
    )


def _artifact_from_value(value: Any, fallback_id: str) -> pb.Artifact | None:
    """An A2A Artifact out of a CUSTOM `a2a.artifact` event's value.

    The value is an Artifact in its JSON form: 1.0 ProtoJSON, or the 0.3 form
    (parts with ``kind``), which the SDK's converter brings to 1.0. Anything
    that does not read as an artifact with parts is not one (None).
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    if not isinstance(value, Mapping):
        return None
    try:
        parts = value.get("parts")
        if isinstance(parts, list) and any(
            isinstance(p, Mapping) and "kind" in p for p in parts
        ):
            compat = dict(value)
            compat.setdefault("artifactId", fallback_id)
            artifact = v03.to_core_artifact(types_v03.Artifact.model_validate(compat))
        else:
            artifact = parse_lenient(dict(value), pb.Artifact())
    except Exception:  # noqa: BLE001 - any failure means "not an artifact"
        return None
    if not artifact.parts:
        return None
    if not artifact.artifact_id:
        artifact.artifact_id = fallback_id
    return artifact


@dataclass
class TaskProjection:
    """A run seen as an A2A Task, built up one AG-UI event at a time.

    `apply(seq, event)` folds an event into the task and answers the stream
    updates it becomes; `task()` is the snapshot so far; `settle(record)`
    takes status and metadata from the record and answers the final status
    update. Text deltas become text artifacts keyed by message id (the first
    chunk creates the artifact, later ones append to it); a CUSTOM
    `a2a.artifact` event becomes the artifact it carries; any other event rides
    a WORKING status update's metadata under ``funduq/aguiEvent``. The run's
    terminal events (RUN_FINISHED, RUN_ERROR) ride the final status update
    instead, so no WORKING is claimed after a run ended.
    """

    task_id: str
    context_id: str
    status: str = statuses.QUEUED
    record_metadata: dict[str, Any] = field(default_factory=dict)
    status_time: Any = None
    cancel_requested: bool = False
    last_seq: int = 0
    _artifacts: dict[str, pb.Artifact] = field(default_factory=dict)
    _last_text_id: str | None = None
    _run_error: str | None = None
    _terminal_event: dict[str, Any] | None = None

    # -- construction

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> TaskProjection:
        projection = cls(task_id=str(record["runId"]), context_id=str(record["threadId"]))
        for entry in record.get("events") or ():
            projection.apply(int(entry.get("seq", 0)), entry.get("event"))
        projection.observe(record)
        return projection

    def observe(self, record: Mapping[str, Any]) -> None:
        """Take the record's status, metadata and time (events are `apply`'s)."""
        self.status = str(record.get("status") or statuses.QUEUED)
        self.record_metadata = dict(record.get("metadata") or {})
        self.status_time = (
            record.get("completedAt") or record.get("startedAt") or record.get("createdAt")
        )
        funduq_meta = self.record_metadata.get("funduq")
        asked = isinstance(funduq_meta, Mapping) and "cancelRequestedBy" in funduq_meta
        if self.status == statuses.CANCELLING or (asked and self.status in statuses.ACTIVE):
            self.cancel_requested = True
        if self.status in statuses.TERMINAL or self.status == statuses.INPUT_REQUIRED:
            self.cancel_requested = False

    # -- events

    def apply(self, seq: int, event: Any) -> list[pb.StreamResponse]:
        """Fold one recorded AG-UI event in; answer the stream updates it becomes."""
        if seq and seq <= self.last_seq:
            return []  # already folded in (a snapshot and a follow overlap)
        self.last_seq = max(self.last_seq, seq)
        if not isinstance(event, Mapping):
            return []
        kind = event.get("type")
        if kind in _TEXT_DELTA_TYPES:
            update = self._text_delta(event)
            if update is not None:
                return [update]
            if kind == EventType.TEXT_MESSAGE_CHUNK.value:
                return []  # a chunk with nothing to say
        elif kind == _CUSTOM and event.get("name") == ARTIFACT_EVENT_NAME:
            artifact = _artifact_from_value(event.get("value"), f"artifact-{seq}")
            if artifact is not None:
                self._artifacts[artifact.artifact_id] = artifact
                update = pb.TaskArtifactUpdateEvent(
                    task_id=self.task_id,
                    context_id=self.context_id,
                    artifact=artifact,
                    append=False,
                    last_chunk=True,
                )
                return [pb.StreamResponse(artifact_update=update)]
        if kind == _RUN_STARTED:
            # A new turn (a paused run answered): the last one's end is history.
            self._terminal_event = self._run_error = None
        if kind in (_RUN_FINISHED, _RUN_ERROR):
            self._terminal_event = dict(event)
            if kind == _RUN_ERROR:
                message = event.get("message")
                self._run_error = str(message) if message is not None else None
            return []
        status = pb.TaskStatus(state=pb.TaskState.TASK_STATE_WORKING)
        update = pb.TaskStatusUpdateEvent(
            task_id=self.task_id, context_id=self.context_id, status=status
        )
        metadata: dict[str, Any] = {AGUI_EVENT_KEY: dict(event)}
        if self.cancel_requested:
            metadata[CANCEL_REQUESTED_KEY] = True
        _set_struct(update.metadata, metadata)
        return [pb.StreamResponse(status_update=update)]

    def _text_delta(self, event: Mapping[str, Any]) -> pb.StreamResponse | None:
        delta = event.get("delta")
        if not isinstance(delta, str) or delta == "":
            return None
        message_id = event.get("messageId") or self._last_text_id or "text"
        message_id = _utf8(str(message_id))
        delta = _utf8(delta)
        self._last_text_id = message_id
        existing = self._artifacts.get(message_id)
        if existing is None:
            self._artifacts[message_id] = pb.Artifact(
                artifact_id=message_id, parts=[pb.Part(text=delta)]
            )
        elif len(existing.parts) == 1 and existing.parts[0].WhichOneof("content") == "text":
            existing.parts[0].text += delta
        else:
            existing.parts.append(pb.Part(text=delta))
        chunk = pb.Artifact(artifact_id=message_id, parts=[pb.Part(text=delta)])
        update = pb.TaskArtifactUpdateEvent(
            task_id=self.task_id,
            context_id=self.context_id,
            artifact=chunk,
            append=existing is not None,
            last_chunk=False,
        )
        return pb.StreamResponse(artifact_update=update)

    # -- views

    def task_status(self) -> pb.TaskStatus:
        status = pb.TaskStatus(state=task_state(self.status))
        ts = _timestamp(self.status_time)
        if ts is not None:
            status.timestamp.CopyFrom(ts)
        message = self._status_message()
        if message is not None:
            status.message.CopyFrom(message)
        return status

    def _status_message(self) -> pb.Message | None:
        if self.status == statuses.FAILED:
            text = self._run_error or self.record_metadata.get("failureReason") or "failed"
            return _text_message(
                str(text),
                task_id=self.task_id,
                context_id=self.context_id,
                message_id=f"{self.task_id}-error",
            )
        if self.status == statuses.INPUT_REQUIRED:
            interrupts = self.record_metadata.get("interrupts") or []
            lines = [
                str(i.get("message") or i.get("reason") or "input required")
                for i in interrupts
                if isinstance(i, Mapping)
            ]
            message = _text_message(
                "\n".join(lines) or "input required",
                task_id=self.task_id,
                context_id=self.context_id,
                message_id=f"{self.task_id}-input-required-{self.last_seq}",
            )
            data = pb.Part()
            _set_struct(data.data.struct_value, {"interrupts": interrupts})
            message.parts.append(data)
            return message
        return None

    def metadata(self) -> dict[str, Any]:
        """The Task's metadata: funduq's observations a caller can act on."""
        metadata: dict[str, Any] = {}
        if self.cancel_requested and self.status in statuses.ACTIVE:
            metadata[CANCEL_REQUESTED_KEY] = True
        if self.status == statuses.INPUT_REQUIRED and "interrupts" in self.record_metadata:
            metadata["interrupts"] = self.record_metadata["interrupts"]
        if "failureReason" in self.record_metadata:
            metadata["failureReason"] = self.record_metadata["failureReason"]
        return metadata

    def task(self, *, include_artifacts: bool = True) -> pb.Task:
        task = pb.Task(id=self.task_id, context_id=self.context_id, status=self.task_status())
        if include_artifacts:
            task.artifacts.extend(self._artifacts.values())
        metadata = self.metadata()
        if metadata:
            _set_struct(task.metadata, metadata)
        return task

    def settle(self, record: Mapping[str, Any]) -> pb.StreamResponse:
        """The closing status update once the run settled or paused."""
        self.observe(record)
        update = pb.TaskStatusUpdateEvent(
            task_id=self.task_id, context_id=self.context_id, status=self.task_status()
        )
        metadata = self.metadata()
        if self._terminal_event is not None:
            metadata[AGUI_EVENT_KEY] = self._terminal_event
        if metadata:
            _set_struct(update.metadata, metadata)
        return pb.StreamResponse(status_update=update)

    def status_update(self) -> pb.StreamResponse:
        """The current status as an update (no event behind it)."""
        update = pb.TaskStatusUpdateEvent(
            task_id=self.task_id, context_id=self.context_id, status=self.task_status()
        )
        metadata = self.metadata()
        if metadata:
            _set_struct(update.metadata, metadata)
        return pb.StreamResponse(status_update=update)


def task_from_record(
    record: Mapping[str, Any],
    *,
    cancel_requested: bool = False,
    include_artifacts: bool = True,
) -> pb.Task:
    """The A2A Task a run record (the `GET /runs/{id}` shape) reads as.

    `cancel_requested` marks the answer to an accepted cancel: the run's own
    task writes `cancelling` a moment after the door asked, so the marker rides
    the answer whatever active status the record still shows.
    """
    projection = TaskProjection.from_record(record)
    if cancel_requested and projection.status in statuses.ACTIVE:
        projection.cancel_requested = projection.status != statuses.INPUT_REQUIRED
    return projection.task(include_artifacts=include_artifacts)


# ---------------------------------------------------------------- Message -> RunAgentInput

_MEDIA_KINDS = (("image/", "image"), ("audio/", "audio"), ("video/", "video"))


def _media_part(part: pb.Part) -> dict[str, Any]:
    """An AG-UI multimodal input part for an A2A file part (raw bytes or url)."""
    media_type = part.media_type or "application/octet-stream"
    kind = next((k for prefix, k in _MEDIA_KINDS if media_type.startswith(prefix)), "document")
    if part.WhichOneof("content") == "raw":
        source: dict[str, Any] = {
            "type": "data",
            "value": base64.b64encode(part.raw).decode("ascii"),
            "mimeType": media_type,
        }
    else:
        source = {"type": "url", "value": part.url}
        if part.media_type:
            source["mimeType"] = part.media_type
    content: dict[str, Any] = {"type": kind, "source": source}
    metadata: dict[str, Any] = {}
    if part.filename:
        metadata["filename"] = part.filename
    if part.HasField("metadata"):
        metadata.update(plain(part.metadata))
    if metadata:
        content["metadata"] = metadata
    return content


def message_text(message: pb.Message) -> str:
    """The message's text parts, joined by newlines."""
    return "\n".join(p.text for p in message.parts if p.WhichOneof("content") == "text")


def message_data(message: pb.Message) -> list[Any]:
    """The values of the message's data parts."""
    return [plain(p.data) for p in message.parts if p.WhichOneof("content") == "data"]


def run_input_from_message(
    message: pb.Message,
    *,
    interrupts: Iterable[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The AG-UI `RunAgentInput` (camelCase dict) an A2A message asks for.

    One user message: its id is the A2A `messageId`; its content is the text
    parts joined (a plain string) or, when the message carries files, AG-UI
    content parts (text, then image/audio/video/document for each file). Data
    parts ride `forwardedProps.a2a.dataParts` (JSON values, in order). The
    message's own metadata stays the message's (`metadata`): it binds nothing.
    funduq replaces `threadId` and `runId`.

    `interrupts` (a paused run's) turn the message into the answer: one
    `resume` entry per interrupt, resolved, its payload the message's single
    data value when it has exactly one, else its text.
    """
    text_parts: list[dict[str, Any]] = []
    files: list[dict[str, Any]] = []
    for part in message.parts:
        which = part.WhichOneof("content")
        if which == "text":
            text_parts.append({"type": "text", "text": part.text})
        elif which in ("raw", "url"):
            files.append(_media_part(part))
    text = message_text(message)
    content: Any = text if not files else [*text_parts, *files]
    user: dict[str, Any] = {"id": message.message_id, "role": "user", "content": content}
    own_metadata = _struct(message, "metadata")
    if own_metadata:
        user["metadata"] = own_metadata
    run_input: dict[str, Any] = {
        "threadId": message.context_id or "",
        "runId": "",
        "state": {},
        "messages": [user],
        "tools": [],
        "context": [],
    }
    data = message_data(message)
    a2a_props: dict[str, Any] = {"messageId": message.message_id}
    if data:
        a2a_props["dataParts"] = data
    if message.reference_task_ids:
        a2a_props["referenceTaskIds"] = list(message.reference_task_ids)
    run_input["forwardedProps"] = {"a2a": a2a_props}
    interrupts = [i for i in interrupts if isinstance(i, Mapping) and i.get("id")]
    if interrupts:
        payload: Any = data[0] if len(data) == 1 and not text else text
        run_input["resume"] = [
            {"interruptId": str(i["id"]), "status": "resolved", "payload": payload}
            for i in interrupts
        ]
    return run_input


# ---------------------------------------------------------------- agent card


def agent_card(
    *,
    name: str,
    description: str,
    rpc_url: str,
    published: Mapping[str, Any] | None = None,
    rest_url: str | None = None,
    identity: Identity | None = None,
) -> dict[str, Any]:
    """The agent's A2A card as served at `.well-known/agent-card.json`.

    Built as the SDK's `AgentCard` and rendered by the SDK's own
    `agent_card_to_dict` (the 1.0 card plus the 0.3 fields older clients read).
    It offers one JSON-RPC URL under both protocol versions (and, given
    `rest_url`, the HTTP+JSON binding under 1.0), streaming, push
    notifications, and the skills (and version, provider, modes, links) of the
    card the provider published for the agent. Given funduq's `identity`, the
    card is signed (`signatures`: see `sign_card`).
    """
    published = dict(published or {})
    card = pb.AgentCard(
        name=name,
        description=description or str(published.get("description") or "") or name,
        version=str(published.get("version") or "0.0.0"),
        capabilities=pb.AgentCapabilities(
            streaming=True, push_notifications=True, extended_agent_card=False
        ),
    )
    for version in (V1, V03):
        card.supported_interfaces.append(
            pb.AgentInterface(
                url=rpc_url,
                protocol_binding=constants.TransportProtocol.JSONRPC.value,
                protocol_version=version,
            )
        )
    if rest_url is not None:
        card.supported_interfaces.append(
            pb.AgentInterface(
                url=rest_url,
                protocol_binding=constants.TransportProtocol.HTTP_JSON.value,
                protocol_version=V1,
            )
        )
    for key, target in (
        ("defaultInputModes", card.default_input_modes),
        ("defaultOutputModes", card.default_output_modes),
    ):
        modes = published.get(key)
        if not (isinstance(modes, list) and all(isinstance(m, str) for m in modes) and modes):
            modes = ["text/plain", "application/json"]
        target.extend(modes)
    provider = published.get("provider")
    if isinstance(provider, Mapping):
        card.provider.CopyFrom(parse_lenient(dict(provider), pb.AgentProvider()))
    for key, attr in (("documentationUrl", "documentation_url"), ("iconUrl", "icon_url")):
        if isinstance(published.get(key), str) and published[key]:
            setattr(card, attr, published[key])
    for index, skill in enumerate(published.get("skills") or ()):
        parsed = _skill(skill, index)
        if parsed is not None:
            card.skills.append(parsed)
    if not card.skills:
        # A card needs at least one skill; an agent that published none is
        # offered as the one skill it is.
        card.skills.append(
            pb.AgentSkill(id=name, name=name, description=card.description, tags=[name])
        )
    if identity is not None:
        try:
            sign_card(card, identity)
        except ValueError:  # no canonical form (a published number JCS cannot spell)
            del card.signatures[:]
    return agent_card_to_dict(card)


def _without_empty(value: Any) -> Any:
    """The card's JSON with empty strings, lists and objects dropped, as A2A's
    canonical card form (and the SDK's verifier) has it; None when empty."""
    if isinstance(value, dict):
        kept = {k: c for k, v in value.items() if (c := _without_empty(v)) is not None}
        return kept or None
    if isinstance(value, list):
        items = [c for v in value if (c := _without_empty(v)) is not None]
        return items or None
    if isinstance(value, str) and not value:
        return None
    return value


def canonical_card(card: pb.AgentCard) -> bytes:
    """The bytes a card signature covers: the card's ProtoJSON without
    `signatures` and without empty values, in JCS (RFC 8785) form."""
    rendered = MessageToDict(card)
    rendered.pop("signatures", None)
    return jose.canonical_json(_without_empty(rendered) or {})


def sign_card(card: pb.AgentCard, identity: Identity) -> None:
    """Replace the card's `signatures` with one by funduq's identity: a JWS
    over `canonical_card` with the payload detached (protected header
    `{"alg": "EdDSA", "kid": <fingerprint>, "typ": "JOSE"}`; the key is at
    `/.well-known/jwks.json`)."""
    del card.signatures[:]
    protected, signature = jose.detached_jws(identity, canonical_card(card))
    card.signatures.append(pb.AgentCardSignature(protected=protected, signature=signature))


def _skill(raw: Any, index: int) -> pb.AgentSkill | None:
    if not isinstance(raw, Mapping):
        return None
    try:
        skill = parse_lenient(
            {k: v for k, v in raw.items() if k not in ("security", "securityRequirements")},
            pb.AgentSkill(),
        )
    except Exception:  # noqa: BLE001 - a skill that does not parse is left out
        return None
    # The fields a card's skill must have, filled from what it has.
    skill.id = skill.id or skill.name or f"skill-{index}"
    skill.name = skill.name or skill.id
    skill.description = skill.description or skill.name
    if not skill.tags:
        skill.tags.append(skill.id)
    return skill


# ---------------------------------------------------------------- JSON-RPC calls

#: Operations the door performs, and the 1.0 request type each one parses.
SEND, STREAM, GET, CANCEL, SUBSCRIBE, LIST = (
    "send",
    "stream",
    "get",
    "cancel",
    "subscribe",
    "list",
)
PUSH_CREATE, PUSH_GET, PUSH_LIST, PUSH_DELETE = (
    "push-create",
    "push-get",
    "push-list",
    "push-delete",
)
PUSH_OPS = frozenset({PUSH_CREATE, PUSH_GET, PUSH_LIST, PUSH_DELETE})
EXTENDED_CARD = "extended-card"
STREAMING_OPS = frozenset({STREAM, SUBSCRIBE})

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
METHODS_V03: dict[str, tuple[str, type, Any]] = {
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


@dataclass(frozen=True)
class Call:
    """One parsed JSON-RPC call: what to do, for whom, in which dialect."""

    request_id: str | int | None
    method: str
    op: str
    dialect: str  # V1 ("1.0") or V03 ("0.3"): which method-name set it used
    request: Any  # the 1.0 protobuf request
    params: Mapping[str, Any] = field(default_factory=dict)  # the raw params object

    @property
    def streaming(self) -> bool:
        return self.op in STREAMING_OPS

    def request_metadata(self) -> dict[str, Any] | None:
        """Request-level metadata (`params.metadata`): funduq's keys ride here.

        Read off the JSON as sent (so integers stay integers), falling back to
        the parsed Struct.
        """
        raw = self.params.get("metadata") if isinstance(self.params, Mapping) else None
        if isinstance(raw, Mapping):
            return plain(raw)
        if self.request is not None and "metadata" in self.request.DESCRIPTOR.fields_by_name:
            return _struct(self.request, "metadata")
        return None


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
    if method in METHODS_V03 or method in METHODS_V1:
        # Params the provider link could not carry (a lone surrogate, NaN, too
        # deep) are the params' fault, whichever field holds them: -32602
        # before anything reads them (request metadata is kept as sent).
        problem = carriable.problem(params)
        if problem is not None:
            error = InvalidParamsError(
                message=f"params cannot be carried to a provider: {problem}",
                data={"reason": "not_carriable"},
            )
            if method in METHODS_V03:
                raise CallRejected(_v03_error_envelope(request_id, error))
            raise CallRejected(build_error_response(request_id, error))

    if method in METHODS_V03:
        return _parse_v03(data, method, request_id, params, version_header)
    if method not in METHODS_V1:
        raise CallRejected(build_error_response(request_id, rpc.MethodNotFoundError()))
    op, model = METHODS_V1[method]
    try:
        request = ParseDict(params, model(), ignore_unknown_fields=True)
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
            _v03_error_envelope(request_id, rpc.InvalidRequestError(data=str(exc)))
        ) from None
    try:
        core = to_core(compat) if to_core is not None else None
    except Exception as exc:  # noqa: BLE001 - e.g. metadata nested past protobuf's limit
        raise CallRejected(
            _v03_error_envelope(request_id, InvalidParamsError(data={"parseError": str(exc)}))
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
    validate_proto_required_fields(request)
    if call.op in (SEND, STREAM):
        config = request.configuration
        if config.HasField("history_length") and config.history_length < 0:
            raise InvalidParamsError(message="history length must be non-negative")
    if (
        call.op in (GET, LIST)
        and request.HasField("history_length")
        and request.history_length < 0
    ):
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


# ---------------------------------------------------------------- rendering answers

# Error codes v0.3 defines, derived from its models as the SDK's adapter does;
# a 1.0-only code (e.g. -32009) reaches a 0.3 caller as -32603.
_V03_ERROR_CODES = frozenset(
    cls.model_fields["code"].default
    for cls in get_args(types_v03.A2AError.model_fields["root"].annotation)
)


def _v03_error_envelope(request_id: Any, error: A2AError | rpc.JSONRPCError) -> dict[str, Any]:
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
        return build_rest_error_payload(error)
    if call is not None and call.dialect == V03:
        return _v03_error_envelope(rid, error)
    return build_error_response(rid, error)


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

    `result` is a 1.0 `Task` (SendMessage, GetTask, CancelTask),
    `ListTasksResponse` (ListTasks), `TaskPushNotificationConfig` (create,
    get), `ListTaskPushNotificationConfigsResponse` (list) or None (delete);
    0.3 calls get the v0.3 shapes the SDK's converters make of it.
    """
    if call.dialect == REST:
        rendered = _v1_result(call, result)
        return {} if rendered is None else rendered
    if call.dialect == V1:
        return JSONRPC20Response(result=_v1_result(call, result), _id=call.request_id).data
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
    if call.dialect == REST:
        return MessageToDict(update, preserving_proto_field_name=False)
    if call.dialect == V1:
        result = MessageToDict(update, preserving_proto_field_name=False)
        return JSONRPC20Response(result=result, _id=call.request_id).data
    compat = v03.to_compat_stream_response(update, call.request_id)
    return compat.model_dump(mode="json", by_alias=True, exclude_none=True)


def stream_snapshot(task: pb.Task) -> pb.StreamResponse:
    return pb.StreamResponse(task=task)


# ---------------------------------------------------------------- ListTasks


@dataclass(frozen=True)
class TaskPage:
    """One ListTasks page chosen over run records (records in page order)."""

    records: list[Mapping[str, Any]]
    total_size: int
    page_size: int
    next_page_token: str


def select_page(request: pb.ListTasksRequest, records: Iterable[Mapping[str, Any]]) -> TaskPage:
    """Choose one ListTasks page as the SDK's task store does: filter by status
    and status time, order newest status first (ties by id, descending), and
    page by a token naming the last task of the previous page."""
    wanted = status_of_state(request.status) if request.status else None
    after_ns = (
        request.status_timestamp_after.ToNanoseconds()
        if request.HasField("status_timestamp_after")
        else None
    )
    chosen: list[tuple[tuple[bool, int, str], Mapping[str, Any]]] = []
    for record in records:
        if wanted is not None and record.get("status") not in wanted:
            continue
        status = task_from_record(record, include_artifacts=False).status
        has = status.HasField("timestamp")
        ns = status.timestamp.ToNanoseconds() if has else 0
        if after_ns is not None and not (has and ns >= after_ns):
            continue
        chosen.append(((has, ns, str(record.get("runId"))), record))
    chosen.sort(key=lambda item: item[0], reverse=True)
    start = 0
    if request.page_token:
        last_id = decode_page_token(request.page_token)
        ids = [key[2] for key, _ in chosen]
        if last_id not in ids:
            raise InvalidParamsError(message="page token names no task of this listing")
        start = ids.index(last_id) + 1
    page_size = request.page_size or constants.DEFAULT_LIST_TASKS_PAGE_SIZE
    page = [record for _, record in chosen[start : start + page_size]]
    token = ""
    if page and start + page_size < len(chosen):
        token = encode_page_token(str(page[-1].get("runId")))
    return TaskPage(page, len(chosen), page_size, token)


def _listed_task(record: Mapping[str, Any], *, include_artifacts: bool) -> pb.Task:
    """One task of a listing. A record no projection can show (a bug, or a
    stored event nothing foresaw) is listed with its status alone, marked
    DEGRADED_KEY: one run never fails the listing of a whole agent."""
    try:
        return task_from_record(record, include_artifacts=include_artifacts)
    except Exception:  # noqa: BLE001 - logged; the listing goes on
        log.exception("run %s: its task cannot be projected; listed by status", record.get("runId"))
        task = pb.Task(id=_utf8(str(record.get("runId"))),
                       context_id=_utf8(str(record.get("threadId"))),
                       status=pb.TaskStatus(state=task_state(str(record.get("status")))))
        _set_struct(task.metadata, {DEGRADED_KEY: True})
        return task


def list_tasks_response(
    request: pb.ListTasksRequest, page: TaskPage, full_records: Iterable[Mapping[str, Any]]
) -> pb.ListTasksResponse:
    """The ListTasksResponse for `page`, its tasks built from the full records
    (with events, so artifacts and failure messages are there)."""
    return pb.ListTasksResponse(
        tasks=[_listed_task(r, include_artifacts=request.include_artifacts) for r in full_records],
        next_page_token=page.next_page_token,
        page_size=page.page_size,
        total_size=page.total_size,
    )


# ---------------------------------------------------------------- broker errors


