"""A2A push notifications end to end (DESIGN §10, issue 13 item 4): a real
server, the hand-played provider of test_a2a_door, and a real HTTP receiver on
loopback (tests/push_support.py). What is asserted is what the receiver gets:
every update the task's stream would carry, once each, in order, signed by
funduq's key from /.well-known/jwks.json -- across a receiver outage and a
restart of funduq.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import pytest
import trio
from a2a.types import a2a_pb2 as pb
from google.protobuf.json_format import MessageToDict
from push_support import Receiver, push_receiver
from support import http_client, running_server
from test_a2a_door import a2a_door_mounted, broker_with_agents  # noqa: F401 (fixture)

from funduq_trio import jose
from funduq_trio.protocol import a2a, push

V1 = {"A2A-Version": "1.0"}
S = pb.TaskState


def rpc(method: str, params: Any, id: Any = "r-1") -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id, "method": method, "params": params}


def message(text: str, **extra: Any) -> dict[str, Any]:
    return {"messageId": f"m-{text}", "role": "ROLE_USER", "parts": [{"text": text}], **extra}


async def call(info: Any, fp: str, agent: str, body: dict[str, Any], headers=V1) -> Any:
    async with http_client(info) as http:
        response = await http.post(f"/a2a/{fp}/{agent}", json=body, headers=headers)
        assert response.status_code == 200
        return response.json()


async def send_with_push(
    info: Any,
    fp: str,
    url: str,
    *,
    agent: str = "echo",
    text: str = "hello",
    blocking: bool = True,
    token: str = "tok-1",
) -> dict[str, Any]:
    config = {"taskPushNotificationConfig": {"url": url, "token": token}}
    if not blocking:
        config["returnImmediately"] = True
    answer = await call(
        info, fp, agent, rpc("SendMessage", {"message": message(text), "configuration": config})
    )
    assert "result" in answer, answer
    return answer["result"]["task"]


async def expected_updates(info: Any, task_id: str) -> list[dict[str, Any]]:
    """The updates a stream of the (ended) task carries after its snapshot:
    each event's, then the final status -- what the receiver must get."""
    async with http_client(info) as http:
        record = (await http.get(f"/runs/{task_id}")).json()
    projection = a2a.TaskProjection(task_id=task_id, context_id=record["threadId"])
    updates = [u for e in record["events"] for u in projection.apply(e["seq"], e["event"])]
    updates.append(projection.settle(record))
    return [MessageToDict(u) for u in updates]


async def delivered_all(info: Any) -> None:
    pushes = info.funduq.pushes
    await pushes.wait_until(lambda: pushes.gauges()["funduq_push_delivering"][1] == 0)


async def check_signed(info: Any, receiver: Receiver, task_id: str, token: str) -> None:
    async with http_client(info) as http:
        jwks = (await http.get("/.well-known/jwks.json")).json()
    (jwk,) = jwks["keys"]
    assert jwk["kid"] == info.funduq.identity.fingerprint
    ids = set()
    for headers, body in receiver.received:
        assert headers["x-a2a-notification-token"] == token
        scheme, _, jws = headers["authorization"].partition(" ")
        assert scheme == "Bearer"
        header, payload = jose.verify_compact_jws(jws, jwk)
        assert header["kid"] == jwk["kid"]
        claims = json.loads(payload)
        assert claims["iss"] == jwk["kid"]
        assert claims["taskId"] == task_id
        assert claims["bodySha256"] == hashlib.sha256(body).hexdigest()
        ids.add(claims["jti"])
    assert len(ids) == len(receiver.received)  # one jti per update


async def test_every_update_is_pushed_once_in_order_and_signed(tmp_path) -> None:
    async with (
        push_receiver() as receiver,
        broker_with_agents(tmp_path, push_allow_private=True) as (info, agents),
    ):
        fp = agents.provider.fingerprint
        task = await send_with_push(info, fp, receiver.url)
        assert task["status"]["state"] == "TASK_STATE_COMPLETED"
        await delivered_all(info)
        expected = await expected_updates(info, task["id"])
        assert len(expected) > 4
        assert receiver.bodies() == expected
        assert expected[-1]["statusUpdate"]["status"]["state"] == "TASK_STATE_COMPLETED"
        await check_signed(info, receiver, task["id"], "tok-1")


