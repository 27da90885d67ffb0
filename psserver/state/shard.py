"""One shard's state: its weight range, optimizer, clocks, members and counters.

This is where the pure policy (policy.py) meets threads: every state change
happens under one condition variable, and every change that could release a
waiting pull notifies it. Nothing here knows about transports: service.py checks what arrives from the wire
and calls these methods with validated values.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from psgrid.psserver.state import checkpoint
from psgrid.psserver.config import ServerConfig
from psgrid.psserver.kernels.compensation import DelayCompensation, effective_momentum
from psgrid.psserver.state.membership import Leases
from psgrid.psserver.state.buffers import BufferPool
from psgrid.psserver.exceptions import (CheckpointFailed, InvalidArgument, NotInitialized, SpecMismatch, Unavailable,
                                        UnknownWorker, WaitTimeout)
from psgrid.psserver.kernels.optim import make_optimizer
from psgrid.psserver.state.policy import ConsistencyPolicy
from psgrid.psserver.protocol import Outcome, PushResult, Reason, job_tag
from psgrid.psserver.sharding import shard_range
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.state.weight_ring import WeightRing
from psgrid.psserver import shared_memory
from psgrid.psserver.kernels.parallel import Chunks, default_threads

STALENESS_BUCKETS = 32
# A pull over TCP or gRPC sends straight from the current version while at most this many buffers
# are lent so (each lent buffer may make the ring grow by one); past it, it sends a pooled copy.
MAX_LENT_BUFFERS = 2
log = logging.getLogger("psserver")


@dataclass
class Counters:
    pushes: int = 0
    pulls: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    applied_updates: int = 0
    dropped_late: int = 0
    duplicates: int = 0
    evictions: int = 0
    stalled_evictions: int = 0     # of those, workers others waited on that made no progress
    lost_updates: int = 0          # known lost to a restart (see StatsReply.lost_updates)
    uncompensated: int = 0         # dc: stale updates applied as they came, their pulled version gone from the ring
    rejected: int = 0
    wait_s_total: float = 0.0
    wait_s_by_worker: dict[int, float] = field(default_factory=dict)
    staleness_counts: list[int] = field(default_factory=lambda: [0] * STALENESS_BUCKETS)
    staleness_sum: int = 0
    staleness_n: int = 0
    max_staleness: int = 0

    def record_staleness(self, s: int) -> None:
        self.staleness_counts[min(s, STALENESS_BUCKETS - 1)] += 1
        self.staleness_sum += s
        self.staleness_n += 1
        self.max_staleness = max(self.max_staleness, s)


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
        self.cond = threading.Condition()
        # async: an update is computed outside ``cond`` (weights are never changed in place, so pulls
        # and everything else go on meanwhile); updates queue on this lock, taken before ``cond``.
        self.apply_lock = threading.Lock()
        self.chunks = Chunks(config.apply_threads or default_threads())
        self.policy = ConsistencyPolicy(config.mode, config.staleness, config.backup_workers)
        self.leases = Leases(config.lease_s)
        self.counters = Counters()
        self.spec: ModelSpec | None = None
        self.member_hashes: dict[int, str] = {}  # before Init: the spec hash each member registered with
        self.begin = self.end = 0
        self.ring: WeightRing | None = None      # the weights: versions readers hold, and the current one
        self.shares_memory = True     # False once this process could not put the weights in shared memory
        self.optimizer = None
        # Staleness remedies (compensation.py); sync computes every gradient from the version it meets.
        self.lr_staleness = config.compensation == "lr"
        self.delay: DelayCompensation | None = None      # dc: made with the optimizer
        self.auto_momentum = config.async_momentum == "auto" and config.mode != "sync" and config.momentum > 0
        self.plain_steps = not self.auto_momentum and not (config.compensation == "dc" and config.mode != "sync")
        self.version = 0
        self.pool: BufferPool | None = None
        # sync: open round -> {worker: gradient}. Summed in worker order when the round closes,
        # so a sync run is bitwise reproducible whatever order the pushes arrive in.
        self.round_grads: dict[int, dict[int, np.ndarray]] = {}
        self.closing = False       # set by close(): waits end, new calls are refused
        self.restoring = False     # set while a checkpoint is loaded: calls are refused as UNAVAILABLE
        self.restored_version = -1
        # After a restore, what pushes made before it may claim (see _check_claims): each member's
        # clock in the checkpoint, and the clock of each worker's first pull from this process.
        self.restored_clocks: dict[int, int] = {}
        self.first_pulls: dict[int, int] = {}
        # Checkpoints: state is copied under the lock (_capture) and written outside it by the
        # thread whose update made one due, before that update is answered (_flush_capture).
        self.pending_capture: tuple[dict, dict] | None = None
        self.write_lock = threading.Lock()
        self.written_version = -1
        self.last_checkpoint = ""
        self.updates_since_checkpoint = 0
        self.last_checkpoint_time = now()
        self.listeners: list = []   # callables(event: str, **fields) for metrics exporters
        if config.checkpoint_dir:
            checkpoint.remove_leftovers(self._checkpoint_dir())
            if restore:
                self.restore()

    # ----- helpers ----------------------------------------------------------------------------

    @property
    def initialized(self) -> bool:
        return self.ring is not None

    @property
    def weights(self) -> np.ndarray | None:
        """The current version of this range's weights (read only: updates write a new buffer)."""
        return None if self.ring is None else self.ring.weights

    def _new_ring(self, values: np.ndarray, version: int) -> None:
        """Hold ``values`` (at ``version``) as the weights, in shared memory when readers on this host may map them.

        Where this process may not make the shared files (a file-size limit), in private memory:
        said once, and the shared-memory plane is no longer offered (the network planes serve).
        """
        shared = self.shares_memory and self.config.shared_memory and shared_memory.can_share_read_only()
        keep = self.config.dc_versions if not self.plain_steps and self.config.compensation == "dc" else 0
        try:
            ring = WeightRing(len(values), shared=shared, keep_versions=keep)
        except OSError as exc:
            if not shared:
                raise
            log.warning("shard %d keeps its weights in private memory, %s; workers on this host use the network "
                        "plane", self.config.shard_index, shared_memory.refused(exc, values.nbytes))
            self.shares_memory = False
            ring = WeightRing(len(values), shared=False, keep_versions=keep)
        np.copyto(ring.weights, values, casting="same_kind")
        ring.publish(ring.current, version)
        if self.ring is not None:
            self.ring.close()
        self.ring = ring

    def _new_optimizer(self) -> None:
        self.optimizer = make_optimizer(self.config.optimizer, self.size, chunks=self.chunks,
                                        **self.config.optimizer_hparams())
        if not self.plain_steps and self.config.compensation == "dc":
            self.delay = DelayCompensation(self.size, self.config.dc_lambda0, self.config.dc_beta)

    @property
    def size(self) -> int:
        return self.end - self.begin

    def _emit(self, event: str, **fields) -> None:
        for listener in self.listeners:
            listener(event, **fields)

    def _require_serving(self) -> None:
        """Data calls: refused while the shard stops or restores (clients retry), and before Init."""
        if self.closing or self.restoring:
            self._require_up()
        if self.ring is None:
            self._require_initialized()

    def _require_up(self) -> None:
        if self.closing:
            raise Unavailable(f"shard {self.config.shard_index} is shutting down")
        if self.restoring:
            raise Unavailable(f"shard {self.config.shard_index} is restoring its checkpoint", Reason.RESTORING)

    def _require_initialized(self) -> None:
        if not self.initialized:
            raise NotInitialized("shard has no weights yet: a worker must call Init first")

    def _require_live(self, worker: int) -> None:
        if not self.policy.is_live(worker):
            raise UnknownWorker(f"worker {worker} is unknown or was evicted from shard "
                                f"{self.config.shard_index}; register again")

    def reject(self) -> None:
        with self.cond:
            self.counters.rejected += 1

    # ----- membership -------------------------------------------------------------------------

    def register(self, spec_hash: str, worker_id: int, start_clock: int, host: str) -> dict:
        """Join (or rejoin) ``worker_id`` (-1: a new id); returns the join and the layout, read together."""
        try:
            if self.config.mode == "async":       # never between an async update and the push it takes
                with self.apply_lock:
                    return self._register(spec_hash, worker_id, start_clock, host)
            return self._register(spec_hash, worker_id, start_clock, host)
        finally:
            self._flush_capture()     # moving a worker forward may have closed a sync round

    def _register(self, spec_hash: str, worker_id: int, start_clock: int, host: str) -> dict:
        with self.cond:
            self._require_up()
            if spec_hash and self.spec is not None and spec_hash != self.spec.hash():
                raise SpecMismatch(f"model spec hash {spec_hash[:12]} differs from this shard's "
                                   f"{self.spec.hash()[:12]}: every worker must build the same model")
            if worker_id < 0:
                worker_id = self.leases.new_id(taken=self.policy.departed)
            before = self.policy.clocks.get(worker_id)
            clock = self.policy.join(worker_id, start_clock if start_clock >= 0 else None)
            if before is not None and clock > before:
                self._skipped(worker_id, before, clock, "registered")
            self.leases.add(worker_id, host, self.now())
            if spec_hash and self.spec is None:
                self.member_hashes[worker_id] = spec_hash    # the first Init decides whose model is the job's
            self._close_rounds()
            self.cond.notify_all()
            return {"worker_id": worker_id, "start_clock": clock, **self._layout_info()}

    def layout_info(self) -> dict:
        """Version, range and whether weights are set, read together (what an observer learns)."""
        with self.cond:
            self._require_up()
            return self._layout_info()

    def _layout_info(self) -> dict:
        return {"version": self.version, "begin": self.begin, "end": self.end, "initialized": self.initialized,
                "total_size": self.spec.size if self.spec is not None else 0}

    def _skipped(self, worker: int, had: int, now_at: int, how: str) -> None:
        """A live worker moved ahead of the clock this shard had for it: this shard missed its pushes.

        In async and ssp each missed push is a lost update; in sync the rounds it skipped are
        counted when they close with no gradient (:meth:`_close_rounds`).
        """
        log.warning("shard %d: worker %d %s at clock %d, this shard had it at %d: %d push(es) it never took "
                    "(a restart from an older checkpoint, or pushes it refused)", self.config.shard_index, worker, how,
                    now_at, had, now_at - had)
        if self.config.mode != "sync":
            self.counters.lost_updates += now_at - had

    def mark_gone(self, worker: int) -> None:
        """Record that a worker which never joined will not come (its launcher saw it exit).

        Those waiting for the whole job count it as departed; if it does come after all, it joins.
        """
        with self.cond:
            if not self.policy.is_live(worker):
                self.policy.departed.setdefault(worker, 0)
                self.policy.forget_oldest_departed()
                self.cond.notify_all()

    def heartbeat(self, worker: int) -> bool:
        with self.cond:
            return self.policy.is_live(worker) and self.leases.renew(worker, self.now())

    def leave(self, worker: int) -> None:
        with self.cond:
            self._drop(worker)
        self._flush_capture()     # the departure may have closed a sync round

    def _drop(self, worker: int) -> None:
        self.leases.remove(worker)
        self.policy.leave(worker)
        self.member_hashes.pop(worker, None)
        self.first_pulls.pop(worker, None)
        self._close_rounds()
        self.cond.notify_all()

    def evict_expired(self) -> list[int]:
        """Drop every worker whose lease ran out; waits that counted them are released."""
        with self.cond:
            expired = self.leases.expired(self.now())
            for worker in expired:
                self.counters.evictions += 1
                self._drop(worker)
                self._emit("eviction", worker=worker)
        self._flush_capture()
        return expired

    def evict_stalled(self) -> list[int]:
        """sync and ssp: drop every worker the others wait on that has not pushed for ``progress_timeout_s``.

        Its heartbeat may be alive (a hung training loop with a live heartbeat thread): leases alone
        would never release the others. A worker that pushes again later registers anew.
        """
        timeout = self.config.progress_timeout_s
        if not timeout or self.config.mode == "async":
            return []
        with self.cond:
            stalled = [w for w in self.leases.stalled(self.now(), timeout) if self.policy.holding_back(w)]
            for worker in stalled:
                self.counters.evictions += 1
                self.counters.stalled_evictions += 1
                self._drop(worker)
                self._emit("eviction", worker=worker)
        self._flush_capture()
        return stalled

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
            self.spec, self.begin, self.end = spec, begin, end
            self._new_ring(values, self.version)
            self._new_optimizer()
            self.pool = BufferPool(end - begin)
            # Members that registered another model were never the job's: they learn it at their next call.
            for worker in [w for w, h in self.member_hashes.items() if h != spec.hash()]:
                log.warning("shard %d: worker %d registered another model spec than the one Init set; dropped",
                            self.config.shard_index, worker)
                self._drop(worker)
            self.member_hashes.clear()
            self.cond.notify_all()
            return True

    # ----- pull -------------------------------------------------------------------------------

    def close(self) -> None:
        """The server is stopping: release every waiting pull (as UNAVAILABLE, so clients retry)."""
        with self.cond:
            self.closing = True
            self.cond.notify_all()

    @property
    def checks_as_it_applies(self) -> bool:
        """async: a pushed gradient is checked for NaN and infinity by the update itself, which reads
        it anyway (a pass of its own costs as much as a copy); the data path need not check it first."""
        return self.config.mode == "async"

    def all_finite(self, values: np.ndarray) -> bool:
        """Whether a gradient of this range holds no NaN or infinity (checked by the update's threads)."""
        return self.chunks.all_finite(values)

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

    def snapshot(self) -> tuple[int, np.ndarray]:
        """The version and this range's weights at that version, to send; hand them back with
        :meth:`release_snapshot` once sent.

        Usually the current buffer itself, lent (updates write other buffers meanwhile); when
        ``MAX_LENT_BUFFERS`` are lent already, a pooled copy, so slow senders cannot make the ring grow.
        """
        with self.cond:
            self._require_serving()
            if self.ring.lent_buffers() < MAX_LENT_BUFFERS or self.ring.lent[self.ring.current]:
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

    def served_layout(self) -> tuple[int, int, int]:
        """(elements of the model, this range's first element, its length); refused until the shard serves."""
        with self.cond:
            self._require_serving()
            return self.spec.size, self.begin, self.size

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
        self.pool.give(values)

    # ----- push -------------------------------------------------------------------------------

    def check_pusher(self, worker: int) -> None:
        """Refuse early (before the payload is read) a push from a worker that is not live.

        Read without the lock: a pull copying a large snapshot holds it for milliseconds, and the
        push would wait that long before it starts to receive. The check is advisory; push()
        checks again under the lock.
        """
        if self.closing or self.weights is None or worker not in self.policy.clocks:
            self._require_serving()         # one of them fails: raise the error that says which
            self._require_live(worker)

    def push(self, worker: int, clock: int, version_used: int, grad: np.ndarray,
             nbytes: int, *, borrowed: bool = False) -> tuple[PushResult, bool]:
        """Take one validated gradient of this range (a float32 buffer from ``self.pool``).

        Returns the result and whether the shard kept ``grad`` (sync holds it, without a copy,
        until its round closes, then gives it back to the pool); if not, the caller gives it back.
        A ``borrowed`` gradient is the worker's own memory (the shared-memory plane): it is read
        during this call only, so a sync round that stays open keeps a pooled copy of it.
        If the update makes a checkpoint due, it is on disk before this returns (so before the
        worker hears of the update), written without holding up other calls.
        """
        try:
            return self._push(worker, clock, version_used, grad, nbytes, borrowed)
        finally:
            self._flush_capture()

    def _push(self, worker: int, clock: int, version_used: int, grad: np.ndarray,
              nbytes: int, borrowed: bool) -> tuple[PushResult, bool]:
        if self.config.mode == "async":
            return self._push_async(worker, clock, version_used, grad, nbytes), False
        with self.cond:
            self._require_serving()
            self._require_live(worker)
            expected = self.policy.clocks[worker]
            self._check_claims(worker, clock, version_used, expected)
            decision = self.policy.on_push(worker, clock)
            if clock > expected and decision.outcome is Outcome.APPLIED:
                self._skipped(worker, expected, clock, "pushed")
            self._count_push(worker, nbytes)
            staleness = max(0, self.version - version_used)
            if decision.outcome is Outcome.DUPLICATE:
                self.counters.duplicates += 1
                staleness = -1
            elif decision.outcome is Outcome.DROPPED_LATE:
                self.counters.dropped_late += 1
                self._emit("dropped_late")
                staleness = -1
            elif decision.outcome is Outcome.APPLIED:
                scale = 1.0 / max(1, staleness) if self.lr_staleness else 1.0
                self._apply(grad, scale, version_used)
                self._record_staleness(staleness)
            else:  # ACCUMULATED: hold the buffer itself for the round (no copy); the pool gets it back at close
                held = self.round_grads.setdefault(decision.round, {})
                held[worker] = grad
                self._record_staleness(staleness)
                closed = decision.round in self._close_rounds(borrowed=grad if borrowed else None)
                if borrowed and not closed:       # the worker may write its memory again once answered
                    held[worker] = self.pool.take()
                    np.copyto(held[worker], grad)
                self.cond.notify_all()
                outcome = Outcome.APPLIED if closed else decision.outcome
                return PushResult(outcome, self.version, staleness, decision.next_clock), not borrowed
            self.cond.notify_all()
            return PushResult(decision.outcome, self.version, staleness, decision.next_clock), False

    def _push_async(self, worker: int, clock: int, version_used: int, grad: np.ndarray, nbytes: int) -> PushResult:
        """async: check and apply the gradient outside ``cond``, then take the push and publish its version.

        A pull returns at once in async, so nothing waits for an update but the next one: updates
        queue on ``apply_lock`` (each reads the version the one before published), everything else
        goes on meanwhile. The gradient is checked for NaN and infinity as the update reads it
        (optim.py), and the push is taken (the worker's clock moves) only once the update is
        computed: a refused gradient changes nothing. Registration also takes ``apply_lock`` in
        async, so only a departure can come between: then the update is published all the same.
        """
        with self.apply_lock:
            with self.cond:
                self._require_serving()
                self._require_live(worker)
                expected = self.policy.clocks[worker]
                self._check_claims(worker, clock, version_used, expected)
                if clock < expected:        # a retry of a push this shard has taken: answered, not applied
                    self.policy.on_push(worker, clock)
                    self._count_push(worker, nbytes)
                    self.counters.duplicates += 1
                    return PushResult(Outcome.DUPLICATE, self.version, -1, expected)
                self.policy.check_ahead(worker, clock)      # refused before the update is computed
                staleness = max(0, self.version - version_used)
                scale = 1.0 / max(1, staleness) if self.lr_staleness else 1.0
                ring = self.ring
                if self.plain_steps:
                    pulled, source, target = None, ring.current, ring.spare()
                else:
                    pulled = self._pulled(version_used)
                    source, target = ring.current, self._spare(pulled)
            if self.plain_steps:
                self.optimizer.step(ring.arrays[source], grad, scale, out=ring.arrays[target], check_finite=True)
            else:
                self._step(ring, source, grad, scale, target, pulled, check_finite=True)
            with self.cond:
                next_clock = clock + 1
                if self.policy.is_live(worker):
                    next_clock = self.policy.on_push(worker, clock).next_clock
                    if clock > expected:
                        self._skipped(worker, expected, clock, "pushed")
                self._count_push(worker, nbytes)
                self._record_staleness(staleness)
                ring.publish(target, self.version + 1)
                self._count_applied(pulled)
                self.cond.notify_all()
                return PushResult(Outcome.APPLIED, self.version, staleness, next_clock)

    def _check_claims(self, worker: int, clock: int, version_used: int, expected: int) -> None:
        """Refuse a push that claims what never happened here (call under ``cond``, before any change).

        Its version must be one this shard published, and in async and ssp its clock at most the
        worker's clock here (sync moves a worker to a round another shard closed first). A restart
        from a checkpoint explains both for pushes made before it: a version past the restored one
        until the worker's first pull from this process, a clock past the one restored for the
        worker until its first push here.
        """
        if version_used > self.version and (self.restored_version < 0
                                            or clock >= self.first_pulls.get(worker, math.inf)):
            raise InvalidArgument(f"worker {worker}'s push at clock {clock} was computed from version {version_used}, "
                                  f"but this shard has published versions up to {self.version}", Reason.FUTURE_VERSION)
        if clock > expected and self.config.mode != "sync" and self.restored_clocks.get(worker) != expected:
            raise InvalidArgument(f"worker {worker} pushed clock {clock}, but this shard has its pushes up to clock "
                                  f"{expected} only: register again with start_clock {clock} to move on",
                                  Reason.FUTURE_CLOCK)

    def _count_push(self, worker: int, nbytes: int) -> None:
        if worker in self.leases.members:
            self.leases.progressed(worker, self.now())
        self.counters.pushes += 1
        self.counters.bytes_in += nbytes
        self._emit("push", nbytes=nbytes)

    def _record_staleness(self, staleness: int) -> None:
        self.counters.record_staleness(staleness)
        self._emit("staleness", value=staleness)

    def _close_rounds(self, borrowed: np.ndarray | None = None) -> range:
        """Apply the mean of every round that may close; ``borrowed`` (a worker's own memory) is only read."""
        closed = self.policy.rounds_to_close()
        if not closed:
            return closed
        held = sorted(r for r in self.round_grads if r in closed)
        # The others every worker skipped: only a restart from an older checkpoint does that.
        self.counters.lost_updates += len(closed) - len(held)
        for round_ in held:
            grads = self.round_grads.pop(round_)
            ordered = [grads[w] for w in sorted(grads)]
            total = ordered[0]
            if len(ordered) > 1:
                if total is borrowed:
                    total = self.pool.take()
                np.add(ordered[0], ordered[1], out=total)
                for other in ordered[2:]:
                    np.add(total, other, out=total)
                np.multiply(total, 1.0 / len(ordered), out=total)
            self._apply(total, 1.0)
            for buf in {id(b): b for b in (*ordered, total)}.values():
                if buf is not borrowed:
                    self.pool.give(buf)
        return closed

    def _apply(self, grad: np.ndarray, lr_scale: float, version_used: int | None = None) -> None:
        ring = self.ring
        if self.plain_steps:       # the spare is never the buffer readers see: they keep the version they were given
            pulled, target = None, ring.spare()
            self.optimizer.step(ring.weights, grad, lr_scale, out=ring.arrays[target])
        else:
            pulled = self._pulled(version_used)
            target = self._spare(pulled)
            self._step(ring, ring.current, grad, lr_scale, target, pulled)
        ring.publish(target, self.version + 1)
        self._count_applied(pulled)

    def _pulled(self, version_used: int | None) -> int | None:
        """dc: the ring's buffer that still holds the version a gradient was computed from (else None)."""
        if self.delay is None or version_used is None:
            return None
        return self.ring.find(version_used)

    def _spare(self, pulled: int | None) -> int:
        """The buffer to write the next version into; dc keeps the last ``dc_versions`` and the one it reads."""
        if self.delay is None:     # auto momentum alone
            return self.ring.spare()
        return self.ring.spare_keeping(pulled, self.version - self.config.dc_versions + 1)

    def _step(self, ring: WeightRing, source: int, grad: np.ndarray, lr_scale: float, target: int,
              pulled: int | None, check_finite: bool = False) -> None:
        """A step with a remedy on (``plain_steps`` off): dc corrects ``grad`` from buffer ``pulled``."""
        if self.auto_momentum:
            self._tune_momentum()
        if self.delay is None:
            self.optimizer.step(ring.arrays[source], grad, lr_scale, out=ring.arrays[target], check_finite=check_finite)
        else:
            self.optimizer.step(ring.arrays[source], grad, lr_scale, out=ring.arrays[target], check_finite=check_finite,
                                delay=self.delay, pulled=None if pulled is None else ring.arrays[pulled])

    def _tune_momentum(self) -> None:
        """async_momentum = "auto": the explicit momentum less what the live workers' asynchrony adds.

        Read at each update (under ``apply_lock`` in async, ``cond`` in ssp, so never during a
        step), so it follows the membership as workers come and go.
        """
        momentum = effective_momentum(self.config.momentum, len(self.policy.clocks))
        if momentum != self.optimizer.momentum:
            self.optimizer.set_momentum(momentum)

    def _count_applied(self, pulled: int | None = None) -> None:
        """A new version is published (call under ``cond``): count it, and capture a checkpoint if one is due."""
        if self.delay is not None and pulled is None:
            self.counters.uncompensated += 1
        self.version += 1
        self.counters.applied_updates += 1
        self.updates_since_checkpoint += 1
        self._emit("applied")
        if self._checkpoint_due():
            self.pending_capture = self._capture()

    def _checkpoint_due(self) -> bool:
        every, every_s = self.config.checkpoint_every, self.config.checkpoint_every_s
        return bool(self.config.checkpoint_dir and self.initialized and self.updates_since_checkpoint and (
            (every and self.updates_since_checkpoint >= every)
            or (every_s and self.now() - self.last_checkpoint_time >= every_s)))

    def checkpoint_if_due(self) -> None:
        with self.apply_lock, self.cond:      # never while an async update changes the optimizer's state
            if self._checkpoint_due():
                self.pending_capture = self._capture()
        self._flush_capture()

    def _flush_capture(self) -> None:
        """Write the checkpoint captured under the lock, if any (call without the lock held)."""
        with self.cond:
            capture, self.pending_capture = self.pending_capture, None
        if capture is not None:
            self._write_logged(*capture)

    # ----- checkpoints ------------------------------------------------------------------------

    def checkpoint(self) -> tuple[str, int]:
        """Write a checkpoint of this moment and return its path once it is on disk."""
        with self.apply_lock, self.cond:
            self._require_initialized()       # also while stopping: that is when the final one is written
            if not self.config.checkpoint_dir:
                raise CheckpointFailed("this shard was started without a checkpoint directory "
                                       "(psctl server --checkpoint-dir)", Reason.NO_CHECKPOINT_DIR)
            arrays, meta = self._capture()
        try:
            return self._write(arrays, meta), meta["version"]
        except OSError as exc:
            raise CheckpointFailed(f"shard {self.config.shard_index} could not write its checkpoint: {exc}") from exc

    def _write_logged(self, arrays: dict, meta: dict) -> None:
        try:
            self._write(arrays, meta)
        except Exception:  # noqa: BLE001 - a full disk must not stop training; the last good one stays
            log.exception("shard %d: checkpoint failed; training goes on", self.config.shard_index)

    def _write(self, arrays: dict, meta: dict) -> str:
        # Serialized, and never behind: a capture overtaken by a newer write is dropped, so the
        # manifest only moves forward.
        with self.write_lock:
            if meta["version"] < self.written_version:
                return self.last_checkpoint
            path = str(checkpoint.save(self._checkpoint_dir(), arrays, meta, keep=self.config.checkpoint_keep))
            self.written_version = meta["version"]
            with self.cond:
                self.last_checkpoint = path
            return path

    def _capture(self) -> tuple[dict, dict]:
        """Copies of everything a checkpoint holds, taken atomically (call under the lock)."""
        arrays = {"weights": self.weights.copy()}
        for key, value in self.optimizer.state_dict().items():     # state_dict returns copies
            arrays[f"opt.{key}"] = np.asarray(value)
        # Gradients held for open sync rounds: their pushers' clocks have moved past them.
        for round_, grads in self.round_grads.items():
            for worker, grad in grads.items():
                arrays[f"round.{round_}.{worker}"] = grad.copy()
        meta = {
            "version": self.version, "spec": self.spec.to_json(), "begin": self.begin, "end": self.end,
            "shard_index": self.config.shard_index, "num_shards": self.config.num_shards,
            "mode": self.config.mode, "clocks": {str(w): c for w, c in self.policy.clocks.items()},
            "closed_rounds": self.policy.closed_rounds, "next_id": self.leases.next_id,
            "hosts": {str(w): m.host for w, m in self.leases.members.items()},
            "departed": {str(w): c for w, c in self.policy.departed.items()},
            # A restarted process starts its counters afresh: the job's losses so far go on with it.
            "lost_updates": self.counters.lost_updates,
        }
        self.updates_since_checkpoint = 0
        self.last_checkpoint_time = self.now()
        return arrays, meta

    def _checkpoint_dir(self) -> str:
        return str(checkpoint.shard_dir(self.config.checkpoint_dir, self.config.shard_index, self.config.num_shards))

    def begin_restore(self) -> None:
        """Refuse every call as UNAVAILABLE (reason ``restoring``) until :meth:`restore` has run."""
        with self.cond:
            self.restoring = True

    def restore(self) -> bool:
        """Load the latest complete checkpoint, if any; members get a fresh lease to come back."""
        try:
            return self._restore()
        finally:
            with self.cond:
                self.restoring = False
                self.cond.notify_all()

    def _restore(self) -> bool:
        found = checkpoint.load_latest(self._checkpoint_dir())   # read outside the lock: calls meanwhile are refused
        if found is None:
            return False
        with self.cond:
            arrays, meta = found
            spec = ModelSpec.from_json(meta["spec"])
            self.spec, self.begin, self.end = spec, meta["begin"], meta["end"]
            self._new_ring(arrays["weights"], meta["version"])
            self._new_optimizer()
            opt_state = {k[4:]: v for k, v in arrays.items() if k.startswith("opt.")}
            self.optimizer.load_state_dict({k: (v if v.ndim else v.item()) for k, v in opt_state.items()})
            self.pool = BufferPool(self.size)
            for key, value in arrays.items():
                if key.startswith("round."):
                    _, round_, worker = key.split(".")
                    held = self.pool.take()       # the round gives it back to the pool when it closes
                    np.copyto(held, value)
                    self.round_grads.setdefault(int(round_), {})[int(worker)] = held
                    self.policy.round_pushers.setdefault(int(round_), set()).add(int(worker))
            self.version = meta["version"]
            self.policy.closed_rounds = meta["closed_rounds"]
            self.leases.next_id = meta["next_id"]
            now = self.now()
            self.policy.departed = {int(w): c for w, c in meta.get("departed", {}).items()}
            self.counters.lost_updates = meta.get("lost_updates", 0)
            for w, c in meta["clocks"].items():
                self.policy.clocks[int(w)] = c
                self.leases.add(int(w), meta["hosts"].get(w, ""), now)
            self.restored_clocks = dict(self.policy.clocks)
            self.last_checkpoint = str(Path(self._checkpoint_dir()) / checkpoint.MANIFEST)
            self.restored_version = self.written_version = self.version
            clocks = sorted(self.policy.clocks.values())
            log.warning("shard %d restored its checkpoint at version %d (%s; worker clocks %s)",
                        self.config.shard_index, self.version,
                        f"{self.policy.closed_rounds} rounds closed" if self.config.mode == "sync" else self.config.mode,
                        f"{clocks[0]}..{clocks[-1]}" if clocks else "none")
            return True

    # ----- stats ------------------------------------------------------------------------------

    def stats(self) -> dict:
        with self.cond:
            now = self.now()
            c = self.counters
            members = [{"worker_id": w, "clock": self.policy.clocks.get(w, -1),
                        "idle_s": now - m.last_seen, "host": m.host}
                       for w, m in sorted(self.leases.members.items())]
            return {
                "shard_index": self.config.shard_index, "num_shards": self.config.num_shards,
                "mode": self.config.mode, "version": self.version, "begin": self.begin, "end": self.end,
                "members": members, "min_clock": self.policy.slowest_clock(),
                "max_clock": self.policy.fastest_clock(), "pushes": c.pushes, "pulls": c.pulls,
                "bytes_in": c.bytes_in, "bytes_out": c.bytes_out, "applied_updates": c.applied_updates,
                "dropped_late": c.dropped_late, "duplicates": c.duplicates, "evictions": c.evictions,
                "rejected": c.rejected, "staleness_counts": list(c.staleness_counts),
                "departed": sorted(self.policy.departed), "lost_updates": c.lost_updates,
                "restored_version": self.restored_version, "stalled_evictions": c.stalled_evictions,
                "revoked_reads": self.ring.revoked if self.ring is not None else 0,
                "mean_staleness": c.staleness_sum / c.staleness_n if c.staleness_n else 0.0,
                "max_staleness": c.max_staleness, "wait_s_total": c.wait_s_total,
                "uncompensated_updates": c.uncompensated,
                "momentum": float(getattr(self.optimizer, "momentum", 0.0)),
                "checkpoint": self.last_checkpoint, "initialized": self.initialized,
                "total_size": self.spec.size if self.spec else 0,
                "job_tag": job_tag(self.config.job_id),
                "waits": [{"worker_id": w, "seconds": s} for w, s in sorted(c.wait_s_by_worker.items())],
            }

    def checksum(self) -> float:
        with self.cond:
            return math.fsum(self.weights.astype(np.float64)) if self.initialized else 0.0

