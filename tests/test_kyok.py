"""KYOK, the completion relay (DESIGN §9, docs/kyok.md), through the real
server: callers at both doors, agents spending their grant with the real
`openai` client (under trio) or by hand over httpx, LLM providers on the SDK
over the real link. Token expiry runs on an injected clock, never a sleep."""

from __future__ import annotations

import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import trio
import trio.testing
from support import (
    RawProvider,
    http_client,
    post_sse,
    raw_provider,
    running_server,
    sdk_provider,
    sse_events,
    user_input,
)

from funduq_trio.broker.kyok import TOKEN_SECONDS, mint_token
from funduq_trio.identity import Identity, kyok_call_payload, verify
from funduq_trio.provider import Provider, Refusal, fake_model, kyok_chat
from funduq_trio.provider.llm import fake_answer, kyok_client, kyok_http_client

SECRET = "k" * 40
V1 = {"A2A-Version": "1.0"}
CHAT = {"model": "m", "messages": [{"role": "user", "content": "ping"}]}


@contextlib.asynccontextmanager
async def llm_provider(
    info: Any, offerings: dict[str, Any] | None = None
) -> AsyncIterator[Provider]:
    """An LLM provider on the SDK serving `offerings` (default: the fake model as "fake")."""
    provider = Provider(Identity.generate(), info.provider_url)
    for name, fn in (offerings or {"fake": fake_model}).items():
        provider.add_offering(fn, name=name)
    async with trio.open_nursery() as nursery:
        await nursery.start(provider.run)
        yield provider
        nursery.cancel_scope.cancel()


def opt_in(llm: Provider, name: str = "fake", context: Any = None) -> dict[str, Any]:
    return {
        "llmProvider": {"providerKey": llm.identity.public_key_hex, "name": name},
        "context": context if context is not None else {"user": "u-1"},
    }


def texts(events: list[dict[str, Any]]) -> str:
    return "".join(e.get("delta", "") for e in events if e.get("type") == "TEXT_MESSAGE_CONTENT")


def heard(text: str) -> str:
    return fake_answer({"messages": [{"role": "user", "content": text}]})


async def a2a(http: httpx.AsyncClient, url: str, method: str, params: dict[str, Any]) -> dict:
    response = await http.post(
        url, json={"jsonrpc": "2.0", "id": "r-1", "method": method, "params": params}, headers=V1
    )
    return response.json()


def a2a_message(text: str) -> dict[str, Any]:
    return {"messageId": f"m-{text}", "role": "ROLE_USER", "parts": [{"text": text}]}


# -- a hand-played agent holding a run with a grant --------------------------------


class HeldRun:
    """A run the caller started at the AG-UI door, accepted by a raw provider,
    whose RUN_STARTED the caller has read (so the lane holds it as running)."""

    def __init__(self, raw: RawProvider, offer: dict[str, Any], events: list[dict]) -> None:
        self.raw = raw
        self.offer = offer
        self.run_id: str = offer["runId"]
        self.grant: dict[str, str] = offer["runInput"]["forwardedProps"]["kyok"]
        self.events = events
        self.ended = trio.Event()

    async def finish(self) -> None:
        await self.raw.report(
            self.run_id,
            {"type": "RUN_FINISHED", "threadId": self.offer["threadId"], "runId": self.run_id},
        )
        await self.raw.finish(self.run_id)
        await self.ended.wait()


@contextlib.asynccontextmanager
async def held_run(
    info: Any, http: httpx.AsyncClient, raw: RawProvider, kyok: dict[str, Any], agent: str = "agent"
) -> AsyncIterator[HeldRun]:
    started = trio.Event()
    events: list[dict[str, Any]] = []
    holder: list[HeldRun] = []

    async def caller() -> None:
        body = user_input("hi", forwardedProps={"kyok": kyok})
        async with http.stream(
            "POST", info.agui_url(raw.fingerprint, agent), json=body
        ) as response:
            assert response.status_code == 200, await response.aread()
            async for event in sse_events(response):
                events.append(event)
                if event["type"] == "RUN_STARTED":
                    started.set()
        holder[0].ended.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(caller)
        offer = await raw.next_offer()
        holder.append(HeldRun(raw, offer, events))
        await raw.answer(offer, "accepted")
        await raw.report(
            offer["runId"],
            {"type": "RUN_STARTED", "threadId": offer["threadId"], "runId": offer["runId"]},
        )
        await started.wait()
        yield holder[0]
        nursery.cancel_scope.cancel()


