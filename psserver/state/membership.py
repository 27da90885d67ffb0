"""Leases: who is alive and who makes progress, judged against a clock the caller passes in (pure, testable).

Two signs are tracked per member: ``last_seen`` (any heartbeat or request: the process lives)
and ``last_progress`` (joining or pushing: the training loop moves). A worker whose heartbeat
thread lives while its loop hangs keeps the first fresh and lets the second age.

:class:`Members`, a part of :class:`~psgrid.psserver.state.shard.Shard`, applies them under
the shard's lock: joining, heartbeats, leaving and evictions, each releasing the waits it may end.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from psgrid.psserver.exceptions import SpecMismatch

log = logging.getLogger("psgrid.shard")


@dataclass
class Member:
    worker_id: int
    host: str
    last_seen: float
    last_progress: float


class Leases:
    """Tracks the last sign of life of each worker; ``expired(now)`` names those past ``lease_s``."""

    def __init__(self, lease_s: float):
        self.lease_s = lease_s
        self.members: dict[int, Member] = {}
        self.next_id = 0

    def new_id(self, taken=(), limit: int = 2**31 - 1) -> int:
        """A worker id nobody holds: the next after every id seen, or, once that passed ``limit``
        (a worker asked for a huge id), the lowest that is neither a member's nor in ``taken``."""
        if self.next_id <= limit:
            worker_id = self.next_id
            self.next_id += 1
            return worker_id
        return next(i for i in range(limit + 1) if i not in self.members and i not in taken)

    def add(self, worker_id: int, host: str, now: float) -> None:
        self.members[worker_id] = Member(worker_id, host, now, now)
        self.next_id = max(self.next_id, worker_id + 1)

    def renew(self, worker_id: int, now: float) -> bool:
        member = self.members.get(worker_id)
        if member is None:
            return False
        member.last_seen = now
        return True

    def progressed(self, worker_id: int, now: float) -> None:
        member = self.members.get(worker_id)
        if member is not None:
            member.last_seen = member.last_progress = now

    def remove(self, worker_id: int) -> None:
        self.members.pop(worker_id, None)

    def expired(self, now: float) -> list[int]:
        return [m.worker_id for m in self.members.values() if now - m.last_seen > self.lease_s]

    def stalled(self, now: float, timeout: float) -> list[int]:
        """Members that have not joined or pushed for more than ``timeout`` seconds."""
        return [m.worker_id for m in self.members.values() if now - m.last_progress > timeout]


