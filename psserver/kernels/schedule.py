"""The learning rate over a job: warmed up, held, or decayed to zero as the shard's updates go by.

A script's own scheduler (``torch.optim.lr_scheduler``) cannot reach an optimizer that runs on
the shards, so the shards keep the schedule. Its clock is the shard's version, the updates it has
applied (one per round in sync, one per push in async and ssp), plus those it knows were lost
(``lost_updates``: a restore from an older checkpoint, a refused push), both of which a checkpoint
keeps: a restored shard goes on where the workers' steps are. Its length is ``lr_updates``: what psctl derives
from the job (``[train] steps`` in sync, workers x steps in async and ssp), so every mode sees the
same rate at the same share of the job's samples.

The factor at version ``v`` (the update that makes version v + 1), with ``U = lr_updates`` and
``K = round(lr_warmup * U)`` warm-up updates (at most U - 1 with a decay)::

    v < K:       (v + 1) / K                                 (linear warm-up from lr / K to lr)
    after, with p = min(1, (v - K) / (U - K)):
      constant:  1
      linear:    1 - p
      cosine:    (1 + cos(pi * p)) / 2

so a decay reaches zero at update U and stays there. Decaying the rate is what settles the noise
of the last updates (the final weights of a run that ends at full rate sit anywhere in that noise):
on a stale mode's runs it is the difference between seeds that end together and seeds that do not
(docs/experiments/README.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LR_SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LrSchedule:
    """What multiplies ``lr`` at each of the shard's updates.

    Parameters
    ----------
    kind : str
        One of LR_SCHEDULES.
    updates : int
        The schedule's length U in the shard's updates (> 0 where anything changes the rate).
    warmup : float
        The share of U spent warming up, in [0, 1).
    """

    kind: str = "constant"
    updates: int = 0
    warmup: float = 0.0

    def __post_init__(self):
        if self.kind not in LR_SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {LR_SCHEDULES}, got {self.kind!r}")
        if not 0.0 <= self.warmup < 1.0:
            raise ValueError(f"lr_warmup must be in [0, 1), got {self.warmup}")
        if self.updates < 0:
            raise ValueError(f"lr_updates must be >= 0, got {self.updates}")
        if self.changes_rate and self.updates == 0:
            raise ValueError(
                f"lr_schedule = {self.kind!r} with lr_warmup = {self.warmup:g} needs lr_updates, the updates the "
                "shard will apply (psctl launch, mpi and compare derive it from [train] steps)"
            )

    @property
    def changes_rate(self) -> bool:
        """Whether the rate ever differs from ``lr``."""
        return self.kind != "constant" or self.warmup > 0

    @property
    def warmup_updates(self) -> int:
        """K: at most U - 1 where the rate decays, so that a decay always has an update to run over."""
        warm = round(self.warmup * self.updates)
        return min(warm, self.updates - 1) if self.kind != "constant" else warm

    def factor(self, version: int) -> float:
        """What multiplies ``lr`` in the update that makes version ``version + 1``."""
        if not self.changes_rate:
            return 1.0
        warm = self.warmup_updates
        if version < warm:
            return (version + 1) / warm
        if self.kind == "constant":
            return 1.0
        progress = min(1.0, (version - warm) / max(1, self.updates - warm))
        if self.kind == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))


CONSTANT = LrSchedule()  # lr at every update
