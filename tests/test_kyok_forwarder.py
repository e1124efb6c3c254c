"""The `forward` offering of `funduq-trio llm-provider`, against a local fake
OpenAI-compatible server (quart-trio on hypercorn, loopback: no network),
through the whole chain with the real server and the `kyok_chat` example agent."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import hypercorn.trio
import trio
from hypercorn.config import Config
from quart import Response, request
from quart_trio import QuartTrio
from support import http_client, post_sse, running_server, sdk_provider, user_input
from test_kyok import CHAT, held_run, signed, url_of

from funduq_trio.provider.llm import kyok_chat
from funduq_trio.provider.llm_cli import build_llm_provider, build_llm_provider_parser


@contextlib.asynccontextmanager
async def fake_openai() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """An OpenAI-compatible endpoint at `{url}/v1`; `seen` lists each request."""
    app = QuartTrio("fake_openai")
    seen: list[dict[str, Any]] = []

    @app.post("/v1/chat/completions")
    async def completions() -> Response:
        body = await request.get_json()
        seen.append({"authorization": request.headers.get("Authorization"), "body": body})
        if body.get("model") == "refuse":
            return Response(
                json.dumps({"error": {"message": "slow down", "type": "rate_limit"}}),
                status=429,
                content_type="application/json",
            )
        if body.get("stream"):

            async def events() -> AsyncIterator[bytes]:
                for word in ("up", "stream"):
                    chunk = {
                        "id": "u1",
                        "object": "chat.completion.chunk",
                        "created": 0,
                        "model": body["model"],
                        "choices": [
                            {"index": 0, "delta": {"content": word}, "finish_reason": None}
                        ],
                    }
                    yield f"data: {json.dumps(chunk)}\n\n".encode()
                yield b"data: [DONE]\n\n"

            return Response(events(), content_type="text/event-stream")
        return Response(
            json.dumps(
                {
                    "id": "u2",
                    "object": "chat.completion",
                    "created": 0,
                    "model": body["model"],
                    "choices": [
                        {
                            "index": 0,
                            "message": {"role": "assistant", "content": "up whole"},
                            "finish_reason": "stop",
                        }
                    ],
                }
            ),
            content_type="application/json",
        )

    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(hypercorn.trio.serve, app, config, mode="asgi"))
        yield binds[0], seen
        nursery.cancel_scope.cancel()


@contextlib.asynccontextmanager
async def forwarder(info: Any, upstream: str, tmp_path: Any, model: str | None = None):
    argv = [
        "--url",
        info.provider_url,
        "--key-file",
        str(tmp_path / "llm.key"),
        "--offering",
        "forward",
        "--forward-url",
        upstream + "/v1",
        "--forward-key-env",
        "UPSTREAM_KEY",
    ]
    if model:
        argv += ["--forward-model", model]
    args: argparse.Namespace = build_llm_provider_parser().parse_args(argv)
    provider = build_llm_provider(args, env={"UPSTREAM_KEY": "sk-upstream"})
    async with trio.open_nursery() as nursery:
        await nursery.start(provider.run)
        yield provider
        nursery.cancel_scope.cancel()


def opt_in(llm: Any) -> dict[str, Any]:
    return {
        "llmProvider": {"providerKey": llm.identity.fingerprint, "name": "forward"},
        "context": {"plan": "gold"},
    }


async def test_the_forwarder_streams_through_the_whole_chain(tmp_path):
    async with (
        fake_openai() as (upstream, seen),
        running_server(tmp_path) as info,
        forwarder(info, upstream, tmp_path, model="up-model") as llm,
        sdk_provider(info, {"chat": kyok_chat}) as agent,
        http_client(info) as http,
    ):
        body = user_input("hello", forwardedProps={"kyok": opt_in(llm)})
        _, events = await post_sse(http, info.agui_url(agent.identity.fingerprint, "chat"), body)
        assert events[-1]["type"] == "RUN_FINISHED", events
        assert (
            "".join(e["delta"] for e in events if e["type"] == "TEXT_MESSAGE_CONTENT") == "upstream"
        )
        assert seen[0]["authorization"] == "Bearer sk-upstream"
        assert seen[0]["body"]["model"] == "up-model"  # --forward-model wins
        assert seen[0]["body"]["messages"][-1] == {"role": "user", "content": "hello"}


async def test_the_forwarder_whole_answers_and_upstream_refusals(tmp_path):
    from support import raw_provider

    async with (
        fake_openai() as (upstream, seen),
        running_server(tmp_path) as info,
        forwarder(info, upstream, tmp_path) as llm,
        raw_provider(info, ["agent"]) as raw,
        http_client(info) as http,
    ):
        async with held_run(info, http, raw, opt_in(llm)) as run:
            whole = await http.post(url_of(run.grant), **signed(run.grant, raw.identity))
            assert whole.status_code == 200
            assert whole.json()["choices"][0]["message"]["content"] == "up whole"
            assert seen[-1]["body"] == CHAT
            refused = await http.post(
                url_of(run.grant),
                **signed(run.grant, raw.identity, {**CHAT, "model": "refuse", "stream": True}),
            )
            assert refused.status_code == 502
            assert refused.json()["error"]["refusal"] == {
                "upstreamStatus": 429,
                "error": {"message": "slow down", "type": "rate_limit"},
            }
