"""CORS by FUNDUQ_CORS_ORIGINS: preflights answered, allowed origins echoed
(streams included), other origins and the default (off) get no CORS headers."""

from __future__ import annotations

from support import http_client, post_sse, running_server, sdk_provider, user_input

ALLOWED = "https://app.example"


async def test_preflight_and_responses_for_an_allowed_origin(tmp_path):
    async with (
        running_server(
            tmp_path, cors_origins=frozenset({ALLOWED, "http://localhost:3000"})
        ) as info,
        http_client(info) as http,
        sdk_provider(info) as provider,
    ):
        door = f"/agui/{provider.identity.fingerprint}/echo"
        preflight = await http.options(
            door,
            headers={
                "Origin": ALLOWED,
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type, last-event-id",
            },
        )
        assert preflight.status_code == 204
        assert preflight.headers["access-control-allow-origin"] == ALLOWED
        assert "POST" in preflight.headers["access-control-allow-methods"]
        allowed = {
            h.strip().lower() for h in preflight.headers["access-control-allow-headers"].split(",")
        }
        assert {
            "content-type",
            "authorization",
            "last-event-id",
            "funduq-proof",
            "a2a-version",
        } <= allowed
        assert preflight.headers["vary"] == "Origin"

        # The door's own stream carries the header; so do the read routes.
        http.headers["Origin"] = ALLOWED
        async with http.stream("POST", door, json=user_input("hi")) as response:
            assert response.status_code == 200
            assert response.headers["access-control-allow-origin"] == ALLOWED
            assert "access-control-expose-headers" in response.headers
            await response.aread()
        roster = await http.get("/agents")
        assert roster.headers["access-control-allow-origin"] == ALLOWED
        missing = await http.get("/runs/run_nope")  # errors too: the browser can read why
        assert missing.status_code == 404
        assert missing.headers["access-control-allow-origin"] == ALLOWED

        # Another origin: answered, but with nothing a browser would accept.
        other = await http.options(
            door,
            headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"},
        )
        assert other.status_code == 204
        assert "access-control-allow-origin" not in other.headers
        http.headers["Origin"] = "https://evil.example"
        assert "access-control-allow-origin" not in (await http.get("/agents")).headers


async def test_cors_is_off_by_default(tmp_path):
    async with (
        running_server(tmp_path) as info,
        http_client(info) as http,
        sdk_provider(info) as provider,
    ):
        http.headers["Origin"] = ALLOWED
        response, events = await post_sse(
            http, f"/agui/{provider.identity.fingerprint}/echo", user_input("hi")
        )
        assert events[-1]["type"] == "RUN_FINISHED"
        assert "access-control-allow-origin" not in response.headers
        preflight = await http.options("/agents", headers={"Access-Control-Request-Method": "GET"})
        assert "access-control-allow-origin" not in preflight.headers
