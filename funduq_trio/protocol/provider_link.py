"""The provider link's provider side as an I/O-free state machine.

Theory of operation
-------------------
`protocol/link.py` is funduq's end of `WS /ws/provider`; this is the other
end, the one the provider SDK (`provider/runtime.py`) speaks through. Like
h11, it never touches a socket, a clock or trio: the runtime (the shell) owns
the connection, the writer's queue and flow control, the run and completion
tasks; it hands this machine what happened and does what the machine
answers, in order:

* `receive(text)` -> actions for one message from funduq.
* `connection_lost(reason)` -> actions once the socket is gone.
* the runtime's own sends, each checked and encoded here:
  `register(agents)` / `register_llm(offerings)` /
  `query_thread_messages(thread_id, limit)` -> `(request id, actions)`;
  `answer(offer_id, verdict, reason)`, `report(run_id, event, seq)`,
  `finish(run_id)`, `chunk(id, data)`, `completion_end(id)`,
  `completion_failed(id, message, refusal)` -> actions.
* `close(reason)` -> the runtime ends the link itself.

=============================== =============================================
action                          what the shell does
=============================== =============================================
`Send(frame, text, flow)`       queue `text` for the writer (`flow`: a report
                                or chunk, sent under a report credit)
`Attached(peer_takes_batches)`  start the writer and reader; publish
`OfferArrived(offer)`           decide at once (never await an agent), then
                                `answer(offer.id, verdict, reason)`
`CancelArrived(run_id)`         cancel that run's task, if it holds one
`CompletionRequested(frame)`    start a KYOK completion task
`CompletionAbandoned(id)`       cancel that completion's task, if any
`Registered()`                  funduq took the agents: the link serves
`QueryAnswered(id, msgs, err)`  wake the query waiting on that id
`Notice(message)`               log it (funduq complained, or answered an id
                                this provider never asked); nothing else
`End(reason, fault)`            the link is over: stop its tasks, close the
                                socket; `fault` = raise it, do not retry
=============================== =============================================

States and transitions (the whole table; `TRANSITIONS` is the code's copy
and `_move` refuses anything not in it):

    AWAIT_HELLO --hello, key as pinned (or none pinned)--> AWAIT_CONNECT_OK
        Send connect {publicKey, nonce, proof, maxConcurrentRuns, extensions}
    AWAIT_HELLO --hello under another key than the pinned one--> CLOSED
        End(fault=KEY_MISMATCH)
    AWAIT_CONNECT_OK --connect.ok, answer verifies--> ATTACHED   Attached
    AWAIT_CONNECT_OK --connect.ok, answer missing (key pinned) or not
                       verifying under hello's key--> CLOSED  End(KEY_MISMATCH)
    AWAIT_CONNECT_OK --connect.err--> CLOSED      End(fault=CONNECT_REJECTED)
    AWAIT_HELLO / AWAIT_CONNECT_OK --anything else, undecodable--> CLOSED
        End("protocol error: ...")
    ATTACHED --offer/cancel/complete/abandon/ok/err/batch--> ATTACHED (below)
    ATTACHED --err to `register` or `register.llm`--> CLOSED
        End(fault=REGISTER_REJECTED)
    ATTACHED --protocol violation--> CLOSED       End("protocol error: ...")
    any but CLOSED --connection lost / the runtime closes--> CLOSED   End
    CLOSED --anything--> CLOSED                   nothing

While ATTACHED:
* `offer` -> OfferArrived; the offer is outstanding until `answer` (once).
* `cancel` -> CancelArrived; `complete` -> CompletionRequested; `abandon` ->
  CompletionAbandoned. Whether the run or completion is held is the shell's
  to know (a cancel crossing a `finish` is normal).
* `ok` / `err {id}` answering this side's request: `register` -> Registered
  (err: End REGISTER_REJECTED); `register.llm` -> nothing (err: End
  REGISTER_REJECTED); `query.threadMessages` -> QueryAnswered. The request
  stops being outstanding.
* `ok` / `err` naming an id this side never asked (or already answered) ->
  Notice; `err` without an id (funduq's complaint about something sent) ->
  Notice. The link stays up: funduq is the side that keeps state.
* `batch {frames}` -> each item in order exactly as if it had come alone
  (`frames.read_message`, the same reading funduq's side does); nothing
  after a violation is read. A batch never nests.

Protocol violations (End with "protocol error: ..."):
* a frame that does not decode and carries no usable `id` (one that carries
  an id is answered `err {id, reason}` and the link stays up);
* `hello`, `connect.ok` or `connect.err` on an attached link.

The runtime's sends are checked before they leave: an answer to an offer
that is not outstanding is the runtime's bug (ValueError); a report or chunk
the link cannot carry (NaN, a lone surrogate) or over `max_frame_bytes`
raises ValueError, failing that run or completion alone. On a link that is
not attached they return no actions: the frame has nowhere to go.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass
from typing import Any

from funduq_trio import identity as _identity
from funduq_trio.protocol import carriable
from funduq_trio.protocol import frames as f
from funduq_trio.protocol.link import Signer

__all__ = [
    "TRANSITIONS",
    "Action",
    "Attached",
    "CancelArrived",
    "CompletionAbandoned",
    "CompletionRequested",
    "End",
    "Fault",
    "Notice",
    "OfferArrived",
    "ProviderLinkMachine",
    "QueryAnswered",
    "Registered",
    "Request",
    "Send",
    "State",
]


class State(enum.Enum):
    AWAIT_HELLO = "AWAIT_HELLO"
    AWAIT_CONNECT_OK = "AWAIT_CONNECT_OK"
    ATTACHED = "ATTACHED"
    CLOSED = "CLOSED"


class Fault(enum.Enum):
    """Why a link ended in a way reconnecting would only repeat."""

    CONNECT_REJECTED = "connect rejected"  # funduq answered connect.err
    KEY_MISMATCH = "key mismatch"  # funduq is not (or cannot prove it is) the pinned one
    REGISTER_REJECTED = "register rejected"  # funduq refused the agents or offerings


class Request(enum.Enum):
    """This side's requests that funduq answers with `ok` / `err {id}`."""

    REGISTER = "register"
    REGISTER_LLM = "register.llm"
    QUERY = "query"


