"""The few-lines API trains a user's own gradient function on the servers."""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
import pytest

from psgrid.worker.api import DistributedTrainer, servers_from_env
from tests.cluster_utils import addresses, in_process_cluster

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "custom_model.py"


@pytest.mark.timeout(120)
def test_example_trains_logistic_regression_on_two_workers():
    results = runpy.run_path(str(EXAMPLE))["main"]()
    assert len(results) == 2 and all(r is not None for r in results)
    assert all(r["test_accuracy"] > 0.85 for r in results), results


@pytest.mark.timeout(60)
def test_trainer_pushes_the_users_gradients_by_name():
    with in_process_cluster(2, mode="async", lr=1.0) as servers:
        params = {"a": np.zeros((2, 3), np.float32), "b": np.ones(4, np.float32)}

        def grad_fn(p, batch):
            return 0.0, {"a": np.full((2, 3), batch, np.float32), "b": np.zeros(4, np.float32)}

        with DistributedTrainer(addresses(servers), params=params, grad_fn=grad_fn) as trainer:
            trainer.step(1.0)
            trainer.step(2.0)
            final = trainer.pull()
            np.testing.assert_allclose(final["a"], -3.0)
            np.testing.assert_allclose(final["b"], 1.0)
            trainer.grad_fn = lambda p, b: (0.0, {"a": np.zeros((2, 3), np.float32)})
            with pytest.raises(ValueError, match=r"no gradient for \['b'\]"):
                trainer.step(None)


def test_servers_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("PSGRID_SERVERS", "127.0.0.1:1, 127.0.0.1:2")
    assert servers_from_env() == ["127.0.0.1:1", "127.0.0.1:2"]
    monkeypatch.delenv("PSGRID_SERVERS")
    with pytest.raises(RuntimeError, match="PSGRID_SERVERS"):
        servers_from_env()
