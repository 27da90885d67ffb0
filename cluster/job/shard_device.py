"""Where a job's shards keep their state: ``shard_device = "auto"`` made "cpu" or "gpu" for one host.

A shard keeps its weights, optimizer state and update on a GPU when that is where its workers
compute: a GPU worker on the same host then pulls and pushes device to device (the CUDA IPC
plane) instead of through host memory, which bounds a GPU worker at a fraction of its speed
(docs/performance.md). CPU workers gain nothing from a device shard, so ``auto`` is "gpu" only
for GPU workers. A shard started alone (``psctl server``) cannot know its workers and takes
``auto`` as "cpu"; the launchers resolve it here, once per host, before the shards start:
``psctl launch``, ``psgrid.LocalCluster``, ``psctl compare`` and ``psctl bench train`` on this
machine, and each shard rank of ``psctl mpi`` on its own node.

Shard ``i`` of a host with ``n`` GPUs takes GPU ``i mod n`` (or the ``gpu`` the job names), as
the shard itself does (psserver/state/device.py).
"""

from __future__ import annotations

import dataclasses

AUTO = "auto"


def resolve_shard_device(server, train) -> str:
    """``server.shard_device`` for shards whose workers run ``train`` on this host: "cpu" or "gpu".

    An explicit "cpu" or "gpu" is kept. ``auto`` is "gpu" when the workers compute on a GPU here
    (``train.device = "gpu"``, or ``"auto"`` where CuPy sees one), else "cpu"; it stays "cpu" for
    ``staleness_compensation = "dc"``, which runs on host shards only.
    """
    if server.shard_device != AUTO:
        return server.shard_device
    if server.compensation == "dc" or train.device == "cpu":
        return "cpu"
    if train.device == "gpu":
        return "gpu"
    from psgrid.worker.backend import gpu_unavailable

    return "gpu" if gpu_unavailable() is None else "cpu"


def with_shard_device(job):
    """``job`` with its shards' device resolved for this host (:func:`resolve_shard_device`); a copy when it changes."""
    device = resolve_shard_device(job.server, job.train)
    if device == job.server.shard_device:
        return job
    return dataclasses.replace(job, server=dataclasses.replace(job.server, shard_device=device))


def shard_gpu(index: int, gpu: int, count: int) -> int:
    """The GPU of shard ``index`` on a host of ``count`` GPUs: ``gpu`` where the job names one, else index mod count."""
    return gpu if gpu >= 0 else index % count


def shards_by_gpu(indices, gpu: int, count: int) -> dict[int, list[int]]:
    """``{GPU: [shard indices]}`` for the shards ``indices`` of one host (:func:`shard_gpu`)."""
    placed: dict[int, list[int]] = {}
    for i in indices:
        placed.setdefault(shard_gpu(i, gpu, count), []).append(i)
    return placed
