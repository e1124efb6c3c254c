"""A client's websocket bytes, split: the common frame read here, the rest by wsproto.

Almost every frame a provider sends is one whole message in one frame: FIN
set, no RSV bit, text (or binary), masked as a client must, short enough,
and already whole in the bytes one socket read brought. wsproto reads such
a frame at ~20 us (a frame decoder step, a masker that copies the payload
and translates it four times, a UTF-8 incremental decoder looked up in
`codecs` for every message, three event objects); `ClientFrames` reads it
with a few integer tests, one XOR over the payload as an integer, and a
strict ``bytes.decode``.

Everything else goes to wsproto, which stays the one authority on the
protocol: fragments and their continuations, control frames (ping, pong,
close), frames over the message bound (wsproto's partial frames let the
front refuse them 1009 as the bytes come), text that is not UTF-8 (1007),
and every malformed frame (RSV bits, an unknown opcode, an unmasked frame,
a length in more bytes than needed, a fragmented control frame: 1002). The
split keeps one rule so that wsproto's state is always right: **wsproto is
handed whole frames from their first byte on, never a frame whose start was
taken here**. A frame for wsproto that is not whole yet is handed as far as
it goes and the rest of it is owed (the next bytes go to wsproto first).
While wsproto holds an unfinished fragmented message, every frame is its.
Once a frame is seen that wsproto will refuse, everything from its first
byte on goes to wsproto for good. So wsproto sees exactly the byte stream
it would have seen alone, minus whole common frames between its frames, and
answers exactly as it would have (tests/test_ws_frames.py holds the two
roads equal, byte for byte, over arbitrary frame sequences split at
arbitrary points).

Only the first bytes of a frame are ever held here (at most 13: a header
whose length or mask key is not all there yet); no payload is held.
"""

from __future__ import annotations

#: Opcodes RFC 6455 defines: continuation, text, binary, close, ping, pong.
_KNOWN_OPCODES = frozenset((0x0, 0x1, 0x2, 0x8, 0x9, 0xA))

#: Up to this many payload bytes the XOR is one integer operation; above
#: it, four `translate`s over strided slices (with the tables below, made
#: once) are cheaper: 30.6k instructions against 47.1k at 1 KiB, 18.4k
#: against 20.3k at 384 bytes, 16.2k against 15.4k at 256 (callgrind,
#: bench/README.md "A raw provider's bursts bound at the writer's flush").
_INT_UNMASK_BYTES = 288

_XOR_TABLE = [bytes(a ^ b for a in range(256)) for b in range(256)]


def unmask(payload: bytes, key: bytes) -> bytes:
    """`payload` XOR the repeated 4-byte masking `key` (RFC 6455 §5.3)."""
    n = len(payload)
    if n <= _INT_UNMASK_BYTES:
        mask = (key * ((n + 3) >> 2))[:n]
        return (int.from_bytes(payload, "little") ^ int.from_bytes(mask, "little")).to_bytes(
            n, "little"
        )
    data = bytearray(payload)
    data[::4] = data[::4].translate(_XOR_TABLE[key[0]])
    data[1::4] = data[1::4].translate(_XOR_TABLE[key[1]])
    data[2::4] = data[2::4].translate(_XOR_TABLE[key[2]])
    data[3::4] = data[3::4].translate(_XOR_TABLE[key[3]])
    return bytes(data)


def server_frame(opcode: int, payload: bytes) -> bytes:
    """One whole unmasked frame from the server, as wsproto writes it (FIN,
    no RSV bit, the length in as few bytes as it fits)."""
    n = len(payload)
    if n < 126:
        return bytes((0x80 | opcode, n)) + payload
    if n < 0x10000:
        return bytes((0x80 | opcode, 126, n >> 8, n & 0xFF)) + payload
    return bytes((0x80 | opcode, 127)) + n.to_bytes(8, "big") + payload


