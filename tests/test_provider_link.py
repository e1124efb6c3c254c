"""The provider link end to end: a real server on a loopback port, and a
provider played frame by frame over a real WebSocket (trio-websocket, not the
SDK), so every assertion is about what travels on the wire or what a caller
reads back from GET /runs and GET /agents."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import trio
from support import http_client, raw_provider, running_server, user_input
from trio_websocket import ConnectionClosed, WebSocketConnection, open_websocket_url

from funduq_trio.identity import (
    Identity,
    funduq_connect_payload,
    new_nonce,
    provider_connect_payload,
    verify,
)

# A safety net against a hung test, never a behaviour clock.
NET = 15


class Raw:
    """A provider link played by hand: frames are plain dicts."""

    def __init__(self, ws: WebSocketConnection, identity: Identity) -> None:
        self.ws = ws
        self.identity = identity
        self.hello: dict[str, Any] = {}
        self._ids = 0

    async def send(self, frame: dict[str, Any] | str) -> None:
        await self.ws.send_message(frame if isinstance(frame, str) else json.dumps(frame))

    async def recv(self) -> dict[str, Any]:
        with trio.fail_after(NET):
            return json.loads(await self.ws.get_message())

    async def closed(self) -> tuple[int, str | None]:
        """Read until funduq closes the link; its close code and reason."""
        with trio.fail_after(NET):
            while True:
                try:
                    await self.ws.get_message()
                except ConnectionClosed as exc:
                    return exc.reason.code, exc.reason.reason

    async def connect(
        self,
        *,
        proof_nonce: str | None = None,
        max_runs: int | None = None,
        funduq_key: str | None = None,
    ) -> dict[str, Any]:
        self.hello = await self.recv()
        nonce = new_nonce()
        payload = provider_connect_payload(
            self.hello["funduqKey"] if funduq_key is None else funduq_key,
            proof_nonce or self.hello["nonce"],
            nonce,
        )
        await self.send(
            {
                "kind": "connect",
                "publicKey": self.identity.public_key_hex,
                "nonce": nonce,
                "proof": self.identity.sign(payload),
                "maxConcurrentRuns": max_runs,
            }
        )
        reply = await self.recv()
        reply["_nonce"] = nonce
        return reply

    async def request(self, frame: dict[str, Any]) -> dict[str, Any]:
        """Send a request with a fresh id and return the reply to it, skipping
        nothing else: the caller knows no other frame is due."""
        self._ids += 1
        frame = {**frame, "id": f"req-{self._ids}"}
        await self.send(frame)
        reply = await self.recv()
        assert reply.get("id") == frame["id"], reply
        return reply

    async def register(self, *names: str) -> dict[str, Any]:
        agents = [
            {"name": n, "description": f"{n} agent", "card": None, "metadata": None} for n in names
        ]
        return await self.request({"kind": "register", "agents": agents})

    async def offer(self) -> dict[str, Any]:
        frame = await self.recv()
        assert frame["kind"] == "offer", frame
        return frame

    async def answer(self, offer: dict[str, Any], verdict: str, reason: str | None = None) -> None:
        await self.send(
            {"kind": "ok", "id": offer["id"], "verdict": verdict, "reason": reason, "payload": None}
        )

    async def report(self, run_id: str, event: dict[str, Any], seq: int | None = None) -> None:
        await self.send({"kind": "report", "runId": run_id, "event": event, "seq": seq})

    async def finish(self, run_id: str) -> None:
        await self.send({"kind": "finish", "runId": run_id})


@contextlib.asynccontextmanager
async def dial(info: Any, identity: Identity | None = None) -> AsyncIterator[Raw]:
    async with open_websocket_url(info.provider_url) as ws:
        yield Raw(ws, identity or Identity.generate())


@contextlib.asynccontextmanager
async def attached(
    info: Any, *agents: str, identity: Identity | None = None, max_runs: int | None = None
) -> AsyncIterator[Raw]:
    async with dial(info, identity) as raw:
        reply = await raw.connect(max_runs=max_runs)
        assert reply["kind"] == "connect.ok", reply
        if agents:
            assert (await raw.register(*agents))["kind"] == "ok"
        yield raw


def started(run: dict[str, Any]) -> dict[str, Any]:
    return {"type": "RUN_STARTED", "threadId": run["threadId"], "runId": run["runId"]}


def finished(run: dict[str, Any]) -> dict[str, Any]:
    return {"type": "RUN_FINISHED", "threadId": run["threadId"], "runId": run["runId"]}


async def first_event(info: Any, run_id: str) -> dict[str, Any]:
    """Wait until the run's first event is in the record (so it is running)."""
    with trio.fail_after(NET):
        async with contextlib.aclosing(info.funduq.follow(run_id)) as bursts:
            async for burst in bursts:
                return burst[0][1]
    raise AssertionError("the run ended without events")


