"""Events on every node (issue #12, docs/cluster.md), through real parts: two
funduq servers on one PostgreSQL database, a provider played by hand on
node A, a run started through A's door, and callers on node B that re-attach
to it (AG-UI `GET /agui/runs/{id}/events`, A2A `SubscribeToTask` by a2a-sdk's
client). B has no lane for the run: its events reach B's callers through
the record, pushed by LISTEN/NOTIFY.

The provider sends one event at a time and the test waits until B's callers
have it before sending the next: B's streams are pushed while the run is
live, never read at the end, and nothing here waits on a clock.

Node B starts after the provider has published (B reads the roster from the
record at start) and before any run starts (each node's start settles the
runs it finds held; leases are another stage of issue #12).
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
import stores
import trio
from a2a.types import a2a_pb2 as pb
from push_support import push_receiver
from reliability_support import eventually
from support import http_client, raw_provider, running_server, user_input
from test_a2a_door import a2a_client
from test_streams_survive import chunks, finished, sse_items, started, text_start

from funduq_trio.server import ServerInfo

pytestmark = pytest.mark.parametrize("store", ["postgres"], indirect=True)

S = pb.TaskState


@contextlib.asynccontextmanager
async def two_nodes(
    tmp_path: Any,
    agents: tuple[str, ...] = ("echo",),
    *,
    url_b: str | None = None,
    **overrides: Any,
) -> AsyncIterator[tuple[ServerInfo, ServerInfo, Any]]:
    """Node A with a hand-played provider, then node B, on one database and
    one data directory (so one funduq identity). B may use its own URL."""
    async with running_server(tmp_path, **overrides) as a, raw_provider(a, agents) as provider:
        url = url_b or stores.database_url
        async with running_server(tmp_path, database_url=url, **overrides) as b:
            assert a.funduq.watchers is not None and b.funduq.watchers is not None
            yield a, b, provider


async def released(node: ServerInfo, thread_id: str) -> None:
    """Until the thread's lease is released (its lane ended at the pause): an
    answer arriving while another node still leads the thread is forwarded
    there (docs/cluster.md), and these tests mean B to take it."""

    async def free() -> bool:
        return await node.funduq.record.thread_leader(thread_id) is None

    await eventually(free, f"thread {thread_id} released")


async def collect(
    response_cm: Any, into: trio.MemorySendChannel[Any], *, raw: bool = False
) -> None:
    """Send each SSE event of a stream (as (id, data)) into a channel; close it at the end."""
    async with into, response_cm as response:
        assert response.status_code == 200
        async for item in sse_items(response):
            if "comment" not in item:
                await into.send((int(item["id"]), item["data"]))


async def subscribe(client: Any, task_id: str, into: trio.MemorySendChannel[Any]) -> None:
    async with into:
        async for update in client.subscribe(pb.SubscribeToTaskRequest(id=task_id)):
            await into.send(update)


async def test_a_caller_on_another_node_gets_every_event_pushed_in_seq_order(tmp_path) -> None:
    async with (
        two_nodes(tmp_path) as (a, b, provider),
        http_client(a) as http_a,
        http_client(b) as http_b,
        a2a_client(b, provider.fingerprint, "echo") as a2a_b,
        trio.open_nursery() as nursery,
    ):
        # The caller on A: the run's own POST stream (the same-node view).
        send_a, on_a = trio.open_memory_channel[Any](1000)
        post = http_a.stream("POST", f"/agui/{provider.fingerprint}/echo", json=user_input())
        nursery.start_soon(collect, post, send_a)
        run = await provider.next_offer()
        run_id = run["runId"]
        await provider.answer(run, "accepted")
        await provider.report(run_id, started(run))
        assert (await on_a.receive())[1]["type"] == "RUN_STARTED"  # recorded

        # The callers on B re-attach; B has no lane for the run.
        assert run_id not in b.funduq.lanes
        send_b, on_b = trio.open_memory_channel[Any](1000)
        nursery.start_soon(collect, http_b.stream("GET", f"/agui/runs/{run_id}/events"), send_b)
        assert await on_b.receive() == (1, started(run))
        send_sub, on_sub = trio.open_memory_channel[Any](1000)
        nursery.start_soon(subscribe, a2a_b, run_id, send_sub)
        opening = await on_sub.receive()
        assert opening.task.status.state == S.TASK_STATE_WORKING
        settled: list[dict[str, Any]] = []

        async def wait_on_b() -> None:
            settled.append(await b.funduq.wait_run(run_id))

        nursery.start_soon(wait_on_b)

        # One event at a time: B's callers have event k before k+1 exists.
        events = [text_start("m"), *chunks("m", *(f"c{k}" for k in range(30)))]
        for seq, event in enumerate(events, start=2):
            await provider.report(run_id, event)
            assert await on_b.receive() == (seq, event)
            update = await on_sub.receive()
            if event["type"] == "TEXT_MESSAGE_CONTENT":
                assert update.artifact_update.artifact.parts[0].text == event["delta"]
            else:
                assert update.status_update.status.state == S.TASK_STATE_WORKING
            assert not settled  # B's wait_run waits while the run is live elsewhere
        await provider.report(run_id, finished(run))
        await provider.finish(run_id)

        rest_b = [item async for item in on_b]  # B's stream ends as the run settles
        rest_sub = [update async for update in on_sub]
        seen_a = [item async for item in on_a]
        record = (await http_b.get(f"/runs/{run_id}")).json()
        assert b.funduq.watchers is not None and b.funduq.watchers.wakes >= len(events)
    last = len(events) + 2
    assert rest_b == [(last, finished(run))]
    assert [u.status_update.status.state for u in rest_sub] == [S.TASK_STATE_COMPLETED]
    assert settled[0]["status"] == "completed"
    assert [e["seq"] for e in record["events"]] == list(range(1, last + 1))
    on_b_all = [(1, started(run)), *enumerate(events, start=2), *rest_b]
    assert on_b_all == [(e["seq"], e["event"]) for e in record["events"]]
    assert seen_a[-1] == (last, finished(run))  # A's own caller: the same run, to its end


def url_as(url: str, role: str) -> str:
    """The tests' database URL, logging in as `role` (its password, if any, the URL's)."""
    parts = urlsplit(url)
    password = f":{parts.password}" if parts.password else ""
    host = parts.hostname or ""
    netloc = f"{role}{password}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


@contextlib.contextmanager
def own_role() -> Any:
    """A login role of the test's own (so the test can stop it logging in)
    and the test database's URL as it; dropped afterwards."""
    import psycopg

    role = "funduq_node_" + secrets.token_hex(4)
    password = urlsplit(stores.POSTGRES_URL).password
    with psycopg.connect(stores.POSTGRES_URL, autocommit=True) as conn:
        conn.execute(
            f"CREATE ROLE {role} LOGIN SUPERUSER"
            + (" PASSWORD " + _literal(password) if password else "")
        )
    try:
        assert stores.database_url is not None
        yield role, url_as(stores.database_url, role)
    finally:
        with psycopg.connect(stores.POSTGRES_URL, autocommit=True) as conn:
            conn.execute(f"ALTER ROLE {role} LOGIN")
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s",
                (role,),
            )
            conn.execute(f"DROP ROLE {role}")


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def admin(sql: str, *args: Any) -> Any:
    import psycopg

    with psycopg.connect(stores.POSTGRES_URL, autocommit=True) as conn:
        cursor = conn.execute(sql, args)
        return cursor.fetchone() if cursor.description else None


