"""Pushes: the clock and version checks, sync rounds, and the update that publishes each new version.

A part of :class:`~psgrid.psserver.state.shard.Shard`. It is given the shard's ``core`` (its locks:
``cond``, and ``apply_lock`` where no pull waits; its policy and counters), the ``served`` range (the
ring, updater and pool an update uses, and the version it publishes), the ``leases`` a push marks
progress on, the ``claims`` a push is checked against, the ``round_grads`` (the gradients held for
open sync rounds, which checkpoints capture too) and the ``checkpoints`` told of each new version.
Weights are never changed in place: the updater (updater.py) writes a spare buffer of the ring, then
it is published.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from psgrid.psserver.kernels.optim import NON_FINITE
from psgrid.psserver.kernels.parallel import Chunks
from psgrid.psserver.protocol import Outcome, PushResult
from psgrid.psserver.state.claims import Claims
from psgrid.psserver.state.core import ShardCore
from psgrid.psserver.state.membership import Leases, missed_pushes
from psgrid.psserver.state.policy import ConsistencyPolicy
from psgrid.psserver.state.served_range import ServedRange
from psgrid.psserver.state.shard_checkpoints import Checkpoints, RoundGrads


def finite_check(policy: ConsistencyPolicy, parts: Chunks) -> Callable[[np.ndarray], bool] | None:
    """The check for NaN and infinity a pushed gradient passes as it lands, or None where the update makes it.

    The one rule of where a gradient is checked, whatever plane brought it. Where no pull waits
    (async) the update checks it as it reads it (:meth:`Pushes._push_at_once`, ``check_finite``): a
    pass of its own would cost as much as a copy. Elsewhere a gradient may wait for its round, so it
    is checked as it lands, a part per thread.
    """
    return parts.all_finite if policy.waits_on_pull else None


class Pushes:
    """The push side of a shard: take a gradient, hold it for its sync round or apply it."""

    def __init__(
        self,
        core: ShardCore,
        served: ServedRange,
        leases: Leases,
        claims: Claims,
        round_grads: RoundGrads,
        checkpoints: Checkpoints,
        parts: Chunks,
    ):
        self.core = core
        self.served = served
        self.leases = leases
        self.claims = claims
        # sync: open round -> {worker: gradient}. Summed in worker order when the round closes,
        # so a sync run is bitwise reproducible whatever order the pushes arrive in.
        self.round_grads = round_grads
        self.checkpoints = checkpoints
        self.finite_check = finite_check(core.policy, parts)  # None: the update checks a gradient

    def check_pusher(self, worker: int) -> None:
        """Refuse early (before the payload is read) a push from a worker that is not live.

        Read without the lock: a pull copying a large snapshot holds it for milliseconds, and the
        push would wait that long before it starts to receive. The check is advisory; push()
        checks again under the lock.
        """
        core = self.core
        if core.closing or self.served.weights is None or worker not in core.policy.clocks:
            self.served.require_serving()  # one of them fails: raise the error that says which
            core.require_live(worker)

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
        """Take one validated gradient of this range (a float32 buffer from the shard's pool).

        Returns the result and whether the shard kept ``grad`` (sync holds it, without a copy,
        until its round closes, then gives it back to the pool); if not, the caller gives it back.
        A ``borrowed`` gradient is the worker's own memory (the shared-memory plane): it is read
        during this call only, so a sync round that stays open keeps a pooled copy of it. A
        ``checked`` one is known finite already (the IPC plane checks as it copies): async skips its check.
        A ``flag`` is that check still on a device shard's GPU (async only: the update reads it there).
        If the update makes a checkpoint due, it is on disk before this returns (so before the
        worker hears of the update), written without holding up other calls.
        """
        try:
            if self.served.arrays.on_gpu and isinstance(grad, np.ndarray):
                return self._push_staged(worker, clock, version_used, grad, nbytes), False
            return self._push_here(worker, clock, version_used, grad, nbytes, borrowed, checked, flag)
        finally:
            self.checkpoints.flush()

    def _push_here(
        self,
        worker: int,
        clock: int,
        version_used: int,
        grad,
        nbytes: int,
        borrowed: bool,
        checked: bool = False,
        flag=None,
    ) -> tuple[PushResult, bool]:
        if not self.core.policy.waits_on_pull:  # nothing waits for an update but the next: it runs outside ``cond``
            return self._push_at_once(worker, clock, version_used, grad, nbytes, checked, flag), False
        if flag is not None and self.served.arrays.flagged(flag):  # a round may hold it: known before it is taken
            raise NON_FINITE()
        return self._push_rounds(worker, clock, version_used, grad, nbytes, borrowed)

    def _push_staged(self, worker: int, clock: int, version_used: int, grad: np.ndarray, nbytes: int) -> PushResult:
        """A device shard takes a gradient that landed in host memory (a network plane's): copied to the GPU first."""
        pool = self.served.pool
        staged = pool.take()
        kept = False
        try:
            self.served.arrays.upload(staged, grad)
            result, kept = self._push_here(worker, clock, version_used, staged, nbytes, False)
            return result
        finally:
            if not kept:
                pool.give(staged)

    def _take(self, worker: int, clock: int, version_used: int) -> int:
        """Check a push under ``cond`` (serving, a live pusher, its claims); returns the worker's clock here."""
        core, policy, served = self.core, self.core.policy, self.served
        if core.closing or core.restoring or served.ring is None or worker not in policy.clocks:
            served.require_serving()  # one of them fails: raise the error that says which
            core.require_live(worker)
        expected = policy.clocks[worker]
        self.claims.check(worker, clock, version_used, expected, served.version, not policy.accumulates)
        return expected

    def _push_rounds(
        self, worker: int, clock: int, version_used: int, grad: np.ndarray, nbytes: int, borrowed: bool
    ) -> tuple[PushResult, bool]:
        """sync and ssp: take the push under ``cond``; apply it, or hold it for its round."""
        core, served = self.core, self.served
        with core.cond:
            expected = self._take(worker, clock, version_used)
            decision = core.policy.on_push(worker, clock)
            if clock > expected and decision.outcome is Outcome.APPLIED:
                missed_pushes(core, worker, expected, clock, "pushed")
            self._count_push(worker, nbytes)
            staleness = max(0, served.version - version_used)
            if decision.outcome is Outcome.DUPLICATE:
                core.counters.duplicates += 1
                staleness = -1
            elif decision.outcome is Outcome.DROPPED_LATE:
                core.counters.dropped_late += 1
                core.emit("dropped_late")
                staleness = -1
            elif decision.outcome is Outcome.APPLIED:
                self._apply(grad, served.updater.lr_scale(staleness, self.schedule_clock()), version_used)
                self._record_staleness(staleness)
            else:  # ACCUMULATED: hold the buffer itself for the round (no copy); the pool gets it back at close
                held = self.round_grads.setdefault(decision.round, {})
                held[worker] = grad
                self._record_staleness(staleness)
                closed = decision.round in self.close_rounds(borrowed=grad if borrowed else None)
                if borrowed and not closed:  # the worker may write its memory again once answered
                    held[worker] = served.pool.take()
                    served.arrays.copy(held[worker], grad)
                core.cond.notify_all()
                outcome = Outcome.APPLIED if closed else decision.outcome
                return PushResult(outcome, served.version, staleness, decision.next_clock), not borrowed
            core.cond.notify_all()
            return PushResult(decision.outcome, served.version, staleness, decision.next_clock), False

    def _push_at_once(
        self,
        worker: int,
        clock: int,
        version_used: int,
        grad: np.ndarray,
        nbytes: int,
        checked: bool = False,
        flag=None,
    ) -> PushResult:
        """async: check and apply the gradient outside ``cond``, then take the push and publish its version.

        A pull returns at once in async, so nothing waits for an update but the next one: updates
        queue on ``apply_lock`` (each reads the version the one before published), everything else
        goes on meanwhile. The gradient is checked for NaN and infinity as the update reads it
        (optim.py), and the push is taken (the worker's clock moves) only once the update is
        computed: a refused gradient changes nothing. Registration also takes ``apply_lock`` in
        async, so only a departure can come between: then the update is published all the same.
        """
        core, policy, served = self.core, self.core.policy, self.served
        with core.apply_lock:
            with core.cond:
                expected = self._take(worker, clock, version_used)
                if clock < expected:  # a retry of a push this shard has taken: answered, not applied
                    policy.on_push(worker, clock)
                    self._count_push(worker, nbytes)
                    core.counters.duplicates += 1
                    return PushResult(Outcome.DUPLICATE, served.version, -1, expected)
                policy.check_ahead(worker, clock)  # refused before the update is computed
                staleness = max(0, served.version - version_used)
                ring, updater = served.ring, served.updater
                step = updater.plan(ring, served.version, version_used)
                skipped = max(0, clock - expected)  # counted lost once the push is taken, below; the rate knows now
                lr_scale = updater.lr_scale(staleness, self.schedule_clock() + skipped)
            updater.apply(ring, step, grad, lr_scale, check_finite=not checked and flag is None, flag=flag)
            with core.cond:
                next_clock = clock + 1
                if policy.is_live(worker):
                    next_clock = policy.on_push(worker, clock).next_clock
                elif worker in policy.departed:  # it left while its update was computed: that push is in all the same
                    policy.departed[worker] = max(policy.departed[worker], next_clock)
                if clock > expected:
                    missed_pushes(core, worker, expected, clock, "pushed")
                self._count_push(worker, nbytes)
                self._record_staleness(staleness)
                self._publish(step.target, updater.uncompensated(step))
                core.cond.notify_all()
                return PushResult(Outcome.APPLIED, served.version, staleness, next_clock)

    def _count_push(self, worker: int, nbytes: int) -> None:
        core = self.core
        self.leases.progressed(worker, core.now())  # its training loop moves
        core.counters.pushes += 1
        core.counters.bytes_in += nbytes
        core.emit("push", nbytes=nbytes)

    def _record_staleness(self, staleness: int) -> None:
        self.core.counters.record_staleness(staleness)
        self.core.emit("staleness", value=staleness)

    def schedule_clock(self) -> int:
        """Where the rate's schedule stands: the updates applied, and those known lost (call under ``cond``).

        Lost: to a restart from an older checkpoint, or a push this shard refused. Workers go on at their
        own steps; counting the lost updates keeps the schedule with them, so it ends at 0 when they do.
        """
        return self.served.version + self.core.counters.lost_updates

    def close_rounds(self, borrowed: np.ndarray | None = None) -> range:
        """Apply the mean of every round that may close (call under ``cond``).

        ``borrowed`` (a worker's own memory) is only read.
        """
        closed = self.core.policy.rounds_to_close()
        if not closed:
            return closed
        held = sorted(r for r in self.round_grads if r in closed)
        with self.served.arrays.use():
            self._apply_rounds(closed, held, borrowed)
        return closed

    def _apply_rounds(self, closed: range, held: list[int], borrowed) -> None:
        """Apply each held round's mean, summed in worker order (the arrays' own module: NumPy or CuPy).

        The other rounds of ``closed`` every worker skipped (only a restart from an older checkpoint
        does that): each is counted lost in its place, so a held round takes the schedule's rate of its own.
        """
        xp, pool, counters = self.served.arrays.xp, self.served.pool, self.core.counters
        next_round = closed.start
        for round_ in held:
            counters.lost_updates += round_ - next_round
            next_round = round_ + 1
            grads = self.round_grads.pop(round_)
            ordered = [grads[w] for w in sorted(grads)]
            total = ordered[0]
            if len(ordered) > 1:
                if total is borrowed:
                    total = pool.take()
                xp.add(ordered[0], ordered[1], out=total)
                for other in ordered[2:]:
                    xp.add(total, other, out=total)
                xp.multiply(total, 1.0 / len(ordered), out=total)
            self._apply(total, self.served.updater.lr_scale(0, self.schedule_clock()))
            for buf in {id(b): b for b in (*ordered, total)}.values():
                if buf is not borrowed:
                    pool.give(buf)
        counters.lost_updates += closed.stop - next_round

    def _apply(self, grad: np.ndarray, lr_scale: float, version_used: int | None = None) -> None:
        """Apply ``grad`` under ``cond`` and publish the next version (sync rounds and ssp)."""
        served = self.served
        ring, updater = served.ring, served.updater
        step = updater.plan(ring, served.version, version_used)
        updater.apply(ring, step, grad, lr_scale)
        self._publish(step.target, updater.uncompensated(step))

    def _publish(self, target: int, uncompensated: bool) -> None:
        """Publish the next version, just written to ``target`` (call under ``cond``): count it, and
        capture a checkpoint if one is due."""
        counters = self.core.counters
        if uncompensated:
            counters.uncompensated += 1
        self.served.publish(target)
        counters.applied_updates += 1
        self.core.emit("applied")
        self.checkpoints.updated()
