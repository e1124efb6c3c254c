"""Authority at the doors, end to end (docs/authority.md, DESIGN §5 "Identity
and authority"): a real server on a loopback port, the provider SDK on the
real link, callers over raw A2A JSON-RPC 1.0 (so refusals can be compared byte
for byte) and over AG-UI.

One agent, `worker`, steered by the caller's words: "end" finishes, "pause"
stops on a question (and says what it was told once answered), "hold" runs
until the test releases it or funduq asks it to stop -- and then stops only
when the test lets it, so `cancelling` can be watched. Nothing here waits on
the wall clock; the only clock read is `time.time()` to stamp proofs.

AG-UI has no cancel signal, so every cancel goes through A2A's `CancelTask`
(a run started over AG-UI is a task of the same agent's A2A endpoint).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import math
import time
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import httpx
import trio
from ag_ui.core import RunAgentInput
from support import (
    chain,
    http_client,
    operator_headers,
    read_proof,
    running_server,
    sse_events,
)

from funduq_trio.identity import (
    Identity,
    cancel_payload,
    resolve_payload,
    verify_chain_claims,
)
from funduq_trio.provider import Provider, RunContext, websocket_connector

AGENT = "worker"
V1 = {"A2A-Version": "1.0"}
CANCEL_REQUESTED = "funduq/cancelRequested"

# ------------------------------------------------------------------ the provider


class Worker:
    """The `worker` agent, and what its provider observed."""

    def __init__(self) -> None:
        #: every offer's input and offer metadata, per run id, in order
        self.inputs: dict[str, list[RunAgentInput]] = defaultdict(list)
        self.metadata: dict[str, list[Any]] = defaultdict(list)
        self._events: dict[tuple[str, str], trio.Event] = {}

    def event(self, what: str, run_id: str) -> trio.Event:
        """`held` (a "hold" run is waiting), `release` (the test lets it
        finish), `asked` (funduq asked it to stop), `stop` (the test lets it
        stop)."""
        return self._events.setdefault((what, run_id), trio.Event())

    def offers(self) -> int:
        return sum(len(v) for v in self.inputs.values())

    def unblock_all(self) -> None:
        for (what, _), event in self._events.items():
            if what in ("release", "stop"):
                event.set()

    async def agent(self, run_input: RunAgentInput, ctx: RunContext) -> AsyncIterator[dict]:
        run_id = run_input.run_id
        self.inputs[run_id].append(run_input)
        self.metadata[run_id].append(ctx.metadata)
        ids = {"threadId": run_input.thread_id, "runId": run_id}
        yield {"type": "RUN_STARTED", **ids}
        if run_input.resume:
            text = f"told {json.dumps(run_input.resume[0].payload)}"
            yield {"type": "TEXT_MESSAGE_START", "messageId": f"said-{run_id}", "role": "assistant"}
            yield {"type": "TEXT_MESSAGE_CONTENT", "messageId": f"said-{run_id}", "delta": text}
            yield {"type": "TEXT_MESSAGE_END", "messageId": f"said-{run_id}"}
        elif _last_text(run_input) == "pause":
            interrupt = {"id": f"ask-{run_id}", "reason": "approval", "message": "Go?"}
            yield {
                "type": "RUN_FINISHED",
                **ids,
                "outcome": {"type": "interrupt", "interrupts": [interrupt]},
            }
            return
        elif _last_text(run_input) == "hold":
            self.event("held", run_id).set()
            try:
                await self.event("release", run_id).wait()
            except trio.Cancelled:
                self.event("asked", run_id).set()
                with trio.CancelScope(shield=True):
                    await self.event("stop", run_id).wait()
                raise
        yield {"type": "RUN_FINISHED", **ids}


def _last_text(run_input: RunAgentInput) -> str:
    content = run_input.messages[-1].content
    if isinstance(content, str):
        return content
    return " ".join(getattr(p, "text", "") for p in content or [])


class HelloTap:
    """A connector that remembers the key funduq presents in its `hello`."""

    def __init__(self) -> None:
        self.funduq_key: str | None = None
        self._inner = websocket_connector()

    async def __call__(self, nursery: trio.Nursery, url: str) -> Any:
        tap, conn = self, await self._inner(nursery, url)

        class Tapped:
            async def send(self, text: str) -> None:
                await conn.send(text)

            async def receive(self) -> str | bytes:
                text = await conn.receive()
                frame = json.loads(text)
                if frame.get("kind") == "hello":
                    tap.funduq_key = frame["funduqKey"]
                return text

            async def aclose(self, reason: str = "") -> None:
                await conn.aclose(reason)

        return Tapped()


class Env:
    def __init__(
        self,
        info: Any,
        http: httpx.AsyncClient,
        provider: Provider,
        worker: Worker,
        hello: HelloTap,
        nursery: trio.Nursery,
    ) -> None:
        self.info, self.http, self.provider = info, http, provider
        self.worker, self.hello, self.nursery = worker, hello, nursery
        self.identity: Identity = provider.identity
        self.a2a = f"/a2a/{provider.identity.fingerprint}/{AGENT}"
        #: Reads of bound threads as the operator, who sees everything.
        self.operator = operator_headers(info)
        self.agui = f"/agui/{provider.identity.fingerprint}/{AGENT}"


@contextlib.asynccontextmanager
async def broker(tmp_path: Any) -> AsyncIterator[Env]:
    worker, hello = Worker(), HelloTap()
    async with running_server(tmp_path) as info:
        provider = Provider(Identity.generate(), info.provider_url, connector=hello)
        provider.add_agent(worker.agent, name=AGENT)
        async with (
            http_client(info) as http,
            trio.open_nursery() as nursery,
        ):
            await nursery.start(provider.run)
            try:
                yield Env(info, http, provider, worker, hello, nursery)
            finally:
                worker.unblock_all()  # no agent is left waiting on a test that ended
                nursery.cancel_scope.cancel()


# ------------------------------------------------------------------ proofs and chains


def proof(signer: Identity, payload_of: Any, run_id: str, timestamp: Any = None) -> dict:
    """`{publicKey, timestamp, signature}` by `signer` over `payload_of(run_id, ts)`."""
    ts = int(time.time()) if timestamp is None else timestamp
    return {
        "publicKey": signer.public_key_hex,
        "timestamp": ts,
        "signature": signer.sign(payload_of(run_id, ts)),
    }


def chain_of(*signers: Identity) -> list[str]:
    """A chain the test client presents (support.chain)."""
    return chain(*signers)


def flip_hex(signature: str) -> str:
    """The same signature with its first hex digit changed (still lowercase hex)."""
    return ("1" if signature[0] == "0" else "0") + signature[1:]


def forged_cancels(
    head: Identity, later_hop: Identity, run_id: str, other_run_id: str
) -> dict[str, Any]:
    """Every cancel proof that must be refused on `run_id`'s bound thread
    (`None`: no proof at all)."""
    stranger = Identity.generate()
    now = time.time()
    tampered = proof(head, cancel_payload, run_id)
    tampered["signature"] = flip_hex(tampered["signature"])
    return {
        "no proof": None,
        "a third key": proof(stranger, cancel_payload, run_id),
        "a later hop of the chain, not its head": proof(later_hop, cancel_payload, run_id),
        "61 s old": proof(head, cancel_payload, run_id, math.floor(now) - 61),
        "61 s in the future": proof(head, cancel_payload, run_id, math.ceil(now) + 61),
        "another run id": proof(head, cancel_payload, other_run_id),
        "another act (a resolution)": proof(head, resolve_payload, run_id),
        "a tampered signature": tampered,
        "the head's key, another's signature": {
            **proof(stranger, cancel_payload, run_id),
            "publicKey": head.public_key_hex,
        },
        "not an object": "let me in",
    }


# ------------------------------------------------------------------ A2A, raw JSON-RPC 1.0


_ids = iter(range(1, 100_000))


def rpc(method: str, params: dict[str, Any], id: Any = None) -> dict[str, Any]:
    return {
        "jsonrpc": "2.0",
        "id": f"r-{next(_ids)}" if id is None else id,
        "method": method,
        "params": params,
    }


def message(text: str, **fields: Any) -> dict[str, Any]:
    return {
        "messageId": f"m-{next(_ids)}",
        "role": "ROLE_USER",
        "parts": [{"text": text}],
        **fields,
    }


def send_params(text: str, metadata: dict | None = None, **fields: Any) -> dict[str, Any]:
    params: dict[str, Any] = {"message": message(text, **fields)}
    if metadata is not None:
        params["metadata"] = metadata
    return params


async def call(
    env: Env, method: str, params: dict[str, Any], id: Any = None, headers: dict | None = None
) -> httpx.Response:
    response = await env.http.post(
        env.a2a, json=rpc(method, params, id), headers={**V1, **(headers or {})}
    )
    assert response.status_code == 200, response.text
    return response


async def send(env: Env, text: str, metadata: dict | None = None, **fields: Any) -> dict[str, Any]:
    """A blocking SendMessage; the JSON-RPC answer (result or error)."""
    return (await call(env, "SendMessage", send_params(text, metadata, **fields))).json()


async def send_task(
    env: Env, text: str, metadata: dict | None = None, **fields: Any
) -> dict[str, Any]:
    answer = await send(env, text, metadata, **fields)
    assert "result" in answer, answer
    return answer["result"]["task"]


async def cancel(
    env: Env, run_id: str, cancel_proof: Any = None, *, id: Any = None
) -> httpx.Response:
    params: dict[str, Any] = {"id": run_id}
    if cancel_proof is not None:
        params["metadata"] = {"cancel": cancel_proof}
    return await call(env, "CancelTask", params, id)


async def task_count(env: Env) -> int:
    """How many tasks (runs) the agent's endpoint knows of."""
    answer = await call(env, "ListTasks", {}, headers=env.operator)
    return answer.json()["result"]["totalSize"]