_last_stamp = [2**62]  # the timestamp the last signed call used


def signed(
    grant: dict[str, str],
    identity: Identity,
    body: Any = CHAT,
    *,
    now: float | None = None,
    token: str | None = None,
    timestamp: int | None = None,
) -> dict[str, Any]:
    """httpx keyword arguments for one signed call (body as bytes, signed as sent)."""
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    token = token or grant["token"]
    # Each signature is taken once: calls signed anew get distinct timestamps,
    # each a second before the last one signed (a clock that moved on between
    # two calls must not bring a spent one back), well inside the window.
    if timestamp is None:
        current = int(time.time() if now is None else now)
        timestamp = min(current, _last_stamp[0] - 1)
        if current - timestamp > 45:
            timestamp = current
        _last_stamp[0] = timestamp
    stamp = timestamp
    signature = identity.sign(kyok_call_payload(token, stamp, raw))
    return {
        "content": raw,
        "headers": {
            "Authorization": f"Bearer {token}",
            "Funduq-Timestamp": str(stamp),
            "Funduq-Signature": signature,
            "Content-Type": "application/json",
        },
    }


def url_of(grant: dict[str, str]) -> str:
    return grant["baseUrl"] + "/chat/completions"


# -- the whole chain ------------------------------------------------------------------


async def test_whole_chain_streaming_through_the_agui_door(tmp_path):
    async with (
        running_server(tmp_path) as info,
        llm_provider(info) as llm,
        sdk_provider(info, {"chat": kyok_chat}) as agent,
        http_client(info) as http,
    ):
        body = user_input("hello there", forwardedProps={"kyok": opt_in(llm)})
        response, events = await post_sse(
            http, info.agui_url(agent.identity.fingerprint, "chat"), body
        )
        assert response.status_code == 200, response.text
        assert events[-1]["type"] == "RUN_FINISHED", events
        assert texts(events) == heard("hello there")
        run = (await http.get(f"/runs/{events[0]['runId']}")).json()
        assert run["status"] == "completed"
        # The record says which offering the run spent against.
        assert run["metadata"]["funduq"]["kyok"] == {
            "llmProvider": {"providerKey": llm.identity.public_key_hex, "name": "fake"}
        }


async def test_whole_chain_not_streaming_through_the_a2a_door(tmp_path):
    """A2A caller, an agent asking with `stream: false` through openai; the
    caller's context reaches the LLM provider and never the agent."""
    seen: dict[str, Any] = {}

    async def remember(request):
        seen["context"], seen["chain"] = request.context, request.actor_chain
        seen["agent"] = request.agent
        async for chunk in fake_model(request):
            yield chunk

    async def ask_once(run_input, ctx):
        seen["forwardedProps"] = run_input.forwarded_props
        seen["metadata"] = ctx.metadata
        client = ctx.kyok_client()
        try:
            answer = await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "whole"}]
            )
        finally:
            await client.close()
        mid = "m1"
        yield {"type": "RUN_STARTED", "threadId": run_input.thread_id, "runId": run_input.run_id}
        yield {"type": "TEXT_MESSAGE_START", "messageId": mid, "role": "assistant"}
        yield {
            "type": "TEXT_MESSAGE_CONTENT",
            "messageId": mid,
            "delta": answer.choices[0].message.content,
        }
        yield {"type": "TEXT_MESSAGE_END", "messageId": mid}
        yield {"type": "RUN_FINISHED", "threadId": run_input.thread_id, "runId": run_input.run_id}

    async with (
        running_server(tmp_path) as info,
        llm_provider(info, {"fake": remember}) as llm,
        sdk_provider(info, {"chat": ask_once}) as agent,
        http_client(info) as http,
    ):
        url = info.a2a_url(agent.identity.fingerprint, "chat")
        kyok = opt_in(llm, context={"secretOfTheCaller": 42})
        answer = await a2a(
            http, url, "SendMessage", {"message": a2a_message("hi"), "metadata": {"kyok": kyok}}
        )
        task = answer["result"]["task"]
        assert task["status"]["state"] == "TASK_STATE_COMPLETED", answer
        assert task["artifacts"][0]["parts"][0]["text"] == heard("whole")
        assert seen["context"] == {"secretOfTheCaller": 42}
        assert seen["agent"] == {"providerKey": agent.identity.public_key_hex, "name": "chat"}
        assert set(seen["forwardedProps"]["kyok"]) == {"token", "baseUrl"}
        assert seen["forwardedProps"]["kyok"]["baseUrl"] == info.url + "/kyok/v1"
        assert "secretOfTheCaller" not in json.dumps(seen["forwardedProps"])
        assert "kyok" not in (seen["metadata"] or {})


