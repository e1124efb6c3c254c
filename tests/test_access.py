"""Who may see and touch what (DESIGN §8, issue #10 items 2-5, 6/9's
authority parts), end to end: a real server on a loopback port, SDK
providers on the real link, callers over raw A2A JSON-RPC 1.0 (so answers
can be compared byte for byte) and AG-UI.

- listings are scoped (a named thread, the threads bound to a listing
  proof's key, the operator's everything; an anonymous bare listing is
  empty) and paged in SQL;
- a bound thread is read only with a `Funduq-Proof`, and without one every
  read answers exactly as an unknown id (AG-UI `resume` included);
- a chain is presented by its last hop, so a provider cannot replay a chain
  it was handed;
- every proof works once;
- hostile chains and timestamps are 4xx refusals, not 500s.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from ag_ui.core import RunAgentInput
from support import (
    UNPRESENTED,
    chain,
    http_client,
    operator_headers,
    post_sse,
    presenter,
    read_proof,
    running_server,
    sdk_provider,
)

from funduq_trio.identity import (
    Identity,
    _b64url,
    cancel_payload,
    make_hop,
    resolve_payload,
)
from funduq_trio.provider import echo

V1 = {"A2A-Version": "1.0"}
PROOF = "Funduq-Proof"


async def asker(run_input: RunAgentInput, ctx: Any) -> AsyncIterator[dict]:
    """Pauses on a question each turn until told "stop" (or asked to "end")."""
    ids = {"threadId": run_input.thread_id, "runId": run_input.run_id}
    yield {"type": "RUN_STARTED", **ids}
    answers = [r.payload for r in run_input.resume or []]
    text = run_input.messages[-1].content if run_input.messages else ""
    if text == "end" or (answers and answers[-1] == "stop"):
        yield {"type": "RUN_FINISHED", **ids}
        return
    interrupt = {"id": f"ask-{len(run_input.messages)}", "reason": "approval"}
    yield {
        "type": "RUN_FINISHED",
        **ids,
        "outcome": {"type": "interrupt", "interrupts": [interrupt]},
    }


class Spy:
    """A provider's agent that keeps every input it is handed."""

    def __init__(self) -> None:
        self.inputs: list[RunAgentInput] = []

    async def agent(self, run_input: RunAgentInput, ctx: Any) -> AsyncIterator[dict]:
        self.inputs.append(run_input)
        ids = {"threadId": run_input.thread_id, "runId": run_input.run_id}
        yield {"type": "RUN_STARTED", **ids}
        yield {"type": "RUN_FINISHED", **ids}


class Env:
    def __init__(
        self, info: Any, http: httpx.AsyncClient, provider: Any, spy_provider: Any, spy: Spy
    ) -> None:
        self.info, self.http = info, http
        self.provider, self.identity = provider, provider.identity
        self.spy_provider, self.spy = spy_provider, spy
        self.operator = operator_headers(info)
        self._ids = 0

    def url(self, door: str, agent: str, provider: Any = None) -> str:
        return f"/{door}/{(provider or self.provider).identity.fingerprint}/{agent}"

    def next_id(self, prefix: str) -> str:
        self._ids += 1
        return f"{prefix}-{self._ids}"

    async def rpc(
        self,
        method: str,
        params: dict[str, Any],
        *,
        agent: str = "echo",
        provider: Any = None,
        headers: dict | None = None,
        id: str = "same-id",
    ) -> httpx.Response:
        body = {"jsonrpc": "2.0", "id": id, "method": method, "params": params}
        response = await self.http.post(
            self.url("a2a", agent, provider), json=body, headers={**V1, **(headers or {})}
        )
        assert response.status_code == 200, response.text
        return response

    def message(self, text: str, **fields: Any) -> dict[str, Any]:
        return {
            "messageId": self.next_id("m"),
            "role": "ROLE_USER",
            "parts": [{"text": text}],
            **fields,
        }

    async def send(
        self,
        text: str,
        metadata: dict | None = None,
        *,
        agent: str = "echo",
        provider: Any = None,
        headers: dict | None = None,
        **fields: Any,
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"message": self.message(text, **fields)}
        if metadata is not None:
            params["metadata"] = metadata
        return (
            await self.rpc("SendMessage", params, agent=agent, provider=provider, headers=headers)
        ).json()

    async def task(self, text: str, metadata: dict | None = None, **kw: Any) -> dict[str, Any]:
        answer = await self.send(text, metadata, **kw)
        assert "result" in answer, answer
        return answer["result"]["task"]

    async def list_tasks(
        self, params: dict[str, Any], headers: dict | None = None, agent: str = "echo"
    ) -> dict[str, Any]:
        answer = (await self.rpc("ListTasks", params, headers=headers, agent=agent)).json()
        assert "result" in answer, answer
        return answer["result"]

    async def runs(self, query: str = "", headers: dict | None = None) -> dict[str, Any]:
        response = await self.http.get(f"/runs{query}", headers=headers)
        assert response.status_code == 200, response.text
        return response.json()

    async def record(self, run_id: str) -> dict[str, Any]:
        response = await self.http.get(f"/runs/{run_id}", headers=self.operator)
        assert response.status_code == 200, response.text
        return response.json()


