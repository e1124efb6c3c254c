"""Shared test helpers: a real server on a loopback port, and real clients.

    async with running_server(tmp_path, thread_queue_limit=2) as info:
        async with http_client(info) as http:
            r = await http.get("/healthz")

`running_server` starts `funduq_trio.server.serve` in a nursery on 127.0.0.1,
port 0 (any free port), with `data_dir=tmp_path`, yields its `ServerInfo`
(`url`, `port`, `funduq`, `provider_url`, `agui_url(...)`, `a2a_url(...)`) and
cancels the server at exit. Keyword arguments override `Settings` fields.

`sse_events(response)` reads an httpx streaming response as SSE and yields each
event's JSON; `post_sse` posts and reads a whole stream.

`sdk_provider(info)` attaches the SDK's `Provider` serving the example echo
agent (or the agents you pass), started once its agents are published.

`chain(alice, bob)` makes an actor chain the test clients present: the
clients of `http_client` (and any made with `PresentingTransport`) add the
chain's `presenter` proof, signed by its last hop, to every request carrying a
chain without one (DESIGN §8), unless the request has the `UNPRESENTED`
header (which is removed before it is sent). `read_proof(signer, thread_id)`
is a `Funduq-Proof` header value.

`raw_provider(info, ["echo"])` attaches a provider that speaks the DESIGN §5
frames directly over trio-websocket and lets a test play the provider's part
by hand (answer each offer, report events, finish) -- for behaviour the SDK
would hide (pausing, unknown event types, offers left unanswered).

Everything here is deliberately small: tests assert what a caller or provider
can observe (status codes, JSON, SSE events, frames, GET /runs records).
"""

from __future__ import annotations

import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import stores
import trio
from httpx_sse import EventSource
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    WebSocketConnection,
    open_websocket_url,
)

from funduq_trio.config import Settings
from funduq_trio.identity import (
    Identity,
    make_hop,
    new_nonce,
    present_payload,
    provider_connect_payload,
    read_payload,
)
from funduq_trio.provider import Provider, echo
from funduq_trio.server import ServerInfo, serve

# A safety net against a hung test, never a behaviour clock.
HTTP_TIMEOUT = 30.0


@contextlib.asynccontextmanager
async def running_server(tmp_path: Path, **overrides: Any) -> AsyncIterator[ServerInfo]:
    overrides.setdefault("database_url", stores.database_url)  # this test's store
    settings = Settings(host="127.0.0.1", port=0, data_dir=Path(tmp_path)).replace(**overrides)
    async with trio.open_nursery() as nursery:
        info: ServerInfo = await nursery.start(serve, settings)
        try:
            yield info
        finally:
            nursery.cancel_scope.cancel()


async def refused_handshake(url: str) -> ConnectionRejected:
    """Open a websocket to `url` whose handshake the server refuses: the refusal."""
    refused: BaseException | None = None
    try:
        async with open_websocket_url(url):
            pass  # pragma: no cover - the handshake is refused
    except BaseException as exc:  # noqa: BLE001 -- unwrapped and checked below
        refused = exc
    # Older trio-websocket releases raise it inside a nursery's group.
    while isinstance(refused, BaseExceptionGroup) and len(refused.exceptions) == 1:
        refused = refused.exceptions[0]
    assert isinstance(refused, ConnectionRejected), refused
    return refused


def http_client(info: ServerInfo, **kwargs: Any) -> httpx.AsyncClient:
    """An httpx client whose relative URLs go to the running server, and which
    presents the chains `chain()` made (see PresentingTransport)."""
    kwargs.setdefault("timeout", HTTP_TIMEOUT)
    kwargs.setdefault("transport", PresentingTransport())
    return httpx.AsyncClient(base_url=info.url, **kwargs)


# -- presented chains and read proofs (DESIGN §8) -----------------------------

#: Every key that signed a hop of a `chain()`, so its chain can be presented.
_SIGNERS: dict[str, Identity] = {}

#: A request header that asks PresentingTransport to leave the body alone.
UNPRESENTED = "X-Test-Unpresented"


def chain(*signers: Identity) -> list[str]:
    """An actor chain of `signers`, hop 0 first, that test clients present."""
    hops: list[str] = []
    for signer in signers:
        _SIGNERS[signer.public_key_hex] = signer
        hops.append(make_hop(signer, hops[-1] if hops else None))
    return hops


def presenter(
    signer: Identity, provider_key: str, agent: str, message_id: str, timestamp: Any = None
) -> dict[str, Any]:
    """`{timestamp, signature}`: `signer` presents its chain to one agent with one message."""
    ts = int(time.time()) if timestamp is None else timestamp
    return {
        "timestamp": ts,
        "signature": signer.sign(present_payload(provider_key, agent, message_id, ts)),
    }


