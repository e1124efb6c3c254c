"""The bounds of docs/limits.md: what a caller or a provider can make funduq
hold, and for how long a connection may stay without saying who it is.

Each bound is driven through the real server (real HTTP, real WebSockets, the
real record) and asserted as the refused party sees it: the status and JSON
code, the JSON-RPC error, the `err` or `connect.err` frame and close code.
The handshake deadline is also checked under trio's MockClock, with
`ProviderSocket` over an in-memory socket.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
from a2a.utils.errors import UnsupportedOperationError
from broker_support import (
    AGENT,
    Provider,
    accepted,
    broker,
    interrupt_finish,
    last_offer_for,
    quiet,
    reply,
    resume_input,
    start,
    status_of,
)
from broker_support import user_input as broker_input
from support import http_client, post_sse, raw_provider, running_server, user_input
from test_a2a_door import a2a_client, send, send_blocking, send_request
from test_provider_link import Raw, dial

from funduq_trio.broker.errors import AgentQueuedRunsLimit, QueuedRunsLimit
from funduq_trio.broker.providers import agents_to_forget
from funduq_trio.config import Settings
from funduq_trio.identity import Identity, new_nonce, provider_connect_payload
from funduq_trio.protocol import frames as f
from funduq_trio.protocol.link import CLOSE_POLICY, CLOSE_TRY_LATER, LinkMachine, State
from funduq_trio.web.provider_socket import ProviderSocket

# A safety net against a hung test, never a behaviour clock.
NET = 15
ASK = [
    {
        "id": "ask-1",
        "reason": "approval",
        "message": "Proceed?",
        "expiresAt": "2030-06-01T00:00:00Z",
    }
]


async def until(check: Any) -> None:
    """Wait (bounded) for something the server does on its own to be true."""
    with trio.fail_after(NET):
        while not await check():
            await trio.sleep(0.01)


async def status_is(http: Any, run_id: str, status: str) -> bool:
    return (await http.get(f"/runs/{run_id}")).json()["status"] == status


# --- runs waiting in funduq ---------------------------------------------------------


async def test_runs_waiting_for_one_agent_are_bounded_and_a_refused_run_leaves_no_trace(tmp_path):
    async with (
        running_server(tmp_path, max_queued_runs_per_agent=2) as info,
        http_client(info) as http,
        raw_provider(info, ["echo", "other"], max_concurrent_runs=1) as provider,
    ):
        async with a2a_client(info, provider.fingerprint, "echo", streaming=False) as client:
            await send_blocking(client, send_request("one", immediately=True))
            await send_blocking(client, send_request("two", immediately=True))
            with pytest.raises(UnsupportedOperationError) as refused:
                await send(client, send_request("three", immediately=True))
        assert refused.value.data == {
            "reason": "agent_queued_runs_limit",
            "setting": "FUNDUQ_MAX_QUEUED_RUNS_PER_AGENT",
            "limit": "2",
        }
        response, events = await post_sse(
            http, f"/agui/{provider.key}/echo", user_input("four", thread_id="caller-four")
        )
        assert response.status_code == 503 and events == []
        error = response.json()["error"]
        assert error["code"] == "agent_queued_runs_limit"
        assert error["details"] == {"setting": "FUNDUQ_MAX_QUEUED_RUNS_PER_AGENT", "limit": 2}
        # Nothing of the refused runs was recorded: no run, no thread, no message.
        runs = await info.funduq.list_runs(limit=100)
        assert len(runs) == 2
        texts = [
            m["content"]
            for r in runs
            for m in (await http.get(f"/threads/{r['threadId']}")).json()["messages"]
        ]
        assert sorted(texts) == ["one", "two"]

        # Another agent of the same provider has its own bound.
        async with a2a_client(info, provider.fingerprint, "other", streaming=False) as client:
            await send_blocking(client, send_request("elsewhere", immediately=True))

        # A run the provider takes no longer waits: its place is free again.
        offer = await provider.next_offer()
        await provider.answer(offer, "accepted")
        await until(lambda: status_is(http, offer["runId"], "running"))
        async with a2a_client(info, provider.fingerprint, "echo", streaming=False) as client:
            await send_blocking(client, send_request("five", immediately=True))


async def test_runs_waiting_in_all_are_bounded(tmp_path):
    async with (
        running_server(tmp_path, max_queued_runs=2) as info,
        http_client(info) as http,
        raw_provider(info, ["a", "b", "c"], max_concurrent_runs=0) as provider,
    ):
        for agent in ("a", "b"):
            async with a2a_client(info, provider.fingerprint, agent, streaming=False) as client:
                await send_blocking(client, send_request(agent, immediately=True))
        response, _ = await post_sse(http, f"/agui/{provider.key}/c", user_input("c"))
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "queued_runs_limit"
        assert len(await info.funduq.list_runs(limit=100)) == 2


async def test_input_held_by_waiting_runs_is_bounded_for_a_provider_with_no_room(tmp_path):
    """The issue's case: a provider declaring no room, and callers sending
    large inputs that would all wait in funduq's memory."""
    big = "x" * 100_000
    async with (
        running_server(tmp_path, max_queued_input_bytes=250_000) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"], max_concurrent_runs=0) as provider,
    ):
        async with a2a_client(info, provider.fingerprint, "echo", streaming=False) as client:
            for _ in range(2):
                await send_blocking(client, send_request(big, immediately=True))
            with pytest.raises(UnsupportedOperationError) as refused:
                await send(client, send_request(big, immediately=True))
            assert refused.value.data["reason"] == "queued_input_bytes_limit"
            assert refused.value.data["setting"] == "FUNDUQ_MAX_QUEUED_INPUT_BYTES"
            # A small input still fits.
            await send_blocking(client, send_request("small", immediately=True))
        response, _ = await post_sse(http, f"/agui/{provider.key}/echo", user_input(big))
        assert response.status_code == 503
        assert response.json()["error"]["code"] == "queued_input_bytes_limit"
        assert len(await info.funduq.list_runs(limit=100)) == 3
        assert info.funduq.waiting.bytes < 250_000


