"""The provider link's frames: one pydantic model per frame of DESIGN §5.

A frame is one JSON text message on `WS /ws/provider`: an object with
camelCase keys, discriminated by `kind`. Optional fields travel as `null`
rather than being dropped, so every frame a peer receives has every key its
kind defines. AG-UI events (`report.event`) and run inputs (`offer.run.runInput`)
are plain JSON objects here: the link carries them, the broker and the SDK
interpret them. An event handed in as an ag-ui-protocol model is turned into
its JSON form by ag-ui-protocol's own serializer, which leaves unset optional
fields out (and keeps meaningful nulls, such as a CUSTOM event's `value`).

Decoding is strict about types (a number where a string belongs is an error,
not a coercion) and lenient about keys it does not know (ignored, so a peer
speaking a later revision that adds a field is still understood).

The KYOK frames of DESIGN §9 ride the same link: an LLM provider publishes
offerings with `register.llm`, funduq asks for a completion with `complete`,
the provider streams `chunk`s and ends with `completion.end` or
`completion.failed`, and funduq sends `abandon` when nobody reads any more
(docs/kyok.md). A link may serve agents and offerings both.

One frame is not in DESIGN §5's table: `batch {frames: [...]}`, several
frames in one message, meaning exactly those frames sent one after another.
It exists because the server's websocket stack moves one message per
scheduler round each way, so a run's dozen reports took a dozen rounds on a
busy link and offers queued behind each other (docs/provider-link.md,
"Batches"). Each side lists it in `extensions` (funduq's `hello`, the
provider's `connect`) and sends batches only to a peer that listed it.

`decode_frame(text)` returns a frame or raises `FrameError(reason, id)`,
where `id` is the frame's `id` when it carried a usable one, so the receiver
can answer `err {id, reason}`; a frame without one closes the link.
`encode_frame(frame)` returns the JSON text to send.

This module is I/O-free and imports only pydantic: the provider SDK and the
server both use it.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Literal, TypeGuard, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel

__all__ = [
    "FROM_FUNDUQ",
    "FROM_PROVIDER",
    "EXTENSIONS",
    "IN_BATCH",
    "IN_FUNDUQ_BATCH",
    "KINDS",
    "KYOK_FROM_FUNDUQ",
    "KYOK_FROM_PROVIDER",
    "MAX_OFFERINGS",
    "MAX_BATCH_FRAMES",
    "MAX_ID_CHARS",
    "VERDICTS",
    "AgentSpec",
    "Abandon",
    "Batch",
    "Cancel",
    "Chunk",
    "CompleteAgent",
    "Complete",
    "CompletionEnd",
    "CompletionFailed",
    "LlmOffering",
    "RegisterLlm",
    "Connect",
    "ConnectErr",
    "ConnectOk",
    "Err",
    "Finish",
    "Frame",
    "FrameError",
    "Hello",
    "Offer",
    "OfferRun",
    "Ok",
    "QueryThreadMessages",
    "Register",
    "Report",
    "BATCH_BYTES",
    "Outgoing",
    "batch_item",
    "batch_items",
    "message_frames",
    "read_message",
    "batch_text",
    "parse_json",
    "plain_batch",
    "plain_finish",
    "plain_ok",
    "plain_report",
    "wire_bytes",
    "decode_frame",
    "decode_object",
    "encode_frame",
]

#: Longest request id either side accepts (and echoes back in an `err`).
MAX_ID_CHARS = 256
#: Frames one `batch` may carry.
MAX_BATCH_FRAMES = 1024
#: Largest batch a writer builds: well under any sane frame limit (the
#: default is 1 MiB), big enough that batching costs nothing.
BATCH_BYTES = 64 * 1024
#: What `hello.extensions` / `connect.extensions` list: the frames beyond
#: DESIGN §5 this side accepts.
EXTENSIONS = ("batch",)
#: Offerings one `register.llm` may publish.
MAX_OFFERINGS = 256
#: The three answers to an offer. `declined` = full right now; `refused` = never.
VERDICTS = ("accepted", "declined", "refused")

_HEX64 = r"^[0-9a-f]{64}$"
_HEX128 = r"^[0-9a-f]{128}$"
# Agent names appear in URLs (/a2a/{provider}/{agent}): keep them path-safe.
_AGENT_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"

Id = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
Nonce = Annotated[str, Field(min_length=1, max_length=256)]
PublicKeyHex = Annotated[str, Field(pattern=_HEX64)]
SignatureHex = Annotated[str, Field(pattern=_HEX128)]
RunId = Annotated[str, Field(min_length=1, max_length=MAX_ID_CHARS)]
JsonObject = dict[str, Any]


class FrameError(ValueError):
    """A text that is not a frame this side accepts.

    `reason` says what is wrong in words a provider's author can act on;
    `id` is the frame's `id` when it carried a usable one (answer
    `err {id, reason}`), else None (close the link).
    """

    def __init__(self, reason: str, id: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.id = id


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="ignore",
        strict=True,
        frozen=True,
    )


# --- funduq -> provider -----------------------------------------------------


class Hello(_Model):
    """First frame on every link: funduq's key and this connection's nonce."""

    kind: Literal["hello"] = "hello"
    funduq_key: PublicKeyHex
    nonce: Nonce
    #: Frames beyond DESIGN §5 this funduq accepts (`["batch"]`); null = none.
    extensions: list[str] | None = None


class ConnectOk(_Model):
    """The provider is attached. `answer` is funduq's signature over
    `funduq-connect-funduq:{funduqNonce}:{providerNonce}`."""

    kind: Literal["connect.ok"] = "connect.ok"
    answer: SignatureHex | None = None


class ConnectErr(_Model):
    """The handshake failed; the socket closes after this frame."""

    kind: Literal["connect.err"] = "connect.err"
    reason: str


class OfferRun(_Model):
    run_id: RunId
    thread_id: Id
    agent_name: Annotated[str, Field(min_length=1)]
    run_input: JsonObject
    metadata: JsonObject | None = None


class Offer(_Model):
    """A request to take a run. `id` is fresh per offer and never the run id."""

    kind: Literal["offer"] = "offer"
    id: Id
    run: OfferRun


class Cancel(_Model):
    """A request to stop a run the provider holds."""

    kind: Literal["cancel"] = "cancel"
    run_id: RunId


class CompleteAgent(_Model):
    provider_key: PublicKeyHex
    name: Annotated[str, Field(min_length=1)]


class Complete(_Model):
    """KYOK: a request for one completion against the offering `llm`. `body` is
    the OpenAI chat-completions request as the agent sent it; `context` is the
    caller's (never shown to the agent); `id` is fresh per completion."""

    kind: Literal["complete"] = "complete"
    id: Id
    run_id: RunId
    agent: CompleteAgent
    llm: Annotated[str, Field(min_length=1)]
    body: JsonObject
    context: JsonObject | None = None
    actor_chain: list[str] | None = None


