"""The lease bookkeeping of a node (broker/leases.py), without PostgreSQL or a
clock: what it holds, what a renewal's answer means, when a thread's lease is
released. The SQL half is tested through real processes in test_cluster.py."""

from __future__ import annotations

import pytest

from funduq_trio.broker.leases import RENEWALS_PER_LEASE, Leases, new_node_id
from funduq_trio.config import Settings


def leases() -> Leases:
    return Leases("node_a", 9.0)


def test_node_ids_are_fresh_per_start_and_carry_the_readable_name():
    assert new_node_id() != new_node_id()
    assert new_node_id().startswith("node_")
    named = new_node_id("eu-1")
    assert named.startswith("eu-1_") and len(named) == len("eu-1_") + 12


def test_renewed_three_times_a_lease():
    assert leases().renew_every == pytest.approx(9.0 / RENEWALS_PER_LEASE)


def test_a_thread_is_released_only_when_held_and_idle():
    lease = leases()
    assert not lease.release("t1", busy=False)  # never held: nothing to release
    lease.taken(["t1"])
    assert lease.leads("t1")
    assert not lease.release("t1", busy=True)  # a lane or a request still at work
    assert lease.leads("t1")
    assert lease.release("t1", busy=False)
    assert not lease.leads("t1")
    assert not lease.release("t1", busy=False)  # released once


def test_a_renewal_that_misses_a_held_thread_means_it_was_taken_over():
    lease = leases()
    lease.taken(["t1", "t2"])
    snapshot = lease.snapshot()
    renewal = lease.renewed(snapshot, ["t1"])
    assert renewal.lost == {"t2"} and renewal.strays == set()
    assert lease.held == {"t1"}


def test_a_thread_released_while_the_renewal_was_out_is_not_lost():
    lease = leases()
    lease.taken(["t1"])
    snapshot = lease.snapshot()
    assert lease.release("t1", busy=False)  # its delete raced the renewal
    renewal = lease.renewed(snapshot, [])
    assert renewal.lost == set() and renewal.strays == set()


def test_a_lease_taken_while_the_renewal_was_out_is_not_a_stray():
    lease = leases()
    snapshot = lease.snapshot()  # empty
    # The run's insert (and its lease) committed before the renewal ran, but
    # the node marks it held only once the insert's await returns.
    renewal = lease.renewed(snapshot, ["t9"])
    assert renewal.strays == set()
    lease.taken(["t9"])
    renewal = lease.renewed(lease.snapshot(), ["t9"])
    assert renewal.strays == set() and renewal.lost == set()


def test_a_row_of_ours_nobody_holds_is_released_again_when_seen_twice():
    lease = leases()
    # A release the record did not take: the row is still ours, renewed.
    first = lease.renewed(lease.snapshot(), ["t3"])
    assert first.strays == set()
    second = lease.renewed(lease.snapshot(), ["t3"])
    assert second.strays == {"t3"}
    # Released again; it does not come back.
    third = lease.renewed(lease.snapshot(), [])
    assert third.strays == set()


def test_a_fenced_write_drops_the_thread_once():
    lease = leases()
    lease.taken(["t1"])
    assert lease.lost("t1")
    assert not lease.lost("t1")
    assert not lease.leads("t1")


def test_settings_bound_the_lease_and_the_node_name():
    assert Settings().lease_seconds == 10.0
    problems = Settings(lease_seconds=0).problems()
    assert any("FUNDUQ_LEASE_SECONDS=0" in p for p in problems)
    assert any("FUNDUQ_LEASE_SECONDS" in p for p in Settings(lease_seconds=-1).problems())
    assert Settings(node_name="eu-west.1").problems() == []
    assert any("FUNDUQ_NODE_NAME" in p for p in Settings(node_name="no spaces").problems())
    assert Settings.from_env({"FUNDUQ_LEASE_SECONDS": "2.5"}).lease_seconds == 2.5
