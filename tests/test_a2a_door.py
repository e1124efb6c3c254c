"""The A2A door end to end: a real server on a loopback port, a provider on the
real WebSocket link, and a2a-sdk's own client as the caller (plus raw httpx for
the 0.3 names, version headers and malformed requests).

a2a-sdk's client runs under trio directly: it is plain httpx (anyio) with no
asyncio of its own, so the tests drive it in the test's trio loop.

The provider is played over the link by hand (`support.raw_provider`), serving
four agents: `echo` answers with its input, `asker` pauses on an interrupt and
answers once resumed (pauses again when the answer is "again"), `slow` starts and then waits for a cancel, `mute` never
answers its offers.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import trio
from a2a.client import A2ACardResolver, ClientConfig, ClientFactory
from a2a.client.client import Client
from a2a.client.errors import AgentCardResolutionError
from a2a.types import a2a_pb2 as pb
from a2a.utils.errors import (
    InvalidParamsError,
    TaskNotCancelableError,
    TaskNotFoundError,
    UnsupportedOperationError,
)
from ag_ui.core import RunAgentInput
from google.protobuf.json_format import MessageToDict, ParseDict
from support import (
    HTTP_TIMEOUT,
    PresentingTransport,
    RawProvider,
    chain,
    http_client,
    operator_headers,
    raw_provider,
    running_server,
)

import funduq_trio.server as server_module
from funduq_trio.identity import Identity, cancel_payload
from funduq_trio.provider import Provider, echo
from funduq_trio.web.a2a_door import mount_a2a_door

S = pb.TaskState
AGENTS = ("echo", "asker", "slow", "mute")
CANCEL_REQUESTED = "funduq/cancelRequested"


@pytest.fixture(autouse=True)
def a2a_door_mounted(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mount the door on the app the server builds, if `web/app.py` does not
    (yet) do it itself; once it does this changes nothing."""
    create_app = server_module.create_app

    def create_app_with_a2a(funduq: Any) -> Any:
        app = create_app(funduq)
        if "a2a_rpc" not in app.view_functions:
            mount_a2a_door(app, funduq)
        return app

    monkeypatch.setattr(server_module, "create_app", create_app_with_a2a)


# ------------------------------------------------------------------ the provider


def user_text(run: dict[str, Any]) -> str:
    content = run["runInput"]["messages"][-1]["content"]
    if isinstance(content, str):
        return content
    return " ".join(part.get("text", "") for part in content if part.get("type") == "text")


def started(run: dict[str, Any]) -> dict[str, Any]:
    return {"type": "RUN_STARTED", "threadId": run["threadId"], "runId": run["runId"]}


def finished(run: dict[str, Any], **extra: Any) -> dict[str, Any]:
    return {"type": "RUN_FINISHED", "threadId": run["threadId"], "runId": run["runId"], **extra}


def says(message_id: str, text: str) -> list[dict[str, Any]]:
    return [
        {"type": "TEXT_MESSAGE_START", "messageId": message_id, "role": "assistant"},
        {"type": "TEXT_MESSAGE_CONTENT", "messageId": message_id, "delta": text[:3]},
        {"type": "TEXT_MESSAGE_CONTENT", "messageId": message_id, "delta": text[3:]},
        {"type": "TEXT_MESSAGE_END", "messageId": message_id},
    ]


class Agents:
    """The four test agents, served from one hand-played provider."""

    def __init__(self, provider: RawProvider) -> None:
        self.provider = provider
        self.offers: list[dict[str, Any]] = []
        self._offered = trio.Event()
        self.slow_started: dict[str, trio.Event] = {}
        self.slow_started_any = trio.Event()
        self.cancel_seen = trio.Event()
        #: `slow` stops (finishes without RUN_FINISHED) only once this is set.
        self.may_stop = trio.Event()

    async def serve(self, nursery: trio.Nursery) -> None:
        while True:
            run = await self.provider.next_offer()
            self.offers.append(run)
            self._offered.set()
            self._offered = trio.Event()
            if run["agentName"] != "mute":
                nursery.start_soon(self.handle, run)

    async def offered(self, run_id: str) -> dict[str, Any]:
        """Wait until the provider has been offered `run_id`."""
        while True:
            for run in self.offers:
                if run["runId"] == run_id:
                    return run
            await self._offered.wait()

    async def handle(self, run: dict[str, Any]) -> None:
        p = self.provider
        await p.answer(run, "accepted")
        name, run_id = run["agentName"], run["runId"]
        if name == "echo":
            await p.play(
                run,
                [
                    started(run),
                    *says(f"reply-{run_id}", f"echo: {user_text(run)}"),
                    {
                        "type": "CUSTOM",
                        "name": "a2a.artifact",
                        "value": {
                            "artifactId": "stats",
                            "parts": [{"data": {"chars": len(user_text(run))}}],
                        },
                    },
                    finished(run),
                ],
            )
        elif name == "asker":
            resume = run["runInput"].get("resume")
            again = bool(resume) and resume[0].get("payload") == "again"  # pauses once more
            if not resume or again:
                interrupt = {
                    "id": f"{'again' if again else 'approve'}-{run_id}",
                    "reason": "approval",
                    "message": "Ship it?",
                    "expiresAt": "2099-01-01T00:00:00Z",
                }
                await p.play(
                    run,
                    [
                        started(run),
                        finished(run, outcome={"type": "interrupt", "interrupts": [interrupt]}),
                    ],
                )
            else:
                payload = resume[0].get("payload")
                await p.play(
                    run,
                    [
                        started(run),
                        *says(f"answer-{run_id}", f"resumed with {json.dumps(payload)}"),
                        finished(run),
                    ],
                )
        elif name == "slow":
            await p.report(run_id, started(run))
            self.slow_started.setdefault(run_id, trio.Event()).set()
            self.slow_started_any.set()
            # Waits to be asked to stop, then (once the test lets it) stops
            # without a RUN_FINISHED.
            while await p.cancels.receive() != run_id:
                pass
            self.cancel_seen.set()
            await self.may_stop.wait()
            await p.finish(run_id)


