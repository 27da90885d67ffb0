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


# ----- bounds: what ids made up by a token holder cannot grow ------------------------------------------


def _service():
    from psgrid.psserver.config import ServerConfig
    from psgrid.psserver.service import ShardService
    from psgrid.psserver.state.shard import Shard

    return ShardService(Shard(ServerConfig(mode="async", shared_memory=False, lease_s=300)))


def test_a_shard_holds_at_most_max_members_live_workers_and_takes_one_when_another_leaves(monkeypatch):
    from psgrid.psserver.exceptions import Unavailable
    from psgrid.psserver.protocol import Reason
    from psgrid.psserver.state import membership

    monkeypatch.setattr(membership, "MAX_MEMBERS", 3)
    service = _service()
    ids = [service.register(spec_hash="", worker_id=-1, start_clock=-1, host="h").worker_id for _ in range(3)]
    with pytest.raises(Unavailable, match="holds 3 live workers, its most") as refused:
        service.register(spec_hash="", worker_id=-1, start_clock=-1, host="h")
    assert refused.value.reason is Reason.TOO_MANY_CONNECTIONS
    assert [m["worker_id"] for m in service.stats()["members"]] == sorted(ids)  # the refusal added nobody
    assert service.register(spec_hash="", worker_id=ids[0], start_clock=-1, host="h").worker_id == ids[0]  # a rejoin
    service.heartbeat(worker_id=ids[1], leaving=True)
    assert service.register(spec_hash="", worker_id=-1, start_clock=-1, host="h").worker_id not in ids


def test_a_full_membership_of_the_longest_hosts_fits_stats_in_grpcs_4_mib():
    from psgrid.psserver.rpc import ps_pb2
    from psgrid.psserver.service import MAX_HOST_CHARS
    from psgrid.psserver.state.membership import MAX_MEMBERS
    from psgrid.psserver.state.policy import MAX_DEPARTED

    service = _service()
    shard = service.shard
    for worker in range(MAX_MEMBERS):
        service.register(spec_hash="", worker_id=worker, start_clock=-1, host="h" * MAX_HOST_CHARS)
    with shard.cond:  # as many departed as a shard remembers, each with a wait of its own
        shard.policy.departed.update((2**30 + w, 2**40) for w in range(MAX_DEPARTED))
        waits = shard.counters.wait_s_by_worker
        waits.update((w, 1.5) for w in [*range(MAX_MEMBERS), *shard.policy.departed])
    stats = service.stats()
    members = [ps_pb2.MemberInfo(**m) for m in stats.pop("members")]
    reply = ps_pb2.StatsReply(members=members, waits=[ps_pb2.WorkerWait(**w) for w in stats.pop("waits")], **stats)
    assert reply.ByteSize() < 4 * 2**20, reply.ByteSize()


def test_a_departed_worker_forgotten_takes_its_wait_time_with_it(monkeypatch):
    from psgrid.psserver.state import policy

    monkeypatch.setattr(policy, "MAX_DEPARTED", 2)
    service = _service()
    shard = service.shard
    for worker in range(5):
        service.register(spec_hash="", worker_id=worker, start_clock=-1, host="h")
        with shard.cond:
            shard.counters.wait_s_by_worker[worker] = 0.5  # as a pull that waited records it
        service.heartbeat(worker_id=worker, leaving=True)
    assert sorted(shard.policy.departed) == [3, 4]
    assert sorted(w["worker_id"] for w in service.stats()["waits"]) == [3, 4]
