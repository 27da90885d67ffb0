"""TensorBoard event files of a run's records: ``psctl compare --tensorboard DIR`` and ``psctl launch
--tensorboard DIR``.

One folder per run under DIR, named after the run (``async-w4-r0``: mode, workers, repeat), so
``tensorboard --logdir DIR`` overlays every mode and repeat. Each holds the run's mean training loss
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

MISSING = "--tensorboard needs tensorboardX: pip install 'psgrid[tensorboard]'"
EPOCH_SCALE = 1000  # TensorBoard's step is an integer: the epoch axis counts thousandths of an epoch


def require() -> None:
    """Refuse ``--tensorboard`` before anything runs where the extra is missing (one line naming it)."""
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        raise UsageError(MISSING) from None


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
    """One job's folder (as ``psctl launch`` wrote it) as TensorBoard events under ``logdir/name``."""
    from psgrid.cluster.experiments.results import run_events

    return write_run(logdir, name, run_events(Path(job_out)))


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