@contextlib.asynccontextmanager
async def broker_with_agents(tmp_path: Any, **overrides: Any) -> AsyncIterator[tuple[Any, Agents]]:
    async with (
        running_server(tmp_path, **overrides) as info,
        raw_provider(info, AGENTS) as provider,
        trio.open_nursery() as nursery,
    ):
        agents = Agents(provider)
        nursery.start_soon(agents.serve, nursery)
        yield info, agents
        nursery.cancel_scope.cancel()


# ------------------------------------------------------------------ the caller


@contextlib.asynccontextmanager
async def a2a_client(
    info: Any,
    provider: str,
    agent: str,
    *,
    streaming: bool = True,
    legacy: bool = False,
    headers: dict[str, str] | None = None,
) -> AsyncIterator[Client]:
    """a2a-sdk's client for one agent, made from the card the door serves.
    `legacy` keeps only the card's 0.3 interface, so the SDK speaks 0.3.
    Its chains are presented (support.PresentingTransport); `headers` ride
    every call (e.g. the operator's)."""
    async with httpx.AsyncClient(
        timeout=HTTP_TIMEOUT, transport=PresentingTransport(), headers=headers
    ) as http:
        card = await A2ACardResolver(http, info.a2a_url(provider, agent)).get_agent_card()
        if legacy:
            keep = [i for i in card.supported_interfaces if i.protocol_version == "0.3"]
            del card.supported_interfaces[:]
            card.supported_interfaces.extend(keep)
        config = ClientConfig(httpx_client=http, streaming=streaming)
        yield ClientFactory(config).create(card)


_ids = iter(range(1, 10_000))


def user_message(text: str, **fields: Any) -> pb.Message:
    return pb.Message(
        message_id=f"caller-msg-{next(_ids)}",
        role=pb.Role.ROLE_USER,
        parts=[pb.Part(text=text)],
        **fields,
    )


def send_request(
    text: str, *, metadata: dict[str, Any] | None = None, immediately: bool = False, **fields: Any
) -> pb.SendMessageRequest:
    request = pb.SendMessageRequest(message=user_message(text, **fields))
    if metadata is not None:
        ParseDict(metadata, request.metadata)
    if immediately:
        request.configuration.return_immediately = True
    return request


async def send(client: Client, request: pb.SendMessageRequest) -> list[pb.StreamResponse]:
    return [event async for event in client.send_message(request)]


async def send_blocking(client: Client, request: pb.SendMessageRequest) -> pb.Task:
    (only,) = await send(client, request)
    assert only.WhichOneof("payload") == "task"
    return only.task


def artifact_text(task: pb.Task, artifact_id: str) -> str:
    (artifact,) = [a for a in task.artifacts if a.artifact_id == artifact_id]
    return "".join(p.text for p in artifact.parts)


def metadata_of(message: Any) -> dict[str, Any]:
    return MessageToDict(message.metadata) if message.HasField("metadata") else {}


async def run_record(info: Any, run_id: str) -> dict[str, Any]:
    async with http_client(info) as http:
        response = await http.get(f"/runs/{run_id}")
        assert response.status_code == 200
        return response.json()


# ------------------------------------------------------------------ card


async def test_agent_card_through_the_sdk_resolver(tmp_path) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        fp = agents.provider.fingerprint
        url = info.a2a_url(fp, "echo")
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as http:
            card = await A2ACardResolver(http, url).get_agent_card()
            assert card.name == "echo"
            assert card.description == "echo (test)"
            assert card.capabilities.streaming is True
            assert {
                (i.url, i.protocol_binding, i.protocol_version) for i in card.supported_interfaces
            } == {(url, "JSONRPC", "1.0"), (url, "JSONRPC", "0.3"), (url, "HTTP+JSON", "1.0")}
            assert [s.id for s in card.skills] == ["echo"]

            # The full 64-hex key names the same agent.
            by_key = await A2ACardResolver(
                http, info.a2a_url(agents.provider.key, "echo")
            ).get_agent_card()
            assert by_key.name == "echo"

            with pytest.raises(AgentCardResolutionError) as err:
                await A2ACardResolver(http, info.a2a_url(fp, "nobody")).get_agent_card()
            assert err.value.status_code == 404


