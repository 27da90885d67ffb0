"""What a push may claim: a version this shard published, and a clock it has taken pushes up to.

A shard restarted from a checkpoint has forgotten what it published and took after that
checkpoint; its workers have not. So a restart explains a push from the future for a while: a
version past the restored one until the worker's first pull from this process (it may have been
computed before the restart), a clock past the one restored for the worker until its first push
here. Anything else that claims what never happened here is refused, before it changes any state.
"""

from __future__ import annotations

import math

from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.protocol import Reason


class Claims:
    """The restart a shard came from (if any), and each worker's first pull since; all read and set under ``cond``."""

    def __init__(self):
        self.restored_version = -1  # the checkpoint's version, -1 for a fresh start
        self.restored_clocks: dict[int, int] = {}  # each member's clock in the checkpoint
        self.first_pulls: dict[int, int] = {}  # the clock of each worker's first pull from this process

    def restored(self, version: int, clocks: dict[int, int]) -> None:
        self.restored_version = version
        self.restored_clocks = dict(clocks)

    def pulled(self, worker: int, clock: int) -> None:
        """``worker`` pulls at ``clock``: from then on its pushes were computed from versions of this process."""
        if self.restored_version >= 0 and worker not in self.first_pulls:
            self.first_pulls[worker] = clock

    def forget(self, worker: int) -> None:
        self.first_pulls.pop(worker, None)

    def check(self, worker: int, clock: int, version_used: int, expected: int, version: int, clocks_lead: bool) -> None:
        """Refuse a push at ``clock`` from ``version_used`` that claims what never happened here.

        ``expected`` is the worker's clock here and ``version`` the shard's. ``clocks_lead``: a push's
        clock must not pass the worker's clock here (async and ssp; sync moves a worker to a round
        another shard closed first).
        """
        if version_used > version and (self.restored_version < 0 or clock >= self.first_pulls.get(worker, math.inf)):
            raise InvalidArgument(
                f"worker {worker}'s push at clock {clock} was computed from version {version_used}, "
                f"but this shard has published versions up to {version}",
                Reason.FUTURE_VERSION,
            )
        if clock > expected and clocks_lead and self.restored_clocks.get(worker) != expected:
            raise InvalidArgument(
                f"worker {worker} pushed clock {clock}, but this shard has its pushes up to clock "
                f"{expected} only: register again with start_clock {clock} to move on",
                Reason.FUTURE_CLOCK,
            )
