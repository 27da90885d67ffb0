"""The few-lines API trains a user's own gradient function on the servers."""

from __future__ import annotations

import runpy
from pathlib import Path

import numpy as np
import pytest

from psgrid.worker.api import DistributedTrainer, addresses_from_env
from tests.support import plane_options

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "custom_model.py"


@pytest.mark.timeout(120)
def test_example_trains_logistic_regression_on_two_workers():
    results = runpy.run_path(str(EXAMPLE))["main"]()
    assert len(results) == 2 and all(r is not None for r in results)
    assert all(r["test_accuracy"] > 0.85 for r in results), results


@pytest.mark.timeout(60)
def test_trainer_pushes_the_users_gradients_by_name(cluster, data_plane):
    c = cluster(2, mode="async", lr=1.0)
    params = {"a": np.zeros((2, 3), np.float32), "b": np.ones(4, np.float32)}

    def grad_fn(p, batch):
        return 0.0, {"a": np.full((2, 3), batch, np.float32), "b": np.zeros(4, np.float32)}

    with DistributedTrainer(c.addresses, params=params, grad_fn=grad_fn, **plane_options(data_plane)) as trainer:
        trainer.step(1.0)
        trainer.step(2.0)
        final = trainer.pull()
        np.testing.assert_allclose(final["a"], -3.0)
        np.testing.assert_allclose(final["b"], 1.0)
        assert trainer.client.data_planes == [data_plane] * 2
        trainer.grad_fn = lambda p, b: (0.0, {"a": np.zeros((2, 3), np.float32)})
        with pytest.raises(ValueError, match=r"no gradient for \['b'\]"):
            trainer.step(None)
    assert c.shard().stats()["members"] == []      # closing left the job


def test_addresses_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("PSGRID_ADDRESSES", "127.0.0.1:1, 127.0.0.1:2")
    assert addresses_from_env() == ["127.0.0.1:1", "127.0.0.1:2"]
    monkeypatch.delenv("PSGRID_ADDRESSES")
    with pytest.raises(RuntimeError, match="PSGRID_ADDRESSES"):
        addresses_from_env()


OWN_WORKER = Path(__file__).resolve().parent.parent / "examples" / "own_worker.py"


def test_the_readmes_worker_is_examples_own_worker_verbatim():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme[readme.index("## Your own worker"):]
    block = section[section.index("```python\n") + len("```python\n"):section.index("```\n", 10)]
    code = OWN_WORKER.read_text()
    assert block == code[code.index("import sys"):]
    loop = block[block.index("with psgrid.Client"):block.index("print(")].strip().splitlines()
    assert len(loop) <= 10 and "Thread" not in block


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_the_readmes_worker_trains_against_running_shards(cluster, data_plane, mode):
    import os
    import subprocess
    import sys

    c = cluster(2, mode=mode, lr=0.1)
    env = dict(os.environ, PYTHONPATH=str(OWN_WORKER.parent.parent))
    runs = [subprocess.Popen([sys.executable, str(OWN_WORKER), ",".join(c.addresses)], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    outputs = [proc.communicate(timeout=50) for proc in runs]
    for proc, (out, err) in zip(runs, outputs):
        assert proc.returncode == 0, err
        assert float(out.split("loss")[1]) < 1e-3, out
    # two workers joined, pushed and left. In async every push is an update; in sync a round is one
    # update, of both workers where both were there (without world=, one may run rounds alone: on a
    # loaded machine the second process can even start after the first has finished).
    stats = c.shard().stats()
    assert stats["members"] == [] and stats["pushes"] == 600
    if mode == "async":
        assert stats["applied_updates"] == 600
    else:
        assert 300 <= stats["applied_updates"] <= 600 and stats["dropped_late"] == 0
        assert stats["version"] == stats["applied_updates"] == c.shard().policy.closed_rounds
