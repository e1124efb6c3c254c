"""`POST /kyok/v1/chat/completions`: KYOK's OpenAI-compatible relay (DESIGN §9).

The checks, in DESIGN §9's order, each answered with its status:

1. the bearer token is funduq's and unexpired (401);
2. its run is active, not cancel-requested, and the token's agent's (403);
3. `Funduq-Signature` by the agent's provider key over
   `funduq-kyok-call:{token}:{Funduq-Timestamp}:{sha256hex(body)}`, fresh (401);
4. the body is a JSON object (400);
5. the LLM offering the caller chose is attached (503).

The body is read between check 2 and check 3 (the signature covers it), and
check 2 is made again once it is in: from there to the `complete` frame
leaving nothing awaits, so a cancel accepted while the body was arriving is
refused here, and one accepted later finds the completion registered and
ends it (`broker/kyok.py`).

Then `stream: true` relays each chunk as an SSE `data:` line and ends with
`data: [DONE]`; otherwise the one chunk holding the whole response is
returned as JSON. A failure before any chunk is answered 502 with
`{"error": {..., "refusal"}}` (or the status of why funduq ended it); after a
chunk, the stream's last `data:` line carries the error instead of `[DONE]`.
A reader that goes away abandons the completion.

In a cluster (docs/cluster.md, "KYOK from any node") a call for a run another
node leads is relayed there over the internal route (``kyok_complete``),
which checks it, spends its signature and counts it -- once, there -- and its
answer comes back as it is: status, JSON, or the stream chunk by chunk.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import trio
from quart import Response, request

from ..broker import cluster
from ..broker.funduq import Funduq
from ..broker.kyok import Completion, KyokRefusal
from ..protocol import carriable
from .access import bearer_of
from .sse import SSE_CONTENT_TYPE, SSE_HEADERS

__all__ = ["mount_kyok"]

_LINE_BREAK = re.compile(r"\r\n|\r|\n")
_DONE = b"data: [DONE]\n\n"


def _answer(status: int, body: dict[str, Any]) -> Response:
    return Response(
        json.dumps(body, separators=(",", ":")), status=status, content_type="application/json"
    )


def _refused(refusal: KyokRefusal) -> Response:
    return _answer(refusal.status, refusal.body())


def _request_body(raw: bytes) -> dict[str, Any]:
    """The body as JSON the LLM provider's link can carry (protocol/carriable.py):
    an object, no NaN/Infinity, no lone surrogate, nested at most MAX_NESTING."""
    try:
        body = carriable.loads(raw)
    except (ValueError, RecursionError):  # NotCarriable is a ValueError
        body = None
    if not isinstance(body, dict) or carriable.problem(body) is not None:
        raise KyokRefusal(
            400,
            "invalid_body",
            "the body must be a JSON object (an OpenAI "
            "chat-completions request) the link can carry: no NaN or "
            "Infinity, no lone surrogate, nested at most "
            f"{carriable.MAX_NESTING} deep",
        )
    return body


def _sse_data(data: str) -> bytes:
    """One SSE event carrying `data` verbatim (a line break in it becomes a
    second `data:` line, which a reader joins back with a newline)."""
    lines = _LINE_BREAK.split(data)
    return b"".join(b"data: " + line.encode("utf-8") + b"\n" for line in lines) + b"\n"


async def _next_chunk(completion: Completion) -> str | None:
    """The next chunk, or None once the completion is over. Funduq ending it
    (a cancel) ends the relay at once, without the chunks still buffered."""
    try:
        data = await completion.chunks.receive()
    except trio.EndOfChannel:
        return None
    if completion.outcome is not None and completion.outcome[0] == "stopped":
        return None
    completion.relayed += 1
    return data


def _failure(completion: Completion) -> KyokRefusal:
    """Why a completion that did not complete ended, as the caller reads it."""
    outcome = completion.outcome
    assert outcome is not None
    if outcome[0] == "stopped":
        return outcome[1]
    if outcome[0] == "failed":
        _, message, refusal = outcome
        error = KyokRefusal(
            502, "llm_refused" if refusal is not None else "llm_failed", message, refusal
        )
        return error
    return KyokRefusal(502, "llm_no_response", "the LLM provider ended without a response")


def _error_line(refusal: KyokRefusal) -> bytes:
    body = refusal.body()
    body["error"].setdefault("refusal", None)
    return b"data: " + json.dumps(body, separators=(",", ":")).encode("utf-8") + b"\n\n"


def mount_kyok(app: Any, funduq: Funduq) -> None:
    @app.get("/llms")
    async def llms() -> Response:
        """KYOK's roster: every LLM offering ever published, online or not,
        with its provider's counters."""
        return _answer(200, {"llms": funduq.kyok.roster()})

    @app.post("/kyok/v1/chat/completions")
    async def chat_completions() -> Response:
        headers = request.headers
        return await complete(
            funduq,
            headers.get("Authorization"),
            headers.get("Funduq-Timestamp"),
            headers.get("Funduq-Signature"),
            request.get_data,
        )


