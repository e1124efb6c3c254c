"""What the A2A conformance kit (a2aproject/a2a-tck, branch 1.0-dev) found
wrong at funduq's A2A door, each checked through the real server with httpx
as the caller (docs/doors.md, "Conformance", has the kit's full account):

- PUSH-DEL-002: deleting a push config is idempotent.
- CARD-CACHE-001/002: the card carries `Cache-Control: max-age` and an `ETag`,
  and a conditional GET of an unchanged card is a 304.
- JSONRPC-SSE-002: a JSON-RPC request declaring a non-JSON Content-Type is
  refused with ContentTypeNotSupportedError (-32005).
- HTTP_JSON-SVC-001 / HTTP_JSON-ERR-001: HTTP+JSON answers are
  `application/json` (A2A §11.1) unless the caller asks for
  `application/a2a+json`.
- PUSH-DELIVER-001: a push config's `authentication` is the `Authorization`
  its receiver gets; funduq's signature moves to `Funduq-Signature`.
"""

from __future__ import annotations

import hashlib
import json

from push_support import push_receiver
from support import http_client, operator_headers
from test_a2a_door import a2a_door_mounted, broker_with_agents  # noqa: F401 (fixture)
from test_a2a_push import V1, call, delivered_all, message, rpc

from funduq_trio import jose

CONTENT_TYPE_NOT_SUPPORTED = -32005


async def _task_id(info, fp: str) -> str:
    answer = await call(info, fp, "echo", rpc("SendMessage", {"message": message("hi")}))
    return answer["result"]["task"]["id"]


async def test_deleting_a_push_config_twice_is_not_an_error(tmp_path) -> None:
    async with (
        push_receiver() as receiver,
        broker_with_agents(tmp_path, push_allow_private=True) as (info, agents),
    ):
        fp = agents.provider.fingerprint
        tid = await _task_id(info, fp)
        made = await call(
            info,
            fp,
            "echo",
            rpc(
                "CreateTaskPushNotificationConfig", {"taskId": tid, "id": "p1", "url": receiver.url}
            ),
        )
        assert made["result"]["id"] == "p1"
        delete = rpc("DeleteTaskPushNotificationConfig", {"taskId": tid, "id": "p1"})
        assert (await call(info, fp, "echo", delete))["result"] is None
        again = await call(info, fp, "echo", delete)
        assert "error" not in again and again["result"] is None
        never = await call(
            info,
            fp,
            "echo",
            rpc("DeleteTaskPushNotificationConfig", {"taskId": tid, "id": "never-made"}),
        )
        assert never["result"] is None
        # The HTTP+JSON binding answers the same.
        async with http_client(info) as http:
            rest = await http.delete(
                f"/a2a/{fp}/echo/tasks/{tid}/pushNotificationConfigs/p1", headers=V1
            )
            assert rest.status_code == 200, rest.text
            # An unknown task is still not found: only the config may be absent.
            unknown = await http.delete(
                f"/a2a/{fp}/echo/tasks/run_nope/pushNotificationConfigs/p1", headers=V1
            )
            assert unknown.status_code == 404
        gone = await call(
            info,
            fp,
            "echo",
            rpc("DeleteTaskPushNotificationConfig", {"taskId": "run_nope", "id": "p1"}),
        )
        assert gone["error"]["code"] == -32001


async def test_the_card_is_cacheable_and_revalidates_with_a_304(tmp_path) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        url = f"/a2a/{agents.provider.fingerprint}/echo/.well-known/agent-card.json"
        async with http_client(info) as http:
            first = await http.get(url)
            assert first.status_code == 200
            assert first.json()["name"] == "echo"
            assert "max-age=" in first.headers["cache-control"]
            etag = first.headers["etag"]
            assert etag
            # The card is the same on a second fetch, and so is its tag.
            assert (await http.get(url)).headers["etag"] == etag
            unchanged = await http.get(url, headers={"If-None-Match": etag})
            assert unchanged.status_code == 304
            assert unchanged.content == b""
            stale = await http.get(url, headers={"If-None-Match": '"not-this-card"'})
            assert stale.status_code == 200
            assert stale.json() == first.json()


