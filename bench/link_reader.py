"""In-process cost of one provider message on funduq's side of the link,
step by step, for a provider that sends one frame per message (no `batch`):
the front's websocket read (`front/websocket.py` `WebSocket.receive`: one run's
masked client frames in one socket read, then one read per frame, the socket
stubbed) and a message written (`WebSocket.send`), the frame decode
(`frames.decode_frame`), the link machine's `receive` (the decode plus its
dispatch to actions), and the provider socket's reader loop handing the
actions to a session (`ProviderSocket._reader`, the broker side stubbed).
Deterministic enough to compare trees: the same frames, many rounds.

    python bench/link_reader.py [--rounds 2000]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import trio

from funduq_trio.identity import Identity, provider_connect_payload
from funduq_trio.protocol import frames as f
from funduq_trio.protocol import link as L


def run_frames(run_id: str, deltas: int = 8) -> list[str]:
    """One echo run's messages as the raw provider sends them (ok, events, finish)."""
    mid = "msg-" + run_id
    events: list[dict[str, Any]] = [
        {"type": "RUN_STARTED", "threadId": "t-" + run_id, "runId": run_id},
        {"type": "TEXT_MESSAGE_START", "messageId": mid, "role": "assistant"},
        *(
            {"type": "TEXT_MESSAGE_CONTENT", "messageId": mid, "delta": f"word{i} "}
            for i in range(deltas)
        ),
        {"type": "TEXT_MESSAGE_END", "messageId": mid},
        {"type": "RUN_FINISHED", "threadId": "t-" + run_id, "runId": run_id},
    ]
    texts = [
        json.dumps(
            {
                "kind": "ok",
                "id": "o-" + run_id,
                "verdict": "accepted",
                "reason": None,
                "payload": None,
            },
            separators=(",", ":"),
        )
    ]
    for seq, event in enumerate(events, start=1):
        texts.append(f.encode_frame(f.Report(run_id=run_id, event=event, seq=seq)))
    texts.append(f.encode_frame(f.Finish(run_id=run_id)))
    return texts


def attached_machine() -> L.LinkMachine:
    funduq, provider = Identity.generate(), Identity.generate()
    machine = L.LinkMachine(funduq, "n" * 32)
    payload = provider_connect_payload(funduq.public_key_hex, machine.nonce, "p" * 32)
    connect = f.Connect(
        public_key=provider.public_key_hex, nonce="p" * 32, proof=provider.sign(payload)
    )
    machine.receive(f.encode_frame(connect))
    assert machine.state is L.State.ATTACHED
    return machine


