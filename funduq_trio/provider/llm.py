"""KYOK in the SDK, both sides (DESIGN §9, docs/kyok.md).

**Agent side.** A run whose caller opted into KYOK carries a grant in
`runInput.forwardedProps.kyok = {token, baseUrl}`. `RunContext.kyok_client()`
(or `kyok_client(grant, identity)`) is an `openai.AsyncOpenAI` aimed at
funduq's relay with that token, whose httpx client signs every call with the
provider's key (`Funduq-Timestamp`, `Funduq-Signature` over
`funduq-kyok-call:{token}:{timestamp}:{sha256hex(body)}`). openai runs on
httpx and anyio, so it works under trio. It needs the `kyok` extra
(`pip install funduq-trio[kyok]`); nothing here imports openai until asked.

**LLM-provider side.** `Provider.add_offering(fn, name=...)` publishes an
offering with `register.llm`; each `complete` frame runs
`fn(request: CompletionRequest)`, an async iterator of chunks (a str is sent
verbatim, a dict as compact JSON), in its own task: `chunk` per item, then
`completion.end`; raising `Refusal(message, refusal)` sends
`completion.failed` with the refusal object, any other exception without one;
an `abandon` cancels the task. Two offerings ship: `fake_model` (a
deterministic model for tests and demos) and `make_forwarder(url, api_key)`
(relays to any OpenAI-compatible endpoint).

**The example agent.** `kyok_chat` answers a run by asking its grant, so the
whole chain is caller -> funduq -> agent -> funduq -> LLM provider -> back.

Imports only the standard library, httpx, ag-ui-protocol, the protocol frames
and identity (and openai lazily).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from ag_ui.core import (
    Event,
    RunAgentInput,
    RunFinishedEvent,
    RunStartedEvent,
    TextMessageContentEvent,
    TextMessageEndEvent,
    TextMessageStartEvent,
)

from funduq_trio.identity import Identity, kyok_call_payload
from funduq_trio.protocol import frames as f

__all__ = [
    "CompletionRequest",
    "Refusal",
    "fake_model",
    "kyok_chat",
    "kyok_client",
    "kyok_grant",
    "kyok_http_client",
    "make_forwarder",
]


# -- the agent side --------------------------------------------------------------


def kyok_grant(run_input: RunAgentInput | dict[str, Any]) -> dict[str, str] | None:
    """The run's `{token, baseUrl}`, or None when its caller opted into no KYOK."""
    props = (
        run_input.get("forwardedProps")
        if isinstance(run_input, dict)
        else run_input.forwarded_props
    )
    grant = props.get("kyok") if isinstance(props, dict) else None
    if (
        isinstance(grant, dict)
        and isinstance(grant.get("token"), str)
        and isinstance(grant.get("baseUrl"), str)
    ):
        return {"token": grant["token"], "baseUrl": grant["baseUrl"]}
    return None


def _signer(token: str, identity: Identity, clock: Callable[[], float]) -> Callable[..., Any]:
    # funduq takes each call signature once; the same body sent twice within
    # a second (a retry) is signed a second earlier, still inside the window.
    used: dict[tuple[int, bytes], None] = {}

    async def sign(request: httpx.Request) -> None:
        body = await request.aread()
        now = int(clock())
        digest = hashlib.sha256(body).digest()
        for old in [entry for entry in used if entry[0] < now - 120]:
            del used[old]
        stamp = now
        while (stamp, digest) in used:
            stamp -= 1
        used[(stamp, digest)] = None
        request.headers["Funduq-Timestamp"] = str(stamp)
        request.headers["Funduq-Signature"] = identity.sign(kyok_call_payload(token, stamp, body))

    return sign


def kyok_http_client(
    grant: dict[str, str],
    identity: Identity,
    *,
    clock: Callable[[], float] = time.time,
    **kwargs: Any,
) -> httpx.AsyncClient:
    """An httpx client whose every request carries the call signature."""
    hooks = kwargs.pop("event_hooks", {})
    hooks = {
        **hooks,
        "request": [*hooks.get("request", ()), _signer(grant["token"], identity, clock)],
    }
    kwargs.setdefault("timeout", httpx.Timeout(600.0, connect=30.0))
    return httpx.AsyncClient(event_hooks=hooks, **kwargs)


def kyok_client(
    grant: dict[str, str],
    identity: Identity,
    *,
    clock: Callable[[], float] = time.time,
    **kwargs: Any,
) -> Any:
    """An `openai.AsyncOpenAI` for the grant: base URL funduq's relay, the
    token as its API key, every call signed by `identity` (the agent's
    provider key). No retries of its own: a refused call is an answer."""
    try:
        import openai
    except ImportError as exc:  # pragma: no cover - the extra is documented
        raise ImportError("KYOK's client needs openai: pip install 'funduq-trio[kyok]'") from exc
    kwargs.setdefault("max_retries", 0)
    return openai.AsyncOpenAI(
        api_key=grant["token"],
        base_url=grant["baseUrl"],
        http_client=kyok_http_client(grant, identity, clock=clock),
        **kwargs,
    )


# -- the LLM-provider side ----------------------------------------------------------


