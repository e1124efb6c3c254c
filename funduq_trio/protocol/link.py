"""The provider link's server side as an I/O-free state machine.

Theory of operation
-------------------
This module is to `WS /ws/provider` what h11 is to HTTP/1.1: it never touches
a socket, a clock or trio. The shell (`web/provider_socket.py`) owns the
websocket and the broker session; it hands this machine what happened and
does what the machine answers, in order:

* `LinkMachine.hello()` -> the first frame to send.
* `receive(text)` -> actions for one message from the provider.
* `offer(offer_id, run)`, `cancel(run_id)`, `close(reason)` -> actions for a
  request of the broker (the `ProviderLink` port: these never block).
* `complete(completion_id, request)`, `abandon(completion_id)` -> actions for
  the KYOK relay's requests to an LLM provider (never block either).
* `register_done(...)`, `register_llm_done(...)`, `query_done(...)` -> the
  reply frame once the shell finished the broker call an earlier `Register` /
  `RegisterLlm` / `QueryThreadMessages` action asked for.
* `connection_lost()` -> actions once the socket is gone, whoever closed it.

Every method returns a list of actions; the shell performs them in order:

=========================== ===============================================
action                      what the shell does
=========================== ===============================================
`Send(frame)`               queue the frame for the writer (never blocks)
`Attach(key, maxRuns)`      `session = funduq.attach_provider(key, maxRuns, link)`
`Register(id, agents)`      `await session.register(agents)`, then `register_done`
`Answer(id, verdict, why)`  `session.answer(id, verdict, why)`
`Report(runId, event)`      `session.report(runId, event)` (False = not its run: ignored)
`Finish(runId)`             `session.finish(runId)`
`QueryThreadMessages(...)`  `await session.thread_messages(...)`, then `query_done`
`RegisterLlm(id, offers)`   `await llm.register(offerings)`, then `register_llm_done`
`Chunk(id, data)`           `llm.chunk(id, data)` (KYOK, docs/kyok.md)
`CompletionEnd(id)`         `llm.end(id)`
`CompletionFailed(...)`     `llm.failed(id, message, refusal)`
`Detach()`                  `session.detach()` (the machine emits it exactly once)
`Close(reason, code)`       send nothing more; close the socket with code/reason
=========================== ===============================================

States and transitions (the whole table; `TRANSITIONS` below is the code's
copy and `_move` refuses anything not in it):

    AWAIT_CONNECT --connect verified, key allowed--> ATTACHED
        send connect.ok {answer}, Attach
    AWAIT_CONNECT --anything else (bad proof, key not allowed, another kind,
                    undecodable, oversized)--> CLOSED
        send connect.err {reason}, Close
    AWAIT_CONNECT --no connect within the handshake deadline--> CLOSED
        send connect.err {reason}, Close (1008)
    AWAIT_CONNECT --too many links already waiting for connect--> CLOSED
        send connect.err {reason}, Close (1013, try again later)
    AWAIT_CONNECT --connection lost--> CLOSED   (nothing to detach)
    ATTACHED --register/ok/err/report/finish/query/batch/register.llm/chunk/
              completion.end/completion.failed--> ATTACHED (see below)
    ATTACHED --protocol violation--> CLOSED     Close, Detach
    ATTACHED --broker closes the link--> CLOSED Close (Detach when the socket is gone)
    ATTACHED --connection lost--> CLOSED        Detach
    CLOSED --anything--> CLOSED                 nothing

While ATTACHED:
* `register {id, agents}` -> Register; then `ok {id}` (or `err {id, reason}`).
* `query.threadMessages {id, threadId, limit}` -> QueryThreadMessages; then
  `ok {id, payload: {messages}}` (or `err {id, reason}`).
* `batch {frames}` -> each item handled in order exactly as if it had come
  alone (an item that does not decode is answered `err {id}` or closes the
  link, as a lone frame would; nothing after a violation is read). A batch
  may not carry `connect` or another batch. funduq's hello lists it in
  `extensions`. The other way, a provider whose `connect.extensions` lists
  "batch" (`peer_takes_batches`) may be sent batches of offer/cancel/ok/err
  frames by the shell; which frames share a message is the shell's choice,
  the machine's frames and their order are the same either way.
* `report` / `finish` -> Report / Finish. Whether the provider holds the run
  is the broker's to say; a report for a run it does not hold is ignored.
* `ok {id, verdict, reason}` answering an outstanding offer -> Answer. The
  offer stops being outstanding. The answer goes to the broker even when the
  broker has since given up on that offer (it ignores late answers).
* `err {id, reason}` answering an outstanding offer: the provider rejected
  the offer frame itself. The offer stops being outstanding; the broker is
  told nothing and its delivery timeout puts the run back (`unanswered`).
* `err` without an id: a complaint about something funduq sent; ignored.
* KYOK (DESIGN §9): `register.llm {id, offerings}` -> RegisterLlm; then
  `ok {id}` (or `err {id, reason}`). `chunk` / `completion.end` /
  `completion.failed` for a completion funduq asked for with `complete` and
  that has not ended -> Chunk / CompletionEnd / CompletionFailed (the last
  two end it). For a completion that already ended or that funduq abandoned
  they are ignored: an `abandon` and the provider's last chunks cross on the
  wire. `complete` / `abandon` from the broker -> Send (an `abandon` ends the
  completion on funduq's side).

Protocol violations (close the link, reason in the close frame):
* an `ok`/`err` whose id names no offer funduq made on this link, or an offer
  already answered (a second answer);
* an `ok` to an offer with no verdict, or a refusal without a reason;
* a `chunk` / `completion.end` / `completion.failed` naming a completion
  funduq never asked for on this link;
* a second `connect`;
* a frame that does not decode and carries no usable `id` (one that carries
  an id is answered `err {id, reason}` and the link stays up);
* a frame larger than `max_frame_bytes` (close code 1009).

The handshake: funduq's `hello {funduqKey, nonce}` goes first. The provider's
`connect.proof` must be its key's signature over
`funduq-connect-provider:{funduqKey}:{funduqNonce}:{providerNonce}` where
funduqKey and funduqNonce are *this* link's (so a proof made for another
connection, or for another funduq, does not verify). Then, when an allowlist
is configured (`FUNDUQ_PROVIDER_KEYS`), the key must be on it. `connect.ok`
carries funduq's signature over `funduq-connect-funduq:{funduqNonce}:{providerNonce}`
so a provider that pinned funduq's key knows whom it reached.
"""

