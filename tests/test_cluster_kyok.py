"""KYOK completions from any node (issue #12, docs/cluster.md "KYOK from any
node"): an agent whose grant's baseUrl is a node that does not lead its run
(a load balancer in front of every node) is served there -- the call is
relayed to the run's leader over the signed internal route, checked, spent
and counted once there, and the answer (JSON or the stream) comes back as
it is.

The nodes are real `serve` processes on one PostgreSQL schema
(cluster_support.py). B starts first; A is told to hand out B's URL as
KYOK's baseUrl (FUNDUQ_PUBLIC_URL, what a load balancer's address is), so
every completion its agents make arrives at B. The agent and the LLM
provider are the SDK over the real link (or the agent played by hand), both
attached to A, which leads the runs.
"""

from __future__ import annotations

import json

import httpx
import pytest
import stores
import trio
from cluster_support import cluster
from reliability_support import HTTP_TIMEOUT, SAFETY
from support import post_sse, raw_provider, sdk_provider, user_input
from test_kyok import CHAT, hanging, heard, held_run, llm_provider, opt_in, signed, texts, url_of

from funduq_trio.provider import kyok_chat

pytestmark = pytest.mark.parametrize("store", ["postgres"], indirect=True)


async def metric(http: httpx.AsyncClient, name: str) -> float:
    for line in (await http.get("/metrics")).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


async def test_an_agent_whose_completions_reach_another_node_is_served_by_the_leader(
    tmp_path, store
):
    """The SDK agent streams its completion through B (its grant's baseUrl);
    B relays it to A, which leads the run and holds the LLM provider: the
    caller on A gets the LLM's words, and the completion is counted once."""
    assert stores.database_url is not None
    async with cluster(tmp_path) as nodes:
        b = await nodes.start("b")
        a = await nodes.start("a", public_url=b.base_url)
        async with (
            llm_provider(a) as llm,
            sdk_provider(a, {"chat": kyok_chat}) as agent,
            httpx.AsyncClient(base_url=a.base_url, timeout=HTTP_TIMEOUT) as http_a,
            httpx.AsyncClient(base_url=b.base_url, timeout=HTTP_TIMEOUT) as http_b,
        ):
            body = user_input("hello there", forwardedProps={"kyok": opt_in(llm)})
            response, events = await post_sse(
                http_a, a.agui_url(agent.identity.fingerprint, "chat"), body
            )
            assert response.status_code == 200, response.text
            assert events[-1]["type"] == "RUN_FINISHED", events
            assert texts(events) == heard("hello there")
            (offering,) = (await http_a.get("/llms")).json()["llms"]
            assert offering["counters"] == {"completions": 1, "refused": 0, "failed": 0}
            assert await metric(http_b, "funduq_calls_forwarded_total") == 1
            assert await metric(http_a, "funduq_calls_taken_total") == 1


async def test_a_relayed_call_is_answered_as_the_leader_answers_and_spent_there(tmp_path, store):
    """A hand-played agent on A calls B: a whole answer comes back as JSON, a
    stream as the same SSE lines; the same signed call sent again -- to B or
    to A -- is refused as spent; once the run has ended B itself refuses it
    (no node leads it). A body too large to relay within the body limit is
    refused 413 by B, saying so (A itself takes it)."""
    assert stores.database_url is not None
    async with cluster(tmp_path, max_body_bytes=16384) as nodes:
        b = await nodes.start("b")
        a = await nodes.start("a", public_url=b.base_url)
        async with (
            llm_provider(a) as llm,
            raw_provider(a, ["agent"]) as raw,
            httpx.AsyncClient(base_url=a.base_url, timeout=HTTP_TIMEOUT) as http,
        ):
            async with held_run(a, http, raw, opt_in(llm)) as run:
                assert run.grant["baseUrl"] == b.base_url + "/kyok/v1"
                call = signed(run.grant, raw.identity)
                whole = await http.post(url_of(run.grant), **call)
                assert whole.status_code == 200, whole.text
                content = whole.json()["choices"][0]["message"]["content"]
                assert content == heard("ping")
                for again_at in (url_of(run.grant), a.base_url + "/kyok/v1/chat/completions"):
                    again = await http.post(again_at, **call)
                    assert again.status_code == 401, again.text
                    assert again.json()["error"]["code"] == "invalid_signature"

                streamed = await http.post(
                    url_of(run.grant), **signed(run.grant, raw.identity, {**CHAT, "stream": True})
                )
                assert streamed.status_code == 200, streamed.text
                assert streamed.headers["content-type"].startswith("text/event-stream")
                frames = [line for line in streamed.text.split("\n") if line]
                assert frames[-1] == "data: [DONE]"
                words = "".join(
                    json.loads(f[6:])["choices"][0]["delta"].get("content") or ""
                    for f in frames[:-1]
                )
                assert words == heard("ping")
                large = {**CHAT, "padding": "x" * 12000}
                refused = await http.post(
                    url_of(run.grant), **signed(run.grant, raw.identity, large)
                )
                assert refused.status_code == 413, refused.text
                assert refused.json()["error"]["code"] == "body_too_large_to_relay"
                taken = await http.post(
                    a.base_url + "/kyok/v1/chat/completions",
                    **signed(run.grant, raw.identity, large),
                )
                assert taken.status_code == 200, taken.text
                await run.finish()
            late = await http.post(url_of(run.grant), **signed(run.grant, raw.identity))
            assert late.status_code == 403, late.text
            assert late.json()["error"]["code"] == "run_not_active"
            (offering,) = (await http.get("/llms")).json()["llms"]
            assert offering["counters"]["completions"] == 3


async def test_an_agent_that_stops_reading_a_relayed_stream_ends_the_completion(tmp_path, store):
    """The agent leaves a stream relayed through B: B lets go of its relay,
    so the leader's completion loses its reader and the LLM provider is
    asked to stop (abandon), as on one node."""
    assert stores.database_url is not None
    abandoned = trio.Event()
    async with cluster(tmp_path) as nodes:
        b = await nodes.start("b")
        a = await nodes.start("a", public_url=b.base_url)
        async with (
            llm_provider(a, {"slow": hanging(abandoned)}) as llm,
            raw_provider(a, ["agent"]) as raw,
            httpx.AsyncClient(base_url=a.base_url, timeout=HTTP_TIMEOUT) as http,
        ):
            async with held_run(a, http, raw, opt_in(llm, "slow")) as run:
                body = {**CHAT, "stream": True}
                async with http.stream(
                    "POST", url_of(run.grant), **signed(run.grant, raw.identity, body)
                ) as response:
                    assert response.status_code == 200
                    first = await response.aiter_lines().__anext__()
                    assert json.loads(first[6:])["choices"][0]["delta"]["content"] == "c0"
                with trio.fail_after(SAFETY):
                    await abandoned.wait()
                await run.finish()
