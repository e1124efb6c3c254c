"""The A2A HTTP+JSON binding beside JSON-RPC (issue 13 item 5): a2a-sdk's own
client, made from the card funduq serves and told which binding to speak,
does the same things over each; raw httpx checks the binding's error shape."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
from a2a.client.client import Client
from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import TaskNotCancelableError, TaskNotFoundError
from push_support import push_receiver
from support import HTTP_TIMEOUT, http_client, sse_events
from test_a2a_door import (  # noqa: F401 (fixture)
    a2a_door_mounted,
    artifact_text,
    broker_with_agents,
    send,
    send_blocking,
    send_request,
)

S = pb.TaskState
BINDINGS = ["HTTP+JSON", "JSONRPC"]


@contextlib.asynccontextmanager
async def client_over(
    info: Any, fp: str, agent: str, binding: str, *, streaming: bool = True
) -> AsyncIterator[tuple[Client, list[str]]]:
    """The SDK's client for `binding` only; yields it and the URLs it called."""
    called: list[str] = []

    async def note(req: httpx.Request) -> None:
        called.append(f"{req.method} {req.url.path}")

    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT, event_hooks={"request": [note]}) as http:
        card = await A2ACardResolver(http, info.a2a_url(fp, agent)).get_agent_card()
        config = ClientConfig(
            httpx_client=http, streaming=streaming, supported_protocol_bindings=[binding]
        )
        yield ClientFactory(config).create(card), called


@pytest.mark.parametrize("binding", BINDINGS)
async def test_the_sdk_client_works_over_each_binding(tmp_path, binding: str) -> None:
    async with broker_with_agents(tmp_path, push_allow_private=True) as (info, agents):
        fp = agents.provider.fingerprint
        base = f"/a2a/{fp}/echo"
        async with client_over(info, fp, "echo", binding, streaming=False) as (client, called):
            task = await send_blocking(client, send_request("over rest"))
            assert task.status.state == S.TASK_STATE_COMPLETED
            assert artifact_text(task, f"reply-{task.id}") == "echo: over rest"
            got = await client.get_task(pb.GetTaskRequest(id=task.id))
            assert got.status.state == S.TASK_STATE_COMPLETED
            listed = await client.list_tasks(pb.ListTasksRequest(context_id=task.context_id))
            assert [t.id for t in listed.tasks] == [task.id]
            with pytest.raises(TaskNotCancelableError):
                await client.cancel_task(pb.CancelTaskRequest(id=task.id))
            with pytest.raises(TaskNotFoundError):
                await client.get_task(pb.GetTaskRequest(id="run_nope"))
            async with push_receiver() as receiver:
                made = await client.create_task_push_notification_config(
                    pb.TaskPushNotificationConfig(task_id=task.id, id="p1", url=receiver.url)
                )
                assert made.id == "p1" and made.url == receiver.url
                again = await client.get_task_push_notification_config(
                    pb.GetTaskPushNotificationConfigRequest(task_id=task.id, id="p1")
                )
                assert again == made
                configs = await client.list_task_push_notification_configs(
                    pb.ListTaskPushNotificationConfigsRequest(task_id=task.id)
                )
                assert [c.id for c in configs.configs] == ["p1"]
                await client.delete_task_push_notification_config(
                    pb.DeleteTaskPushNotificationConfigRequest(task_id=task.id, id="p1")
                )
        if binding == "HTTP+JSON":
            assert f"POST {base}/message:send" in called
            assert f"GET {base}/tasks/{task.id}" in called
            assert f"POST {base}/tasks/{task.id}:cancel" in called
            assert f"POST {base}/tasks/{task.id}/pushNotificationConfigs" in called
            assert f"POST {base}" not in called
        else:
            assert {c for c in called if "agent-card" not in c} == {f"POST {base}"}
        async with client_over(info, fp, "echo", binding) as (client, called):
            events = await send(client, send_request("streamed"))
            assert events[0].task.status.state in (S.TASK_STATE_SUBMITTED, S.TASK_STATE_WORKING)
            assert events[-1].status_update.status.state == S.TASK_STATE_COMPLETED
            deltas = "".join(
                e.artifact_update.artifact.parts[0].text
                for e in events
                if e.HasField("artifact_update")
                and e.artifact_update.artifact.parts[0].HasField("text")
            )
            assert deltas == "echo: streamed"
        if binding == "HTTP+JSON":
            assert f"POST {base}/message:stream" in called


