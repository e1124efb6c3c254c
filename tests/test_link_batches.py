"""`batch` frames over the real link: a real server, a hand-played provider
over a real websocket, an AG-UI caller over httpx. A batch must mean exactly
its frames sent one after another (docs/provider-link.md, "Batches")."""

from __future__ import annotations

import json
from typing import Any

import trio
from broker_support import broker, quiet
from broker_support import user_input as broker_input
from support import http_client, post_sse, raw_provider, running_server, user_input
from trio_websocket import ConnectionClosed

from funduq_trio.identity import Identity, new_nonce, provider_connect_payload
from funduq_trio.web.provider_socket import ProviderSocket

START, FINISH = "RUN_STARTED", "RUN_FINISHED"


def events_of(run: dict[str, Any], text: str) -> list[dict[str, Any]]:
    ids = {"threadId": run["threadId"], "runId": run["runId"]}
    return [
        {"type": START, **ids},
        {"type": "TEXT_MESSAGE_START", "messageId": "m", "role": "assistant"},
        *({"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": c} for c in text),
        {"type": "TEXT_MESSAGE_END", "messageId": "m"},
        {"type": FINISH, **ids},
    ]


def accepted(run: dict[str, Any]) -> dict[str, Any]:
    return {
        "kind": "ok",
        "id": run["offerId"],
        "verdict": "accepted",
        "reason": None,
        "payload": None,
    }


def reports(run: dict[str, Any], events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"kind": "report", "runId": run["runId"], "event": e, "seq": i}
        for i, e in enumerate(events, 1)
    ]


async def test_a_whole_run_in_one_batch_reaches_the_caller_and_the_record(tmp_path):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        assert provider.hello["extensions"] == ["batch"]
        result: dict[str, Any] = {}

        async def call() -> None:
            url = f"/agui/{provider.key}/echo"
            result["response"], result["events"] = await post_sse(http, url, user_input())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            run = await provider.next_offer()
            events = events_of(run, "hello")
            frames = [
                accepted(run),
                *reports(run, events),
                {"kind": "finish", "runId": run["runId"]},
            ]
            await provider.send({"kind": "batch", "frames": frames})
        record = (await http.get(f"/runs/{run['runId']}")).json()
    assert result["response"].status_code == 200
    assert result["events"] == events
    assert record["status"] == "completed"
    assert [e["event"] for e in record["events"]] == events


async def test_a_bad_item_with_an_id_is_answered_err_and_the_batch_goes_on(tmp_path):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(post_sse, http, f"/agui/{provider.key}/echo", user_input())
            run = await provider.next_offer()
            events = events_of(run, "ok")
            await provider.send(
                {
                    "kind": "batch",
                    "frames": [
                        accepted(run),
                        {"kind": "register", "id": "bad-register", "agents": "lots"},
                        *reports(run, events),
                        {"kind": "finish", "runId": run["runId"]},
                    ],
                }
            )
            with trio.fail_after(10):
                while "bad-register" not in provider._replies:
                    await provider._replied.wait()
        err = provider._replies["bad-register"]
        record = (await http.get(f"/runs/{run['runId']}")).json()
    assert err["kind"] == "err" and err["reason"].startswith("batch item 1: ")
    assert record["status"] == "completed"
    assert [e["event"] for e in record["events"]] == events


async def test_a_violation_mid_batch_closes_the_link_and_nothing_after_it_counts(tmp_path):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        caller: dict[str, Any] = {}

        async def call() -> None:
            url = f"/agui/{provider.key}/echo"
            caller["response"], caller["events"] = await post_sse(http, url, user_input())

        async with trio.open_nursery() as nursery:
            nursery.start_soon(call)
            run = await provider.next_offer()
            events = events_of(run, "x")
            frames = [
                accepted(run),
                *reports(run, events[:1]),
                {"kind": "report", "runId": run["runId"]},  # no event, no id: a violation
                *reports(run, events[1:]),
                {"kind": "finish", "runId": run["runId"]},
            ]
            await provider.send({"kind": "batch", "frames": frames})
            with trio.fail_after(10):
                try:
                    while True:
                        await provider.ws.get_message()
                except ConnectionClosed as closed:
                    reason = closed.reason
        record = (await http.get(f"/runs/{run['runId']}")).json()
    assert reason.code == 1008 and "batch item 2" in reason.reason
    assert record["status"] == "failed"
    assert record["metadata"]["failureReason"] == "provider_left_holding_it"
    # What came before the violation is recorded; what came after never happened.
    assert [e["event"] for e in record["events"]][:1] == events[:1]
    assert all(e["event"]["type"] != "TEXT_MESSAGE_CONTENT" for e in record["events"])
    assert [e["type"] for e in caller["events"]][0] == START
    assert json.dumps(caller["events"]).count("TEXT_MESSAGE_CONTENT") == 0


# --- funduq -> provider ----------------------------------------------------------


