"""How the all-reduce baseline sums gradients that live on GPUs: NCCL, or the host's MPI where it must.

NCCL sums device arrays in place over NVLink or PCIe, but it refuses two ranks of one communicator
on one device. So the ranks first tell each other where they run (host and the GPU's PCI bus id):

* one rank: nothing to reduce (:func:`device_reduction` returns None);
* every rank on a GPU of its own: :class:`NcclReduction`, its communicator's id made by rank 0 and
  broadcast over MPI;
* two ranks or more on one GPU: :class:`HostMpiReduction`, the gradient copied to page-locked host
  memory, summed by MPI there and copied back, with one line on rank 0's stderr saying so.

Both sum into a buffer of their own and return it, with the work done (the stream synchronized),
so the time a push spends waiting for the others is measured where it is spent.
"""

from __future__ import annotations

import os
import socket
import sys

import numpy as np

from psgrid.worker.backend import pinned_empty


def where_ranks_run(comm, cupy) -> list[tuple[str, str]]:
    """Every rank's (host name, PCI bus id of its current GPU), by rank."""
    return comm.allgather((socket.gethostname(), cupy.cuda.Device().pci_bus_id))


def sharing(places: list[tuple[str, str]]) -> str | None:
    """A line naming ranks that share a GPU, given :func:`where_ranks_run`'s answer; None if every GPU has one rank."""
    shared = sorted({p for p in places if places.count(p) > 1})
    if not shared:
        return None
    host, bus = shared[0]
    ranks = [r for r, p in enumerate(places) if p == shared[0]]
    more = f" (and {len(shared) - 1} more GPU(s) shared)" if len(shared) > 1 else ""
    return f"ranks {ranks} share GPU {bus} on {host}{more}"


def device_reduction(comm, cupy, size: int, *, name: str = "psctl allreduce"):
    """The reduction for ``comm``'s ranks' GPU gradients of ``size`` float32 values, or None for one rank."""
    if comm.Get_size() == 1:
        return None
    shared = sharing(where_ranks_run(comm, cupy))
    if shared is None:
        return NcclReduction(comm, cupy, size)
    if comm.Get_rank() == 0:
        print(
            f"{name}: {shared} and NCCL needs a GPU per rank: gradients are summed by MPI on the host",
            file=sys.stderr,
            flush=True,
        )
    return HostMpiReduction(comm, cupy, size)


class NcclReduction:
    """Sums over NCCL on the current stream (``cupy.cuda.nccl``); the ranks' GPUs are distinct."""

    kind = "nccl"

    def __init__(self, comm, cupy, size: int):
        from cupy.cuda import nccl

        self.cupy, self.nccl = cupy, nccl
        uid = comm.bcast(nccl.get_unique_id() if comm.Get_rank() == 0 else None, root=0)
        self.comm = nccl.NcclCommunicator(comm.Get_size(), uid, comm.Get_rank())
        self.sum = cupy.empty(size, cupy.float32)

    def __call__(self, grad):
        stream = self.cupy.cuda.get_current_stream()
        self.comm.allReduce(
            grad.data.ptr, self.sum.data.ptr, grad.size, self.nccl.NCCL_FLOAT32, self.nccl.NCCL_SUM, stream.ptr
        )
        stream.synchronize()
        return self.sum


class HostMpiReduction:
    """Sums through page-locked host buffers with MPI, for ranks that share a GPU."""

    kind = "mpi-host"

    def __init__(self, comm, cupy, size: int):
        self.comm, self.cupy = comm, cupy
        self.host = pinned_empty(size, np.float32, cupy)
        self.host_sum = pinned_empty(size, np.float32, cupy)
        self.sum = cupy.empty(size, cupy.float32)

    def __call__(self, grad):
        from mpi4py import MPI

        grad.get(out=self.host)
        # As the host path does: a non-blocking Allreduce driven by Test(), yielding the core between
        # tests, since ranks that share a GPU often share cores too.
        request = self.comm.Iallreduce(self.host, self.host_sum, op=MPI.SUM)
        while not request.Test():
            os.sched_yield()
        self.sum.set(self.host_sum)
        return self.sum
