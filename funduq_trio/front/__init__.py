"""funduq's HTTP/1.1 and WebSocket front: an ASGI server on trio streams.

Theory of operation. The protocols are h11's and wsproto's I/O-free state
machines; this package is the thin I/O shell around them, and speaks ASGI
3.0 (``http``, ``websocket``, ``lifespan``) to the app, so the app stays a
plain ASGI app any server can run (tests run it under hypercorn too).

It exists for what hypercorn charged every run (bench/README.md, "Our own
front"): hypercorn gives each request its own task and a memory channel to
the app and writes a response in one socket send per ASGI message. Here:

- **One task per connection, and the app runs on it.** A request is read,
  the app is awaited on the connection's own task, the next request is read.
  ``receive`` reads the socket itself (h11 parses every event a read holds),
  ``send`` writes it itself: no channel, no task hand-off.
- **A response is written in as few sends as it has bursts.** The status
  line and headers wait for the first body; a whole JSON answer (start,
  body, end) is one ``send_all``, an SSE burst one more.
- **A websocket message is one parse, not one task step.** ``receive``
  hands the app each message wsproto found in the last read, without a
  checkpoint in between; ``send`` frames and writes at once.

What it bounds (every figure from the settings, refused with a clear answer):
connections served at once (``max_connections``: one more is answered 503
at once, with no task started for it), request line and headers
(``MAX_HEADER_BYTES``: 431/400 and close), how long a connection may sit
idle or take to send its headers (``keep_alive``: closed), a websocket
message (``max_message_bytes``: close 1009). Bodies are bounded by the app
(413, 408), which reads them through ``receive``. An app that fails
before answering gets a JSON 500; after answering, the connection is cut so
the caller cannot mistake a partial answer for a whole one.

Shutting down is cancelling the serving nursery, as it was with hypercorn:
listeners close, every connection's task (and the app call on it) is
cancelled, then the lifespan's shutdown runs.
"""

from __future__ import annotations

from .limits import FrontLimits
from .serving import serve_asgi

__all__ = ["FrontLimits", "serve_asgi"]
