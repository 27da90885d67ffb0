"""Your own model on the parameter servers: logistic regression on scikit-learn's digits.

The training code is ordinary NumPy; the lines marked `# +ps` are all it takes to
train it on sharded servers. Run it as it is (it starts two local shards in this
process for the demonstration), or point it at a running job with
PSGRID_ADDRESSES=host:port,host:port.

    python examples/custom_model.py
"""

from __future__ import annotations

import os
import threading

import numpy as np
from sklearn.datasets import load_digits

from psgrid import DistributedTrainer  # +ps


def grad_fn(params, batch):
    """Mean softmax cross-entropy of a linear model, and its gradients by name."""
    x, y = batch
    logits = x @ params["w"] + params["b"]
    logits -= logits.max(axis=1, keepdims=True)
    probs = np.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    loss = -np.log(probs[np.arange(len(y)), y]).mean()
    probs[np.arange(len(y)), y] -= 1
    probs /= len(y)
    return loss, {"w": x.T @ probs, "b": probs.sum(axis=0)}


def train(addresses, rank: int, world: int, steps: int = 300) -> dict:
    digits = load_digits()
    x, y = (digits.data / 16).astype(np.float32), digits.target
    x_train, y_train = x[:1400][rank::world], y[:1400][rank::world]
    params = {"w": np.zeros((64, 10), np.float32), "b": np.zeros(10, np.float32)}
    rng = np.random.default_rng(rank)
    trainer = DistributedTrainer(addresses, params=params, grad_fn=grad_fn, world=world)  # +ps
    with trainer:  # +ps
        for _ in range(steps):
            idx = rng.choice(len(y_train), size=64, replace=False)
            loss = trainer.step((x_train[idx], y_train[idx]))  # +ps (instead of: grad_fn + your update)
        final = trainer.pull()  # +ps
        accuracy = float(((x[1400:] @ final["w"] + final["b"]).argmax(axis=1) == y[1400:]).mean())
    return {"rank": rank, "loss": float(loss), "test_accuracy": accuracy}


def main() -> list[dict]:
    if os.environ.get("PSGRID_ADDRESSES"):
        return [train(None, rank=int(os.environ.get("RANK", 0)), world=int(os.environ.get("WORLD", 1)))]
    from psgrid import ServerConfig, serve

    shards = [serve(ServerConfig(shard_index=i, num_shards=2, mode="sync", lr=0.5)) for i in range(2)]
    try:
        addresses = [s.address for s in shards]
        results = [None, None]
        workers = [threading.Thread(target=lambda r=r: results.__setitem__(r, train(addresses, r, 2)))
                   for r in range(2)]
        for w in workers:
            w.start()
        for w in workers:
            w.join(timeout=120)
        return results
    finally:
        for s in shards:
            s.stop()


if __name__ == "__main__":
    for result in main():
        print(result)