async def get_run(http: Any, run_id: str) -> dict[str, Any]:
    response = await http.get(f"/runs/{run_id}")
    assert response.status_code == 200, response.text
    return response.json()


# --- handshake --------------------------------------------------------------


async def test_good_handshake_proves_both_keys(tmp_path):
    async with running_server(tmp_path) as info, dial(info) as raw:
        reply = await raw.connect(max_runs=2)
        hello = raw.hello
        assert hello["kind"] == "hello"
        assert hello["funduqKey"] == info.funduq.identity.public_key_hex
        assert len(hello["nonce"]) >= 16
        assert reply["kind"] == "connect.ok"
        assert verify(
            hello["funduqKey"],
            funduq_connect_payload(hello["nonce"], reply["_nonce"]),
            reply["answer"],
        )
        # attached: a register is answered ok
        assert (await raw.register("echo"))["kind"] == "ok"


async def test_each_connection_gets_a_fresh_nonce(tmp_path):
    async with running_server(tmp_path) as info, dial(info) as one, dial(info) as two:
        assert (await one.recv())["nonce"] != (await two.recv())["nonce"]


async def test_bad_proof_is_refused_and_closed(tmp_path):
    async with running_server(tmp_path) as info, dial(info) as raw:
        hello = await raw.recv()
        impostor = Identity.generate()
        nonce = new_nonce()
        payload = provider_connect_payload(hello["funduqKey"], hello["nonce"], nonce)
        await raw.send(
            {
                "kind": "connect",
                "publicKey": raw.identity.public_key_hex,  # claims this key...
                "nonce": nonce,
                "proof": impostor.sign(payload),  # ...signs with another
                "maxConcurrentRuns": None,
            }
        )
        reply = await raw.recv()
        assert reply["kind"] == "connect.err" and "proof does not verify" in reply["reason"]
        code, _ = await raw.closed()
        assert code == 1008


async def test_proof_over_another_connections_nonce_is_refused(tmp_path):
    async with running_server(tmp_path) as info, dial(info) as other, dial(info) as raw:
        stolen = (await other.recv())["nonce"]
        reply = await raw.connect(proof_nonce=stolen)
        assert reply["kind"] == "connect.err" and "proof does not verify" in reply["reason"]
        assert (await raw.closed())[0] == 1008


async def test_proof_for_another_funduq_is_refused(tmp_path):
    async with running_server(tmp_path) as info, dial(info) as raw:
        reply = await raw.connect(funduq_key=Identity.generate().public_key_hex)
        assert reply["kind"] == "connect.err"


async def test_key_not_on_the_allowlist_is_refused(tmp_path):
    allowed = Identity.generate()
    async with running_server(tmp_path, provider_keys=frozenset({allowed.public_key_hex})) as info:
        async with dial(info) as raw:
            reply = await raw.connect()
            assert reply["kind"] == "connect.err"
            assert reply["reason"] == "key not allowed on this funduq"
            assert (await raw.closed())[0] == 1008
        async with dial(info, allowed) as raw:
            assert (await raw.connect())["kind"] == "connect.ok"


async def test_frames_before_connect_are_refused(tmp_path):
    async with running_server(tmp_path) as info, dial(info) as raw:
        await raw.recv()  # hello
        await raw.send({"kind": "register", "id": "r1", "agents": []})
        reply = await raw.recv()
        assert reply["kind"] == "connect.err" and "connect" in reply["reason"]
        assert (await raw.closed())[0] == 1008


# --- registration -----------------------------------------------------------


