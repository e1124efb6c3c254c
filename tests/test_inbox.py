"""A lane's inbox keeps trio's memory channel semantics for what a lane does
with it: first in, first out; a receive is a checkpoint; a cancelled receive
loses nothing; the reader's close drops what is unread and breaks senders."""

import pytest
import trio
import trio.testing

from funduq_trio.broker.inbox import Inbox


async def test_messages_come_out_in_the_order_they_went_in() -> None:
    inbox: Inbox[int] = Inbox()
    for n in range(5):
        inbox.send_nowait(n)
    assert [await inbox.receive() for _ in range(3)] == [0, 1, 2]
    inbox.send_nowait(5)
    assert [inbox.receive_nowait() for _ in range(3)] == [3, 4, 5]
    with pytest.raises(trio.WouldBlock):
        inbox.receive_nowait()
    assert inbox.statistics().current_buffer_used == 0


async def test_a_waiting_reader_gets_what_is_sent_next() -> None:
    inbox: Inbox[str] = Inbox()
    got: list[str] = []

    async def read() -> None:
        got.append(await inbox.receive())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(read)
        await trio.testing.wait_all_tasks_blocked()
        assert inbox.statistics().tasks_waiting_receive == 1
        inbox.send_nowait("turn")
    assert got == ["turn"]
    assert inbox.statistics().current_buffer_used == 0


async def test_a_receive_is_a_checkpoint_even_with_a_message_waiting() -> None:
    inbox: Inbox[str] = Inbox()
    inbox.send_nowait("wake")
    with trio.CancelScope() as scope:
        scope.cancel()
        await inbox.receive()
    assert scope.cancelled_caught
    assert await inbox.receive() == "wake"  # nothing was taken by the cancelled receive


async def test_a_cancelled_wait_loses_nothing(autojump_clock: trio.testing.MockClock) -> None:
    inbox: Inbox[str] = Inbox()
    with trio.move_on_after(0.01):
        await inbox.receive()
    assert inbox.statistics().tasks_waiting_receive == 0
    inbox.send_nowait("cancel")
    assert await inbox.receive() == "cancel"


async def test_the_readers_close_drops_what_is_unread_and_breaks_senders() -> None:
    inbox: Inbox[str] = Inbox()
    inbox.send_nowait("report")
    inbox.close()
    with pytest.raises(trio.BrokenResourceError):
        inbox.send_nowait("late")
    with pytest.raises(trio.ClosedResourceError):
        inbox.receive_nowait()
    with pytest.raises(trio.ClosedResourceError):
        await inbox.receive()


async def test_a_reader_that_never_catches_up_keeps_order_and_not_what_it_read() -> None:
    inbox: Inbox[int] = Inbox()
    sent = received = 0
    for _ in range(1000):  # two in, one out: the inbox never empties
        inbox.send_nowait(sent)
        inbox.send_nowait(sent + 1)
        sent += 2
        assert inbox.receive_nowait() == received
        received += 1
    assert inbox.statistics().current_buffer_used == sent - received
    assert len(inbox._items) < 2 * (sent - received)  # what was read is not kept
    while received < sent:
        assert await inbox.receive() == received
        received += 1


def test_take_nowait_and_waiting_answer_as_receive_nowait() -> None:
    """The lane's exception-free reads (``take_nowait``, ``waiting``) say
    what ``receive_nowait`` says, across the list's compaction."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.tuples(st.sampled_from(["send", "take", "receive"]), st.integers(1, 90))))
    def check(steps: list[tuple[str, int]]) -> None:
        a: Inbox[int] = Inbox()
        b: Inbox[int] = Inbox()
        n = 0
        for op, count in steps:
            for _ in range(count):
                if op == "send":
                    a.send_nowait(n)
                    b.send_nowait(n)
                    n += 1
                    continue
                assert a.waiting() == (b.statistics().current_buffer_used > 0)
                try:
                    expected: int | None = b.receive_nowait()
                except trio.WouldBlock:
                    expected = None
                got = a.take_nowait() if op == "take" else _receive_or_none(a)
                assert got == expected
                assert a.statistics() == b.statistics()
        a.close()
        assert a.take_nowait() is None and not a.waiting()

    check()


def _receive_or_none(inbox: Inbox[int]) -> int | None:
    try:
        return inbox.receive_nowait()
    except trio.WouldBlock:
        return None
