"""Samples/s over a run's steady steps, the one estimator ``psctl bench train`` and ``psctl bench script`` share.

A job's first steps connect, map the shards' memory, warm caches and (cuDNN) choose kernels; the
reference with no servers warms up before it is timed. Counting both from their steady steps, the
same way, keeps the ratio what the parameter server costs a step.
"""

from __future__ import annotations

import json
from pathlib import Path


def steady_samples_per_s(metrics_files: list[Path], skip: int) -> float | None:
    """Samples/s of a run: each worker's samples over its steps after the first ``skip``, per second, summed.

    None where a worker recorded no samples (a script that does not pass ``samples=`` to ``push``)
    or too few steps.
    """
    total = 0.0
    for path in metrics_files:
        steps = [r for r in map(json.loads, path.read_text().splitlines()) if r.get("event") == "step"]
        steady = steps[skip:]
        if len(steady) < 2 or any("samples" not in r for r in steady):
            return None
        # From the start of the first steady step to the record of the last (written once its push ended).
        seconds = steady[-1]["time"] - steady[0]["started"]
        total += sum(r["samples"] for r in steady) / seconds
    return total


def beside(before: float, after: float) -> float:
    """A run's reference: the mean of the reference runs just before and just after it.

    On a shared GPU host the reference moved by a fifth between runs minutes apart
    (docs/performance.md), so each run is divided by the references on either side of it.
    """
    return (before + after) / 2
