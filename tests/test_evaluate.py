"""The final evaluation of a job's weights (what the coordinator does after training)."""

from __future__ import annotations

import pytest

from psgrid.worker.config import TrainConfig


def test_train_accuracy_of_a_large_synthetic_set_is_measured_on_a_bounded_part(monkeypatch):
    """The coordinator evaluates on the CPU: a synthetic set of any size costs it at most MAX_TRAIN_ROWS rows."""
    from psgrid.worker import evaluate as ev
    from psgrid.worker.loop import build

    monkeypatch.setattr(ev, "MAX_TRAIN_ROWS", 1000)
    train = TrainConfig(
        model="mlp", hidden=[8], dataset="synthetic", synthetic_features=20, synthetic_samples=4500, device="cpu"
    )
    made = []

    def recording_build(*args, **kwargs):
        made.append(build(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(ev, "build", recording_build)
    _, _, whole, model = build(train, rank=0, world=1)
    scores = ev.evaluate_weights(train, model.spec.pack(model.init_params(0)), device="cpu")
    rows = len(made[0][2].train_y)
    assert 0 < rows <= 1000 and len(whole.train_y) == 4500
    assert 0.0 <= scores["train_accuracy"] <= 1.0 and len(made[0][2].test_y) == len(whole.test_y)


def _synthetic(**kw) -> TrainConfig:
    return TrainConfig(
        model="mlp", hidden=[8], dataset="synthetic", synthetic_features=12, synthetic_samples=600, device="cpu", **kw
    )


def test_a_jobs_seed_keeps_its_synthetic_task_and_synthetic_seed_changes_it():
    """Repeats that vary `seed` (compare's) train and test on one task; `synthetic_seed` picks another."""
    import numpy as np

    from psgrid.worker.loop import build

    _, _, base, _ = build(_synthetic(seed=0), rank=1, world=2)
    _, _, reseeded, _ = build(_synthetic(seed=7), rank=1, world=2)
    _, _, other_task, _ = build(_synthetic(seed=0, synthetic_seed=3), rank=1, world=2)
    for a, b in ((base.train_x, reseeded.train_x), (base.train_y, reseeded.train_y), (base.test_x, reseeded.test_x)):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(base.train_x, other_task.train_x)
    assert not np.array_equal(base.test_y, other_task.test_y)


def test_synthetic_test_samples_sets_the_held_out_set_and_leaves_training_alone():
    import numpy as np
    import pytest

    from psgrid.worker.loop import build

    _, _, small, _ = build(_synthetic(), rank=0, world=1)
    _, _, large, _ = build(_synthetic(synthetic_test_samples=5000), rank=0, world=1)
    assert (len(small.test_y), len(large.test_y)) == (2000, 5000)
    np.testing.assert_array_equal(small.test_x, large.test_x[:2000])  # the same draws, more of them
    np.testing.assert_array_equal(small.train_x, large.train_x)
    with pytest.raises(ValueError, match="synthetic_test_samples"):
        _synthetic(synthetic_test_samples=0).validate()


def test_the_test_sets_loss_and_accuracy_in_batches_are_the_whole_sets():
    import numpy as np

    from psgrid.worker.loop import build
    from psgrid.worker.models import accuracy, loss_and_accuracy, softmax_cross_entropy

    _, _, data, model = build(_synthetic(synthetic_test_samples=2500), rank=0, world=1)
    params = model.spec.views(model.spec.pack(model.init_params(3)))
    whole_loss, _ = softmax_cross_entropy(model.predict(params, data.test_x), data.test_y)
    loss, acc = loss_and_accuracy(model, params, data.test_x, data.test_y, batch=1000)  # a short last batch
    assert np.isclose(loss, float(whole_loss), rtol=1e-5)
    assert acc == accuracy(model, params, data.test_x, data.test_y) and 0.0 < acc < 1.0


class Untouchable:
    """A test set that no worker but the evaluating one may read (on a GPU each copy costs device memory)."""

    def __len__(self):
        return 10

    def __array__(self, *args, **kwargs):
        raise AssertionError("a worker that does not evaluate read the test set")


def test_only_the_evaluating_worker_takes_the_test_set(tmp_path):
    import dataclasses
    import json

    from psgrid.worker.loop import build, train_loop
    from tests.test_pull_ahead import STEPS, RecordingExchange

    train = TrainConfig(model="softmax", dataset="digits", batch_size=32, steps=STEPS, eval_every=4, device="cpu")
    xp, device, data, model = build(train, 0, 1, device="cpu")
    init = model.spec.pack(model.init_params(train.seed, train.init_scale))
    hidden = dataclasses.replace(data, test_x=Untouchable(), test_y=Untouchable())
    assert train_loop(train, RecordingExchange(init.copy(), "async"), 1, xp, device, hidden, model)["steps"] == STEPS
    with pytest.raises(AssertionError, match="read the test set"):  # rank 0 evaluates: it reads it
        train_loop(train, RecordingExchange(init.copy(), "async"), 0, xp, device, hidden, model)
    metrics = tmp_path / "rank0.jsonl"
    train_loop(train, RecordingExchange(init.copy(), "async"), 0, xp, device, data, model, str(metrics))
    evals = [r for r in map(json.loads, metrics.read_text().splitlines()) if r["event"] == "eval"]
    assert [r["step"] for r in evals] == list(range(4, STEPS + 1, 4)) and 0 <= evals[-1]["test_accuracy"] <= 1