class Refusal(Exception):  # noqa: N818 -- the LLM provider's word for it
    """Raised by an offering: it will not serve this completion. `refusal` is
    the object the agent reads in `error.refusal`."""

    def __init__(self, message: str, refusal: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.refusal = refusal if refusal is not None else {"reason": message}


@dataclass(frozen=True)
class CompletionRequest:
    """One `complete` frame, as an offering reads it."""

    id: str
    run_id: str
    agent: dict[str, str]  # {providerKey, name}
    llm: str
    body: dict[str, Any]  # the OpenAI chat-completions request as the agent sent it
    context: dict[str, Any] | None  # the caller's: the agent never saw it
    actor_chain: list[str] | None

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True

    @classmethod
    def from_frame(cls, frame: f.Complete) -> CompletionRequest:
        return cls(
            frame.id,
            frame.run_id,
            frame.agent.model_dump(by_alias=True),
            frame.llm,
            frame.body,
            frame.context,
            frame.actor_chain,
        )


def chunk_text(item: Any) -> str:
    if isinstance(item, str):
        return item
    if isinstance(item, dict):
        return json.dumps(item, separators=(",", ":"))
    raise TypeError(f"an offering yielded {type(item).__name__}, not a str or a dict")


def _last_user_text(body: dict[str, Any]) -> str:
    for message in reversed(body.get("messages") or []):
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
            if isinstance(content, list):
                return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return ""


def fake_answer(body: dict[str, Any]) -> str:
    """What the fake model says: a function of the request's last user text."""
    return f"fake model heard: {_last_user_text(body)}"


async def fake_model(request: CompletionRequest) -> AsyncIterator[dict[str, Any]]:
    """A deterministic OpenAI-compatible model: answers `fake_answer(body)`,
    streamed as one chunk per word (role first, `finish_reason: stop` last),
    or whole as one `chat.completion`."""
    text = fake_answer(request.body)
    model = str(request.body.get("model") or "fake")
    ident = (
        "chatcmpl-"
        + hashlib.sha256(
            json.dumps(request.body, sort_keys=True).encode("utf-8", "surrogatepass")
        ).hexdigest()[:16]
    )
    if not request.stream:
        yield {
            "id": ident,
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": 0,
                "completion_tokens": len(text.split()),
                "total_tokens": len(text.split()),
            },
        }
        return

    def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
        return {
            "id": ident,
            "object": "chat.completion.chunk",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }

    yield chunk({"role": "assistant", "content": ""})
    words = text.split(" ")
    for i, word in enumerate(words):
        yield chunk({"content": word if i == 0 else " " + word})
    yield chunk({}, "stop")


def make_forwarder(
    url: str,
    api_key: str | None,
    *,
    model: str | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    timeout: float = 600.0,
) -> Callable[[CompletionRequest], AsyncIterator[str]]:
    """An offering relaying each completion to the OpenAI-compatible endpoint
    at `url` (`{url}/chat/completions`) with `api_key` as its bearer. Streams
    relay each upstream `data:` event verbatim; a non-streaming answer is the
    one chunk. An upstream error status is a `Refusal` carrying
    `{upstreamStatus, error}`; `model` (optional) overrides the request's."""
    endpoint = url.rstrip("/") + "/chat/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def refuse(response: httpx.Response) -> Refusal:
        raw = await response.aread()
        try:
            error = json.loads(raw).get("error")
        except (ValueError, AttributeError):
            error = raw.decode("utf-8", "replace")[:1000]
        return Refusal(
            f"upstream answered {response.status_code}",
            {"upstreamStatus": response.status_code, "error": error},
        )

    async def forward(request: CompletionRequest) -> AsyncIterator[str]:
        body = dict(request.body)
        if model is not None:
            body["model"] = model
        async with httpx.AsyncClient(transport=transport, timeout=timeout) as client:
            if not request.stream:
                response = await client.post(endpoint, json=body, headers=headers)
                if response.status_code >= 400:
                    raise await refuse(response)
                yield response.text
                return
            async with client.stream("POST", endpoint, json=body, headers=headers) as response:
                if response.status_code >= 400:
                    raise await refuse(response)
                data: list[str] = []
                async for line in response.aiter_lines():
                    if line.startswith("data:"):
                        data.append(line[5:].removeprefix(" "))
                    elif not line and data:
                        event, data = "\n".join(data), []
                        if event == "[DONE]":
                            return
                        yield event
                if data and "\n".join(data) != "[DONE]":
                    yield "\n".join(data)

    forward.__doc__ = f"forwards to {endpoint}"
    return forward


# -- the example agent ----------------------------------------------------------------


def _chat_messages(run_input: RunAgentInput) -> list[dict[str, str]]:
    messages = []
    for message in run_input.messages:
        role = getattr(message, "role", None)
        content = getattr(message, "content", None)
        if role in ("user", "assistant", "system") and isinstance(content, str):
            messages.append({"role": role, "content": content})
    return messages


async def kyok_chat(run_input: RunAgentInput, ctx: Any) -> AsyncIterator[Event]:
    """Answers by asking the LLM its caller opted into (KYOK), streaming the reply."""
    client = ctx.kyok_client()  # raises when the run carries no grant
    message_id = f"{run_input.run_id}-kyok"
    yield RunStartedEvent(thread_id=run_input.thread_id, run_id=run_input.run_id)
    yield TextMessageStartEvent(message_id=message_id, role="assistant")
    try:
        stream = await client.chat.completions.create(
            model="kyok", messages=_chat_messages(run_input), stream=True
        )
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    yield TextMessageContentEvent(message_id=message_id, delta=choice.delta.content)
    finally:
        await client.close()
    yield TextMessageEndEvent(message_id=message_id)
    yield RunFinishedEvent(thread_id=run_input.thread_id, run_id=run_input.run_id)
