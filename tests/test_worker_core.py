"""One worker path: every worker feature reaches the built-in trainer and a user's script alike (worker/core.py).

The same feature matrix runs through ``psctl launch --config mnist`` and ``psctl launch -- python
examples/train_cupy.py``; each feature must show in both runs' records, where a second copy of the
worker's code would show in one only.
"""

from __future__ import annotations

import csv
import json
import subprocess
import sys

import numpy as np
import pytest

from tests.support import ROOT, launch_env, run_launch

SCRIPT = ["--", "python", "examples/train_cupy.py", "--steps", "12", "--eval-every", "0"]
BUILT_IN = ["--config", "mnist", "--steps", "12", "--eval-every", "0"]

# One job per row, to keep the suite short: a straggler, in async, pulling ahead (with the overlap it needs).
FEATURES = {
    "stragglers_pull_ahead": [
        "--set",
        'mode="async"',
        "--set",
        'train.stragglers=["1:4"]',
        "--set",
        "train.pull_ahead=true",
    ],
    "aggregate": ["--mode", "sync", "--set", 'train.aggregate="host"'],
    "placement": ["--mode", "async", "--set", 'shard_placement="worker"'],
}


def records(out, rank: int) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics" / f"worker-{rank}.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("worker", ["built-in", "script"])
def test_each_worker_feature_reaches_the_built_in_trainer_and_a_script(tmp_path, feature, worker):
    runner = BUILT_IN if worker == "built-in" else SCRIPT
    at = runner.index("--") if "--" in runner else len(runner)
    args = [*runner[:at], "--workers", "2", "--no-progress", *FEATURES[feature], *runner[at:]]
    code, text, out = run_launch(tmp_path, *args)
    assert code == 0, text
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["steps"] == 24, summary
    starts = {rank: next(r for r in records(out, rank) if r["event"] == "start") for rank in (0, 1)}
    steps = {rank: [r for r in records(out, rank) if r["event"] == "step"] for rank in (0, 1)}
    assert all(len(s) == 12 for s in steps.values())
    if feature == "stragglers_pull_ahead":
        assert all(start["stragglers"] == ["1:4"] for start in starts.values())
        assert all(r["delay_s"] > 0 for r in steps[1]) and all(r["delay_s"] == 0 for r in steps[0])
        # 3 x its own compute: the delay follows the step it slowed.
        assert all(r["delay_s"] == pytest.approx(3 * r["compute_s"]) for r in steps[1])
        assert all(start["pull_ahead"] and start["overlap"] for start in starts.values())
        assert all("pull_ahead_s" in r for rank in (0, 1) for r in steps[rank][1:])
        # Overlapped and pulled ahead, a lone worker's gradient is of weights up to two of its own pushes old.
        assert max(r["staleness"] for rank in (0, 1) for r in steps[rank]) >= 1
    elif feature == "aggregate":
        # One host: its leader pushes the mean of both workers' gradients, once a step, as one worker.
        assert all(s["pushes"] == 12 for s in summary["shard_stats"]), summary["shard_stats"]
    else:
        # Shard i in worker i's process: each worker calls its own shard in place and the other over shared memory
        # (over CUDA IPC where the shards resolved to a GPU: a machine with one, shard_device auto).
        other = "ipc" if summary["shard_device"] == "gpu" else "shm"
        assert [starts[rank]["data_planes"] for rank in (0, 1)] == [["local", other], [other, "local"]]
        assert all(s["pushes"] == 24 for s in summary["shard_stats"]), summary["shard_stats"]
        assert not (out / "logs" / "server-0.log").exists()  # no shard process was started


