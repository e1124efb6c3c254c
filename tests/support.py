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

`raw_provider(info, ["echo"])` attaches a provider that speaks the DESIGN §5
frames directly over trio-websocket and lets a test play the provider's part
by hand (answer each offer, report events, finish) -- for behaviour the SDK
would hide (pausing, unknown event types, offers left unanswered).

Everything here is deliberately small: tests assert what a caller or provider
can observe (status codes, JSON, SSE events, frames, GET /runs records).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import stores
import trio
from httpx_sse import EventSource
from trio_websocket import ConnectionClosed, WebSocketConnection, open_websocket_url

from funduq_trio.config import Settings
from funduq_trio.identity import Identity, new_nonce, provider_connect_payload
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


def http_client(info: ServerInfo, **kwargs: Any) -> httpx.AsyncClient:
    """An httpx client whose relative URLs go to the running server."""
    kwargs.setdefault("timeout", HTTP_TIMEOUT)
    return httpx.AsyncClient(base_url=info.url, **kwargs)


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
            {"kind": "ok", "id": run["offerId"], "verdict": verdict, "reason": reason,
             "payload": None}
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