async def test_an_unknown_offering_is_refused_at_both_doors_and_records_nothing(tmp_path):
    async with (
        running_server(tmp_path) as info,
        llm_provider(info) as llm,
        sdk_provider(info, {"chat": kyok_chat}) as agent,
        http_client(info) as http,
    ):
        fp = agent.identity.fingerprint
        unknown = opt_in(llm, name="nope")
        response = await http.post(
            info.agui_url(fp, "chat"), json=user_input("x", forwardedProps={"kyok": unknown})
        )
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "invalid_kyok_opt_in"
        answer = await a2a(
            http,
            info.a2a_url(fp, "chat"),
            "SendMessage",
            {"message": a2a_message("x"), "metadata": {"kyok": {"llmProvider": 7}}},
        )
        assert answer["error"]["code"] == -32602
        assert await info.funduq.list_runs() == []


# -- the checks, in order ----------------------------------------------------------


async def test_token_checks_expired_tampered_and_another_agents(tmp_path):
    async with (
        running_server(tmp_path, kyok_secret=SECRET) as info,
        llm_provider(info) as llm,
        raw_provider(info, ["agent"]) as raw,
        raw_provider(info, ["agent"]) as other,
        http_client(info) as http,
    ):
        async with held_run(info, http, raw, opt_in(llm)) as run:
            grant, url = run.grant, url_of(run.grant)
            # The clock funduq reads tokens and signatures with, injected.
            exp = json.loads(base64.urlsafe_b64decode(grant["token"].split(".")[0] + "=="))["exp"]
            now = [exp - 1.0]
            info.funduq.kyok.clock = lambda: now[0]
            ok = await http.post(url, **signed(grant, raw.identity, now=now[0]))
            assert ok.status_code == 200, ok.text
            assert exp - TOKEN_SECONDS <= time.time() + 1
            now[0] = float(exp)
            expired = await http.post(url, **signed(grant, raw.identity, now=now[0]))
            assert expired.status_code == 401
            assert expired.json()["error"]["message"] == "KYOK token has expired"
            now[0] = exp - 1.0

            first, mac = grant["token"].split(".")
            tampered = first[:-2] + ("A" if first[-2] != "A" else "B") + first[-1] + "." + mac
            bad = await http.post(url, **signed(grant, raw.identity, now=now[0], token=tampered))
            assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_token"
            missing = await http.post(url, content=b"{}")
            assert missing.status_code == 401

            # Another provider's key holding this agent's token: the signature fails.
            stolen = await http.post(url, **signed(grant, other.identity, now=now[0]))
            assert stolen.status_code == 401
            assert stolen.json()["error"]["code"] == "invalid_signature"
            # A token (made with the secret) naming another agent for this run.
            forged = mint_token(SECRET.encode(), run.run_id, f"{other.key}/agent", exp)
            not_theirs = await http.post(
                url, **signed(grant, other.identity, now=now[0], token=forged)
            )
            assert not_theirs.status_code == 403
            assert not_theirs.json()["error"]["code"] == "not_this_agents_run"