@contextlib.asynccontextmanager
async def serving(tmp_path: Any, **settings: Any) -> AsyncIterator[Env]:
    spy = Spy()
    async with (
        running_server(tmp_path, **settings) as info,
        http_client(info) as http,
        sdk_provider(info, {"echo": echo, "asker": asker}) as provider,
        sdk_provider(info, {"spy": spy.agent}) as spy_provider,
    ):
        yield Env(info, http, provider, spy_provider, spy)


def proof(signer: Identity, payload_of: Any, run_id: str, ts: int | None = None) -> dict:
    ts = int(time.time()) if ts is None else ts
    return {
        "publicKey": signer.public_key_hex,
        "timestamp": ts,
        "signature": signer.sign(payload_of(run_id, ts)),
    }


def error_of(answer: dict[str, Any]) -> tuple[int | None, str | None]:
    """(JSON-RPC code, funduq's reason) of an A2A 1.0 error answer."""
    error = answer.get("error") or {}
    found = [
        d.get("metadata", {}).get("reason") for d in error.get("data") or [] if isinstance(d, dict)
    ]
    return error.get("code"), (found[0] if found else None)


# The push-config acts on a task (each beside "taskId"); the URL is one the
# broker refuses, so an act that skipped the authority check would say so.
PUSH_ACTS: dict[str, dict[str, Any]] = {
    "CreateTaskPushNotificationConfig": {"id": "p1", "url": "https://192.0.2.1/hook"},
    "GetTaskPushNotificationConfig": {"id": "p1"},
    "ListTaskPushNotificationConfigs": {},
    "DeleteTaskPushNotificationConfig": {"id": "p1"},
}


def same_as(
    response: httpx.Response, unknown: httpx.Response, known_id: str, unknown_id: str
) -> bool:
    """Does `response` say exactly what the answer to an unknown id says?"""
    return (response.status_code, response.text.replace(known_id, "ID")) == (
        unknown.status_code,
        unknown.text.replace(unknown_id, "ID"),
    )


_signed = itertools.count(1)


def fresh() -> int:
    """A timestamp for a proof signed anew (well inside the window): each
    proof is spent once, and one key's proofs for the same thing within one
    second would otherwise be the same bytes."""
    return math.floor(time.time()) - 50 + next(_signed) % 50


# ================================================================== item 2: scoped listings