# ------------------------------------------------------------------ send


async def test_send_message_waits_and_returns_the_completed_task(tmp_path) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        fp = agents.provider.fingerprint
        async with a2a_client(info, fp, "echo", streaming=False) as client:
            request = send_request("hello there")
            task = await send_blocking(client, request)
            assert task.id.startswith("run_")
            assert task.context_id.startswith("thread_")
            assert task.status.state == S.TASK_STATE_COMPLETED
            assert artifact_text(task, f"reply-{task.id}") == "echo: hello there"
            stats = next(a for a in task.artifacts if a.artifact_id == "stats")
            assert MessageToDict(stats.parts[0].data) == {"chars": 11}

            # What the provider was asked, and what the record says.
            (offer,) = agents.offers
            assert offer["runId"] == task.id and offer["threadId"] == task.context_id
            (user,) = offer["runInput"]["messages"]
            assert user["id"] == request.message.message_id
            assert user["content"] == "hello there"
            assert (await run_record(info, task.id))["status"] == "completed"

            # The same contextId continues the thread; GetTask reads the record.
            again = await send_blocking(client, send_request("second", context_id=task.context_id))
            assert again.context_id == task.context_id and again.id != task.id
            got = await client.get_task(pb.GetTaskRequest(id=task.id))
            assert got.status.state == S.TASK_STATE_COMPLETED
            assert artifact_text(got, f"reply-{task.id}") == "echo: hello there"


async def test_streaming_opens_with_the_task_then_updates_then_the_final_status(
    tmp_path,
) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        fp = agents.provider.fingerprint
        async with a2a_client(info, fp, "echo") as client:
            events = await send(client, send_request("stream me"))
            kinds = [e.WhichOneof("payload") for e in events]
            assert kinds[0] == "task"
            task = events[0].task
            assert task.status.state in (S.TASK_STATE_SUBMITTED, S.TASK_STATE_WORKING)
            assert kinds[-1] == "status_update"
            final = events[-1].status_update
            assert final.task_id == task.id
            assert final.status.state == S.TASK_STATE_COMPLETED
            assert metadata_of(final)["funduq/aguiEvent"]["type"] == "RUN_FINISHED"

            chunks = [e.artifact_update for e in events if e.HasField("artifact_update")]
            text = [c for c in chunks if c.artifact.artifact_id == f"reply-{task.id}"]
            assert [(c.append, c.artifact.parts[0].text) for c in text] == [
                (False, "ech"),
                (True, "o: stream me"),
            ]
            (stats,) = [c for c in chunks if c.artifact.artifact_id == "stats"]
            assert MessageToDict(stats.artifact.parts[0].data) == {"chars": 9}

            relayed = [
                metadata_of(e.status_update)["funduq/aguiEvent"]["type"]
                for e in events[1:-1]
                if e.HasField("status_update")
            ]
            assert relayed == ["RUN_STARTED", "TEXT_MESSAGE_START", "TEXT_MESSAGE_END"]


async def test_unknown_context_and_unknown_task_are_refused(tmp_path) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        fp = agents.provider.fingerprint
        async with a2a_client(info, fp, "echo", streaming=False) as client:
            with pytest.raises(InvalidParamsError):
                await send(client, send_request("hi", context_id="thread_doesnotexist"))
            with pytest.raises(TaskNotFoundError):
                await client.get_task(pb.GetTaskRequest(id="run_doesnotexist"))
            with pytest.raises(TaskNotFoundError):
                await client.cancel_task(pb.CancelTaskRequest(id="run_doesnotexist"))
            with pytest.raises(TaskNotFoundError):
                await send(client, send_request("hi", task_id="run_doesnotexist"))
            assert agents.offers == []  # nothing was started

            # A task of another agent is not a task of this endpoint.
            task = await send_blocking(client, send_request("mine"))
        async with a2a_client(info, fp, "asker", streaming=False) as other:
            with pytest.raises(TaskNotFoundError):
                await other.get_task(pb.GetTaskRequest(id=task.id))


# ------------------------------------------------------------------ cancel


