"""A proof spent on one node is spent on all (DESIGN §8, §11): where several
funduq nodes share one PostgreSQL record, a proof accepted by node A is
refused by node B exactly as a bad proof is. On SQLite (one process) the
spending stays in memory and touches no record.

The nodes here are two real servers on loopback ports on one database. A
cluster does not exist yet (they do not share runs' ordering), so the proofs
replayed are ones whose refusal shows without it: a listing, a thread's read,
a cancel of a run that has settled, a presented chain, a KYOK call's
signature.
"""

from __future__ import annotations

import contextlib
import sqlite3
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
import stores
from broker_support import broker
from support import chain, http_client, presenter, read_proof, running_server, sdk_provider
from test_access import PROOF, Env, Spy, error_of, fresh, proof

from funduq_trio.broker import authority
from funduq_trio.broker.errors import NotAuthorized, RecordUnavailable
from funduq_trio.broker.kyok import KyokRefusal
from funduq_trio.broker.spends import Spends
from funduq_trio.broker.store import open_store
from funduq_trio.config import Settings
from funduq_trio.identity import Identity, cancel_payload, kyok_call_payload, read_payload
from funduq_trio.provider import echo


@contextlib.asynccontextmanager
async def node(tmp_path, name: str) -> AsyncIterator[tuple[Any, Any]]:
    """One funduq node on this test's record, its data directory its own:
    its ServerInfo and an HTTP client to it."""
    (tmp_path / name).mkdir()
    async with running_server(tmp_path / name) as info, http_client(info) as http:
        yield info, http


@pytest.mark.parametrize("store", ["postgres"], indirect=True)
async def test_a_proof_accepted_on_one_node_is_refused_on_another(tmp_path) -> None:
    alice = Identity.generate()
    async with node(tmp_path, "a") as (info, http):
        async with sdk_provider(info, {"echo": echo}) as provider:
            a = Env(info, http, provider, provider, Spy())
            task = await a.task("hi", {"actorChain": chain(alice)})
            run_id, thread_id = task["id"], task["contextId"]

            # Node A accepts each proof once, as ever.
            listing = {PROOF: read_proof(alice, "", fresh())}
            assert [r["runId"] for r in (await a.runs("", listing))["runs"]] == [run_id]
            reading = {PROOF: read_proof(alice, thread_id, fresh())}
            assert (await a.http.get(f"/threads/{thread_id}", headers=reading)).status_code == 200
            cancel = {"id": run_id, "metadata": {"cancel": proof(alice, cancel_payload, run_id)}}
            # Accepted (the run has settled, which its signer may learn).
            assert error_of((await a.rpc("CancelTask", cancel)).json())[0] == -32002
            message = a.message("once")
            presented = {
                "message": message,
                "metadata": {
                    "actorChain": chain(alice),
                    "presenter": presenter(
                        alice, provider.identity.public_key_hex, "echo", message["messageId"]
                    ),
                },
            }
            first = (await a.rpc("SendMessage", presented)).json()
            assert first["result"]["task"]["status"]["state"] == "TASK_STATE_COMPLETED"
            runs = [first["result"]["task"]["id"], run_id]  # alice's, newest first

        # Node B, on the same database: each of those proofs is spent there too.
        async with node(tmp_path, "b") as (info, http):
            b = Env(info, http, provider, provider, Spy())
            assert await b.runs("", listing) == {"runs": [], "nextCursor": None}
            again = await b.http.get(f"/threads/{thread_id}", headers=reading)
            unknown = await b.http.get("/threads/thread_nope", headers=reading)
            assert again.status_code == 404
            assert again.text.replace(thread_id, "ID") == unknown.text.replace("thread_nope", "ID")
            replayed = (await b.rpc("CancelTask", cancel)).json()
            forged = {
                "id": run_id,
                "metadata": {"cancel": proof(Identity.generate(), cancel_payload, run_id)},
            }
            assert error_of(replayed) == (-32602, "not_authorized"), replayed
            assert replayed["error"] == (await b.rpc("CancelTask", forged)).json()["error"]
            replayed = (await b.rpc("SendMessage", presented)).json()
            assert error_of(replayed) == (-32602, "invalid_actor_chain"), replayed

            # ... while fresh proofs work on B: it reads the shared record.
            fresh_listing = {PROOF: read_proof(alice, "", fresh())}
            assert [r["runId"] for r in (await b.runs("", fresh_listing))["runs"]] == runs
            fresh_reading = {PROOF: read_proof(alice, thread_id, fresh())}
            read = await b.http.get(f"/threads/{thread_id}", headers=fresh_reading)
            assert read.status_code == 200
            fresh_cancel = {
                "id": run_id,
                "metadata": {"cancel": proof(alice, cancel_payload, run_id, fresh())},
            }
            assert error_of((await b.rpc("CancelTask", fresh_cancel)).json())[0] == -32002

            # And back: what B spent, A refuses.
            assert await a.runs("", fresh_listing) == {"runs": [], "nextCursor": None}