class ForWsproto:
    """Bytes that wsproto must parse (a frame, or the start or rest of one)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __repr__(self) -> str:
        return f"ForWsproto({self.data!r})"


class ClientFrames:
    """The split of one websocket connection's client bytes (server side, no
    extension negotiated: funduq's front offers none)."""

    __slots__ = ("max_message_bytes", "_held", "_owed", "_fragmented", "_wsproto_only")

    def __init__(self, max_message_bytes: int) -> None:
        #: A frame longer than this goes to wsproto, whose partial frames let
        #: the front refuse it (1009) as its bytes arrive.
        self.max_message_bytes = max_message_bytes
        self._held = b""  # the first bytes of a frame, its header not all there
        self._owed = 0  # bytes of a frame wsproto has the start of
        self._fragmented = False  # wsproto holds an unfinished fragmented message
        self._wsproto_only = False  # a frame wsproto will refuse was seen

    def feed(self, data: bytes) -> list[str | bytes | ForWsproto]:
        """What `data` (the next bytes from the client) holds, in order: a
        text message (str), a binary message (bytes), or bytes for wsproto.
        A frame that is not all there is held or owed to the next feed."""
        if self._wsproto_only:
            return [ForWsproto(data)]
        if self._held:
            data = self._held + data
            self._held = b""
        out: list[str | bytes | ForWsproto] = []
        end = len(data)
        pos = 0
        if self._owed:
            pos = min(self._owed, end)
            self._owed -= pos
            out.append(ForWsproto(data[:pos]))
        while pos < end:
            if end - pos < 2:
                self._held = data[pos:]
                break
            first = data[pos]
            second = data[pos + 1]
            opcode = first & 0x0F
            length = second & 0x7F
            if (
                first & 0x70  # an RSV bit (no extension is negotiated)
                or not second & 0x80  # unmasked: a client must mask
                or opcode not in _KNOWN_OPCODES
                or (opcode & 0x08 and (not first & 0x80 or length > 125))  # control frames
                or (opcode < 8 and (opcode == 0) is not self._fragmented)  # out of turn
            ):
                self._wsproto_only = True  # wsproto refuses it, from this frame on
                out.append(ForWsproto(data[pos:]))
                break
            if length < 126:
                head = pos + 6
            elif length == 126:
                if end - pos < 4:
                    self._held = data[pos:]
                    break
                length = (data[pos + 2] << 8) | data[pos + 3]
                head = pos + 8
                if length < 126:
                    self._wsproto_only = True  # a length in more bytes than needed
                    out.append(ForWsproto(data[pos:]))
                    break
            else:
                if end - pos < 10:
                    self._held = data[pos:]
                    break
                length = int.from_bytes(data[pos + 2 : pos + 10], "big")
                head = pos + 14
                if length <= 0xFFFF or length >> 63:
                    self._wsproto_only = True
                    out.append(ForWsproto(data[pos:]))
                    break
            if head > end:  # the masking key is not all there
                self._held = data[pos:]
                break
            frame_end = head + length
            if (
                first & 0x80
                and (opcode == 1 or opcode == 2)
                and frame_end <= end
                and length <= self.max_message_bytes
            ):
                payload = unmask(data[head:frame_end], data[head - 4 : head])
                if opcode == 1:
                    try:
                        out.append(payload.decode("utf-8"))
                    except UnicodeDecodeError:
                        self._wsproto_only = True  # wsproto closes it 1007
                        out.append(ForWsproto(data[pos:]))
                        break
                else:
                    out.append(payload)
                pos = frame_end
                continue
            if opcode < 8:  # a data frame for wsproto: fragments follow until FIN
                self._fragmented = not first & 0x80
            if frame_end <= end:
                out.append(ForWsproto(data[pos:frame_end]))
                pos = frame_end
            else:
                out.append(ForWsproto(data[pos:]))
                self._owed = frame_end - end
                break
        return out

    def end(self) -> None:
        """The connection ended: a held header is dropped (wsproto reports 1006)."""
        self._held = b""


__all__ = ["ClientFrames", "ForWsproto", "server_frame", "unmask"]