def operator_headers(info: ServerInfo) -> dict[str, str]:
    """The operator's `Authorization` header: reads everything (DESIGN §8)."""
    return {"Authorization": f"Bearer {info.funduq.operator_token}"}


def read_proof(signer: Identity, thread_id: str, timestamp: Any = None) -> str:
    """A `Funduq-Proof` header value: `signer` reads `thread_id` ("" = a listing)."""
    ts = int(time.time()) if timestamp is None else timestamp
    return f"{signer.public_key_hex}:{ts}:{signer.sign(read_payload(thread_id, ts))}"


def last_hop_key(hops: list[str]) -> str | None:
    try:
        claims = hops[-1].split(".")[1]
        return json.loads(base64.urlsafe_b64decode(claims + "=" * (-len(claims) % 4)))[
            "actorPublicKey"
        ]
    except (AttributeError, IndexError, KeyError, TypeError, ValueError, RecursionError):
        return None


class PresentingTransport(httpx.AsyncBaseTransport):
    """Plays a caller's part a test would otherwise repeat at every call: a
    POST to a door whose request-level metadata (A2A `params.metadata`,
    AG-UI `forwardedProps`) carries a `chain()`'s chain and no `presenter`
    gets the presenter its last hop signs for this agent and message."""

    def __init__(self, inner: httpx.AsyncBaseTransport | None = None) -> None:
        self._inner = inner or httpx.AsyncHTTPTransport()
        self._keys: dict[str, str] = {}

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if UNPRESENTED in request.headers:
            del request.headers[UNPRESENTED]
        elif request.method == "POST":
            request = await self._present(request)
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()

    async def _provider_key(self, request: httpx.Request, provider: str) -> str | None:
        if len(provider) == 64:
            return provider
        if provider not in self._keys:
            roster = await self._inner.handle_async_request(
                httpx.Request("GET", request.url.copy_with(path="/agents", query=None))
            )
            await roster.aread()
            for agent in json.loads(roster.content)["agents"]:
                self._keys[agent["fingerprint"]] = agent["provider"]
        return self._keys.get(provider)

    async def _present(self, request: httpx.Request) -> httpx.Request:
        parts = request.url.path.strip("/").split("/")
        if len(parts) != 3 or parts[0] not in ("a2a", "agui"):
            return request
        content = await request.aread()
        if b"actorChain" not in content:
            return request  # bodies tests make hostile on purpose stay as they are
        try:
            body = json.loads(content)
        except (ValueError, RecursionError):
            return request
        if not isinstance(body, dict):
            return request
        if parts[0] == "a2a":
            params = body.get("params")
            params = params if isinstance(params, dict) else {}
            metadata = params.get("metadata")
            message = params.get("message")
            message_id = message.get("messageId", "") if isinstance(message, dict) else ""
        else:
            metadata = body.get("forwardedProps")
            messages = body.get("messages")
            message_id = (
                messages[-1].get("id", "")
                if isinstance(messages, list) and messages and isinstance(messages[-1], dict)
                else ""
            )
        if not isinstance(metadata, dict) or "presenter" in metadata:
            return request
        hops = metadata.get("actorChain")
        signer = _SIGNERS.get(last_hop_key(hops)) if isinstance(hops, list) and hops else None
        key = await self._provider_key(request, parts[1]) if signer else None
        if signer is None or key is None:
            return request
        metadata["presenter"] = presenter(signer, key, parts[2], message_id)
        headers = [(k, v) for k, v in request.headers.raw if k.lower() != b"content-length"]
        return httpx.Request(
            request.method,
            request.url,
            headers=headers,
            content=json.dumps(body).encode(),
            extensions=request.extensions,
        )


async def sse_events(response: httpx.Response) -> AsyncIterator[dict[str, Any]]:
    """Each SSE event's `data` parsed as JSON, as the server sends them."""
    async for sse in EventSource(response).aiter_sse():
        yield json.loads(sse.data)


async def post_sse(
    http: httpx.AsyncClient, url: str, body: Any
) -> tuple[httpx.Response, list[dict[str, Any]]]:
    """POST `body` and read the whole SSE stream (or the error body)."""
    async with http.stream("POST", url, json=body) as response:
        if response.headers.get("content-type", "").startswith("text/event-stream"):
            return response, [event async for event in sse_events(response)]
        await response.aread()
        return response, []


@contextlib.asynccontextmanager
async def sdk_provider(
    info: ServerInfo, agents: dict[str, Any] | None = None, **options: Any
) -> AsyncIterator[Provider]:
    """The SDK's provider serving `agents` ({name: agent function}; default the
    example echo), attached and published; detached at exit."""
    provider = Provider(Identity.generate(), info.provider_url, **options)
    for name, agent in (agents or {"echo": echo}).items():
        provider.add_agent(agent, name=name)
    async with trio.open_nursery() as nursery:
        await nursery.start(provider.run)
        yield provider
        nursery.cancel_scope.cancel()