class Stream:
    """A caller's stream running in the background (A2A SendStreamingMessage or
    an AG-UI POST): `running` is set once the run is seen working, with its ids."""

    def __init__(self) -> None:
        self.run_id = self.thread_id = ""
        self.running = trio.Event()
        self.done = trio.Event()
        self.frames: list[dict[str, Any]] = []

    async def a2a(self, env: Env, params: dict[str, Any]) -> None:
        async with env.http.stream(
            "POST", env.a2a, json=rpc("SendStreamingMessage", params), headers=V1
        ) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            async for frame in sse_events(response):
                self.frames.append(frame)
                result = frame["result"]
                item = result.get("task") or result.get("statusUpdate") or {}
                if "task" in result:
                    self.run_id, self.thread_id = item["id"], item["contextId"]
                if item.get("status", {}).get("state") == "TASK_STATE_WORKING":
                    self.running.set()
        self.done.set()

    async def agui(self, env: Env, body: dict[str, Any]) -> None:
        async with env.http.stream("POST", env.agui, json=body) as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            async for event in sse_events(response):
                self.frames.append(event)
                if event["type"] == "RUN_STARTED":
                    self.run_id, self.thread_id = event["runId"], event["threadId"]
                    self.running.set()
        self.done.set()


async def held_over_a2a(env: Env, metadata: dict | None = None, **fields: Any) -> Stream:
    """A "hold" run started over A2A, seen running (its RUN_STARTED recorded)."""
    stream = Stream()
    env.nursery.start_soon(stream.a2a, env, send_params("hold", metadata, **fields))
    await stream.running.wait()
    await env.worker.event("held", stream.run_id).wait()
    return stream


