"""Real training through real shards on the CPU: the accuracy figures the GPU-workers issue asks for."""

from __future__ import annotations

import json

import numpy as np
import pytest

from psgrid.worker.config import TrainConfig
from psgrid.worker.evaluate import evaluate
from psgrid.worker.loop import run_worker
from tests.support import run_threads

# The built-in trainer takes TrainConfig's plane (shared memory on this host), whatever the fixture's.
pytestmark = [pytest.mark.slow, pytest.mark.parametrize("data_plane", ["shm"])]


def train_job(cluster, tmp_path, train: TrainConfig, workers: int, shards: int = 2, **server):
    c = cluster(shards, **server)
    results = run_threads(
        [lambda r=r: run_worker(train, c.addresses, r, workers, str(tmp_path / f"w{r}.jsonl")) for r in range(workers)],
        timeout=150,
    )
    return results, evaluate(train, c.addresses), c.weights()


@pytest.mark.timeout(180)
def test_two_worker_sync_mlp_reaches_90_percent_on_mnist5k(cluster, tmp_path):
    train = TrainConfig(model="mlp", hidden=[128], dataset="mnist5k", batch_size=64, steps=300, eval_every=100)
    results, scores, _ = train_job(cluster, tmp_path, train, workers=2, mode="sync", lr=0.1, momentum=0.9)
    assert scores["test_accuracy"] >= 0.90, scores
    assert [r["steps"] for r in results] == [300, 300]
    records = [json.loads(line) for line in (tmp_path / "w0.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["event"] == "step"]
    evals = [r for r in records if r["event"] == "eval"]
    assert len(steps) == 300 and [e["step"] for e in evals] == [100, 200, 300]
    for key in ("time", "worker", "clock", "loss", "staleness", "bytes", "pull_s", "compute_s", "push_s"):
        assert key in steps[0], key
    assert all(s["staleness"] == 0 for s in steps), "sync updates are never stale"
    assert steps[-1]["loss"] < steps[0]["loss"] / 5


@pytest.mark.timeout(180)
def test_sigmoid_mlp_full_batch_reaches_95_percent_training_accuracy(cluster, tmp_path):
    # The classic exercise: 784-25-10 sigmoid, full batch. Two workers each hold half the
    # training set; sync averages their gradients, which is exactly the full-batch gradient.
    train = TrainConfig(
        model="mlp", hidden=[25], activation="sigmoid", dataset="mnist5k", batch_size=0, steps=100, eval_every=0
    )
    _, scores, _ = train_job(cluster, tmp_path, train, workers=2, mode="sync", lr=1.0, momentum=0.9)
    assert scores["train_accuracy"] >= 0.95, scores


@pytest.mark.timeout(180)
def test_same_seed_gives_the_same_weights_in_sync_mode(cluster, tmp_path):
    train = TrainConfig(model="mlp", hidden=[32], dataset="digits", batch_size=32, steps=40, eval_every=0, seed=3)
    runs = [train_job(cluster, tmp_path / str(i), train, workers=3, mode="sync", lr=0.1)[2] for i in range(2)]
    np.testing.assert_array_equal(runs[0], runs[1])
    other = TrainConfig(**{**train.__dict__, "seed": 4})
    assert not np.array_equal(runs[0], train_job(cluster, tmp_path / "other", other, workers=3, mode="sync", lr=0.1)[2])


@pytest.mark.timeout(120)
def test_a_lone_async_worker_without_overlap_is_never_stale_and_with_it_still_learns(cluster, tmp_path):
    """overlap = false: each pull waits for the push before it, so one worker alone sees staleness 0.
    With overlap (the default) its pushes run beside the next step and land all the same."""
    train = TrainConfig(
        model="softmax", dataset="digits", batch_size=32, steps=120, eval_every=0, overlap=False, init_scale=0.1
    )
    results, scores, _ = train_job(cluster, tmp_path, train, workers=1, mode="async", lr=0.5)
    steps = [json.loads(line) for line in (tmp_path / "w0.jsonl").read_text().splitlines()]
    assert [s["staleness"] for s in steps if s["event"] == "step"] == [0] * 120
    assert scores["test_accuracy"] >= 0.85, scores
    train.overlap = True
    results, scores, _ = train_job(cluster, tmp_path / "overlap", train, workers=1, mode="async", lr=0.5)
    steps = [json.loads(line) for line in (tmp_path / "overlap" / "w0.jsonl").read_text().splitlines()]
    applied = [s for s in steps if s["event"] == "step" and s["outcome"] == "APPLIED"]
    assert len(applied) == 120 and max(s["staleness"] for s in applied) <= 1
    assert scores["test_accuracy"] >= 0.85, scores


@pytest.mark.timeout(150)
def test_two_async_workers_learn_with_dc_and_auto_momentum(cluster, tmp_path, monkeypatch):
    """Delay compensation and asynchrony-aware momentum through real shards, read back over gRPC."""
    from psgrid.psserver.kernels.optim import SGD

    applied = []
    real = SGD.set_momentum
    monkeypatch.setattr(SGD, "set_momentum", lambda self, mu: (applied.append(mu), real(self, mu))[1])
    train = TrainConfig(model="softmax", dataset="digits", batch_size=32, steps=150, eval_every=0, init_scale=0.1)
    c = cluster(2, mode="async", lr=0.2, momentum=0.9, staleness_compensation="dc", async_momentum="auto")
    results = run_threads(
        [lambda r=r: run_worker(train, c.addresses, r, 2, str(tmp_path / f"w{r}.jsonl")) for r in range(2)], timeout=120
    )
    assert [r["steps"] for r in results] == [150, 150]
    scores = evaluate(train, c.addresses)
    assert scores["test_accuracy"] >= 0.85, scores
    assert 0.4 in [round(mu, 12) for mu in applied], applied  # two live workers: 0.9 - (1 - 1/2)
    for stats in c.admin().stats():  # through StatsReply
        stale = stats["applied_updates"] - stats["staleness_counts"][0]
        assert stale > 0 and stats["uncompensated_updates"] < stale, stats
        assert stats["momentum"] in (pytest.approx(0.4), pytest.approx(0.9)), stats
