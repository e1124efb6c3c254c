"""An A2A Message as the AG-UI `RunAgentInput` it asks for, I/O-free."""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from typing import Any

from a2a.types import a2a_pb2 as pb

from .structs import plain, struct_dict

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
    texts: list[str] = []
    files: list[dict[str, Any]] = []
    data_parts: list[pb.Part] = []
    # One pass over the parts (`message_text` and `message_data` each make one).
    for part in message.parts:
        which = part.WhichOneof("content")
        if which == "text":
            texts.append(part.text)
        elif which in ("raw", "url"):
            files.append(_media_part(part))
        elif which == "data":
            data_parts.append(part)
    text = "\n".join(texts)
    content: Any = text
    if files:
        content = [*({"type": "text", "text": t} for t in texts), *files]
    user: dict[str, Any] = {"id": message.message_id, "role": "user", "content": content}
    own_metadata = struct_dict(message, "metadata")
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
    data = [plain(p.data) for p in data_parts]
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