class Abandon(_Model):
    """KYOK: nobody reads this completion any more (the agent went, the run
    was cancel-requested or ended); stop spending on it."""

    kind: Literal["abandon"] = "abandon"
    id: Id


# --- provider -> funduq -----------------------------------------------------


class Connect(_Model):
    """The provider's proof of its key: an Ed25519 signature over
    `funduq-connect-provider:{funduqKey}:{funduqNonce}:{providerNonce}`."""

    kind: Literal["connect"] = "connect"
    public_key: PublicKeyHex
    nonce: Nonce
    proof: SignatureHex
    max_concurrent_runs: Annotated[int, Field(ge=0)] | None = None
    #: Frames beyond DESIGN §5 this provider accepts (`["batch"]`); null = none.
    extensions: list[str] | None = None


class AgentSpec(_Model):
    name: Annotated[str, Field(pattern=_AGENT_NAME)]
    description: str | None = None
    card: JsonObject | None = None
    metadata: JsonObject | None = None


class Register(_Model):
    """Publish the agents this link serves; replaces what it served before."""

    kind: Literal["register"] = "register"
    id: Id
    agents: list[AgentSpec]

    @model_validator(mode="after")
    def _names_unique(self) -> Register:
        seen: set[str] = set()
        for agent in self.agents:
            if agent.name in seen:
                raise ValueError(f"agent {agent.name!r} is listed twice")
            seen.add(agent.name)
        return self


