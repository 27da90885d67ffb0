"""Pushes: the clock and version checks, sync rounds, and the update that publishes each new version.

A mixin of :class:`~psgrid.psserver.state.shard.Shard`: its methods use the shard's locks
(``cond``, and ``apply_lock`` in async), ring, pool, updater, policy and counters. Weights are
never changed in place: the updater (updater.py) writes a spare buffer of the ring, then it is published.
"""

from __future__ import annotations

import logging
import math
from typing import Callable

import numpy as np

from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.kernels.parallel import Chunks
from psgrid.psserver.protocol import Outcome, PushResult, Reason
from psgrid.psserver.state.policy import ConsistencyPolicy

log = logging.getLogger("psgrid.shard")


def finite_check(policy: ConsistencyPolicy, chunks: Chunks) -> Callable[[np.ndarray], bool] | None:
    """The check for NaN and infinity a pushed gradient passes as it lands, or None where the update makes it.

    The one rule of where a gradient is checked, whatever plane brought it. Where no pull waits
    (async) the update checks it as it reads it (:meth:`Pushes._push_async`, ``check_finite``): a
    pass of its own would cost as much as a copy. Elsewhere a gradient may wait for its round, so it
    is checked as it lands, a chunk per thread.
    """
    return chunks.all_finite if policy.waits_on_pull else None


class Pushes:
    """The push side of a shard: take a gradient, hold it for its sync round or apply it."""

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
             nbytes: int, *, borrowed: bool = False, checked: bool = False) -> tuple[PushResult, bool]:
        """Take one validated gradient of this range (a float32 buffer from ``self.pool``).

        Returns the result and whether the shard kept ``grad`` (sync holds it, without a copy,
        until its round closes, then gives it back to the pool); if not, the caller gives it back.
        A ``borrowed`` gradient is the worker's own memory (the shared-memory plane): it is read
        during this call only, so a sync round that stays open keeps a pooled copy of it. A
        ``checked`` one is known finite already (the IPC plane checks as it copies): async skips its check.
        If the update makes a checkpoint due, it is on disk before this returns (so before the
        worker hears of the update), written without holding up other calls.
        """
        try:
            if self.arrays.on_gpu and isinstance(grad, np.ndarray):
                return self._push_staged(worker, clock, version_used, grad, nbytes), False
            return self._push_here(worker, clock, version_used, grad, nbytes, borrowed, checked)
        finally:
            self._flush_capture()

    def _push_here(self, worker: int, clock: int, version_used: int, grad, nbytes: int,
                   borrowed: bool, checked: bool = False) -> tuple[PushResult, bool]:
        if not self.policy.waits_on_pull:     # nothing waits for an update but the next: it runs outside ``cond``
            return self._push_async(worker, clock, version_used, grad, nbytes, checked), False
        return self._push_rounds(worker, clock, version_used, grad, nbytes, borrowed)

    def _push_staged(self, worker: int, clock: int, version_used: int, grad: np.ndarray, nbytes: int) -> PushResult:
        """A device shard takes a gradient that landed in host memory (a network plane's): copied to the GPU first."""
        staged = self.pool.take()
        kept = False
        try:
            self.arrays.upload(staged, grad)
            result, kept = self._push_here(worker, clock, version_used, staged, nbytes, False)
            return result
        finally:
            if not kept:
                self.pool.give(staged)

    def _push_rounds(self, worker: int, clock: int, version_used: int, grad: np.ndarray,
                     nbytes: int, borrowed: bool) -> tuple[PushResult, bool]:
        """sync and ssp: take the push under ``cond``; apply it, or hold it for its round."""
        with self.cond:
            if self.closing or self.restoring or self.ring is None or worker not in self.policy.clocks:
                self._require_serving()         # one of them fails: raise the error that says which
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
                self._apply(grad, self.updater.lr_scale(staleness), version_used)
                self._record_staleness(staleness)
            else:  # ACCUMULATED: hold the buffer itself for the round (no copy); the pool gets it back at close
                held = self.round_grads.setdefault(decision.round, {})
                held[worker] = grad
                self._record_staleness(staleness)
                closed = decision.round in self._close_rounds(borrowed=grad if borrowed else None)
                if borrowed and not closed:       # the worker may write its memory again once answered
                    held[worker] = self.pool.take()
                    self.arrays.copy(held[worker], grad)
                self.cond.notify_all()
                outcome = Outcome.APPLIED if closed else decision.outcome
                return PushResult(outcome, self.version, staleness, decision.next_clock), not borrowed
            self.cond.notify_all()
            return PushResult(decision.outcome, self.version, staleness, decision.next_clock), False

    def _push_async(self, worker: int, clock: int, version_used: int, grad: np.ndarray, nbytes: int,
                    checked: bool = False) -> PushResult:
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
                if self.closing or self.restoring or self.ring is None or worker not in self.policy.clocks:
                    self._require_serving()     # one of them fails: raise the error that says which
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
                ring, updater = self.ring, self.updater
                step = updater.plan(ring, self.version, version_used)
            updater.apply(ring, step, grad, updater.lr_scale(staleness), check_finite=not checked)
            with self.cond:
                next_clock = clock + 1
                if self.policy.is_live(worker):
                    next_clock = self.policy.on_push(worker, clock).next_clock
                    if clock > expected:
                        self._skipped(worker, expected, clock, "pushed")
                self._count_push(worker, nbytes)
                self._record_staleness(staleness)
                ring.publish(step.target, self.version + 1)
                self._count_applied(updater.uncompensated(step))
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
        if clock > expected and not self.policy.accumulates and self.restored_clocks.get(worker) != expected:
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
        with self.arrays.use():
            self._apply_rounds(held, borrowed)
        return closed

    def _apply_rounds(self, held: list[int], borrowed) -> None:
        """Apply each held round's mean, summed in worker order (the arrays' own module: NumPy or CuPy)."""
        xp = self.arrays.xp
        for round_ in held:
            grads = self.round_grads.pop(round_)
            ordered = [grads[w] for w in sorted(grads)]
            total = ordered[0]
            if len(ordered) > 1:
                if total is borrowed:
                    total = self.pool.take()
                xp.add(ordered[0], ordered[1], out=total)
                for other in ordered[2:]:
                    xp.add(total, other, out=total)
                xp.multiply(total, 1.0 / len(ordered), out=total)
            self._apply(total, 1.0)
            for buf in {id(b): b for b in (*ordered, total)}.values():
                if buf is not borrowed:
                    self.pool.give(buf)

    def _apply(self, grad: np.ndarray, lr_scale: float, version_used: int | None = None) -> None:
        """Apply ``grad`` under ``cond`` and publish the next version (sync rounds and ssp)."""
        ring, updater = self.ring, self.updater
        step = updater.plan(ring, self.version, version_used)
        updater.apply(ring, step, grad, lr_scale)
        ring.publish(step.target, self.version + 1)
        self._count_applied(updater.uncompensated(step))

    def _count_applied(self, uncompensated: bool = False) -> None:
        """A new version is published (call under ``cond``): count it, and capture a checkpoint if one is due."""
        if uncompensated:
            self.counters.uncompensated += 1
        self.version += 1
        self.counters.applied_updates += 1
        self.updates_since_checkpoint += 1
        self._emit("applied")
        if self._checkpoint_due():
            self.pending_capture = self._capture()
