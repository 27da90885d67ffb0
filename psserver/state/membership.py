"""Leases: who is alive and who makes progress, judged against a clock the caller passes in (pure, testable).

Two signs are tracked per member: ``last_seen`` (any heartbeat or request: the process lives)
and ``last_progress`` (joining or pushing: the training loop moves). A worker whose heartbeat
thread lives while its loop hangs keeps the first fresh and lets the second age.
"""

from __future__ import annotations

from dataclasses import dataclass


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