async def test_signature_body_and_attachment_checks(tmp_path):
    async with (
        running_server(tmp_path) as info,
        llm_provider(info) as llm,
        raw_provider(info, ["agent"]) as raw,
        http_client(info) as http,
    ):
        async with held_run(info, http, raw, opt_in(llm)) as run:
            grant, url = run.grant, url_of(run.grant)
            now = time.time()
            wrong = signed(grant, raw.identity)
            wrong["headers"]["Funduq-Signature"] = "0" * 128
            assert (await http.post(url, **wrong)).status_code == 401
            stale = await http.post(url, **signed(grant, raw.identity, timestamp=int(now) - 61))
            assert stale.status_code == 401
            unsigned = signed(grant, raw.identity)
            del unsigned["headers"]["Funduq-Signature"]
            assert (await http.post(url, **unsigned)).status_code == 401
            # A signature over another body does not cover this one.
            other_body = signed(grant, raw.identity, {"model": "x", "messages": []})
            other_body["content"] = json.dumps(CHAT).encode()
            assert (await http.post(url, **other_body)).status_code == 401
            not_json = await http.post(url, **signed(grant, raw.identity, b"[1, 2"))
            assert not_json.status_code == 400
            array = await http.post(url, **signed(grant, raw.identity, b"[1, 2]"))
            assert array.status_code == 400
            call = signed(grant, raw.identity)
            good = await http.post(url, **call)
            assert good.status_code == 200
            assert good.json()["choices"][0]["message"]["content"] == heard("ping")
            # The same call again (captured, replayed): its signature is spent.
            replayed = await http.post(url, **call)
            assert replayed.status_code == 401
            assert replayed.json()["error"]["code"] == "invalid_signature"

            # The LLM provider detaches: 503 (after every other check passed).
            llm_gone = trio.Event()
            llm.offerings.clear()
            info.funduq.kyok.sessions[llm.identity.public_key_hex].link.close("test: leave")
            with trio.move_on_after(5):
                while llm.identity.public_key_hex in info.funduq.kyok.sessions:
                    await trio.testing.wait_all_tasks_blocked()
                    await trio.sleep(0)
                llm_gone.set()
            assert llm_gone.is_set()
            detached = await http.post(url, **signed(grant, raw.identity))
            assert detached.status_code == 503
            assert detached.json()["error"]["code"] == "llm_provider_unavailable"
            roster = (await http.get("/llms")).json()["llms"]
            assert [(o["name"], o["online"]) for o in roster] == [("fake", False)]


async def test_a_finished_run_is_refused(tmp_path):
    async with (
        running_server(tmp_path) as info,
        llm_provider(info) as llm,
        raw_provider(info, ["agent"]) as raw,
        http_client(info) as http,
    ):
        async with held_run(info, http, raw, opt_in(llm)) as run:
            await run.finish()
            assert (await http.get(f"/runs/{run.run_id}")).json()["status"] == "completed"
            client = kyok_client(run.grant, raw.identity)
            with pytest.raises(openai.PermissionDeniedError) as refused:
                await client.chat.completions.create(**CHAT)
            assert refused.value.status_code == 403
            assert refused.value.body["code"] == "run_not_active"
            await client.close()


# -- the seed's rule: a cancel-requested run is refused ------------------------------


async def test_refused_from_the_moment_the_cancel_is_accepted(tmp_path):
    """The offer (and its grant) is out, unanswered; a cancel is accepted (the
    lane reads it only after the answer, so nothing writes `cancelling` yet):
    the grant is refused already."""
    async with (
        running_server(tmp_path) as info,
        llm_provider(info) as llm,
        raw_provider(info, ["agent"]) as raw,
        http_client(info) as http,
    ):
        a2a_url = info.a2a_url(raw.fingerprint, "agent")
        answer = await a2a(
            http,
            a2a_url,
            "SendMessage",
            {
                "message": a2a_message("x"),
                "metadata": {"kyok": opt_in(llm)},
                "configuration": {"returnImmediately": True},
            },
        )
        offer = await raw.next_offer()
        grant = offer["runInput"]["forwardedProps"]["kyok"]
        cancel = await a2a(http, a2a_url, "CancelTask", {"id": offer["runId"]})
        assert cancel["result"]["metadata"]["funduq/cancelRequested"] is True, (answer, cancel)
        assert (await http.get(f"/runs/{offer['runId']}")).json()["status"] == "offering"
        refused = await http.post(url_of(grant), **signed(grant, raw.identity))
        assert refused.status_code == 403
        assert refused.json()["error"]["code"] == "run_cancel_requested"
        await raw.answer(offer, "accepted")
        assert await raw.cancels.receive() == offer["runId"]
        assert (await http.get(f"/runs/{offer['runId']}")).json()["status"] == "cancelling"
        again = await http.post(url_of(grant), **signed(grant, raw.identity))
        assert again.status_code == 403