async def test_notifications_lost_while_the_listen_connection_is_down_are_read_from_the_log(
    tmp_path,
) -> None:
    """B's LISTEN connection is killed and cannot come back for a while
    (its role may not log in); events are recorded meanwhile, and nothing
    tells B. Once it listens again it wakes every follower, which reads the
    log from the seq it had: every event, in order, none twice."""
    with own_role() as (role, url_b):
        async with (
            two_nodes(tmp_path, url_b=url_b) as (a, b, provider),
            http_client(a) as http_a,
            http_client(b) as http_b,
            trio.open_nursery() as nursery,
        ):
            send_a, on_a = trio.open_memory_channel[Any](1000)
            post = http_a.stream("POST", f"/agui/{provider.fingerprint}/echo", json=user_input())
            nursery.start_soon(collect, post, send_a)
            run = await provider.next_offer()
            run_id = run["runId"]
            await provider.answer(run, "accepted")
            await provider.report(run_id, started(run))
            await on_a.receive()
            send_b, on_b = trio.open_memory_channel[Any](1000)
            nursery.start_soon(collect, http_b.stream("GET", f"/agui/runs/{run_id}/events"), send_b)
            assert await on_b.receive() == (1, started(run))
            await provider.report(run_id, text_start("m"))
            assert (await on_a.receive())[0] == 2
            assert await on_b.receive() == (2, text_start("m"))

            store_b = b.funduq.record
            listens = store_b.listens
            admin(f"ALTER ROLE {role} NOLOGIN")
            pid = store_b.listener_pid
            assert pid is not None
            # Terminated, and gone (waited for by the server, up to 10 s).
            assert admin("SELECT pg_terminate_backend(%s, 10000)", pid) == (True,)

            missed = chunks("m", "while", "nobody", "listened")
            for event in missed:
                await provider.report(run_id, event)
            for seq in (3, 4, 5):
                assert (await on_a.receive())[0] == seq  # recorded (A relays only then)
            with pytest.raises(trio.WouldBlock):
                on_b.receive_nowait()  # nothing told B: it has not read them
            assert store_b.listens == listens

            admin(f"ALTER ROLE {role} LOGIN")  # B's next attempt listens again
            assert [await on_b.receive() for _ in missed] == list(enumerate(missed, start=3))
            assert store_b.listens == listens + 1
            assert store_b.listener_pid not in (None, pid)

            # And it is pushed again as before.
            await provider.report(run_id, finished(run))
            await provider.finish(run_id)
            assert [item async for item in on_b] == [(6, finished(run))]
            nursery.cancel_scope.cancel()