async def complete(
    funduq: Funduq,
    authorization: str | None,
    timestamp: str | None,
    signature: str | None,
    read_body: Callable[[], Awaitable[bytes]],
    *,
    forwarded: bool = False,
) -> Response:
    """One completion call, checked and carried out here -- or, for a run
    another node leads (a cluster), relayed to that node, which checks and
    carries it out (``forwarded``: it came that way, and is never sent on)."""
    kyok = funduq.kyok
    try:
        grant = kyok.read_token(bearer_of(authorization))
        if not forwarded:
            leader = await funduq.kyok_leader(grant.run_id)
            if leader is not None:
                raw = await read_body()
                _check_relayable(funduq, raw)
                return await _relay(
                    funduq,
                    leader,
                    {
                        "authorization": authorization,
                        "timestamp": timestamp,
                        "signature": signature,
                        "body": base64.b64encode(raw).decode("ascii"),
                    },
                )
        funduq.kyok_run(grant)
        raw = await read_body()
        run = funduq.kyok_run(grant)
        await kyok.check_signature(run.key, grant.token, timestamp, signature, raw)
        # Nothing awaits from here until the completion is registered.
        # The signature's check awaits where nodes share the record (its
        # spending is written there): the run is looked at again.
        run = funduq.kyok_run(grant)
        body = _request_body(raw)
        completion = kyok.start(
            run.run_id,
            run.offering,
            {
                "runId": run.run_id,
                "agent": {"providerKey": run.key, "name": run.agent},
                "llm": run.offering[1],
                "body": body,
                "context": run.context,
                "actorChain": run.actor_chain,
            },
        )
    except KyokRefusal as refusal:
        return _refused(refusal)
    reader_gone = KyokRefusal(499, "reader_gone", "the agent stopped reading")
    try:
        first = await _next_chunk(completion)
        if body.get("stream") is True:
            return _streaming(completion, first, reader_gone)
        return await _whole(completion, first)
    except BaseException:
        completion.stop(reader_gone)
        raise


async def complete_forwarded(funduq: Funduq, args: dict[str, Any]) -> Response:
    """A completion call another node relayed here (the internal route's
    ``kyok_complete``): checked and carried out as if it had come here, its
    answer marked as the relay's to pass on verbatim."""
    try:
        raw = base64.b64decode(str(args.get("body") or ""), validate=True)
    except ValueError:
        raw = b""

    async def read_body() -> bytes:
        return raw

    def text(name: str) -> str | None:
        value = args.get(name)
        return value if isinstance(value, str) else None

    response = await complete(
        funduq,
        text("authorization"),
        text("timestamp"),
        text("signature"),
        read_body,
        forwarded=True,
    )
    response.headers[cluster.RELAYED_HEADER] = "kyok"
    return response


#: What a relayed call carries besides its body (the token, timestamp and
#: signature, JSON's punctuation), at most.
RELAY_OVERHEAD_BYTES = 4096