async def test_a_cancel_accepted_while_the_call_is_being_read_is_refused(tmp_path):
    """The call passed the token and run checks and is still sending its
    body when the cancel is accepted: the check made once the body is in refuses it."""
    async with (
        running_server(tmp_path) as info,
        llm_provider(info) as llm,
        raw_provider(info, ["agent"]) as raw,
        http_client(info) as http,
    ):
        async with held_run(info, http, raw, opt_in(llm)) as run:
            kwargs = signed(run.grant, raw.identity)
            whole = kwargs.pop("content")
            rest = trio.Event()

            async def slowly():
                yield whole[:10]
                await rest.wait()
                yield whole[10:]

            result: list[httpx.Response] = []

            async def call():
                result.append(await http.post(url_of(run.grant), content=slowly(), **kwargs))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call)
                await trio.testing.wait_all_tasks_blocked()  # the route waits for the body
                cancel = await a2a(
                    http, info.a2a_url(raw.fingerprint, "agent"), "CancelTask", {"id": run.run_id}
                )
                assert "result" in cancel, cancel
                rest.set()
            assert result[0].status_code == 403
            assert result[0].json()["error"]["code"] == "run_cancel_requested"
            assert info.funduq.kyok.by_run == {}


def hanging(abandoned: trio.Event, chunks: int = 1):
    async def offering(request):
        try:
            for i in range(chunks):
                yield {"choices": [{"index": 0, "delta": {"content": f"c{i}"}}]}
            await trio.sleep_forever()
        finally:
            abandoned.set()

    return offering


async def test_a_completion_in_flight_ends_when_the_cancel_arrives(tmp_path):
    abandoned = trio.Event()
    async with (
        running_server(tmp_path) as info,
        llm_provider(info, {"slow": hanging(abandoned)}) as llm,
        raw_provider(info, ["agent"]) as raw,
        http_client(info) as http,
    ):
        async with held_run(info, http, raw, opt_in(llm, "slow")) as run:
            body = {**CHAT, "stream": True}
            async with http.stream(
                "POST", url_of(run.grant), **signed(run.grant, raw.identity, body)
            ) as response:
                assert response.status_code == 200
                lines = response.aiter_lines()
                assert (
                    json.loads((await lines.__anext__())[len("data: ") :])["choices"][0]["delta"][
                        "content"
                    ]
                    == "c0"
                )
                cancel = await a2a(
                    http, info.a2a_url(raw.fingerprint, "agent"), "CancelTask", {"id": run.run_id}
                )
                assert "result" in cancel
                rest = [line async for line in lines if line]
            assert len(rest) == 1 and rest[0].startswith("data: "), rest
            error = json.loads(rest[0][len("data: ") :])["error"]
            assert error["code"] == "run_cancel_requested"
            with trio.fail_after(5):
                await abandoned.wait()  # the LLM provider was asked to stop (abandon)
        metrics = (await http.get("/metrics")).text
        assert (
            f'funduq_kyok_completions_total{{offering="{llm.identity.fingerprint}/slow",'
            'outcome="abandoned"} 1' in metrics
        )


async def test_completions_in_flight_per_run_are_bounded(tmp_path):
    """FUNDUQ_KYOK_COMPLETIONS_PER_RUN: past it a call is refused 429 before
    anything reaches the LLM provider; once one ends, another may start."""
    abandoned = trio.Event()
    async with (
        running_server(tmp_path, kyok_completions_per_run=2) as info,
        llm_provider(info, {"slow": hanging(abandoned)}) as llm,
        raw_provider(info, ["agent"]) as raw,
        http_client(info) as http,
    ):
        async with held_run(info, http, raw, opt_in(llm, "slow")) as run:
            body = {**CHAT, "stream": True}
            async with contextlib.AsyncExitStack() as open_calls:
                streams = []
                for _ in range(2):
                    response = await open_calls.enter_async_context(
                        http.stream(
                            "POST", url_of(run.grant), **signed(run.grant, raw.identity, body)
                        )
                    )
                    assert response.status_code == 200
                    lines = response.aiter_lines()
                    assert (await lines.__anext__()).startswith("data: ")  # c0: in flight
                    streams.append(lines)
                with trio.fail_after(5):  # (unbounded, the third call streams forever)
                    third = await http.post(
                        url_of(run.grant), **signed(run.grant, raw.identity, body)
                    )
                assert third.status_code == 429, third.text
                assert third.json()["error"]["code"] == "too_many_completions"
                assert len(info.funduq.kyok.by_run[run.run_id]) == 2
            # Both readers left: their completions ended, so a new one starts.
            with trio.fail_after(5):
                while info.funduq.kyok.by_run.get(run.run_id):
                    await trio.testing.wait_all_tasks_blocked()
                    await trio.sleep(0)
            async with http.stream(
                "POST", url_of(run.grant), **signed(run.grant, raw.identity, body)
            ) as response:
                assert response.status_code == 200