def rpc(method: str, params: Any) -> dict[str, Any]:
    return {"jsonrpc": "2.0", "id": "r-1", "method": method, "params": params}


def message(text: str, **extra: Any) -> dict[str, Any]:
    return {
        "message": {
            "messageId": f"m-{text}",
            "role": "ROLE_USER",
            "parts": [{"text": text}],
            **extra,
        }
    }


INTERRUPT = {"type": "interrupt", "interrupts": [{"id": "ok?", "reason": "approval"}]}


async def test_a_subscription_on_another_node_stays_open_through_an_answer_given_elsewhere(
    tmp_path,
) -> None:
    """The task pauses; a caller on B subscribes to it; the answer is given
    on A (A's lane takes the next turn). B's subscription is woken by the
    record's news, follows the new turn and ends with the task."""
    async with (
        two_nodes(tmp_path, ("asker",)) as (a, b, provider),
        httpx.AsyncClient(timeout=30, headers={"A2A-Version": "1.0"}) as http,
        a2a_client(b, provider.fingerprint, "asker") as a2a_b,
        trio.open_nursery() as nursery,
    ):
        url_a = a.a2a_url(provider.fingerprint, "asker")

        turn = trio.Event()

        async def provider_turns() -> None:
            run = await provider.next_offer()
            await provider.answer(run, "accepted")
            await provider.play(run, [started(run), {**finished(run), "outcome": INTERRUPT}])
            run = await provider.next_offer()  # the answer's turn
            await provider.answer(run, "accepted")
            await provider.report(run["runId"], started(run))
            await turn.wait()
            await provider.play(run, [*chunks("r", "yes"), finished(run)])

        nursery.start_soon(provider_turns)
        sent = (await http.post(url_a, json=rpc("SendMessage", message("deploy")))).json()
        task = sent["result"]["task"]
        assert task["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"

        send_sub, on_sub = trio.open_memory_channel[Any](100)
        nursery.start_soon(subscribe, a2a_b, task["id"], send_sub)
        opening = await on_sub.receive()
        assert opening.task.status.state == S.TASK_STATE_INPUT_REQUIRED

        answer = message("yes", taskId=task["id"])
        again = (
            await http.post(
                url_a,
                json=rpc("SendMessage", {**answer, "configuration": {"returnImmediately": True}}),
            )
        ).json()
        assert again["result"]["task"]["id"] == task["id"]
        assert task["id"] in a.funduq.lanes and task["id"] not in b.funduq.lanes
        # The new turn's RUN_STARTED, pushed to B while A's lane holds the turn.
        started_again = await on_sub.receive()
        assert started_again.status_update.status.state == S.TASK_STATE_WORKING
        turn.set()
        rest = [u async for u in on_sub]
        nursery.cancel_scope.cancel()
    assert rest[0].artifact_update.artifact.parts[0].text == "yes"
    assert rest[-1].status_update.status.state == S.TASK_STATE_COMPLETED


async def test_a_run_paused_on_its_lanes_node_and_answered_on_another_is_followed_there(
    tmp_path,
) -> None:
    """The lane ends on A at the pause; the answer comes to B, whose lane takes
    the next turn (the provider is attached to both nodes). A subscriber at
    the pause on A -- where the run's lane used to be -- follows the new turn
    through the record's news, to the task's end."""
    async with (
        two_nodes(tmp_path, ("asker",)) as (a, b, provider),
        raw_provider(b, ["asker"], identity=provider.identity) as provider_b,
        httpx.AsyncClient(timeout=30, headers={"A2A-Version": "1.0"}) as http,
        a2a_client(a, provider.fingerprint, "asker") as a2a_a,
        trio.open_nursery() as nursery,
    ):
        turn = trio.Event()

        async def first_turn_on_a() -> None:
            run = await provider.next_offer()
            await provider.answer(run, "accepted")
            await provider.play(run, [started(run), {**finished(run), "outcome": INTERRUPT}])

        async def next_turn_on_b() -> None:
            run = await provider_b.next_offer()
            await provider_b.answer(run, "accepted")
            await provider_b.report(run["runId"], started(run))
            await turn.wait()
            await provider_b.play(run, [*chunks("r", "done"), finished(run)])

        nursery.start_soon(first_turn_on_a)
        nursery.start_soon(next_turn_on_b)
        url_a = a.a2a_url(provider.fingerprint, "asker")
        sent = (await http.post(url_a, json=rpc("SendMessage", message("deploy")))).json()
        task = sent["result"]["task"]
        assert task["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"
        assert task["id"] not in a.funduq.lanes  # the lane ended at the pause

        send_sub, on_sub = trio.open_memory_channel[Any](100)
        nursery.start_soon(subscribe, a2a_a, task["id"], send_sub)
        assert (await on_sub.receive()).task.status.state == S.TASK_STATE_INPUT_REQUIRED

        await released(b, task["contextId"])
        url_b = b.a2a_url(provider.fingerprint, "asker")
        answer = {**message("yes", taskId=task["id"]), "configuration": {"returnImmediately": True}}
        again = (await http.post(url_b, json=rpc("SendMessage", answer))).json()
        assert again["result"]["task"]["id"] == task["id"]
        assert task["id"] in b.funduq.lanes and task["id"] not in a.funduq.lanes
        started_again = await on_sub.receive()  # B's turn, pushed to A's subscriber
        assert started_again.status_update.status.state == S.TASK_STATE_WORKING
        turn.set()
        rest = [u async for u in on_sub]
        nursery.cancel_scope.cancel()
    assert rest[0].artifact_update.artifact.parts[0].text == "done"
    assert rest[-1].status_update.status.state == S.TASK_STATE_COMPLETED


async def test_a_push_deliverer_at_a_pause_wakes_when_another_node_takes_the_answer(
    tmp_path,
) -> None:
    """A's push deliverer has pushed the pause; the answer comes to B and B's
    lane runs the turn. A's deliverer is woken by the record's news and
    pushes the new turn and the task's end."""
    async with (
        push_receiver() as receiver,
        two_nodes(tmp_path, ("asker",), push_allow_private=True) as (a, b, provider),
        raw_provider(b, ["asker"], identity=provider.identity) as provider_b,
        httpx.AsyncClient(timeout=30, headers={"A2A-Version": "1.0"}) as http,
        trio.open_nursery() as nursery,
    ):

        async def first_turn_on_a() -> None:
            run = await provider.next_offer()
            await provider.answer(run, "accepted")
            await provider.play(run, [started(run), {**finished(run), "outcome": INTERRUPT}])

        async def next_turn_on_b() -> None:
            run = await provider_b.next_offer()
            await provider_b.answer(run, "accepted")
            await provider_b.play(run, [started(run), *chunks("r", "done"), finished(run)])

        nursery.start_soon(first_turn_on_a)
        nursery.start_soon(next_turn_on_b)
        push = {"taskPushNotificationConfig": {"url": receiver.url, "token": "t"}}
        url_a = a.a2a_url(provider.fingerprint, "asker")
        sent = await http.post(
            url_a, json=rpc("SendMessage", {**message("go"), "configuration": push})
        )
        task = sent.json()["result"]["task"]
        assert task["status"]["state"] == "TASK_STATE_INPUT_REQUIRED"
        await receiver.wait_for(2)  # RUN_STARTED's update, then the pause

        await released(b, task["contextId"])
        url_b = b.a2a_url(provider.fingerprint, "asker")
        again = await http.post(url_b, json=rpc("SendMessage", message("yes", taskId=task["id"])))
        assert again.json()["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
        pushes = a.funduq.pushes
        assert pushes is not None
        await pushes.wait_until(lambda: pushes.gauges()["funduq_push_delivering"][1] == 0)
        nursery.cancel_scope.cancel()
    bodies = receiver.bodies()
    states = [b["statusUpdate"]["status"]["state"] for b in bodies if "statusUpdate" in b]
    assert states == [
        "TASK_STATE_WORKING",
        "TASK_STATE_INPUT_REQUIRED",
        "TASK_STATE_WORKING",
        "TASK_STATE_COMPLETED",
    ]
    texts = [
        b["artifactUpdate"]["artifact"]["parts"][0]["text"] for b in bodies if "artifactUpdate" in b
    ]
    assert texts == ["done"]


async def test_one_notification_per_run_per_transaction_and_only_on_commit(tmp_path) -> None:
    """The store's side: a group commit that appends events to two runs and
    moves one tells each run once (its last seq; whether its status moved);
    a refused move tells nothing."""
    import psycopg

    from funduq_trio.broker.postgres import PostgresStore
    from funduq_trio.broker.store import run_store

    assert stores.database_url is not None
    store = PostgresStore(stores.database_url)
    async with run_store(store):
        for run_id in ("run_1", "run_2"):
            row = {
                "arrival": 1,
                "id": run_id,
                "thread_id": "thread_1",
                "provider_key": "k",
                "agent_name": "echo",
                "status": "running",
                "input": "{}",
                "caller_metadata": "{}",
                "metadata": {},
                "created_at": 0.0,
            }
            await store.insert_run(row, None, [])
        with psycopg.connect(stores.database_url, autocommit=True) as listener:
            listener.execute(f'LISTEN "{store.channel}"')
            commits = store.commits
            event = {"type": "TEXT_MESSAGE_CONTENT", "messageId": "m", "delta": "x"}
            async with trio.open_nursery() as nursery:  # queued in one round: one batch
                nursery.start_soon(store.append_events, "run_1", [(1, event), (2, event)])
                nursery.start_soon(store.append_events, "run_2", [(1, event)])
                nursery.start_soon(store.append_events, "run_1", [(3, event)])
                nursery.start_soon(
                    lambda: store.move("run_1", "completed", events=[(4, finished_event)])
                )
                nursery.start_soon(lambda: store.move("run_2", "queued"))  # refused
            assert store.commits == commits + 1
            # 'end' comes from another connection: a query run on the listener
            # itself would read (and, on psycopg 3.2.1, drop) notifications
            # already waiting on its socket; notifies() alone reads them all.
            with psycopg.connect(stores.database_url, autocommit=True) as other:
                other.execute("SELECT pg_notify(%s, 'end')", (store.channel,))
            payloads = []
            for notice in listener.notifies(timeout=30):  # a safety net, never reached
                if notice.payload == "end":
                    break
                payloads.append(notice.payload)
    assert sorted(payloads) == ["run_1 4 s", "run_2 1 -"]


finished_event = {"type": "RUN_FINISHED", "threadId": "thread_1", "runId": "run_1"}