# (state, what happened) -> next state. Nothing else moves the machine.
TRANSITIONS: dict[tuple[State, str], State] = {
    (State.AWAIT_HELLO, "hello"): State.AWAIT_CONNECT_OK,
    (State.AWAIT_HELLO, "key mismatch"): State.CLOSED,
    (State.AWAIT_HELLO, "protocol violation"): State.CLOSED,
    (State.AWAIT_HELLO, "connection lost"): State.CLOSED,
    (State.AWAIT_HELLO, "provider closes"): State.CLOSED,
    (State.AWAIT_CONNECT_OK, "connect.ok"): State.ATTACHED,
    (State.AWAIT_CONNECT_OK, "key mismatch"): State.CLOSED,
    (State.AWAIT_CONNECT_OK, "connect.err"): State.CLOSED,
    (State.AWAIT_CONNECT_OK, "protocol violation"): State.CLOSED,
    (State.AWAIT_CONNECT_OK, "connection lost"): State.CLOSED,
    (State.AWAIT_CONNECT_OK, "provider closes"): State.CLOSED,
    (State.ATTACHED, "register rejected"): State.CLOSED,
    (State.ATTACHED, "protocol violation"): State.CLOSED,
    (State.ATTACHED, "connection lost"): State.CLOSED,
    (State.ATTACHED, "provider closes"): State.CLOSED,
}


# --- actions ----------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Send:
    frame: Any  # a frames.* model
    text: str  # its encoding, done once here
    flow: bool = False  # a report or chunk: the shell sends it under a credit


@dataclass(frozen=True, slots=True)
class Attached:
    peer_takes_batches: bool  # funduq's hello listed "batch"


@dataclass(frozen=True, slots=True)
class OfferArrived:
    offer: f.Offer


@dataclass(frozen=True, slots=True)
class CancelArrived:
    run_id: str


@dataclass(frozen=True, slots=True)
class CompletionRequested:
    request: f.Complete


@dataclass(frozen=True, slots=True)
class CompletionAbandoned:
    completion_id: str


@dataclass(frozen=True, slots=True)
class Registered:
    pass


@dataclass(frozen=True, slots=True)
class QueryAnswered:
    request_id: str
    messages: list[Any] | None  # None when `error` says why not
    error: str | None = None


@dataclass(frozen=True, slots=True)
class Notice:
    message: str


@dataclass(frozen=True, slots=True)
class End:
    reason: str
    fault: Fault | None = None


Action = (
    Send
    | Attached
    | OfferArrived
    | CancelArrived
    | CompletionRequested
    | CompletionAbandoned
    | Registered
    | QueryAnswered
    | Notice
    | End
)


def _send(frame: Any, *, flow: bool = False) -> Send:
    return Send(frame, f.encode_frame(frame), flow)


# --- the machine ------------------------------------------------------------


