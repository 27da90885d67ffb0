"""Leases: who is alive and who makes progress, judged against a clock the caller passes in (pure, testable).

Two signs are tracked per member: ``last_seen`` (any heartbeat or request: the process lives)
and ``last_progress`` (joining or pushing: the training loop moves). A worker whose heartbeat
thread lives while its loop hangs keeps the first fresh and lets the second age.

:class:`Membership`, a mixin of :class:`~psgrid.psserver.state.shard.Shard`, applies them under
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


class Membership:
    """The shard's members: who joins, who is alive, who is dropped; uses the shard's ``cond``, policy and leases."""

    def register(self, spec_hash: str, worker_id: int, start_clock: int, host: str) -> dict:
        """Join (or rejoin) ``worker_id`` (-1: a new id); returns the join and the layout, read together."""
        try:
            if not self.policy.waits_on_pull:     # never between an async update and the push it takes
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
        if not self.policy.accumulates:
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
        if not timeout or not self.policy.waits_on_pull:
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