class RawProvider:
    """A provider played by hand over the real link (see `raw_provider`)."""

    def __init__(self, ws: WebSocketConnection, identity: Identity) -> None:
        self.ws = ws
        self.identity = identity
        self.key = identity.public_key_hex
        self.fingerprint = identity.fingerprint
        self._offers_in, self.offers = trio.open_memory_channel[dict[str, Any]](100)
        self._cancels_in, self.cancels = trio.open_memory_channel[str](100)
        self._replies: dict[str, dict[str, Any]] = {}
        self._replied = trio.Event()
        self._ids = 0
        self.hello: dict[str, Any] = {}
        self.kinds: list[str] = []  # each message's kind, "batch" included

    async def send(self, frame: dict[str, Any]) -> None:
        await self.ws.send_message(json.dumps(frame))

    async def _receive_loop(self) -> None:
        while True:
            try:
                text = await self.ws.get_message()
            except ConnectionClosed:
                return
            message = json.loads(text)
            self.kinds.append(message.get("kind"))
            for frame in message["frames"] if message.get("kind") == "batch" else [message]:
                await self._take(frame)

    async def _take(self, frame: dict[str, Any]) -> None:
        kind = frame.get("kind")
        if kind == "offer":
            await self._offers_in.send(frame)
        elif kind == "cancel":
            await self._cancels_in.send(frame["runId"])
        elif kind in ("ok", "err"):
            self._replies[frame["id"]] = frame
            self._replied.set()
            self._replied = trio.Event()

    async def request(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Send a frame with a fresh `id`; return funduq's `ok`/`err` for it."""
        self._ids += 1
        frame = {**frame, "id": f"req-{self._ids}"}
        await self.send(frame)
        while frame["id"] not in self._replies:
            await self._replied.wait()
        return self._replies.pop(frame["id"])

    async def register(self, agents: list[str]) -> None:
        reply = await self.request(
            {
                "kind": "register",
                "agents": [
                    {"name": name, "description": f"{name} (test)", "card": None, "metadata": None}
                    for name in agents
                ],
            }
        )
        assert reply["kind"] == "ok", reply

    async def next_offer(self) -> dict[str, Any]:
        """The next `offer` frame's `run`, with the offer's id as `offerId`."""
        frame = await self.offers.receive()
        return {**frame["run"], "offerId": frame["id"]}

    async def answer(self, run: dict[str, Any], verdict: str, reason: str | None = None) -> None:
        await self.send(
            {
                "kind": "ok",
                "id": run["offerId"],
                "verdict": verdict,
                "reason": reason,
                "payload": None,
            }
        )

    async def report(self, run_id: str, event: dict[str, Any]) -> None:
        await self.send({"kind": "report", "runId": run_id, "event": event, "seq": None})

    async def finish(self, run_id: str) -> None:
        await self.send({"kind": "finish", "runId": run_id})

    async def play(self, run: dict[str, Any], events: list[dict[str, Any]]) -> None:
        """Report `events` for an offered run already accepted, then finish it."""
        for event in events:
            await self.report(run["runId"], event)
        await self.finish(run["runId"])


@contextlib.asynccontextmanager
async def raw_provider(
    info: ServerInfo,
    agents: list[str] | tuple[str, ...] = ("echo",),
    *,
    max_concurrent_runs: int | None = None,
    identity: Identity | None = None,
    extensions: list[str] | None = None,
) -> AsyncIterator[RawProvider]:
    """Attach a hand-played provider serving `agents`; detach (close the link)
    at exit. `extensions` goes in its connect (["batch"]: funduq may batch)."""
    identity = identity or Identity.generate()
    async with open_websocket_url(info.provider_url) as ws:
        hello = json.loads(await ws.get_message())
        assert hello["kind"] == "hello", hello
        nonce = new_nonce()
        payload = provider_connect_payload(hello["funduqKey"], hello["nonce"], nonce)
        await ws.send_message(
            json.dumps(
                {
                    "kind": "connect",
                    "publicKey": identity.public_key_hex,
                    "nonce": nonce,
                    "proof": identity.sign(payload),
                    "maxConcurrentRuns": max_concurrent_runs,
                    "extensions": extensions,
                }
            )
        )
        answer = json.loads(await ws.get_message())
        assert answer["kind"] == "connect.ok", answer
        provider = RawProvider(ws, identity)
        provider.hello = hello
        async with trio.open_nursery() as nursery:
            nursery.start_soon(provider._receive_loop)
            await provider.register(list(agents))
            yield provider
            nursery.cancel_scope.cancel()


def user_input(text: str = "hi", *, thread_id: str = "caller-thread", **extra: Any) -> dict:
    """A minimal AG-UI RunAgentInput (camelCase JSON) with one user message."""
    return {
        "threadId": thread_id,
        "runId": "caller-run",
        "messages": [{"id": f"msg-{text}", "role": "user", "content": text}],
        **extra,
    }
