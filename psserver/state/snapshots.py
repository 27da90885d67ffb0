"""Pulls: the consistency wait, and lending the current version to a reader until it is sent.

A part of :class:`~psgrid.psserver.state.shard.Shard` with no state of its own. It is given the
shard's ``core`` (its lock, policy and counters), the ``served`` range (the ring and pools it lends
from), the ``leases`` a pull renews and the ``claims`` a worker's first pull is recorded in.
"""

from __future__ import annotations

import time

import numpy as np

from psgrid.psserver.exceptions import Unavailable, WaitTimeout
from psgrid.psserver.state.claims import Claims
from psgrid.psserver.state.core import ShardCore
from psgrid.psserver.state.membership import Leases
from psgrid.psserver.state.served_range import ServedRange

# A pull over TCP or gRPC sends straight from the current version while at most this many buffers
# are lent so (each lent buffer may make the ring grow by one); past it, it sends a pooled copy.
MAX_LENT_BUFFERS = 2


class Snapshots:
    """The pull side of a shard: wait until a pull may read, then lend it a version (see weight_ring.py)."""

    def __init__(self, core: ShardCore, served: ServedRange, leases: Leases, claims: Claims):
        self.core = core
        self.served = served
        self.leases = leases
        self.claims = claims

    def wait_for_pull(self, worker: int, clock: int, timeout: float | None, cancelled=None) -> float:
        """Block until the policy lets ``worker`` pull at ``clock``; returns seconds waited.

        The wait also ends when the shard closes, and when ``cancelled()`` turns true (the
        caller went away), so no handler thread outlives its request.
        """
        core, policy = self.core, self.core.policy
        start = time.monotonic()
        deadline = None if timeout is None else start + timeout
        with core.cond:
            self.served.require_serving()
            if worker >= 0:
                core.require_live(worker)
                self.leases.renew(worker, core.now())
                self.claims.pulled(worker, clock)
            while not policy.may_pull(worker, clock):
                if core.closing:
                    raise Unavailable(f"shard {core.config.shard_index} is shutting down")
                if cancelled is not None and cancelled():
                    raise WaitTimeout("the caller cancelled the pull")
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise WaitTimeout(
                        f"pull at clock {clock} still waiting for slower workers "
                        f"(slowest live clock {policy.slowest_clock()})"
                    )
                core.cond.wait(timeout=min(remaining, 1.0) if remaining is not None else 1.0)
            waited = time.monotonic() - start
            counters = core.counters
            counters.wait_s_total += waited
            if worker >= 0:
                counters.wait_s_by_worker[worker] = counters.wait_s_by_worker.get(worker, 0.0) + waited
            core.emit("wait", seconds=waited)
            return waited

    def snapshot(self, *, device: bool = False) -> tuple[int, np.ndarray]:
        """The version and this range's weights at that version, to send; hand them back with
        :meth:`release_snapshot` once sent.

        Usually the current buffer itself, lent (updates write other buffers meanwhile); when
        ``MAX_LENT_BUFFERS`` are lent already, a pooled copy, so slow senders cannot make the ring grow.
        A device shard's weights go out as a page-locked host copy, unless ``device``: a reader in this
        process (the in-process plane) may take the GPU buffer itself.
        """
        served = self.served
        with self.core.cond:
            served.require_serving()
            ring, arrays = served.ring, served.arrays
            lendable = ring.lent_buffers() < MAX_LENT_BUFFERS or ring.lent[ring.current]
            if arrays.on_gpu and not (device and lendable):  # host memory to send from
                values = arrays.download(ring.weights, served.landing_pool.take())
            elif lendable:
                values = ring.arrays[ring.lend()]
            else:
                values = served.pool.take()
                np.copyto(values, ring.weights)
            self._count_pull()
            return served.version, values

    def _count_pull(self) -> None:
        nbytes = self.served.size * 4
        self.core.counters.pulls += 1
        self.core.counters.bytes_out += nbytes
        self.core.emit("pull", nbytes=nbytes)

    def mark_current(self, slot: int) -> tuple[int, int]:
        """Hand the current version to the reader in another process that holds ``slot``.

        Returns (version, buffer index); the reader reads that buffer of the ring in place and
        clears its mark when done (weight_ring.py). Call after :meth:`wait_for_pull`.
        """
        with self.core.cond:
            self.served.require_serving()
            index = self.served.ring.mark(slot)
            self._count_pull()
            return self.served.version, index

    def device_ring(self):
        """The ring, if it is on a GPU (the IPC plane's calls); refused otherwise."""
        with self.core.cond:
            self.served.require_serving()
            if not self.served.arrays.on_gpu:
                raise Unavailable(
                    f"shard {self.core.config.shard_index} keeps its weights in host memory: use the "
                    f"shared-memory or a network plane"
                )
            return self.served.ring

    def take_reader_slot(self) -> int:
        with self.core.cond:
            self.served.require_serving()
            return self.served.ring.take_slot()

    def free_reader_slot(self, slot: int) -> None:
        with self.core.cond:
            if self.served.ring is not None:
                self.served.ring.free_slot(slot)

    def release_snapshot(self, values: np.ndarray) -> None:
        with self.core.cond:
            ring = self.served.ring
            for index, array in enumerate(ring.arrays):
                if array is values:
                    ring.give_back(index)
                    return
        self.served.landing_pool.give(values)
