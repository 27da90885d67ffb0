"""The pull-ahead: the weights of step c+1 are pulled while step c computes.

A worker keeps two parameter buffers (on its GPU, or in host memory on the CPU). Once the weights of
step c have landed in one, the pull for step c+1 starts in the background into the other, and step
c computes from the first; step c+1 waits for that pull (usually long done) and the two swap. With
the push of step c also in the background (``overlap``), a step costs about the longest of compute
plus the gradient's copy, the pull and the push, rather than their sum.

What it costs: the pull for step c+1 is made before step c pushes, while the push of step c-1 may
still be in flight, so the gradient of step c+1 is computed from weights that may lack this
worker's pushes c and c-1: one step more of staleness than ``overlap`` alone (a lone async worker
sees up to 2). In ssp that pull is made at clock c, not c+1, so the bound the shards keep grows by
one for this worker. With momentum that staleness costs accuracy (docs/performance.md, "The
pull-ahead"), so it is off unless asked for (``pull_ahead = true``). Every push carries the
versions of the pull its gradient was computed from (the client's own last pull is by then the
next step's), so the shards count staleness, and delay compensation finds its weights, from the
right version.

A shard restarted from its checkpoint takes a push that names a version past its own only before
the worker's first pull from the new process at a clock up to the push's (psserver/state/pushes.py),
and the pull for step c+1 is made at clock c, before the push of step c. So before that push the
next step's pull is waited for (in the steady state it ended during the compute) and the push names,
per shard, the lower of the two pulls' versions: what the new process has published.
"""

from __future__ import annotations

import time

from psgrid.psserver.protocol import ModeRules
from psgrid.worker.config import TrainConfig
from psgrid.worker.flat import FlatBuffers


def pulls_ahead(train: TrainConfig, rules: ModeRules) -> bool:
    """Whether a worker of ``train`` pulls ahead under a mode's ``rules``: asked to, with overlap, where pushes
    are not held for a round (async, ssp).

    ``pull_ahead = true`` in sync is refused by the job file's check; a worker started by hand in
    sync just pulls when each step starts, as sync must.
    """
    return train.pull_ahead and train.overlap is not False and train.aggregate == "none" and not rules.accumulates


class PullAhead:
    """Two parameter buffers, taken in turn: ``bufs.params`` is this step's, the other is being filled.

    Parameters
    ----------
    bufs : FlatBuffers
        The worker's buffers; the model reads ``bufs.param_views``, which :meth:`pull` swaps.
    spec : ModelSpec
        The layout of the second buffer's views.

    Attributes
    ----------
    versions : list of int
        The shards' versions of the weights in ``bufs.params``: what this step's push carries.
    pulled_s : float or None
        How long the pull of this step's weights took in the background (None where it was made
        when the step started: the first step).
    waited_s : float
        What this step waited for its weights, before the push of the step before (:meth:`push_versions`).
    """

    def __init__(self, bufs: FlatBuffers, spec):
        self.bufs = bufs
        self.spare = spec.flat(bufs.xp)
        self.spare_views = spec.views(self.spare)
        self.pending = None  # the pull into ``spare``, made during the step before
        self.versions: list[int] = []
        self.pulled_s: float | None = None
        self.waited_s = 0.0
        self._waited_before_push_s = 0.0

    def pull(self, ahead: bool = True) -> None:
        """Make ``bufs.params`` this step's weights; with ``ahead``, start the next step's pull into the other buffer.

        The first step pulls where it is called. ``ahead`` is false on the last step: nothing would read it.
        """
        self.waited_s, self._waited_before_push_s = self._waited_before_push_s, 0.0
        if self.pending is None:
            self.versions, self.pulled_s = self.bufs.pull().wait(), None
        else:
            handle, self.pending = self.pending, None
            self.versions, self.pulled_s = handle.wait(), handle.seconds
            current, views = self.bufs.params, self.bufs.param_views
            self.bufs.use_params(self.spare, self.spare_views)
            self.spare, self.spare_views = current, views
        if ahead:
            # The buffer the step before computed from: its compute (and the gradient's copy) has ended.
            # A posted pull's copies start once this step's kernels are launched (advance()), its answers
            # read then rather than waited for before the launches (benchmarks/host_step_parts.py compares).
            self.pending = self.bufs.pull_to(self.spare, background=True)

    def advance(self) -> None:
        """Once the step's kernels are launched: start the next step's copies, where its pull was posted
        (Client.post_pull: the shards' answers have come meanwhile, and reading them took the launches nothing)."""
        advance = getattr(self.pending, "advance", None)  # a Client's handle has it; another exchange's may not
        if advance is not None:
            advance()

    def push_versions(self) -> list[int]:
        """The versions this step's push names: its weights', or the next step's pull's where lower.

        Waits for the next step's pull first (counted in that step's ``waited_s``). Its versions are
        lower only where a shard went back to an older checkpoint between the two pulls; elsewhere
        the push names exactly the weights its gradient came from.
        """
        if self.pending is None:
            return self.versions
        t0 = time.perf_counter()
        later = self.pending.wait()
        self._waited_before_push_s = time.perf_counter() - t0
        return [min(used, now) for used, now in zip(self.versions, later)]