async def test_a_receiver_outage_and_a_restart_lose_and_repeat_nothing(tmp_path) -> None:
    async with push_receiver() as receiver:
        receiver.down_after = 2  # two updates land, then the port refuses
        async with broker_with_agents(
            tmp_path,
            push_allow_private=True,
            push_backoff_seconds=0.001,
            push_max_attempts=1000,
        ) as (info, agents):
            fp = agents.provider.fingerprint
            task = await send_with_push(info, fp, receiver.url)
            assert task["status"]["state"] == "TASK_STATE_COMPLETED"
            pushes = info.funduq.pushes
            # Refused connections, retried.
            await pushes.wait_until(lambda: pushes.failed_attempts >= 3)
            assert len(receiver.received) == 2
        await receiver.up()  # back, on the same port, while funduq is down
        async with running_server(tmp_path, push_allow_private=True) as info:
            await receiver.wait_for(3)  # the restarted funduq resumed the outbox
            await delivered_all(info)
            expected = await expected_updates(info, task["id"])
            assert receiver.bodies() == expected
            await check_signed(info, receiver, task["id"], "tok-1")


async def test_a_failing_receiver_is_given_up_after_the_last_attempt(tmp_path) -> None:
    async with push_receiver() as receiver:
        receiver.answers = [503, 500, 502, 200]
        async with broker_with_agents(
            tmp_path,
            push_allow_private=True,
            push_backoff_seconds=0.001,
            push_max_attempts=3,
        ) as (info, agents):
            fp = agents.provider.fingerprint
            await send_with_push(info, fp, receiver.url)
            pushes = info.funduq.pushes
            await pushes.wait_until(lambda: pushes.given_up == 1)
            await delivered_all(info)
            assert receiver.attempts == 3 and receiver.received == []
            async with http_client(info) as http:
                metrics = (await http.get("/metrics")).text
            assert "funduq_push_given_up 1" in metrics


