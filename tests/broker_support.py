"""Helpers for the broker's own tests: a Funduq on a real SQLite file and an
in-process provider link that records what the broker asked of it.

The in-process link is a fake of the WebSocket shell only; the record, the
lanes and the registry under test are the real ones. Capabilities that cross
the network are proven again in the tests that drive the real server.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import trio

from funduq_trio.broker.funduq import Funduq
from funduq_trio.config import Settings
from funduq_trio.identity import Identity

AGENT = "echo"


@dataclass
class FakeLink:
    """Records offers and cancels the broker sends; lets a test answer them."""

    offers: list[tuple[str, dict[str, Any]]] = field(default_factory=list)
    cancels: list[str] = field(default_factory=list)
    closed: str | None = None
    offered: trio.Event = field(default_factory=trio.Event)

    def send_offer(self, offer_id: str, run: dict[str, Any]) -> None:
        self.offers.append((offer_id, run))
        self.offered.set()
        self.offered = trio.Event()

    def send_cancel(self, run_id: str) -> None:
        self.cancels.append(run_id)

    def close(self, reason: str) -> None:
        self.closed = reason

    async def next_offer(self, after: int) -> tuple[str, dict[str, Any]]:
        """Wait until more than ``after`` offers were made; return offer #after."""
        while len(self.offers) <= after:
            await self.offered.wait()
        return self.offers[after]


class Provider:
    """A provider attached through the broker's port, with a fake link."""

    def __init__(self, funduq: Funduq, identity: Identity | None = None,
                 max_concurrent: int | None = None) -> None:
        self.funduq = funduq
        self.identity = identity or Identity.generate()
        self.max_concurrent = max_concurrent
        self.link = FakeLink()
        self.session = None

    @property
    def key(self) -> str:
        return self.identity.public_key_hex

    async def attach(self, *agents: str) -> "Provider":
        self.link = FakeLink()
        self.session = self.funduq.attach_provider(self.key, self.max_concurrent, self.link)
        await self.session.register(
            [{"name": a, "description": f"{a} agent", "card": {}, "metadata": {}}
             for a in (agents or (AGENT,))])
        return self

    async def offer(self, n: int) -> tuple[str, dict[str, Any]]:
        return await self.link.next_offer(n)

    def stream(self, run_id: str, *events: dict[str, Any], finish: bool = True) -> None:
        for event in events:
            assert self.session.report(run_id, event)
        if finish:
            assert self.session.finish(run_id)


def user_input(text: str = "hello", message_id: str = "m1") -> dict[str, Any]:
    return {"threadId": "caller-thread", "runId": "caller-run",
            "messages": [{"id": message_id, "role": "user", "content": text}]}


def reply(run_id: str, thread_id: str, text: str = "hi", deltas: int = 1) -> list[dict[str, Any]]:
    events = [{"type": "RUN_STARTED", "threadId": thread_id, "runId": run_id},
              {"type": "TEXT_MESSAGE_START", "messageId": "r-" + run_id, "role": "assistant"}]
    events += [{"type": "TEXT_MESSAGE_CONTENT", "messageId": "r-" + run_id, "delta": text}
               for _ in range(deltas)]
    events += [{"type": "TEXT_MESSAGE_END", "messageId": "r-" + run_id},
               {"type": "RUN_FINISHED", "threadId": thread_id, "runId": run_id}]
    return events


@contextlib.asynccontextmanager
async def broker(tmp_path: Path, **overrides: Any) -> AsyncIterator[Funduq]:
    settings = Settings(data_dir=tmp_path, **overrides)
    async with Funduq(settings) as funduq:
        yield funduq


async def settled(funduq: Funduq, run_id: str) -> dict[str, Any]:
    return await funduq.wait_run(run_id)