async def held_over_agui(env: Env, forwarded_props: dict | None = None, **fields: Any) -> Stream:
    stream = Stream()
    env.nursery.start_soon(stream.agui, env, agui_input("hold", forwarded_props, **fields))
    await stream.running.wait()
    await env.worker.event("held", stream.run_id).wait()
    return stream


# ------------------------------------------------------------------ AG-UI and the record


def agui_input(
    text: str,
    forwarded_props: dict | None = None,
    *,
    thread_id: str = "callers-own-thread",
    **extra: Any,
) -> dict[str, Any]:
    body = {
        "threadId": thread_id,
        "runId": "callers-own-run",
        "messages": [{"id": f"u-{next(_ids)}", "role": "user", "content": text}],
        **extra,
    }
    if forwarded_props is not None:
        body["forwardedProps"] = forwarded_props
    return body


async def run_record(env: Env, run_id: str) -> dict[str, Any]:
    response = await env.http.get(f"/runs/{run_id}", headers=env.operator)
    assert response.status_code == 200, response.text
    return response.json()


async def thread_record(env: Env, thread_id: str) -> dict[str, Any]:
    response = await env.http.get(f"/threads/{thread_id}", headers=env.operator)
    assert response.status_code == 200, response.text
    return response.json()


def marks(record: dict[str, Any]) -> dict[str, Any]:
    """`metadata.funduq` of a run record."""
    return record["metadata"].get("funduq") or {}