@pytest.mark.parametrize("store", ["postgres"], indirect=True)
async def test_a_kyok_call_signature_spent_on_one_node_is_refused_on_another(tmp_path) -> None:
    agent = Identity.generate()
    body = b'{"model": "m"}'
    stamp = str(int(time.time()))
    signature = agent.sign(kyok_call_payload("tok", int(stamp), body))
    call = (agent.public_key_hex, "tok", stamp, signature, body)
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    async with broker(tmp_path / "a") as a, broker(tmp_path / "b") as b:
        await a.kyok.check_signature(*call)
        with pytest.raises(KyokRefusal) as refused:
            await b.kyok.check_signature(*call)
        assert (refused.value.status, refused.value.code) == (401, "invalid_signature")
        later = str(int(stamp) - 1)
        await b.kyok.check_signature(
            agent.public_key_hex,
            "tok",
            later,
            agent.sign(kyok_call_payload("tok", int(later), body)),
            body,
        )


async def test_spent_proofs_are_shared_only_where_the_record_is(tmp_path, store) -> None:
    """On SQLite a broker spends in memory alone; on PostgreSQL in the record too."""
    async with broker(tmp_path) as funduq:
        shared = store == "postgres"
        for spends in (funduq.spent, funduq.spent_by_anyone, funduq.kyok.spent):
            assert (spends.record is not None) == shared
        assert funduq.record.shared == shared


async def test_the_store_spends_a_proof_once_and_forgets_it_past_its_time(tmp_path) -> None:
    settings = Settings(data_dir=tmp_path, database_url=stores.database_url)
    async with open_store(settings) as record:
        now = 1_000_000.0
        key = "ab" * 32
        assert await record.spend_proof(key, "funduq-read::1", now + 120, now)
        assert not await record.spend_proof(key, "funduq-read::1", now + 120, now)
        assert await record.spend_proof(key, "funduq-read::2", now + 120, now)
        assert await record.spend_proof("cd" * 32, "funduq-read::1", now + 120, now)
        # A payload of any text is kept (as its digest).
        assert await record.spend_proof(key, "nul \x00 and \ud800", now + 120, now)
        assert not await record.spend_proof(key, "nul \x00 and \ud800", now + 120, now)
        count = "SELECT COUNT(*) FROM spent_proofs"
        assert await record.read(lambda c: c.execute(count).fetchone()[0]) == 4

        # Past their time (and the sweep's pause), spending deletes them.
        later = now + 121 + record.SPENT_SWEEP_SECONDS
        assert await record.spend_proof(key, "funduq-read::3", later + 120, later)
        assert await record.read(lambda c: c.execute(count).fetchone()[0]) == 1


class FakeRecord:
    """A store as Spends sees one: shared or not, its spend_proof scripted."""

    def __init__(self, shared: bool, answer: object) -> None:
        self.shared, self.answer = shared, answer
        self.spent: list[tuple[str, str, float]] = []

    async def spend_proof(self, signer: str, payload: str, keep_until: float, now: float) -> bool:
        self.spent.append((signer, payload, keep_until))
        if isinstance(self.answer, BaseException):
            raise self.answer
        return bool(self.answer)


def _listing_check(signer: Identity, ts: int):
    header = read_proof(signer, "", ts)
    return lambda spent: authority.check_listing(header, time.time(), spent)


def _bad(signer: Identity):
    header = read_proof(signer, "", 12345)  # far outside the window
    return lambda spent: authority.check_listing(header, time.time(), spent)


async def test_spends_write_to_a_shared_record_only_and_refuse_what_it_refuses() -> None:
    alice = Identity.generate()
    ts = int(time.time())
    # Not shared (SQLite): the local check alone, and the record never asked.
    local = FakeRecord(False, True)
    spends = Spends(authority.SpentProofs(10))
    spends.share(local)
    assert await spends.check(_listing_check(alice, ts)) == alice.public_key_hex
    with pytest.raises(NotAuthorized):
        await spends.check(_listing_check(alice, ts))  # spent here
    assert local.spent == []

    # Shared: the record is asked once per accepted proof, kept two windows.
    shared = FakeRecord(True, True)
    spends = Spends(authority.SpentProofs(10))
    spends.share(shared)
    assert await spends.check(_listing_check(alice, ts)) == alice.public_key_hex
    assert shared.spent == [(alice.public_key_hex, read_payload("", ts), ts + 120)]
    with pytest.raises(NotAuthorized):
        await spends.check(_listing_check(alice, ts))  # the local check: no second ask
    assert len(shared.spent) == 1
    with pytest.raises(NotAuthorized):
        await spends.check(_bad(alice))
    assert len(shared.spent) == 1  # a bad proof is refused before any ask

    # Spent by another node: refused as a bad proof is.
    shared.answer = False
    with pytest.raises(NotAuthorized) as refused:
        await spends.check(_listing_check(alice, ts - 2))
    assert str(refused.value) == authority.NOT_AUTHORIZED
    # The record cannot take it: 503, not a crash (the proof stays spent here).
    shared.answer = sqlite3.OperationalError("disk I/O error")
    with pytest.raises(RecordUnavailable):
        await spends.check(_listing_check(alice, ts - 3))
    with pytest.raises(NotAuthorized):
        await spends.check(_listing_check(alice, ts - 3))
