"""The all-reduce baseline: synchronous data parallelism with no shards, as Horovod does it.

Every worker keeps the whole model and the optimizer's state. A step's gradients are summed
across workers with MPI ``Allreduce``, divided by the number of workers, and every worker applies
the same server-side optimizer (:mod:`psgrid.psserver.optim`) to its own copy. That is a
sync round of the parameter server, done everywhere at once: the same mean of the gradients, the
same optimizer maths, and with the same seeds and data order the same weights, up to the order in
which float32 additions are made.

On a GPU the gradient travels through the pinned host buffer the parameter-server path also
uses (the training loop copies it there), and the update is made on the host, as a shard makes it.

:class:`AllreduceExchange` has the surface of :class:`~psgrid.psserver.client.Client` that the
training loop uses, so the loop, the data, the straggler and the records are the same.
"""

from __future__ import annotations

import time

import numpy as np

from psgrid.psserver.config import ServerConfig
from psgrid.psserver.optim import make_optimizer
from psgrid.psserver.protocol import Outcome, PushResult

# Waiting ranks poll a non-blocking Allreduce with this sleep: a blocking MPICH collective spins a
# core, and on a machine with fewer cores than workers the spinning ranks slow the straggler down.
POLL_S = 0.0002


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
    """

    mode = "allreduce"
    data_planes: list = []
    wire_dtype = None

    def __init__(self, comm, init: np.ndarray, server: ServerConfig):
        self.comm = comm
        self.world = comm.Get_size()
        self.worker_id = comm.Get_rank()
        self.weights = np.array(init, dtype=np.float32, copy=True)
        self._mean = np.empty_like(self.weights)
        self.optimizer = make_optimizer(server.optimizer, self.weights.size, **server.optimizer_hparams())
        self.clock = 0
        self.wait_s = 0.0            # seconds inside Allreduce: the transfer and waiting for the others

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None

    def bytes_per_step(self, params: int) -> int:
        """Sent plus received by one rank in a ring all-reduce of ``params`` float32: 2 x 2(W-1)/W x 4P."""
        return int(16 * params * (self.world - 1) / self.world)

    def pull(self, out: np.ndarray, *, background: bool = False) -> Completed:
        t0 = time.perf_counter()
        np.copyto(out, self.weights)
        return Completed([self.clock], time.perf_counter() - t0)

    def push(self, grad: np.ndarray, *, background: bool = False) -> Completed:
        from mpi4py import MPI

        t0 = time.perf_counter()
        request = self.comm.Iallreduce(grad, self._mean, op=MPI.SUM)
        while not request.Test():
            time.sleep(POLL_S)
        self.wait_s += time.perf_counter() - t0
        # As a shard closes a sync round: the sum, then one multiply by 1/W, then the optimizer.
        np.multiply(self._mean, 1.0 / self.world, out=self._mean)
        self.optimizer.step(self.weights, self._mean, 1.0)
        self.clock += 1
        return Completed([PushResult(Outcome.APPLIED, self.clock, 0, self.clock)], time.perf_counter() - t0)