class ProviderLinkMachine:
    """One connection to funduq, provider side. See the module docstring.

    `identity`: the provider's key. `nonce`: this connection's provider
    nonce (fresh per connection). `funduq_key`: the pinned funduq key (hex)
    or None. `max_frame_bytes`: the largest report or chunk this side sends.
    """

    def __init__(
        self,
        identity: Signer,
        nonce: str,
        *,
        funduq_key: str | None = None,
        max_concurrent_runs: int | None = None,
        max_frame_bytes: int = 1024 * 1024,
    ) -> None:
        self.state = State.AWAIT_HELLO
        self.nonce = nonce
        self.funduq_key = funduq_key.lower() if funduq_key else None
        self.end_reason: str | None = None
        self.max_frame_bytes = max_frame_bytes
        self._identity = identity
        self._max_runs = max_concurrent_runs
        self._hello: f.Hello | None = None
        self._requests: dict[str, Request] = {}  # this side's, awaiting ok/err
        self._offers: set[str] = set()  # funduq's, awaiting this side's answer
        self._ids = itertools.count(1)

    # -- bookkeeping --

    def _move(self, event: str) -> None:
        try:
            self.state = TRANSITIONS[(self.state, event)]
        except KeyError:
            raise RuntimeError(f"no transition from {self.state.name} on {event!r}") from None

    def _end(self, event: str, reason: str, fault: Fault | None = None) -> list[Action]:
        self._move(event)
        self.end_reason = reason
        self._requests.clear()
        self._offers.clear()
        return [End(reason, fault)]

    def _violation(self, reason: str) -> list[Action]:
        return self._end("protocol violation", f"protocol error: {reason}")

    @property
    def outstanding_requests(self) -> dict[str, Request]:
        return dict(self._requests)

    @property
    def outstanding_offers(self) -> frozenset[str]:
        return frozenset(self._offers)

    # -- messages from funduq --

    def receive(self, text: str | bytes) -> list[Action]:
        """One message from funduq."""
        if self.state is State.CLOSED:
            return []
        if self.state is not State.ATTACHED:
            try:
                frame = f.decode_frame(text, accept=f.FROM_FUNDUQ)
            except f.FrameError as exc:
                return self._violation(exc.reason)
            if self.state is State.AWAIT_HELLO:
                return self._receive_hello(frame)
            return self._receive_connect_reply(frame)
        return f.read_message(
            text,
            accept=f.FROM_FUNDUQ,
            in_batch=f.IN_FUNDUQ_BATCH,
            on_frame=self._receive_attached,
            answer_err=lambda err: [_send(err)],
            violation=self._violation,
            closed=lambda: self.state is State.CLOSED,
        )

    def _receive_hello(self, frame: Any) -> list[Action]:
        if not isinstance(frame, f.Hello):
            return self._violation(f"expected hello, got {frame.kind!r}")
        if self.funduq_key is not None and frame.funduq_key != self.funduq_key:
            return self._end(
                "key mismatch",
                f"funduq presents key {frame.funduq_key}, not the pinned {self.funduq_key}",
                Fault.KEY_MISMATCH,
            )
        self._move("hello")
        self._hello = frame
        proof = self._identity.sign(
            _identity.provider_connect_payload(frame.funduq_key, frame.nonce, self.nonce)
        )
        return [
            _send(
                f.Connect(
                    public_key=self._identity.public_key_hex,
                    nonce=self.nonce,
                    proof=proof,
                    max_concurrent_runs=self._max_runs,
                    extensions=list(f.EXTENSIONS),
                )
            )
        ]

    def _receive_connect_reply(self, frame: Any) -> list[Action]:
        hello = self._hello
        assert hello is not None  # AWAIT_CONNECT_OK is reached only through a hello
        if isinstance(frame, f.ConnectErr):
            return self._end("connect.err", frame.reason, Fault.CONNECT_REJECTED)
        if not isinstance(frame, f.ConnectOk):
            return self._violation(f"expected connect.ok, got {frame.kind!r}")
        if frame.answer is None:
            # An unpinned provider takes an answerless funduq at its hello's word.
            if self.funduq_key is not None:
                return self._end(
                    "key mismatch",
                    "funduq sent no answer to prove its pinned key",
                    Fault.KEY_MISMATCH,
                )
        elif not _identity.verify(
            hello.funduq_key,
            _identity.funduq_connect_payload(hello.nonce, self.nonce),
            frame.answer,
        ):
            return self._end(
                "key mismatch",
                "funduq's connect.ok answer does not verify under its key",
                Fault.KEY_MISMATCH,
            )
        self._move("connect.ok")
        return [Attached("batch" in (hello.extensions or ()))]

    def _receive_attached(self, frame: Any) -> list[Action]:
        if isinstance(frame, f.Offer):
            self._offers.add(frame.id)
            return [OfferArrived(frame)]
        if isinstance(frame, f.Cancel):
            return [CancelArrived(frame.run_id)]
        if isinstance(frame, f.Complete):
            return [CompletionRequested(frame)]
        if isinstance(frame, f.Abandon):
            return [CompletionAbandoned(frame.id)]
        if isinstance(frame, (f.Ok, f.Err)):
            return self._receive_reply(frame)
        return self._violation(f"unexpected {frame.kind!r} on an attached link")

    def _receive_reply(self, frame: f.Ok | f.Err) -> list[Action]:
        if frame.id is None:
            return [Notice(f"funduq complained: {getattr(frame, 'reason', frame)}")]
        what = self._requests.pop(frame.id, None)
        if what is None:
            return [Notice(f"funduq answered {frame.id!r}, which this provider never asked")]
        if what is Request.QUERY:
            if isinstance(frame, f.Err):
                return [QueryAnswered(frame.id, None, frame.reason)]
            payload = frame.payload if isinstance(frame.payload, dict) else {}
            return [QueryAnswered(frame.id, list(payload.get("messages") or []))]
        if isinstance(frame, f.Err):
            return self._end("register rejected", frame.reason, Fault.REGISTER_REJECTED)
        return [Registered()] if what is Request.REGISTER else []

    def connection_lost(self, reason: str) -> list[Action]:
        """The socket is gone (either side closed it, or it broke)."""
        if self.state is State.CLOSED:
            return []
        return self._end("connection lost", reason)

    def close(self, reason: str) -> list[Action]:
        """The runtime ends the link itself (it is stopping)."""
        if self.state is State.CLOSED:
            return []
        return self._end("provider closes", reason)

    # -- the runtime's sends --

    def _request(self, what: Request, prefix: str, frame_of: Any) -> tuple[str, list[Action]]:
        request_id = f"{prefix}-{next(self._ids)}"
        if self.state is not State.ATTACHED:
            return request_id, []
        frame = frame_of(request_id)
        self._requests[request_id] = what
        return request_id, [_send(frame)]

    def register(self, agents: list[f.AgentSpec]) -> tuple[str, list[Action]]:
        """Publish the agents this link serves; funduq's `ok` -> Registered."""
        return self._request(
            Request.REGISTER, "register", lambda rid: f.Register(id=rid, agents=agents)
        )

    def register_llm(self, offerings: list[f.LlmOffering]) -> tuple[str, list[Action]]:
        """KYOK: publish the offerings (before `register`, so its ok says both are in)."""
        return self._request(
            Request.REGISTER_LLM,
            "register.llm",
            lambda rid: f.RegisterLlm(id=rid, offerings=offerings),
        )

    def query_thread_messages(self, thread_id: str, limit: int | None) -> tuple[str, list[Action]]:
        """Ask for a thread's messages; the answer comes as QueryAnswered."""
        return self._request(
            Request.QUERY,
            "query",
            lambda rid: f.QueryThreadMessages(id=rid, thread_id=thread_id, limit=limit),
        )

    def answer(self, offer_id: str, verdict: str, reason: str | None = None) -> list[Action]:
        """Answer an outstanding offer (exactly once)."""
        if self.state is not State.ATTACHED:
            return []
        if offer_id not in self._offers:
            raise ValueError(f"offer {offer_id!r} is not awaiting an answer on this link")
        frame = f.Ok(id=offer_id, verdict=verdict, reason=reason)  # type: ignore[arg-type]
        self._offers.discard(offer_id)
        return [_send(frame)]

    def _flow(self, frame: Any, what: str) -> list[Action]:
        send = _send(frame, flow=True)
        size = f.wire_bytes(send.text)
        if size > self.max_frame_bytes:
            raise ValueError(
                f"{what} is {size} bytes on the wire, over the link's frame "
                f"limit of {self.max_frame_bytes}"
            )
        return [send] if self.state is State.ATTACHED else []

    def report(self, run_id: str, event: Any, seq: int) -> list[Action]:
        """One event of a run. Raises ValueError (failing that run alone) for
        an event the link cannot carry or that is over the frame limit."""
        frame = f.Report(run_id=run_id, event=event, seq=seq)
        # Refused here: the encoder would turn NaN into null, and funduq
        # refuses a lone surrogate as a malformed event anyway.
        problem = carriable.problem(frame.event, max_nesting=None)
        if problem is not None:
            raise ValueError(f"event #{seq} cannot be carried by the link: it holds {problem}")
        return self._flow(frame, f"event #{seq}")

    def finish(self, run_id: str) -> list[Action]:
        if self.state is not State.ATTACHED:
            return []
        return [_send(f.Finish(run_id=run_id))]

    def chunk(self, completion_id: str, data: str) -> list[Action]:
        """KYOK: one piece of a completion, flow-controlled like a report."""
        return self._flow(f.Chunk(id=completion_id, data=data), "a chunk")

    def completion_end(self, completion_id: str) -> list[Action]:
        if self.state is not State.ATTACHED:
            return []
        return [_send(f.CompletionEnd(id=completion_id))]

    def completion_failed(
        self, completion_id: str, message: str, refusal: dict[str, Any] | None = None
    ) -> list[Action]:
        if self.state is not State.ATTACHED:
            return []
        return [_send(f.CompletionFailed(id=completion_id, message=message, refusal=refusal))]