async def test_listings_show_only_what_the_caller_may_read_and_page_in_sql(tmp_path) -> None:
    alice, bob = Identity.generate(), Identity.generate()
    async with serving(tmp_path) as env:
        a1 = await env.task("one", {"actorChain": chain(alice)})
        thread_a = a1["contextId"]
        a2 = await env.task("two", {"actorChain": chain(alice)}, contextId=thread_a)
        b1 = await env.task("three", {"actorChain": chain(bob)})
        u1 = await env.task("four")  # unbound
        everyone = [u1["id"], b1["id"], a2["id"], a1["id"]]  # newest first

        # A stranger listing without a contextId learns nothing: an empty page.
        for headers in (None, {PROOF: "garbage"}, {"Authorization": "Bearer not-the-token"}):
            page = await env.list_tasks({}, headers)
            assert page.get("tasks", []) == [] and page["totalSize"] == 0, page
            assert await env.runs("", headers) == {"runs": [], "nextCursor": None}

        # A listing proof (over `funduq-read::{ts}`) lists the threads bound to its key.
        page = await env.list_tasks({}, {PROOF: read_proof(alice, "", fresh())})
        assert [t["id"] for t in page["tasks"]] == [a2["id"], a1["id"]]
        assert page["totalSize"] == 2
        listed = await env.runs("", {PROOF: read_proof(alice, "", fresh())})
        assert [r["runId"] for r in listed["runs"]] == [a2["id"], a1["id"]]
        assert "events" not in listed["runs"][0]
        # ... once: the same header again is a stranger's.
        header = {PROOF: read_proof(bob, "", fresh())}
        assert [t["id"] for t in (await env.list_tasks({}, header))["tasks"]] == [b1["id"]]
        assert (await env.list_tasks({}, header))["totalSize"] == 0

        # A named unbound thread is anyone's who holds its id.
        page = await env.list_tasks({"contextId": u1["contextId"]})
        assert [t["id"] for t in page["tasks"]] == [u1["id"]]
        # A named bound thread needs its read proof, else it lists as an unknown one.
        unknown = await env.rpc("ListTasks", {"contextId": "thread_nope"})
        for headers in (None, {PROOF: read_proof(bob, thread_a, fresh())}):
            named = await env.rpc("ListTasks", {"contextId": thread_a}, headers=headers)
            assert named.content == unknown.content
            listed = await env.runs(f"?thread={thread_a}", headers)
            assert listed == {"runs": [], "nextCursor": None}
        page = await env.list_tasks(
            {"contextId": thread_a, "includeArtifacts": True},
            {PROOF: read_proof(alice, thread_a, fresh())},
        )
        assert [t["id"] for t in page["tasks"]] == [a2["id"], a1["id"]]
        assert page["tasks"][0]["artifacts"][0]["parts"][0]["text"] == "two"
        listed = await env.runs(
            f"?thread={thread_a}", {PROOF: read_proof(env.identity, thread_a, fresh())}
        )
        assert [r["runId"] for r in listed["runs"]] == [a2["id"], a1["id"]]

        # The operator sees everything, a page at a time, with the total.
        seen, token = [], None
        while True:
            params = {"pageSize": 3, **({"pageToken": token} if token else {})}
            page = await env.list_tasks(params, env.operator)
            assert page["totalSize"] == 4 and page["pageSize"] == 3
            seen += [t["id"] for t in page["tasks"]]
            token = page.get("nextPageToken")
            if not token:
                break
        assert sorted(seen) == sorted(everyone) and len(seen) == 4
        page = await env.list_tasks({"status": "TASK_STATE_WORKING"}, env.operator)
        assert page["totalSize"] == 0
        page = await env.list_tasks(
            {"status": "TASK_STATE_COMPLETED", "statusTimestampAfter": "2000-01-01T00:00:00Z"},
            env.operator,
        )
        assert page["totalSize"] == 4
        page = await env.list_tasks({"statusTimestampAfter": "2999-01-01T00:00:00Z"}, env.operator)
        assert page["totalSize"] == 0

        first = await env.runs("?limit=3", env.operator)
        assert [r["runId"] for r in first["runs"]] == everyone[:3]
        rest = await env.runs(f"?limit=3&cursor={first['nextCursor']}", env.operator)
        assert [r["runId"] for r in rest["runs"]] == everyone[3:]
        assert rest["nextCursor"] is None
        by_agent = await env.runs(
            f"?agent=echo&provider={env.identity.fingerprint}&status=completed,failed", env.operator
        )
        assert [r["runId"] for r in by_agent["runs"]] == everyone
        assert (await env.runs("?agent=spy", env.operator))["runs"] == []
        for bad in ("?limit=0", "?limit=501", "?limit=x", "?status=done"):
            response = await env.http.get(f"/runs{bad}", headers=env.operator)
            assert response.status_code == 400, bad
            assert response.json()["error"]["code"] == "invalid_query"


