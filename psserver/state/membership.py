"""Leases: who is alive and who makes progress, judged against a clock the caller passes in (pure, testable).

Two signs are tracked per member: ``last_seen`` (any heartbeat or request: the process lives)
and ``last_progress`` (joining or pushing: the training loop moves). A worker whose heartbeat
thread lives while its loop hangs keeps the first fresh and lets the second age.

:class:`Members`, a part of :class:`~psgrid.psserver.state.shard.Shard`, applies them under
the shard's lock: joining, heartbeats, leaving and evictions, each releasing the waits it may end.
Pulls renew a lease and pushes mark progress on the :class:`Leases` themselves (snapshots.py, pushes.py).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from psgrid.psserver.exceptions import SpecMismatch, Unavailable
from psgrid.psserver.protocol import Reason
from psgrid.psserver.state.claims import Claims
from psgrid.psserver.state.core import ShardCore
from psgrid.psserver.state.served_range import ServedRange

log = logging.getLogger("psgrid.shard")

# Live workers a shard takes at once: far past any job's, and what keeps Stats, which lists each (its host
# too), under gRPC's 4 MiB; ids made up by a token holder cannot grow the membership past it.
MAX_MEMBERS = 4096


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

    A part of :class:`~psgrid.psserver.state.shard.Shard`. It owns the spec hashes members
    registered with before Init, and is given what it uses by name: the shard's ``core`` (its lock,
    clock, policy and counters), the ``served`` range (the spec members must share, and the layout a
    registration answers), the ``leases`` (also renewed by pulls and pushes, captured by checkpoints),
    the ``claims`` it forgets a departed worker's first pull in, and two calls of other parts:
    ``close_rounds`` (pushes.py: a membership change may close the sync rounds a worker held open;
    called under ``cond``) and ``flush`` (shard_checkpoints.py: write the checkpoint such a round made
    due; called without the lock).
    """

    def __init__(
        self,
        core: ShardCore,
        served: ServedRange,
        leases: Leases,
        claims: Claims,
        *,
        close_rounds: Callable[[], object],
        flush: Callable[[], None],
    ):
        self.core = core
        self.served = served
        self.leases = leases
        self.claims = claims
        self.close_rounds = close_rounds
        self.flush = flush
        self.spec_hashes: dict[int, str] = {}  # before Init: the spec hash each member registered with

    def register(self, spec_hash: str, worker_id: int, start_clock: int, host: str) -> dict:
        """Join (or rejoin) ``worker_id`` (-1: a new id); returns the join and the layout, read together."""
        try:
            if not self.core.policy.waits_on_pull:  # never between an async update and the push it takes
                with self.core.apply_lock:
                    return self._register(spec_hash, worker_id, start_clock, host)
            return self._register(spec_hash, worker_id, start_clock, host)
        finally:
            self.flush()  # moving a worker forward may have closed a sync round

    def _register(self, spec_hash: str, worker_id: int, start_clock: int, host: str) -> dict:
        core, policy = self.core, self.core.policy
        with core.cond:
            core.require_up()
            spec = self.served.spec
            if spec_hash and spec is not None and spec_hash != spec.hash():
                raise SpecMismatch(
                    f"model spec hash {spec_hash[:12]} differs from this shard's "
                    f"{spec.hash()[:12]}: every worker must build the same model"
                )
            if worker_id < 0:
                worker_id = self.leases.new_id(taken=policy.departed)
            if not policy.is_live(worker_id) and len(policy.clocks) >= MAX_MEMBERS:
                raise Unavailable(
                    f"shard {core.config.shard_index} holds {MAX_MEMBERS} live workers, its most: another "
                    f"joins once one leaves or is evicted",
                    Reason.TOO_MANY_CONNECTIONS,
                )
            # An evicted worker that comes back at a later clock pushed to the other shards meanwhile:
            # what it pushed while it was not a member here is as lost as what a restart forgot.
            before = policy.clocks.get(worker_id, policy.departed.get(worker_id))
            clock = policy.join(worker_id, start_clock if start_clock >= 0 else None)
            if before is not None and clock > before:
                missed_pushes(core, worker_id, before, clock, "registered")
            self.leases.add(worker_id, host, core.now())
            if spec_hash and spec is None:
                self.spec_hashes[worker_id] = spec_hash  # the first Init decides whose model is the job's
            self.close_rounds()
            core.cond.notify_all()
            return {"worker_id": worker_id, "start_clock": clock, **self.served.layout_fields()}

    def admit(self, spec_hash: str) -> None:
        """Init set the job's model (call under ``cond``): members that registered another were never the job's.

        They learn it at their next call.
        """
        for worker in [w for w, h in self.spec_hashes.items() if h != spec_hash]:
            log.warning(
                "shard %d: worker %d registered another model spec than the one Init set; dropped",
                self.core.config.shard_index,
                worker,
            )
            self.drop(worker)
        self.spec_hashes.clear()

    def mark_gone(self, worker: int) -> None:
        """Record that a worker which never joined will not come (its launcher saw it exit).

        Those waiting for the whole job count it as departed; if it does come after all, it joins.
        """
        core, policy = self.core, self.core.policy
        with core.cond:
            if not policy.is_live(worker):
                policy.departed.setdefault(worker, 0)
                policy.forget_oldest_departed()
                core.cond.notify_all()

    def heartbeat(self, worker: int) -> bool:
        core = self.core
        with core.cond:
            return core.policy.is_live(worker) and self.leases.renew(worker, core.now())

    def leave(self, worker: int) -> None:
        with self.core.cond:
            self.drop(worker)
        self.flush()  # the departure may have closed a sync round

    def drop(self, worker: int) -> None:
        """Drop ``worker`` (call under ``cond``): waits stop counting it, and the rounds it held open may close."""
        self.leases.remove(worker)
        self.core.policy.leave(worker)
        self.spec_hashes.pop(worker, None)
        self.claims.forget(worker)
        self.close_rounds()
        self.core.cond.notify_all()

    def evict_expired(self) -> list[int]:
        """Drop every worker whose lease ran out; waits that counted them are released."""
        core = self.core
        with core.cond:
            expired = self.leases.expired(core.now())
            for worker in expired:
                core.counters.evictions += 1
                self.drop(worker)
                core.emit("eviction", worker=worker)
        self.flush()
        return expired

    def evict_stalled(self) -> list[int]:
        """sync and ssp: drop every worker the others wait on that has not pushed for ``progress_timeout_s``.

        Its heartbeat may be alive (a hung training loop with a live heartbeat thread): leases alone
        would never release the others. A worker that pushes again later registers anew.
        """
        core, policy = self.core, self.core.policy
        timeout = core.config.progress_timeout_s
        if not timeout or not policy.waits_on_pull:
            return []
        with core.cond:
            stalled = [w for w in self.leases.stalled(core.now(), timeout) if policy.holding_back(w)]
            for worker in stalled:
                core.counters.evictions += 1
                core.counters.stalled_evictions += 1
                self.drop(worker)
                core.emit("eviction", worker=worker)
        self.flush()
        return stalled


def missed_pushes(core: ShardCore, worker: int, had: int, now_at: int, how: str) -> None:
    """A live worker moved ahead of the clock this shard had for it (call under ``cond``): this shard missed its pushes.

    It ``registered`` or ``pushed`` at a later clock. In async and ssp each missed push is a lost
    update; in sync the rounds it skipped are counted when they close with no gradient
    (:meth:`Pushes.close_rounds`).
    """
    log.warning(
        "shard %d: worker %d %s at clock %d, this shard had it at %d: %d push(es) it never took "
        "(a restart from an older checkpoint, or pushes it refused)",
        core.config.shard_index,
        worker,
        how,
        now_at,
        had,
        now_at - had,
    )
    if not core.policy.accumulates:
        core.counters.lost_updates += now_at - had