def _weights_seen(text: str) -> dict[int, list[float]]:
    seen = {}
    for line in text.splitlines():
        if line.startswith("[rank ") and '"seen"' in line:
            found = json.loads(line.split("] ", 1)[1])
            seen[found["rank"]] = found["seen"]
    return seen


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_script_aggregated_per_host_sees_the_same_weights_in_sync_as_unaggregated(tmp_path):
    base = ["--workers", "2", "--shards", "2", "--mode", "sync", "--lr", "1", "--set", "momentum=0.0", "--no-progress"]
    command = ["--", "python", "tests/user_script.py", "6"]
    (tmp_path / "plain").mkdir()
    (tmp_path / "host").mkdir()
    plain_code, plain, _ = run_launch(tmp_path / "plain", *base, *command)
    host_code, host, out = run_launch(tmp_path / "host", *base, "--set", 'train.aggregate="host"', *command)
    assert plain_code == 0 and host_code == 0, (plain, host)
    plain_seen, host_seen = _weights_seen(plain), _weights_seen(host)
    # Gradients rank + 1: each sync round moves every weight by minus their mean, 1.5.
    assert plain_seen == {0: [-1.5 * k for k in range(7)], 1: [-1.5 * k for k in range(7)]}, plain
    assert host_seen == plain_seen, host
    assert all(s["pushes"] == 6 for s in json.loads((out / "summary.json").read_text())["shard_stats"])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_compare_slows_a_scripts_straggler_and_sync_pays_for_it(tmp_path):
    # A researcher's question, asked of their own script: what does one 8x slower worker cost sync?
    out = tmp_path / "experiment"
    argv = [
        sys.executable,
        "-m",
        "psgrid.cluster.cli",
        "compare",
        "--modes",
        "sync",
        "--workers",
        "2",
        "--stragglers",
        "none",
        "--stragglers",
        "1:8",
        "--out",
        str(out),
        "--no-progress",
        "--",
        "python",
        "examples/train_cupy.py",
        "--steps",
        "60",
        "--hidden",
        "512",
        "--batch-size",
        "256",
        "--eval-every",
        "0",
    ]
    done = subprocess.run(argv, cwd=ROOT, env=launch_env(), capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(out / "summary.csv") as f:
        rows = {row["stragglers"]: row for row in csv.DictReader(f)}
    assert set(rows) == {"none", "1:8"} and all(row["status"] == "ok" for row in rows.values())
    steps = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    by_worker = {(r["stragglers"], r["rank"]): [] for r in steps if r.get("event") == "step"}
    for r in steps:
        if r.get("event") == "step":
            by_worker[(r["stragglers"], r["rank"])].append(r)
    delays = {key: [r["delay_s"] for r in records] for key, records in by_worker.items()}
    assert all(d > 0 for d in delays[("1:8", 1)]) and not any(delays[("1:8", 0)]) and not any(delays[("none", 1)])
    # Every sync round waits for the straggler: the fast worker spends most of the straggler's sleep in its
    # exchange, waiting for the round to close. (Not a samples/s ratio: on a loaded machine the start-up and
    # the scheduler's noise in a 60-step job can hide the sleep from the job's rate, but never from the wait.)
    waited = sum(r["pull_s"] + r["push_s"] for r in by_worker[("1:8", 0)])
    assert waited > 0.5 * sum(delays[("1:8", 1)]), (waited, sum(delays[("1:8", 1)]))


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_psctl_mpi_aggregates_a_scripts_workers_through_one_client_per_node(tmp_path):
    """5 ranks on this node (coordinator, shard, 3 workers running a script): one node, one aggregator, whose
    client is the shards' only worker; each sync round moves the weights by minus the mean gradient, 2."""
    from tests.support import run_mpiexec

    out = tmp_path / "run"
    code, stdout, err, _ = run_mpiexec(
        5,
        [
            "-m",
            "psgrid.cluster.cli",
            "mpi",
            "--shards",
            "1",
            "--mode",
            "sync",
            "--lr",
            "1",
            "--set",
            "momentum=0.0",
            "--set",
            'train.aggregate="host"',
            "--out",
            str(out),
            "--",
            "python",
            "tests/user_script.py",
            "4",
        ],
        timeout=190,
    )
    assert code == 0, err
    starts = {rank: next(r for r in records(out, rank) if r["event"] == "start") for rank in range(3)}
    assert {rank: s["worker"] for rank, s in starts.items()} == {0: 0, 1: 0, 2: 0}
    assert [starts[rank]["data_planes"] for rank in (1, 2)] == [["host"], ["host"]]
    seen = _weights_seen(stdout + err)
    assert seen == {rank: [-2.0 * k for k in range(5)] for rank in range(3)}, stdout + err


# ----- a script's session on the core, in this process ------------------------------------------------------


@pytest.fixture
def no_job(monkeypatch):
    from psgrid.worker import env as job_vars

    for name in (*job_vars.NAMES, "PSGRID_ALONE", job_vars.PARENT):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("data_plane", ["shm"])
def test_a_push_refused_after_its_buffer_was_taken_leaves_the_push_in_flight_alone(cluster, data_plane, no_job):
    # async overlaps a push with the next step, its gradient in the other of two buffers: a push that fails before
    # it is sent (here the exchange refuses it) must not make the retry write the buffer the push in flight reads.
    from psgrid.worker.api import init

    c = cluster(1, mode="async", lr=1.0)
    w = np.zeros(4, np.float32)
    ps = init({"w": w}, addresses=c.addresses, world=1)
    assert ps._overlap
    ps.pull()
    ps.push({"w": np.ones(4, np.float32)})
    in_flight = ps.bufs.current
    real_push, calls = ps.client.push, []

    def refuse_once(*args, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("refused")
        return real_push(*args, **kw)

    ps.client.push = refuse_once
    with pytest.raises(RuntimeError, match="refused"):
        ps.push({"w": np.full(4, 5, np.float32)})
    ps.push({"w": np.full(4, 2, np.float32)})
    assert ps.bufs.current != in_flight  # the retry wrote the buffer the refused push had taken
    ps.close()
    np.testing.assert_array_equal(c.weights(), -3.0)  # the first push and the retry, nothing of the refused
    assert ps.steps == 2


@pytest.mark.timeout(60)
@pytest.mark.parametrize("data_plane", ["shm"])
def test_a_background_push_refused_is_named_at_the_next_push_which_may_be_made_again(cluster, data_plane, no_job):
    # async: step 0's NaN is refused while step 1 computes, and its error comes at step 1's push, which
    # therefore is not sent. It said the shard's words alone, as if step 1's gradient were the bad one.
    from psgrid.psserver.exceptions import InvalidArgument
    from psgrid.worker.api import init

    c = cluster(1, mode="async", lr=1.0)
    ps = init({"w": np.zeros(4, np.float32)}, addresses=c.addresses, world=1)
    ps.pull()
    ps.push({"w": np.full(4, np.nan, np.float32)})
    ps.pull()
    with pytest.raises(InvalidArgument) as refused:
        ps.push({"w": np.ones(4, np.float32)})
    said = str(refused.value)
    assert said.startswith("step 0's push, made in the background, failed: ") and "NaN or infinity" in said, said
    assert said.endswith("; step 1's gradient was not sent: push it again"), said
    ps.push({"w": np.ones(4, np.float32)})  # step 1 again
    ps.pull()
    ps.push({"w": np.ones(4, np.float32)})
    ps.close()
    np.testing.assert_array_equal(c.weights(), -2.0)  # steps 1 and 2, nothing of the NaN
    assert ps.steps == 3


@pytest.mark.timeout(60)
@pytest.mark.parametrize("data_plane", ["shm"])
def test_a_script_that_pulls_ahead_may_push_before_its_first_pull(cluster, data_plane, no_job):
    from psgrid.worker.api import init

    c = cluster(1, mode="async", lr=1.0)
    ps = init({"w": np.zeros(4, np.float32)}, addresses=c.addresses, world=1, pull_ahead=True)
    assert ps.core.ahead is not None
    ps.push({"w": np.ones(4, np.float32)})  # nothing pulled yet: the client's own versions
    for _ in range(3):
        ps.pull()
        ps.push({"w": np.ones(4, np.float32)})
    ps.close()
    np.testing.assert_array_equal(c.weights(), -4.0)


def test_a_worker_setting_given_to_init_reaches_the_core_and_a_bad_one_is_one_line(no_job):
    from psgrid.worker.api import init

    with pytest.raises(RuntimeError, match=r"the job's \[train\] table: stragglers: 'x' is not a straggler"):
        init({"w": np.zeros(2, np.float32)}, addresses=["127.0.0.1:1"], world=1, stragglers=["x"])


def test_a_script_alone_updates_as_torch_optim_sgd_and_writes_the_step_records(tmp_path, monkeypatch, no_job):
    import psgrid

    job = tmp_path / "job.toml"
    job.write_text('[server]\noptimizer = "sgd"\nlr = 0.1\nmomentum = 0.9\nweight_decay = 0.01\n')
    metrics = tmp_path / "worker-0.jsonl"
    monkeypatch.setenv("PSGRID_ALONE", "1")
    w = np.ones(3, np.float32)
    ps = psgrid.init({"w": w}, job_file=str(job), metrics=str(metrics))
    g = np.array([1.0, 2.0, 3.0], np.float32)
    expected, velocity = w.copy(), None
    for step in range(3):
        ps.pull()
        ps.push({"w": g}, loss=1.0 / (step + 1), samples=8)
        d = g + 0.01 * expected  # torch.optim.SGD: decay, then the momentum buffer
        velocity = d.copy() if velocity is None else 0.9 * velocity + d
        expected = expected - 0.1 * velocity
    np.testing.assert_allclose(w, expected, rtol=1e-6)
    ps.close()
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["event"] for r in records] == ["start", "step", "step", "step", "done"]
    assert records[0]["mode"] == "alone" and records[-1]["samples"] == 24
    job.write_text('[server]\noptimizer = "adam"\nlr = 0.1\n')
    with pytest.raises(RuntimeError, match="trains alone with SGD"):
        psgrid.init({"w": w}, job_file=str(job))