def reason_of(answer: dict[str, Any]) -> tuple[int | None, str | None]:
    """(JSON-RPC error code, funduq's reason) of an A2A 1.0 error answer; the
    reason rides `error.data` as a google.rpc.ErrorInfo's metadata."""
    error = answer.get("error") or {}
    reasons = [
        d.get("metadata", {}).get("reason") for d in error.get("data") or [] if isinstance(d, dict)
    ]
    return error.get("code"), (reasons[0] if len(reasons) == 1 else None)


def not_authorized(answer: dict[str, Any]) -> bool:
    return reason_of(answer) == (-32602, "not_authorized")


# ================================================================== cancel


async def test_an_unbound_run_is_anyones_to_stop_and_no_signer_is_recorded(tmp_path) -> None:
    stranger = Identity.generate()
    async with broker(tmp_path) as env:
        over_a2a = await held_over_a2a(env)
        over_agui = await held_over_agui(env)

        # No proof at all, and a stranger's proof (on an unbound thread it is
        # not checked, so it is not recorded either).
        for stream, cancel_proof in (
            (over_a2a, None),
            (over_agui, proof(stranger, cancel_payload, over_agui.run_id)),
        ):
            answer = (await cancel(env, stream.run_id, cancel_proof)).json()
            assert "result" in answer, answer
            assert answer["result"]["status"]["state"] == "TASK_STATE_WORKING"
            assert answer["result"]["metadata"][CANCEL_REQUESTED] is True
            record = await run_record(env, stream.run_id)
            assert record["status"] == "cancelling"
            assert "cancelRequestedBy" in marks(record)
            assert marks(record)["cancelRequestedBy"] is None

            await env.worker.event("asked", stream.run_id).wait()  # the provider was asked
            env.worker.event("stop", stream.run_id).set()
            await stream.done.wait()
            record = await run_record(env, stream.run_id)
            assert record["status"] == "cancelled"
            assert marks(record)["cancelRequestedBy"] is None

        assert over_a2a.frames[-1]["result"]["statusUpdate"]["status"]["state"] == (
            "TASK_STATE_CANCELED"
        )
        # AG-UI has no cancelled event: the stream just ends.
        assert [e["type"] for e in over_agui.frames] == ["RUN_STARTED"]


