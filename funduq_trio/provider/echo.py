"""The example agent: streams the user's last message back as text deltas.

Its events: RUN_STARTED, TEXT_MESSAGE_START, `deltas` TEXT_MESSAGE_CONTENT,
TEXT_MESSAGE_END, RUN_FINISHED — so `make_echo(deltas=8)` produces exactly 12
events per run whatever the message (a text shorter than `deltas` characters
yields some empty deltas, which AG-UI allows).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import trio
from ag_ui.core import (
    Event,
    RunAgentInput,
    RunFinishedEvent,
    RunStartedEvent,
    TextMessageContentEvent,
    TextMessageEndEvent,
    TextMessageStartEvent,
)

__all__ = ["echo", "last_user_text", "make_echo", "split_text"]


def last_user_text(run_input: RunAgentInput) -> str:
    """The text of the last user message (text parts joined), or ''."""
    for message in reversed(run_input.messages):
        if getattr(message, "role", None) != "user":
            continue
        content: Any = getattr(message, "content", "")
        if isinstance(content, str):
            return content
        return "".join(getattr(part, "text", "") or "" for part in content or ())
    return ""


def split_text(text: str, pieces: int) -> list[str]:
    """`text` cut into exactly `pieces` consecutive parts (some may be empty)."""
    pieces = max(1, pieces)
    size, extra = divmod(len(text), pieces)
    parts, start = [], 0
    for i in range(pieces):
        end = start + size + (1 if i < extra else 0)
        parts.append(text[start:end])
        start = end
    return parts


def make_echo(deltas: int = 3, *, delay: float = 0.0) -> Callable[..., AsyncIterator[Event]]:
    """An echo agent sending `deltas` content events (optionally `delay`
    seconds apart, trio time)."""

    async def echo(run_input: RunAgentInput) -> AsyncIterator[Event]:
        """Streams your last message back to you."""
        message_id = f"{run_input.run_id}-echo"
        yield RunStartedEvent(thread_id=run_input.thread_id, run_id=run_input.run_id)
        yield TextMessageStartEvent(message_id=message_id, role="assistant")
        for part in split_text(last_user_text(run_input), deltas):
            if delay:
                await trio.sleep(delay)
            yield TextMessageContentEvent(message_id=message_id, delta=part)
        yield TextMessageEndEvent(message_id=message_id)
        yield RunFinishedEvent(thread_id=run_input.thread_id, run_id=run_input.run_id)

    return echo


echo = make_echo()
