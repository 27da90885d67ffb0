"""A job's output folder: a default that never collides, and ``--overwrite`` of an earlier run.

The default is ``runs/NAME-YYYYmmdd-HHMMSS``; two jobs of the same name started in the same
second (a shell loop, two terminals) get ``...-HHMMSS-2``, ``-3``: the folder is claimed with
an atomic ``mkdir``, so no two launchers ever share one. A folder given with ``--out`` that
holds an earlier run is refused unless ``overwrite`` is set; then the earlier run's files
(and only those: a user's own files in the folder stay) are removed first.

A folder in use is locked: the process that runs the job (``psctl launch``'s launcher,
``psctl mpi``'s rank 0, ``psctl compare`` for each of its runs) holds ``flock`` on
``OUT/.psgrid.lock`` for the job's life, and the kernel lets go of it however that process
ends. Another job given the folder, with ``--overwrite`` or ``--resume`` or neither, is
refused with the pid and command of the holder: two jobs writing one folder would each
report a mix of both (the second's numbers in the first's summary).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from pathlib import Path

from psgrid.cluster.errors import UsageError
from psgrid.cluster.job.records import sweep_temporaries
from psgrid.psserver import files

# What a run of psctl launch / mpi / allreduce writes into its folder (cluster/run/resume.py moves the same to attempts/).
RUN_FILES = (
    "summary.json",
    "metrics.jsonl",
    "job.toml",
    "command.json",
    "token",
    "metrics",
    "logs",
    "addr",
    "attempts",
    "superseded-checkpoints",
)
_HOLDS_A_RUN = ("summary.json", "metrics", "addr", "logs")
# What psctl compare writes into its --out (cluster/experiments/compare.py, cluster/experiments/report.py).
EXPERIMENT_FILES = (
    "experiment.json",
    "results.jsonl",
    "results.jsonl.tmp",
    "summary.csv",
    "report.md",
    "report.html",
    "plots",
    "runs",
    "chosen.json",
)
MAX_SUFFIX = 1000
LOCK_FILE = ".psgrid.lock"

_held: dict[Path, int] = {}  # folder -> the open lock file of a job this process runs there


def lock(folder: Path) -> None:
    """Hold ``folder``'s lock (making the folder) for as long as this process lives, or until :func:`release`.

    Raises
    ------
    UsageError
        Another process holds it: a job is running there.
    """
    folder = folder.resolve()
    if folder in _held:
        return
    usable(folder)
    fd = os.open(folder / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 4096).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise UsageError(
            f"{folder} is in use by a running job ({holder}): wait for it to end, stop it, or choose another --out"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()}: {_command()}\n".encode())
    _held[folder] = fd


def usable(folder: Path) -> None:
    """Make ``folder`` (and its parents) for a job's files, or say in one line why it cannot be one.

    Raises
    ------
    UsageError
        It is a file, or it cannot be made (a parent is a file, no permission, a read-only place).
    """
    check_usable(folder)
    try:
        files.make_dirs(folder)
    except OSError as exc:
        raise UsageError(f"--out {folder}: cannot make the folder ({exc.strerror or exc}): give another") from None


def check_usable(folder: Path) -> None:
    """Refuse in one line a ``folder`` that is a file or lies under one, making nothing (:func:`usable` makes it)."""
    if folder.exists() and not folder.is_dir():
        raise UsageError(f"--out {folder} is a file, not a folder: give a folder (new or of an earlier run)")
    above = next((parent for parent in folder.parents if parent.exists()), None)
    if above is not None and not above.is_dir():
        raise UsageError(f"--out {folder}: {above} is a file, not a folder: give another")


def release(folder: Path) -> None:
    """Let go of ``folder``'s lock once this process's job there has ended (the file stays: see lock)."""
    fd = _held.pop(folder.resolve(), None)
    if fd is not None:
        os.close(fd)


def _command() -> str:
    try:
        argv = Path("/proc/self/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    except OSError:
        return "psgrid"
    text = " ".join(a.decode(errors="replace") for a in argv)
    return text if len(text) <= 200 else text[:197] + "..."


def holds_a_run(folder: Path) -> bool:
    return folder.is_dir() and any((folder / name).exists() for name in _HOLDS_A_RUN)


def claim_default(job) -> Path:
    """A new folder ``runs/NAME-STAMP`` (``-2``, ``-3``, ... when taken), created here and now."""
    base = Path(job.default_out())
    files.make_dirs(base.parent)
    for n in range(1, MAX_SUFFIX + 1):
        candidate = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            candidate.mkdir(mode=files.DIR_MODE)  # fails if taken: the claim
        except FileExistsError:
            continue
        lock(candidate)
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
        ``job.out`` holds an earlier run and neither ``job.overwrite`` nor ``resume`` is set, or a
        job is running there now (whatever the flags).

    With ``resume`` the folder's earlier run is kept: the caller archives it first (a job folder knows
    nothing of resuming; cluster/run/launch.py's :func:`prepare_out` does both).
    """
    if resume:  # the earlier attempt's files were moved aside by the resume (cluster/run/resume.py)
        out = Path(job.out)
        lock(out)
    elif job.out:
        out = Path(job.out)
        lock(out)
        if holds_a_run(out):
            if not getattr(job, "overwrite", False):
                release(out)
                raise UsageError(
                    f"{out} already holds a run: choose another --out, add --overwrite to replace it, "
                    f"or continue it with psctl launch --resume {out}"
                )
            clear_run(out)
    else:
        out = claim_default(job)
    sweep_temporaries(out)  # of a launcher killed while it wrote its job.toml or token here
    for sub in ("addr", "logs", "metrics"):
        files.make_dirs(out / sub)
    return out