async def test_a_json_rpc_call_declaring_another_media_type_is_refused(tmp_path) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        fp = agents.provider.fingerprint
        body = json.dumps(rpc("SendMessage", {"message": message("typed")})).encode()
        async with http_client(info) as http:
            for declared in ("text/plain", "application/x-www-form-urlencoded"):
                answer = await http.post(
                    f"/a2a/{fp}/echo", content=body, headers={**V1, "Content-Type": declared}
                )
                assert answer.status_code == 200
                error = answer.json()["error"]
                assert error["code"] == CONTENT_TYPE_NOT_SUPPORTED, error
                assert declared in error["message"]
            # The same body as JSON (with a charset, or undeclared) is a call.
            for declared in ("application/json; charset=utf-8", None):
                headers = dict(V1) if declared is None else {**V1, "Content-Type": declared}
                ok = await http.post(f"/a2a/{fp}/echo", content=body, headers=headers)
                assert ok.json()["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
            runs = (await http.get("/runs", headers=operator_headers(info))).json()
        assert len(runs["runs"]) == 2  # the refused calls started nothing


async def test_http_json_answers_are_application_json_unless_a2a_json_is_asked_for(
    tmp_path,
) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        fp = agents.provider.fingerprint
        tid = await _task_id(info, fp)
        async with http_client(info) as http:
            plain = await http.get(f"/a2a/{fp}/echo/tasks/{tid}", headers=V1)
            assert plain.status_code == 200
            assert plain.headers["content-type"].split(";")[0] == "application/json"
            assert plain.json()["id"] == tid
            missing = await http.get(f"/a2a/{fp}/echo/tasks/run_nope", headers=V1)
            assert missing.status_code == 404
            assert missing.headers["content-type"].split(";")[0] == "application/json"
            asked = await http.get(
                f"/a2a/{fp}/echo/tasks/{tid}", headers={**V1, "Accept": "application/a2a+json"}
            )
            assert asked.headers["content-type"].split(";")[0] == "application/a2a+json"
            assert asked.json() == plain.json()


async def test_a_push_config_s_credentials_are_its_receiver_s_authorization(tmp_path) -> None:
    async with (
        push_receiver() as receiver,
        broker_with_agents(tmp_path, push_allow_private=True) as (info, agents),
    ):
        fp = agents.provider.fingerprint
        auth = {"scheme": "Bearer", "credentials": "receiver-secret-1"}
        answer = await call(
            info,
            fp,
            "echo",
            rpc(
                "SendMessage",
                {
                    "message": message("pushed"),
                    "configuration": {
                        "taskPushNotificationConfig": {
                            "url": receiver.url,
                            "token": "tok-1",
                            "authentication": auth,
                        }
                    },
                },
            ),
        )
        task = answer["result"]["task"]
        await delivered_all(info)
        assert receiver.received
        async with http_client(info) as http:
            (jwk,) = (await http.get("/.well-known/jwks.json")).json()["keys"]
        for headers, body in receiver.received:
            assert headers["authorization"] == "Bearer receiver-secret-1"
            assert headers["x-a2a-notification-token"] == "tok-1"
            # funduq's signature still rides every update, in its own header.
            _, payload = jose.verify_compact_jws(headers["funduq-signature"], jwk)
            claims = json.loads(payload)
            assert claims["taskId"] == task["id"]
            assert claims["bodySha256"] == hashlib.sha256(body).hexdigest()
        # Credentials that would split the request are refused up front.
        for bad in (
            {"scheme": "Bearer", "credentials": "x\r\nX-Evil: 1"},
            {"scheme": "Bad Scheme", "credentials": "x"},
        ):
            refused = await call(
                info,
                fp,
                "echo",
                rpc(
                    "CreateTaskPushNotificationConfig",
                    {"taskId": task["id"], "url": receiver.url, "authentication": bad},
                ),
            )
            assert refused["error"]["code"] == -32602, refused