async def test_cancel_of_a_running_task_is_seen_through_cancelling_to_cancelled(
    tmp_path,
) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        fp = agents.provider.fingerprint
        async with a2a_client(info, fp, "slow") as client:
            streamed: list[pb.StreamResponse] = []
            working = trio.Event()
            stream_done = trio.Event()

            async def stream() -> None:
                async for event in client.send_message(send_request("take your time")):
                    streamed.append(event)
                    if event.HasField("status_update") and (
                        event.status_update.status.state == S.TASK_STATE_WORKING
                    ):
                        working.set()
                stream_done.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(stream)
                await working.wait()  # RUN_STARTED recorded: the run is running
                task_id = streamed[0].task.id

                answer = await client.cancel_task(pb.CancelTaskRequest(id=task_id))
                assert answer.id == task_id
                assert answer.status.state == S.TASK_STATE_WORKING
                assert metadata_of(answer)[CANCEL_REQUESTED] is True

                got = await client.get_task(pb.GetTaskRequest(id=task_id))
                assert got.status.state == S.TASK_STATE_WORKING
                assert metadata_of(got)[CANCEL_REQUESTED] is True
                assert (await run_record(info, task_id))["status"] == "cancelling"

                await agents.cancel_seen.wait()  # the provider was asked to stop
                assert not stream_done.is_set()  # and until it does, the task runs on
                agents.may_stop.set()
                await stream_done.wait()  # the provider stopped; the run settled

            final = streamed[-1].status_update
            assert final.status.state == S.TASK_STATE_CANCELED
            assert CANCEL_REQUESTED not in metadata_of(final)
            got = await client.get_task(pb.GetTaskRequest(id=task_id))
            assert got.status.state == S.TASK_STATE_CANCELED
            assert (await run_record(info, task_id))["status"] == "cancelled"

            # An ended task will not be cancelled.
            with pytest.raises(TaskNotCancelableError):
                await client.cancel_task(pb.CancelTaskRequest(id=task_id))


async def test_cancel_of_a_queued_task_is_immediate_and_of_an_offered_one_pending(
    tmp_path,
) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        fp = agents.provider.fingerprint
        async with a2a_client(info, fp, "mute", streaming=False) as client:
            head = await send_blocking(client, send_request("one", immediately=True))
            behind = await send_blocking(
                client, send_request("two", context_id=head.context_id, immediately=True)
            )
            await agents.offered(head.id)  # the head is offered; the next waits queued
            assert (await run_record(info, behind.id))["status"] == "queued"

            # Nobody has a queued run: it is cancelled at once.
            answer = await client.cancel_task(pb.CancelTaskRequest(id=behind.id))
            assert answer.status.state == S.TASK_STATE_CANCELED
            assert CANCEL_REQUESTED not in metadata_of(answer)
            assert (await run_record(info, behind.id))["status"] == "cancelled"

            # An offered run's cancel waits behind the provider's answer.
            answer = await client.cancel_task(pb.CancelTaskRequest(id=head.id))
            assert answer.status.state == S.TASK_STATE_SUBMITTED
            assert metadata_of(answer)[CANCEL_REQUESTED] is True
            assert (await run_record(info, head.id))["status"] == "offering"


async def test_cancel_of_an_ended_task_is_refused(tmp_path) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        fp = agents.provider.fingerprint
        async with a2a_client(info, fp, "echo", streaming=False) as client:
            task = await send_blocking(client, send_request("done already"))
            with pytest.raises(TaskNotCancelableError):
                await client.cancel_task(pb.CancelTaskRequest(id=task.id))
            assert (await run_record(info, task.id))["status"] == "completed"


async def test_pause_is_answered_by_a_message_naming_the_task_and_cannot_be_cancelled(
    tmp_path,
) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        fp = agents.provider.fingerprint
        async with a2a_client(info, fp, "asker", streaming=False) as client:
            paused = await send_blocking(client, send_request("deploy please"))
            assert paused.status.state == S.TASK_STATE_INPUT_REQUIRED
            (interrupt,) = metadata_of(paused)["interrupts"]
            assert interrupt["id"] == f"approve-{paused.id}"
            assert interrupt["expiresAt"] == "2099-01-01T00:00:00Z"
            assert paused.status.message.parts[0].text == "Ship it?"

            with pytest.raises(TaskNotCancelableError):
                await client.cancel_task(pb.CancelTaskRequest(id=paused.id))
            still = await client.get_task(pb.GetTaskRequest(id=paused.id))
            assert still.status.state == S.TASK_STATE_INPUT_REQUIRED

            answer = pb.SendMessageRequest(
                message=pb.Message(
                    message_id="caller-answer-1",
                    role=pb.Role.ROLE_USER,
                    task_id=paused.id,
                    context_id=paused.context_id,
                    parts=[pb.Part(data=ParseDict({"approved": True}, pb.Part().data))],
                )
            )
            done = await send_blocking(client, answer)
            assert done.id == paused.id  # the same task continues
            assert done.status.state == S.TASK_STATE_COMPLETED
            assert artifact_text(done, f"answer-{paused.id}") == 'resumed with {"approved": true}'

            resumed = agents.offers[-1]
            assert resumed["runId"] == paused.id
            assert resumed["runInput"]["resume"] == [
                {
                    "interruptId": interrupt["id"],
                    "status": "resolved",
                    "payload": {"approved": True},
                }
            ]
            assert resumed["runInput"]["messages"][-1]["id"] == "caller-answer-1"