class Members:
    """A shard's members: who joins, who is alive, who is dropped (the policy's clocks and the leases, kept together).

    A part of :class:`~psgrid.psserver.state.shard.Shard`: it owns the leases and the spec hashes
    members registered with before Init, and uses the shard's ``cond``, policy and counters; a
    departure closes the sync rounds it held open (pushes.py).
    """

    def __init__(self, shard, lease_s: float):
        self.shard = shard
        self.leases = Leases(lease_s)
        self.spec_hashes: dict[int, str] = {}  # before Init: the spec hash each member registered with

    def register(self, spec_hash: str, worker_id: int, start_clock: int, host: str) -> dict:
        """Join (or rejoin) ``worker_id`` (-1: a new id); returns the join and the layout, read together."""
        shard = self.shard
        try:
            if not shard.policy.waits_on_pull:  # never between an async update and the push it takes
                with shard.apply_lock:
                    return self._register(spec_hash, worker_id, start_clock, host)
            return self._register(spec_hash, worker_id, start_clock, host)
        finally:
            shard.checkpoints.flush()  # moving a worker forward may have closed a sync round

    def _register(self, spec_hash: str, worker_id: int, start_clock: int, host: str) -> dict:
        shard = self.shard
        with shard.cond:
            shard.require_up()
            if spec_hash and shard.spec is not None and spec_hash != shard.spec.hash():
                raise SpecMismatch(
                    f"model spec hash {spec_hash[:12]} differs from this shard's "
                    f"{shard.spec.hash()[:12]}: every worker must build the same model"
                )
            if worker_id < 0:
                worker_id = self.leases.new_id(taken=shard.policy.departed)
            before = shard.policy.clocks.get(worker_id)
            clock = shard.policy.join(worker_id, start_clock if start_clock >= 0 else None)
            if before is not None and clock > before:
                self.skipped(worker_id, before, clock, "registered")
            self.leases.add(worker_id, host, shard.now())
            if spec_hash and shard.spec is None:
                self.spec_hashes[worker_id] = spec_hash  # the first Init decides whose model is the job's
            shard.pushes.close_rounds()
            shard.cond.notify_all()
            return {"worker_id": worker_id, "start_clock": clock, **shard.layout_fields()}

    def admit(self, spec_hash: str) -> None:
        """Init set the job's model (call under ``cond``): members that registered another were never the job's.

        They learn it at their next call.
        """
        for worker in [w for w, h in self.spec_hashes.items() if h != spec_hash]:
            log.warning(
                "shard %d: worker %d registered another model spec than the one Init set; dropped",
                self.shard.config.shard_index,
                worker,
            )
            self.drop(worker)
        self.spec_hashes.clear()

    def skipped(self, worker: int, had: int, now_at: int, how: str) -> None:
        """A live worker moved ahead of the clock this shard had for it: this shard missed its pushes.

        In async and ssp each missed push is a lost update; in sync the rounds it skipped are
        counted when they close with no gradient (:meth:`Pushes.close_rounds`).
        """
        shard = self.shard
        log.warning(
            "shard %d: worker %d %s at clock %d, this shard had it at %d: %d push(es) it never took "
            "(a restart from an older checkpoint, or pushes it refused)",
            shard.config.shard_index,
            worker,
            how,
            now_at,
            had,
            now_at - had,
        )
        if not shard.policy.accumulates:
            shard.counters.lost_updates += now_at - had

    def progressed(self, worker: int) -> None:
        """``worker`` pushed (call under ``cond``): its training loop moves."""
        if worker in self.leases.members:
            self.leases.progressed(worker, self.shard.now())

    def renew(self, worker: int) -> None:
        """A sign of life from ``worker`` (call under ``cond``)."""
        self.leases.renew(worker, self.shard.now())

    def mark_gone(self, worker: int) -> None:
        """Record that a worker which never joined will not come (its launcher saw it exit).

        Those waiting for the whole job count it as departed; if it does come after all, it joins.
        """
        shard = self.shard
        with shard.cond:
            if not shard.policy.is_live(worker):
                shard.policy.departed.setdefault(worker, 0)
                shard.policy.forget_oldest_departed()
                shard.cond.notify_all()

    def heartbeat(self, worker: int) -> bool:
        shard = self.shard
        with shard.cond:
            return shard.policy.is_live(worker) and self.leases.renew(worker, shard.now())

    def leave(self, worker: int) -> None:
        with self.shard.cond:
            self.drop(worker)
        self.shard.checkpoints.flush()  # the departure may have closed a sync round

    def drop(self, worker: int) -> None:
        """Drop ``worker`` (call under ``cond``): waits stop counting it, and the rounds it held open may close."""
        shard = self.shard
        self.leases.remove(worker)
        shard.policy.leave(worker)
        self.spec_hashes.pop(worker, None)
        shard.claims.forget(worker)
        shard.pushes.close_rounds()
        shard.cond.notify_all()

    def evict_expired(self) -> list[int]:
        """Drop every worker whose lease ran out; waits that counted them are released."""
        shard = self.shard
        with shard.cond:
            expired = self.leases.expired(shard.now())
            for worker in expired:
                shard.counters.evictions += 1
                self.drop(worker)
                shard.emit("eviction", worker=worker)
        shard.checkpoints.flush()
        return expired

    def evict_stalled(self) -> list[int]:
        """sync and ssp: drop every worker the others wait on that has not pushed for ``progress_timeout_s``.

        Its heartbeat may be alive (a hung training loop with a live heartbeat thread): leases alone
        would never release the others. A worker that pushes again later registers anew.
        """
        shard = self.shard
        timeout = shard.config.progress_timeout_s
        if not timeout or not shard.policy.waits_on_pull:
            return []
        with shard.cond:
            stalled = [w for w in self.leases.stalled(shard.now(), timeout) if shard.policy.holding_back(w)]
            for worker in stalled:
                shard.counters.evictions += 1
                shard.counters.stalled_evictions += 1
                self.drop(worker)
                shard.emit("eviction", worker=worker)
        shard.checkpoints.flush()
        return stalled
