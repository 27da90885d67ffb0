"""WeightRing without a shard: the ring's bound, which buffer an update takes back, and what the marks table may say."""

from __future__ import annotations

import numpy as np
import pytest

from psgrid.psserver import shared_memory
from psgrid.psserver.protocol import NO_MARK, REVOKED
from psgrid.psserver.state.weight_ring import MAX_SHARED_READERS, MAX_VERSIONS, NOT_GIVEN, WeightRing


def update(ring: WeightRing) -> int:
    """What a shard does per update: write a spare buffer, make it current."""
    target = ring.spare()
    assert target != ring.current
    ring.publish(target)
    return target


@pytest.mark.parametrize("shared", [False, True])
def test_readers_that_never_let_go_hold_the_ring_at_its_cap(shared):
    if shared and not shared_memory.can_share_read_only():
        pytest.skip("this kernel cannot seal weights read-only")
    ring = WeightRing(16, shared=shared)
    try:
        slots = []
        for _ in range(100):
            slots.append(ring.take_slot())
            ring.mark(slots[-1])  # held for ever
            update(ring)
            assert len(ring.arrays) <= MAX_VERSIONS
        assert len(ring.arrays) == MAX_VERSIONS
        # Each update past the cap took back the oldest version: its one reader reads REVOKED.
        assert ring.revoked == 100 - (MAX_VERSIONS - 1)
        assert (ring.marks[slots[: ring.revoked]] == REVOKED).all()
        held = ring.marks[slots[ring.revoked :]]
        assert len(set(held.tolist())) == len(held) == MAX_VERSIONS - 1  # the newest versions, one each
    finally:
        ring.close()


def test_the_buffer_taken_back_is_the_one_handed_out_longest_ago_never_one_lent_or_current():
    ring = WeightRing(4, shared=False)
    first = ring.take_slot()
    ring.mark(first)  # buffer 0, the oldest version
    ring.lend()  # ... also lent in-process: never taken back
    for _ in range(MAX_VERSIONS - 1):
        ring.mark(ring.take_slot())
        update(ring)
    assert len(ring.arrays) == MAX_VERSIONS
    oldest_not_lent = min((i for i in range(MAX_VERSIONS) if i and i != ring.current), key=ring.published.__getitem__)
    assert update(ring) == oldest_not_lent
    assert ring.marks[first] == 0 and ring.revoked == 1


def test_a_reader_done_with_its_copy_frees_its_buffer_without_a_revocation():
    ring = WeightRing(4, shared=False)
    slot = ring.take_slot()
    for _ in range(50):
        index = ring.mark(slot)
        update(ring)
        assert ring.marks[slot] == index  # still its own: its copy is intact
        ring.marks[slot] = NO_MARK  # what the reader writes when done
    assert len(ring.arrays) <= 3 and ring.revoked == 0


def test_garbage_in_the_marks_table_holds_nothing():
    ring = WeightRing(4, shared=False)
    rng = np.random.default_rng(0)
    values = np.array(
        [-(1 << 63), (1 << 63) - 1, -7, REVOKED, NO_MARK, NOT_GIVEN, 0, 1, 2, MAX_VERSIONS, 1 << 40], np.int64
    )
    for _ in range(200):
        ring.marks[:] = rng.choice(values, MAX_SHARED_READERS)  # written by a peer, any slot, any time
        update(ring)
    assert len(ring.arrays) == 2 and ring.revoked == 0  # nothing the shard handed out is held


def test_a_slot_another_peer_overwrites_no_longer_holds_its_buffer():
    ring = WeightRing(4, shared=False)
    slot = ring.take_slot()
    index = ring.mark(slot)
    ring.marks[slot] = index + 1  # someone else's garbage: the reader will see it and read again
    update(ring)
    assert update(ring) == index  # reused at once: the slot no longer says what it was given


def test_a_freed_slot_forgets_what_it_held():
    ring = WeightRing(4, shared=False)
    slot = ring.take_slot()
    index = ring.mark(slot)
    ring.free_slot(slot)
    ring.marks[slot] = index  # a peer writes into the free slot
    update(ring)
    assert update(ring) == index and ring.given[slot] == NOT_GIVEN


# ----- in-process readers: lending -------------------------------------------------------------


def test_a_lent_buffer_is_never_written_and_is_reused_once_given_back():
    ring = WeightRing(4, shared=False)
    lent = ring.lend()
    assert lent == ring.current and ring.lent_buffers() == 1
    ring.lend()  # a second sender of the same version: still one buffer
    assert ring.lent_buffers() == 1
    written = {update(ring) for _ in range(20)}
    assert lent not in written  # twenty versions, none written over the lent one
    ring.give_back(lent)
    assert lent not in {update(ring) for _ in range(3)}  # one loan is still out
    ring.give_back(lent)
    assert ring.lent_buffers() == 0
    assert lent in {update(ring) for _ in range(3)}  # free again: reused, no growth
    assert len(ring.arrays) == 3


def test_a_buffer_given_back_that_was_not_lent_is_refused():
    ring = WeightRing(4, shared=False)
    with pytest.raises(ValueError, match="not lent"):
        ring.give_back(ring.current)
    index = ring.lend()
    ring.give_back(index)
    with pytest.raises(ValueError, match="not lent"):
        ring.give_back(index)  # twice: it would be written while its first reader reads
    assert ring.lent == [0] * len(ring.arrays)