async def test_register_replaces_what_the_link_serves(tmp_path):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        attached(info, "alpha", "beta") as raw,
    ):
        roster = (await http.get("/agents")).json()["agents"]
        assert {(a["name"], a["online"]) for a in roster} == {("alpha", True), ("beta", True)}
        assert all(a["provider"] == raw.identity.public_key_hex for a in roster)
        assert (await raw.register("beta"))["kind"] == "ok"
        roster = (await http.get("/agents")).json()["agents"]
        assert {(a["name"], a["online"]) for a in roster} == {("alpha", False), ("beta", True)}


async def test_a_bad_register_is_answered_err_and_the_link_stays(tmp_path):
    async with running_server(tmp_path) as info, attached(info) as raw:
        reply = await raw.request({"kind": "register", "agents": [{"name": "no/slashes"}]})
        assert reply["kind"] == "err" and "agents.0.name" in reply["reason"]
        assert (await raw.register("echo"))["kind"] == "ok"


# --- offers and answers -----------------------------------------------------


async def test_offers_carry_fresh_ids_and_the_run(tmp_path):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        attached(info, "echo") as raw,
    ):
        fp = raw.identity.fingerprint
        one = await info.funduq.start_run(fp, "echo", user_input("one"))
        offer1 = await raw.offer()
        two = await info.funduq.start_run(fp, "echo", user_input("two"))
        offer2 = await raw.offer()
        assert offer1["id"] != offer2["id"]
        for offer, ticket in ((offer1, one), (offer2, two)):
            run = offer["run"]
            assert offer["id"] != ticket.run_id
            assert run["runId"] == ticket.run_id and run["threadId"] == ticket.thread_id
            assert run["agentName"] == "echo"
            assert run["runInput"]["runId"] == ticket.run_id
            assert run["runInput"]["messages"][-1]["content"] in ("one", "two")
            assert set(run) == {"runId", "threadId", "agentName", "runInput", "metadata"}
        await raw.answer(offer1, "accepted")
        await raw.answer(offer2, "refused", "I never take twos")
        record = await info.funduq.wait_run(two.run_id)
        assert record["status"] == "failed"
        assert record["metadata"]["failureReason"] == "I never take twos"
        run = offer1["run"]
        await raw.report(run["runId"], started(run), 1)
        await raw.report(run["runId"], finished(run), 2)
        await raw.finish(run["runId"])
        await info.funduq.wait_run(one.run_id)
        record = await get_run(http, one.run_id)
        assert record["status"] == "completed"
        assert [e["event"]["type"] for e in record["events"]] == ["RUN_STARTED", "RUN_FINISHED"]


async def test_a_second_answer_closes_the_link(tmp_path):
    async with running_server(tmp_path) as info, attached(info, "echo") as raw:
        await info.funduq.start_run(raw.identity.fingerprint, "echo", user_input())
        offer = await raw.offer()
        await raw.answer(offer, "accepted")
        await raw.answer(offer, "accepted")
        code, reason = await raw.closed()
        assert code == 1008 and "second answer" in reason


async def test_an_answer_to_an_offer_never_made_closes_the_link(tmp_path):
    async with running_server(tmp_path) as info, attached(info, "echo") as raw:
        await raw.answer({"id": "offer_invented"}, "accepted")
        code, reason = await raw.closed()
        assert code == 1008 and "never made" in reason


async def test_cancel_reaches_the_provider_as_a_cancel_frame(tmp_path):
    async with running_server(tmp_path) as info, attached(info, "echo") as raw:
        ticket = await info.funduq.start_run(raw.identity.fingerprint, "echo", user_input())
        offer = await raw.offer()
        await raw.answer(offer, "accepted")
        await raw.report(ticket.run_id, started(offer["run"]))
        await first_event(info, ticket.run_id)
        await info.funduq.cancel_run(ticket.run_id)
        assert await raw.recv() == {"kind": "cancel", "runId": ticket.run_id}
        await raw.finish(ticket.run_id)  # stopped without RUN_FINISHED
        record = await info.funduq.wait_run(ticket.run_id)
        assert record["status"] == "cancelled"


# --- speaking for runs ------------------------------------------------------


