"""Leases: who is alive, judged against a clock the caller passes in (pure, testable)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Member:
    worker_id: int
    host: str
    last_seen: float


class Leases:
    """Tracks the last sign of life of each worker; ``expired(now)`` names those past ``lease_s``."""

    def __init__(self, lease_s: float):
        self.lease_s = lease_s
        self.members: dict[int, Member] = {}
        self.next_id = 0

    def new_id(self) -> int:
        worker_id = self.next_id
        self.next_id += 1
        return worker_id

    def add(self, worker_id: int, host: str, now: float) -> None:
        self.members[worker_id] = Member(worker_id, host, now)
        self.next_id = max(self.next_id, worker_id + 1)

    def renew(self, worker_id: int, now: float) -> bool:
        member = self.members.get(worker_id)
        if member is None:
            return False
        member.last_seen = now
        return True

    def remove(self, worker_id: int) -> None:
        self.members.pop(worker_id, None)

    def expired(self, now: float) -> list[int]:
        return [m.worker_id for m in self.members.values() if now - m.last_seen > self.lease_s]
