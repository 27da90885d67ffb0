"""TensorBoard event files of a run's records: ``psctl compare --tensorboard DIR`` and ``psctl launch
--tensorboard DIR``.

An experiment's runs go to ``DIR/NAME``, NAME its output folder's name (``cmp``; another experiment's
folder of that name sends it to ``cmp-2``, ...), one folder per run named after the run (``async-w4-r0``:
mode, workers, repeat), so ``tensorboard --logdir DIR`` overlays every mode and repeat, and two experiments
sharing DIR never replace each other's runs of the same name. A job of ``psctl launch`` goes to
``DIR/NAME``, NAME the job's (``NAME-2``, ... where an experiment or another job's folder has it). Each run's folder holds the run's mean training loss
per step (``train/loss``), its test accuracy per step (``test/accuracy``) and per epoch where the
worker said how large its shard is (``test/accuracy_by_epoch``, the step axis holding the epoch in
thousandths); the wall time of every point is its seconds since the run's start, so TensorBoard's
"relative" axis is time since start as in the report's plots.

The files are written by tensorboardX (the ``tensorboard`` extra), a well-kept writer that needs
no TensorFlow; without it the command says in one line what to install.
"""

from __future__ import annotations

import math
import shutil
import statistics
from collections import defaultdict
from pathlib import Path

from psgrid.cluster.errors import UsageError
from psgrid.psserver import files

MISSING = "--tensorboard needs tensorboardX: pip install 'psgrid[tensorboard]'"
EPOCH_SCALE = 1000  # TensorBoard's step is an integer: the epoch axis counts thousandths of an epoch
OWNER_FILE = ".psgrid-experiment"  # in an experiment's folder under DIR: the experiment's own folder, resolved


def require() -> None:
    """Refuse ``--tensorboard`` before anything runs where the extra is missing (one line naming it)."""
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        raise UsageError(MISSING) from None


def experiment_logdir(logdir: Path, out: Path) -> Path:
    """The folder of the experiment in ``out`` under ``logdir``: ``logdir/NAME``, made and claimed if new.

    NAME is ``out``'s name; a folder of that name that another experiment claimed (an ``--out`` of the
    same name elsewhere), or that no experiment did, is not this one's: the next of NAME-2, NAME-3, ... is.
    """
    owner = str(Path(out).resolve())
    name, n = Path(owner).name, 1
    files.make_dirs(logdir)
    folder = Path(logdir) / name
    while not _claim(folder, owner):
        n += 1
        folder = Path(logdir) / f"{name}-{n}"
    return folder


def _claim(folder: Path, owner: str) -> bool:
    """Whether ``folder`` is ``owner``'s: made now and marked so, or marked so before."""
    try:
        folder.mkdir(mode=files.DIR_MODE)
    except FileExistsError:
        return _owner_of(folder) == owner
    files.write_text(folder / OWNER_FILE, owner + "\n")
    return True


def write_run(logdir: Path, name: str, events: list[dict]) -> Path:
    """Write one run's events (as results.run_events reads them) to ``logdir/name``, replacing what was there."""
    from tensorboardX import SummaryWriter

    folder = Path(logdir) / name
    shutil.rmtree(folder, ignore_errors=True)  # a run done again replaces its curves, never doubles them
    writer = SummaryWriter(logdir=str(folder), flush_secs=3600)
    try:
        losses: dict[int, list[float]] = defaultdict(list)
        first: dict[int, float] = {}
        for e in events:
            if e.get("event") == "step" and isinstance(e.get("step"), int) and _finite(e.get("loss")):
                losses[e["step"]].append(e["loss"])
                first.setdefault(e["step"], e["t"])
        for step in sorted(losses):
            writer.add_scalar("train/loss", statistics.fmean(losses[step]), step, walltime=first[step])
        for e in events:
            if e.get("event") == "eval" and isinstance(e.get("step"), int) and _finite(e.get("test_accuracy")):
                writer.add_scalar("test/accuracy", e["test_accuracy"], e["step"], walltime=e["t"])
                if _finite(e.get("epoch")):
                    writer.add_scalar(
                        "test/accuracy_by_epoch", e["test_accuracy"], round(e["epoch"] * EPOCH_SCALE), walltime=e["t"]
                    )
    finally:
        writer.close()
    return folder


def write_job(logdir: Path, name: str, job_out: Path) -> Path:
    """One job's folder (as ``psctl launch`` wrote it) as TensorBoard events under ``logdir/name``.

    A folder of that name that an experiment or another job's folder claimed is not replaced (an
    experiment named like the job lost every run's curves): the next of ``name-2``, ``name-3``, ... is.
    """
    from psgrid.cluster.experiments.results import run_events

    owner = str(Path(job_out).resolve())
    folder, n = Path(logdir) / name, 1
    while _owner_of(folder) not in (None, owner):  # unmarked: an earlier launch's, written before there were marks
        n += 1
        folder = Path(logdir) / f"{name}-{n}"
    written = write_run(folder.parent, folder.name, run_events(Path(job_out)))
    files.write_text(written / OWNER_FILE, owner + "\n")
    return written


def _owner_of(folder: Path) -> str | None:
    try:
        return (folder / OWNER_FILE).read_text().strip()
    except OSError:
        return None


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
