"""What an experiment records about itself: its settings, its job in one line, the machine it ran on.

``psctl compare`` writes them to ``D/experiment.json`` (:func:`settings_for`); the report
(cluster/experiments/report.py) reads them back to say what ran and where.
"""

from __future__ import annotations

import os
import platform
import shlex
import socket

from psgrid.cluster.job.config import JobConfig
from psgrid.cluster.job.shard_device import resolve_shard_device
from psgrid.cluster.run.procs import usable_cpus


def machine() -> dict:
    """Where the experiment ran, for the report."""
    info = {"host": socket.gethostname(), "cpus": usable_cpus(), "platform": platform.platform(terse=True),
            "python": platform.python_version()}
    try:
        info["load_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    return info


def gpu_name(device: str) -> str | None:
    """The GPUs the workers used (``2 x NVIDIA H100``); None on the CPU or where CuPy sees none."""
    if device == "cpu":
        return None
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
        return f"{count} x {name}"
    except Exception:  # noqa: BLE001 - no CuPy or no GPU: the workers ran on the CPU
        return None


def job_summary(job: JobConfig) -> str:
    """The job in one line: model, data, batch, length, optimizer, shards, data plane, device and seed."""
    t, s = job.train, job.server
    model = t.model + (f" {list(t.hidden)} {t.activation}" if t.model == "mlp" else "")
    batch = "full batch" if t.batch_size == 0 else f"batch {t.batch_size} per worker"
    length = f"{t.epochs} epochs" if t.epochs else f"{t.steps} steps per worker"
    opt = f"{s.optimizer} lr {s.lr:g}" + (f" momentum {s.momentum:g}" if s.optimizer == "sgd" and s.momentum else "")
    where = resolve_shard_device(s, t).upper()      # as each run's launcher will resolve "auto" on this machine
    return (f"{model} on {t.dataset}, {batch}, {length}, {opt} on the shards, {job.shards} {where} shard(s), "
            f"{'shared memory on one host, else ' if t.shared_memory else ''}{t.data_plane} data plane, "
            f"device {t.device}, seed {t.seed}")


def settings_for(job: JobConfig, *, command: list[str], modes, workers, stragglers, repeats: int,
                 target: float | None, backup_workers: int | None, tune: dict | None = None,
                 tune_steps: int | None = None, mode_settings: dict | None = None,
                 script: list[str] | None = None, classes: int | None = None) -> dict:
    """The experiment's settings as ``D/experiment.json`` keeps them (``command``: psctl compare's arguments)."""
    info = machine()
    info["gpu"] = gpu_name(job.train.device)
    return {
        "command": "psctl compare " + shlex.join(command),
        "modes": [m.label for m in modes], "workers": list(workers), "stragglers": list(stragglers),
        "repeats": repeats, "backup_workers": backup_workers, "target_accuracy": target,
        "tune": tune or {}, "tune_steps": tune_steps,
        "mode_settings": {m: [list(kv) for kv in s] for m, s in (mode_settings or {}).items()},
        "script": script, "shards": job.shards, "classes": classes,
        "target_source": "given" if target is not None else "auto",
        "machine": info, "job_summary": job_summary(job), "job": job.public_dict(),
        "title": f"psctl compare: {job.name}",
    }