async def test_bound_cancel_refusals_are_one_answer_whatever_the_run_and_touch_nothing(
    tmp_path,
) -> None:
    alice, bob = Identity.generate(), Identity.generate()
    bound = {"actorChain": chain_of(alice, bob)}
    async with broker(tmp_path) as env:
        held = await held_over_a2a(env, bound)
        running = held.run_id
        paused = (await send_task(env, "pause", bound))["id"]
        ended = (await send_task(env, "end", bound))["id"]
        assert (await run_record(env, paused))["status"] == "input-required"
        assert (await run_record(env, ended))["status"] == "completed"
        before = {r: await run_record(env, r) for r in (running, paused, ended)}
        assert before[running]["status"] == "running"

        bodies: dict[tuple[str, str], bytes] = {}
        for state, run_id in (("running", running), ("paused", paused), ("ended", ended)):
            other = ended if run_id != ended else running
            for what, forged in forged_cancels(alice, bob, run_id, other).items():
                response = await cancel(env, run_id, forged, id="same-id")
                assert not_authorized(response.json()), (state, what, response.text)
                bodies[state, what] = response.content
        # One answer, byte for byte, for every state and every way of failing.
        assert len(set(bodies.values())) == 1, bodies
        # ... and apart from the JSON-RPC id, the same again under another id.
        again = (await cancel(env, running, None, id=7)).json()
        refused = json.loads(next(iter(bodies.values())))
        assert again["id"] == 7 and {**again, "id": "same-id"} == refused
        assert running not in json.dumps(refused) and paused not in json.dumps(refused)

        # The same holds for an 0.3 client's tasks/cancel, and for a message
        # naming the task with no authority (an answer to a paused task, a new
        # utterance on the others' threads): one answer for all three.
        legacy, named = set(), set()
        for run_id in (running, paused, ended):
            response = await env.http.post(
                env.a2a, json=rpc("tasks/cancel", {"id": run_id}, id="same-id")
            )
            assert response.json()["error"]["data"] == {"reason": "not_authorized"}
            legacy.add(response.content)
            response = await call(
                env, "SendMessage", send_params("yes", taskId=run_id), id="same-id"
            )
            assert not_authorized(response.json()), response.text
            named.add(response.content)
        assert len(legacy) == 1 and len(named) == 1, (legacy, named)

        # Nothing moved: the records are as they were and the provider was
        # never asked to stop.
        for run_id, record in before.items():
            assert await run_record(env, run_id) == record
            assert not env.worker.event("asked", run_id).is_set()
        got = await call(env, "GetTask", {"id": running}, headers=env.operator)
        got = got.json()["result"]
        assert got["status"]["state"] == "TASK_STATE_WORKING"
        assert CANCEL_REQUESTED not in got.get("metadata", {})

        # The held run was never touched: released, it finishes on its own.
        env.worker.event("release", running).set()
        await held.done.wait()
        assert held.frames[-1]["result"]["statusUpdate"]["status"]["state"] == (
            "TASK_STATE_COMPLETED"
        )
        record = await run_record(env, running)
        assert record["status"] == "completed"
        assert "cancelRequestedBy" not in marks(record)
        # The paused run is still answerable by its head.
        answered = await send_task(
            env, "yes", {"resolution": proof(alice, resolve_payload, paused)}, taskId=paused
        )
        assert (answered["id"], answered["status"]["state"]) == (paused, "TASK_STATE_COMPLETED")


async def test_the_heads_and_the_providers_proofs_stop_a_bound_run(tmp_path) -> None:
    alice = Identity.generate()
    async with broker(tmp_path) as env:
        provider = env.identity
        # Bound over A2A, stopped by its head.
        by_head = await held_over_a2a(env, {"actorChain": chain_of(alice)})
        # Bound over AG-UI, stopped over A2A by the agent's provider; its
        # timestamp arrives as an integral float (as protobuf Struct numbers do).
        by_provider = await held_over_agui(env, {"actorChain": chain_of(alice)})
        provider_proof = proof(provider, cancel_payload, by_provider.run_id)
        provider_proof["timestamp"] = float(provider_proof["timestamp"])

        for stream, signer, cancel_proof in (
            (by_head, alice, proof(alice, cancel_payload, by_head.run_id)),
            (by_provider, provider, provider_proof),
        ):
            run_id = stream.run_id
            answer = (await cancel(env, run_id, cancel_proof)).json()
            assert "result" in answer, answer
            assert answer["result"]["id"] == run_id
            assert answer["result"]["status"]["state"] == "TASK_STATE_WORKING"
            assert answer["result"]["metadata"][CANCEL_REQUESTED] is True

            record = await run_record(env, run_id)
            assert record["status"] == "cancelling"
            assert marks(record)["cancelRequestedBy"] == signer.public_key_hex

            await env.worker.event("asked", run_id).wait()
            env.worker.event("stop", run_id).set()
            await stream.done.wait()
            record = await run_record(env, run_id)
            assert record["status"] == "cancelled"
            assert marks(record)["cancelRequestedBy"] == signer.public_key_hex

            # With authority shown, the state may be told: an ended task will
            # not be cancelled, and the record keeps the first signer. (A new
            # proof: the first was spent; another timestamp signs anew.)
            fresh = proof(signer, cancel_payload, run_id, math.floor(time.time()) - 30)
            again = (await cancel(env, run_id, fresh)).json()
            assert again["error"]["code"] == -32002, again  # TaskNotCancelableError
            assert marks(await run_record(env, run_id))["cancelRequestedBy"] == (
                signer.public_key_hex
            )


