"""The final evaluation of a job's weights (what the coordinator does after training)."""

from __future__ import annotations

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