from __future__ import annotations

import enum
import json
from collections import deque
from dataclasses import dataclass
from typing import Any, Protocol

from funduq_trio import identity as _identity
from funduq_trio.protocol import carriable
from funduq_trio.protocol import frames as f

__all__ = [
    "CLOSE_NORMAL",
    "CLOSE_POLICY",
    "CLOSE_TOO_BIG",
    "CLOSE_TRY_LATER",
    "TRANSITIONS",
    "Action",
    "Answer",
    "Attach",
    "Close",
    "Detach",
    "Finish",
    "LinkMachine",
    "Chunk",
    "CompletionEnd",
    "CompletionFailed",
    "QueryThreadMessages",
    "Register",
    "RegisterLlm",
    "Report",
    "Send",
    "State",
]

#: WebSocket close codes the link uses.
CLOSE_NORMAL = 1000  # funduq closed the link (replaced, withdrawn, shutting down)
CLOSE_POLICY = 1008  # the provider broke the protocol or failed the handshake
CLOSE_TOO_BIG = 1009  # a frame over max_frame_bytes
#: Room kept in a query's reply frame for everything but its messages.
_REPLY_ENVELOPE = 1024
CLOSE_TRY_LATER = 1013  # funduq is full of links waiting for connect

#: How many answered offer ids the machine remembers, to tell "a second
#: answer" from "an answer to an offer never made" in the close reason.
#: Both close the link; only the wording depends on it.
_REMEMBERED_ANSWERS = 4096


