"""The all-reduce baseline: synchronous data parallelism with no shards, as Horovod does it.

Every worker keeps the whole model and the optimizer's state. A step's gradients are summed
across workers with MPI ``Allreduce``, divided by the number of workers, and every worker applies
the same server-side optimizer (:mod:`psgrid.psserver.kernels.optim`) to its own copy. That is a
sync round of the parameter server, done everywhere at once: the same mean of the gradients, the
same optimizer maths, and with the same seeds and data order the same weights, up to the order in
which float32 additions are made.

On a GPU the gradient travels through the pinned host buffer the parameter-server path also
uses (the training loop copies it there), and the update is made on the host, as a shard makes it.
With ``wire_dtype`` float16 or bfloat16 each rank rounds its gradient through that type before the
sum, as a shard decodes a pushed gradient, so compression costs both the same accuracy.

:class:`AllreduceExchange` has the surface of :class:`~psgrid.psserver.client.client.Client` that the
training loop uses, so the loop, the data, the straggler and the records are the same.
"""

from __future__ import annotations

import os
import time

import numpy as np

from psgrid.psserver import dtypes as wire
from psgrid.psserver.config import ServerConfig
from psgrid.psserver.kernels.optim import make_optimizer
from psgrid.psserver.kernels.parallel import Chunks, default_threads
from psgrid.psserver.protocol import ITEMSIZE, Outcome, PushResult



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
    """

    mode = "allreduce"
    data_planes: list = []

    def __init__(self, comm, init: np.ndarray, server: ServerConfig, wire_dtype: str = "float32"):
        self.wire_dtype = wire.wire_dtype(wire_dtype)
        self.comm = comm
        self.world = comm.Get_size()
        self.worker_id = comm.Get_rank()
        self.weights = np.array(init, dtype=np.float32, copy=True)
        self._mean = np.empty_like(self.weights)
        # The shards' optimizer and its threads (a shard cuts its range among apply_threads threads).
        self._chunks = Chunks(server.apply_threads or default_threads())
        self.optimizer = make_optimizer(server.optimizer, self.weights.size, chunks=self._chunks,
                                        **server.optimizer_hparams())
        self.clock = 0
        self.wait_s = 0.0            # seconds inside Allreduce: the transfer and waiting for the others

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._chunks.close()

    def bytes_per_step(self, params: int) -> int:
        """Sent plus received by one rank in a ring all-reduce of ``params`` values: 2 x 2(W-1)/W x P x size."""
        return int(4 * params * ITEMSIZE[self.wire_dtype] * (self.world - 1) / self.world)

    def pull(self, out: np.ndarray, *, background: bool = False) -> Completed:
        t0 = time.perf_counter()
        np.copyto(out, self.weights)
        return Completed([self.clock], time.perf_counter() - t0)

    def push(self, grad: np.ndarray, *, background: bool = False) -> Completed:
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
        self.optimizer.step(self.weights, self._mean, 1.0)
        self.clock += 1
        return Completed([PushResult(Outcome.APPLIED, self.clock, 0, self.clock)], time.perf_counter() - t0)
