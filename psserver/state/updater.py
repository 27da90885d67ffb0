"""How a shard turns a gradient into the next version of its weights: one :class:`Updater`, chosen at Init.

Which update runs is decided once, from the settings and the mode, when a shard takes on a range
(an Init or a restore), and checked then, before any weights are published: a setting the
optimizer refuses refuses the Init and leaves the shard as it was. Three kinds:

:class:`HostUpdater`
    The optimizer's step, from the current version into a spare buffer of the ring.
:class:`CompensatedUpdater`
    The same with a staleness remedy (async and ssp only: in sync every gradient of a round is
    computed from the version it is applied to). ``async_momentum = "auto"`` sets the momentum
    from the live workers before each step; ``dc`` corrects the gradient from the version it was
    computed from, which the ring keeps (``dc_versions``).
:class:`DeviceUpdater`
    A device shard's step (``shard_device = "gpu"``): its own weights updated in place on the GPU
    and the next version written into the ring's buffer in the same pass.

An update is planned under the shard's lock (:meth:`Updater.plan`: which buffer it reads, which
it writes), computed (:meth:`Updater.apply`, outside the lock in async), and published by the
caller. Weights are never changed in place where a reader may see them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.kernels.compensation import DelayCompensation, effective_momentum
from psgrid.psserver.kernels.optim import check_settings, make_optimizer
from psgrid.psserver.kernels.parallel import Chunks
from psgrid.psserver.kernels.schedule import CONSTANT, LrSchedule
from psgrid.psserver.state.weight_ring import WeightRing


class Step(NamedTuple):
    """The buffers of one planned update."""

    source: int  # the ring's buffer the update reads: the current version
    target: int  # the one it writes the next version into
    pulled: int | None  # dc: the buffer that still holds the version the gradient came from


class Updater:
    """What every update shares: the optimizer, the lr rule, and planning then applying a step.

    Parameters
    ----------
    optimizer
        The range's optimizer (kernels/optim.py, or kernels/device_optim.py on a GPU).
    arrays : HostArrays or GpuArrays
        Where the shard's arrays live (state/device.py).
    lr_staleness : bool
        ``staleness_compensation = "lr"``: scale each step by 1/max(1, staleness).
    schedule : LrSchedule
        The rate over the shard's updates (kernels/schedule.py).
    """

    keep_versions = 0  # past versions the ring keeps for the update to read (dc)

    def __init__(self, optimizer, arrays, *, lr_staleness: bool = False, schedule: LrSchedule = CONSTANT):
        self.optimizer = optimizer
        self.arrays = arrays
        self.lr_staleness = lr_staleness
        self.schedule = schedule

    def lr_scale(self, staleness: int, version: int) -> float:
        """What multiplies ``lr`` in the update from ``version`` of a gradient ``staleness`` versions old."""
        scale = self.schedule.factor(version)
        return scale / max(1, staleness) if self.lr_staleness else scale

    def weights(self, ring: WeightRing):
        """The weights the next update starts from (and a checkpoint holds)."""
        return ring.weights

    def hold(self, values):
        """The weights a new ring starts from, where this updater's own copy lives (a device shard's)."""
        return values

    def plan(self, ring: WeightRing, version: int, version_used: int | None = None) -> Step:
        """Choose the buffers of the next update (call under the shard's lock); ``version`` is the current one."""
        return Step(ring.current, ring.spare(), None)

    def apply(
        self, ring: WeightRing, step: Step, grad, lr_scale: float, *, check_finite: bool = False, flag=None
    ) -> None:
        """Write the next version into ``step.target``; done (on a GPU too) when this returns.

        ``check_finite`` refuses a gradient with NaN or infinity, changing no state (InvalidArgument);
        so does ``flag``, a device shard's check of ``grad`` still on the GPU (GpuArrays.check_into),
        which the update reads there, in the same wait for the GPU.
        """
        if flag is not None and not self.arrays.on_gpu:  # a host update would pass over it: NaN unchecked
            raise ValueError("a check's flag on the GPU reaches a device shard's update only")
        with self.arrays.use():
            self._step(ring, step, grad, lr_scale, check_finite, flag)
            self.arrays.finished()  # written before it is published: readers elsewhere copy it at once

    def _step(self, ring: WeightRing, step: Step, grad, lr_scale: float, check_finite: bool, flag=None) -> None:
        raise NotImplementedError

    def uncompensated(self, step: Step) -> bool:
        """Whether a remedy that needs the pulled version went without it (counted in stats)."""
        return False


class HostUpdater(Updater):
    """A host shard's plain update: ``optimizer.step`` from the current version into a spare buffer."""

    def _step(self, ring: WeightRing, step: Step, grad, lr_scale: float, check_finite: bool, flag=None) -> None:
        self.optimizer.step(
            ring.arrays[step.source], grad, lr_scale, out=ring.arrays[step.target], check_finite=check_finite
        )


class _AutoMomentum:
    """``async_momentum = "auto"``: the explicit momentum less what the live workers' asynchrony adds.

    SGD's ``momentum``, or Adam's ``beta1`` (the decay of its gradients' mean, Adam's momentum):
    ``key`` names which. Read at each update (under ``apply_lock`` in async, ``cond`` in ssp, so
    never during a step), so it follows the membership as workers come and go.
    """

    def __init__(self, momentum: float, live_workers: Callable[[], int], key: str = "momentum"):
        self.momentum = momentum
        self.live_workers = live_workers
        self.key = key

    def tune(self, optimizer) -> None:
        momentum = effective_momentum(self.momentum, self.live_workers())
        if momentum != getattr(optimizer, self.key):
            getattr(optimizer, f"set_{self.key}")(momentum)


class CompensatedUpdater(HostUpdater):
    """A host update with a staleness remedy: auto momentum, delay compensation (dc), or both."""

    def __init__(
        self,
        optimizer,
        arrays,
        *,
        lr_staleness: bool = False,
        schedule: LrSchedule = CONSTANT,
        auto_momentum: _AutoMomentum | None = None,
        delay: DelayCompensation | None = None,
        dc_versions: int = 0,
    ):
        super().__init__(optimizer, arrays, lr_staleness=lr_staleness, schedule=schedule)
        self.auto_momentum = auto_momentum
        self.delay = delay
        self.dc_versions = dc_versions
        self.keep_versions = dc_versions if delay is not None else 0

    def plan(self, ring: WeightRing, version: int, version_used: int | None = None) -> Step:
        if self.delay is None:  # auto momentum alone
            return Step(ring.current, ring.spare(), None)
        # dc reads the version the gradient came from (if the ring still holds it), and keeps the last few
        pulled = None if version_used is None else ring.find(version_used)
        return Step(ring.current, ring.spare_keeping(pulled, version - self.dc_versions + 1), pulled)

    def _step(self, ring: WeightRing, step: Step, grad, lr_scale: float, check_finite: bool, flag=None) -> None:
        if self.auto_momentum is not None:
            self.auto_momentum.tune(self.optimizer)
        if self.delay is None:
            super()._step(ring, step, grad, lr_scale, check_finite)
            return
        self.optimizer.step(
            ring.arrays[step.source],
            grad,
            lr_scale,
            out=ring.arrays[step.target],
            check_finite=check_finite,
            delay=self.delay,
            pulled=None if step.pulled is None else ring.arrays[step.pulled],
        )

    def uncompensated(self, step: Step) -> bool:
        return self.delay is not None and step.pulled is None


class DeviceUpdater(Updater):
    """A device shard's update: its own weights (``master``) updated in place, the next version written to the ring.

    Readers map the ring's buffers through CUDA IPC, which can only map them writable: the shard
    reads none of them, so a reader that writes one changes what readers of that version copy,
    never the weights the next update starts from, the optimizer state, or a checkpoint.
    """

    def __init__(
        self,
        optimizer,
        arrays,
        *,
        lr_staleness: bool = False,
        schedule: LrSchedule = CONSTANT,
        auto_momentum: _AutoMomentum | None = None,
    ):
        super().__init__(optimizer, arrays, lr_staleness=lr_staleness, schedule=schedule)
        self.auto_momentum = auto_momentum
        self.master = None

    def weights(self, ring: WeightRing):
        return self.master

    def hold(self, values):
        self.master = self.arrays.adopt(values)
        return self.master

    def _step(self, ring: WeightRing, step: Step, grad, lr_scale: float, check_finite: bool, flag=None) -> None:
        if self.auto_momentum is not None:
            self.auto_momentum.tune(self.optimizer)
        # The published copy is written in the update's own pass (the next weights go to both buffers).
        self.optimizer.step(
            self.master, grad, lr_scale, check_finite=check_finite, publish=ring.arrays[step.target], flag=flag
        )


def make_updater(config, arrays, size: int, *, stale: bool, parts: Chunks, live_workers: Callable[[], int]) -> Updater:
    """The update of a range of ``size`` elements, built and checked (InvalidArgument) before anything is published.

    ``stale``: the mode applies gradients computed from older versions (async, ssp), where the
    staleness remedies act. ``live_workers()`` counts the live workers, for auto momentum.
    """
    hparams = config.optimizer_hparams()
    check_settings(hparams)  # every setting, used or not, by the bounds the job check holds to
    lr_staleness = config.compensation == "lr"
    schedule = config.schedule()
    auto = None
    key = config.momentum_key
    if config.auto_momentum and stale:
        auto = _AutoMomentum(getattr(config, key), live_workers, key)
    dc = config.compensation == "dc" and stale
    if arrays.on_gpu:
        if dc:
            raise InvalidArgument(
                "staleness_compensation = 'dc' runs on host shards only: use shard_device = 'cpu', "
                "or staleness_compensation = 'lr' or 'none'"
            )
        from psgrid.psserver.kernels.device_optim import make_device_optimizer

        with arrays.use():
            optimizer = make_device_optimizer(config.optimizer, size, **hparams)
            optimizer.warm_up()  # compiled now, not in a worker's first push
        arrays.warm_up()
        return DeviceUpdater(optimizer, arrays, lr_staleness=lr_staleness, schedule=schedule, auto_momentum=auto)
    optimizer = make_optimizer(config.optimizer, size, chunks=parts, **hparams)
    if auto is None and not dc:
        return HostUpdater(optimizer, arrays, lr_staleness=lr_staleness, schedule=schedule)
    delay = DelayCompensation(size, config.dc_lambda0, config.dc_beta) if dc else None
    return CompensatedUpdater(
        optimizer,
        arrays,
        lr_staleness=lr_staleness,
        schedule=schedule,
        auto_momentum=auto,
        delay=delay,
        dc_versions=config.dc_versions if dc else 0,
    )
