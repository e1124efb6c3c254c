"""A follower's quiet: how a stream that writes to a caller waits for news.

A caller's SSE stream (`web/sse.py`) waits for its run's next events, for
hours if the run is queued, and meanwhile two other things may need it: a
keepalive is due after a silence (FUNDUQ_SSE_KEEPALIVE_SECONDS), or the
caller has gone. Both used to be a second task beside the stream (a watcher
waiting on the connection, with its own nursery and deadline: ~5 KiB a
waiting stream, bench/README.md). With a `Quiet`, the stream's own task does
all of it: every wait of the stream's source for news (`Funduq.follow`'s wait
on the feed or the record's news, a door's wait at a pause) runs inside a
cancel scope made here, whose deadline is the keepalive's and which the
connection's owner cancels when the caller goes (`end`). A wait that ends
that way is not an error: the source yields an empty burst, and the stream
writes its keepalive or, the caller gone, closes the source.

The scope is inside the source's own frame, around one wait: a generator's
`__anext__` cancelled from outside would end the generator; a wait cancelled
inside it is caught where it was entered, and the source goes on.
"""

from __future__ import annotations

import math

import trio


class Quiet:
    """One stream's waits: their deadline (`deadline`, trio's clock; the
    stream moves it after each write) and the caller's going (`end`)."""

    __slots__ = ("deadline", "gone", "_scope")

    def __init__(self) -> None:
        #: When the wait in progress (or the next) ends with no news.
        self.deadline = math.inf
        #: The caller has gone: every wait ends at once, now and later.
        self.gone = False
        self._scope: trio.CancelScope | None = None

    def waiting(self, deadline: float | None = None) -> trio.CancelScope:
        """The cancel scope for one wait (enter it around the wait): ends at
        `deadline` (default: the keepalive's), or when the caller goes.
        After it, `cancelled_caught` says the wait ended without news."""
        scope = trio.CancelScope(deadline=self.deadline if deadline is None else deadline)
        if self.gone:
            scope.cancel()
        self._scope = scope
        return scope

    def due(self) -> bool:
        """A wait entered now would end at once without news: its deadline
        has passed (as a stream's first wait's has, so that its head goes
        out at once) or the caller has gone. A source whose wait always
        parks (`Funduq.follow`'s on a live feed) asks this first and yields
        its empty burst without the wait: the scope, the trip through the
        scheduler and the `Cancelled` it would cost end the same way (trio
        cancels a scope entered at or past its deadline)."""
        return self.gone or trio.current_time() >= self.deadline

    def end(self) -> None:
        """The caller has gone: the wait in progress ends now."""
        self.gone = True
        scope, self._scope = self._scope, None
        if scope is not None:
            scope.cancel()
