"""Your own array model on the shards: an MLP on the 8 x 8 digits, CuPy on a GPU, NumPy elsewhere.

    psctl launch --workers 2 -- python examples/train_cupy.py
    mpiexec -n 4 psctl mpi --shards 1 -- python examples/train_cupy.py --steps 300
    psctl bench script --device gpu -- python examples/train_cupy.py --hidden 4096 --layers 3 --batch-size 512

The model is plain array code written once against ``xp`` (``cupy`` or ``numpy``); the lines
marked ``# +ps`` are all it takes to train it on the job's shards, which hold the weights and
apply the job's optimizer (``--lr``, ``--mode`` ... of psctl). Each worker trains on its own
share of the data; rank 0 reports the test accuracy.
"""

from __future__ import annotations

import argparse

import numpy as np

import psgrid  # +ps
from psgrid.worker.data import read_shipped


def array_module(gpu: int | None):
    """CuPy on this worker's GPU where there is one (and CuPy), else NumPy."""
    if gpu is None:
        return np
    try:
        import cupy
    except ImportError:
        return np
    cupy.cuda.Device(gpu).use()
    return cupy


def init_params(sizes: list[int], seed: int) -> dict:
    rng = np.random.default_rng(seed)
    params = {}
    for i, (n_in, n_out) in enumerate(zip(sizes, sizes[1:])):
        params[f"w{i}"] = (rng.normal(size=(n_in, n_out)) * np.sqrt(2 / n_in)).astype(np.float32)
        params[f"b{i}"] = np.zeros(n_out, np.float32)
    return params


def forward(xp, params: dict, x):
    """Logits, and each layer's input (for the backward pass)."""
    layers = len(params) // 2
    inputs = []
    for i in range(layers):
        inputs.append(x)
        x = x @ params[f"w{i}"] + params[f"b{i}"]
        if i < layers - 1:
            x = xp.maximum(x, 0)
    return x, inputs


def loss_and_grads(xp, params: dict, x, y):
    """Mean softmax cross-entropy and its gradients by name."""
    logits, inputs = forward(xp, params, x)
    logits = logits - logits.max(axis=1, keepdims=True)
    probs = xp.exp(logits)
    probs /= probs.sum(axis=1, keepdims=True)
    rows = xp.arange(len(y))
    loss = -xp.log(probs[rows, y] + 1e-12).mean()
    delta = probs
    delta[rows, y] -= 1
    delta /= len(y)
    grads = {}
    for i in reversed(range(len(inputs))):
        grads[f"w{i}"] = inputs[i].T @ delta
        grads[f"b{i}"] = delta.sum(axis=0)
        if i:
            delta = (delta @ params[f"w{i}"].T) * (inputs[i] > 0)
    return float(loss), grads


def accuracy(xp, params: dict, x, y) -> float:
    return float((forward(xp, params, x)[0].argmax(axis=1) == y).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64, help="width of each hidden layer")
    parser.add_argument("--layers", type=int, default=1, help="hidden layers")
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--seed", type=int, default=None, help="default: the job's seed (PSGRID_SEED), else 0")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else psgrid.job_env().seed or 0  # psctl compare varies it per repeat

    xp = array_module(psgrid.job_env().gpu)
    params = {k: xp.asarray(v) for k, v in init_params([64, *[args.hidden] * args.layers, 10], seed).items()}
    ps = psgrid.init(params)  # +ps: join the job; the shards start from rank 0's weights

    images, labels = read_shipped("digits")  # the UCI digits scikit-learn has, shipped with psgrid
    x, y = xp.asarray(images.reshape(len(labels), -1) / 16, dtype=xp.float32), xp.asarray(labels, dtype=xp.int64)
    x_train, y_train = x[:1400][ps.rank :: ps.world], y[:1400][ps.rank :: ps.world]
    x_test, y_test = x[1400:], y[1400:]
    rng = np.random.default_rng(seed + ps.rank)
    loss = float("nan")
    for step in range(ps.first_step, args.steps):  # +ps: a resumed job makes only the steps that are left
        ps.pull()  # +ps: the shards' weights, written into params
        batch = xp.asarray(rng.choice(len(y_train), size=args.batch_size, replace=False))
        loss, grads = loss_and_grads(xp, params, x_train[batch], y_train[batch])
        ps.push(grads, loss=loss, samples=args.batch_size)  # +ps: instead of your own update
        if ps.rank == 0 and args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            ps.log_eval(test_accuracy=accuracy(xp, params, x_test, y_test))
    ps.pull()  # the final weights
    final = accuracy(xp, params, x_test, y_test)
    if ps.rank == 0:
        ps.log_eval(test_accuracy=final, train_accuracy=accuracy(xp, params, x[:1400], y[:1400]))
    ps.close()  # +ps: leave the job
    print(
        f"worker {ps.rank} of {ps.world} ({'cupy' if xp is not np else 'numpy'}): {args.steps} steps, "
        f"last loss {loss:.4f}, test accuracy {final:.4f}"
    )


if __name__ == "__main__":
    main()
