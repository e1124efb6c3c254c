"""Run records and AG-UI events as A2A Tasks and stream updates, I/O-free.

`task_from_record(record)` is the Task a run record (the `GET /runs/{id}`
shape) reads as; `TaskProjection` is the same projection fed one event at a
time, answering each with the stream updates the event becomes.

Status mapping (exactly DESIGN's table): queued/offering -> SUBMITTED, running
-> WORKING, cancelling -> WORKING with ``funduq/cancelRequested: true`` in the
Task's metadata, input-required -> INPUT_REQUIRED with ``interrupts``,
completed -> COMPLETED, failed -> FAILED with the RUN_ERROR's message as the
status message, cancelled -> CANCELED.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from a2a.compat.v0_3 import conversions as v03
from a2a.compat.v0_3 import types as types_v03
from a2a.types import a2a_pb2 as pb
from a2a.utils.proto_utils import parse_lenient
from ag_ui.core import EventType

from .. import statuses
from .structs import json_timestamp, proto_timestamp, set_struct, utf8

#: Task metadata key: a cancel was asked for and the run has not settled yet.
CANCEL_REQUESTED_KEY = "funduq/cancelRequested"
#: Status-update metadata key carrying an AG-UI event that is not an artifact.
AGUI_EVENT_KEY = "funduq/aguiEvent"
#: The AG-UI CUSTOM event whose value is an A2A Artifact (DESIGN §5).
ARTIFACT_EVENT_NAME = "a2a.artifact"

# AG-UI event type names, read off the package (never transcribed).
_TEXT_DELTA_TYPES = frozenset(
    {EventType.TEXT_MESSAGE_CONTENT.value, EventType.TEXT_MESSAGE_CHUNK.value}
)
_CONTENT = EventType.TEXT_MESSAGE_CONTENT.value
_RUN_STARTED = EventType.RUN_STARTED.value
_RUN_FINISHED = EventType.RUN_FINISHED.value
_RUN_ERROR = EventType.RUN_ERROR.value
_CUSTOM = EventType.CUSTOM.value

#: The event types `apply(..., updates=False)` keeps something of besides
#: their seq (text deltas, artifacts, a turn's start and end): any other
#: is only its seq to a snapshot (`from_record`).
_SNAPSHOT_FOLDS = frozenset({*_TEXT_DELTA_TYPES, _CUSTOM, _RUN_STARTED, _RUN_FINISHED, _RUN_ERROR})

#: What `_text_delta` answers for a delta folded in without an update.
_FOLDED = pb.StreamResponse()


# ---------------------------------------------------------------- statuses

_STATE_OF_STATUS: dict[str, pb.TaskState] = {
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


#: The TaskState's JSON name per run status (UNSPECIFIED left out: ProtoJSON omits it).
_STATE_NAME = {status: pb.TaskState.Name(state) for status, state in _STATE_OF_STATUS.items()}
#: Statuses whose Task status carries a message (see `_status_message`).
_STATUS_WITH_MESSAGE = frozenset({statuses.FAILED, statuses.INPUT_REQUIRED})


def task_state(status: str) -> pb.TaskState:
    """The A2A TaskState a run status reads as."""
    return _STATE_OF_STATUS.get(status, pb.TaskState.TASK_STATE_UNSPECIFIED)


def status_of_state(state: int) -> frozenset[str]:
    """The run statuses that read as `state` (ListTasks' status filter)."""
    return frozenset(s for s, st in _STATE_OF_STATUS.items() if st == state)


# ---------------------------------------------------------------- record -> Task


def _text_message(text: str, *, task_id: str, context_id: str, message_id: str) -> pb.Message:
    return pb.Message(
        message_id=utf8(message_id),
        task_id=task_id,
        context_id=context_id,
        role=pb.Role.ROLE_AGENT,
        parts=[pb.Part(text=utf8(text))],
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
        if isinstance(parts, list) and any(isinstance(p, Mapping) and "kind" in p for p in parts):
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
    # Text deltas per artifact id, joined only when a Task is asked for:
    # growing a protobuf string by `+=` copies it on every delta (quadratic in
    # the message's length, and it runs on the event loop).
    _texts: dict[str, list[str]] = field(default_factory=dict)
    _last_text_id: str | None = None
    _run_error: str | None = None
    _terminal_event: dict[str, Any] | None = None

    # -- construction

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> TaskProjection:
        projection = cls(task_id=str(record["runId"]), context_id=str(record["threadId"]))
        texts = projection._texts
        # `last_seq` and `_last_text_id` as locals, handed to `apply` and
        # taken back around each event it folds.
        last = 0
        text_id: str | None = None
        for entry in record.get("events") or ():
            seq = entry.get("seq", 0)
            if type(seq) is not int:
                seq = int(seq)
            event = entry.get("event")
            if type(event) is dict and seq > last:
                kind = event.get("type")
                # Most of a record is text deltas continuing the text just
                # before them: folded here as `apply` folds them (same
                # checks, ASCII needs no `utf8`), without its dispatch.
                if kind == _CONTENT:
                    delta = event.get("delta")
                    message_id = event.get("messageId")
                    if (
                        type(delta) is str
                        and delta
                        and delta.isascii()
                        and type(message_id) is str
                        and message_id == text_id
                        and message_id in texts
                    ):
                        texts[message_id].append(delta)
                        last = seq
                        continue
                elif type(kind) is str and kind not in _SNAPSHOT_FOLDS:
                    # An event a snapshot keeps nothing of but its seq (a
                    # message's start and end, steps, state, tool calls...).
                    last = seq
                    continue
            projection.last_seq = last
            projection.apply(seq, event, updates=False)
            last = projection.last_seq
            text_id = projection._last_text_id
        projection.last_seq = last
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

    def apply(self, seq: int, event: Any, *, updates: bool = True) -> list[pb.StreamResponse]:
        """Fold one recorded AG-UI event in; answer the stream updates it
        becomes (none built without `updates`: a snapshot folds a whole record
        and keeps only the Task, and building an update with its event as a
        protobuf Struct cost more than the fold itself)."""
        if seq and seq <= self.last_seq:
            return []  # already folded in (a snapshot and a follow overlap)
        self.last_seq = max(self.last_seq, seq)
        if not isinstance(event, Mapping):
            return []
        kind = event.get("type")
        if kind in _TEXT_DELTA_TYPES:
            update = self._text_delta(event, updates)
            if update is not None:
                return [update] if updates else []
            if kind == EventType.TEXT_MESSAGE_CHUNK.value:
                return []  # a chunk with nothing to say
        elif kind == _CUSTOM and event.get("name") == ARTIFACT_EVENT_NAME:
            artifact = _artifact_from_value(event.get("value"), f"artifact-{seq}")
            if artifact is not None:
                self._artifacts[artifact.artifact_id] = artifact
                self._texts.pop(artifact.artifact_id, None)  # replaced whole
                if not updates:
                    return []
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
        if not updates:
            return []
        status = pb.TaskStatus(state=pb.TaskState.TASK_STATE_WORKING)
        update = pb.TaskStatusUpdateEvent(
            task_id=self.task_id, context_id=self.context_id, status=status
        )
        metadata: dict[str, Any] = {AGUI_EVENT_KEY: dict(event)}
        if self.cancel_requested:
            metadata[CANCEL_REQUESTED_KEY] = True
        set_struct(update.metadata, metadata)
        return [pb.StreamResponse(status_update=update)]

    def plain_updates(self, seq: int, event: Any) -> list[dict[str, Any]] | None:
        """`[MessageToDict(u) for u in self.apply(seq, event)]` for the common
        event of a stream, a text delta, written directly: its artifact
        update built as protobuf and walked back out was most of a streamed
        event's cost (bench/README.md, "The doors' own work per run"). The
        projection is left as `apply` leaves it. None for any other event
        (nothing folded in: `apply` takes it), or one with a text, id or
        message id that is not ASCII. `tests/test_door_fast_paths.py` holds
        the two equal."""
        if type(event) is not dict:
            return None
        if seq and seq <= self.last_seq:
            return []  # already folded in (a snapshot and a follow overlap)
        if event.get("type") not in _TEXT_DELTA_TYPES:
            return None
        delta = event.get("delta")
        if type(delta) is not str or not delta or not delta.isascii():
            return None
        message_id = event.get("messageId") or self._last_text_id or "text"
        if type(message_id) is not str or not message_id.isascii():
            return None
        if not (self.task_id.isascii() and self.context_id.isascii()):
            return None
        self.last_seq = max(self.last_seq, seq)
        self._last_text_id = message_id
        existing = self._artifacts.get(message_id)
        if existing is None:
            self._artifacts[message_id] = pb.Artifact(artifact_id=message_id)
        self._texts.setdefault(message_id, []).append(delta)
        update: dict[str, Any] = {}
        if self.task_id:
            update["taskId"] = self.task_id
        if self.context_id:
            update["contextId"] = self.context_id
        update["artifact"] = {"artifactId": message_id, "parts": [{"text": delta}]}
        if existing is not None:
            update["append"] = True
        return [{"artifactUpdate": update}]

    def _text_delta(
        self, event: Mapping[str, Any], updates: bool = True
    ) -> pb.StreamResponse | None:
        delta = event.get("delta")
        if not isinstance(delta, str) or delta == "":
            return None
        message_id = event.get("messageId") or self._last_text_id or "text"
        message_id = utf8(str(message_id))
        delta = utf8(delta)
        self._last_text_id = message_id
        existing = self._artifacts.get(message_id)
        if existing is None:
            self._artifacts[message_id] = pb.Artifact(artifact_id=message_id)
        self._texts.setdefault(message_id, []).append(delta)
        if not updates:
            return _FOLDED
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

    def _artifact(self, artifact_id: str) -> pb.Artifact:
        """The artifact with its text deltas folded in: one text part grows by
        them (a text message), any other artifact gains a part per delta."""
        artifact = self._artifacts[artifact_id]
        deltas = self._texts.get(artifact_id)
        if not deltas:
            return artifact
        whole = pb.Artifact()
        whole.CopyFrom(artifact)
        if not whole.parts:
            whole.parts.append(pb.Part(text="".join(deltas)))
        elif len(whole.parts) == 1 and whole.parts[0].WhichOneof("content") == "text":
            whole.parts[0].text = whole.parts[0].text + "".join(deltas)
        else:
            whole.parts.extend(pb.Part(text=delta) for delta in deltas)
        return whole

    def task_status(self) -> pb.TaskStatus:
        status = pb.TaskStatus(state=task_state(self.status))
        ts = proto_timestamp(self.status_time)
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
            set_struct(data.data.struct_value, {"interrupts": interrupts})
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
            task.artifacts.extend(self._artifact(key) for key in self._artifacts)
        metadata = self.metadata()
        if metadata:
            set_struct(task.metadata, metadata)
        return task

    def plain_task_json(self) -> dict[str, Any] | None:
        """`MessageToDict(self.task())` for the common Task, written directly
        (building the protobuf Task and walking it back out was 45 of the
        blocking SendMessage's 80 µs, bench/README.md): a status without a
        message (not failed, not input-required), no metadata, and only
        artifacts made of text deltas. None for any other Task, which then
        goes through protobuf; `tests/test_a2a_fast_paths.py` holds the two
        equal, key order included."""
        state = _STATE_NAME.get(self.status)
        if (
            state is None
            or self.status in _STATUS_WITH_MESSAGE
            or not self.task_id.isascii()
            or not self.context_id.isascii()
            or self.metadata()
        ):
            return None
        artifacts = []
        for artifact_id, artifact in self._artifacts.items():
            deltas = self._texts.get(artifact_id)
            if not deltas or artifact.parts or len(artifact.ListFields()) > 1:
                return None  # not one made of text deltas alone
            rendered: dict[str, Any] = {"artifactId": artifact_id} if artifact_id else {}
            rendered["parts"] = [{"text": "".join(deltas)}]
            artifacts.append(rendered)
        status: dict[str, Any] = {"state": state}
        stamp = json_timestamp(self.status_time)
        if stamp is not None:
            status["timestamp"] = stamp
        task: dict[str, Any] = {}
        if self.task_id:
            task["id"] = self.task_id
        if self.context_id:
            task["contextId"] = self.context_id
        task["status"] = status
        if artifacts:
            task["artifacts"] = artifacts
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
            set_struct(update.metadata, metadata)
        return pb.StreamResponse(status_update=update)

    def status_update(self) -> pb.StreamResponse:
        """The current status as an update (no event behind it)."""
        update = pb.TaskStatusUpdateEvent(
            task_id=self.task_id, context_id=self.context_id, status=self.task_status()
        )
        metadata = self.metadata()
        if metadata:
            set_struct(update.metadata, metadata)
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
    return snapshot_of_record(record, cancel_requested=cancel_requested).task(
        include_artifacts=include_artifacts
    )


def snapshot_of_record(
    record: Mapping[str, Any], *, cancel_requested: bool = False
) -> TaskProjection:
    """The projection `task_from_record` builds its Task from (the door's
    renderer writes a common Task straight from it, `plain_task_json`)."""
    projection = TaskProjection.from_record(record)
    if cancel_requested and projection.status in statuses.ACTIVE:
        projection.cancel_requested = projection.status != statuses.INPUT_REQUIRED
    return projection