# ================================================================== item 3: reads need proofs


async def test_a_bound_thread_reads_exactly_as_an_unknown_one_without_its_proof(tmp_path) -> None:
    alice, stranger = Identity.generate(), Identity.generate()
    async with serving(tmp_path) as env:
        task = await env.task("hi", {"actorChain": chain(alice)})
        run_id, thread_id = task["id"], task["contextId"]

        async def reads(headers: dict | None) -> list[tuple[httpx.Response, httpx.Response]]:
            """Each read of the bound thread beside the same read of unknown ids."""
            pairs = []
            for path, nope in (
                (f"/threads/{thread_id}", "/threads/thread_nope"),
                (f"/runs/{run_id}", "/runs/run_nope"),
            ):
                pairs.append((await env.http.get(path, headers=headers), await env.http.get(nope)))
            for method in ("GetTask", "SubscribeToTask"):
                pairs.append(
                    (
                        await env.rpc(method, {"id": run_id}, headers=headers),
                        await env.rpc(method, {"id": "run_nope"}),
                    )
                )
            # A push config receives every update and holds its owner's
            # secrets: each push-config act is a read of the task.
            for method, params in PUSH_ACTS.items():
                pairs.append(
                    (
                        await env.rpc(method, {"taskId": run_id, **params}, headers=headers),
                        await env.rpc(method, {"taskId": "run_nope", **params}),
                    )
                )
            return pairs

        def one_header(signer: Identity, thread: str = thread_id) -> dict[str, str]:
            return {PROOF: read_proof(signer, thread, fresh())}

        refused = {
            "no proof": None,
            "a stranger's proof": one_header(stranger),
            "a proof for another thread": one_header(alice, "thread_other"),
            "a proof 61 s old": {PROOF: read_proof(alice, thread_id, math.floor(time.time()) - 61)},
            "not a proof": {PROOF: "let me in"},
        }
        for what, headers in refused.items():
            for i, (got, unknown) in enumerate(await reads(headers)):
                nope = "thread_nope" if i == 0 else "run_nope"
                known = thread_id if i == 0 else run_id
                assert same_as(got, unknown, known, nope), (what, i, got.text, unknown.text)

        # The head's proof, the provider's, and the operator's token read it,
        # each proof once: the same header again reads as a stranger's.
        for signer in (alice, env.identity):
            header = one_header(signer)
            response = await env.http.get(f"/threads/{thread_id}", headers=header)
            assert response.status_code == 200 and response.json()["segmentHead"] == (
                alice.public_key_hex
            )
            again = await env.http.get(f"/threads/{thread_id}", headers=header)
            assert same_as(
                again, await env.http.get("/threads/thread_nope"), thread_id, "thread_nope"
            )
            got = (await env.rpc("GetTask", {"id": run_id}, headers=one_header(signer))).json()
            assert got["result"]["status"]["state"] == "TASK_STATE_COMPLETED"
            answer = (
                await env.rpc("SubscribeToTask", {"id": run_id}, headers=one_header(signer))
            ).json()
            assert error_of(answer)[0] == -32004  # terminal: told only to a reader
            listed = (
                await env.rpc(
                    "ListTaskPushNotificationConfigs",
                    {"taskId": run_id},
                    headers=one_header(signer),
                )
            ).json()
            assert listed["result"] == {}, listed
        assert (await env.http.get(f"/runs/{run_id}", headers=env.operator)).status_code == 200
        listed = (
            await env.rpc(
                "ListTaskPushNotificationConfigs", {"taskId": run_id}, headers=env.operator
            )
        ).json()
        assert listed["result"] == {}, listed

        # An unbound thread stays readable by anyone holding its id.
        plain = await env.task("hello")
        assert (await env.http.get(f"/threads/{plain['contextId']}")).status_code == 200
        assert (await env.http.get(f"/runs/{plain['id']}")).status_code == 200