class State(enum.Enum):
    AWAIT_CONNECT = "AWAIT_CONNECT"
    ATTACHED = "ATTACHED"
    CLOSED = "CLOSED"


# (state, what happened) -> next state. Nothing else moves the machine.
TRANSITIONS: dict[tuple[State, str], State] = {
    (State.AWAIT_CONNECT, "connect accepted"): State.ATTACHED,
    (State.AWAIT_CONNECT, "connect rejected"): State.CLOSED,
    (State.AWAIT_CONNECT, "handshake timed out"): State.CLOSED,
    (State.AWAIT_CONNECT, "no room to wait for connect"): State.CLOSED,
    (State.AWAIT_CONNECT, "connection lost"): State.CLOSED,
    (State.AWAIT_CONNECT, "funduq closes"): State.CLOSED,
    (State.ATTACHED, "protocol violation"): State.CLOSED,
    (State.ATTACHED, "funduq closes"): State.CLOSED,
    (State.ATTACHED, "connection lost"): State.CLOSED,
}


# --- actions ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    frame: Any  # a frames.* model


@dataclass(frozen=True, slots=True)
class Attach:
    public_key: str
    max_concurrent_runs: int | None


@dataclass(frozen=True, slots=True)
class Register:
    request_id: str
    agents: list[dict[str, Any]]  # [{name, description, card, metadata}]


@dataclass(frozen=True, slots=True)
class Answer:
    offer_id: str
    verdict: str  # accepted | declined | refused
    reason: str | None


@dataclass(frozen=True, slots=True)
class Report:
    run_id: str
    event: dict[str, Any]
    seq: int | None


@dataclass(frozen=True, slots=True)
class Finish:
    run_id: str


@dataclass(frozen=True, slots=True)
class QueryThreadMessages:
    request_id: str
    thread_id: str
    limit: int | None


@dataclass(frozen=True, slots=True)
class RegisterLlm:
    request_id: str
    offerings: list[dict[str, Any]]  # [{name, description, metadata}]


@dataclass(frozen=True, slots=True)
class Chunk:
    completion_id: str
    data: str


@dataclass(frozen=True, slots=True)
class CompletionEnd:
    completion_id: str


@dataclass(frozen=True, slots=True)
class CompletionFailed:
    completion_id: str
    message: str
    refusal: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class Detach:
    pass


@dataclass(frozen=True, slots=True)
class Close:
    reason: str
    code: int = CLOSE_POLICY


Action = (
    Send
    | Attach
    | Register
    | Answer
    | Report
    | Finish
    | QueryThreadMessages
    | Detach
    | Close
    | RegisterLlm
    | Chunk
    | CompletionEnd
    | CompletionFailed
)


class Signer(Protocol):
    public_key_hex: str

    def sign(self, payload: bytes | str) -> str: ...


# --- the machine ------------------------------------------------------------


