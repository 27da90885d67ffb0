"""Whether a ``psctl compare --resume`` may finish the experiment recorded in its folder.

The runs left must be the runs the experiment planned: the same job, modes, workers, stragglers and
repeats. An experiment recorded by an older psgrid resumes: a key added to the job since takes its
default, and a key added to the plan since counts as absent when empty.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from psgrid.cluster.errors import UsageError


def check_resumable(saved: dict, settings: dict, out: Path) -> None:
    """Refuse --resume of the experiment ``saved`` in ``out`` where its runs and those left would differ."""
    if _plan_of(saved) != _plan_of(settings):
        raise UsageError(
            f"{out} holds an experiment with other settings ({_describe(saved)}); "
            f"--resume needs the same job, modes, workers, stragglers and repeats"
        )
    train = (saved.get("job") or {}).get("train") or {}
    if train.get("dataset") == "synthetic" and "synthetic_seed" not in train and len(set(saved.get("seeds") or [])) > 1:
        raise UsageError(
            f"{out} was recorded when each seed chose its own synthetic task, and the runs left would share one "
            f"(synthetic_seed): run the experiment again with another --out"
        )


def _plan_of(settings: dict) -> tuple:
    # The keys added with --tune and scripts count as absent when empty, and the job's keys added since take
    # their defaults: an older experiment resumes.
    settings = {**settings, "job": _job_as_today(settings.get("job"))}
    return tuple(
        json.dumps(settings.get(k) if k not in NEWER_KEYS else settings.get(k) or None, sort_keys=True)
        for k in ("job", "modes", "workers", "stragglers", "repeats", "backup_workers", *NEWER_KEYS)
    )


def _job_as_today(job: dict | None) -> dict | None:
    """A recorded job as this psgrid reads it (a key it did not have yet at its default), or as recorded if unreadable."""
    from psgrid.cluster.job.config import job_from_dict

    try:
        return job_from_dict(job, redacted_ok=True).public_dict()
    except (UsageError, ValueError, TypeError, AttributeError):
        return job


NEWER_KEYS = ("tune", "tune_steps", "mode_settings", "script", "seeds", "tune_repeats", "mode_defaults")


def _describe(settings: dict) -> str:
    return (
        f"modes {','.join(settings.get('modes', []))}, workers {settings.get('workers')}, "
        f"stragglers {settings.get('stragglers')}, repeats {settings.get('repeats')}"
        + (f", tune {settings['tune']}" if settings.get("tune") else "")
        + (f", script {shlex.join(settings['script'])}" if settings.get("script") else "")
        + (f", seeds {settings['seeds']}" if settings.get("seeds") else ", every repeat at the job's seed")
    )
