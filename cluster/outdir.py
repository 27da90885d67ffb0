"""A job's output folder: a default that never collides, and ``--overwrite`` of an earlier run.

The default is ``runs/NAME-YYYYmmdd-HHMMSS``; two jobs of the same name started in the same
second (a shell loop, two terminals) get ``...-HHMMSS-2``, ``-3``: the folder is claimed with
an atomic ``mkdir``, so no two launchers ever share one. A folder given with ``--out`` that
holds an earlier run is refused unless ``overwrite`` is set; then the earlier run's files
(and only those: a user's own files in the folder stay) are removed first.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from psgrid.cluster.errors import UsageError
from psgrid.psserver import files

# What a run of psctl launch / mpi / allreduce writes into its folder (cluster/resume.py moves the same to attempts/).
RUN_FILES = ("summary.json", "metrics.jsonl", "job.toml", "token", "metrics", "logs", "addr", "attempts",
             "superseded-checkpoints")
_HOLDS_A_RUN = ("summary.json", "metrics", "addr", "logs")
# What psctl compare writes into its --out (cluster/compare.py, cluster/report.py).
EXPERIMENT_FILES = ("experiment.json", "results.jsonl", "results.jsonl.tmp", "summary.csv", "report.md",
                    "report.html", "plots", "runs", "chosen.json")
MAX_SUFFIX = 1000


def holds_a_run(folder: Path) -> bool:
    return folder.is_dir() and any((folder / name).exists() for name in _HOLDS_A_RUN)


def claim_default(job) -> Path:
    """A new folder ``runs/NAME-STAMP`` (``-2``, ``-3``, ... when taken), created here and now."""
    base = Path(job.default_out())
    files.make_dirs(base.parent)
    for n in range(1, MAX_SUFFIX + 1):
        candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            candidate.mkdir(mode=files.DIR_MODE)      # fails if taken: the claim
        except FileExistsError:
            continue
        return candidate
    raise UsageError(f"{base} and {MAX_SUFFIX - 1} numbered folders beside it exist; give --out DIR")


def clear_run(folder: Path, names: tuple[str, ...] = RUN_FILES) -> None:
    """Remove what an earlier run (or, with ``EXPERIMENT_FILES``, experiment) wrote into ``folder``."""
    for name in names:
        path = folder / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def prepare(job, resume: bool = False) -> Path:
    """The output folder of ``job``, with ``addr/``, ``logs/`` and ``metrics/`` in it, ready for a new run.

    Raises
    ------
    UsageError
        ``job.out`` holds an earlier run and neither ``job.overwrite`` nor ``resume`` is set.
    """
    if resume:
        from psgrid.cluster.resume import archive_attempt

        out = Path(job.out)
        archive_attempt(out)
    elif job.out:
        out = Path(job.out)
        if holds_a_run(out):
            if not getattr(job, "overwrite", False):
                raise UsageError(f"{out} already holds a run: choose another --out, add --overwrite to replace it, "
                                 f"or continue it with psctl launch --resume {out}")
            clear_run(out)
    else:
        out = claim_default(job)
    for sub in ("addr", "logs", "metrics"):
        files.make_dirs(out / sub)
    return out