async def test_an_agui_resume_on_a_bound_thread_says_nothing_before_authority(tmp_path) -> None:
    alice = Identity.generate()
    async with serving(tmp_path) as env:
        url = env.url("agui", "asker")

        def body(text: str, thread_id: str, props: dict | None = None, **extra: Any) -> dict:
            return {
                "threadId": thread_id,
                "runId": "r",
                "messages": [{"id": env.next_id("u"), "role": "user", "content": text}],
                **({"forwardedProps": props} if props is not None else {}),
                **extra,
            }

        _, events = await post_sse(
            env.http, url, body("pause", "t-p", {"actorChain": chain(alice)})
        )
        paused_thread, paused_run = events[0]["threadId"], events[0]["runId"]
        _, events = await post_sse(env.http, url, body("end", "t-e", {"actorChain": chain(alice)}))
        ended_thread = events[0]["threadId"]
        resume = [{"interruptId": "ask-1", "status": "resolved", "payload": "stop"}]

        # A stranger's resume: paused or not, the unknown thread's answer.
        unknown = await env.http.post(url, json=body("x", "thread_nope", resume=resume))
        assert unknown.status_code == 404
        for thread_id in (paused_thread, ended_thread):
            for props in (
                None,
                {"resolution": proof(alice, resolve_payload, "run_other")},
                {"kyok": "bogus"},
            ):
                got = await env.http.post(url, json=body("x", thread_id, props, resume=resume))
                assert same_as(got, unknown, thread_id, "thread_nope"), (got.status_code, got.text)
        assert (await env.record(paused_run))["status"] == "input-required"

        # A reader learns the state: the ended thread's snapshot, or that the
        # paused run's answer lacked authority.
        got = await env.http.post(
            url,
            json=body("x", ended_thread, resume=resume),
            headers={PROOF: read_proof(alice, ended_thread, fresh())},
        )
        assert got.status_code == 200 and got.json()["threadId"] == ended_thread
        got = await env.http.post(
            url,
            json=body("x", paused_thread, resume=resume),
            headers={PROOF: read_proof(alice, paused_thread, fresh())},
        )
        assert got.status_code == 403 and got.json()["error"]["code"] == "not_authorized"

        # The head's resolution answers it, no read proof needed.
        _, events = await post_sse(
            env.http,
            url,
            body(
                "x",
                paused_thread,
                {"resolution": proof(alice, resolve_payload, paused_run)},
                resume=resume,
            ),
        )
        assert [e["type"] for e in events][-1] == "RUN_FINISHED"
        assert (await env.record(paused_run))["status"] == "completed"


async def test_an_answer_cannot_hand_a_bound_thread_another_chain(tmp_path) -> None:
    """An answer's actor chain is held to a new utterance's rule: headed by
    the segment head (or the provider), however good its resolution."""
    alice, mallory = Identity.generate(), Identity.generate()
    async with serving(tmp_path) as env:
        url = env.url("agui", "asker")

        def body(text: str, thread_id: str, props: dict, **extra: Any) -> dict:
            return {
                "threadId": thread_id,
                "runId": "r",
                "forwardedProps": props,
                "messages": [{"id": env.next_id("u"), "role": "user", "content": text}],
                **extra,
            }

        _, events = await post_sse(
            env.http, url, body("pause", "t-p", {"actorChain": chain(alice)})
        )
        thread_id, run_id = events[0]["threadId"], events[0]["runId"]
        resume = [{"interruptId": "ask-1", "status": "resolved", "payload": "stop"}]

        got = await env.http.post(
            url,
            json=body(
                "x",
                thread_id,
                {
                    "resolution": proof(alice, resolve_payload, run_id, fresh()),
                    "actorChain": chain(mallory),
                },
                resume=resume,
            ),
            headers={PROOF: read_proof(alice, thread_id, fresh())},
        )
        assert got.status_code == 403 and got.json()["error"]["code"] == "not_authorized"
        record = await env.record(run_id)
        assert record["status"] == "input-required"

        # Her own chain with her resolution answers it.
        _, events = await post_sse(
            env.http,
            url,
            body(
                "x",
                thread_id,
                {
                    "resolution": proof(alice, resolve_payload, run_id, fresh()),
                    "actorChain": chain(alice),
                },
                resume=resume,
            ),
        )
        assert [e["type"] for e in events][-1] == "RUN_FINISHED"
        assert (await env.record(run_id))["status"] == "completed"