@pytest.mark.parametrize("agent", ["echo", "asker"])
async def test_a_blocking_answer_is_the_records_when_the_last_write_and_its_settle_fail(
    tmp_path, store, agent
) -> None:
    """The write that ends the run (its completion, or its pause) fails, and
    so does the fault's settle (a failure, with a RUN_ERROR): the record
    still says `running`. The blocking SendMessage's answer must be what
    the record says (GET /runs/{id}, and GetTask), not the `failed` the
    lane's machine reached without recording it. On SQLite nothing settles
    the run before a restart: the answer is `working`. On PostgreSQL the
    thread, idle here, is claimed again by the lease round (its run needs
    a leader) and the run settles `orphaned_by_restart`: the answer waits
    for that, through the record."""
    # A lease round a second (PostgreSQL): the claim comes soon.
    async with broker_with_agents(tmp_path, lease_seconds=3) as (info, agents):
        record = info.funduq.record
        real_move = record.move
        refused: list[str] = []

        async def failing_move(run_id: str, to: str, **changes: Any) -> Any:
            if len(refused) < 2 and to in ("completed", "failed", "cancelled", "input-required"):
                refused.append(str(to))
                raise RuntimeError("the record's write failed (a bug, not the medium)")
            return await real_move(run_id, to, **changes)

        record.move = failing_move  # type: ignore[method-assign]
        fp = agents.provider.fingerprint
        async with a2a_client(info, fp, agent, streaming=False) as client:
            answer = await send_blocking(client, send_request("deploy please"))
            recorded = await run_record(info, answer.id)
            # The run's last write and the fault's settle were both tried.
            ending = "completed" if agent == "echo" else "input-required"
            assert refused == [ending, "failed"]
            if store == "sqlite":
                assert recorded["status"] == "running"
                assert "failureReason" not in recorded["metadata"]
                assert answer.status.state == S.TASK_STATE_WORKING
            else:
                assert recorded["status"] == "failed"
                assert recorded["metadata"]["failureReason"] == "orphaned_by_restart"
                assert answer.status.state == S.TASK_STATE_FAILED
            reason = json.dumps(metadata_of(answer))
            assert ("funduq_error" in reason) is False
            got = await client.get_task(pb.GetTaskRequest(id=answer.id))
            assert MessageToDict(answer) == MessageToDict(got)


async def test_a_bound_threads_cancel_needs_authority_and_says_nothing_of_state(
    tmp_path,
) -> None:
    caller = Identity.generate()
    chain_metadata = {"actorChain": chain(caller)}
    async with broker_with_agents(tmp_path) as (info, agents):
        fp = agents.provider.fingerprint
        async with (
            a2a_client(info, fp, "echo", streaming=False) as echo,
            a2a_client(info, fp, "asker", streaming=False) as asker,
        ):
            ended = await send_blocking(echo, send_request("x", metadata=chain_metadata))
            paused = await send_blocking(asker, send_request("y", metadata=chain_metadata))
            assert ended.status.state == S.TASK_STATE_COMPLETED
            assert paused.status.state == S.TASK_STATE_INPUT_REQUIRED

            refusals = []
            for client, task in ((echo, ended), (asker, paused)):
                with pytest.raises(InvalidParamsError) as err:
                    await client.cancel_task(pb.CancelTaskRequest(id=task.id))
                refusals.append((type(err.value), err.value.message, err.value.data))
            assert refusals[0] == refusals[1]  # the same answer, whatever the state

            # Signed by the segment head, the state may be told.
            for client, task in ((echo, ended), (asker, paused)):
                ts = int(time.time())
                proof = {
                    "publicKey": caller.public_key_hex,
                    "timestamp": ts,
                    "signature": caller.sign(cancel_payload(task.id, ts)),
                }
                request = pb.CancelTaskRequest(id=task.id)
                ParseDict({"cancel": proof}, request.metadata)
                with pytest.raises(TaskNotCancelableError):
                    await client.cancel_task(request)


# ------------------------------------------------------------------ subscribe, list


