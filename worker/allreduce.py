"""The all-reduce baseline: synchronous data parallelism with no shards, as Horovod does it.

Every worker keeps the whole model and the optimizer's state. A step's gradients are summed
across workers with MPI ``Allreduce``, divided by the number of workers, and every worker applies
the same server-side optimizer (:mod:`psgrid.psserver.kernels.optim`) to its own copy. That is a
sync round of the parameter server, done everywhere at once: the same mean of the gradients, the
same optimizer maths, and with the same seeds and data order the same weights, up to the order in
which float32 additions are made.

On a GPU (``xp`` CuPy) the weights, the optimizer's state and the update stay on the device: the
optimizer is the same maths as one fused kernel (:mod:`~psgrid.psserver.kernels.device_optim`), the
loop computes its gradient straight into what is pushed, and the sum is NCCL's, or the host MPI's
where ranks share a GPU (:mod:`~psgrid.worker.reduction`); one rank reduces nothing. On the CPU the
update is the host optimizer's, as a shard makes it.
With ``wire_dtype`` float16 or bfloat16 each rank rounds its gradient through that type before the
sum, as a shard decodes a pushed gradient, so compression costs both the same accuracy (on a GPU
the rounding goes through the host: a setting for comparing accuracy, not for speed).

:class:`AllreduceExchange` has the surface of :class:`~psgrid.psserver.client.client.Client` that the
training loop uses, so the loop, the data, the straggler and the records are the same.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import numpy as np

from psgrid.psserver import dtypes as wire
from psgrid.psserver.config import ServerConfig
from psgrid.psserver.kernels.optim import make_optimizer
from psgrid.psserver.kernels.parallel import Chunks, default_threads
from psgrid.psserver.protocol import ITEMSIZE, Outcome, PushResult
from psgrid.worker.backend import pinned_empty

STOP_CHECK_EVERY = 16  # steps between the ranks' checks for a Ctrl-C that any of them heard


class Completed:
    """A finished pull or push, with the handle surface the loop reads (``wait()``, ``seconds``)."""

    def __init__(self, result, seconds: float):
        self._result, self.seconds = result, seconds

    def wait(self, timeout: float | None = None):
        return self._result


class AllreduceExchange:
    """Weights and optimizer of the whole model on this rank; gradients averaged over ``comm``.

    Parameters
    ----------
    comm : mpi4py communicator
        The job's workers, one rank each; rank r is worker r.
    init : ndarray
        The initial flat float32 weights, the same on every rank (the job's seed makes them).
    server : ServerConfig
        The optimizer and its settings, as the shards of a parameter-server job would use them.
    wire_dtype : str
        The job's gradient type on the wire (float32, float16, bfloat16).
    xp : module, optional
        numpy (the default: weights and update on the host) or cupy (on the current GPU).

    Attributes
    ----------
    on_device : bool
        The weights are a device array; ``push`` takes the device gradient.
    reduction : str
        How gradients are summed: "none" (one rank), "nccl", "mpi-host" (ranks sharing a GPU) or "mpi".
    """

    mode = "allreduce"
    data_planes: list = []

    def __init__(
        self,
        comm,
        init: np.ndarray,
        server: ServerConfig,
        wire_dtype: str = "float32",
        xp=np,
        heard: Callable[[], int | None] | None = None,
    ):
        self.wire_dtype = wire.wire_dtype(wire_dtype)
        self.comm = comm
        # The signal this process heard (None: none), asked every STOP_CHECK_EVERY steps: see _stop_together.
        self.heard = heard
        self.world = comm.Get_size()
        self.worker_id = comm.Get_rank()
        self.xp, self.on_device = xp, xp is not np
        self._chunks = None
        if self.on_device:
            self._on_device(init, server)
        else:
            self.weights = np.array(init, dtype=np.float32, copy=True)
            self._mean = np.empty_like(self.weights)
            # The shards' optimizer and its threads (a shard cuts its range among apply_threads threads).
            self._chunks = Chunks(server.apply_threads or default_threads())
            self.optimizer = make_optimizer(
                server.optimizer, self.weights.size, chunks=self._chunks, **server.optimizer_hparams()
            )
            self.reduction = "mpi" if self.world > 1 else "none"
        self.schedule = server.schedule()  # the shards' rate over their updates: here one a step
        self.clock = 0
        self.wait_s = 0.0  # seconds inside Allreduce: the transfer and waiting for the others

    def _on_device(self, init: np.ndarray, server: ServerConfig) -> None:
        from psgrid.psserver.kernels.device_optim import make_device_optimizer
        from psgrid.worker.reduction import device_reduction

        cupy = self.xp
        self.weights = cupy.array(init, dtype=cupy.float32)
        self.optimizer = make_device_optimizer(server.optimizer, self.weights.size, **server.optimizer_hparams())
        self.optimizer.warm_up()  # CuPy compiles on first launch: not inside the first timed step
        self._sum = device_reduction(self.comm, cupy, self.weights.size)
        self.reduction = "none" if self._sum is None else self._sum.kind
        self._rounding = (
            None if self.wire_dtype == wire.wire_dtype("float32") else pinned_empty(self.weights.size, np.float32, cupy)
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self._chunks is not None:
            self._chunks.close()

    def host_weights(self) -> np.ndarray:
        """The weights as a host array (a copy from the device on a GPU)."""
        return self.xp.asnumpy(self.weights) if self.on_device else self.weights

    def bytes_per_step(self, params: int) -> int:
        """Sent plus received by one rank in a ring all-reduce of ``params`` values: 2 x 2(W-1)/W x P x size."""
        return int(4 * params * ITEMSIZE[self.wire_dtype] * (self.world - 1) / self.world)

    def pull(self, out, *, background: bool = False) -> Completed:
        """Copy the weights into ``out``; nothing to copy when ``out`` is the weights (lent by FlatBuffers)."""
        t0 = time.perf_counter()
        if out is not self.weights:
            if not self.on_device:
                np.copyto(out, self.weights)
            elif isinstance(out, np.ndarray):
                self.weights.get(out=out)
            else:
                self.xp.copyto(out, self.weights)
        return Completed([self.clock], time.perf_counter() - t0)

    def push(self, grad, *, background: bool = False) -> Completed:
        if self.on_device:
            return self._push_on_device(grad)
        from mpi4py import MPI

        t0 = time.perf_counter()
        if self.wire_dtype != wire.wire_dtype("float32"):
            wire.decode_into(grad, wire.encode(grad, self.wire_dtype), self.wire_dtype)
        # A non-blocking Allreduce, driven by Test() and yielding the core between tests: a blocking
        # collective spins, and on a machine with fewer cores than workers the spinning ranks would slow
        # the straggler they wait for. Not a sleep: Open MPI's non-blocking collectives move only inside
        # Test(), and a 0.2 ms sleep between tests made an 80 MB Allreduce take 0.6 s instead of 0.06 s.
        request = self.comm.Iallreduce(grad, self._mean, op=MPI.SUM)
        while not request.Test():
            os.sched_yield()
        self.wait_s += time.perf_counter() - t0
        # As a shard closes a sync round: the sum, then one multiply by 1/W, then the optimizer.
        np.multiply(self._mean, 1.0 / self.world, out=self._mean)
        self.optimizer.step(self.weights, self._mean, self.schedule.factor(self.clock))
        self.clock += 1
        self._stop_together()
        return Completed([PushResult(Outcome.APPLIED, self.clock, 0, self.clock)], time.perf_counter() - t0)

    def _push_on_device(self, grad) -> Completed:
        """Sum ``grad`` (a device array) over the ranks, take the mean and apply the optimizer, all on the GPU."""
        t0 = time.perf_counter()
        cupy = self.xp
        if self._rounding is not None:
            grad.get(out=self._rounding)
            wire.decode_into(self._rounding, wire.encode(self._rounding, self.wire_dtype), self.wire_dtype)
            grad.set(self._rounding)
        mean = grad
        if self._sum is not None:
            mean = self._sum(grad)
            self.wait_s += time.perf_counter() - t0
            cupy.multiply(mean, 1.0 / self.world, out=mean)  # as a shard closes a sync round
        # Queued, not waited for: the next step's kernels run after it on the same stream (as no servers'
        # update does), and the GPU updates while the loop records this step. push_s is the sum and the
        # launch; the update's own time falls in the next step's compute.
        self.optimizer.step(self.weights, mean, self.schedule.factor(self.clock))
        self.clock += 1
        self._stop_together()
        return Completed([PushResult(Outcome.APPLIED, self.clock, 0, self.clock)], time.perf_counter() - t0)

    def _stop_together(self) -> None:
        """Every STOP_CHECK_EVERY steps, between two collectives: if any rank heard Ctrl-C or SIGTERM, all stop.

        A rank that raised as the signal came left its Allreduce half done, and the others could then
        neither finish theirs nor meet again: the job aborted, its records lost. The ranks step together,
        so they ask at the same clock; a small collective every few steps costs the mean's exchange little.
        """
        if self.heard is None or self.clock % STOP_CHECK_EVERY:
            return
        heard = self.heard() or 0
        if self.world > 1:
            from mpi4py import MPI

            heard = self.comm.allreduce(heard, op=MPI.MAX)
        if heard:
            raise KeyboardInterrupt  # on every rank at this step: none has a collective in flight
