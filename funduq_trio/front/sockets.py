"""The front's socket calls: a non-blocking stdlib socket and trio's waits.

trio's `SocketStream` puts a conflict detector, a method wrapper and a
context manager around each call, and its lock-free send needs a lock
around it once two tasks may write (an SSE keepalive beside a burst). A
connection here reads and writes often and briefly (a request, its answer,
every websocket message), so each call is the syscall, trio's wait when the
kernel says "would block", and the one checkpoint trio's rules ask of every
async call (bench/README.md: 21 -> 9 us a read on a busy host).
"""

from __future__ import annotations

import errno
import logging
import select
import socket
from collections.abc import Callable

import trio
from trio.lowlevel import (
    cancel_shielded_checkpoint,
    checkpoint_if_cancelled,
    wait_readable,
    wait_writable,
)

log = logging.getLogger("funduq_trio.server")

#: One socket read. Large enough that a burst of pipelined requests or
#: websocket frames is parsed in one step.
READ_BYTES = 65536

#: accept() errors that mean "out of a resource": wait a little and go on,
#: rather than spin or stop serving (trio's serve_listeners does the same).
_OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.ENOBUFS}
OUT_OF_RESOURCES_PAUSE = 0.1


async def read(sock: socket.socket) -> bytes:
    """The next bytes `sock` has, b"" at its end (or when it is reset)."""
    await checkpoint_if_cancelled()
    data = read_now(sock)
    if data is not None:
        await cancel_shielded_checkpoint()
        return data
    return await read_when_ready(sock)


def read_now(sock: socket.socket) -> bytes | None:
    """The bytes `sock` has now, b"" at its end (or when it is reset); None
    when it has none yet. No checkpoint: `read` is this and trio's."""
    try:
        return sock.recv(READ_BYTES)
    except BlockingIOError:
        return None  # out of the except at once: no traceback held by a wait
    except OSError:
        return b""


async def read_when_ready(sock: socket.socket) -> bytes:
    """`read` once `read_now` found nothing: wait for the next bytes (the
    wait is the checkpoint)."""
    while True:
        await wait_readable(sock)
        data = read_now(sock)
        if data is not None:
            return data


async def write_all(sock: socket.socket, data: bytes) -> bool:
    """Write all of `data`; False if the peer is gone. Cancelled half way, the
    connection cannot be used again (the caller marks it so)."""
    await checkpoint_if_cancelled()
    try:
        sent = sock.send(data)
    except BlockingIOError:
        sent = 0
    except OSError:
        return False
    if sent == len(data):
        await cancel_shielded_checkpoint()
        return True
    view = memoryview(data)
    while sent < len(data):
        await wait_writable(sock)
        try:
            sent += sock.send(view[sent:])
        except BlockingIOError:
            continue
        except OSError:
            return False
    return True


def send_some(sock: socket.socket, data: bytes) -> int | None:
    """One non-blocking send: how many bytes of `data` the kernel took
    (0 when its buffer is full), None if the peer is gone."""
    try:
        return sock.send(data)
    except BlockingIOError:
        return 0
    except OSError:
        return None


def close(sock: socket.socket) -> None:
    """Close `sock`, waking any task still waiting on it (trio's rule)."""
    trio.lowlevel.notify_closing(sock)
    sock.close()


async def accept_forever(
    listening: socket.socket,
    take: Callable[[socket.socket, tuple[str, int] | None], None],
) -> None:
    """Hand every connection `listening` gets to `take` (which starts its
    task, or refuses it). Runs until cancelled."""
    listening.setblocking(False)
    while True:
        await wait_readable(listening)
        try:
            sock, address = listening.accept()
        except BlockingIOError:
            continue  # another accept took it, or the caller gave up
        except OSError as exc:
            if exc.errno in _OUT_OF_RESOURCES:
                log.error("cannot accept a connection (%s); pausing", exc.strerror)
                await trio.sleep(OUT_OF_RESOURCES_PAUSE)
                continue
            if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                continue  # that one connection's trouble
            raise
        sock.setblocking(False)
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        peer = (str(address[0]), int(address[1])) if isinstance(address, tuple) else None
        take(sock, peer)


def refuse_at_once(sock: socket.socket, answer: bytes) -> None:
    """Write `answer` (short: it fits the kernel's buffer) and close, without
    waiting for anything. What the peer already sent (one read's worth) is
    dropped first: closing on unread bytes would reset the connection, and
    the peer could lose the answer."""
    try:
        sock.send(answer)
        sock.shutdown(socket.SHUT_WR)
        sock.recv(READ_BYTES)
    except OSError:  # BlockingIOError included: nothing (more) has come
        pass
    finally:
        sock.close()


class Hangups:
    """One task's watch over the connections of every response that waits
    long (an SSE stream whose run is queued, a blocking SendMessage): when a
    caller goes, its callback runs (`web/sse.py` then ends the stream's
    wait, `web/asgi_doors.py` the door's).

    A task per watched connection, waiting on its socket, is a task, a
    nursery, trio's wait and a deadline per waiting stream (~5 KiB,
    bench/README.md). Here the sockets are registered in one epoll set of
    their own, and one task waits for that set to be readable (trio waits on
    the set's descriptor as on any other): a watched connection costs an
    entry in the set and in a dict. Only the caller's end is watched
    (EPOLLRDHUP, and the hang-ups and errors epoll always reports): bytes it
    sends meanwhile (a pipelined request) stay in the kernel for the
    connection to read once its response is done.

    Linux only (`available`); elsewhere no connection offers the hang-up
    extension and streams watch `receive` with a task, as under any server."""

    available = hasattr(select, "epoll") and hasattr(select, "EPOLLRDHUP")

    def __init__(self) -> None:
        self._set = select.epoll()
        self._callbacks: dict[int, Callable[[], None]] = {}

    def watch(self, sock: socket.socket, callback: Callable[[], None]) -> None:
        """Call `callback` (once) when `sock`'s caller hangs up, until `unwatch`."""
        fd = sock.fileno()
        self._set.register(fd, select.EPOLLRDHUP)
        self._callbacks[fd] = callback

    def unwatch(self, sock: socket.socket) -> None:
        fd = sock.fileno()
        if self._callbacks.pop(fd, None) is not None and not self._set.closed:
            self._set.unregister(fd)

    async def run(self) -> None:
        """Wait for hang-ups, forever (until cancelled with the server)."""
        try:
            while True:
                await wait_readable(self._set)
                for fd, _ in self._set.poll(0):
                    if fd in self._callbacks:
                        self._set.unregister(fd)
                        self._hung_up(self._callbacks.pop(fd))
        finally:
            self._set.close()

    @staticmethod
    def _hung_up(callback: Callable[[], None]) -> None:
        # Not a local of `run`: what the callback holds would wait for the next hang-up.
        try:
            callback()
        except Exception:  # one stream's trouble is never the server's
            log.exception("a hang-up callback failed")
