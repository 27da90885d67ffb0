"""The range a shard serves: its spec and bounds, the weight ring and its version, the updater and the pools.

Set whole by an Init or a restore (:meth:`ServedRange.take_on`), and read through this one holder by
every part of the shard (pulls read the ring, pushes write the next version, checkpoints copy it);
all of it read and changed under the core's ``cond``.
"""

from __future__ import annotations

import logging

import numpy as np

from psgrid.psserver import shared_memory
from psgrid.psserver.exceptions import NotInitialized
from psgrid.psserver.kernels.parallel import Chunks
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.state.buffers import BufferPool
from psgrid.psserver.state.core import ShardCore
from psgrid.psserver.state.updater import Updater, make_updater
from psgrid.psserver.state.weight_ring import WeightRing

log = logging.getLogger("psgrid.shard")


class ServedRange:
    """The weights of ``[begin, end)`` of ``spec`` and what serves them; empty (no ring) before Init.

    Parameters
    ----------
    core : ShardCore
        Its settings and policy (the update a range takes on depends on the mode), and whether the shard is up.
    arrays : HostArrays or GpuArrays
        Where the ring, the optimizer's state and the pools live (state/device.py).
    parts : Chunks
        The update's threads, over the range's parts.
    """

    def __init__(self, core: ShardCore, arrays, parts: Chunks):
        self.core = core
        self.arrays = arrays
        self.parts = parts
        self.spec: ModelSpec | None = None
        self.begin = self.end = 0
        self.ring: WeightRing | None = None  # the weights: versions readers hold, and the current one
        self.version = 0
        self.shares_memory = True  # False once this process could not put the weights in shared memory
        self.updater: Updater | None = None  # the optimizer and how a gradient makes the next version
        self.pool: BufferPool | None = None  # range-sized buffers where the arrays live (rounds, updates)
        self.landing_pool: BufferPool | None = None  # ... in host memory, for network payloads (host shard: same)

    @property
    def initialized(self) -> bool:
        return self.ring is not None

    @property
    def size(self) -> int:
        return self.end - self.begin

    @property
    def weights(self) -> np.ndarray | None:
        """The current version of this range's weights (read only: updates write a new buffer).

        On a device shard, its own copy: readers map the ring's buffers through CUDA IPC, which can
        only map them writable, so the shard keeps the weights it updates and checkpoints apart
        and publishes a copy of each version (updater.py's DeviceUpdater).
        """
        if self.ring is None:
            return None
        return self.updater.weights(self.ring)

    @property
    def optimizer(self):
        """The range's optimizer (its state is checkpointed), None before Init."""
        return None if self.updater is None else self.updater.optimizer

    def require_serving(self) -> None:
        """Data calls: refused while the shard stops or restores (clients retry), and before Init."""
        if self.core.closing or self.core.restoring:
            self.core.require_up()
        if self.ring is None:
            self.require_initialized()

    def require_initialized(self) -> None:
        if not self.initialized:
            raise NotInitialized("shard has no weights yet: a worker must call Init first")

    def layout_fields(self) -> dict:
        """Version, range and whether weights are set (what a registration and an observer learn)."""
        return {
            "version": self.version,
            "begin": self.begin,
            "end": self.end,
            "initialized": self.initialized,
            "total_size": self.spec.size if self.spec is not None else 0,
        }

    def publish(self, index: int) -> None:
        """Make the ring's buffer ``index`` (the next version, just written) current (call under ``cond``)."""
        self.ring.publish(index, self.version + 1)
        self.version += 1

    def take_on(
        self,
        spec: ModelSpec,
        begin: int,
        end: int,
        values: np.ndarray,
        version: int,
        optimizer_state: dict | None = None,
    ) -> None:
        """Serve the range ``[begin, end)`` of ``spec`` from ``values`` at ``version`` (an Init, or a restore).

        Everything is built and checked before anything is published: the updater (its optimizer with
        its state from a checkpoint) and the pooled buffers first, then the weight ring, whose publication
        makes the shard serve. A setting or state that is refused, or memory that runs out, leaves the shard
        as it was: a refused Init leaves no half-built shard (weights and no optimizer), and the next Init
        is taken afresh.
        """
        policy = self.core.policy
        updater = make_updater(
            self.core.config,
            self.arrays,
            end - begin,
            stale=not policy.accumulates,
            parts=self.parts,
            live_workers=lambda: len(policy.clocks),
        )
        if optimizer_state is not None:
            with self.arrays.use():
                updater.optimizer.load_state_dict(optimizer_state)
        pool, landing_pool = self._new_pools(end - begin)
        self._new_ring(values, version, updater)
        self.spec, self.begin, self.end, self.version = spec, begin, end, version
        self.updater, self.pool, self.landing_pool = updater, pool, landing_pool

    def _new_pools(self, size: int) -> tuple[BufferPool, BufferPool]:
        """Range-sized buffers where the arrays live, and those network payloads land in (the same on a host shard)."""
        pool = BufferPool(size, make=self.arrays.empty)
        return pool, BufferPool(size, make=self.arrays.landing) if self.arrays.on_gpu else pool

    def _new_ring(self, values: np.ndarray, version: int, updater: Updater) -> None:
        """Hold ``values`` (at ``version``) as the weights, in shared memory when readers on this host may map them.

        Where this process may not make the shared files (a file-size limit), in private memory:
        said once, and the shared-memory plane is no longer offered (the network planes serve).
        """
        config = self.core.config
        shared = self.shares_memory and config.shared_memory and shared_memory.can_share_read_only()
        keep = updater.keep_versions
        if self.arrays.on_gpu:  # readers on this host map the buffers through CUDA IPC; only the marks are shared
            self.shares_memory = False
            ring = WeightRing(len(values), shared=shared, keep_versions=keep, device=self.arrays)
            master = updater.hold(values)
            with self.arrays.use():
                ring.weights[...] = master
            self.arrays.finished()
            self._set_ring(ring, version)
            return
        try:
            ring = WeightRing(len(values), shared=shared, keep_versions=keep)
        except OSError as exc:
            if not shared:
                raise
            log.warning(
                "shard %d keeps its weights in private memory, %s; workers on this host use the network plane",
                config.shard_index,
                shared_memory.refused(exc, values.nbytes),
            )
            self.shares_memory = False
            ring = WeightRing(len(values), shared=False, keep_versions=keep)
        np.copyto(ring.weights, values, casting="same_kind")
        self._set_ring(ring, version)

    def _set_ring(self, ring: WeightRing, version: int) -> None:
        ring.publish(ring.current, version)
        if self.ring is not None:
            self.ring.close()
        self.ring = ring
