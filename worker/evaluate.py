"""Accuracy of the weights the shards hold now, pulled as an observer (never waits, never counts)."""

from __future__ import annotations

import numpy as np

from psgrid.psserver.client import ShardedClient
from psgrid.worker.config import TrainConfig
from psgrid.worker.loop import build, make_client
from psgrid.worker.models import accuracy, softmax_cross_entropy


def evaluate(train: TrainConfig, servers: list[str], device: str | None = "cpu") -> dict:
    """Train and test accuracy (and test loss) of the shards' current weights on the whole data set."""
    xp, _, data, model = build(train, rank=0, world=1, device=device)
    client: ShardedClient = make_client(train, servers)
    try:
        client.observe(model.spec)
        flat = np.empty(model.spec.size, np.float32)
        versions = client.pull(flat)
    finally:
        client.close()
    params = model.spec.views(xp.asarray(flat))
    test_x, test_y = xp.asarray(data.test_x), xp.asarray(data.test_y)
    logits = model.predict(params, test_x)
    test_loss, _ = softmax_cross_entropy(logits, test_y)
    return {
        "train_accuracy": accuracy(model, params, xp.asarray(data.train_x), xp.asarray(data.train_y)),
        "test_accuracy": accuracy(model, params, test_x, test_y),
        "test_loss": float(test_loss),
        "version": max(versions),
    }