class Report(_Model):
    """One AG-UI event of a run the provider holds. `seq` is the provider's own
    1-based count of events for that run (optional, informational)."""

    kind: Literal["report"] = "report"
    run_id: RunId
    event: JsonObject
    seq: Annotated[int, Field(ge=1)] | None = None

    @field_validator("event", mode="before")
    @classmethod
    def _event_as_json(cls, value: Any) -> Any:
        if isinstance(value, BaseModel):
            # ag-ui-protocol's serializer omits optional fields that have no value.
            return value.model_dump(mode="json", by_alias=True)
        return value


class Finish(_Model):
    """The stream of this run ended (whatever its last event was)."""

    kind: Literal["finish"] = "finish"
    run_id: RunId


class LlmOffering(_Model):
    name: Annotated[str, Field(pattern=_AGENT_NAME)]
    description: str | None = None
    metadata: JsonObject | None = None


class RegisterLlm(_Model):
    """KYOK: publish the LLM offerings this link serves; replaces what it
    offered before (agents published with `register` are untouched)."""

    kind: Literal["register.llm"] = "register.llm"
    id: Id
    offerings: Annotated[list[LlmOffering], Field(max_length=MAX_OFFERINGS)]

    @model_validator(mode="after")
    def _names_unique(self) -> RegisterLlm:
        names = [o.name for o in self.offerings]
        if len(set(names)) != len(names):
            raise ValueError("an offering is listed twice")
        return self


class Chunk(_Model):
    """KYOK: one piece of a completion's answer, relayed verbatim (as an SSE
    `data:` line when the agent streams)."""

    kind: Literal["chunk"] = "chunk"
    id: Id
    data: str


class CompletionEnd(_Model):
    kind: Literal["completion.end"] = "completion.end"
    id: Id


class CompletionFailed(_Model):
    """KYOK: the completion failed; `refusal` (an object) when the LLM
    provider refused it rather than broke."""

    kind: Literal["completion.failed"] = "completion.failed"
    id: Id
    message: str
    refusal: JsonObject | None = None


class Batch(_Model):
    """Several frames in one message, meaning exactly those frames sent one
    after another. Each item is decoded on its own (`decode_object`), so one
    bad item is answered like the same frame sent alone; a batch never nests
    and never carries a handshake frame."""

    kind: Literal["batch"] = "batch"
    frames: Annotated[list[Any], Field(min_length=1, max_length=MAX_BATCH_FRAMES)]


class QueryThreadMessages(_Model):
    """Ask for a thread's messages; answered `ok` with `payload.messages`."""

    kind: Literal["query.threadMessages"] = "query.threadMessages"
    id: Id
    thread_id: Id
    limit: Annotated[int, Field(ge=0)] | None = None


# --- either way -------------------------------------------------------------


class Ok(_Model):
    """An answer. To an offer: `verdict` (and `reason`, a refusal's). To a
    request: `payload`, the reply's body."""

    kind: Literal["ok"] = "ok"
    id: Id
    verdict: Literal["accepted", "declined", "refused"] | None = None
    reason: str | None = None
    payload: Any = None


class Err(_Model):
    """A rejected request (never a refusal of a run)."""

    kind: Literal["err"] = "err"
    id: Id | None = None
    reason: str


Frame = Annotated[
    Hello
    | Connect
    | ConnectOk
    | ConnectErr
    | Register
    | Offer
    | Ok
    | Err
    | Report
    | Finish
    | Cancel
    | QueryThreadMessages
    | Batch
    | RegisterLlm
    | Complete
    | Chunk
    | CompletionEnd
    | CompletionFailed
    | Abandon,
    Field(discriminator="kind"),
]

_FRAME = TypeAdapter(Frame)