async def test_a_completion_in_flight_ends_when_the_run_settles(tmp_path):
    abandoned = trio.Event()
    async with (
        running_server(tmp_path) as info,
        llm_provider(info, {"slow": hanging(abandoned, chunks=0)}) as llm,
        raw_provider(info, ["agent"]) as raw,
        http_client(info) as http,
    ):
        async with held_run(info, http, raw, opt_in(llm, "slow")) as run:
            result: list[httpx.Response] = []

            async def call():
                result.append(await http.post(url_of(run.grant), **signed(run.grant, raw.identity)))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call)
                with trio.fail_after(5):
                    while not info.funduq.kyok.by_run:
                        await trio.testing.wait_all_tasks_blocked()
                        await trio.sleep(0)
                await run.finish()
            assert result[0].status_code == 403
            assert result[0].json()["error"]["code"] == "run_not_active"
            with trio.fail_after(5):
                await abandoned.wait()


# -- what the LLM provider says ---------------------------------------------------------


async def test_refusals_before_and_after_the_first_chunk_and_the_counters(tmp_path):
    async def refuse(request):
        raise Refusal("over quota", {"reason": "quota", "retryAfter": 60})
        yield  # pragma: no cover

    async def half(request):
        yield {"choices": [{"index": 0, "delta": {"content": "partial"}}]}
        raise Refusal("changed its mind", {"reason": "policy"})

    async def broken(request):
        raise RuntimeError("boom")
        yield  # pragma: no cover

    offerings = {"fake": fake_model, "refuse": refuse, "half": half, "broken": broken}
    async with (
        running_server(tmp_path) as info,
        llm_provider(info, offerings) as llm,
        raw_provider(info, ["agent"]) as raw,
        http_client(info) as http,
    ):

        async def spend(name: str, body: dict) -> httpx.Response:
            async with held_run(info, http, raw, opt_in(llm, name)) as run:
                response = await http.post(
                    url_of(run.grant), **signed(run.grant, raw.identity, body)
                )
                await run.finish()
                return response

        streaming = {**CHAT, "stream": True}
        before = await spend("refuse", streaming)
        assert before.status_code == 502
        assert before.json()["error"]["refusal"] == {"reason": "quota", "retryAfter": 60}
        assert before.json()["error"]["message"] == "over quota"
        whole = await spend("refuse", CHAT)
        assert whole.status_code == 502 and whole.json()["error"]["refusal"]["reason"] == "quota"

        after = await spend("half", streaming)
        assert after.status_code == 200
        frames = [line for line in after.text.split("\n") if line]
        assert json.loads(frames[0][6:])["choices"][0]["delta"]["content"] == "partial"
        assert "[DONE]" not in after.text
        last = json.loads(frames[-1][6:])["error"]
        assert last["refusal"] == {"reason": "policy"} and last["message"] == "changed its mind"

        failed = await spend("broken", CHAT)
        assert failed.status_code == 502 and failed.json()["error"]["refusal"] is None

        done = await spend("fake", streaming)
        assert done.text.endswith("data: [DONE]\n\n")

        counters = (await http.get("/llms")).json()["llms"]
        assert {o["name"]: o["online"] for o in counters} == dict.fromkeys(offerings, True)
        assert counters[0]["counters"] == {"completions": 1, "refused": 3, "failed": 1}
        stored = await info.funduq.record.read(
            lambda c: c.execute("SELECT completions, refused, failed FROM llm_providers").fetchall()
        )
        assert stored == [(1, 3, 1)]
        metrics = (await http.get("/metrics")).text
        fp = llm.identity.fingerprint
        for name, outcome, n in [
            ("refuse", "refused", 2),
            ("half", "refused", 1),
            ("broken", "failed", 1),
            ("fake", "completed", 1),
        ]:
            assert (
                f'funduq_kyok_completions_total{{offering="{fp}/{name}",outcome="{outcome}"}} {n}'
                in metrics
            ), metrics


async def test_the_example_agent_says_so_without_a_grant(tmp_path):
    async with (
        running_server(tmp_path) as info,
        sdk_provider(info, {"chat": kyok_chat}) as agent,
        http_client(info) as http,
    ):
        _, events = await post_sse(
            http, info.agui_url(agent.identity.fingerprint, "chat"), user_input("x")
        )
        assert events[-1]["type"] == "RUN_ERROR"
        assert "no KYOK grant" in events[-1]["message"]