async def test_rest_errors_have_the_bindings_shape(tmp_path) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        fp = agents.provider.fingerprint
        base = f"/a2a/{fp}/echo"
        v1 = {"A2A-Version": "1.0"}
        async with http_client(info) as http:
            missing = await http.get(f"{base}/tasks/run_nope", headers=v1)
            assert missing.status_code == 404
            error = missing.json()["error"]
            assert error["status"] == "NOT_FOUND"
            assert error["details"][0]["reason"] == "TASK_NOT_FOUND"
            old = await http.get(f"{base}/tasks/run_nope")  # no version: 0.3
            assert old.status_code == 400
            assert old.json()["error"]["details"][0]["reason"] == "VERSION_NOT_SUPPORTED"
            bad = await http.post(f"{base}/message:send", content=b"{nope", headers=v1)
            assert bad.status_code == 400 and bad.json()["error"]["status"] == "INVALID_ARGUMENT"
            wrong_shape = await http.post(f"{base}/message:send", json={"message": 5}, headers=v1)
            assert wrong_shape.status_code == 400
            no_agent = await http.post(
                f"/a2a/{fp}/ghost/message:send",
                headers=v1,
                json={"message": {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "x"}]}},
            )
            assert no_agent.status_code == 400
            assert no_agent.json()["error"]["details"][0]["metadata"] == {
                "reason": "agent_not_found"
            }
            private = await http.post(
                f"{base}/message:send",
                headers=v1,
                json={
                    "message": {"messageId": "m2", "role": "ROLE_USER", "parts": [{"text": "x"}]},
                    "configuration": {"taskPushNotificationConfig": {"url": "http://127.0.0.1/"}},
                },
            )
            assert private.status_code == 400
            assert "FUNDUQ_PUSH_ALLOW_PRIVATE" in private.json()["error"]["message"]


async def test_subscribe_and_cancel_over_rest(tmp_path) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        fp = agents.provider.fingerprint
        base = f"/a2a/{fp}/slow"
        v1 = {"A2A-Version": "1.0"}
        message = {"messageId": "s1", "role": "ROLE_USER", "parts": [{"text": "wait"}]}
        async with http_client(info) as http:
            sent = await http.post(
                f"{base}/message:send",
                headers=v1,
                json={"message": message, "configuration": {"returnImmediately": True}},
            )
            assert sent.status_code == 200, sent.text
            task_id = sent.json()["task"]["id"]
            await agents.slow_started_any.wait()
            # The provider's accept and first report are only on their way when
            # its agent starts: the run is working once funduq recorded that
            # report (a store that writes through a worker thread takes longer).
            async with contextlib.aclosing(info.funduq.follow(task_id)) as bursts:
                await anext(bursts)
            async with http.stream(
                "GET", f"{base}/tasks/{task_id}:subscribe", headers=v1
            ) as stream:
                assert stream.headers["content-type"].startswith("text/event-stream")
                events = sse_events(stream)
                first = await anext(events)
                assert first["task"]["id"] == task_id
                assert first["task"]["status"]["state"] == "TASK_STATE_WORKING"
                cancel = await http.post(f"{base}/tasks/{task_id}:cancel", headers=v1)
                assert cancel.status_code == 200
                assert cancel.json()["metadata"]["funduq/cancelRequested"] is True
                agents.may_stop.set()
                rest = [event async for event in events]
            assert rest[-1]["statusUpdate"]["status"]["state"] == "TASK_STATE_CANCELED"
            ended = await http.get(f"{base}/tasks/{task_id}:subscribe", headers=v1)
            assert ended.status_code == 400
            assert ended.json()["error"]["details"][0]["reason"] == "UNSUPPORTED_OPERATION"