KINDS: frozenset[str] = frozenset(
    m.model_fields["kind"].default
    for m in (
        Hello,
        Connect,
        ConnectOk,
        ConnectErr,
        Register,
        Offer,
        Ok,
        Err,
        Report,
        Finish,
        Cancel,
        QueryThreadMessages,
        Batch,
        RegisterLlm,
        Complete,
        Chunk,
        CompletionEnd,
        CompletionFailed,
        Abandon,
    )
)
#: KYOK's kinds (DESIGN §9), each way.
KYOK_FROM_PROVIDER: frozenset[str] = frozenset(
    {"register.llm", "chunk", "completion.end", "completion.failed"}
)
KYOK_FROM_FUNDUQ: frozenset[str] = frozenset({"complete", "abandon"})
#: The kinds a provider may send.
FROM_PROVIDER: frozenset[str] = frozenset(
    {
        "connect",
        "register",
        "ok",
        "err",
        "report",
        "finish",
        "query.threadMessages",
        "batch",
        *KYOK_FROM_PROVIDER,
    }
)
#: The kinds a provider's `batch` may carry.
IN_BATCH: frozenset[str] = FROM_PROVIDER - {"connect", "batch"}
#: The kinds funduq may send.
FROM_FUNDUQ: frozenset[str] = frozenset(
    {
        "hello",
        "connect.ok",
        "connect.err",
        "offer",
        "ok",
        "err",
        "cancel",
        "batch",
        *KYOK_FROM_FUNDUQ,
    }
)
#: The kinds funduq's `batch` may carry.
IN_FUNDUQ_BATCH: frozenset[str] = frozenset({"offer", "ok", "err", "cancel", *KYOK_FROM_FUNDUQ})


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


#: `message_frames`' default: the text is still to be parsed.
_UNPARSED: Any = object()

# One decoder for every message: `json.loads` with a keyword builds a new
# JSONDecoder per call, a tenth of a lone report's decode (bench/README.md,
# "The per-message path of a provider without batches").
_JSON = json.JSONDecoder(parse_constant=_no_constants)


#: The decoder's C scanner: `decode` is it plus two whitespace regexes and a
#: Python frame, a third of a report's parse.
_SCAN: Callable[[str, int], tuple[Any, int]] = _JSON.scan_once  # type: ignore[attr-defined]


def parse_json(text: str | bytes) -> Any:
    """`json.loads(text, parse_constant=...)` (NaN and Infinity are not JSON),
    raising what it raises, on one shared decoder."""
    if type(text) is str:
        # A value from the first character to the last (what a frame is) is
        # what `decode` gives; anything else (whitespace around it, a BOM,
        # an error) is decoded again the usual way, which answers or raises.
        try:
            obj, end = _SCAN(text, 0)
        except Exception:  # noqa: BLE001 - StopIteration, JSONDecodeError, ... decided below
            pass
        else:
            if end == len(text):
                return obj
        if not text.startswith("\ufeff"):
            return _JSON.decode(text)
    return json.loads(text, parse_constant=_no_constants)  # its BOM and bytes errors


def _usable_id(obj: dict[str, Any]) -> str | None:
    value = obj.get("id")
    if isinstance(value, str) and 0 < len(value) <= MAX_ID_CHARS and _utf8(value):
        return value
    return None


def _utf8(value: str) -> bool:
    """An `err` can echo it: a lone surrogate (`"\\ud800"` in the JSON) is no
    string pydantic takes, and the answer would fail where the frame did."""
    if value.isascii():
        return True
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _describe(error: ValidationError) -> str:
    parts = []
    for item in error.errors(include_url=False, include_input=False):
        # The first location element of a tagged union is the tag itself.
        loc = [str(p) for p in item["loc"]][1:]
        where = ".".join(loc) if loc else "frame"
        parts.append(f"{where}: {item['msg']}")
    return "; ".join(parts)


def decode_frame(text: str | bytes, *, accept: frozenset[str] | None = None) -> Frame:
    """Parse one message into a frame, or raise FrameError.

    `accept` limits the kinds this side takes (FROM_PROVIDER on the server,
    FROM_FUNDUQ in the SDK); a frame of another kind is an error carrying its id.
    """
    if isinstance(text, (bytes, bytearray, memoryview)):
        raise FrameError("frames are JSON text messages, not binary")
    try:
        obj = parse_json(text)
    except (ValueError, RecursionError) as exc:
        raise FrameError(f"frame is not JSON: {exc}") from None
    return decode_object(obj, accept=accept)


