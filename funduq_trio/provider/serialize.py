"""`serialize_per_thread(agent)`: one thread's runs one at a time, in arrival order.

funduq delivers a thread's utterances in order but imposes no turn-taking: a
provider may hold several runs of one conversation at once. An agent that can
only generate one turn per conversation at a time wraps itself in this. The
order is fixed when a run is *accepted* (the runtime calls `admit(ctx)`
synchronously while answering the offer), not when its task happens to start,
so it is the order funduq delivered them in.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from typing import Any

import trio
from ag_ui.core import RunAgentInput

from .runtime import RunContext, _wants_ctx

__all__ = ["serialize_per_thread"]


class serialize_per_thread:
    """Wrap an agent so runs of one thread take turns (FIFO by acceptance)."""

    funduq_wants_ctx = True  # called as (run_input, ctx), whatever the wrapped agent takes

    def __init__(self, agent: Callable[..., Any]) -> None:
        self._agent = agent
        self._agent_wants_ctx = _wants_ctx(agent)
        self._queues: dict[str, deque[str]] = {}
        self._changed: dict[str, trio.Event] = {}
        functools.update_wrapper(self, agent)

    def waiting(self, thread_id: str) -> list[str]:
        """Run ids of this thread held by the wrapper, the running one first."""
        return list(self._queues.get(thread_id, ()))

    # Hooks the runtime calls: admit() while accepting, release() when the run's task ends.
    def admit(self, ctx: RunContext) -> None:
        self._queues.setdefault(ctx.thread_id, deque()).append(ctx.run_id)

    def release(self, ctx: RunContext) -> None:
        queue = self._queues.get(ctx.thread_id)
        if queue is None or ctx.run_id not in queue:
            return
        queue.remove(ctx.run_id)
        if not queue:
            del self._queues[ctx.thread_id]
        changed = self._changed.pop(ctx.thread_id, None)
        if changed is not None:
            changed.set()

    def __call__(self, run_input: RunAgentInput, ctx: RunContext) -> AsyncIterator[Any]:
        return self._take_turn(run_input, ctx)

    async def _take_turn(self, run_input: RunAgentInput, ctx: RunContext) -> AsyncIterator[Any]:
        if ctx.run_id not in self._queues.get(ctx.thread_id, ()):
            self.admit(ctx)  # called outside a Provider: take a place now
        try:
            while self._queues[ctx.thread_id][0] != ctx.run_id:
                await self._changed.setdefault(ctx.thread_id, trio.Event()).wait()
            args = (run_input, ctx) if self._agent_wants_ctx else (run_input,)
            async with aclosing(self._agent(*args)) as events:
                async for event in events:
                    yield event
        finally:
            self.release(ctx)
