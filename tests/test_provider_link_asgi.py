"""The provider link is served straight on ASGI, in front of quart
(web/provider_socket.py `register_provider_socket`): what stays as it was.

- other websocket paths still reach quart's routing (404, no link);
- a peer that drops its TCP connection without a close frame ends its link
  (hypercorn's `websocket.disconnect` cancels the handler, as quart-trio did):
  the place it held among the links waiting for `connect` is free again.
"""

from __future__ import annotations

import base64
import json
import os

import trio
import trio.testing
from support import refused_handshake, running_server
from trio_websocket import open_websocket_url


async def test_other_websocket_paths_still_reach_quart(tmp_path):
    async with running_server(tmp_path) as info:
        elsewhere = info.provider_url.replace("/ws/provider", "/ws/elsewhere")
        assert (await refused_handshake(elsewhere)).status_code == 404


async def dial_by_hand(port: int) -> tuple[trio.SocketStream, bytes]:
    """Upgrade a plain TCP connection to the provider link; return it and
    what it read so far (the 101 and funduq's hello)."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    key = base64.b64encode(os.urandom(16)).decode()
    await stream.send_all(
        (
            "GET /ws/provider HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
            f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
            "Sec-WebSocket-Version: 13\r\n\r\n"
        ).encode()
    )
    data = b""
    while b'"kind":"hello"' not in data:
        chunk = await stream.receive_some()
        assert chunk, data
        data += chunk
    return stream, data


async def test_a_dropped_connection_ends_its_link(tmp_path):
    async with running_server(tmp_path, max_unauthenticated_links=1) as info:
        stream, greeting = await dial_by_hand(info.port)
        assert greeting.startswith(b"HTTP/1.1 101")
        # The one waiting place is taken: a second link is refused.
        async with open_websocket_url(info.provider_url) as second:
            refused = json.loads(await second.get_message())
            assert refused["kind"] == "connect.err", refused
        # Gone without a close frame; the link ends and frees its place. (The
        # server runs in this trio loop: once every task is blocked, it has
        # taken the drop in.)
        await stream.aclose()
        await trio.testing.wait_all_tasks_blocked()
        async with open_websocket_url(info.provider_url) as third:
            reply = json.loads(await third.get_message())
        assert reply["kind"] == "hello", reply
