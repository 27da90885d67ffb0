"""A shard's parts built on their own, from the narrow pieces the shard gives them (no Shard)."""

from __future__ import annotations

import numpy as np
import pytest

from psgrid.psserver.config import ServerConfig
from psgrid.psserver.exceptions import NotInitialized, UnknownWorker
from psgrid.psserver.kernels.parallel import Chunks
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.state.claims import Claims
from psgrid.psserver.state.core import ShardCore
from psgrid.psserver.state.device import HostArrays
from psgrid.psserver.state.membership import Leases, Members
from psgrid.psserver.state.served_range import ServedRange
from psgrid.psserver.state.snapshots import MAX_LENT_BUFFERS, Snapshots


@pytest.fixture
def chunks():
    parts = Chunks(1)
    yield parts
    parts.close()


def members_alone(mode: str, now, chunks: Chunks):
    """Members with a core, an empty served range and its own leases and claims; what it calls is recorded."""
    core = ShardCore(ServerConfig(mode=mode, lease_s=5.0), now=now)
    calls: list = []
    members = Members(
        core,
        ServedRange(core, HostArrays(), chunks),
        Leases(core.config.lease_s),
        Claims(),
        close_rounds=lambda: calls.append(("close_rounds", sorted(core.policy.clocks))),
        flush=lambda: calls.append("flush"),
    )
    return core, members, calls


def test_members_evicts_an_expired_worker_and_releases_what_it_held(chunks):
    now = [0.0]
    core, members, calls = members_alone("sync", lambda: now[0], chunks)
    events = []
    core.listeners.append(lambda event, **fields: events.append((event, fields)))
    assert [members.register("", -1, -1, "h")["worker_id"] for _ in range(2)] == [0, 1]
    members.claims.restored(3, {0: 0, 1: 0})  # a restarted shard: each worker's first pull is remembered
    members.claims.pulled(0, 2)
    calls.clear()

    now[0] = 4.0
    assert members.heartbeat(1)
    now[0] = 6.0  # worker 0 last seen at 0: past its lease of 5 s; worker 1 at 4
    assert members.evict_expired() == [0]

    assert set(members.leases.members) == {1} and not core.policy.is_live(0)
    assert 0 not in members.claims.first_pulls
    # The rounds it held open may close once it is gone from the clocks; the checkpoint is written after.
    assert calls == [("close_rounds", [1]), "flush"]
    assert core.counters.evictions == 1 and events == [("eviction", {"worker": 0})]
    assert not members.heartbeat(0)


def test_members_admit_drops_those_that_registered_another_model(chunks):
    core, members, calls = members_alone("async", lambda: 0.0, chunks)
    job, other = "a" * 64, "b" * 64
    members.register(job, 0, -1, "h")
    members.register(other, 1, -1, "h")
    with core.cond:
        members.admit(job)
    assert core.policy.is_live(0) and not core.policy.is_live(1)
    assert members.spec_hashes == {}


def test_snapshots_lend_the_current_version_then_copy(chunks):
    core = ShardCore(ServerConfig(mode="async", shared_memory=False), now=lambda: 0.0)
    served = ServedRange(core, HostArrays(), chunks)
    leases, claims = Leases(5.0), Claims()
    snapshots = Snapshots(core, served, leases, claims)
    with pytest.raises(NotInitialized):
        snapshots.wait_for_pull(-1, 0, timeout=1.0)

    values = np.arange(6, dtype=np.float32)
    served.take_on(ModelSpec([("w", (6,))]), 0, 6, values, version=4)
    with pytest.raises(UnknownWorker):
        snapshots.wait_for_pull(7, 0, timeout=1.0)  # never joined
    core.policy.join(7)
    leases.add(7, "h", now=0.0)
    assert snapshots.wait_for_pull(7, 0, timeout=1.0) >= 0.0

    ring = served.ring
    taken = []
    for step in range(MAX_LENT_BUFFERS + 1):  # each pull takes a version, then an update publishes the next
        taken.append(snapshots.snapshot())
        index = ring.spare()
        ring.arrays[index][:] = values + step + 1
        with core.cond:
            served.publish(index)
    assert [version for version, _ in taken] == [4, 5, 6]
    assert all(np.array_equal(array, values + i) for i, (_, array) in enumerate(taken))
    # The first two are the ring's buffers, lent; past MAX_LENT_BUFFERS a pull gets a pooled copy.
    assert [any(array is buf for buf in ring.arrays) for _, array in taken] == [True, True, False]
    assert ring.lent_buffers() == MAX_LENT_BUFFERS and served.pool.on_loan == 1
    for _, array in taken:
        snapshots.release_snapshot(array)
    assert ring.lent_buffers() == 0 and served.pool.on_loan == 0
    assert core.counters.pulls == 3 and core.counters.bytes_out == 3 * 4 * 6