async def test_a_paused_task_pushes_through_the_answer(tmp_path) -> None:
    async with (
        push_receiver() as receiver,
        broker_with_agents(tmp_path, push_allow_private=True) as (info, agents),
    ):
        fp = agents.provider.fingerprint
        task = await send_with_push(info, fp, receiver.url, agent="asker")
        assert task["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"
        await receiver.wait_for(2)  # RUN_STARTED's update, then the pause
        answer = await call(
            info,
            fp,
            "asker",
            rpc(
                "SendMessage",
                {"message": message("yes", taskId=task["id"], contextId=task["contextId"])},
            ),
        )
        assert answer["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
        await delivered_all(info)
        states = [
            b["statusUpdate"]["status"]["state"] for b in receiver.bodies() if "statusUpdate" in b
        ]
        assert states[0] == "TASK_STATE_WORKING"
        assert "TASK_STATE_INPUT_REQUIRED" in states
        assert states[-1] == "TASK_STATE_COMPLETED"
        assert states.index("TASK_STATE_INPUT_REQUIRED") < len(states) - 1
        texts = [
            b["artifactUpdate"]["artifact"]["parts"][0]["text"]
            for b in receiver.bodies()
            if "artifactUpdate" in b and "text" in b["artifactUpdate"]["artifact"]["parts"][0]
        ]
        assert "".join(texts) == 'resumed with "yes"'


async def test_a_deliverer_that_lags_past_a_pause_still_pushes_the_pause(tmp_path) -> None:
    """The receiver is down while the task pauses and is answered: once it is
    back, the pause's INPUT_REQUIRED arrives in its place, once."""
    async with push_receiver() as receiver:
        receiver.down()
        async with broker_with_agents(
            tmp_path,
            push_allow_private=True,
            push_backoff_seconds=0.001,
            push_max_attempts=10_000,
        ) as (info, agents):
            fp = agents.provider.fingerprint
            task = await send_with_push(info, fp, receiver.url, agent="asker")
            assert task["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"
            answer = await call(
                info,
                fp,
                "asker",
                rpc(
                    "SendMessage",
                    {"message": message("yes", taskId=task["id"], contextId=task["contextId"])},
                ),
            )
            assert answer["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
            pushes = info.funduq.pushes
            await pushes.wait_until(lambda: pushes.failed_attempts >= 1)
            assert receiver.received == []
            await receiver.up()
            await delivered_all(info)
        states = [
            b["statusUpdate"]["status"]["state"] for b in receiver.bodies() if "statusUpdate" in b
        ]
        assert states.count("TASK_STATE_INPUT_REQUIRED") == 1
        paused_at = states.index("TASK_STATE_INPUT_REQUIRED")
        assert 0 < paused_at < len(states) - 1
        assert states[-1] == "TASK_STATE_COMPLETED"
        assert states[paused_at + 1] == "TASK_STATE_WORKING"


def _states(receiver: Receiver) -> list[str]:
    return [b["statusUpdate"]["status"]["state"] for b in receiver.bodies() if "statusUpdate" in b]


async def test_a_turn_that_pauses_again_before_its_deliverer_wakes_is_pushed(tmp_path) -> None:
    """Finding 8: the deliverer is still sending the first pause while the
    answer comes and the next turn pauses again. It must push that second
    pause at once (not wait for an answer nobody knows to give), and leave
    nothing behind per task once the task ends."""
    async with push_receiver() as receiver:
        receiver.down_after = 1  # the first pause's status update fails until `up`
        async with broker_with_agents(
            tmp_path,
            push_allow_private=True,
            push_backoff_seconds=0.001,
            push_max_attempts=10_000,
        ) as (info, agents):
            fp = agents.provider.fingerprint
            pushes = info.funduq.pushes
            task = await send_with_push(info, fp, receiver.url, agent="asker")
            assert task["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"
            await pushes.wait_until(lambda: pushes.failed_attempts >= 1)
            again = await call(
                info,
                fp,
                "asker",
                rpc(
                    "SendMessage",
                    {"message": message("again", taskId=task["id"], contextId=task["contextId"])},
                ),
            )
            assert again["result"]["task"]["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"
            await receiver.up()
            with trio.fail_after(10):  # a guard: on the base it waits for good
                while _states(receiver).count("TASK_STATE_INPUT_REQUIRED") < 2:
                    await receiver.wait_for(len(receiver.received) + 1)
            answer = await call(
                info,
                fp,
                "asker",
                rpc(
                    "SendMessage",
                    {"message": message("yes", taskId=task["id"], contextId=task["contextId"])},
                ),
            )
            assert answer["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
            await delivered_all(info)
            assert pushes._resumed == {} and pushes._following == {}
        states = _states(receiver)
        assert states.count("TASK_STATE_INPUT_REQUIRED") == 2
        assert states[-1] == "TASK_STATE_COMPLETED"


async def test_an_inline_config_is_refused_before_its_answer_resumes_the_task(tmp_path) -> None:
    """Finding 9: an answer carrying a push config for a task whose configs
    are at FUNDUQ_PUSH_CONFIGS_PER_TASK was let through, resumed the task,
    and only then refused (an error for an answer that was taken). Now it
    is refused first and the task still waits for its answer."""
    async with (
        push_receiver() as receiver,
        broker_with_agents(tmp_path, push_allow_private=True, push_configs_per_task=1) as (
            info,
            agents,
        ),
    ):
        fp = agents.provider.fingerprint
        task = await send_with_push(info, fp, receiver.url, agent="asker")
        assert task["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"
        answer = await call(
            info,
            fp,
            "asker",
            rpc(
                "SendMessage",
                {
                    "message": message("yes", taskId=task["id"], contextId=task["contextId"]),
                    "configuration": {
                        "taskPushNotificationConfig": {"url": receiver.url, "id": "two"}
                    },
                },
            ),
        )
        assert answer["error"]["code"] == -32602, answer
        assert "FUNDUQ_PUSH_CONFIGS_PER_TASK" in answer["error"]["message"]
        async with http_client(info) as http:
            record = (await http.get(f"/runs/{task['id']}")).json()
        assert record["status"] == "input-required"
        assert info.funduq.pushes._reserved == 0
        answer = await call(
            info,
            fp,
            "asker",
            rpc(
                "SendMessage",
                {"message": message("yes", taskId=task["id"], contextId=task["contextId"])},
            ),
        )
        assert answer["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"


async def test_a_held_slot_counts_against_active_configs(tmp_path) -> None:
    async with broker_with_agents(tmp_path, push_allow_private=True, push_max_active=1) as (
        info,
        _agents,
    ):
        pushes = info.funduq.pushes
        config = pb.TaskPushNotificationConfig(url="http://127.0.0.1:9/hook")
        slot = await pushes.reserve(config)
        with pytest.raises(Exception, match="FUNDUQ_PUSH_MAX_ACTIVE"):
            await pushes.reserve(config)
        slot.release()
        slot.release()  # again: a no-op
        (await pushes.reserve(config)).release()
        assert pushes._reserved == 0


async def test_push_configs_are_created_read_listed_and_deleted(tmp_path) -> None:
    async with (
        push_receiver() as receiver,
        broker_with_agents(tmp_path, push_allow_private=True, push_configs_per_task=2) as (
            info,
            agents,
        ),
    ):
        fp = agents.provider.fingerprint
        task = await send_with_push(info, fp, receiver.url, agent="asker", token="")
        tid = task["id"]
        made = await call(
            info,
            fp,
            "asker",
            rpc(
                "CreateTaskPushNotificationConfig",
                {"taskId": tid, "id": "second", "url": receiver.url, "token": "t2"},
            ),
        )
        assert made["result"] == {"id": "second", "taskId": tid, "url": receiver.url, "token": "t2"}
        got = await call(
            info, fp, "asker", rpc("GetTaskPushNotificationConfig", {"taskId": tid, "id": "second"})
        )
        assert got["result"] == made["result"]
        listed = await call(
            info, fp, "asker", rpc("ListTaskPushNotificationConfigs", {"taskId": tid})
        )
        assert [c["url"] for c in listed["result"]["configs"]] == [receiver.url] * 2
        full = await call(
            info,
            fp,
            "asker",
            rpc(
                "CreateTaskPushNotificationConfig",
                {"taskId": tid, "id": "third", "url": receiver.url},
            ),
        )
        assert full["error"]["code"] == -32602
        assert "FUNDUQ_PUSH_CONFIGS_PER_TASK" in full["error"]["message"]
        # The 0.3 names reach the same configs.
        old = await call(
            info,
            fp,
            "asker",
            rpc(
                "tasks/pushNotificationConfig/get",
                {"id": tid, "pushNotificationConfigId": "second"},
            ),
            headers={},
        )
        assert old["result"]["pushNotificationConfig"]["url"] == receiver.url
        deleted = await call(
            info,
            fp,
            "asker",
            rpc("DeleteTaskPushNotificationConfig", {"taskId": tid, "id": "second"}),
        )
        assert deleted["result"] is None
        gone = await call(
            info, fp, "asker", rpc("GetTaskPushNotificationConfig", {"taskId": tid, "id": "second"})
        )
        assert gone["error"]["code"] == -32001
        # Another agent's endpoint does not see the task.
        other = await call(
            info, fp, "echo", rpc("ListTaskPushNotificationConfigs", {"taskId": tid})
        )
        assert other["error"]["code"] == -32001


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:9/hook",
        "http://localhost:9/hook",
        "http://10.1.2.3/hook",
        "http://169.254.169.254/latest/meta-data",
        "http://[::1]:9/hook",
        "http://[::ffff:127.0.0.1]/hook",
        "ftp://example.com/hook",
        "http://user:pw@example.com/hook",
        "http://example.com/" + "x" * push.MAX_URL_CHARS,
    ],
)
async def test_private_and_malformed_targets_are_refused(tmp_path, url: str) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        fp = agents.provider.fingerprint
        answer = await call(
            info,
            fp,
            "echo",
            rpc(
                "SendMessage",
                {
                    "message": message("x"),
                    "configuration": {"taskPushNotificationConfig": {"url": url}},
                },
            ),
        )
        assert answer["error"]["code"] == -32602, answer
        assert await info.funduq.list_runs() == []  # nothing started
        assert agents.offers == []


def test_backoff_doubles_up_to_its_cap() -> None:
    delays = [push.backoff_delay(n, 0.5) for n in range(1, 12)]
    assert delays[:4] == [0.5, 1.0, 2.0, 4.0]
    assert max(delays) == push.MAX_BACKOFF_SECONDS
    assert push.backoff_delay(10**6, 1.0) == push.MAX_BACKOFF_SECONDS


async def test_backoff_waits_between_attempts_in_virtual_time(tmp_path, autojump_clock) -> None:
    """The deliverer sleeps the schedule between attempts (MockClock)."""
    from funduq_trio.broker.pushes import PushConfig, Pushes, _GiveUp

    class Facade:
        settings = type(
            "S",
            (),
            {"push_max_attempts": 4, "push_backoff_seconds": 2.0, "push_allow_private": True},
        )()
        record = None

    pushes = Pushes(Facade())
    times: list[float] = []

    async def failing(config: Any, key: Any, body: bytes) -> str:
        times.append(trio.current_time())
        return "HTTP 503"

    async def finish(config: Any, state: str, error: Any) -> None:
        config.state = state

    pushes._attempt = failing
    pushes._finish = finish
    config = PushConfig("t", "c", "http://x/", "", {}, (0, -1))
    start = trio.current_time()
    with pytest.raises(_GiveUp):
        await pushes._send(config, (1, 0), pb.StreamResponse())
    assert [round(t - start, 6) for t in times] == [0, 2.0, 6.0, 14.0]
    assert config.state == "given_up"


def test_push_settings_are_read_and_checked() -> None:
    from funduq_trio.config import Settings

    assert Settings().push_allow_private is False
    assert Settings.from_env({"FUNDUQ_PUSH_ALLOW_PRIVATE": "true"}).push_allow_private is True
    assert Settings.from_env({"FUNDUQ_PUSH_ALLOW_PRIVATE": "off"}).push_allow_private is False
    with pytest.raises(ValueError, match="FUNDUQ_PUSH_ALLOW_PRIVATE"):
        Settings.from_env({"FUNDUQ_PUSH_ALLOW_PRIVATE": "maybe"})
    problems = Settings(
        push_max_attempts=0, push_timeout_seconds=0, push_backoff_seconds=-1
    ).problems()
    assert any("FUNDUQ_PUSH_MAX_ATTEMPTS" in p for p in problems)
    assert any("FUNDUQ_PUSH_TIMEOUT_SECONDS" in p for p in problems)
    assert any("FUNDUQ_PUSH_BACKOFF_SECONDS" in p for p in problems)


async def test_a_deleted_config_gets_nothing_more_and_active_configs_are_bounded(tmp_path) -> None:
    async with (
        push_receiver() as receiver,
        broker_with_agents(tmp_path, push_allow_private=True, push_max_active=2) as (info, agents),
    ):
        fp = agents.provider.fingerprint
        task = await send_with_push(info, fp, receiver.url, agent="asker", token="kept")
        tid = task["id"]
        made = await call(
            info,
            fp,
            "asker",
            rpc(
                "CreateTaskPushNotificationConfig",
                {"taskId": tid, "id": "dropped", "url": receiver.url, "token": "dropped"},
            ),
        )
        assert "result" in made, made
        await receiver.wait_for(3)  # "kept": started + paused; "dropped": paused (as it stands)
        tokens = [h["x-a2a-notification-token"] for h, _ in receiver.received]
        assert sorted(tokens) == ["dropped", "kept", "kept"]
        # Two configs deliver: a third, on any task, is refused (and starts nothing).
        refused = await call(
            info,
            fp,
            "asker",
            rpc(
                "SendMessage",
                {
                    "message": message("third"),
                    "configuration": {"taskPushNotificationConfig": {"url": receiver.url}},
                },
            ),
        )
        assert "FUNDUQ_PUSH_MAX_ACTIVE" in refused["error"]["message"]
        deleted = await call(
            info,
            fp,
            "asker",
            rpc("DeleteTaskPushNotificationConfig", {"taskId": tid, "id": "dropped"}),
        )
        assert deleted["result"] is None
        answer = await call(
            info,
            fp,
            "asker",
            rpc(
                "SendMessage", {"message": message("yes", taskId=tid, contextId=task["contextId"])}
            ),
        )
        assert answer["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
        await delivered_all(info)
        tokens = [h["x-a2a-notification-token"] for h, _ in receiver.received]
        assert tokens.count("dropped") == 1
        assert tokens.count("kept") > 3


class _Rebinding(trio.abc.HostnameResolver):
    """A DNS server playing rebinding: `rebind.example` is "public" (here
    127.0.0.2, which the test lets count as public) for the checks made as
    the config is made, then alternately public and internal (127.0.0.1) --
    the answer a check sees is never the one the next resolution gets."""

    def __init__(self) -> None:
        self.calls = 0

    async def getaddrinfo(self, host, port, family=0, type=0, proto=0, flags=0):  # noqa: A002
        name = host.decode() if isinstance(host, bytes) else host
        if name != "rebind.example":
            return await trio.to_thread.run_sync(
                __import__("socket").getaddrinfo, host, port, family, type, proto, flags
            )
        self.calls += 1
        address = "127.0.0.2" if self.calls <= 2 or self.calls % 2 else "127.0.0.1"
        return [(trio.socket.AF_INET, trio.socket.SOCK_STREAM, 6, "", (address, int(port)))]

    async def getnameinfo(self, sockaddr, flags):
        raise NotImplementedError


async def test_a_push_connects_to_the_address_that_was_checked(tmp_path, monkeypatch) -> None:
    # Finding 4: the host was vetted, then resolved again by the POST; a
    # rebinding DNS answer sent the push to a loopback service.
    monkeypatch.setattr(push, "address_blocked", lambda address: address != "127.0.0.2")
    resolver = _Rebinding()
    trio.socket.set_custom_hostname_resolver(resolver)
    async with push_receiver() as inside, push_receiver("127.0.0.2", inside.port) as vetted:
        async with broker_with_agents(
            tmp_path,
            push_backoff_seconds=0.001,
            push_max_attempts=50,
        ) as (info, agents):
            fp = agents.provider.fingerprint
            task = await send_with_push(info, fp, f"http://rebind.example:{inside.port}/hook")
            await delivered_all(info)
            expected = await expected_updates(info, task["id"])
            assert inside.received == []
            assert vetted.bodies() == expected
            assert {h["host"] for h, _ in vetted.received} == {f"rebind.example:{inside.port}"}
            assert resolver.calls > 2


@pytest.mark.sqlite_only
async def test_a_task_a_fault_left_unsettled_is_pushed_once_a_restart_settles_it(
    tmp_path,
) -> None:
    """The run's last write fails, and so does the fault's settle: the record
    says `running`, and on SQLite nothing changes that before a restart.
    The deliverer pushes what the record holds and stops (rather than read
    the record in a loop); the restart settles the run `orphaned_by_restart`
    and the deliverer resumes from its cursor: the receiver gets every update
    of the task once, in order, ending with `failed` -- never a status the
    record did not hold."""
    async with push_receiver() as receiver:
        async with broker_with_agents(tmp_path, push_allow_private=True) as (info, agents):
            record = info.funduq.record
            real_move = record.move
            refused: list[str] = []

            async def failing_move(run_id: str, to: str, **changes: Any) -> Any:
                if len(refused) < 2 and to in ("completed", "failed"):
                    refused.append(str(to))
                    raise RuntimeError("the record's write failed (a bug, not the medium)")
                return await real_move(run_id, to, **changes)

            record.move = failing_move  # type: ignore[method-assign]
            task = await send_with_push(info, agents.provider.fingerprint, receiver.url)
            assert refused == ["completed", "failed"]
            assert task["status"]["state"] == "TASK_STATE_WORKING"  # the record's
            await delivered_all(info)  # the deliverer stopped
            states = [
                b["statusUpdate"]["status"]["state"]
                for b in receiver.bodies()
                if "statusUpdate" in b
            ]
            assert not any(s in ("TASK_STATE_COMPLETED", "TASK_STATE_FAILED") for s in states)
        async with running_server(tmp_path, push_allow_private=True) as info:
            await receiver.wait_for(len(receiver.received) + 1)
            await delivered_all(info)
            async with http_client(info) as http:
                run = (await http.get(f"/runs/{task['id']}")).json()
            assert run["status"] == "failed"
            assert run["metadata"]["failureReason"] == "orphaned_by_restart"
            expected = await expected_updates(info, task["id"])
            assert receiver.bodies() == expected
            assert expected[-1]["statusUpdate"]["status"]["state"] == "TASK_STATE_FAILED"
