"""What can be said to a run: the messages its lane's memory channel carries.

The lane is the only reader. Everyone else -- the provider link, the doors,
the thread queue, the provider registry -- only sends it what happened, and
the lane applies those facts one at a time, in channel order. The channel
itself is an ``Inbox`` (below).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Generic, NamedTuple, TypeVar

import outcome
import trio
from trio.lowlevel import Abort, RaiseCancelT

T = TypeVar("T")


@dataclass(slots=True)
class Turn:
    """You are now the head of your thread's pending queue."""


@dataclass(slots=True)
class Wake:
    """Something changed for your agent: a place freed, a provider attached,
    (re)published or left. Look again. ``baton``: you were woken for a freed
    place, and must pass it on if you do not use it."""

    baton: bool = False


@dataclass(slots=True)
class Cancel:
    """A caller asked to stop the run. ``seen`` is set once the lane read it;
    ``refused`` too when the run had ended before the lane got to it.
    ``record`` is the run as the lane left it right after applying the cancel
    (None when the lane lacks the whole record): the caller's answer, which a
    finish read a moment later must not overtake."""

    by: str | None = None
    seen: trio.Event = field(default_factory=trio.Event)
    refused: bool = False
    record: dict[str, Any] | None = None

    def refuse(self) -> None:
        self.refused = True
        self.seen.set()

    def applied(self, record: dict[str, Any] | None) -> None:
        self.record = copy.deepcopy(record)
        self.seen.set()


@dataclass(slots=True)
class Report:
    """An event the provider holding the run reported (not yet validated)."""

    event: Any


@dataclass(slots=True)
class Finish:
    """The provider says the run's stream ended."""


@dataclass(slots=True)
class Gone:
    """The provider holding the run stopped serving (link closed or withdrawn)."""


Message = Turn | Wake | Cancel | Report | Finish | Gone


#: An inbox drops what its reader took once that is this many messages and
#: half its list.
COMPACT_AFTER = 64


class InboxStatistics(NamedTuple):
    """As trio's ``MemoryChannelStatistics``, for what an inbox can say."""

    current_buffer_used: int
    tasks_waiting_receive: int


class Inbox(trio.abc.SendChannel[T], trio.abc.ReceiveChannel[T], Generic[T]):
    """A lane's memory channel: unbounded, many senders, one reader, both
    ends one object. It keeps trio's memory channel semantics for what a
    lane does with it (``send_nowait``; ``receive`` a checkpoint whether or
    not a message waits, cancellable while it waits; the reader's ``close``
    drops what is unread and breaks the senders' side) at a fraction of the
    memory: trio's allocates a deque, two ordered dicts and two sets per
    channel, which a broker holding ten thousand waiting runs pays ten
    thousand times (bench/README.md, "What an open stream holds")."""

    __slots__ = ("_items", "_head", "_reader", "_closed")

    def __init__(self) -> None:
        # A list read from ``_head`` on: popping its front would move the rest.
        self._items: list[T] = []
        self._head = 0
        self._reader: trio.lowlevel.Task | None = None
        self._closed = False

    def send_nowait(self, value: T) -> None:
        if self._closed:
            raise trio.BrokenResourceError
        reader = self._reader
        if reader is not None:
            self._reader = None
            trio.lowlevel.reschedule(reader, outcome.Value(value))
        else:
            self._items.append(value)

    async def send(self, value: T) -> None:
        await trio.lowlevel.checkpoint_if_cancelled()
        self.send_nowait(value)
        await trio.lowlevel.cancel_shielded_checkpoint()

    def receive_nowait(self) -> T:
        if self._closed:
            raise trio.ClosedResourceError
        if self._head == len(self._items):
            raise trio.WouldBlock
        return self.take_nowait()  # type: ignore[return-value]  # one waits: not None

    def waiting(self) -> bool:
        """A message waits to be read (``receive`` would return at once)."""
        return self._head < len(self._items) and not self._closed

    def take_nowait(self) -> T | None:
        """``receive_nowait`` without its exceptions, for the reader's loops:
        None when nothing waits or the inbox is closed (messages are never
        None)."""
        items = self._items
        head = self._head
        if self._closed or head == len(items):
            return None
        value = items[head]
        head += 1
        if head == len(items):
            items.clear()
            head = 0
        elif head >= COMPACT_AFTER and 2 * head >= len(items):
            # A lane that never quite catches up never empties the list:
            # what it read goes, at most half the list's length at a time.
            del items[:head]
            head = 0
        else:
            items[head - 1] = None  # type: ignore[assignment]  # not held once read
        self._head = head
        return value

    async def receive(self) -> T:
        await trio.lowlevel.checkpoint_if_cancelled()
        # Asked before taking, not by catching WouldBlock: an exception passing
        # through this frame would leave it materialized while the lane waits.
        if self._closed or self._head < len(self._items):
            value = self.receive_nowait()
            await trio.lowlevel.cancel_shielded_checkpoint()
            return value
        if self._reader is not None:
            raise trio.BusyResourceError("an inbox has one reader")
        self._reader = trio.lowlevel.current_task()
        return await trio.lowlevel.wait_task_rescheduled(self._abort)  # type: ignore[no-any-return]

    def _abort(self, _: RaiseCancelT) -> Abort:
        self._reader = None
        return Abort.SUCCEEDED

    def statistics(self) -> InboxStatistics:
        return InboxStatistics(len(self._items) - self._head, int(self._reader is not None))

    def close(self) -> None:
        """The reader is done: what is unread is dropped, and a send now
        raises ``BrokenResourceError``."""
        self._closed = True
        self._items = []
        self._head = 0
        reader, self._reader = self._reader, None
        if reader is not None:
            trio.lowlevel.reschedule(reader, outcome.Error(trio.ClosedResourceError()))

    async def aclose(self) -> None:
        self.close()
        await trio.lowlevel.checkpoint()
