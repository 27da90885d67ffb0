"""What an experiment ran, recorded so another user can cite it and run it again from the report alone.

``psctl compare`` stores :func:`provenance` in ``D/experiment.json`` and the report's Setup shows it:
psgrid's version and, run from a git checkout, its commit (and whether the tree had changes); the
versions of Python, NumPy and, where installed, CuPy and PyTorch; the machine; the seeds; and for a
user's script its command and the SHA-256 of every file the command names, with the settings psgrid
imposed on it (the shards' optimizer and mode settings, the workers' settings from the job's
``[train]`` table) rather than the built-in job's description, which the script never ran.

An experiment may run in several attempts: the first, then each ``--resume`` that ran a run. Each
attempt's command, machine and provenance are kept under ``attempts`` with the runs it ran
(:func:`attempt_of`, :func:`resumed`), and the record at the top stays the first one's: a
``--resume`` from another checkout that finds nothing left to run changes nothing of what ran.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import numpy

import psgrid
from psgrid.cluster.job.config import JobConfig

GIT_TIMEOUT_S = 10.0
PER_RUN = ("mode", "staleness", "workers", "stragglers", "seed")  # set per run: in summary.csv, not here
# Packages whose versions change what a run computes, where installed (a script may load either).
OPTIONAL = ("cupy", "torch")


def provenance(
    job: JobConfig, *, seeds: list[int] | None, script: list[str] | None, given: list[str] | None = None
) -> dict:
    """The record: ``{"psgrid": "0.1.0", "git_commit": ..., "python": ..., ...}`` (see the module's docstring)."""
    found = {
        "psgrid": _version("psgrid"),
        **git_state(Path(psgrid.__file__).resolve().parent),
        "python": sys.version.split()[0],
        "numpy": numpy.__version__,
    }
    for name in OPTIONAL:
        found[name] = optional_version(name)
    found["seeds"] = seeds
    if script:
        found["script_command"] = " ".join(given or script)
        found["script_files"] = script_hashes(script)
        found["imposed_settings"] = imposed_settings(job)
    return found


ATTEMPT_KEYS = ("command", "machine", "provenance")  # what each attempt records of itself


def attempt_of(settings: dict) -> dict:
    """The attempt ``settings`` (as settings_for wrote them now) describe, with no run yet: ``{..., "runs": []}``."""
    return {**{k: settings.get(k) for k in ATTEMPT_KEYS}, "runs": []}


def resumed(saved: dict, settings: dict) -> dict:
    """The settings a ``--resume`` writes: today's, with the attempts ``saved`` records and the first one's record.

    The attempt now adds itself once it runs a run (compare.py ``Experiment.ran``). An experiment recorded
    before attempts were is one attempt, whose runs were not listed (``runs`` None); one whose attempts ran
    nothing yet takes today's record.
    """
    attempts = saved.get("attempts")
    if attempts is None:
        attempts = [{**{k: saved.get(k) for k in ATTEMPT_KEYS}, "runs": None}]
    merged = {**settings, "attempts": attempts}
    if attempts:
        merged.update(machine=attempts[0].get("machine"), provenance=attempts[0].get("provenance"))
    return merged


def git_state(where: Path) -> dict:
    """``git_commit`` and ``git_tree`` (clean / changed) of the checkout holding ``where``; {} outside one."""
    try:
        commit = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=GIT_TIMEOUT_S
        )
        if commit.returncode != 0:
            return {}
        changed = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {}
    state = "unknown" if changed.returncode != 0 else "changed" if changed.stdout.strip() else "clean"
    return {"git_commit": commit.stdout.strip(), "git_tree": state}


def optional_version(name: str) -> str | None:
    """The installed version of ``name`` (CuPy under any of its wheel names), read without importing it."""
    if name in sys.modules and getattr(sys.modules[name], "__version__", None):
        return str(sys.modules[name].__version__)
    for dist in importlib.metadata.distributions():
        dist_name = (dist.metadata["Name"] or "").lower()
        if dist_name == name or (name == "cupy" and dist_name.startswith("cupy-")):
            return dist.version
    return None


def script_hashes(command: list[str]) -> dict[str, str]:
    """SHA-256 of each file the command names (the Python interpreter aside): ``{path: hex digest}``.

    The program itself is one where it is a file (``./train.py`` run directly): it is the script. An
    argument is one where it is a file with a suffix (``train.py``, ``data.npz``), not a bare word that
    happens to name a file in the current folder.
    """
    hashes = {}
    program = Path(command[0]) if command else None
    if program is not None and program.is_file() and not _is_python(program):
        hashes[str(program.resolve())] = _sha256(program)
    for arg in command[1:]:
        path = Path(arg)
        if path.suffix and path.is_file():
            hashes[str(path.resolve())] = _sha256(path)
    return hashes


def _is_python(program: Path) -> bool:
    """Whether ``program`` is the Python interpreter (this one, or any: its hash says nothing of the script)."""
    if program.resolve() == Path(sys.executable).resolve():
        return True
    return program.name.startswith("python") and not program.suffix.startswith(".py")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def imposed_settings(job: JobConfig) -> dict:
    """What psgrid decides for a script's job: the shards' settings and the workers' own (the rest is the script's)."""
    from psgrid.worker.api import CLIENT_SETTINGS, WORKER_SETTINGS

    tables = job.public_dict()
    train = tables.get("train") or {}
    return {
        "job": {k: v for k, v in (tables.get("job") or {}).items() if k not in ("out", "name", *PER_RUN)},
        "server": {k: v for k, v in (tables.get("server") or {}).items() if k not in PER_RUN},
        "train": {
            k: train[k] for k in dict.fromkeys(WORKER_SETTINGS + CLIENT_SETTINGS) if k in train and k not in PER_RUN
        },
    }


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


# What tells two attempts' records apart: the machine's load at the start of each always differs.
MACHINE_KEYS = ("host", "cpus", "platform", "python", "gpu")


def attempts_text(settings: dict) -> str | None:
    """Which runs each attempt ran (the first, then each --resume that ran one), and what differed between them."""
    attempts = settings.get("attempts") or []
    if len(attempts) < 2:
        return None
    fields = [("provenance", k) for k in dict.fromkeys(k for a in attempts for k in a.get("provenance") or {})]
    fields += [("machine", k) for k in MACHINE_KEYS]
    differ = [
        (part, key)
        for part, key in fields
        if len({json.dumps((a.get(part) or {}).get(key), sort_keys=True) for a in attempts}) > 1
    ]

    def said(i: int, attempt: dict) -> str:
        values = ", ".join(f"{key} {_said((attempt.get(part) or {}).get(key))}" for part, key in differ)
        runs = attempt.get("runs")
        ran = "the runs recorded before attempts were" if runs is None else ", ".join(runs) or "no run"
        return f"attempt {i + 1}{f' ({values})' if values else ''} ran {ran}"

    if not differ:
        return (
            f"The runs ran in {len(attempts)} attempts (the first, then each --resume that ran a run), on the same "
            f"machine and provenance: " + "; ".join(said(i, a) for i, a in enumerate(attempts)) + "."
        )
    return (
        f"The runs ran in {len(attempts)} attempts (the first, then each --resume that ran a run), whose records "
        f"differ in {', '.join(k for _, k in differ)}: " + "; ".join(said(i, a) for i, a in enumerate(attempts)) + ". "
        "The machine and provenance above are attempt 1's; experiment.json keeps each attempt's under attempts."
    )


def _said(value) -> str:
    return "none" if value is None else value if isinstance(value, str) else json.dumps(value)
