"""One shard's state: its weight range, optimizer, clocks, members and counters.

This is where the pure policy (policy.py) meets threads: every state change
happens under one condition variable, and every change that could release a
waiting pull notifies it. Nothing here knows about transports: service.py checks what arrives from the wire
and calls these methods with validated values.

:class:`Shard` holds what every part shares (the lock, the policy, the served range: its ring,
version, updater and pools, the counters) and the rules every call shares (is the shard serving, is
a worker live). Each concept is a part of its own, holding its own state: ``members``
(membership.py: joining, leases, evictions), ``snapshots`` (snapshots.py: pulls), ``pushes``
(pushes.py: sync rounds and updates), ``checkpoints`` (shard_checkpoints.py: capture, write, restore)
and ``claims`` (claims.py: what a push may claim after a restart). The shard's public methods are
the calls service.py makes, each handed to its part.
"""

from __future__ import annotations

import logging
import math
import threading
import time

import numpy as np

from psgrid.psserver import shared_memory
from psgrid.psserver.config import ServerConfig
from psgrid.psserver.exceptions import InvalidArgument, NotInitialized, SpecMismatch, Unavailable, UnknownWorker
from psgrid.psserver.kernels.parallel import Chunks, default_threads
from psgrid.psserver.protocol import PushResult, Reason, job_tag
from psgrid.psserver.sharding import shard_range
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.state import checkpoint_files
from psgrid.psserver.state.buffers import BufferPool
from psgrid.psserver.state.claims import Claims
from psgrid.psserver.state.counters import Counters
from psgrid.psserver.state.device import shard_arrays
from psgrid.psserver.state.membership import Members
from psgrid.psserver.state.policy import ConsistencyPolicy
from psgrid.psserver.state.pushes import Pushes
from psgrid.psserver.state.shard_checkpoints import Checkpoints
from psgrid.psserver.state.snapshots import MAX_LENT_BUFFERS, Snapshots
from psgrid.psserver.state.updater import Updater, make_updater
from psgrid.psserver.state.weight_ring import WeightRing

__all__ = ["MAX_LENT_BUFFERS", "Shard"]

log = logging.getLogger("psgrid.shard")