# --- events a live run holds in memory -------------------------------------------------


def custom(i: int) -> dict[str, Any]:
    return {"type": "CUSTOM", "name": "n", "value": i}


async def test_a_follower_behind_the_feed_reads_the_rest_from_the_record_in_order(tmp_path):
    count = 40
    async with (
        running_server(tmp_path, max_feed_events=5) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        funduq = info.funduq
        async with a2a_client(info, provider.fingerprint, "echo", streaming=False) as client:
            task = await send_blocking(client, send_request("go", immediately=True))
        offer = await provider.next_offer()
        await provider.answer(offer, "accepted")
        run_id = task.id
        assert offer["runId"] == run_id
        # A slow follower: it reads one burst, then nothing while the run goes on.
        follower = funduq.follow(run_id)
        await provider.report(
            run_id, {"type": "RUN_STARTED", "threadId": task.context_id, "runId": run_id}
        )
        with trio.fail_after(NET):
            seen = list(await follower.__anext__())
        for i in range(count):
            await provider.report(run_id, custom(i))
        lane = funduq.lanes[run_id]
        with trio.fail_after(NET):
            while lane.feed.events[-1][0] < count + 1:
                await lane.feed.changed()
        # Memory holds only the latest events...
        assert len(lane.feed.events) == 5
        assert [seq for seq, _ in lane.feed.events] == list(range(count - 3, count + 2))
        # ...and the follower still reads every one, in order, none twice.
        await provider.report(
            run_id, {"type": "RUN_FINISHED", "threadId": task.context_id, "runId": run_id}
        )
        await provider.finish(run_id)
        with trio.fail_after(NET):
            async for burst in follower:
                seen.extend(burst)
        assert [seq for seq, _ in seen] == list(range(1, count + 3))
        assert [event.get("value") for _, event in seen[1:-1]] == list(range(count))
        record = (await http.get(f"/runs/{run_id}")).json()
        assert record["status"] == "completed" and len(record["events"]) == count + 2


async def test_a_live_stream_relays_every_event_with_a_tiny_feed(tmp_path):
    async with (
        running_server(tmp_path, max_feed_events=2) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        results: list[Any] = []

        async def caller() -> None:
            results.append(await post_sse(http, f"/agui/{provider.key}/echo", user_input()))

        async with trio.open_nursery() as nursery:
            nursery.start_soon(caller)
            offer = await provider.next_offer()
            await provider.answer(offer, "accepted")
            run_id, thread_id = offer["runId"], offer["threadId"]
            await provider.play(
                offer,
                [
                    {"type": "RUN_STARTED", "threadId": thread_id, "runId": run_id},
                    *(custom(i) for i in range(30)),
                    {"type": "RUN_FINISHED", "threadId": thread_id, "runId": run_id},
                ],
            )
        ((response, events),) = results
        assert response.status_code == 200
        assert [e["type"] for e in events] == ["RUN_STARTED", *["CUSTOM"] * 30, "RUN_FINISHED"]
        assert [e["value"] for e in events[1:-1]] == list(range(30))


async def test_reply_text_kept_for_the_history_is_bounded_while_the_record_keeps_all(tmp_path):
    """A provider streaming more reply text than a caller could send back as
    one message: the thread's history keeps FUNDUQ_MAX_BODY_BYTES of it, the
    record every event, and the run completes."""
    limit = 4096
    async with (
        running_server(tmp_path, max_body_bytes=limit) as info,
        http_client(info) as http,
        raw_provider(info, ["echo"]) as provider,
    ):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(post_sse, http, f"/agui/{provider.key}/echo", user_input())
            offer = await provider.next_offer()
            await provider.answer(offer, "accepted")
            run_id, thread_id = offer["runId"], offer["threadId"]
            deltas = [
                {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m1", "delta": "x" * 1000}
                for _ in range(12)
            ]
            await provider.play(
                offer,
                [
                    {"type": "RUN_STARTED", "threadId": thread_id, "runId": run_id},
                    {"type": "TEXT_MESSAGE_START", "messageId": "m1", "role": "assistant"},
                    *deltas,
                    {"type": "TEXT_MESSAGE_END", "messageId": "m1"},
                    {"type": "RUN_FINISHED", "threadId": thread_id, "runId": run_id},
                ],
            )
        run = await info.funduq.wait_run(run_id)
        assert run["status"] == "completed"
        recorded = (await http.get(f"/runs/{run_id}")).json()["events"]
        assert sum(len(e["event"].get("delta", "")) for e in recorded) == 12_000
        thread = (await http.get(f"/threads/{thread_id}")).json()
        (reply,) = [m for m in thread["messages"] if m["id"] == "m1"]
        assert reply["role"] == "assistant"
        assert 0 < len(reply["content"]) <= limit
        assert set(reply["content"]) == {"x"}


# --- agents per provider ------------------------------------------------------------------


async def roster(http: Any) -> set[tuple[str, bool]]:
    return {(a["name"], a["online"]) for a in (await http.get("/agents")).json()["agents"]}


async def test_a_register_listing_too_many_agents_is_refused_and_changes_nothing(tmp_path):
    async with (
        running_server(tmp_path, max_agents_per_provider=3) as info,
        http_client(info) as http,
        dial(info) as raw,
    ):
        assert (await raw.connect())["kind"] == "connect.ok"
        assert (await raw.register("a", "b"))["kind"] == "ok"
        reply = await raw.register("a", "b", "c", "d")
        assert reply["kind"] == "err"
        assert "FUNDUQ_MAX_AGENTS_PER_PROVIDER" in reply["reason"] and "4" in reply["reason"]
        assert await roster(http) == {("a", True), ("b", True)}
        # The link stays up and a register within the bound is fine.
        assert (await raw.register("a", "b", "c"))["kind"] == "ok"
        assert await roster(http) == {("a", True), ("b", True), ("c", True)}


async def test_one_key_cannot_grow_the_roster_past_the_bound(tmp_path):
    async with (
        running_server(tmp_path, max_agents_per_provider=3) as info,
        http_client(info) as http,
        dial(info) as raw,
    ):
        assert (await raw.connect())["kind"] == "connect.ok"
        assert (await raw.register("a", "b", "c"))["kind"] == "ok"
        # Agents no longer served stay listed offline while there is room:
        # the most recently first recorded first.
        assert (await raw.register("d", "e"))["kind"] == "ok"
        assert await roster(http) == {("c", False), ("d", True), ("e", True)}
        for i in range(20):
            assert (await raw.register(f"x{i}"))["kind"] == "ok"
            assert len(await roster(http)) <= 3
        assert await roster(http) == {("x17", False), ("x18", False), ("x19", True)}
    # The record holds no more than the roster shows (after a restart too).
    async with running_server(tmp_path) as info, http_client(info) as http:
        assert await roster(http) == {("x17", False), ("x18", False), ("x19", False)}


async def test_a_roster_read_again_brings_back_no_agent_this_node_let_go(tmp_path, monkeypatch):
    """A node of a cluster reads the roster again whenever any node's changes
    (`Providers.refresh`); a read taken before this node's own register let
    agents go must not bring them back past the bound (the interleaving is
    forced: the read answers what the record held before the register)."""
    async with (
        running_server(tmp_path, max_agents_per_provider=3) as info,
        http_client(info) as http,
        dial(info) as raw,
    ):
        assert (await raw.connect())["kind"] == "connect.ok"
        assert (await raw.register("a", "b", "c"))["kind"] == "ok"
        record = info.funduq.record
        before = await record.providers_and_agents()
        assert (await raw.register("d", "e"))["kind"] == "ok"

        async def stale_read() -> Any:
            return before

        monkeypatch.setattr(record, "providers_and_agents", stale_read)
        await info.funduq.providers.refresh()
        assert await roster(http) == {("c", False), ("d", True), ("e", True)}


async def test_agents_no_longer_served_are_kept_only_within_a_frame_of_bytes(tmp_path):
    async with (
        running_server(tmp_path, max_agents_per_provider=10, max_frame_bytes=20_000) as info,
        http_client(info) as http,
        dial(info) as raw,
    ):
        assert (await raw.connect())["kind"] == "connect.ok"
        for name in ("a", "b", "c"):
            reply = await raw.request(
                {
                    "kind": "register",
                    "agents": [
                        {"name": name, "description": "d" * 8_000, "card": None, "metadata": None}
                    ],
                }
            )
            assert reply["kind"] == "ok"
        # b and c fill the bytes one key may keep: a is forgotten.
        assert await roster(http) == {("b", False), ("c", True)}
        assert len((await http.get("/agents")).content) < 20_000


# --- links that never say who they are ------------------------------------------------------


class QuietSocket:
    """The server side of a websocket whose peer never says anything."""

    def __init__(self) -> None:
        self.inbound_send, self._inbound = trio.open_memory_channel[str](10)
        self.written: list[dict[str, Any]] = []
        self.closed: tuple[float, int, str] | None = None

    async def accept(self) -> None:
        pass

    async def receive(self) -> str:
        return await self._inbound.receive()

    async def send(self, text: str) -> None:
        self.written.append(json.loads(text))

    async def close(self, code: int, reason: str) -> None:
        self.closed = (trio.current_time(), code, reason)


async def test_the_handshake_deadline_under_a_mock_clock(tmp_path, autojump_clock):
    async with broker(tmp_path, handshake_timeout_seconds=10) as funduq:
        silent, prompt = QuietSocket(), QuietSocket()
        start = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(ProviderSocket(silent, funduq).run)
            nursery.start_soon(ProviderSocket(prompt, funduq).run)
            # The prompt one says connect just before the deadline.
            await trio.sleep(9.5)
            provider = Identity.generate()
            hello = prompt.written[0]
            nonce = new_nonce()
            proof = provider.sign(
                provider_connect_payload(hello["funduqKey"], hello["nonce"], nonce)
            )
            await prompt.inbound_send.send(
                json.dumps(
                    {
                        "kind": "connect",
                        "publicKey": provider.public_key_hex,
                        "nonce": nonce,
                        "proof": proof,
                        "maxConcurrentRuns": None,
                    }
                )
            )
            await trio.sleep(100)
            nursery.cancel_scope.cancel()
        assert [m["kind"] for m in silent.written] == ["hello", "connect.err"]
        assert "FUNDUQ_HANDSHAKE_TIMEOUT_SECONDS" in silent.written[1]["reason"]
        when, code, reason = silent.closed
        assert when - start == pytest.approx(10) and code == 1008
        assert [m["kind"] for m in prompt.written] == ["hello", "connect.ok"]
        assert prompt.closed is None


async def test_a_link_that_never_says_connect_is_closed(tmp_path):
    async with running_server(tmp_path, handshake_timeout_seconds=0.2) as info, dial(info) as raw:
        assert (await raw.recv())["kind"] == "hello"
        refused = await raw.recv()
        assert refused["kind"] == "connect.err"
        assert "FUNDUQ_HANDSHAKE_TIMEOUT_SECONDS" in refused["reason"]
        assert (await raw.closed())[0] == 1008


async def say_connect(raw: Raw) -> dict[str, Any]:
    """`connect` on a link whose hello was already read into `raw.hello`."""
    nonce = new_nonce()
    payload = provider_connect_payload(raw.hello["funduqKey"], raw.hello["nonce"], nonce)
    await raw.send(
        {
            "kind": "connect",
            "publicKey": raw.identity.public_key_hex,
            "nonce": nonce,
            "proof": raw.identity.sign(payload),
            "maxConcurrentRuns": None,
        }
    )
    return await raw.recv()


async def test_links_waiting_for_connect_are_bounded(tmp_path):
    async with (
        running_server(tmp_path, max_unauthenticated_links=2) as info,
        dial(info) as one,
        dial(info) as two,
    ):
        one.hello, two.hello = await one.recv(), await two.recv()
        async with dial(info) as three:
            refused = await three.recv()
            assert refused["kind"] == "connect.err"
            assert "FUNDUQ_MAX_UNAUTHENTICATED_LINKS" in refused["reason"]
            assert (await three.closed())[0] == 1013
        # A link that said connect no longer counts: the next one is served.
        assert (await say_connect(one))["kind"] == "connect.ok"
        async with dial(info) as four:
            four.hello = await four.recv()
            assert four.hello["kind"] == "hello"
            assert (await say_connect(four))["kind"] == "connect.ok"
        # Links that went away do not count either.
        assert (await say_connect(two))["kind"] == "connect.ok"
        async with dial(info) as five, dial(info) as six:
            assert (await five.recv())["kind"] == "hello"
            assert (await six.recv())["kind"] == "hello"


# --- slow request bodies, idle and half-open connections -----------------------------------


async def read_to_eof(stream: trio.SocketStream, within: float) -> bytes:
    data = b""
    with trio.fail_after(within):
        while chunk := await stream.receive_some(65536):
            data += chunk
    return data


@pytest.mark.parametrize("door", ["agui", "a2a"])
async def test_a_body_that_trickles_is_cut_with_408(tmp_path, door):
    async with running_server(tmp_path, body_timeout_seconds=0.3) as info:
        stream = await trio.open_tcp_stream("127.0.0.1", info.port)
        async with stream:
            await stream.send_all(
                f"POST /{door}/0123456789abcdef/echo HTTP/1.1\r\nHost: t\r\n"
                'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"th'.encode()
            )
            answer = await read_to_eof(stream, NET)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408")
        assert b"connection: close" in head.lower()
        assert json.loads(body)["error"]["code"] == "body_timeout"


async def test_idle_and_half_open_connections_are_closed(tmp_path):
    async with running_server(tmp_path, body_timeout_seconds=0.3) as info:
        # Headers that never end.
        stream = await trio.open_tcp_stream("127.0.0.1", info.port)
        async with stream:
            await stream.send_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\n")
            assert await read_to_eof(stream, 3) == b""
        # A request answered before its body came (405 here): the rest of the
        # body is never read, so the connection closes rather than wait for it.
        stream = await trio.open_tcp_stream("127.0.0.1", info.port)
        async with stream:
            await stream.send_all(
                b"POST /healthz HTTP/1.1\r\nHost: t\r\nContent-Length: 100\r\n\r\nab"
            )
            assert (await read_to_eof(stream, 3)).startswith(b"HTTP/1.1 405")
        # A keep-alive connection left idle after its request.
        stream = await trio.open_tcp_stream("127.0.0.1", info.port)
        async with stream:
            await stream.send_all(b"GET /healthz HTTP/1.1\r\nHost: t\r\n\r\n")
            assert (await read_to_eof(stream, 3)).startswith(b"HTTP/1.1 200")


# --- the waiting-runs count, forced interleavings ------------------------------------------


async def test_two_runs_racing_for_the_last_place_cannot_both_take_it(tmp_path, mock_clock):
    async with broker(tmp_path, max_queued_runs=1) as funduq:
        provider = await Provider(funduq, max_concurrent=0).attach()
        outcomes: list[str] = []

        async def start(text: str) -> None:
            try:
                await funduq.start_run(provider.key, AGENT, broker_input(text))
            except QueuedRunsLimit:
                outcomes.append("refused")
            else:
                outcomes.append("queued")

        # Both are checked before either's record write finishes.
        async with trio.open_nursery() as nursery:
            nursery.start_soon(start, "one")
            nursery.start_soon(start, "two")
        assert sorted(outcomes) == ["queued", "refused"]
        assert len(await funduq.list_runs()) == 1


async def test_runs_queued_again_at_a_restart_count(tmp_path, mock_clock):
    async with broker(tmp_path) as funduq:
        provider = await Provider(funduq, max_concurrent=0).attach()
        for text in ("one", "two"):
            await funduq.start_run(provider.key, AGENT, broker_input(text))
        await quiet()
    async with broker(tmp_path, max_queued_runs=2) as funduq:
        assert {r["status"] for r in await funduq.list_runs()} == {"queued"}
        with pytest.raises(QueuedRunsLimit):
            await funduq.start_run(provider.key, AGENT, broker_input("three"))
        assert len(await funduq.list_runs()) == 2


def test_bad_bounds_are_refused_at_start():
    bad = Settings(
        max_queued_runs=0,
        max_feed_events=0,
        max_agents_per_provider=-1,
        max_unauthenticated_links=0,
        max_queued_input_bytes=0,
        max_queued_runs_per_agent=0,
        handshake_timeout_seconds=0,
        body_timeout_seconds=-1,
    )
    problems = " ".join(bad.problems())
    for name in (
        "MAX_QUEUED_RUNS=",
        "MAX_FEED_EVENTS",
        "MAX_AGENTS_PER_PROVIDER",
        "MAX_UNAUTHENTICATED_LINKS",
        "MAX_QUEUED_INPUT_BYTES",
        "MAX_QUEUED_RUNS_PER_AGENT",
        "HANDSHAKE_TIMEOUT_SECONDS",
        "BODY_TIMEOUT_SECONDS",
    ):
        assert f"FUNDUQ_{name}" in problems
    assert Settings().problems() == []


async def test_answering_a_pause_waits_again_so_it_counts(tmp_path, mock_clock):
    async with broker(tmp_path, max_queued_runs_per_agent=1) as funduq:
        p = await Provider(funduq, max_concurrent=1).attach()
        paused = await accepted(funduq, p)
        p.stream(
            paused.run_id,
            *reply(paused.run_id, paused.thread_id)[:-1],
            interrupt_finish(paused.run_id, paused.thread_id, ASK),
        )
        assert await status_of(funduq, paused.run_id) == "input-required"
        waiting = await start(funduq, p)  # offered, not yet answered: it waits
        messages = len((await funduq.get_thread(paused.thread_id))["messages"])
        with pytest.raises(AgentQueuedRunsLimit):
            await funduq.answer_pause(paused.run_id, resume_input("ask-1"))
        assert await status_of(funduq, paused.run_id) == "input-required"
        assert len((await funduq.get_thread(paused.thread_id))["messages"]) == messages
        # Once the other run is taken, the answer fits.
        p.session.answer(last_offer_for(p.link, waiting.run_id), "accepted")
        await quiet()
        await funduq.answer_pause(paused.run_id, resume_input("ask-1"))
        assert await status_of(funduq, paused.run_id) in ("queued", "offering")


# --- the I/O-free cores ------------------------------------------------------------------------


def test_the_link_machine_owns_both_handshake_refusals():
    funduq = Identity.generate()
    late = LinkMachine(funduq, new_nonce())
    send, close = late.handshake_timed_out(10)
    assert isinstance(send.frame, f.ConnectErr) and "10 s" in send.frame.reason
    assert close.code == CLOSE_POLICY and late.state is State.CLOSED
    assert late.receive("{}") == []  # closed: nothing more is read

    full = LinkMachine(funduq, new_nonce())
    send, close = full.no_room_to_wait(256)
    assert isinstance(send.frame, f.ConnectErr) and close.code == CLOSE_TRY_LATER
    assert full.state is State.CLOSED

    # A link that attached before its deadline is not touched by it.
    provider = Identity.generate()
    attached = LinkMachine(funduq, "n" * 32)
    nonce = new_nonce()
    proof = provider.sign(provider_connect_payload(funduq.public_key_hex, "n" * 32, nonce))
    attached.receive(
        json.dumps(
            {
                "kind": "connect",
                "publicKey": provider.public_key_hex,
                "nonce": nonce,
                "proof": proof,
                "maxConcurrentRuns": None,
            }
        )
    )
    assert attached.state is State.ATTACHED
    assert attached.handshake_timed_out(10) == [] and attached.state is State.ATTACHED


def test_a_keys_roster_keeps_what_it_lists_and_the_newest_of_the_rest_within_bounds():
    recorded = [("a", 10), ("b", 10), ("c", 10), ("d", 10)]  # oldest first
    assert agents_to_forget(recorded, {"d": 10, "e": 10}, 3, 10_000) == ["b", "a"]
    assert agents_to_forget(recorded, {"e": 10}, 10, 25) == ["c", "b", "a"]
    assert agents_to_forget(recorded, {"a": 10}, 10, 10_000) == []