def _check_relayable(funduq: Funduq, raw: bytes) -> None:
    """A body the leader's door would take once relayed (base64 makes it a
    third larger), else KyokRefusal 413 -- said here, not as a leader that
    cannot be reached."""
    limit = funduq.settings.max_body_bytes
    if 4 * ((len(raw) + 2) // 3) + RELAY_OVERHEAD_BYTES > limit:
        raise KyokRefusal(
            413,
            "body_too_large_to_relay",
            f"the run is led by another funduq node, and a body of {len(raw)} bytes "
            f"cannot be relayed there within FUNDUQ_MAX_BODY_BYTES ({limit}): at most "
            f"{(limit - RELAY_OVERHEAD_BYTES) * 3 // 4} bytes",
        )


async def _relay(funduq: Funduq, url: str, args: dict[str, Any]) -> Response:
    """Pass a completion call to the node leading its run and its answer --
    status, JSON or the SSE stream as it comes -- back to the agent. A
    leader that cannot be reached: 503 ``thread_led_elsewhere``."""
    assert funduq.forwarder is not None
    funduq.metrics.calls_forwarded += 1
    try:
        answer = await funduq.forwarder.open(url, "kyok_complete", args)
    except cluster.Unreachable as exc:
        return _refused(
            KyokRefusal(
                503,
                "thread_led_elsewhere",
                f"the run is led by another funduq node, which cannot be reached ({exc}); "
                "retry shortly",
            )
        )
    content_type = answer.headers.get("Content-Type", "application/json")
    if not content_type.startswith(SSE_CONTENT_TYPE):
        try:
            content = await answer.aread()
        finally:
            await answer.aclose()
        return Response(content, status=answer.status_code, content_type=content_type)

    async def frames() -> Any:
        try:
            async for chunk in answer.aiter_raw():
                yield chunk
        finally:
            await answer.aclose()

    response = Response(
        frames(), status=answer.status_code, content_type=SSE_CONTENT_TYPE, headers=SSE_HEADERS
    )
    response.timeout = None
    return response


def _streaming(completion: Completion, first: str | None, reader_gone: KyokRefusal) -> Response:
    if first is None and completion.outcome != ("completed",):
        return _answer(*_status_body(_failure(completion)))

    async def frames() -> Any:
        try:
            data = first
            while data is not None:
                yield _sse_data(data)
                data = await _next_chunk(completion)
            if completion.outcome == ("completed",):
                yield _DONE
            else:
                yield _error_line(_failure(completion))
        finally:
            completion.stop(reader_gone)

    response = Response(frames(), status=200, content_type=SSE_CONTENT_TYPE, headers=SSE_HEADERS)
    response.timeout = None
    return response


def _status_body(refusal: KyokRefusal) -> tuple[int, dict[str, Any]]:
    body = refusal.body()
    if refusal.status == 502:
        body["error"].setdefault("refusal", None)
    return refusal.status, body


async def _whole(completion: Completion, first: str | None) -> Response:
    """`stream: false`: exactly one chunk, the whole response, as JSON."""
    if first is None:
        if completion.outcome == ("completed",):
            return _answer(
                502,
                KyokRefusal(
                    502, "llm_no_response", "the LLM provider ended without a response"
                ).body(),
            )
        return _answer(*_status_body(_failure(completion)))
    second = await _next_chunk(completion)
    if second is not None:
        completion.stop(KyokRefusal(502, "llm_bad_response", "more than one chunk"))
        return _answer(
            502,
            KyokRefusal(
                502,
                "llm_bad_response",
                "the LLM provider sent more than one chunk for a non-streaming completion",
            ).body(),
        )
    if completion.outcome != ("completed",):
        return _answer(*_status_body(_failure(completion)))
    try:
        json.loads(first)
    except ValueError:
        return _answer(
            502,
            KyokRefusal(502, "llm_bad_response", "the LLM provider's response is not JSON").body(),
        )
    return Response(first, status=200, content_type="application/json")