async def test_refusals_before_authority_say_nothing_of_the_thread(tmp_path) -> None:
    """Refuse first: an unpresented chain is refused alike whether or not the
    contextId names a thread, and an answer naming the wrong contextId is
    refused as an unauthorized answer is, until its authority is proven."""
    alice, mallory = Identity.generate(), Identity.generate()
    async with serving(tmp_path) as env:
        paused = await env.task("pause", {"actorChain": chain(alice)}, agent="asker")
        run_id, thread_id = paused["id"], paused["contextId"]

        unpresented = {UNPRESENTED: "1"}
        answers = [
            await env.send(
                "x",
                {"actorChain": chain(mallory)},
                agent="asker",
                headers=unpresented,
                contextId=context,
            )
            for context in (thread_id, "thread_nope")
        ]
        assert [error_of(a) for a in answers] == [(-32602, "invalid_actor_chain")] * 2, answers

        stranger = {"resolution": proof(mallory, resolve_payload, run_id, fresh())}
        right = await env.send("stop", stranger, agent="asker", taskId=run_id, contextId=thread_id)
        wrong = await env.send(
            "stop", stranger, agent="asker", taskId=run_id, contextId="thread_other"
        )
        assert error_of(right) == error_of(wrong) == (-32602, "not_authorized"), (right, wrong)
        # With her authority, the wrong context is refused as such.
        wrong = await env.send(
            "stop",
            {"resolution": proof(alice, resolve_payload, run_id, fresh())},
            agent="asker",
            taskId=run_id,
            contextId="thread_other",
        )
        assert error_of(wrong)[0] == -32602, wrong
        assert "is not the thread of run" in wrong["error"]["message"]
        assert (await env.record(run_id))["status"] == "input-required"


async def test_strangers_listing_proofs_cannot_crowd_out_a_threads_reads(tmp_path) -> None:
    """Listing and presenter proofs come from any key, fresh ones by the
    thousand: they are kept apart from the proofs a thread's own keys spend."""
    alice = Identity.generate()
    async with serving(tmp_path, max_spent_proofs=3) as env:
        task = await env.task("hi", {"actorChain": chain(alice)})
        thread_id = task["contextId"]
        for _ in range(4):
            listed = await env.http.get(
                "/runs", headers={PROOF: read_proof(Identity.generate(), "", fresh())}
            )
            assert listed.status_code in (200, 503)
            # A self-made chain, presented, to a thread that is not there.
            await env.send("x", {"actorChain": chain(Identity.generate())}, contextId="thread_nope")
        read = await env.http.get(
            f"/threads/{thread_id}", headers={PROOF: read_proof(alice, thread_id, fresh())}
        )
        assert read.status_code == 200, read.text
        listing = await env.http.get("/runs", headers={PROOF: read_proof(alice, "", fresh())})
        assert listing.status_code == 503  # only listings wait for the store to drain
        assert listing.json()["error"]["code"] == "proofs_busy"


# ================================================================== item 4: presented chains


