"""The pure parts of forwarding between nodes (broker/cluster.py): a call's
signature and its freshness, and broker errors carried as JSON and raised
again as the same exception (so a door answers a forwarded call's error
exactly as a local one). The route and the forwarding itself, through real
processes: test_cluster_forwarding.py."""

from __future__ import annotations

import time

from funduq_trio.broker import cluster, errors
from funduq_trio.identity import InvalidActorChain
from funduq_trio.web.door_errors import door_answer

SECRET = "s" * 64


def test_a_signature_holds_only_for_its_secret_op_body_and_minute():
    body = b'{"run_id": "run_1"}'
    stamp = repr(time.time())
    good = cluster.sign(SECRET, "cancel_run", stamp, body)
    assert cluster.signed(SECRET, "cancel_run", stamp, good, body)
    assert not cluster.signed("t" * 64, "cancel_run", stamp, good, body)
    assert not cluster.signed(SECRET, "start_run", stamp, good, body)
    assert not cluster.signed(SECRET, "cancel_run", stamp, good, body + b" ")
    assert not cluster.signed(SECRET, "cancel_run", None, good, body)
    assert not cluster.signed(SECRET, "cancel_run", stamp, None, body)
    assert not cluster.signed(SECRET, "cancel_run", "soon", good, body)
    assert not cluster.signed(
        "", "cancel_run", stamp, cluster.sign("", "cancel_run", stamp, body), body
    )
    stale = repr(time.time() - 2 * cluster.FRESH_SECONDS)
    assert not cluster.signed(
        SECRET, "cancel_run", stale, cluster.sign(SECRET, "cancel_run", stale, body), body
    )


def test_errors_come_back_as_the_same_exception_with_the_same_answer():
    originals: list[Exception] = [
        errors.AgentNotFound("no agent 'x'"),
        errors.ThreadQueueFull("thread t already holds 8 pending runs"),
        errors.NotAuthorized("not authorized"),
        errors.RunNotCancellable("run r is paused or has ended; nothing to stop"),
        errors.QueuedRunsLimit("too many", limit=5),
        errors.ThreadLedElsewhere("led elsewhere"),
        InvalidActorChain("not presented"),
    ]
    for original in originals:
        back = cluster.error_from_json(cluster.error_json(original))
        assert type(back) is type(original)
        assert str(back) == str(original)
        assert getattr(back, "details", None) == getattr(original, "details", None)
        assert door_answer(back) == door_answer(original)
    unknown = cluster.error_from_json({"class": "NoSuchError", "message": "m"})
    assert type(unknown) is errors.FunduqError and str(unknown) == "m"
    assert type(cluster.error_from_json("junk")) is errors.FunduqError