class RawLlm:
    """An LLM provider played by hand over a raw provider's link: `completes`
    receives each `complete` frame, `abandons` each `abandon` id; every other
    frame goes to the raw provider as before."""

    def __init__(self, raw: RawProvider) -> None:
        self.raw = raw
        self._completes_in, self.completes = trio.open_memory_channel[dict](100)
        self._abandons_in, self.abandons = trio.open_memory_channel[str](100)
        self._others = raw._take
        raw._take = self._take  # its receive loop now hands KYOK frames here

    async def _take(self, frame: dict[str, Any]) -> None:
        if frame.get("kind") == "complete":
            await self._completes_in.send(frame)
        elif frame.get("kind") == "abandon":
            await self._abandons_in.send(frame["id"])
        else:
            await self._others(frame)


async def test_hostile_bodies_and_chunks_are_refused(tmp_path):
    async with (
        running_server(tmp_path) as info,
        raw_provider(info, []) as raw_llm,
        raw_provider(info, ["agent"]) as raw,
        http_client(info) as http,
    ):
        llm = RawLlm(raw_llm)
        reply = await raw_llm.request(
            {
                "kind": "register.llm",
                "offerings": [{"name": "raw", "description": None, "metadata": None}],
            }
        )
        assert reply["kind"] == "ok", reply
        kyok = {"llmProvider": {"providerKey": raw_llm.key, "name": "raw"}, "context": None}
        async with held_run(info, http, raw, kyok) as run:
            deep: Any = "x"
            for _ in range(200):
                deep = [deep]
            nested = await http.post(
                url_of(run.grant), **signed(run.grant, raw.identity, {"model": "m", "x": deep})
            )
            assert nested.status_code == 400

            result: list[httpx.Response] = []

            async def call():
                result.append(await http.post(url_of(run.grant), **signed(run.grant, raw.identity)))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(call)
                complete = await llm.completes.receive()
                assert complete["runId"] == run.run_id and complete["llm"] == "raw"
                assert complete["agent"] == {"providerKey": raw.key, "name": "agent"}
                assert complete["body"] == CHAT and complete["context"] is None
                await raw_llm.ws.send_message(
                    json.dumps({"kind": "chunk", "id": complete["id"], "data": "\ud800"})
                )
                assert await llm.abandons.receive() == complete["id"]
            assert result[0].status_code == 502
            assert result[0].json()["error"]["code"] == "llm_bad_chunk"


async def test_chunks_relay_verbatim_and_a_whole_answer_is_one_chunk(tmp_path):
    async def lines(request):
        yield "first\nsecond"
        yield '{"n": 2}'

    async with (
        running_server(tmp_path) as info,
        llm_provider(info, {"lines": lines}) as llm,
        raw_provider(info, ["agent"]) as raw,
        http_client(info) as http,
    ):
        async with held_run(info, http, raw, opt_in(llm, "lines")) as run:
            streamed = await http.post(
                url_of(run.grant), **signed(run.grant, raw.identity, {**CHAT, "stream": True})
            )
            assert streamed.headers["content-type"].startswith("text/event-stream")
            # A line break inside a chunk is a second data: line of the same event.
            assert (
                streamed.text == 'data: first\ndata: second\n\ndata: {"n": 2}\n\ndata: [DONE]\n\n'
            )
            whole = await http.post(url_of(run.grant), **signed(run.grant, raw.identity))
            assert whole.status_code == 502
            assert whole.json()["error"]["code"] == "llm_bad_response"


async def test_the_sdk_signs_the_same_call_twice_in_a_second_apart():
    """funduq takes a call signature once, so a retry within the second must
    not be the same bytes: the SDK signs it a second earlier."""
    identity = Identity.generate()
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        stamp = request.headers["Funduq-Timestamp"]
        assert verify(
            identity.public_key_hex,
            kyok_call_payload("t", int(stamp), request.content),
            request.headers["Funduq-Signature"],
        )
        seen.append(stamp)
        return httpx.Response(200, json={})

    grant = {"token": "t", "baseUrl": "http://relay.test/kyok/v1"}
    async with kyok_http_client(
        grant, identity, clock=lambda: 1000.5, transport=httpx.MockTransport(answer)
    ) as client:
        for _ in range(3):
            await client.post("http://relay.test/kyok/v1/chat/completions", json=CHAT)
    assert seen == ["1000", "999", "998"]