async def test_a_provider_cannot_replay_a_chain_it_was_handed(tmp_path) -> None:
    alice = Identity.generate()
    async with serving(tmp_path) as env:
        alices = chain(alice)
        # Alice's thread with echo, bound to her; and a call to the spy's agent,
        # whose provider now holds her chain.
        task = await env.task("mine", {"actorChain": alices})
        thread_id = task["contextId"]
        await env.task("hello spy", {"actorChain": alices}, agent="spy", provider=env.spy_provider)
        handed = env.spy.inputs[-1].forwarded_props["actorChain"]
        assert handed[:-1] == alices
        snapshot = (await env.http.get(f"/threads/{thread_id}", headers=env.operator)).json()

        spy_key = env.spy_provider.identity
        echo_key = env.identity.public_key_hex
        attempts = {
            "as handed (funduq's hop last)": {"actorChain": handed},
            "alice's hops alone": {"actorChain": alices},
            "presented by the spy": {
                "actorChain": alices,
                "presenter": presenter(spy_key, echo_key, "echo", "m-any"),
            },
        }
        no_auto = {UNPRESENTED: "1"}
        for what, metadata in attempts.items():
            answer = await env.send("let me in", metadata, contextId=thread_id, headers=no_auto)
            assert error_of(answer) == (-32602, "invalid_actor_chain"), (what, answer)
            response = await env.http.post(
                env.url("agui", "echo"),
                headers=no_auto,
                json={
                    "threadId": thread_id,
                    "runId": "r",
                    "forwardedProps": metadata,
                    "messages": [{"id": "m-any", "role": "user", "content": "let me in"}],
                },
            )
            assert response.status_code == 403, (what, response.text)
            assert response.json()["error"]["code"] == "invalid_actor_chain"

        # Alice's own presenter, made for the spy's agent, presents to nobody else.
        message = env.message("for the spy")
        made_for_spy = presenter(
            alice, env.spy_provider.identity.public_key_hex, "spy", message["messageId"]
        )
        answer = (
            await env.rpc(
                "SendMessage",
                {
                    "message": {**message, "contextId": thread_id},
                    "metadata": {"actorChain": alices, "presenter": made_for_spy},
                },
                headers=no_auto,
            )
        ).json()
        assert error_of(answer) == (-32602, "invalid_actor_chain"), answer

        after = await env.http.get(f"/threads/{thread_id}", headers=env.operator)
        assert after.json() == snapshot  # nothing was written into alice's thread
        # The presenter proved something to funduq: it is not handed on.
        assert "presenter" not in env.spy.inputs[-1].forwarded_props


# ================================================================== item 5: spent once