class LinkMachine:
    """One provider connection, server side. See the module docstring."""

    def __init__(
        self,
        funduq_identity: Signer,
        nonce: str,
        *,
        allowed_keys: frozenset[str] | None = None,
        max_frame_bytes: int = 1024 * 1024,
    ) -> None:
        self.state = State.AWAIT_CONNECT
        self.nonce = nonce
        self.public_key: str | None = None  # the provider's, once attached
        #: The key a connect frame claimed, proven or not (for logging a refusal).
        self.claimed_key: str | None = None
        #: The provider listed "batch" in connect.extensions: the shell may
        #: write several queued frames to it as one batch.
        self.peer_takes_batches = False
        self.close_reason: str | None = None
        self._identity = funduq_identity
        self._allowed = allowed_keys
        self._max_frame_bytes = max_frame_bytes
        self._detached = False
        self._attached = False
        self._outstanding: dict[str, str] = {}  # offer id -> run id
        self._answered: deque[str] = deque()
        self._answered_set: set[str] = set()
        self._completions: set[str] = set()  # KYOK completions asked and not ended
        self._ended: deque[str] = deque()
        self._ended_set: set[str] = set()

    # -- bookkeeping --

    def _move(self, event: str) -> None:
        try:
            self.state = TRANSITIONS[(self.state, event)]
        except KeyError:
            raise RuntimeError(f"no transition from {self.state.name} on {event!r}") from None

    @property
    def outstanding_offers(self) -> frozenset[str]:
        return frozenset(self._outstanding)

    def _remember_answered(self, offer_id: str) -> None:
        self._outstanding.pop(offer_id, None)
        self._answered.append(offer_id)
        self._answered_set.add(offer_id)
        if len(self._answered) > _REMEMBERED_ANSWERS:
            self._answered_set.discard(self._answered.popleft())

    def _detach(self) -> list[Action]:
        if self._attached and not self._detached:
            self._detached = True
            return [Detach()]
        return []

    def _violation(self, reason: str, code: int = CLOSE_POLICY) -> list[Action]:
        """The provider broke the protocol while attached: close, then detach."""
        self._move("protocol violation")
        self.close_reason = reason
        return [Close(reason, code), *self._detach()]

    def _reject_connect(
        self, reason: str, code: int = CLOSE_POLICY, event: str = "connect rejected"
    ) -> list[Action]:
        self._move(event)
        self.close_reason = reason
        return [Send(f.ConnectErr(reason=reason)), Close(reason, code)]

    def _too_big(self, text: str | bytes) -> bool:
        limit = self._max_frame_bytes
        if isinstance(text, str):
            if len(text) * 4 <= limit:  # UTF-8 is at most 4 bytes a character
                return False
            return len(text.encode("utf-8", "surrogatepass")) > limit
        return len(text) > limit

    # -- inputs from the shell --

    def hello(self) -> Send:
        """The first frame of the link."""
        return Send(
            f.Hello(
                funduq_key=self._identity.public_key_hex,
                nonce=self.nonce,
                extensions=list(f.EXTENSIONS),
            )
        )

    def receive(self, text: str | bytes) -> list[Action]:
        """One message from the provider."""
        got = self.take(text)
        if isinstance(got, tuple):
            return [Report(*got)]
        return got

    def take(self, text: str | bytes) -> tuple[str, dict[str, Any], int | None] | list[Action]:
        """`receive`, except that a plain report (the commonest message of all)
        comes back as its bare (runId, event, seq), not as a `Report` in a
        list: the provider socket's reader takes it so, two objects fewer a
        message. Anything else: `receive`'s actions."""
        if self.state is State.CLOSED:
            return []
        if self._too_big(text):
            reason = f"frame larger than {self._max_frame_bytes} bytes"
            if self.state is State.AWAIT_CONNECT:
                return self._reject_connect(reason, CLOSE_TOO_BIG)
            return self._violation(reason, CLOSE_TOO_BIG)
        if self.state is State.AWAIT_CONNECT:
            return self._receive_connect(text)
        if type(text) is not str:
            return self._read(text)
        try:
            obj = f.parse_json(text)
        except (ValueError, RecursionError):
            return self._read(text)  # which says why
        if type(obj) is dict:
            # The commonest frames, read without a model (frames.plain_report):
            # the same actions the long road gives them.
            kind = obj.get("kind")
            if kind == "report":
                report = f.plain_report(obj)
                if report is not None:
                    return report
            elif kind == "finish":
                run_id = f.plain_finish(obj)
                if run_id is not None:
                    return [Finish(run_id)]
            elif kind == "ok":
                ok = f.plain_ok(obj)
                if ok is not None:
                    return self._answer(*ok)
            elif kind == "batch":
                items = f.plain_batch(obj)
                if items is not None:
                    return self._batch(items)
        return self._read(text, obj)

    def _batch(self, items: list[Any]) -> list[Action]:
        """A batch's items (`frames.plain_batch`), each taken as `take`
        takes a lone frame: the commonest short of a model, the others the
        long road's way (`frames.batch_item`), in order, nothing after the
        item that closed the link. The same actions as `_read`'s
        (tests/test_frames_plain.py holds the two equal)."""
        actions: list[Action] = []
        for index, item in enumerate(items):
            if type(item) is dict:
                kind = item.get("kind")
                if kind == "report":
                    report = f.plain_report(item)
                    if report is not None:
                        actions.append(Report(*report))
                        continue
                elif kind == "finish":
                    run_id = f.plain_finish(item)
                    if run_id is not None:
                        actions.append(Finish(run_id))
                        continue
                elif kind == "ok":
                    ok = f.plain_ok(item)
                    if ok is not None:
                        actions += self._answer(*ok)
                        if self.state is State.CLOSED:
                            break
                        continue
            frame = f.batch_item(index, item, accept=f.IN_BATCH)
            if not isinstance(frame, f.FrameError):
                actions += self._receive_attached(frame)
            elif frame.id is not None:
                actions.append(Send(f.Err(id=frame.id, reason=frame.reason)))
            else:
                actions += self._violation(frame.reason)
            if self.state is State.CLOSED:
                break
        return actions

    def _read(self, text: str | bytes, parsed: Any = f._UNPARSED) -> list[Action]:
        """An attached link's message, every frame decoded in full (the
        long road; `receive` takes the commonest frames short of it)."""
        return f.read_message(
            text,
            accept=f.FROM_PROVIDER,
            in_batch=f.IN_BATCH,
            on_frame=self._receive_attached,
            answer_err=lambda err: [Send(err)],
            violation=self._violation,
            closed=lambda: self.state is State.CLOSED,
            parsed=parsed,
        )

    def _receive_connect(self, text: str | bytes) -> list[Action]:
        try:
            frame = f.decode_frame(text, accept=f.FROM_PROVIDER)
        except f.FrameError as exc:
            return self._reject_connect(exc.reason)
        if not isinstance(frame, f.Connect):
            return self._reject_connect(f"expected a 'connect' frame first, got {frame.kind!r}")
        self.claimed_key = frame.public_key
        payload = _identity.provider_connect_payload(
            self._identity.public_key_hex, self.nonce, frame.nonce
        )
        if not _identity.verify(frame.public_key, payload, frame.proof):
            return self._reject_connect(
                "proof does not verify: it must be publicKey's signature over "
                "funduq-connect-provider:{funduqKey}:{funduqNonce}:{providerNonce} "
                "with this connection's hello"
            )
        if self._allowed is not None and frame.public_key not in self._allowed:
            return self._reject_connect("key not allowed on this funduq")
        self._move("connect accepted")
        self._attached = True
        self.public_key = frame.public_key
        self.peer_takes_batches = "batch" in (frame.extensions or ())
        answer = self._identity.sign(_identity.funduq_connect_payload(self.nonce, frame.nonce))
        return [
            Send(f.ConnectOk(answer=answer)),
            Attach(frame.public_key, frame.max_concurrent_runs),
        ]

    def _receive_attached(self, frame: Any) -> list[Action]:
        if isinstance(frame, f.Report):
            return [Report(frame.run_id, frame.event, frame.seq)]
        if isinstance(frame, f.Finish):
            return [Finish(frame.run_id)]
        if isinstance(frame, f.Ok):
            return self._receive_ok(frame)
        if isinstance(frame, f.Register):
            agents = [a.model_dump(by_alias=True) for a in frame.agents]
            return [Register(frame.id, agents)]
        if isinstance(frame, f.QueryThreadMessages):
            return [QueryThreadMessages(frame.id, frame.thread_id, frame.limit)]
        if isinstance(frame, f.Err):
            return self._receive_err(frame)
        if isinstance(frame, f.Chunk):
            return self._completion_frame(frame, Chunk(frame.id, frame.data), ends=False)
        if isinstance(frame, f.CompletionEnd):
            return self._completion_frame(frame, CompletionEnd(frame.id), ends=True)
        if isinstance(frame, f.CompletionFailed):
            action = CompletionFailed(frame.id, frame.message, frame.refusal)
            return self._completion_frame(frame, action, ends=True)
        if isinstance(frame, f.RegisterLlm):
            offerings = [o.model_dump(by_alias=True) for o in frame.offerings]
            return [RegisterLlm(frame.id, offerings)]
        if isinstance(frame, f.Connect):
            return self._violation("a second 'connect' on an attached link")
        raise AssertionError(f"unhandled provider frame {frame.kind!r}")  # pragma: no cover

    def _unknown_answer(self, kind: str, offer_id: str) -> list[Action]:
        if offer_id in self._answered_set:
            return self._violation(f"a second answer ({kind}) to offer {offer_id!r}")
        return self._violation(f"{kind} for {offer_id!r}, an offer funduq never made on this link")

    def _receive_ok(self, frame: f.Ok) -> list[Action]:
        return self._answer(frame.id, frame.verdict, frame.reason)

    def _answer(self, offer_id: str, verdict: str | None, reason: str | None) -> list[Action]:
        """An `ok {id, verdict, reason}`."""
        if offer_id not in self._outstanding:
            return self._unknown_answer("ok", offer_id)
        if verdict is None:
            return self._violation(f"ok to offer {offer_id!r} carries no verdict")
        if verdict == "refused" and not reason:
            return self._violation(f"refusal of offer {offer_id!r} carries no reason")
        self._remember_answered(offer_id)
        return [Answer(offer_id, verdict, reason if verdict == "refused" else None)]

    def _completion_frame(self, frame: Any, action: Action, *, ends: bool) -> list[Action]:
        if frame.id in self._completions:
            if ends:
                self._end_completion(frame.id)
            return [action]
        if frame.id in self._ended_set:
            return []  # crossed an abandon, or after the end: nobody reads it
        return self._violation(
            f"{frame.kind} for {frame.id!r}, a completion funduq never asked for on this link"
        )

    def _end_completion(self, completion_id: str) -> None:
        self._completions.discard(completion_id)
        self._ended.append(completion_id)
        self._ended_set.add(completion_id)
        if len(self._ended) > _REMEMBERED_ANSWERS:
            self._ended_set.discard(self._ended.popleft())

    def _receive_err(self, frame: f.Err) -> list[Action]:
        if frame.id is None:
            return []
        if frame.id not in self._outstanding:
            return self._unknown_answer("err", frame.id)
        self._remember_answered(frame.id)
        return []

    # -- the broker's requests (ProviderLink port) --

    def offer(self, offer_id: str, run: dict[str, Any]) -> list[Action]:
        """Offer a run: `run` is `{runId, threadId, agentName, runInput, metadata}`."""
        if self.state is not State.ATTACHED:
            return []
        if offer_id in self._outstanding or offer_id in self._answered_set:
            raise ValueError(f"offer id {offer_id!r} was already used on this link")
        frame = f.Offer(id=offer_id, run=f.OfferRun.model_validate(run))
        self._outstanding[offer_id] = frame.run.run_id
        return [Send(frame)]

    def cancel(self, run_id: str) -> list[Action]:
        if self.state is not State.ATTACHED:
            return []
        return [Send(f.Cancel(run_id=run_id))]

    def complete(self, completion_id: str, request: dict[str, Any]) -> list[Action]:
        """KYOK: ask for a completion. `request` is `{runId, agent, llm, body,
        context, actorChain}` (camelCase, as the `complete` frame has them)."""
        if self.state is not State.ATTACHED:
            return []
        if completion_id in self._completions or completion_id in self._ended_set:
            raise ValueError(f"completion id {completion_id!r} was already used on this link")
        frame = f.Complete.model_validate({"kind": "complete", "id": completion_id, **request})
        self._completions.add(completion_id)
        return [Send(frame)]

    def abandon(self, completion_id: str) -> list[Action]:
        """KYOK: funduq stops reading a completion; what the provider still
        sends for it is ignored."""
        if self.state is not State.ATTACHED or completion_id not in self._completions:
            return []
        self._end_completion(completion_id)
        return [Send(f.Abandon(id=completion_id))]

    def close(self, reason: str) -> list[Action]:
        """The broker closes the link (replaced by a newer connection, withdrawn,
        shutting down). Detach follows from connection_lost, once the socket is
        gone, so the broker is never re-entered from inside its own call."""
        if self.state is State.CLOSED:
            return []
        self._move("funduq closes")
        self.close_reason = reason
        return [Close(reason, CLOSE_NORMAL)]

    # -- completions of the shell's broker calls --

    def register_done(self, request_id: str, error: str | None = None) -> list[Action]:
        if self.state is not State.ATTACHED:
            return []
        if error is not None:
            return [Send(f.Err(id=request_id, reason=error))]
        return [Send(f.Ok(id=request_id))]

    def register_llm_done(self, request_id: str, error: str | None = None) -> list[Action]:
        return self.register_done(request_id, error)

    def query_done(
        self,
        request_id: str,
        messages: list[dict[str, Any]] | None = None,
        error: str | None = None,
    ) -> list[Action]:
        if self.state is not State.ATTACHED:
            return []
        if error is None:
            # An older record may hold messages the link cannot carry: the
            # query fails, not the link (its writer could not encode the reply).
            problem = carriable.problem(messages, max_nesting=None)
            if problem is not None:
                error = f"the thread's messages cannot be carried by the link: {problem}"
        if error is not None:
            return [Send(f.Err(id=request_id, reason=error))]
        messages = _newest_that_fit(messages or [], self._max_frame_bytes - _REPLY_ENVELOPE)
        return [Send(f.Ok(id=request_id, payload={"messages": messages}))]

    def handshake_timed_out(self, seconds: float) -> list[Action]:
        """The shell's handshake deadline passed. Closes a link still waiting
        for `connect`; nothing for one that attached (or closed) meanwhile."""
        if self.state is not State.AWAIT_CONNECT:
            return []
        return self._reject_connect(
            f"no 'connect' within {seconds:g} s of the hello (FUNDUQ_HANDSHAKE_TIMEOUT_SECONDS)",
            event="handshake timed out",
        )

    def no_room_to_wait(self, limit: int) -> list[Action]:
        """Refuse a new link at once: `limit` links already wait for `connect`."""
        if self.state is not State.AWAIT_CONNECT:
            return []
        return self._reject_connect(
            f"{limit} links already wait for 'connect' (FUNDUQ_MAX_UNAUTHENTICATED_LINKS); "
            "retry later",
            CLOSE_TRY_LATER,
            event="no room to wait for connect",
        )

    def connection_lost(self) -> list[Action]:
        """The socket is gone (either side closed it, or it broke)."""
        if self.state is not State.CLOSED:
            self._move("connection lost")
            if self.close_reason is None:
                self.close_reason = "connection lost"
        return self._detach()


def _newest_that_fit(messages: list[dict[str, Any]], room: int) -> list[dict[str, Any]]:
    """The newest messages whose JSON fits in `room` bytes (a query's reply is
    held to the link's frame limit: older history is what gives way)."""
    kept = 0
    for message in reversed(messages):
        size = len(json.dumps(message, ensure_ascii=False, separators=(",", ":")).encode()) + 1
        if size > room:
            break
        room -= size
        kept += 1
    return messages[len(messages) - kept :]