class Shard:
    """The state of shard ``config.shard_index`` of ``config.num_shards``.

    Parameters
    ----------
    config : ServerConfig
    now : callable
        Monotonic clock; tests inject a fake one to expire leases.
    """

    def __init__(self, config: ServerConfig, now=time.monotonic, *, restore: bool = True):
        self.config = config
        self.now = now
        self.arrays = shard_arrays(config)  # host memory, or a GPU (shard_device): the ring, optimizer and pools
        self.cond = threading.Condition()
        # async: an update is computed outside ``cond`` (weights are never changed in place, so pulls
        # and everything else go on meanwhile); updates queue on this lock, taken before ``cond``.
        self.apply_lock = threading.Lock()
        self.policy = ConsistencyPolicy(config.mode, config.staleness, config.backup_workers)
        self.parts = Chunks(config.apply_threads or default_threads())  # the update's threads, over the range's parts
        self.counters = Counters()
        self.spec: ModelSpec | None = None
        self.begin = self.end = 0
        self.ring: WeightRing | None = None  # the weights: versions readers hold, and the current one
        self.shares_memory = True  # False once this process could not put the weights in shared memory
        self.updater: Updater | None = None  # the optimizer and how a gradient makes the next version (at Init)
        self.version = 0
        self.pool: BufferPool | None = None  # range-sized buffers where the arrays live (rounds, updates)
        self.landing_pool: BufferPool | None = None  # ... in host memory, for network payloads (host shard: same)
        self.closing = False  # set by close(): waits end, new calls are refused
        self.restoring = False  # set while a checkpoint is loaded: calls are refused as UNAVAILABLE
        self.listeners: list = []  # callables(event: str, **fields) for metrics exporters
        # Its parts, each with the state of its own concept (see the module's text).
        self.claims = Claims()
        self.members = Members(self, config.lease_s)
        self.snapshots = Snapshots(self)
        self.pushes = Pushes(self)
        self.checkpoints = Checkpoints(self)
        if config.checkpoint_dir:
            checkpoint_files.remove_leftovers(self.checkpoints.directory)
            if restore:
                self.checkpoints.restore()

    # ----- helpers ----------------------------------------------------------------------------

    @property
    def initialized(self) -> bool:
        return self.ring is not None

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

    def _new_ring(self, values: np.ndarray, version: int, updater: Updater) -> None:
        """Hold ``values`` (at ``version``) as the weights, in shared memory when readers on this host may map them.

        Where this process may not make the shared files (a file-size limit), in private memory:
        said once, and the shared-memory plane is no longer offered (the network planes serve).
        """
        shared = self.shares_memory and self.config.shared_memory and shared_memory.can_share_read_only()
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
                self.config.shard_index,
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
        updater = make_updater(
            self.config,
            self.arrays,
            end - begin,
            stale=not self.policy.accumulates,
            parts=self.parts,
            live_workers=lambda: len(self.policy.clocks),
        )
        if optimizer_state is not None:
            with self.arrays.use():
                updater.optimizer.load_state_dict(optimizer_state)
        pool, landing_pool = self._new_pools(end - begin)
        self._new_ring(values, version, updater)
        self.spec, self.begin, self.end = spec, begin, end
        self.updater, self.pool, self.landing_pool = updater, pool, landing_pool

    def _new_pools(self, size: int) -> tuple[BufferPool, BufferPool]:
        """Range-sized buffers where the arrays live, and those network payloads land in (the same on a host shard)."""
        pool = BufferPool(size, make=self.arrays.empty)
        return pool, BufferPool(size, make=self.arrays.landing) if self.arrays.on_gpu else pool

    @property
    def size(self) -> int:
        return self.end - self.begin

    def emit(self, event: str, **fields) -> None:
        """Tell the metrics exporters (``listeners``) of ``event``."""
        for listener in self.listeners:
            listener(event, **fields)

    def require_serving(self) -> None:
        """Data calls: refused while the shard stops or restores (clients retry), and before Init."""
        if self.closing or self.restoring:
            self.require_up()
        if self.ring is None:
            self.require_initialized()

    def require_up(self) -> None:
        if self.closing:
            raise Unavailable(f"shard {self.config.shard_index} is shutting down")
        if self.restoring:
            raise Unavailable(f"shard {self.config.shard_index} is restoring its checkpoint", Reason.RESTORING)

    def require_initialized(self) -> None:
        if not self.initialized:
            raise NotInitialized("shard has no weights yet: a worker must call Init first")

    def require_live(self, worker: int) -> None:
        if not self.policy.is_live(worker):
            raise UnknownWorker(
                f"worker {worker} is unknown or was evicted from shard {self.config.shard_index}; register again"
            )

    def reject(self) -> None:
        with self.cond:
            self.counters.rejected += 1

    # ----- init -------------------------------------------------------------------------------

    def check_spec(self, spec: ModelSpec) -> None:
        """Refuse, before its payload is read, an Init of a spec other than the job's."""
        with self.cond:
            self._check_spec(spec)

    def _check_spec(self, spec: ModelSpec) -> None:
        if self.spec is not None and spec.hash() != self.spec.hash():
            raise SpecMismatch("Init with a model spec other than the one this shard holds")

    def layout(self, spec: ModelSpec) -> tuple[int, int]:
        return shard_range(spec.size, self.config.shard_index, self.config.num_shards)

    def init(self, spec: ModelSpec, values: np.ndarray | None) -> bool:
        """Set the initial weights of this shard's range; False if it already had them (same spec)."""
        with self.cond:
            self._check_spec(spec)
            if self.spec is not None:
                return False
            begin, end = self.layout(spec)
            if values is None or values.shape != (end - begin,):
                raise InvalidArgument(f"Init must cover this shard's range [{begin}, {end})", Reason.BAD_SIZE)
            self.take_on(spec, begin, end, values, self.version)
            self.members.admit(spec.hash())
            self.cond.notify_all()
            return True

    def close(self) -> None:
        """The server is stopping: release every waiting pull (as UNAVAILABLE, so clients retry)."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()

    def served_layout(self) -> tuple[int, int, int]:
        """(elements of the model, this range's first element, its length); refused until the shard serves."""
        with self.cond:
            self.require_serving()
            return self.spec.size, self.begin, self.size

    def layout_info(self) -> dict:
        """Version, range and whether weights are set, read together (what an observer learns)."""
        with self.cond:
            self.require_up()
            return self.layout_fields()

    def layout_fields(self) -> dict:
        return {
            "version": self.version,
            "begin": self.begin,
            "end": self.end,
            "initialized": self.initialized,
            "total_size": self.spec.size if self.spec is not None else 0,
        }

    # ----- the calls service.py makes, each handed to its part --------------------------------

    def register(self, spec_hash: str, worker_id: int, start_clock: int, host: str) -> dict:
        return self.members.register(spec_hash, worker_id, start_clock, host)

    def heartbeat(self, worker: int) -> bool:
        return self.members.heartbeat(worker)

    def leave(self, worker: int) -> None:
        self.members.leave(worker)

    def mark_gone(self, worker: int) -> None:
        self.members.mark_gone(worker)

    def evict_expired(self) -> list[int]:
        return self.members.evict_expired()

    def evict_stalled(self) -> list[int]:
        return self.members.evict_stalled()

    def wait_for_pull(self, worker: int, clock: int, timeout: float | None, cancelled=None) -> float:
        return self.snapshots.wait_for_pull(worker, clock, timeout, cancelled)

    def snapshot(self, *, device: bool = False) -> tuple[int, np.ndarray]:
        return self.snapshots.snapshot(device=device)

    def release_snapshot(self, values: np.ndarray) -> None:
        self.snapshots.release_snapshot(values)

    def mark_current(self, slot: int) -> tuple[int, int]:
        return self.snapshots.mark_current(slot)

    def take_reader_slot(self) -> int:
        return self.snapshots.take_reader_slot()

    def free_reader_slot(self, slot: int) -> None:
        self.snapshots.free_reader_slot(slot)

    def device_ring(self):
        return self.snapshots.device_ring()

    def check_pusher(self, worker: int) -> None:
        self.pushes.check_pusher(worker)

    def push(
        self,
        worker: int,
        clock: int,
        version_used: int,
        grad: np.ndarray,
        nbytes: int,
        *,
        borrowed: bool = False,
        checked: bool = False,
    ) -> tuple[PushResult, bool]:
        return self.pushes.push(worker, clock, version_used, grad, nbytes, borrowed=borrowed, checked=checked)

    def checkpoint(self) -> tuple[str, int]:
        return self.checkpoints.write_now()

    def checkpoint_if_due(self) -> None:
        self.checkpoints.if_due()

    def begin_restore(self) -> None:
        self.checkpoints.begin_restore()

    def restore(self) -> bool:
        return self.checkpoints.restore()

    # ----- stats ------------------------------------------------------------------------------

    def stats(self) -> dict:
        with self.cond:
            now = self.now()
            c = self.counters
            members = [
                {"worker_id": w, "clock": self.policy.clocks.get(w, -1), "idle_s": now - m.last_seen, "host": m.host}
                for w, m in sorted(self.members.leases.members.items())
            ]
            return {
                "shard_index": self.config.shard_index,
                "num_shards": self.config.num_shards,
                "mode": self.config.mode,
                "version": self.version,
                "begin": self.begin,
                "end": self.end,
                "members": members,
                "min_clock": self.policy.slowest_clock(),
                "max_clock": self.policy.fastest_clock(),
                "pushes": c.pushes,
                "pulls": c.pulls,
                "bytes_in": c.bytes_in,
                "bytes_out": c.bytes_out,
                "applied_updates": c.applied_updates,
                "dropped_late": c.dropped_late,
                "duplicates": c.duplicates,
                "evictions": c.evictions,
                "rejected": c.rejected,
                "staleness_counts": list(c.staleness_counts),
                "departed": sorted(self.policy.departed),
                "lost_updates": c.lost_updates,
                "restored_version": self.claims.restored_version,
                "stalled_evictions": c.stalled_evictions,
                "revoked_reads": self.ring.revoked if self.ring is not None else 0,
                "mean_staleness": c.staleness_sum / c.staleness_n if c.staleness_n else 0.0,
                "max_staleness": c.max_staleness,
                "wait_s_total": c.wait_s_total,
                "uncompensated_updates": c.uncompensated,
                "momentum": float(getattr(self.optimizer, "momentum", 0.0)),
                "checkpoint": self.checkpoints.last,
                "initialized": self.initialized,
                "total_size": self.spec.size if self.spec else 0,
                "job_tag": job_tag(self.config.job_id),
                "waits": [{"worker_id": w, "seconds": s} for w, s in sorted(c.wait_s_by_worker.items())],
            }

    def checksum(self) -> float:
        with self.cond:
            return math.fsum(self.arrays.download(self.weights).astype(np.float64)) if self.initialized else 0.0
