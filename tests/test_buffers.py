"""BufferPool without a shard: buffers are reused, never held twice, and a wrong give-back is refused."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from psgrid.psserver.state.buffers import BufferPool


def test_a_buffer_given_back_is_the_next_one_taken_so_the_steady_state_allocates_nothing():
    pool = BufferPool(10)
    first = pool.take()
    assert first.shape == (10,) and first.dtype == np.float32 and pool.on_loan == 1
    pool.give(first)
    assert pool.on_loan == 0
    again = pool.take()
    assert again is first
    second = pool.take()  # none free: a new one
    assert second is not first and pool.on_loan == 2


def test_a_pool_keeps_its_dtype():
    pool = BufferPool(6, np.uint16)
    buf = pool.take()
    assert buf.dtype == np.uint16 and buf.shape == (6,)
    pool.give(buf)


def test_a_buffer_given_back_twice_is_refused_and_never_handed_to_two_holders():
    pool = BufferPool(4)
    a, b = pool.take(), pool.take()
    pool.give(a)
    pool.give(b)
    with pytest.raises(ValueError, match="none on loan"):
        pool.give(a)
    assert pool.on_loan == 0 and len(pool.free) == 2
    assert pool.take() is not pool.take()


@pytest.mark.parametrize(
    "foreign",
    [np.zeros(5, np.float32), np.zeros(4, np.float64), np.zeros((2, 2), np.float32)],
    ids=["size", "dtype", "shape"],
)
def test_a_buffer_not_of_the_pool_is_refused(foreign):
    pool = BufferPool(4)
    pool.take()
    with pytest.raises(ValueError, match="given back to a pool"):
        pool.give(foreign)
    assert pool.on_loan == 1 and pool.free == []


def test_threads_taking_and_giving_never_share_a_buffer():
    pool = BufferPool(64)
    shared: list[str] = []

    def use(me: int) -> None:
        for _ in range(500):
            buf = pool.take()
            buf[:] = me
            if not (buf == me).all():  # another holder wrote it meanwhile
                shared.append(f"thread {me}")
            pool.give(buf)

    threads = [threading.Thread(target=use, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads)
    assert shared == [] and pool.on_loan == 0 and len(pool.free) <= 4