def decode_object(obj: Any, *, accept: frozenset[str] | None = None) -> Frame:
    """`decode_frame` for a message already parsed from JSON (a batch's item)."""
    if not isinstance(obj, dict):
        raise FrameError("frame is not a JSON object")
    frame_id = _usable_id(obj)
    kind = obj.get("kind")
    if not isinstance(kind, str):
        raise FrameError("frame has no string 'kind'", frame_id)
    if kind not in KINDS:
        raise FrameError(f"unknown frame kind {kind!r}", frame_id)
    if accept is not None and kind not in accept:
        raise FrameError(f"{kind!r} is not a frame this side accepts", frame_id)
    try:
        return _FRAME.validate_python(obj)
    except ValidationError as exc:
        raise FrameError(f"{kind!r} frame does not validate: {_describe(exc)}", frame_id) from None


# --- the commonest frames, read without a model ----------------------------
#
# A provider without batches sends every event as its own `report` message,
# and a run's `ok` and `finish` too: a dozen messages a run, each of which
# pydantic would validate. The readers below take such an object when it is
# beyond doubt what `decode_object` would accept as it is (only keys the
# frame's model knows by their wire names, every value of exactly the type
# it must have, nothing to convert) and give back the fields the link
# machine uses; anything else -- an unknown or snake_case key, a null where
# a value is required, a non-ASCII id, a bool for an int -- answers None and
# is decoded the long way, which decides it. `obj` must come from
# `parse_json` (its keys are strings). tests/test_frames_plain.py holds them
# equal to `decode_object`.

_REPORT_KEYS = frozenset({"kind", "runId", "event", "seq"})
_FINISH_KEYS = frozenset({"kind", "runId"})
_OK_KEYS = frozenset({"kind", "id", "verdict", "reason", "payload"})
_BATCH_KEYS = frozenset({"kind", "frames"})


def _plain_id(value: Any) -> TypeGuard[str]:
    # ASCII: pydantic refuses a string it cannot encode (a lone surrogate).
    return type(value) is str and 0 < len(value) <= MAX_ID_CHARS and value.isascii()


def plain_report(obj: dict[str, Any]) -> tuple[str, dict[str, Any], int | None] | None:
    """A `report`'s (runId, event, seq), or None: decode it the long way."""
    if not obj.keys() <= _REPORT_KEYS or obj.get("kind") != "report":
        return None
    run_id, event, seq = obj.get("runId"), obj.get("event"), obj.get("seq")
    if not _plain_id(run_id) or type(event) is not dict:
        return None
    if seq is not None and (type(seq) is not int or seq < 1):
        return None
    return run_id, event, seq


def plain_finish(obj: dict[str, Any]) -> str | None:
    """A `finish`'s runId, or None: decode it the long way."""
    if not obj.keys() <= _FINISH_KEYS or obj.get("kind") != "finish":
        return None
    run_id = obj.get("runId")
    return run_id if _plain_id(run_id) else None


def plain_ok(obj: dict[str, Any]) -> tuple[str, str | None, str | None] | None:
    """An `ok`'s (id, verdict, reason), or None: decode it the long way.
    (Its payload, anything at all, is not read: an offer's answer has none
    that matters.)"""
    if not obj.keys() <= _OK_KEYS or obj.get("kind") != "ok":
        return None
    frame_id, verdict, reason = obj.get("id"), obj.get("verdict"), obj.get("reason")
    if not _plain_id(frame_id):
        return None
    if verdict is not None and (type(verdict) is not str or verdict not in VERDICTS):
        return None
    if reason is not None and (type(reason) is not str or not reason.isascii()):
        return None
    return frame_id, verdict, reason


def plain_batch(obj: dict[str, Any]) -> list[Any] | None:
    """A `batch`'s items, or None: decode it the long way. (Each item is
    still the machine's to read, as `batch_items` reads it.)"""
    if not obj.keys() <= _BATCH_KEYS or obj.get("kind") != "batch":
        return None
    items = obj.get("frames")
    if type(items) is not list or not 0 < len(items) <= MAX_BATCH_FRAMES:
        return None
    return items


