"""The front's own read of the common client frame (`front/ws_frames.py`)
against wsproto alone, byte for byte.

`WebSocket` (front/websocket.py) takes a whole, masked, unfragmented text or
binary frame itself and hands every other frame to wsproto. Here the same
client bytes, cut into socket reads at arbitrary points, go through the
front as it is and through a front that hands everything to wsproto (what
it did before): the app must receive the same messages and the same
disconnect code, and the client must get the same bytes back (pongs, close
frames with their codes and reasons), for every frame sequence hypothesis
builds -- common frames, fragments, pings, closes, RSV bits, unknown
opcodes, unmasked frames, lengths in too many bytes, invalid UTF-8, frames
over the message bound.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any

import pytest
import trio
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from wsproto.connection import Connection as WsConnection
from wsproto.connection import ConnectionType
from wsproto.events import BytesMessage, TextMessage
from wsproto.frame_protocol import FrameProtocol, XorMaskerSimple

from funduq_trio.front import FrontLimits
from funduq_trio.front.websocket import WebSocket
from funduq_trio.front.ws_frames import ClientFrames, ForWsproto, server_frame, unmask


class Wire:
    """The front's `Connection` as `WebSocket` uses it once open: reads come
    from `chunks` (then the end), writes are kept."""

    def __init__(self, chunks: list[bytes], max_message_bytes: int) -> None:
        self.chunks = deque(chunks)
        self.written: list[bytes] = []
        self.limits = FrontLimits(max_message_bytes=max_message_bytes)

    async def read(self) -> bytes:
        return self.chunks.popleft() if self.chunks else b""

    async def write(self, data: bytes) -> None:
        self.written.append(bytes(data))


class WsprotoAlone(WebSocket):
    """The front before the split: every byte read goes to wsproto."""

    async def _take(self, data: bytes) -> None:
        assert self.ws is not None
        self.ws.receive_data(data)
        await self._take_events()


async def by_message(socket: WebSocket) -> dict[str, Any]:
    """`receive` as the provider link reads it (web/provider_socket.py's
    AsgiWebsocket): the message itself when `receive_message` has one,
    `receive` when it answers None."""
    message = await socket.receive_message()
    if type(message) is str:
        return {"type": "websocket.receive", "text": message}
    if message is not None:
        return {"type": "websocket.receive", "bytes": message}
    return await socket.receive()


async def serve(
    kind: type[WebSocket],
    chunks: list[bytes],
    limit: int,
    close_after: int | None,
    messages: bool = False,
) -> tuple[list[dict[str, Any]], bytes, int]:
    """What the app receives, what the client is sent, and the close code,
    with the app itself closing after `close_after` messages if set;
    `messages`: the app reads through `receive_message` (`by_message`)."""
    wire = Wire(chunks, limit)
    socket = kind(wire, b"key")  # type: ignore[arg-type]
    socket.ws = WsConnection(ConnectionType.SERVER)
    socket.state = "open"
    received: list[dict[str, Any]] = []
    while True:
        message = await (by_message(socket) if messages else socket.receive())
        received.append(message)
        if message["type"] == "websocket.disconnect":
            break
        if close_after is not None and len(received) == close_after:
            await socket.send({"type": "websocket.close", "code": 4000, "reason": "app"})
        else:
            await socket.send(
                {"type": "websocket.send", **{k: v for k, v in message.items() if k != "type"}}
            )
    return received, b"".join(wire.written), socket.close_code


def both_roads(
    chunks: list[bytes], limit: int, close_after: int | None = None
) -> tuple[list[dict[str, Any]], bytes, int]:
    split = trio.run(serve, WebSocket, chunks, limit, close_after)
    alone = trio.run(serve, WsprotoAlone, chunks, limit, close_after)
    assert split == alone
    # The provider link's road (the receive_message extension) hands over
    # the same messages, disconnect and writes as `receive` does.
    assert trio.run(serve, WebSocket, chunks, limit, close_after, True) == split
    return split


def client_frame(
    opcode: int,
    payload: bytes,
    *,
    fin: bool = True,
    rsv: int = 0,
    masked: bool = True,
    key: bytes = b"\x12\x34\x56\x78",
    length_bytes: int | None = None,
) -> bytes:
    """A client frame as a client would write it, or bent."""
    n = len(payload)
    if length_bytes is None:
        length_bytes = 0 if n < 126 else 2 if n < 0x10000 else 8
    mask_bit = 0x80 if masked else 0
    if length_bytes == 0:
        head = bytes((fin << 7 | rsv << 4 | opcode, mask_bit | n))
    elif length_bytes == 2:
        head = bytes((fin << 7 | rsv << 4 | opcode, mask_bit | 126)) + n.to_bytes(2, "big")
    else:
        head = bytes((fin << 7 | rsv << 4 | opcode, mask_bit | 127)) + n.to_bytes(8, "big")
    if not masked:
        return head + payload
    return head + key + bytes(XorMaskerSimple(key).process(bytearray(payload)))


def cut(stream: bytes, points: list[int]) -> list[bytes]:
    edges = sorted({p % (len(stream) + 1) for p in points} | {0, len(stream)})
    return [stream[a:b] for a, b in zip(edges, edges[1:], strict=False) if b > a]


CLOSE_CODES = [1000, 1001, 1002, 1005, 1006, 1009, 999, 2999, 3000, 4001, 5000]

payloads = st.one_of(
    st.text(max_size=40).map(str.encode),
    st.binary(max_size=40),
    st.text(min_size=40, max_size=200).map(str.encode),
    st.builds(lambda n, c: c * n, st.integers(100, 400), st.sampled_from([b"a", b"\xc3\xa9"])),
)


@st.composite
def frames(draw: st.DrawFn) -> bytes:
    opcode = draw(st.sampled_from([1, 1, 1, 1, 2, 2, 0, 0, 8, 9, 9, 10, 3, 11]))
    if opcode == 8:
        payload = draw(
            st.one_of(
                st.just(b""),
                st.binary(max_size=1),
                st.builds(
                    lambda code, reason: code.to_bytes(2, "big") + reason,
                    st.sampled_from(CLOSE_CODES),
                    st.one_of(st.text(max_size=20).map(str.encode), st.binary(max_size=20)),
                ),
            )
        )
    elif opcode in (9, 10):
        payload = draw(st.binary(max_size=130))
    else:
        payload = draw(payloads)
    bent = draw(st.sampled_from(["none"] * 12 + ["rsv", "unmasked", "long", "fin"]))
    fin = opcode >= 8 or draw(st.sampled_from([True, True, True, False]))
    if bent == "fin":
        fin = not fin
    length_bytes = None
    if bent == "long":
        length_bytes = 2 if len(payload) < 126 else 8
    return client_frame(
        opcode,
        payload,
        fin=fin,
        rsv=draw(st.sampled_from([1, 2, 4, 5])) if bent == "rsv" else 0,
        masked=bent != "unmasked",
        key=draw(st.binary(min_size=4, max_size=4)),
        length_bytes=length_bytes,
    )


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sequence=st.lists(frames(), max_size=8),
    points=st.lists(st.integers(0, 10_000), max_size=6),
    limit=st.sampled_from([0, 3, 50, 130, 300, 16 * 1024 * 1024]),
    close_after=st.one_of(st.none(), st.integers(1, 4)),
)
@example(
    # a text frame whose second part is not UTF-8, cut inside it
    sequence=[client_frame(1, "é".encode() * 3 + b"\xff\xfe")],
    points=[9],
    limit=16 * 1024 * 1024,
    close_after=None,
)
def test_the_split_and_wsproto_alone_agree_byte_for_byte(sequence, points, limit, close_after):
    both_roads(cut(b"".join(sequence), points), limit, close_after)


@pytest.mark.parametrize("cuts", [[], [1], [2], [5], [10], [13], [14], [70000]])
@pytest.mark.parametrize("form", ["text", "binary", "text-16", "over"])
def test_long_frames_and_their_length_forms_agree_with_wsproto(cuts, form):
    payload = b"x" * (70_000 if form != "text-16" else 300)
    limit = 69_999 if form == "over" else 16 * 1024 * 1024
    stream = client_frame(2 if form == "binary" else 1, payload) + client_frame(1, b"after")
    received, written, code = both_roads(cut(stream, cuts), limit)
    if form == "over":
        assert code == 1009 and received == [{"type": "websocket.disconnect", "code": 1009}]
    else:
        assert [m.get("text", m.get("bytes")) for m in received[:2]] in (
            [payload.decode(), "after"],
            [payload, "after"],
        )


@pytest.mark.parametrize(
    ("bent", "code"),
    [
        (client_frame(1, b"unmasked", masked=False), 1002),
        (client_frame(1, b"rsv", rsv=4), 1002),
        (client_frame(1, b"\xff not utf-8"), 1007),
        (client_frame(5, b"opcode 5"), 1002),
        (client_frame(1, b"short", length_bytes=2), 1002),
        (client_frame(1, b"x" * 125, length_bytes=2), 1002),
        (client_frame(2, b"x" * 0xFFFF, length_bytes=8), 1002),
        (client_frame(9, b"a ping in pieces", fin=False), 1002),
        (client_frame(0, b"a continuation of nothing"), 1002),
        (client_frame(1, b"x" * 0x10001), 1009),
    ],
)
def test_a_bad_frame_after_common_ones_closes_as_wsproto_closes(bent, code):
    stream = client_frame(1, b"one") + client_frame(2, b"two") + bent + client_frame(1, b"never")
    received, written, got = both_roads([stream], 0x10000)
    assert got == code
    assert received[:2] == [
        {"type": "websocket.receive", "text": "one"},
        {"type": "websocket.receive", "bytes": b"two"},
    ]
    assert received[2:] == [{"type": "websocket.disconnect", "code": code}]
    assert written.endswith(b"\x88") is False


def test_the_common_frames_never_reach_wsproto():
    """The fast road is the road taken: a regression to wsproto for every
    message would be invisible to the tests above."""
    sent = [
        client_frame(1, b'{"kind":"report"}'),
        client_frame(2, b"\x00\x01"),
        client_frame(1, "é".encode() * 100),  # a 16-bit length
        client_frame(1, b""),
        client_frame(1, b"y" * 125) + client_frame(2, b"z" * 70_000),  # 7- and 64-bit lengths
    ]
    # Reads that end inside a header (held until the rest comes) or between frames.
    one, two, three, four, five = sent
    reads = [one[:1], one[1:] + two + three[:3], three[3:7], three[7:] + four, five]
    fed: list[bytes] = []

    async def main() -> list[dict[str, Any]]:
        wire = Wire(reads, 1 << 20)
        socket = WebSocket(wire, b"key")  # type: ignore[arg-type]
        socket.ws = WsConnection(ConnectionType.SERVER)
        socket.state = "open"
        receive_data = socket.ws.receive_data

        def counted(data: bytes | None) -> None:
            fed.append(data or b"")
            receive_data(data)

        socket.ws.receive_data = counted  # type: ignore[method-assign]
        return [await socket.receive() for _ in range(7)]

    received = trio.run(main)
    assert received == [
        {"type": "websocket.receive", "text": '{"kind":"report"}'},
        {"type": "websocket.receive", "bytes": b"\x00\x01"},
        {"type": "websocket.receive", "text": "é" * 100},
        {"type": "websocket.receive", "text": ""},
        {"type": "websocket.receive", "text": "y" * 125},
        {"type": "websocket.receive", "bytes": b"z" * 70_000},
        {"type": "websocket.disconnect", "code": 1006},
    ]
    assert fed == [b""]  # only the end, which wsproto reports as 1006


def test_the_split_itself_holds_only_a_header_and_owes_the_rest():
    frames_ = ClientFrames(1000)
    ping = client_frame(9, b"ping")
    text = client_frame(1, b"hello")
    assert frames_.feed(text[:1]) == []
    assert frames_.feed(text[1:5]) == []  # the mask key not all there: held
    assert frames_.feed(text[5:] + ping[:3]) == ["hello"]
    out = frames_.feed(ping[3:] + text)
    assert isinstance(out[0], ForWsproto) and out[0].data == ping
    assert out[1:] == ["hello"]
    out = frames_.feed(text[:7])  # a payload not all there goes to wsproto at once
    assert isinstance(out[0], ForWsproto) and out[0].data == text[:7]
    out = frames_.feed(text[7:] + text)
    assert isinstance(out[0], ForWsproto) and out[0].data == text[7:] and out[1:] == ["hello"]
    out = frames_.feed(ping[:7])
    assert [type(x) for x in out] == [ForWsproto] and out[0].data == ping[:7]
    out = frames_.feed(ping[7:] + text)  # the ping's rest is owed to wsproto
    assert isinstance(out[0], ForWsproto) and out[0].data == ping[7:] and out[1] == "hello"


@pytest.mark.parametrize("n", [0, 1, 3, 4, 5, 125, 287, 288, 289, 1025, 2048, 70_001])
def test_unmask_is_wsprotos_unmask(n):
    payload, key = os.urandom(n), os.urandom(4)
    assert unmask(payload, key) == bytes(XorMaskerSimple(key).process(bytearray(payload)))


@pytest.mark.parametrize("n", [0, 125, 126, 0xFFFF, 0x10000])
def test_a_server_frame_is_wsprotos_frame(n):
    proto = FrameProtocol(client=False, extensions=[])
    assert server_frame(0x1, b"a" * n) == bytes(proto.send_data("a" * n))
    assert server_frame(0x2, b"b" * n) == bytes(proto.send_data(b"b" * n))
    wsproto_conn = WsConnection(ConnectionType.SERVER)
    assert server_frame(0x1, "é".encode()) == wsproto_conn.send(TextMessage(data="é"))
    assert server_frame(0x2, b"") == wsproto_conn.send(BytesMessage(data=b""))


def test_a_ping_after_the_apps_close_is_not_answered_and_breaks_nothing():
    """Found by the property test above: the front answered a ping that came
    after the app's close with a pong wsproto refuses to send in that state,
    and the app's receive raised LocalProtocolError."""
    stream = client_frame(1, b"one") + client_frame(9, b"") + client_frame(8, b"\x03\xe8")
    received, written, code = both_roads([stream[:9], stream[9:]], 1000, close_after=1)
    assert code == 1000
    assert received == [
        {"type": "websocket.receive", "text": "one"},
        {"type": "websocket.disconnect", "code": 1000},
    ]
    assert written == server_frame(0x8, (4000).to_bytes(2, "big") + b"app")