async def test_subscribe_reattaches_to_a_live_task(tmp_path) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        fp = agents.provider.fingerprint
        async with a2a_client(info, fp, "slow") as client:
            # Non-blocking send: the task comes back at once.
            async with a2a_client(info, fp, "slow", streaming=False) as plain:
                submitted = await send_blocking(plain, send_request("background", immediately=True))
            assert submitted.status.state in (S.TASK_STATE_SUBMITTED, S.TASK_STATE_WORKING)
            await agents.slow_started_any.wait()
            agents.may_stop.set()

            seen: list[pb.StreamResponse] = []
            attached = trio.Event()

            async def subscribe() -> None:
                async for event in client.subscribe(pb.SubscribeToTaskRequest(id=submitted.id)):
                    seen.append(event)
                    attached.set()

            async with trio.open_nursery() as nursery:
                nursery.start_soon(subscribe)
                await attached.wait()
                assert seen[0].task.id == submitted.id
                await client.cancel_task(pb.CancelTaskRequest(id=submitted.id))
            assert seen[-1].status_update.status.state == S.TASK_STATE_CANCELED

            with pytest.raises(UnsupportedOperationError):
                async for _ in client.subscribe(pb.SubscribeToTaskRequest(id=submitted.id)):
                    pass
            with pytest.raises(TaskNotFoundError):
                async for _ in client.subscribe(pb.SubscribeToTaskRequest(id="run_nope")):
                    pass


async def test_list_tasks_of_a_context(tmp_path) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        fp = agents.provider.fingerprint
        async with a2a_client(info, fp, "echo", streaming=False) as client:
            first = await send_blocking(client, send_request("one"))
            second = await send_blocking(client, send_request("two", context_id=first.context_id))
            await send_blocking(client, send_request("elsewhere"))
            listed = await client.list_tasks(
                pb.ListTasksRequest(context_id=first.context_id, include_artifacts=True)
            )
            assert {t.id for t in listed.tasks} == {first.id, second.id}
            assert listed.total_size == 2
            assert all(t.status.state == S.TASK_STATE_COMPLETED for t in listed.tasks)
            by_id = {t.id: t for t in listed.tasks}
            assert artifact_text(by_id[second.id], f"reply-{second.id}") == "echo: two"
            # A bare listing lists nobody's threads (DESIGN §8) ...
            nothing = await client.list_tasks(pb.ListTasksRequest(page_size=1))
            assert nothing.total_size == 0 and not nothing.tasks
            assert not nothing.next_page_token
        # ... but the operator's lists everything.
        async with a2a_client(
            info, fp, "echo", streaming=False, headers=operator_headers(info)
        ) as operator:
            everything = await operator.list_tasks(pb.ListTasksRequest(page_size=1))
            assert everything.total_size == 3 and len(everything.tasks) == 1
            assert everything.next_page_token


# ------------------------------------------------------------------ limits, offline


async def test_a_full_thread_refuses_loudly(tmp_path) -> None:
    async with broker_with_agents(tmp_path, thread_queue_limit=1) as (info, agents):
        fp = agents.provider.fingerprint
        async with a2a_client(info, fp, "mute", streaming=False) as client:
            first = await send_blocking(client, send_request("one", immediately=True))
            with pytest.raises(UnsupportedOperationError) as err:
                await send(
                    client, send_request("two", context_id=first.context_id, immediately=True)
                )
            assert "pending" in err.value.message
            assert err.value.data == {"reason": "thread_queue_full"}


async def test_an_offline_agent_fails_with_its_reason(tmp_path) -> None:
    async with running_server(tmp_path) as info:
        async with raw_provider(info, ["echo"]) as provider:
            fp = provider.fingerprint
        async with http_client(info) as http:
            # The link is closed; wait (reading the roster, no clock) until
            # funduq has seen it go.
            while True:
                roster = (await http.get("/agents")).json()["agents"]
                if not any(agent["online"] for agent in roster):
                    break
        async with a2a_client(info, fp, "echo", streaming=False) as client:
            task = await send_blocking(client, send_request("anyone?"))
            assert task.status.state == S.TASK_STATE_FAILED
            assert task.status.message.parts[0].text == "agent_offline"


# ------------------------------------------------------------------ 0.3 clients


async def test_a_v0_3_sdk_client_is_served(tmp_path) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        fp = agents.provider.fingerprint
        async with a2a_client(info, fp, "echo", streaming=False, legacy=True) as client:
            task = await send_blocking(client, send_request("old school"))
            assert task.status.state == S.TASK_STATE_COMPLETED
            assert artifact_text(task, f"reply-{task.id}") == "echo: old school"
            got = await client.get_task(pb.GetTaskRequest(id=task.id))
            assert got.status.state == S.TASK_STATE_COMPLETED
            with pytest.raises(TaskNotCancelableError):
                await client.cancel_task(pb.CancelTaskRequest(id=task.id))
        async with a2a_client(info, fp, "echo", legacy=True) as client:
            events = await send(client, send_request("streamed"))
            assert events[0].task.status.state in (S.TASK_STATE_SUBMITTED, S.TASK_STATE_WORKING)
            assert events[-1].status_update.status.state == S.TASK_STATE_COMPLETED


# ------------------------------------------------------------------ raw JSON-RPC


def rpc(method: str, params: Any, id: Any = "r-1") -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": id, "method": method, "params": params}


def v03_message(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "kind": "message",
        "messageId": f"raw-{next(_ids)}",
        "role": "user",
        "parts": [{"kind": "text", "text": text}],
        **extra,
    }