# ================================================================== answering a pause


async def test_a_bound_pause_is_answered_only_with_a_resolution(tmp_path) -> None:
    alice, mallory = Identity.generate(), Identity.generate()
    async with broker(tmp_path) as env:
        # -- over A2A: a message naming the paused task, resolution in params.metadata
        paused = await send_task(env, "pause", {"actorChain": chain_of(alice)})
        run_id = paused["id"]
        before = await run_record(env, run_id)
        assert before["status"] == "input-required"
        tampered = proof(alice, resolve_payload, run_id)
        tampered["signature"] = flip_hex(tampered["signature"])
        for what, metadata in {
            "no resolution": None,
            "a third key": {"resolution": proof(mallory, resolve_payload, run_id)},
            "61 s old": {
                "resolution": proof(alice, resolve_payload, run_id, math.floor(time.time()) - 61)
            },
            "another act (a cancel)": {"resolution": proof(alice, cancel_payload, run_id)},
            "a tampered signature": {"resolution": tampered},
            "a cancel proof instead": {"cancel": proof(alice, cancel_payload, run_id)},
        }.items():
            answer = await send(env, "yes", metadata, taskId=run_id)
            assert not_authorized(answer), (what, answer)
            assert await run_record(env, run_id) == before, what  # still paused, as it was
        assert len(env.worker.inputs[run_id]) == 1  # never offered again

        answered = await send_task(
            env, "yes", {"resolution": proof(alice, resolve_payload, run_id)}, taskId=run_id
        )
        assert (answered["id"], answered["status"]["state"]) == (run_id, "TASK_STATE_COMPLETED")
        resumed = env.worker.inputs[run_id][-1]
        assert [(r.interrupt_id, r.payload) for r in resumed.resume] == [(f"ask-{run_id}", "yes")]
        record = await run_record(env, run_id)
        assert record["status"] == "completed"
        assert marks(record)["answeredBy"] == alice.public_key_hex
        # The proof was for funduq: the provider's offer does not carry it.
        assert "resolution" not in (env.worker.metadata[run_id][-1] or {})
        assert "resolution" not in (resumed.forwarded_props or {})

        # -- over AG-UI: a `resume` body, resolution in forwardedProps
        first = Stream()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                first.agui, env, agui_input("pause", {"actorChain": chain_of(alice)})
            )
        run_id, thread_id = first.run_id, first.thread_id
        before = await run_record(env, run_id)
        assert before["status"] == "input-required"
        resume = [{"interruptId": f"ask-{run_id}", "status": "resolved", "payload": "go"}]
        # Refuse first, say nothing (DESIGN §8): without authority the answer
        # is the unknown thread's, paused or not; a reader may learn why.
        for props in (None, {}, {"resolution": proof(alice, resolve_payload, "run_elsewhere")}):
            response = await env.http.post(
                env.agui, json=agui_input("go", props, thread_id=thread_id, resume=resume)
            )
            assert response.status_code == 404, response.text
            assert response.json()["error"]["code"] == "thread_not_found"
            assert await run_record(env, run_id) == before
        response = await env.http.post(
            env.agui,
            json=agui_input("go", None, thread_id=thread_id, resume=resume),
            headers={"Funduq-Proof": read_proof(alice, thread_id)},
        )
        assert response.status_code == 403, response.text
        assert response.json()["error"]["code"] == "not_authorized"
        assert await run_record(env, run_id) == before
        assert len(env.worker.inputs[run_id]) == 1

        # Still answerable; this time by the agent's own provider.
        second = Stream()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                second.agui,
                env,
                agui_input(
                    "go",
                    {"resolution": proof(env.identity, resolve_payload, run_id)},
                    thread_id=thread_id,
                    resume=resume,
                ),
            )
        assert [e["type"] for e in second.frames][-1] == "RUN_FINISHED"
        assert {e.get("runId", run_id) for e in second.frames} == {run_id}
        record = await run_record(env, run_id)
        assert record["status"] == "completed"
        assert marks(record)["answeredBy"] == env.identity.public_key_hex
        resumed = env.worker.inputs[run_id][-1]
        assert [(r.interrupt_id, r.payload) for r in resumed.resume] == [(f"ask-{run_id}", "go")]
        assert "resolution" not in resumed.forwarded_props  # it rode forwardedProps to funduq only
        assert "resolution" not in (env.worker.metadata[run_id][-1] or {})


