"""Leases judged against an explicit ``now``: expiry, renewal, removal, worker ids."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psgrid.psserver.state.membership import Leases, Member


def test_expires_after_lease_s():
    leases = Leases(lease_s=5.0)
    leases.add(0, "host-a", now=100.0)
    leases.add(1, "host-b", now=102.0)
    assert leases.expired(100.0) == []
    assert leases.expired(105.0) == []  # exactly lease_s: still alive
    assert leases.expired(105.001) == [0]
    assert leases.expired(107.0) == [0]
    assert sorted(leases.expired(107.5)) == [0, 1]
    # expired() only reports; it removes nobody
    assert set(leases.members) == {0, 1}


def test_renew_extends():
    leases = Leases(lease_s=2.0)
    leases.add(3, "h", now=0.0)
    assert leases.renew(3, now=1.5)
    assert leases.members[3].last_seen == 1.5
    assert leases.expired(3.0) == []
    assert leases.expired(3.6) == [3]
    assert leases.renew(3, now=3.6)
    assert leases.expired(3.6) == []


def test_renew_unknown_is_false_and_adds_nobody():
    leases = Leases(lease_s=1.0)
    assert not leases.renew(7, now=0.0)
    assert leases.members == {}
    assert leases.expired(100.0) == []


def test_remove():
    leases = Leases(lease_s=1.0)
    leases.add(0, "h", now=0.0)
    leases.add(1, "h", now=0.0)
    leases.remove(0)
    assert set(leases.members) == {1}
    assert leases.expired(10.0) == [1]
    assert not leases.renew(0, now=10.0)
    leases.remove(0)  # removing twice is harmless
    leases.remove(42)
    assert set(leases.members) == {1}


def test_add_again_resets_member():
    leases = Leases(lease_s=1.0)
    leases.add(0, "old-host", now=0.0)
    leases.add(0, "new-host", now=10.0)
    assert leases.members[0] == Member(0, "new-host", 10.0, 10.0)
    assert leases.expired(10.5) == []


def test_a_live_heartbeat_does_not_count_as_progress():
    leases = Leases(lease_s=1.0)
    leases.add(0, "a", now=0.0)
    leases.add(1, "b", now=0.0)
    for t in range(1, 10):
        leases.renew(0, now=float(t))  # heartbeats only: the process lives, its loop does not move
        leases.renew(1, now=float(t))
        leases.progressed(1, now=float(t))  # pushes
    assert leases.expired(9.5) == []
    assert leases.stalled(9.5, timeout=5.0) == [0]
    leases.progressed(0, now=9.5)
    assert leases.stalled(9.5, timeout=5.0) == []


def test_new_id_monotone():
    leases = Leases(lease_s=1.0)
    ids = [leases.new_id() for _ in range(5)]
    assert ids == [0, 1, 2, 3, 4]
    assert leases.members == {}  # new_id does not register anyone


def test_add_bumps_next_id():
    leases = Leases(lease_s=1.0)
    leases.add(5, "h", now=0.0)
    assert leases.next_id == 6
    assert leases.new_id() == 6
    leases.add(2, "h", now=0.0)  # a lower id never moves next_id back
    assert leases.next_id == 7
    assert leases.new_id() == 7
    leases.add(7, "h", now=0.0)  # an id just handed out, registered
    assert leases.new_id() == 8


@given(st.lists(st.one_of(st.just(None), st.integers(0, 50)), max_size=40))
@settings(max_examples=50, deadline=None)
def test_ids_never_collide(events):
    """new_id never hands out an id that was added before (restored or rejoining workers)."""
    leases = Leases(lease_s=1.0)
    seen: set[int] = set()
    last = -1
    for e in events:
        if e is None:
            wid = leases.new_id()
            assert wid not in seen and wid > last
            last = wid
            seen.add(wid)
        else:
            leases.add(e, "h", now=0.0)
            seen.add(e)
        assert leases.next_id > max(seen)


@pytest.mark.parametrize("lease_s", [0.0, 0.5, 30.0])
def test_expired_boundary(lease_s):
    leases = Leases(lease_s=lease_s)
    leases.add(0, "h", now=1000.0)
    assert leases.expired(1000.0 + lease_s) == []
    assert leases.expired(1000.0 + lease_s + 1e-6) == [0]