async def sse_json(response: httpx.Response) -> list[dict[str, Any]]:
    frames = []
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            frames.append(json.loads(line[len("data:") :]))
    return frames


async def test_v0_3_method_names_over_raw_http(tmp_path) -> None:
    async with broker_with_agents(tmp_path) as (info, agents):
        url = info.a2a_url(agents.provider.fingerprint, "echo")
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as http:
            sent = (
                await http.post(url, json=rpc("message/send", {"message": v03_message("raw")}))
            ).json()
            assert sent["id"] == "r-1"
            task = sent["result"]
            assert task["kind"] == "task"
            assert task["status"]["state"] == "completed"
            assert task["artifacts"][0]["parts"] == [{"kind": "text", "text": "echo: raw"}]

            got = (await http.post(url, json=rpc("tasks/get", {"id": task["id"]}))).json()
            assert got["result"]["status"]["state"] == "completed"

            async with http.stream(
                "POST",
                url + "/",
                json=rpc(
                    "message/stream",
                    {"message": v03_message("s", contextId=task["contextId"])},
                    id=7,
                ),
            ) as response:
                assert response.headers["content-type"].startswith("text/event-stream")
                frames = await sse_json(response)
            assert all(f["jsonrpc"] == "2.0" and f["id"] == 7 for f in frames)
            kinds = [f["result"]["kind"] for f in frames]
            assert kinds[0] == "task" and kinds[-1] == "status-update"
            # The echo may finish before the stream's opening snapshot is read:
            # its text then rides that Task instead of artifact updates.
            assert "artifact-update" in kinds or frames[0]["result"].get("artifacts")
            assert frames[-1]["result"]["final"] is True
            assert frames[-1]["result"]["status"]["state"] == "completed"

            gone = (await http.post(url, json=rpc("tasks/resubscribe", {"id": "run_nope"}))).json()
            assert gone["error"]["code"] == -32001

            cancel = (await http.post(url, json=rpc("tasks/cancel", {"id": task["id"]}))).json()
            assert cancel["error"]["code"] == -32002


