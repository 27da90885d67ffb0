"""Pulls: the consistency wait, and lending the current version to a reader until it is sent.

A part of :class:`~psgrid.psserver.state.shard.Shard` with no state of its own: it uses the shard's
lock (``cond``), ring, pools, policy and counters.
"""

from __future__ import annotations

import time

import numpy as np

from psgrid.psserver.exceptions import Unavailable, WaitTimeout

# A pull over TCP or gRPC sends straight from the current version while at most this many buffers
# are lent so (each lent buffer may make the ring grow by one); past it, it sends a pooled copy.
MAX_LENT_BUFFERS = 2


class Snapshots:
    """The pull side of a shard: wait until a pull may read, then lend it a version (see weight_ring.py)."""

    def __init__(self, shard):
        self.shard = shard

    def wait_for_pull(self, worker: int, clock: int, timeout: float | None, cancelled=None) -> float:
        """Block until the policy lets ``worker`` pull at ``clock``; returns seconds waited.

        The wait also ends when the shard closes, and when ``cancelled()`` turns true (the
        caller went away), so no handler thread outlives its request.
        """
        shard = self.shard
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        with shard.cond:
            shard.require_serving()
            if worker >= 0:
                shard.require_live(worker)
                shard.members.renew(worker)
                shard.claims.pulled(worker, clock)
            while not shard.policy.may_pull(worker, clock):
                if shard.closing:
                    raise Unavailable(f"shard {shard.config.shard_index} is shutting down")
                if cancelled is not None and cancelled():
                    raise WaitTimeout("the caller cancelled the pull")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise WaitTimeout(
                        f"pull at clock {clock} still waiting for slower workers "
                        f"(slowest live clock {shard.policy.slowest_clock()})"
                    )
                shard.cond.wait(timeout=min(remaining, 1.0) if remaining is not None else 1.0)
            waited = time.monotonic() - start
            counters = shard.counters
            counters.wait_s_total += waited
            if worker >= 0:
                counters.wait_s_by_worker[worker] = counters.wait_s_by_worker.get(worker, 0.0) + waited
            shard.emit("wait", seconds=waited)
            return waited

    def snapshot(self, *, device: bool = False) -> tuple[int, np.ndarray]:
        """The version and this range's weights at that version, to send; hand them back with
        :meth:`release_snapshot` once sent.

        Usually the current buffer itself, lent (updates write other buffers meanwhile); when
        ``MAX_LENT_BUFFERS`` are lent already, a pooled copy, so slow senders cannot make the ring grow.
        A device shard's weights go out as a page-locked host copy, unless ``device``: a reader in this
        process (the in-process plane) may take the GPU buffer itself.
        """
        shard = self.shard
        with shard.cond:
            shard.require_serving()
            ring = shard.ring
            lendable = ring.lent_buffers() < MAX_LENT_BUFFERS or ring.lent[ring.current]
            if shard.arrays.on_gpu and not (device and lendable):  # host memory to send from
                values = shard.arrays.download(ring.weights, shard.landing_pool.take())
            elif lendable:
                values = ring.arrays[ring.lend()]
            else:
                values = shard.pool.take()
                np.copyto(values, ring.weights)
            self._count_pull()
            return shard.version, values

    def _count_pull(self) -> None:
        shard = self.shard
        shard.counters.pulls += 1
        shard.counters.bytes_out += shard.size * 4
        shard.emit("pull", nbytes=shard.size * 4)

    def mark_current(self, slot: int) -> tuple[int, int]:
        """Hand the current version to the reader in another process that holds ``slot``.

        Returns (version, buffer index); the reader reads that buffer of the ring in place and
        clears its mark when done (weight_ring.py). Call after :meth:`wait_for_pull`.
        """
        shard = self.shard
        with shard.cond:
            shard.require_serving()
            index = shard.ring.mark(slot)
            self._count_pull()
            return shard.version, index

    def device_ring(self):
        """The ring, if it is on a GPU (the IPC plane's calls); refused otherwise."""
        shard = self.shard
        with shard.cond:
            shard.require_serving()
            if not shard.arrays.on_gpu:
                raise Unavailable(
                    f"shard {shard.config.shard_index} keeps its weights in host memory: use the "
                    f"shared-memory or a network plane"
                )
            return shard.ring

    def take_reader_slot(self) -> int:
        shard = self.shard
        with shard.cond:
            shard.require_serving()
            return shard.ring.take_slot()

    def free_reader_slot(self, slot: int) -> None:
        shard = self.shard
        with shard.cond:
            if shard.ring is not None:
                shard.ring.free_slot(slot)

    def release_snapshot(self, values: np.ndarray) -> None:
        shard = self.shard
        with shard.cond:
            for index, array in enumerate(shard.ring.arrays):
                if array is values:
                    shard.ring.give_back(index)
                    return
        shard.landing_pool.give(values)
