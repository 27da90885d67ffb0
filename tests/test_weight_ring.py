"""WeightRing without a shard: the ring's bound, which buffer an update takes back, and what the marks table may say."""

from __future__ import annotations

import numpy as np
import pytest

from psgrid.psserver import shared_memory
from psgrid.psserver.transports.stream_frames import NO_MARK, REVOKED
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
            ring.mark(slots[-1])                 # held for ever
            update(ring)
            assert len(ring.arrays) <= MAX_VERSIONS
        assert len(ring.arrays) == MAX_VERSIONS
        # Each update past the cap took back the oldest version: its one reader reads REVOKED.
        assert ring.revoked == 100 - (MAX_VERSIONS - 1)
        assert (ring.marks[slots[:ring.revoked]] == REVOKED).all()
        held = ring.marks[slots[ring.revoked:]]
        assert len(set(held.tolist())) == len(held) == MAX_VERSIONS - 1     # the newest versions, one each
    finally:
        ring.close()


def test_the_buffer_taken_back_is_the_one_handed_out_longest_ago_never_one_lent_or_current():
    ring = WeightRing(4, shared=False)
    first = ring.take_slot()
    ring.mark(first)                             # buffer 0, the oldest version
    ring.lend()                                  # ... also lent in-process: never taken back
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
        assert ring.marks[slot] == index         # still its own: its copy is intact
        ring.marks[slot] = NO_MARK               # what the reader writes when done
    assert len(ring.arrays) <= 3 and ring.revoked == 0


def test_garbage_in_the_marks_table_holds_nothing():
    ring = WeightRing(4, shared=False)
    rng = np.random.default_rng(0)
    values = np.array([-(1 << 63), (1 << 63) - 1, -7, REVOKED, NO_MARK, NOT_GIVEN, 0, 1, 2, MAX_VERSIONS, 1 << 40],
                      np.int64)
    for _ in range(200):
        ring.marks[:] = rng.choice(values, MAX_SHARED_READERS)     # written by a peer, any slot, any time
        update(ring)
    assert len(ring.arrays) == 2 and ring.revoked == 0              # nothing the shard handed out is held


def test_a_slot_another_peer_overwrites_no_longer_holds_its_buffer():
    ring = WeightRing(4, shared=False)
    slot = ring.take_slot()
    index = ring.mark(slot)
    ring.marks[slot] = index + 1                 # someone else's garbage: the reader will see it and read again
    update(ring)
    assert update(ring) == index                 # reused at once: the slot no longer says what it was given


def test_a_freed_slot_forgets_what_it_held():
    ring = WeightRing(4, shared=False)
    slot = ring.take_slot()
    index = ring.mark(slot)
    ring.free_slot(slot)
    ring.marks[slot] = index                     # a peer writes into the free slot
    update(ring)
    assert update(ring) == index and ring.given[slot] == NOT_GIVEN