async def test_version_header_and_malformed_requests(tmp_path) -> None:
    async with broker_with_agents(tmp_path, max_body_bytes=4096) as (info, agents):
        fp = agents.provider.fingerprint
        url = info.a2a_url(fp, "echo")
        v1 = {"A2A-Version": "1.0"}
        message = {"messageId": "m", "role": "ROLE_USER", "parts": [{"text": "x"}]}
        async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as http:

            async def call(
                body: Any, headers: dict[str, str] | None = None, *, to: str = url
            ) -> dict[str, Any]:
                content = body if isinstance(body, bytes) else json.dumps(body).encode()
                response = await http.post(
                    to,
                    content=content,
                    headers={"content-type": "application/json", **(headers or {})},
                )
                assert response.status_code == 200
                return response.json()

            # A 1.0 method with no header is a 0.3 caller's: the SDK's version error.
            error = (await call(rpc("SendMessage", {"message": message})))["error"]
            assert error["code"] == -32009
            assert error["data"][0]["reason"] == "VERSION_NOT_SUPPORTED"
            assert (await call(rpc("GetTask", {"id": "x"}), {"A2A-Version": "3.0"}))["error"][
                "code"
            ] == -32009
            # A 0.3 method with a 1.0 header, answered as the SDK's 0.3 adapter does.
            assert (await call(rpc("tasks/get", {"id": "x"}), v1))["error"]["code"] == -32603
            assert agents.offers == []

            parse = await call(b'{"jsonrpc": "2.0", "method": "SendMessage", ')
            assert parse["error"]["code"] == -32700 and parse["id"] is None
            assert (await call({"jsonrpc": "2.0", "id": 3}, v1))["error"]["code"] == -32600
            assert (await call(rpc("NoSuchMethod", {}), v1))["error"]["code"] == -32601
            empty = dict(message, parts=[])
            invalid = await call(rpc("SendMessage", {"message": empty}), v1)
            assert invalid["error"]["code"] == -32602
            assert invalid["id"] == "r-1"
            assert (await call(rpc("GetTask", {"id": 12}), v1))["error"]["code"] == -32602
            assert (await call(rpc("tasks/get", {}), None))["error"]["code"] == -32600
            unknown_ctx = await call(
                rpc("SendMessage", {"message": dict(message, contextId="thread_nope")}), v1
            )
            assert unknown_ctx["error"]["code"] == -32602

            bad_chain = await call(
                rpc("SendMessage", {"message": message, "metadata": {"actorChain": ["nope"]}}), v1
            )
            assert bad_chain["error"]["code"] == -32602
            assert "actorChain" in bad_chain["error"]["message"]

            nobody = await call(rpc("GetTask", {"id": "x"}), v1, to=info.a2a_url(fp, "nobody"))
            assert nobody["error"]["code"] == -32600
            assert "nobody" in nobody["error"]["message"]

            too_big = await call(
                rpc("SendMessage", {"message": dict(message, parts=[{"text": "x" * 5000}])}), v1
            )
            assert too_big["error"]["code"] == -32600
            assert agents.offers == []

            # snake_case params are read as well as camelCase.
            ok = await call(
                rpc(
                    "SendMessage",
                    {
                        "message": {
                            "message_id": "snake",
                            "role": "ROLE_USER",
                            "parts": [{"text": "sss"}],
                        },
                        "configuration": {"return_immediately": False},
                    },
                ),
                v1,
            )
            assert ok["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
            assert agents.offers[-1]["runInput"]["messages"][-1]["id"] == "snake"


# ------------------------------------------------------------------ the provider SDK


async def sdk_asker(run_input: RunAgentInput) -> AsyncIterator[dict[str, Any]]:
    """Asks for approval, then says what it was told."""
    ids = {"threadId": run_input.thread_id, "runId": run_input.run_id}
    yield {"type": "RUN_STARTED", **ids}
    if not run_input.resume:
        interrupt = {"id": "ok-to-go", "reason": "approval", "message": "Go ahead?"}
        yield {
            "type": "RUN_FINISHED",
            **ids,
            "outcome": {"type": "interrupt", "interrupts": [interrupt]},
        }
        return
    for event in says("verdict", f"told {json.dumps(run_input.resume[0].payload)}"):
        yield event
    yield {"type": "RUN_FINISHED", **ids}


async def sdk_waiter(run_input: RunAgentInput) -> AsyncIterator[dict[str, Any]]:
    """Starts and waits until it is cancelled (the SDK cancels its task)."""
    yield {"type": "RUN_STARTED", "threadId": run_input.thread_id, "runId": run_input.run_id}
    await trio.sleep_forever()


async def test_agents_of_the_provider_sdk_through_the_sdk_client(tmp_path) -> None:
    skills = [{"id": "repeat", "name": "Repeat", "description": "says it back", "tags": ["demo"]}]
    async with running_server(tmp_path) as info:
        provider = Provider(Identity.generate(), info.provider_url)
        provider.add_agent(
            echo,
            name="echo",
            description="says it back",
            card={"version": "1.2.3", "skills": skills},
        )
        provider.add_agent(sdk_asker, name="asker")
        provider.add_agent(sdk_waiter, name="waiter")
        async with trio.open_nursery() as nursery:
            await nursery.start(provider.run)
            fp = provider.identity.fingerprint

            async with a2a_client(info, fp, "echo") as client:
                async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as http:
                    card = await A2ACardResolver(http, info.a2a_url(fp, "echo")).get_agent_card()
                assert card.version == "1.2.3"
                assert [(s.id, s.name, list(s.tags)) for s in card.skills] == [
                    ("repeat", "Repeat", ["demo"])
                ]
                events = await send(client, send_request("through the SDK"))
                task_id = events[0].task.id
                assert events[-1].status_update.status.state == S.TASK_STATE_COMPLETED
                said = "".join(
                    e.artifact_update.artifact.parts[0].text
                    for e in events
                    if e.HasField("artifact_update")
                )
                assert said == "through the SDK"
                got = await client.get_task(pb.GetTaskRequest(id=task_id))
                assert artifact_text(got, f"{task_id}-echo") == "through the SDK"

            async with a2a_client(info, fp, "asker", streaming=False) as client:
                paused = await send_blocking(client, send_request("may I?"))
                assert paused.status.state == S.TASK_STATE_INPUT_REQUIRED
                assert metadata_of(paused)["interrupts"][0]["id"] == "ok-to-go"
                with pytest.raises(TaskNotCancelableError):
                    await client.cancel_task(pb.CancelTaskRequest(id=paused.id))
                done = await send_blocking(client, send_request("yes, go", task_id=paused.id))
                assert (done.id, done.status.state) == (paused.id, S.TASK_STATE_COMPLETED)
                assert artifact_text(done, "verdict") == 'told "yes, go"'

            async with a2a_client(info, fp, "waiter") as client:
                streamed: list[pb.StreamResponse] = []
                working = trio.Event()

                async def stream() -> None:
                    async for event in client.send_message(send_request("wait")):
                        streamed.append(event)
                        if event.HasField("status_update"):
                            working.set()

                async with trio.open_nursery() as callers:
                    callers.start_soon(stream)
                    await working.wait()
                    answer = await client.cancel_task(pb.CancelTaskRequest(id=streamed[0].task.id))
                    # The agent stops at once, so the answer is either the
                    # accepted request (working + marker) or already the outcome.
                    assert (
                        metadata_of(answer).get(CANCEL_REQUESTED) is True
                        or answer.status.state == S.TASK_STATE_CANCELED
                    )
                assert streamed[-1].status_update.status.state == S.TASK_STATE_CANCELED
            nursery.cancel_scope.cancel()
