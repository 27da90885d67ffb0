"""Accuracy of a job's weights: the shards' (pulled as an observer, which never waits or counts) or given."""

from __future__ import annotations

import numpy as np

from psgrid.worker.config import TrainConfig
from psgrid.worker.loop import build, make_admin
from psgrid.worker.models import accuracy, softmax_cross_entropy


def evaluate(train: TrainConfig, addresses: list[str], device: str | None = "cpu") -> dict:
    """Train and test accuracy (and test loss) of the shards' current weights on the whole data set."""
    with make_admin(train, addresses, deadline_s=train.deadline_s, retry_s=train.retry_s) as admin:
        flat, versions = admin.pull()
    return evaluate_weights(train, flat, version=max(versions), device=device)


def evaluate_weights(train: TrainConfig, flat: np.ndarray, *, version: int | None = None,
                     device: str | None = "cpu") -> dict:
    """Train and test accuracy (and test loss) of the flat weights ``flat`` of this job's model."""
    xp, _, data, model = build(train, rank=0, world=1, device=device)
    if flat.shape != (model.spec.size,):
        raise ValueError(f"the weights hold {flat.size} parameters; this job's model has {model.spec.size}")
    params = model.spec.views(xp.asarray(flat))
    test_x, test_y = xp.asarray(data.test_x), xp.asarray(data.test_y)
    logits = model.predict(params, test_x)
    test_loss, _ = softmax_cross_entropy(logits, test_y)
    return {
        "train_accuracy": accuracy(model, params, xp.asarray(data.train_x), xp.asarray(data.train_y)),
        "test_accuracy": accuracy(model, params, test_x, test_y),
        "test_loss": float(test_loss),
        "version": version,
    }
