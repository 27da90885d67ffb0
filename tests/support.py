"""Plain helpers several test modules share (fixtures live in conftest.py)."""

from __future__ import annotations

import threading

import numpy as np

from psgrid.psserver.spec import ModelSpec

FEATURES = 12
REGRESSION = ModelSpec([("w", (FEATURES,)), ("b", (1,))])


def make_problem(seed: int = 0, n: int = 400):
    """A linear regression problem: inputs, targets, true weights and bias."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    w_true = rng.normal(size=FEATURES).astype(np.float32)
    b_true = np.float32(0.7)
    return x, x @ w_true + b_true, w_true, b_true


def regression_grad(params: np.ndarray, x: np.ndarray, y: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The mean squared error's gradient for REGRESSION's flat layout."""
    out = np.empty(REGRESSION.size, np.float32) if out is None else out
    residual = x @ params[:FEATURES] + params[FEATURES] - y
    out[:FEATURES] = x.T @ residual / len(y)
    out[FEATURES] = residual.mean()
    return out


def run_threads(targets, timeout: float) -> list:
    """Run callables in threads; re-raise the first error; fail if any is still running after timeout."""
    results = [None] * len(targets)
    errors = []

    def wrap(i, fn):
        try:
            results[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(i, fn), daemon=True) for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    alive = [t for t in threads if t.is_alive()]
    if errors:
        raise errors[0]
    assert not alive, f"{len(alive)} threads still running after {timeout}s (deadlock?)"
    return results