# ================================================================== actor chains


def forged_chains() -> dict[str, Any]:
    alice, bob, carol = Identity.generate(), Identity.generate(), Identity.generate()
    good = chain_of(alice, bob)
    other = chain_of(carol, bob)
    header, claims, signature = good[1].split(".")
    signed_claims = json.loads(_b64decode(claims))
    signed_claims["actorPublicKey"] = carol.public_key_hex  # claims edited after signing
    return {
        "a tampered signature": [good[0], f"{header}.{claims}.{_flip_b64(signature)}"],
        "tampered claims": [good[0], f"{header}.{_b64encode(signed_claims)}.{signature}"],
        "reordered": [good[1], good[0]],
        "spliced from another chain": [good[0], other[1]],
        "its head dropped": [good[1]],
        "empty": [],
        "not a list": good[0],
        "not JWTs": ["x.y.z"],
    }


def _b64decode(segment: str) -> bytes:
    return base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4))


def _b64encode(value: Any) -> str:
    raw = json.dumps(value, separators=(",", ":")).encode()
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _flip_b64(segment: str) -> str:
    return ("B" if segment[0] == "A" else "A") + segment[1:]


async def test_a_forged_chain_is_refused_at_either_door_and_records_nothing(tmp_path) -> None:
    alice = Identity.generate()
    async with broker(tmp_path) as env:
        bound = await send_task(env, "end", {"actorChain": chain_of(alice)})
        unbound = await send_task(env, "end")
        threads = {
            t["contextId"]: await thread_record(env, t["contextId"]) for t in (bound, unbound)
        }
        tasks, offers = await task_count(env), env.worker.offers()
        assert tasks == 2

        for what, chain in forged_chains().items():
            # A2A: on a new thread, on the bound one and on the unbound one --
            # one answer, so it says nothing about the thread.
            # A streaming call is refused the same way, as plain JSON before
            # any stream opens.
            answers = set()
            for method, context in (
                ("SendMessage", {}),
                ("SendMessage", {"contextId": bound["contextId"]}),
                ("SendMessage", {"contextId": unbound["contextId"]}),
                ("SendStreamingMessage", {"contextId": bound["contextId"]}),
            ):
                response = await call(
                    env, method, send_params("end", {"actorChain": chain}, **context), id="same-id"
                )
                assert response.headers["content-type"].startswith("application/json")
                assert reason_of(response.json()) == (-32602, "invalid_actor_chain"), (
                    what,
                    method,
                    response.text,
                )
                answers.add(response.content)
            assert len(answers) == 1, (what, answers)

            # AG-UI: a new thread, and the bound one; again one answer.
            answers = set()
            for thread_id in ("never-seen", bound["contextId"]):
                response = await env.http.post(
                    env.agui, json=agui_input("end", {"actorChain": chain}, thread_id=thread_id)
                )
                assert response.status_code == 403, (what, response.text)
                assert response.json()["error"]["code"] == "invalid_actor_chain", what
                answers.add(response.content)
            assert len(answers) == 1, (what, answers)

        # Nothing was recorded and nothing reached the provider.
        assert await task_count(env) == tasks
        assert env.worker.offers() == offers
        for thread_id, snapshot in threads.items():
            assert await thread_record(env, thread_id) == snapshot
        roster = (await env.http.get("/agents")).json()["agents"]
        assert [(a["name"], a["online"]) for a in roster] == [(AGENT, True)]


