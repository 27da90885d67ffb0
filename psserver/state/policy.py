"""Consistency policies as pure state machines: events in, decisions out.

No gRPC, no threads, no clocks: the shard feeds events (a worker joined, pushed
clock c, left) and asks questions (may worker w pull at clock c?). Tests drive it
directly, without sockets (see tests/test_policy.py).

A worker's clock is the number of pushes the shard has taken from it; a push
carries the clock it was made at, so a worker's first push carries 0.

* ``async``: a push is applied at once; a pull never waits.
* ``ssp``: a push is applied at once; a pull at clock c waits until the slowest
  live worker's clock is at least ``c - staleness``.
* ``sync``: a push for round c is accumulated; round c closes once
  ``max(1, live - backup_workers)`` live workers have moved past c, and then
  the mean of the gradients received for it is applied once. A push for a
  round that has closed is dropped and counted, and the pusher's clock jumps
  to the open round so it catches up instead of lagging forever. A pull at
  clock c waits until round c-1 has closed.

A push whose clock is below the worker's clock is a retry of one already taken
and is acknowledged without effect (``DUPLICATE``). A push whose clock is above
it fast-forwards the worker (the shard restarted from an older checkpoint), at
most to ``MAX_START_CLOCK``.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from dataclasses import dataclass

from psgrid.psserver.exceptions import InvalidArgument, UnknownWorker
from psgrid.psserver.protocol import MODES, Outcome, mode_rules

__all__ = ["MODES", "ConsistencyPolicy", "Outcome", "PushDecision"]

MAX_DEPARTED = 1 << 16  # departed workers remembered (the newest)
# Clocks stay exact as a float64, so JSON and checkpoints keep them: a push carries at most
# MAX_CLOCK - 1. A worker starts at, or is moved ahead to, at most MAX_START_CLOCK, which leaves
# it 2^52 pushes below the bound: more than any job makes.
MAX_CLOCK = 2**53
MAX_START_CLOCK = 2**52


@dataclass(frozen=True)
class PushDecision:
    outcome: Outcome
    round: int  # the push's clock (its sync round)
    next_clock: int  # the clock the worker's next push must carry


class ConsistencyPolicy:
    """Clocks, membership and round bookkeeping for one shard.

    Parameters
    ----------
    mode : {"sync", "async", "ssp"}
    staleness : int
        The ssp bound s (ignored by the other modes).
    backup_workers : int
        sync only: a round closes when all but this many live workers pushed it.
    """

    def __init__(
        self, mode: str, staleness: int = 0, backup_workers: int = 0, on_forget: Callable[[int], object] | None = None
    ):
        if mode not in MODES:
            raise InvalidArgument(f"mode must be one of {MODES}, got {mode!r}")
        if staleness < 0 or backup_workers < 0:
            raise InvalidArgument("staleness and backup_workers must be non-negative")
        self.mode = mode
        # What the mode does, asked by the shard (accumulates, waits_on_pull, bounded) and here alike.
        rules = mode_rules(mode)
        self.accumulates, self.waits_on_pull, self.bounded = rules.accumulates, rules.waits_on_pull, rules.bounded
        self.staleness = staleness
        self.backup_workers = backup_workers
        self.clocks: dict[int, int] = {}  # live worker -> its clock
        self.closed_rounds = 0  # sync: rounds 0..closed_rounds-1 are closed
        self.round_pushers: dict[int, set[int]] = {}  # sync: open round -> workers whose gradient it holds
        # The clock each departed worker had: one that comes back (a reply lost past its lease,
        # then a retry) must not push the same clock a second time.
        self.departed: dict[int, int] = {}
        self.on_forget = on_forget  # told of each departed worker forgotten, so what else it keeps of one goes too

    # ----- membership -------------------------------------------------------------------------

    def join(self, worker: int, start_clock: int | None = None) -> int:
        """Add a live worker (or keep a live one as it is) and return its clock.

        In ssp a worker never starts behind the slowest live clock, even when it asks to: an
        evicted worker that rejoins with the clock it had must not hold the others back again,
        and the stale pushes it still carries are acknowledged without being applied (past the
        bound). In sync such pushes are dropped as late and the worker jumps to the open round.
        """
        if worker in self.clocks:
            # A live worker asking for a later clock is ahead of what this shard remembers: the shard
            # restarted from a checkpoint older than the worker's last pushes. It moves forward (what
            # it missed is lost, and counted by the shard) instead of holding the others back.
            if start_clock is not None and start_clock > self.clocks[worker]:
                self.clocks[worker] = start_clock
            return self.clocks[worker]
        if start_clock is None or start_clock < 0:
            start_clock = self.slowest_clock()
            if self.accumulates:
                start_clock = max(start_clock, self.closed_rounds)
        elif self.bounded:
            start_clock = max(start_clock, self.slowest_clock())
        start_clock = max(start_clock, self.departed.pop(worker, 0))
        self.clocks[worker] = start_clock
        return start_clock

    def leave(self, worker: int) -> None:
        """Drop a worker (evicted or finished): waits stop counting it. Its accumulated gradient stays."""
        if worker in self.clocks:
            self.departed[worker] = self.clocks.pop(worker)
            self.forget_oldest_departed()

    def forget_oldest_departed(self) -> None:
        # Bounded, so that ids made up by strangers cannot grow it without end; the oldest go first.
        while len(self.departed) > MAX_DEPARTED:
            worker = next(iter(self.departed))
            del self.departed[worker]
            if self.on_forget is not None:
                self.on_forget(worker)

    def is_live(self, worker: int) -> bool:
        return worker in self.clocks

    def slowest_clock(self) -> int:
        """The smallest live clock; with no live worker, the sync open round (or 0)."""
        if self.clocks:
            return min(self.clocks.values())
        return self.closed_rounds if self.accumulates else 0

    def fastest_clock(self) -> int:
        return max(self.clocks.values()) if self.clocks else self.slowest_clock()

    def holding_back(self, worker: int) -> bool:
        """Whether a live worker is one that others' pulls wait on now (sync and ssp; never async).

        sync: it has not pushed the open round while another worker has (and waits for the round
        to close). ssp: its clock is more than the bound behind the fastest worker's.
        """
        clock = self.clocks.get(worker)
        if clock is None or not self.waits_on_pull:
            return False
        if self.accumulates:
            return clock <= self.closed_rounds and self.fastest_clock() > self.closed_rounds
        return clock < self.fastest_clock() - self.staleness

    # ----- pushes -----------------------------------------------------------------------------

    def on_push(self, worker: int, clock: int) -> PushDecision:
        """Decide what to do with worker ``worker``'s push made at ``clock``."""
        if worker not in self.clocks:
            raise UnknownWorker(f"worker {worker} is not a live member of this shard; register again")
        if clock < 0:
            raise InvalidArgument(f"clock must be non-negative, got {clock}")
        expected = self.clocks[worker]
        if clock < expected:
            return PushDecision(Outcome.DUPLICATE, clock, expected)
        self.check_ahead(worker, clock)
        if not self.accumulates:
            self.clocks[worker] = clock + 1
            return PushDecision(Outcome.APPLIED, clock, clock + 1)
        if clock < self.closed_rounds:
            self.clocks[worker] = self.closed_rounds
            return PushDecision(Outcome.DROPPED_LATE, clock, self.closed_rounds)
        self.clocks[worker] = clock + 1
        self.round_pushers.setdefault(clock, set()).add(worker)
        return PushDecision(Outcome.ACCUMULATED, clock, clock + 1)

    def check_ahead(self, worker: int, clock: int) -> None:
        """Refuse a push that would move ``worker`` ahead past ``MAX_START_CLOCK`` (it could not push on)."""
        if clock > MAX_START_CLOCK and clock > self.clocks[worker]:
            raise InvalidArgument(
                f"clock {clock} would move worker {worker} ahead from {self.clocks[worker]} past "
                f"{MAX_START_CLOCK}, the furthest a worker may move ahead"
            )

    def quorum(self) -> int:
        """sync: how many live workers must be past a round for it to close."""
        return max(1, len(self.clocks) - self.backup_workers)

    def rounds_to_close(self) -> range:
        """sync: close every round that now has its quorum, oldest first, and return them.

        The caller applies each returned round's mean gradient, in order. A round closes only
        after all earlier ones, and never with no live worker past it: the rounds below the
        clock that ``quorum`` live workers have reached. A range, as a worker moved far ahead
        closes as many rounds at once (with no gradient), at no cost per round.
        """
        first = self.closed_rounds
        if not self.accumulates or not self.clocks:
            return range(first, first)
        if sum(1 for c in self.clocks.values() if c > first) < self.quorum():
            return range(first, first)  # most pushes: the open round stays open
        closed = range(first, heapq.nlargest(self.quorum(), self.clocks.values())[-1])
        for round_ in [r for r in self.round_pushers if r in closed]:
            del self.round_pushers[round_]
        self.closed_rounds = closed.stop
        return closed

    def pushers(self, round_: int) -> set[int]:
        return set(self.round_pushers.get(round_, ()))

    # ----- pulls ------------------------------------------------------------------------------

    def may_pull(self, worker: int, clock: int) -> bool:
        """Whether a pull by ``worker`` at ``clock`` may be answered now.

        Observers (worker < 0) and workers that are no longer live never wait: an
        evicted worker learns of its eviction at its next push instead of hanging.
        """
        if worker < 0 or worker not in self.clocks or not self.waits_on_pull:
            return True
        if self.accumulates:
            return self.closed_rounds >= clock
        return self.slowest_clock() >= clock - self.staleness
