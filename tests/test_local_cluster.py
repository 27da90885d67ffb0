"""psgrid.LocalCluster: a job's shards (and optionally its workers) in the background, as Dask's LocalCluster."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import psgrid
from psgrid.worker import env as job_vars
from tests.support import alive


@pytest.fixture
def no_job_env(monkeypatch):
    for name in job_vars.NAMES:
        monkeypatch.delenv(name, raising=False)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_notebook_trains_against_a_local_cluster(no_leaks, no_job_env):
    w = np.zeros(3, np.float32)
    with psgrid.LocalCluster(shards=2, mode="sync", lr=1.0) as cluster:
        assert len(cluster.addresses) == 2 and "2 shards, sync" in repr(cluster)
        out, pids = cluster.out, [s.pid for s in cluster._launcher.shards]
        with cluster.init({"w": w}) as ps:
            for _ in range(5):
                ps.pull()
                ps.push({"w": np.ones(3, np.float32)}, loss=1.0, samples=2)
            ps.pull()
            ps.log_eval(test_accuracy=0.5)
        running = cluster.summary()
        assert (running["status"], running["steps"], running["samples"]) == ("running", 5, 10)
        assert [s["version"] for s in cluster.stats()] == [5, 5]
        weights = np.empty(3, np.float32)
        with cluster.client(psgrid.ModelSpec([("w", (3,))])) as client:  # a client of its shards, its token
            client.pull(weights)
        np.testing.assert_array_equal(weights, -5.0)
    np.testing.assert_array_equal(w, -5.0)
    summary = cluster.summary()
    assert (summary["status"], summary["launcher"], summary["steps"], summary["test_accuracy"]) == (
        "ok",
        "local",
        5,
        0.5,
    )
    assert [s["version"] for s in summary["shard_stats"]] == [5, 5]
    assert not out.exists(), "its temporary folder outlived it"
    assert not any(alive(pid) for pid in pids)
    # closed: what needs its shards says so at once (it read as a lost job file, or retried for seconds)
    for use in (lambda: cluster.init({"w": w}), cluster.stats, lambda: cluster.client(psgrid.ModelSpec([("w", (3,))]))):
        with pytest.raises(RuntimeError, match=r"LocalCluster\.\w+: this cluster is closed"):
            use()
    assert cluster.close() is summary and "closed" in repr(cluster)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_background_workers_train_the_jobs_model(no_leaks, tmp_path):
    with psgrid.LocalCluster(
        shards=1, workers=2, config="mnist", steps=40, eval_every=0, out=str(tmp_path / "run")
    ) as cluster:
        cluster.wait(timeout=100)
        assert cluster.summary()["workers_completed"] == 2
    summary = cluster.summary()
    assert (summary["status"], summary["workers_completed"], summary["steps"]) == ("ok", 2, 80)
    assert summary["test_accuracy"] > 0.5  # the job's own evaluation, as psctl launch makes it
    assert (tmp_path / "run" / "summary.json").is_file() and (tmp_path / "run" / "metrics.jsonl").is_file()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_forgotten_cluster_stops_what_it_started(no_leaks):
    cluster = psgrid.LocalCluster(shards=1)
    out, pids = cluster.out, [s.pid for s in cluster._launcher.shards]
    assert all(alive(pid) for pid in pids)
    del cluster
    gc.collect()
    assert not any(alive(pid) for pid in pids) and not out.exists()