async def test_reports_for_a_run_another_provider_holds_are_ignored(tmp_path):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        attached(info, "echo") as holder,
        attached(info, "other") as stranger,
    ):
        ticket = await info.funduq.start_run(holder.identity.fingerprint, "echo", user_input())
        offer = await holder.offer()
        await holder.answer(offer, "accepted")
        run = offer["run"]
        await holder.report(run["runId"], started(run), 1)
        await first_event(info, ticket.run_id)

        await stranger.report(run["runId"], {"type": "CUSTOM", "name": "x", "value": 1})
        await stranger.report(run["runId"], finished(run))
        await stranger.finish(run["runId"])
        # The stranger's link handles frames in order: once this is answered,
        # the three above were handled (and ignored); the link is still up.
        assert (await stranger.register("other"))["kind"] == "ok"
        record = await get_run(http, ticket.run_id)
        assert record["status"] == "running"
        assert [e["event"]["type"] for e in record["events"]] == ["RUN_STARTED"]

        await holder.report(run["runId"], finished(run), 2)
        await holder.finish(run["runId"])
        await info.funduq.wait_run(ticket.run_id)
        record = await get_run(http, ticket.run_id)
        assert record["status"] == "completed"
        assert [e["event"]["type"] for e in record["events"]] == ["RUN_STARTED", "RUN_FINISHED"]


async def test_reports_for_a_run_offered_but_not_accepted_are_ignored(tmp_path):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        attached(info, "echo") as raw,
    ):
        ticket = await info.funduq.start_run(raw.identity.fingerprint, "echo", user_input())
        offer = await raw.offer()
        await raw.report(ticket.run_id, started(offer["run"]))  # before answering
        await raw.finish(ticket.run_id)
        assert (await raw.register("echo"))["kind"] == "ok"
        await raw.answer(offer, "accepted")
        await raw.report(ticket.run_id, finished(offer["run"]))
        await raw.finish(ticket.run_id)
        await info.funduq.wait_run(ticket.run_id)
        record = await get_run(http, ticket.run_id)
        assert record["status"] == "completed"
        assert [e["event"]["type"] for e in record["events"]] == ["RUN_FINISHED"]


# --- malformed and oversized frames -----------------------------------------


async def test_a_malformed_frame_with_an_id_is_answered_err(tmp_path):
    async with running_server(tmp_path) as info, attached(info, "echo") as raw:
        await raw.send({"kind": "ok", "id": "x1", "verdict": "perhaps"})
        reply = await raw.recv()
        assert reply["kind"] == "err" and reply["id"] == "x1" and "verdict" in reply["reason"]
        await raw.send({"kind": "teleport", "id": "x2"})
        reply = await raw.recv()
        assert reply == {"kind": "err", "id": "x2", "reason": "unknown frame kind 'teleport'"}
        assert (await raw.register("echo"))["kind"] == "ok"  # still attached


async def test_a_malformed_frame_without_an_id_closes_the_link(tmp_path):
    async with running_server(tmp_path) as info, attached(info, "echo") as raw:
        await raw.send("this is not json")
        code, reason = await raw.closed()
        assert code == 1008 and "not JSON" in reason


async def test_an_oversized_frame_closes_the_link(tmp_path):
    async with running_server(tmp_path, max_frame_bytes=4096) as info:
        async with attached(info, "echo") as raw:
            ticket = await info.funduq.start_run(raw.identity.fingerprint, "echo", user_input())
            offer = await raw.offer()
            await raw.answer(offer, "accepted")
            await raw.report(ticket.run_id, started(offer["run"]))
            await first_event(info, ticket.run_id)
            big = {"type": "CUSTOM", "name": "blob", "value": "x" * 5000}
            await raw.report(ticket.run_id, big)
            code, _ = await raw.closed()
            assert code == 1009
        record = await info.funduq.wait_run(ticket.run_id)
        assert record["status"] == "failed"
        assert record["metadata"]["failureReason"] == "provider_left_holding_it"
        assert all(e["event"].get("name") != "blob" for e in record["events"])


# --- replacement and leaving ------------------------------------------------


async def test_a_second_connection_under_the_same_key_replaces_the_first(tmp_path):
    me = Identity.generate()
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        attached(info, "echo", identity=me) as first,
        attached(info, identity=me) as second,
    ):
        code, reason = await first.closed()
        assert code == 1000 and "replaced" in reason
        assert (await second.register("echo"))["kind"] == "ok"
        ticket = await info.funduq.start_run(me.fingerprint, "echo", user_input())
        offer = await second.offer()
        assert offer["run"]["runId"] == ticket.run_id
        await second.answer(offer, "accepted")
        await second.report(ticket.run_id, finished(offer["run"]))
        await second.finish(ticket.run_id)
        await info.funduq.wait_run(ticket.run_id)
        assert (await get_run(http, ticket.run_id))["status"] == "completed"