def per_message(fn: Callable[[], None], messages: int, rounds: int) -> float:
    """Microseconds per message: the least of many short timings (a busy
    host only ever adds to a timing)."""
    best = float("inf")
    for _ in range(max(200, rounds // 5)):
        start = time.perf_counter()
        for _ in range(5):
            fn()
        best = min(best, time.perf_counter() - start)
    return best / (5 * messages) * 1e6


class _Session:
    def __init__(self) -> None:
        self.reports = 0
        self.behind: dict[int, Any] = {}

    def report(self, run_id: str, event: Any) -> bool:
        self.reports += 1
        return True

    def finish(self, run_id: str) -> bool:
        return True

    def answer(self, offer_id: str, verdict: str, reason: str | None) -> None:
        pass

    async def can_read(self) -> None:
        pass


class _Socket:
    """The front's `WebSocket.receive` as the reader sees it: every message of
    one socket read handed over without a task step, then the end."""

    def __init__(self, messages: list[str]) -> None:
        self.messages = messages
        self.at = 0

    async def receive(self) -> str:
        if self.at == len(self.messages):
            raise _Done
        self.at += 1
        return self.messages[self.at - 1]


class _Done(Exception):
    pass


def masked_frame(text: str, key: bytes = b"\x37\xfa\x21\x3d") -> bytes:
    """`text` as a client's one-frame text message (RFC 6455 §5.2-5.3)."""
    payload = text.encode()
    n = len(payload)
    length = bytes((0x80 | n,)) if n < 126 else bytes((0x80 | 126,)) + n.to_bytes(2, "big")
    masked = bytes(b ^ key[i % 4] for i, b in enumerate(payload))
    return bytes((0x81,)) + length + key + masked


class _Wire:
    """The front's `Connection` as an open websocket uses it: `reads` in
    turn, writes dropped."""

    class limits:
        max_message_bytes = 16 * 1024 * 1024

    def __init__(self) -> None:
        self.reads: list[bytes] = []
        self.at = 0

    async def read(self) -> bytes:
        self.at += 1
        return self.reads[self.at - 1]

    async def write(self, data: bytes) -> None:
        pass


def front_socket(wire: _Wire) -> Any:
    from wsproto.connection import Connection, ConnectionType

    from funduq_trio.front.websocket import WebSocket

    socket = WebSocket(wire, b"key")  # type: ignore[arg-type]
    socket.ws = Connection(ConnectionType.SERVER)
    socket.state = "open"
    return socket


def front_per_message(texts: list[str], rounds: int, *, one_read: bool) -> float:
    """Microseconds for `WebSocket.receive` to hand over one message."""
    frames = [masked_frame(t) for t in texts]
    reads = [b"".join(frames)] if one_read else frames
    n = len(texts)

    async def timed() -> float:
        best = float("inf")
        for _ in range(max(200, rounds // 5)):
            sockets = []
            for _ in range(5):
                wire = _Wire()
                wire.reads = reads
                sockets.append(front_socket(wire))
            start = time.perf_counter()
            for socket in sockets:
                for _ in range(n):
                    await socket.receive()
            best = min(best, time.perf_counter() - start)
        return best / (5 * n) * 1e6

    return trio.run(timed)


def front_send_per_message(text: str, rounds: int) -> float:
    async def timed() -> float:
        socket = front_socket(_Wire())
        message = {"type": "websocket.send", "text": text}
        best = float("inf")
        for _ in range(max(200, rounds // 5)):
            start = time.perf_counter()
            for _ in range(50):
                await socket.send(message)
            best = min(best, time.perf_counter() - start)
        return best / 50 * 1e6

    return trio.run(timed)


def main() -> None:
    from funduq_trio.web.provider_socket import ProviderSocket

    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument(
        "--calls",
        type=int,
        default=None,
        help="no timing: run the reader over CALLS runs' messages once and stop (for "
        "instruction counts: callgrind with 0 and with N calls, subtracted)",
    )
    args = parser.parse_args()
    texts = run_frames("r-0000000000000001")
    n = len(texts)
    timed = args.calls is None
    reports = [t for t in texts if '"kind":"report"' in t]
    print(f"{n} messages a run ({len(reports)} reports)")

    if timed:
        us = front_per_message(texts, args.rounds, one_read=True)
        print(f"WebSocket.receive (a run in one read):   {us:6.2f} us")
        us = front_per_message(texts, args.rounds, one_read=False)
        print(f"WebSocket.receive (a read per message):  {us:6.2f} us")
        us = front_send_per_message(texts[1], args.rounds)
        print(f"WebSocket.send (a {len(texts[1])}-byte text):      {us:6.2f} us")

    def decode_only() -> None:
        for text in reports:
            f.decode_frame(text, accept=f.FROM_PROVIDER)

    if timed:
        us = per_message(decode_only, len(reports), args.rounds)
        print(f"frames.decode_frame (a report):          {us:6.2f} us")

    machine = attached_machine()

    def machine_reports() -> None:
        for text in reports:
            machine.receive(text)

    if timed:
        us = per_message(machine_reports, len(reports), args.rounds)
        print(f"LinkMachine.receive (a report):          {us:6.2f} us")

    # The reader loop over a run's messages, the broker stubbed: the offer
    # each run's `ok` answers is made on the machine first.
    sock = ProviderSocket.__new__(ProviderSocket)
    sock.machine = attached_machine()
    sock._session = _Session()
    sock._close = None
    sock._llm = None
    sock._queries = 0

    class _Funduq:
        class settings:
            max_thread_queries_per_link = 8

    sock._funduq = _Funduq()

    async def read_one_run() -> None:
        """The reader over one run's messages (the offer outstanding again)."""
        sock.machine._outstanding["o-r-0000000000000001"] = "r-0000000000000001"
        sock.machine._answered_set.discard("o-r-0000000000000001")
        sock._ws = _Socket(texts)
        try:
            await sock._reader(None)
        except _Done:
            pass

    async def reader_rounds() -> float:
        best = float("inf")
        for _ in range(max(200, args.rounds // 5)):
            start = time.perf_counter()
            for _ in range(5):
                await read_one_run()
            best = min(best, time.perf_counter() - start)
        return best / (5 * n) * 1e6

    async def reader_calls(calls: int) -> None:
        for _ in range(calls):
            await read_one_run()

    if args.calls is not None:
        trio.run(reader_calls, args.calls)
        return
    print(f"ProviderSocket._reader (any message):    {trio.run(reader_rounds):6.2f} us")


if __name__ == "__main__":
    main()
