"""What an experiment records about itself: its settings, its job in one line, the machine it ran on, provenance.

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
    info = {
        "host": socket.gethostname(),
        "cpus": usable_cpus(),
        "platform": platform.platform(terse=True),
        "python": platform.python_version(),
    }
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
    opt = optimizer_text(job)
    where = resolve_shard_device(s, t).upper()  # as each run's launcher will resolve "auto" on this machine
    return (
        f"{model} on {t.dataset}, {batch}, {length}, {opt} on the shards, {job.shards} {where} shard(s), "
        f"{'shared memory on one host, else ' if t.shared_memory else ''}{t.data_plane} data plane, "
        f"device {t.device}, seed {t.seed}"
    )


def optimizer_text(job: JobConfig) -> str:
    """``sgd lr 0.05 momentum 0.9, cosine to 0 over the job's updates``: what the shards apply, its schedule too."""
    s = job.server
    opt = f"{s.optimizer} lr {s.lr:g}" + (f" momentum {s.momentum:g}" if s.optimizer == "sgd" and s.momentum else "")
    return opt + s.describe_schedule()


def script_summary(job: JobConfig, script: list[str], given: list[str] | None = None) -> str:
    """A user's script in one line: its command and what psgrid imposed on it (its own model and data are its own)."""
    s = job.server
    opt = optimizer_text(job)
    if s.describe_schedule() and not s.lr_updates:
        # The schedule's length is the built-in job's, whatever the script's own length: say so.
        opt += f" (its length from [train] steps = {job.train.steps}, not the script's own: lr_updates sets it)"
    return (
        f"your script `{shlex.join(given or script)}` (its SHA-256 under provenance), run by every worker; psgrid "
        f"imposed {opt} on the shards, {job.shards} {resolve_shard_device(s, job.train).upper()} shard(s), "
        f"the {job.train.data_plane} data plane and the seed per repeat; its model, data and length are the "
        f"script's own"
    )


def settings_for(
    job: JobConfig,
    *,
    command: list[str],
    modes,
    workers,
    stragglers,
    repeats: int,
    target: float | None,
    backup_workers: int | None,
    tune: dict | None = None,
    tune_steps: int | None = None,
    mode_settings: dict | None = None,
    script: list[str] | None = None,
    classes: int | None = None,
    seeds: list[int] | None = None,
    tune_repeats: int = 1,
    mode_defaults: dict | None = None,
    tensorboard: str | None = None,
    script_given: list[str] | None = None,
    seeds_pinned: bool = False,
) -> dict:
    """The experiment's settings as ``D/experiment.json`` keeps them (``command``: psctl compare's arguments).

    ``seeds`` are the repeats' (repeat r: ``seeds[r]``), ``seeds_pinned`` whether --seeds gave them,
    ``mode_defaults`` the settings each mode runs with unless ``mode_settings`` (--mode-set) says otherwise,
    ``script_given`` the script's command as typed.
    """
    from psgrid.cluster.experiments.provenance import provenance
    from psgrid.cluster.run.script import default_name

    info = machine()
    info["gpu"] = gpu_name(job.train.device)
    return {
        "command": "psctl compare " + shlex.join(command),
        "modes": [m.label for m in modes],
        "workers": list(workers),
        "stragglers": list(stragglers),
        "repeats": repeats,
        "backup_workers": backup_workers,
        "target_accuracy": target,
        "tune": tune or {},
        "tune_steps": tune_steps,
        "mode_settings": {m: [list(kv) for kv in s] for m, s in (mode_settings or {}).items()},
        "mode_defaults": {m: [list(kv) for kv in s] for m, s in (mode_defaults or {}).items()},
        "seeds": seeds,
        "seeds_pinned": seeds_pinned,
        "tune_repeats": tune_repeats if tune else None,
        "tensorboard": tensorboard,
        "script": script,
        "shards": job.shards,
        "classes": classes,
        "target_source": "given" if target is not None else "auto",
        "machine": info,
        "job_summary": script_summary(job, script, script_given) if script else job_summary(job),
        "provenance": provenance(job, seeds=seeds, script=script, given=script_given),
        "job": job.public_dict(),
        # A script's experiment is its script's, whatever job file lent it the shards' settings.
        "title": f"psctl compare: {default_name(script_given or script) if script else job.name}",
    }


def schedule_note(x) -> str | None:
    """For a script: psctl launch's note that the rate schedule's length came from [train] steps, once for every run.

    A run under compare is a quiet psctl launch, which says nothing; the length differs by mode and worker
    count (one update a round in sync, one a push in async and ssp), so the line gives each one's.
    """
    from psgrid.cluster.job import rate_schedule

    if not x.command:
        return None
    updates: dict[str, int] = {}
    first = None
    for run in x.runs:
        job = x.run_job(run)
        if rate_schedule.derived_note(job):
            first = first or job
            updates.setdefault(f"{run.mode.label} w{run.workers}", rate_schedule.schedule_updates(job))
    if first is None:
        return None
    over = (
        f"{next(iter(updates.values()))} updates"
        if len(set(updates.values())) == 1
        else ", ".join(f"{k} {n}" for k, n in updates.items()) + " updates"
    )
    return (
        f"lr_schedule {first.server.lr_schedule} runs over {over}, from [train] steps = {first.train.steps}; "
        f"a script that runs another number of steps sets lr_updates"
    )
