"""funduq's app is a plain ASGI app: served by hypercorn instead of funduq's
own front (`funduq_trio/front`), a provider attaches over hypercorn's
websockets and a caller's runs stream over hypercorn's HTTP, as they do on
the front. What an embedding deployment that brings its own ASGI server gets.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from urllib.parse import urlsplit

import hypercorn.trio
import trio
from hypercorn.config import Config
from support import http_client, post_sse, running_server, sdk_provider, user_input

from funduq_trio.web.app import create_app


async def test_the_app_serves_runs_on_hypercorn(tmp_path):
    async with running_server(tmp_path) as front_info, trio.open_nursery() as nursery:
        config = Config()
        config.bind = ["127.0.0.1:0"]
        config.accesslog = None
        app = create_app(front_info.funduq)
        binds = await nursery.start(partial(hypercorn.trio.serve, app, config, mode="asgi"))
        port = urlsplit(binds[0]).port
        info = dataclasses.replace(front_info, url=f"http://127.0.0.1:{port}", port=port)
        async with http_client(info) as http, sdk_provider(info) as provider:
            assert (await http.get("/healthz")).status_code == 200
            url = info.agui_url(provider.identity.fingerprint, "echo")
            response, first = await post_sse(http, url, user_input("hello over hypercorn"))
            assert response.status_code == 200
            assert first[-1]["type"] == "RUN_FINISHED"
            said = "".join(e["delta"] for e in first if e["type"] == "TEXT_MESSAGE_CONTENT")
            assert said == "hello over hypercorn"
            thread_id = first[0]["threadId"]
            _, second = await post_sse(http, url, user_input("again", thread_id=thread_id))
            thread = (await http.get(f"/threads/{thread_id}")).json()
            assert [r["runId"] for r in thread["runs"]] == [first[0]["runId"], second[0]["runId"]]
            assert all(r["status"] == "completed" for r in thread["runs"])
        nursery.cancel_scope.cancel()