async def many_runs_through(tmp_path, extensions: list[str] | None, runs: int = 30):
    """Start `runs` AG-UI runs at once for a raw provider connected with
    `extensions`; it accepts and completes each. Returns the kinds of the
    messages it received and the runs' final records."""
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"], extensions=extensions) as provider,
    ):
        run_ids = []
        async with trio.open_nursery() as nursery:
            for i in range(runs):
                body = user_input(f"run {i}", thread_id=f"caller-{i}")
                nursery.start_soon(post_sse, http, f"/agui/{provider.key}/echo", body)
            for _ in range(runs):
                with trio.fail_after(30):
                    run = await provider.next_offer()
                run_ids.append(run["runId"])
                await provider.answer(run, "accepted")
                await provider.play(run, events_of(run, "ok"))
        records = [(await http.get(f"/runs/{run_id}")).json() for run_id in run_ids]
    return provider.kinds, records


async def test_a_provider_that_takes_batches_gets_every_offer_batched_or_not(tmp_path):
    kinds, records = await many_runs_through(tmp_path, ["batch"])
    assert len(records) == 30 and {r["status"] for r in records} == {"completed"}
    assert set(kinds) <= {"ok", "offer", "batch"}


async def test_a_provider_that_did_not_ask_never_gets_a_batch(tmp_path):
    kinds, records = await many_runs_through(tmp_path, None)
    assert len(records) == 30 and {r["status"] for r in records} == {"completed"}
    assert "batch" not in kinds and kinds.count("offer") == 30


# --- the shell's writer, forced: a socket that is busy while offers queue ------------


class BusySocket:
    """The server side of one websocket, played in memory: what the provider
    sends is fed in, what funduq writes is kept; `busy` holds writes back."""

    def __init__(self) -> None:
        self._in_send, self._in = trio.open_memory_channel[str](100)
        self.written: list[dict[str, Any]] = []
        self.wrote = trio.Event()
        self.busy: trio.Event | None = None

    async def accept(self) -> None:
        pass

    async def receive(self) -> str:
        return await self._in.receive()

    async def send(self, text: str) -> None:
        if self.busy is not None:
            await self.busy.wait()
        self.written.append(json.loads(text))
        self.wrote.set()
        self.wrote = trio.Event()

    async def close(self, code: int, reason: str) -> None:
        pass

    async def next_written(self, kind: str) -> dict[str, Any]:
        with trio.fail_after(100):
            while not any(m["kind"] == kind for m in self.written):
                await self.wrote.wait()
        return next(m for m in self.written if m["kind"] == kind)


async def offers_written_while_busy(tmp_path, extensions: list[str] | None) -> list[Any]:
    """Attach a provider through ProviderSocket over a BusySocket, make the
    socket busy, start three runs, free it: the messages written after."""
    provider = Identity.generate()
    async with broker(tmp_path) as funduq:
        ws = BusySocket()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ProviderSocket(ws, funduq).run)
            hello = await ws.next_written("hello")
            nonce = new_nonce()
            proof = provider.sign(
                provider_connect_payload(hello["funduqKey"], hello["nonce"], nonce)
            )
            await ws._in_send.send(
                json.dumps(
                    {
                        "kind": "connect",
                        "publicKey": provider.public_key_hex,
                        "nonce": nonce,
                        "proof": proof,
                        "maxConcurrentRuns": None,
                        "extensions": extensions,
                    }
                )
            )
            await ws._in_send.send(
                json.dumps(
                    {
                        "kind": "register",
                        "id": "r1",
                        "agents": [
                            {"name": "echo", "description": None, "card": None, "metadata": None}
                        ],
                    }
                )
            )
            await ws.next_written("ok")
            await quiet()
            ws.busy = trio.Event()
            before = len(ws.written)
            for i in range(3):
                await funduq.start_run(provider.public_key_hex, "echo", broker_input(f"run {i}"))
            await quiet()
            ws.busy.set()
            await quiet()
            nursery.cancel_scope.cancel()
    return ws.written[before:]


async def test_offers_queued_while_the_socket_is_busy_go_out_as_one_batch(tmp_path, mock_clock):
    first, *rest = await offers_written_while_busy(tmp_path, ["batch"])
    # The writer had taken the first offer when the socket stalled; the
    # other two waited and left together.
    assert first["kind"] == "offer"
    (batch,) = rest
    assert batch["kind"] == "batch" and [f["kind"] for f in batch["frames"]] == ["offer"] * 2
    run_ids = [first["run"]["runId"], *(f["run"]["runId"] for f in batch["frames"])]
    assert len(set(run_ids)) == 3


async def test_to_a_provider_without_the_extension_each_offer_goes_alone(tmp_path, mock_clock):
    messages = await offers_written_while_busy(tmp_path, None)
    assert [m["kind"] for m in messages] == ["offer"] * 3