async def test_a_bound_thread_takes_utterances_only_under_its_heads_or_providers_chain(
    tmp_path,
) -> None:
    alice, mallory = Identity.generate(), Identity.generate()
    async with broker(tmp_path) as env:
        first = await send_task(env, "end", {"actorChain": chain_of(alice)})
        thread_id = first["contextId"]
        snapshot = await thread_record(env, thread_id)
        assert snapshot["segmentHead"] == alice.public_key_hex
        offers = env.worker.offers()

        # Refused: no chain, a third key's chain, a third key heading a chain
        # the head signs later on.
        for metadata in (
            None,
            {},
            {"actorChain": chain_of(mallory)},
            {"actorChain": chain_of(mallory, alice)},
        ):
            answer = await send(env, "end", metadata, contextId=thread_id)
            assert not_authorized(answer), (metadata, answer)
        for props in (None, {"actorChain": chain_of(mallory)}):  # the same over AG-UI
            response = await env.http.post(
                env.agui, json=agui_input("end", props, thread_id=thread_id)
            )
            assert response.status_code == 403, response.text
            assert response.json()["error"]["code"] == "not_authorized"
        assert await thread_record(env, thread_id) == snapshot
        assert env.worker.offers() == offers

        # Accepted: the head's chain (extended by others), and the provider's.
        by_head = await send_task(
            env, "end", {"actorChain": chain_of(alice, mallory)}, contextId=thread_id
        )
        provider_chain = chain_of(env.identity)
        by_provider = await send_task(
            env, "end", {"actorChain": provider_chain}, contextId=thread_id
        )
        for task in (by_head, by_provider):
            assert task["contextId"] == thread_id
            assert task["status"]["state"] == "TASK_STATE_COMPLETED"
        after = await thread_record(env, thread_id)
        assert after["segmentHead"] == alice.public_key_hex  # never rebound
        assert [r["runId"] for r in after["runs"]] == [
            first["id"],
            by_head["id"],
            by_provider["id"],
        ]
        dispatched = env.worker.inputs[by_provider["id"]][0].forwarded_props["actorChain"]
        assert dispatched[:-1] == provider_chain

        # An unbound thread cannot be bound later: a chain is welcome, binds
        # nothing, and a chainless utterance is still anyone's to add.
        unbound = await send_task(env, "end")
        late = await send_task(
            env, "end", {"actorChain": chain_of(alice)}, contextId=unbound["contextId"]
        )
        assert late["status"]["state"] == "TASK_STATE_COMPLETED"
        assert (await thread_record(env, unbound["contextId"]))["segmentHead"] is None
        anyone = await send_task(env, "end", contextId=unbound["contextId"])
        assert anyone["status"]["state"] == "TASK_STATE_COMPLETED"


async def test_the_provider_receives_the_callers_chain_plus_funduqs_dispatch_hop(
    tmp_path,
) -> None:
    alice, bob = Identity.generate(), Identity.generate()
    async with broker(tmp_path) as env:
        funduq_key = env.hello.funduq_key
        assert funduq_key is not None and funduq_key != env.identity.public_key_hex
        dispatched_to = {"providerKey": env.identity.public_key_hex, "name": AGENT}

        over_a2a = chain_of(alice, bob)
        task = await send_task(env, "end", {"actorChain": over_a2a})
        over_agui = chain_of(bob, alice)
        stream = Stream()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                stream.agui,
                env,
                agui_input("end", {"actorChain": over_agui, "app": {"theme": "dark"}}),
            )

        for run_id, sent in ((task["id"], over_a2a), (stream.run_id, over_agui)):
            (run_input,) = env.worker.inputs[run_id]
            received = run_input.forwarded_props["actorChain"]
            assert received[:-1] == sent  # the caller's hops, verbatim
            claims = verify_chain_claims(received)
            assert [c["actorPublicKey"] for c in claims[:-1]] == [
                c["actorPublicKey"] for c in verify_chain_claims(sent)
            ]
            assert claims[-1] == {
                "actorPublicKey": funduq_key,
                "prevHash": hashlib.sha256(sent[-1].encode("ascii")).hexdigest(),
                "dispatchedTo": dispatched_to,
            }
        # The caller's own props ride along untouched.
        assert env.worker.inputs[stream.run_id][0].forwarded_props["app"] == {"theme": "dark"}

        # A run that came without a chain is dispatched without one.
        plain = await send_task(env, "end")
        props = env.worker.inputs[plain["id"]][0].forwarded_props or {}
        assert "actorChain" not in props
        stream = Stream()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(stream.agui, env, agui_input("end", {"app": 1}))
        assert env.worker.inputs[stream.run_id][0].forwarded_props == {"app": 1}
