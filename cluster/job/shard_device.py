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

A device shard and its workers are processes of their own, and without MPS a GPU runs one
process's context at a time: every call over CUDA IPC moves the GPU to the shard's context and
back, 0.14-0.16 ms each way on an H100 (benchmarks/gpu_context_switch.py). Under an MPS control
daemon they share one context and the move costs nothing measurable. Starting that daemon is the
machine owner's choice (it serves every CUDA process of the user), so the launcher only says,
once, when device shards share a GPU with GPU workers and none serves them (:func:`mps_note`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping

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


MPS_PIPE_DEFAULT = "/tmp/nvidia-mps"  # where CUDA looks for the MPS control daemon without CUDA_MPS_PIPE_DIRECTORY


def mps_serving(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether an MPS control daemon serves CUDA processes started with ``environ`` (its pipe is where CUDA looks)."""
    return os.path.exists(os.path.join(environ.get("CUDA_MPS_PIPE_DIRECTORY") or MPS_PIPE_DEFAULT, "control"))


def mps_note(job, environ: Mapping[str, str] = os.environ) -> str | None:
    """One line for a job whose device shards share this host's GPU with GPU workers and no MPS serves them, else None."""
    if job.server.shard_device != "gpu" or job.workers < 1 or job.mps or mps_serving(environ):
        return None
    if job.train.device == "cpu":
        return None
    if job.train.device != "gpu":
        from psgrid.worker.backend import gpu_unavailable

        if gpu_unavailable() is not None:
            return None
    return (
        "device shards and GPU workers are separate processes sharing the GPU without MPS: each push and the "
        "pull after it move the GPU between their contexts (0.15 ms each on an H100); an MPS control daemon "
        "gives them one context: --mps ([job] mps = true) starts one for this job alone "
        '(docs/performance.md, "Device shards")'
    )
