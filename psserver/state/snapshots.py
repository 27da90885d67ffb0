"""Pulls: the consistency wait, and lending the current version to a reader until it is sent.

A mixin of :class:`~psgrid.psserver.state.shard.Shard`: its methods use the shard's lock
(``cond``), ring, pool, policy and counters, and are called as the shard's own.
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

    def wait_for_pull(self, worker: int, clock: int, timeout: float | None, cancelled=None) -> float:
        """Block until the policy lets ``worker`` pull at ``clock``; returns seconds waited.

        The wait also ends when the shard closes, and when ``cancelled()`` turns true (the
        caller went away), so no handler thread outlives its request.
        """
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        with self.cond:
            self._require_serving()
            if worker >= 0:
                self._require_live(worker)
                self.leases.renew(worker, self.now())
                if self.restored_version >= 0 and worker not in self.first_pulls:
                    self.first_pulls[worker] = clock
            while not self.policy.may_pull(worker, clock):
                if self.closing:
                    raise Unavailable(f"shard {self.config.shard_index} is shutting down")
                if cancelled is not None and cancelled():
                    raise WaitTimeout("the caller cancelled the pull")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise WaitTimeout(f"pull at clock {clock} still waiting for slower workers "
                                      f"(slowest live clock {self.policy.slowest_clock()})")
                self.cond.wait(timeout=min(remaining, 1.0) if remaining is not None else 1.0)
            waited = time.monotonic() - start
            self.counters.wait_s_total += waited
            if worker >= 0:
                self.counters.wait_s_by_worker[worker] = self.counters.wait_s_by_worker.get(worker, 0.0) + waited
            self._emit("wait", seconds=waited)
            return waited

    def snapshot(self, *, device: bool = False) -> tuple[int, np.ndarray]:
        """The version and this range's weights at that version, to send; hand them back with
        :meth:`release_snapshot` once sent.

        Usually the current buffer itself, lent (updates write other buffers meanwhile); when
        ``MAX_LENT_BUFFERS`` are lent already, a pooled copy, so slow senders cannot make the ring grow.
        A device shard's weights go out as a page-locked host copy, unless ``device``: a reader in this
        process (the in-process plane) may take the GPU buffer itself.
        """
        with self.cond:
            self._require_serving()
            lendable = self.ring.lent_buffers() < MAX_LENT_BUFFERS or self.ring.lent[self.ring.current]
            if self.arrays.on_gpu and not (device and lendable):     # host memory to send from
                values = self.arrays.download(self.ring.weights, self.landing_pool.take())
            elif lendable:
                values = self.ring.arrays[self.ring.lend()]
            else:
                values = self.pool.take()
                np.copyto(values, self.ring.weights)
            self._count_pull()
            return self.version, values

    def _count_pull(self) -> None:
        self.counters.pulls += 1
        self.counters.bytes_out += self.size * 4
        self._emit("pull", nbytes=self.size * 4)

    def mark_current(self, slot: int) -> tuple[int, int]:
        """Hand the current version to the reader in another process that holds ``slot``.

        Returns (version, buffer index); the reader reads that buffer of the ring in place and
        clears its mark when done (weight_ring.py). Call after :meth:`wait_for_pull`.
        """
        with self.cond:
            self._require_serving()
            index = self.ring.mark(slot)
            self._count_pull()
            return self.version, index

    def device_ring(self):
        """The ring, if it is on a GPU (the IPC plane's calls); refused otherwise."""
        with self.cond:
            self._require_serving()
            if not self.arrays.on_gpu:
                raise Unavailable(f"shard {self.config.shard_index} keeps its weights in host memory: use the "
                                  f"shared-memory or a network plane")
            return self.ring

    def take_reader_slot(self) -> int:
        with self.cond:
            self._require_serving()
            return self.ring.take_slot()

    def free_reader_slot(self, slot: int) -> None:
        with self.cond:
            if self.ring is not None:
                self.ring.free_slot(slot)

    def release_snapshot(self, values: np.ndarray) -> None:
        with self.cond:
            for index, array in enumerate(self.ring.arrays):
                if array is values:
                    self.ring.give_back(index)
                    return
        self.landing_pool.give(values)