async def test_a_provider_dropping_mid_run_fails_it_provider_left_holding_it(tmp_path):
    async with running_server(tmp_path) as info, http_client(info) as http:
        async with attached(info, "echo") as raw:
            ticket = await info.funduq.start_run(raw.identity.fingerprint, "echo", user_input())
            offer = await raw.offer()
            await raw.answer(offer, "accepted")
            await raw.report(ticket.run_id, started(offer["run"]))
            await first_event(info, ticket.run_id)
        # leaving the block closed the provider's side of the link
        await info.funduq.wait_run(ticket.run_id)
        record = await get_run(http, ticket.run_id)
        assert record["status"] == "failed"
        assert record["metadata"]["failureReason"] == "provider_left_holding_it"
        assert record["events"][-1]["event"]["type"] == "RUN_ERROR"
        roster = (await http.get("/agents")).json()["agents"]
        assert [(a["name"], a["online"]) for a in roster] == [("echo", False)]


# --- queries ----------------------------------------------------------------


async def test_thread_queries_are_bounded_per_link_in_number_size_and_count(tmp_path):
    """query.threadMessages: past FUNDUQ_MAX_THREAD_QUERIES_PER_LINK in flight a
    query is answered err at once (forced: the history reads wait on a gate);
    `limit: null` answers at most the newest FUNDUQ_MAX_THREAD_MESSAGES_PER_QUERY
    messages, and the reply fits the frame limit (older messages give way)."""
    async with (
        running_server(
            tmp_path,
            max_thread_queries_per_link=2,
            max_thread_messages_per_query=3,
            max_frame_bytes=4096,
        ) as info,
        raw_provider(info, ["echo"]) as raw,
    ):
        funduq = info.funduq
        ticket = await funduq.start_run(raw.identity.fingerprint, "echo", user_input("ping"))
        offer = await raw.next_offer()
        await raw.answer(offer, "declined")
        history = [{"id": f"h{i}", "role": "user", "content": "x" * 1200} for i in range(8)]
        await funduq.record.write(
            lambda c: c.executemany(
                "INSERT INTO messages (thread_id, idx, message_id, run_id, message) "
                "VALUES (?, ?, ?, ?, ?)",
                [
                    (ticket.thread_id, 100 + i, m["id"], ticket.run_id, json.dumps(m))
                    for i, m in enumerate(history)
                ],
            )
        )
        read, gate = funduq._messages, trio.Event()

        async def gated(thread_id, limit=None):
            await gate.wait()
            return await read(thread_id, limit)

        funduq._messages = gated
        query = {"kind": "query.threadMessages", "threadId": ticket.thread_id, "limit": None}
        replies, refused = [], trio.Event()
        async with trio.open_nursery() as nursery:

            async def ask():
                replies.append(await raw.request(query))
                if len(replies) == 3:
                    refused.set()

            for _ in range(5):
                nursery.start_soon(ask)
            with trio.fail_after(10):
                await refused.wait()
            assert [r["kind"] for r in replies] == ["err"] * 3
            assert "FUNDUQ_MAX_THREAD_QUERIES_PER_LINK" in replies[0]["reason"]
            gate.set()
        assert [r["kind"] for r in replies[3:]] == ["ok", "ok"]
        funduq._messages = read
        reply = await raw.request({**query, "limit": 50})
        got = [m["id"] for m in reply["payload"]["messages"]]
        # At most the newest 3, and of those only what fits a 4 KiB frame.
        assert got == ["h6", "h7"]


async def test_query_thread_messages_answers_with_the_threads_messages(tmp_path):
    async with running_server(tmp_path) as info, attached(info, "echo") as raw:
        ticket = await info.funduq.start_run(raw.identity.fingerprint, "echo", user_input("ping"))
        offer = await raw.offer()
        reply = await raw.request(
            {"kind": "query.threadMessages", "threadId": ticket.thread_id, "limit": None}
        )
        assert reply["kind"] == "ok"
        assert [m["content"] for m in reply["payload"]["messages"]] == ["ping"]
        await raw.answer(offer, "declined")
        reply = await raw.request(
            {"kind": "query.threadMessages", "threadId": "thread_nobody", "limit": 5}
        )
        assert reply["kind"] == "err"
