"""What a shard counts as it serves: pushes, pulls, bytes, outcomes, staleness and waits (read by stats)."""

from __future__ import annotations

from dataclasses import dataclass, field

STALENESS_BUCKETS = 32


@dataclass
class Counters:
    """The running totals of one shard process (a restart starts them afresh but for ``lost_updates``)."""

    pushes: int = 0
    pulls: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    applied_updates: int = 0
    dropped_late: int = 0
    duplicates: int = 0
    evictions: int = 0
    stalled_evictions: int = 0  # of those, workers others waited on that made no progress
    lost_updates: int = 0  # known lost to a restart (see StatsReply.lost_updates)
    uncompensated: int = 0  # dc: stale updates applied as they came, their pulled version gone from the ring
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
