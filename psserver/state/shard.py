"""One shard's state: its weight range, optimizer, clocks, members and counters.

This is where the pure policy (policy.py) meets threads: every state change
happens under one condition variable, and every change that could release a
waiting pull notifies it. Nothing here knows about transports: service.py checks what arrives from the wire
and calls these methods with validated values.

:class:`Shard` composes parts, each given what it uses by name rather than the shard. What every
part shares is the ``core`` (core.py: the locks, clock, settings, policy and counters, and whether
the shard is up); the range it serves is one holder, ``served`` (served_range.py: the spec and
bounds, weight ring and version, updater and pools). Each concept is a part of its own, holding its
own state: ``members`` (membership.py: joining, leases, evictions), ``snapshots`` (snapshots.py:
pulls), ``pushes`` (pushes.py: sync rounds and updates), ``checkpoints`` (shard_checkpoints.py:
capture, write, restore) and ``claims`` (claims.py: what a push may claim after a restart). Parts
are built in the order they depend on one another, so no two hold each other: checkpoints reads
the others' state and calls none of them; pushes tells checkpoints of each version; members
closes rounds and flushes checkpoints through the two calls it is given. The shard's public
methods are the calls service.py makes, each handed to its part.
"""

from __future__ import annotations

import math
import time

import numpy as np

from psgrid.psserver.config import ServerConfig
from psgrid.psserver.exceptions import InvalidArgument, SpecMismatch
from psgrid.psserver.kernels.parallel import Chunks, default_threads
from psgrid.psserver.protocol import PushResult, Reason, job_tag
from psgrid.psserver.sharding import shard_range
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.state import checkpoint_files
from psgrid.psserver.state.claims import Claims
from psgrid.psserver.state.core import ShardCore
from psgrid.psserver.state.device import shard_arrays
from psgrid.psserver.state.membership import Leases, Members
from psgrid.psserver.state.pushes import Pushes
from psgrid.psserver.state.served_range import ServedRange
from psgrid.psserver.state.shard_checkpoints import Checkpoints, RoundGrads
from psgrid.psserver.state.snapshots import MAX_LENT_BUFFERS, Snapshots

__all__ = ["MAX_LENT_BUFFERS", "Shard"]


def _read_from(part: str, name: str) -> property:
    """A read-only view of ``self.<part>.<name>``: what the shard's callers (service.py, the planes, tests) read."""
    return property(lambda self: getattr(getattr(self, part), name), doc=f"``{part}.{name}``")


class Shard:
    """The state of shard ``config.shard_index`` of ``config.num_shards``.

    Parameters
    ----------
    config : ServerConfig
    now : callable
        Monotonic clock; tests inject a fake one to expire leases.
    """

    def __init__(self, config: ServerConfig, now=time.monotonic, *, restore: bool = True):
        self.core = core = ShardCore(config, now)
        self.parts = Chunks(config.apply_threads or default_threads())  # the update's threads, over the range's parts
        # in host memory, or on a GPU (shard_device): the ring, optimizer and pools
        self.served = served = ServedRange(core, shard_arrays(config), self.parts)
        # Its parts, each with the state of its own concept and given what it uses (see the module's text),
        # built in the order they depend on one another.
        leases = Leases(config.lease_s)
        round_grads: RoundGrads = {}
        self.claims = Claims()
        self.checkpoints = Checkpoints(core, served, leases, round_grads, self.claims)
        self.pushes = Pushes(core, served, leases, self.claims, round_grads, self.checkpoints, self.parts)
        self.members = Members(
            core, served, leases, self.claims, close_rounds=self.pushes.close_rounds, flush=self.checkpoints.flush
        )
        self.snapshots = Snapshots(core, served, leases, self.claims)
        if config.checkpoint_dir:
            checkpoint_files.remove_leftovers(self.checkpoints.directory)
            if restore:
                self.checkpoints.restore()

    # What the shard's callers read: the core's ...
    config = _read_from("core", "config")
    now = _read_from("core", "now")
    cond = _read_from("core", "cond")
    policy = _read_from("core", "policy")
    counters = _read_from("core", "counters")
    listeners = _read_from("core", "listeners")
    # ... and the served range's.
    arrays = _read_from("served", "arrays")
    spec = _read_from("served", "spec")
    begin = _read_from("served", "begin")
    end = _read_from("served", "end")
    size = _read_from("served", "size")
    ring = _read_from("served", "ring")
    version = _read_from("served", "version")
    updater = _read_from("served", "updater")
    pool = _read_from("served", "pool")
    landing_pool = _read_from("served", "landing_pool")
    shares_memory = _read_from("served", "shares_memory")
    initialized = _read_from("served", "initialized")
    weights = _read_from("served", "weights")
    optimizer = _read_from("served", "optimizer")

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
            self.served.take_on(spec, begin, end, values, self.version)
            self.members.admit(spec.hash())
            self.cond.notify_all()
        self.checkpoints.first()
        return True

    def close(self) -> None:
        """The server is stopping: release every waiting pull (as UNAVAILABLE, so clients retry)."""
        with self.cond:
            self.core.closing = True
            self.cond.notify_all()

    def served_layout(self) -> tuple[int, int, int]:
        """(elements of the model, this range's first element, its length); refused until the shard serves."""
        with self.cond:
            self.served.require_serving()
            return self.spec.size, self.begin, self.size

    def layout_info(self) -> dict:
        """Version, range and whether weights are set, read together (what an observer learns)."""
        with self.cond:
            self.core.require_up()
            return self.served.layout_fields()

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
        flag=None,
    ) -> tuple[PushResult, bool]:
        return self.pushes.push(
            worker, clock, version_used, grad, nbytes, borrowed=borrowed, checked=checked, flag=flag
        )

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
                "momentum": float(getattr(self.optimizer, self.config.momentum_key, 0.0)),
                "lr": self.config.lr
                * (self.updater.schedule.factor(self.pushes.schedule_clock()) if self.updater else 1.0),
                "checkpoint": self.checkpoints.last,
                "initialized": self.initialized,
                "total_size": self.spec.size if self.spec else 0,
                "job_tag": job_tag(self.config.job_id),
                "waits": [{"worker_id": w, "seconds": s} for w, s in sorted(c.wait_s_by_worker.items())],
            }

    def checksum(self) -> float:
        with self.cond:
            return math.fsum(self.arrays.download(self.weights).astype(np.float64)) if self.initialized else 0.0