def test_lending_every_buffer_grows_the_ring_past_its_cap_rather_than_write_a_lent_one():
    ring = WeightRing(4, shared=False)
    lent = []
    for _ in range(MAX_VERSIONS + 2):
        lent.append(ring.lend())
        update(ring)
        assert ring.current not in lent
    assert len(ring.arrays) == MAX_VERSIONS + 3 and ring.revoked == 0
    for index in lent:
        ring.give_back(index)
    assert len({update(ring) for _ in range(5)}) == 2  # back to the current one and one to write


# ----- versions kept for delay compensation ----------------------------------------------------


def test_a_version_is_found_until_its_buffer_is_written_again():
    ring = WeightRing(4, shared=False)
    ring.publish(ring.current, 0)
    for version in range(1, 4):
        ring.publish(ring.spare(), version)
    assert ring.find(3) == ring.current
    assert ring.find(0) is None  # two buffers: versions 2 and 3 only
    assert ring.find(2) is not None and ring.find(-1) is None


def test_spare_keeping_never_takes_the_buffer_read_nor_a_kept_version_while_others_are_free():
    ring = WeightRing(4, shared=False, keep_versions=3)
    ring.publish(ring.current, 0)
    for version in range(1, 12):
        pulled = ring.find(version - 3)  # the version a stale gradient came from, if held
        target = ring.spare_keeping(pulled, version - 3)
        assert target != pulled and target != ring.current
        kept = [ring.find(v) for v in range(max(0, version - 3), version)]
        assert target not in kept  # the last versions stay, to compensate the next ones
        ring.publish(target, version)
    assert all(ring.find(v) is not None for v in range(8, 12))
    assert len(ring.arrays) <= MAX_VERSIONS + 3


def test_at_the_cap_kept_versions_give_way_before_a_readers_buffer_is_taken_back():
    ring = WeightRing(4, shared=False, keep_versions=2)
    ring.publish(ring.current, 0)
    slot = ring.take_slot()
    read = ring.mark(slot)  # version 0, held by a reader in another process
    for version in range(1, 40):
        ring.publish(ring.spare_keeping(None, 0), version)  # keep every version: none is spare
    assert len(ring.arrays) == ring.max_versions
    assert ring.marks[slot] == read and ring.revoked == 0  # the oldest kept versions went first


# ----- readers in other processes: slots -------------------------------------------------------


def test_every_slot_taken_is_a_clear_error_and_a_freed_one_is_taken_again():
    ring = WeightRing(4, shared=False)
    slots = [ring.take_slot() for _ in range(MAX_SHARED_READERS)]
    assert sorted(slots) == list(range(MAX_SHARED_READERS)) and ring.peak_readers == MAX_SHARED_READERS
    with pytest.raises(ValueError, match="slots are taken"):
        ring.take_slot()
    ring.free_slot(slots[7])
    assert ring.take_slot() == slots[7]


@pytest.mark.parametrize("slot", [5, -1, MAX_SHARED_READERS])
def test_a_slot_freed_that_is_not_taken_is_refused(slot):
    ring = WeightRing(4, shared=False)
    taken = ring.take_slot()
    if slot == 5:
        slot = taken
        ring.free_slot(taken)  # twice: it would go to two readers
    free = list(ring.free_slots)
    with pytest.raises(ValueError, match="not taken"):
        ring.free_slot(slot)
    assert ring.free_slots == free
    assert len({ring.take_slot() for _ in range(3)}) == 3


def test_a_private_ring_has_no_files_to_hand_out():
    ring = WeightRing(4, shared=False)
    assert ring.marks_fd == -1
    with pytest.raises(ValueError, match="not in shared memory"):
        ring.reader_fd(0)


# ----- the shard's lending to senders (snapshots.py) -------------------------------------------


def test_a_shard_lends_at_most_max_lent_buffers_and_sends_a_pooled_copy_past_them():
    from psgrid.psserver.config import ServerConfig
    from psgrid.psserver.spec import ModelSpec
    from psgrid.psserver.state.shard import MAX_LENT_BUFFERS, Shard

    spec = ModelSpec([("w", (6,))])
    shard = Shard(ServerConfig(mode="async", shared_memory=False))
    shard.init(spec, np.zeros(6, np.float32))
    worker = shard.register(spec.hash(), -1, -1, "here")["worker_id"]
    sent = []
    for clock in range(MAX_LENT_BUFFERS + 2):
        version, values = shard.snapshot()
        sent.append((version, values, values.copy()))
        grad = shard.pool.take()
        grad[:] = 1.0
        shard.push(worker, clock, version, grad, 24)
        shard.pool.give(grad)
    lent = [v for _, v, _ in sent if any(v is a for a in shard.ring.arrays)]
    assert len(lent) == MAX_LENT_BUFFERS and shard.ring.lent_buffers() == MAX_LENT_BUFFERS
    assert len(shard.ring.arrays) <= 2 + MAX_LENT_BUFFERS
    for version, values, copy in sent:  # every sender read its version whole, lent or copied
        np.testing.assert_array_equal(values, copy)
        np.testing.assert_allclose(copy, np.full(6, -shard.config.lr * version, np.float32), rtol=1e-6)
    for _, values, _ in sent:
        shard.release_snapshot(values)
    assert shard.ring.lent_buffers() == 0 and shard.pool.on_loan == 0
