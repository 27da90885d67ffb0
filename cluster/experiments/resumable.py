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
    if differ := _differences(saved, settings):
        raise UsageError(
            f"{out} holds an experiment with other settings: {'; '.join(differ)} (--resume needs the same job, "
            f"modes, workers, stragglers and repeats: give them as before, or another --out)"
        )
    train = (saved.get("job") or {}).get("train") or {}
    if train.get("dataset") == "synthetic" and "synthetic_seed" not in train and len(set(saved.get("seeds") or [])) > 1:
        raise UsageError(
            f"{out} was recorded when each seed chose its own synthetic task, and the runs left would share one "
            f"(synthetic_seed): run the experiment again with another --out"
        )


def _differences(saved: dict, settings: dict) -> list[str]:
    """What differs between the recorded plan and this one, each as "KEY was A, now B" (the job's keys one by one)."""
    was, now = _plan_of(saved), _plan_of(settings)
    found = []
    for key in was:
        if json.dumps(was[key], sort_keys=True) == json.dumps(now[key], sort_keys=True) or _follows(key, was, now):
            continue
        if key == "job" and isinstance(was[key], dict) and isinstance(now[key], dict):
            found += _job_differences(was[key], now[key])
        elif key == "script":
            found.append(_script_difference(saved, settings))
        else:
            found.append(f"{key} was {_said(was[key])}, now {_said(now[key])}")
    return found


def _follows(key: str, was: dict, now: dict) -> bool:
    """Whether ``key`` differs only as the repeats do: one list of seeds the other's first ones (base+r)."""
    if key != "seeds" or was["repeats"] == now["repeats"] or not (was[key] and now[key]):
        return False
    shorter, longer = sorted((list(was[key]), list(now[key])), key=len)
    return longer[: len(shorter)] == shorter


def _job_differences(was: dict, now: dict) -> list[str]:
    """``[train] steps was 100, now 200`` for each key of the job's tables that differs."""
    found = []
    for table in sorted(set(was) | set(now)):
        old, new = was.get(table) or {}, now.get(table) or {}
        for key in sorted(set(old) | set(new)):
            if json.dumps(old.get(key), sort_keys=True) != json.dumps(new.get(key), sort_keys=True):
                found.append(f"[{table}] {key} was {_said(old.get(key))}, now {_said(new.get(key))}")
    return found


def _script_difference(saved: dict, settings: dict) -> str:
    """The scripts' commands; where they name the same files from another folder, where to run --resume from."""
    was, now = saved.get("script"), settings.get("script")
    said = f"script was {_said_command(was)}, now {_said_command(now)}"
    named = _script_files(saved)
    if not (was and now and named and named == _script_files(settings)):
        return said
    folder = _started_in(saved)
    return (
        f"{said}: the same script named from another folder; run psctl compare --resume from "
        f"{folder or 'the folder the experiment was started in'} with the command as it was first given"
    )


def _script_files(settings: dict) -> dict:
    """The files the script's command names, by resolved path, with their hashes (provenance.script_hashes)."""
    return (settings.get("provenance") or {}).get("script_files") or {}


def _started_in(saved: dict) -> str | None:
    """The folder the experiment's script was named from: a relative file argument's resolved path less the argument."""
    for arg in (saved.get("script") or [])[1:]:
        path = Path(arg)
        if path.is_absolute() or ".." in path.parts or not path.suffix:
            continue
        for resolved in map(Path, _script_files(saved)):
            if resolved.parts[-len(path.parts) :] == path.parts:
                return str(Path(*resolved.parts[: -len(path.parts)]))
    return None


def _said(value) -> str:
    return (
        "none"
        if value is None
        else json.dumps(value, sort_keys=True)
        if isinstance(value, (dict, list))
        else str(value)
    )


def _said_command(command: list[str] | None) -> str:
    return "none" if not command else shlex.join(command)


def _plan_of(settings: dict) -> dict:
    # The keys added with --tune and scripts count as absent when empty, and the job's keys added since take
    # their defaults: an older experiment resumes.
    settings = {**settings, "job": _job_as_today(settings.get("job"))}
    return {
        k: settings.get(k) if k not in NEWER_KEYS else settings.get(k) or None
        for k in ("job", "modes", "workers", "stragglers", "repeats", "backup_workers", *NEWER_KEYS)
    }


def _job_as_today(job: dict | None) -> dict | None:
    """A recorded job as this psgrid reads it (a key it did not have yet at its default), or as recorded if unreadable."""
    from psgrid.cluster.job.config import job_from_dict

    try:
        return job_from_dict(job, redacted_ok=True).public_dict()
    except (UsageError, ValueError, TypeError, AttributeError):
        return job


NEWER_KEYS = ("tune", "tune_steps", "mode_settings", "script", "seeds", "tune_repeats", "mode_defaults")
