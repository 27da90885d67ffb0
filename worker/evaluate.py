"""Accuracy of a job's weights: the shards' (pulled as an observer, which never waits or counts) or given.

Train accuracy is measured on at most ``MAX_TRAIN_ROWS`` training samples: a synthetic task can
hold hundreds of thousands (2.4 GB of 3x32x32 images at 200,000), and the coordinator evaluates on
the CPU. The synthetic generator makes only the rows asked for, so a larger set is cut to its first
shard of that size, not generated whole.
"""

from __future__ import annotations

import math

import numpy as np

from psgrid.worker.config import TrainConfig
from psgrid.worker.loop import build, make_admin
from psgrid.worker.models import accuracy, loss_and_accuracy

MAX_TRAIN_ROWS = 20_000


def evaluate(train: TrainConfig, addresses: list[str], device: str | None = "cpu") -> dict:
    """Train and test accuracy (and test loss) of the shards' current weights (train: up to MAX_TRAIN_ROWS)."""
    with make_admin(train, addresses, deadline_s=train.deadline_s, retry_s=train.retry_s) as admin:
        pulled = admin.pull()
    return evaluate_weights(train, pulled.out, version=max(pulled.wait()), device=device)


def evaluate_weights(
    train: TrainConfig, flat: np.ndarray, *, version: int | None = None, device: str | None = "cpu"
) -> dict:
    """Train and test accuracy (and test loss) of the flat weights ``flat`` of this job's model."""
    parts = math.ceil(train.synthetic_samples / MAX_TRAIN_ROWS) if train.dataset == "synthetic" else 1
    xp, _, data, model = build(train, rank=0, world=max(1, parts), device=device)
    if flat.shape != (model.spec.size,):
        raise ValueError(f"the weights hold {flat.size} parameters; this job's model has {model.spec.size}")
    params = model.spec.views(xp.asarray(flat))
    test_loss, test_accuracy = loss_and_accuracy(model, params, data.test_x, data.test_y)
    return {
        "train_accuracy": accuracy(model, params, data.train_x, data.train_y),
        "test_accuracy": test_accuracy,
        "test_loss": test_loss,
        "version": version,
    }