def batch_items(batch: Batch, *, accept: frozenset[str]) -> Iterator[Frame | FrameError]:
    """A batch's frames in order, each decoded on its own: the frame, or the
    FrameError that item would have raised alone, its reason prefixed
    `batch item N: ` so the sender can find it."""
    for index, item in enumerate(batch.frames):
        yield batch_item(index, item, accept=accept)


def batch_item(index: int, item: Any, *, accept: frozenset[str]) -> Frame | FrameError:
    """A batch's item `index` decoded on its own (`batch_items`)."""
    try:
        return decode_object(item, accept=accept)
    except FrameError as exc:
        return FrameError(f"batch item {index}: {exc.reason}", exc.id)


def message_frames(
    text: str | bytes,
    *,
    accept: frozenset[str],
    in_batch: frozenset[str],
    parsed: Any = _UNPARSED,
) -> Iterator[Frame | FrameError]:
    """One message's frames in order, each decoded on its own: the frame
    itself, or a batch's items (`batch_items` with `in_batch`, which never
    lists "batch": a nested batch is an item that does not decode); a message
    that does not decode yields its FrameError. Both ends of the link read
    every message through this, by way of `read_message`. `parsed` is
    `parse_json(text)` when the caller has it already."""
    try:
        if parsed is _UNPARSED:
            frame = decode_frame(text, accept=accept)
        else:
            frame = decode_object(parsed, accept=accept)
    except FrameError as exc:
        yield exc
        return
    if isinstance(frame, Batch):
        yield from batch_items(frame, accept=in_batch)
    else:
        yield frame


_Action = TypeVar("_Action")


def read_message(
    text: str | bytes,
    *,
    accept: frozenset[str],
    in_batch: frozenset[str],
    on_frame: Callable[[Frame], list[_Action]],
    answer_err: Callable[[Err], list[_Action]],
    violation: Callable[[str], list[_Action]],
    closed: Callable[[], bool],
    parsed: Any = _UNPARSED,
) -> list[_Action]:
    """One attached link end's reading of a message (funduq's in
    protocol/link.py, the SDK's in protocol/provider_link.py): each of its
    `message_frames` in order, as if it had come alone. A frame goes to
    `on_frame`; one that does not decode is answered `err {id, reason}` when
    it carried a usable id and is a `violation` otherwise; nothing after the
    item that closed the link is read. `parsed` as for `message_frames`."""
    actions: list[_Action] = []
    for item in message_frames(text, accept=accept, in_batch=in_batch, parsed=parsed):
        if not isinstance(item, FrameError):
            actions += on_frame(item)
        elif item.id is not None:
            actions += answer_err(Err(id=item.id, reason=item.reason))
        else:
            actions += violation(item.reason)
        if closed():
            break
    return actions


def encode_frame(frame: BaseModel) -> str:
    """The frame as compact JSON text: camelCase keys, optional fields as null."""
    return frame.model_dump_json(by_alias=True)


def batch_text(texts: list[str]) -> str:
    """One `batch` message of already encoded frames (no re-encoding)."""
    return '{"kind":"batch","frames":[' + ",".join(texts) + "]}"


def wire_bytes(text: str) -> int:
    """A message's length on the wire (UTF-8)."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


class Outgoing:
    """The encoded frames a writer gathers for its next message: a lone frame
    goes as itself, several as one `batch` of at most MAX_BATCH_FRAMES and
    about BATCH_BYTES (a single larger frame still goes, alone)."""

    __slots__ = ("texts", "_room")

    def __init__(self) -> None:
        self.texts: list[str] = []
        self._room = BATCH_BYTES - 32  # the batch's own wrapping

    def add(self, text: str) -> bool:
        """Take `text` into this message; False when it must wait for the next."""
        cost = wire_bytes(text) + 1
        if self.texts and (cost > self._room or len(self.texts) >= MAX_BATCH_FRAMES):
            return False
        self.texts.append(text)
        self._room -= cost
        return True

    def message(self) -> str:
        return self.texts[0] if len(self.texts) == 1 else batch_text(self.texts)
