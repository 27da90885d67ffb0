"""What every part of a shard shares: its locks, clock, settings, policy, counters and whether it is up.

Each part of :class:`~psgrid.psserver.state.shard.Shard` (membership.py, snapshots.py, pushes.py,
shard_checkpoints.py) is given this core, the served range (served_range.py) where it reads the
weights, and the other parts it talks to, each by name: no part reaches into the shard.
"""

from __future__ import annotations

import threading
import time

from psgrid.psserver.config import ServerConfig
from psgrid.psserver.exceptions import Unavailable, UnknownWorker
from psgrid.psserver.protocol import Reason
from psgrid.psserver.state.counters import Counters
from psgrid.psserver.state.policy import ConsistencyPolicy


class ShardCore:
    """The lock every state change happens under, and what every part reads under it.

    Parameters
    ----------
    config : ServerConfig
    now : callable
        Monotonic clock; tests inject a fake one to expire leases.
    """

    def __init__(self, config: ServerConfig, now=time.monotonic):
        self.config = config
        self.now = now
        # Every state change happens under ``cond``; every change that could release a waiting pull notifies it.
        self.cond = threading.Condition()
        # async: an update is computed outside ``cond`` (weights are never changed in place, so pulls
        # and everything else go on meanwhile); updates queue on this lock, taken before ``cond``.
        self.apply_lock = threading.Lock()
        # a departed worker the policy forgets (the oldest, past MAX_DEPARTED) takes its wait time with it
        self.policy = ConsistencyPolicy(
            config.mode,
            config.staleness,
            config.backup_workers,
            on_forget=lambda worker: self.counters.wait_s_by_worker.pop(worker, None),
        )
        self.counters = Counters()
        self.listeners: list = []  # callables(event: str, **fields) for metrics exporters
        self.closing = False  # set by Shard.close(): waits end, new calls are refused
        self.restoring = False  # set while a checkpoint is loaded: calls are refused as UNAVAILABLE

    def emit(self, event: str, **fields) -> None:
        """Tell the metrics exporters (``listeners``) of ``event``."""
        for listener in self.listeners:
            listener(event, **fields)

    def require_up(self) -> None:
        if self.closing:
            raise Unavailable(f"shard {self.config.shard_index} is shutting down")
        if self.restoring:
            raise Unavailable(f"shard {self.config.shard_index} is restoring its checkpoint", Reason.RESTORING)

    def require_live(self, worker: int) -> None:
        if not self.policy.is_live(worker):
            raise UnknownWorker(
                f"worker {worker} is unknown or was evicted from shard {self.config.shard_index}; register again"
            )