async def test_a_proof_works_once(tmp_path) -> None:
    alice, mallory = Identity.generate(), Identity.generate()
    async with serving(tmp_path) as env:
        # A resolution captured on one turn of a paused run, replayed on its
        # next turn with a different answer: refused as a bad proof is.
        paused = await env.task("pause", {"actorChain": chain(alice)}, agent="asker")
        run_id = paused["id"]
        captured = {"resolution": proof(alice, resolve_payload, run_id)}
        turn2 = await env.task("again", captured, agent="asker", taskId=run_id)
        assert (turn2["id"], turn2["status"]["state"]) == (run_id, "TASK_STATE_INPUT_REQUIRED")
        before = await env.record(run_id)
        replayed = await env.send("stop", captured, agent="asker", taskId=run_id)
        forged = await env.send(
            "stop",
            {"resolution": proof(mallory, resolve_payload, run_id)},
            agent="asker",
            taskId=run_id,
        )
        assert error_of(replayed) == (-32602, "not_authorized"), replayed
        assert replayed["error"] == forged["error"]
        assert await env.record(run_id) == before  # still paused, answered by alice once

        # A cancel proof: accepted once (here the task has ended, which a
        # signer may learn), then refused as any bad proof.
        ended = await env.task("hi", {"actorChain": chain(alice)})
        cancel = {
            "id": ended["id"],
            "metadata": {"cancel": proof(alice, cancel_payload, ended["id"])},
        }
        first = (await env.rpc("CancelTask", cancel)).json()
        assert error_of(first)[0] == -32002  # TaskNotCancelableError
        second = (await env.rpc("CancelTask", cancel)).json()
        forged = (
            await env.rpc(
                "CancelTask",
                {
                    "id": ended["id"],
                    "metadata": {"cancel": proof(mallory, cancel_payload, ended["id"])},
                },
            )
        ).json()
        assert error_of(second) == (-32602, "not_authorized"), second
        assert second["error"] == forged["error"]

        # A presenter: the same request twice is a forged chain the second time.
        message = env.message("once")
        metadata = {
            "actorChain": chain(alice),
            "presenter": presenter(
                alice, env.identity.public_key_hex, "echo", message["messageId"]
            ),
        }
        first = (await env.rpc("SendMessage", {"message": message, "metadata": metadata})).json()
        assert first["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
        second = (await env.rpc("SendMessage", {"message": message, "metadata": metadata})).json()
        assert error_of(second) == (-32602, "invalid_actor_chain"), second


# ================================================================== items 6/9: hostile shapes


def long_chain(signer: Identity, hops: int, *, first: str | None = None) -> list[str]:
    tokens = [first or make_hop(signer, None)]
    while len(tokens) < hops:
        tokens.append(make_hop(signer, tokens[-1]))
    return tokens


async def test_hostile_chains_and_timestamps_are_refused_not_crashes(tmp_path) -> None:
    alice = Identity.generate()
    async with serving(tmp_path) as env:
        header = _b64url(b'{"alg":"EdDSA","typ":"JWT"}')
        deep = _b64url(b"[" * 200_000 + b"]" * 200_000)
        nested = f"{header}.{deep}.{_b64url(bytes(64))}"
        chains = {
            # counted before any signature: hop 0 is forged, the refusal is the count
            "17 hops": (long_chain(alice, 17, first="x.y.z"), "at most 16 hops"),
            "claims nested 200,000 deep": ([nested], "hop 0 is not a compact JWT"),
        }
        for what, (tokens, reason) in chains.items():
            answer = await env.send("x", {"actorChain": tokens}, headers={UNPRESENTED: "1"})
            assert error_of(answer) == (-32602, "invalid_actor_chain"), (what, answer)
            assert reason in answer["error"]["message"], what
            response = await env.http.post(
                env.url("agui", "echo"),
                json={
                    "threadId": "t",
                    "runId": "r",
                    "forwardedProps": {"actorChain": tokens},
                    "messages": [{"id": "m", "role": "user", "content": "x"}],
                },
            )
            assert response.status_code == 403, (what, response.text)
            assert response.json()["error"]["code"] == "invalid_actor_chain"
        assert (await env.runs("", env.operator))["runs"] == []
        sixteen = await env.task("x", {"actorChain": chain(*[alice] * 16)})
        assert sixteen["status"]["state"] == "TASK_STATE_COMPLETED"

        # Timestamps of 400 digits: not authorized, like any bad proof.
        huge = 10**400
        paused = await env.task("pause", {"actorChain": chain(alice)}, agent="asker")
        bad = {"publicKey": alice.public_key_hex, "timestamp": huge, "signature": "0" * 128}
        response = await env.http.post(
            env.url("agui", "asker"),
            headers={PROOF: read_proof(alice, paused["contextId"], fresh())},
            json={
                "threadId": paused["contextId"],
                "runId": "r",
                "forwardedProps": {"resolution": bad},
                "resume": [{"interruptId": "ask-1", "status": "resolved", "payload": "stop"}],
                "messages": [{"id": "m-huge", "role": "user", "content": "x"}],
            },
        )
        assert response.status_code == 403, response.text
        assert response.json()["error"]["code"] == "not_authorized"
        answer = (
            await env.rpc("CancelTask", {"id": paused["id"], "metadata": {"cancel": bad}})
        ).json()
        assert error_of(answer)[0] in (-32602,), answer
        assert (await env.record(paused["id"]))["status"] == "input-required"
