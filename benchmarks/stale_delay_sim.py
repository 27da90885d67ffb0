"""How much a gradient's staleness alone costs a model: one process, no shards, the delay by hand.

Trains a built-in model on its synthetic task with the shards' own optimizer (psserver/kernels/optim.py),
each gradient computed from the weights of ``--delay`` updates before (0: plain training; 1: what one
async worker whose push overlaps its next step sees; about W: W async workers), and prints the test
accuracy every 25 updates. It separates what staleness does to the maths from anything the exchange
does (synthetic-cnn: docs/experiments/synthetic-gpu-stale-tables-2xH200)::

    python benchmarks/stale_delay_sim.py --delay 1 --init-scale 0.5
"""

from __future__ import annotations

import argparse
from collections import deque

import numpy as np

from psgrid.psserver.kernels.optim import make_optimizer
from psgrid.worker.data import load_dataset
from psgrid.worker.models.base import accuracy
from psgrid.worker.models.cnn import SmallCNN


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--delay", type=int, default=0, help="updates between the weights a gradient is of and those it updates"
    )
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--optimizer", choices=("adam", "sgd"), default="adam")
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--momentum", type=float, default=0.9, help="SGD's momentum or Adam's beta1")
    p.add_argument("--init-scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0, help="initial weights and batches")
    p.add_argument("--synthetic-seed", type=int, default=0, help="the task (the jobs' synthetic_seed)")
    a = p.parse_args()
    if a.delay < 0 or a.steps < 1 or a.batch_size < 1:
        p.error("--delay must be >= 0, and --steps and --batch-size >= 1")

    data = load_dataset("synthetic", seed=a.synthetic_seed, image=(3, 32, 32), samples=32768, classes=10)
    model = SmallCNN(data.input_shape, data.num_classes, hidden=1024)  # examples/synthetic-cnn.toml's model
    spec = model.spec
    weights = spec.pack(model.init_params(a.seed, a.init_scale)).astype(np.float32)
    key = "beta1" if a.optimizer == "adam" else "momentum"
    optimizer = make_optimizer(a.optimizer, spec.size, lr=a.lr, **{key: a.momentum})
    rng = np.random.default_rng(a.seed)
    history = deque([weights.copy()], maxlen=a.delay + 1)  # history[0]: the weights of `delay` updates ago
    grad = np.zeros(spec.size, np.float32)
    for step in range(1, a.steps + 1):
        rows = rng.integers(0, len(data.train_y), a.batch_size)
        model.loss_and_grad(spec.views(history[0]), data.train_x[rows], data.train_y[rows], spec.views(grad))
        optimizer.step(weights, grad)
        history.append(weights.copy())
        if step % 25 == 0:
            acc = accuracy(model, spec.views(weights), data.test_x[:1000], data.test_y[:1000])
            print(f"update {step}: test accuracy {acc:.3f}", flush=True)


if __name__ == "__main__":
    main()
