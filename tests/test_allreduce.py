"""The all-reduce baseline computes what a sync parameter-server job computes (under mpiexec)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from psgrid.worker.allreduce import AllreduceExchange
from tests.support import run_mpiexec

# Two ranks train the same job twice: once with no shards (Allreduce), once as the two workers of a
# sync job whose shards rank 0 serves in-process. Rank 0 writes both final weights.
SAME_WEIGHTS_SCRIPT = r"""
import sys
import numpy as np
from mpi4py import MPI
from psgrid.cluster.job.config import apply_overrides, load_job
from psgrid.cluster.job.rate_schedule import scheduled
from psgrid.psserver.server import serve
from psgrid.worker.allreduce import AllreduceExchange
from psgrid.worker.loop import build, make_admin, run_worker, train_loop

comm = MPI.COMM_WORLD
rank, world = comm.Get_rank(), comm.Get_size()
job = apply_overrides(load_job("mnist"), {
    "mode": "sync", "shards": 2, "workers": world, "steps": int(sys.argv[2]), "batch_size": 32,
    "eval_every": 0, "optimizer": "sgd", "momentum": 0.9, "lr": 0.05, "seed": 7, "wire_dtype": sys.argv[3],
    "lr_schedule": sys.argv[4]})
job = scheduled(job)
train = job.train
xp, device, data, model = build(train, rank, world)
init = model.spec.pack(model.init_params(train.seed, train.init_scale))
exchange = AllreduceExchange(comm, init, job.server, train.wire_dtype)
train_loop(train, exchange, rank, xp, device, data, model)

running = [serve(job.server_config(i, port=0)) for i in range(job.shards)] if rank == 0 else []
addresses = comm.bcast([f"127.0.0.1:{r.port}" for r in running], root=0)
run_worker(train, addresses, rank, world)
comm.Barrier()
if rank == 0:
    with make_admin(train, addresses) as admin:
        ps_weights = admin.pull().out
    for r in running:
        r.stop(grace=1.0)
    np.savez(sys.argv[1], allreduce=exchange.weights, sync=ps_weights, init=init)
"""


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize(
    "ranks, wire_dtype, schedule",
    [(2, "float32", "constant"), (3, "float32", "constant"), (2, "bfloat16", "constant"), (2, "float32", "cosine")],
)
def test_allreduce_and_sync_reach_the_same_weights(tmp_path, ranks, wire_dtype, schedule):
    out = tmp_path / "weights.npz"
    code, _, err, _ = run_mpiexec(ranks, ["-c", SAME_WEIGHTS_SCRIPT, str(out), "30", wire_dtype, schedule])
    assert code == 0, err
    w = np.load(out)
    moved = np.abs(w["sync"] - w["init"]).max()
    assert moved > 1e-2  # 30 steps of momentum SGD went somewhere
    # The same algorithm: only the order of float32 additions may differ (Allreduce's tree, the shard's loop).
    np.testing.assert_allclose(w["allreduce"], w["sync"], rtol=1e-4, atol=1e-6)


class FakeComm:
    """One rank: enough of a communicator for the exchange's bookkeeping."""

    def Get_size(self):
        return 4

    def Get_rank(self):
        return 2


def test_a_ring_all_reduce_moves_2_w_minus_1_over_w_of_the_gradient_each_way():
    from psgrid.psserver.config import ServerConfig

    ex = AllreduceExchange(FakeComm(), np.zeros(10, np.float32), ServerConfig(lr=0.1))
    assert (ex.worker_id, ex.world, ex.mode) == (2, 4, "allreduce")
    assert ex.bytes_per_step(1000) == 2 * 2 * 3 * 1000 * 4 // 4


@pytest.mark.mpi
@pytest.mark.slow
def test_psctl_allreduce_writes_a_summary(tmp_path):
    out = tmp_path / "ar"
    code, stdout, err, _ = run_mpiexec(
        2,
        [
            "-m",
            "psgrid.cluster.cli",
            "allreduce",
            "--config",
            "mnist",
            "--steps",
            "40",
            "--eval-every",
            "20",
            "--out",
            str(out),
        ],
    )
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["mode"], summary["shards"], summary["workers"], summary["steps"]) == ("allreduce", 0, 2, 80)
    assert summary["test_accuracy"] > 0.5 and len(summary["wait_s_by_worker"]) == 2
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert {e["rank"] for e in steps if e["event"] == "step"} == {0, 1}
    assert "allreduce, 0 shards, 2 workers" in stdout


@pytest.mark.mpi
def test_psctl_allreduce_refuses_a_job_of_the_wrong_size(tmp_path):
    # What an mpiexec of another MPI than mpi4py's looks like: N one-rank jobs instead of one N-rank job.
    code, _, err, _ = run_mpiexec(
        2, ["-m", "psgrid.cluster.cli", "allreduce", "--config", "mnist", "--ranks", "3", "--out", str(tmp_path / "ar")]
    )
    assert code != 0 and "expected 3 ranks, this job has 2" in err
    assert not (tmp_path / "ar" / "summary.json").exists()


def test_ranks_sharing_a_gpu_are_named_and_gpus_of_their_own_are_not():
    from psgrid.worker.reduction import sharing

    assert sharing([("a", "0000:01:00.0"), ("a", "0000:02:00.0"), ("b", "0000:01:00.0")]) is None
    line = sharing([("a", "0000:01:00.0"), ("b", "0000:01:00.0"), ("a", "0000:01:00.0")])
    assert line == "ranks [0, 2] share GPU 0000:01:00.0 on a"


class OneRank:
    def Get_size(self):
        return 1

    def Get_rank(self):
        return 0


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("hparams", [dict(optimizer="sgd", lr=0.05, momentum=0.9), dict(optimizer="adam", lr=0.01)])
def test_one_rank_on_a_gpu_keeps_and_updates_the_weights_there_as_the_host_does(hparams):
    from psgrid.psserver.config import ServerConfig
    from psgrid.psserver.kernels.optim import make_optimizer
    from psgrid.psserver.spec import ModelSpec
    from psgrid.worker.flat import FlatBuffers
    from tests.gpu import cupy_or_skip

    cupy = cupy_or_skip()
    spec = ModelSpec([("w", (300, 200)), ("b", (200,))])
    rng = np.random.default_rng(3)
    init = rng.standard_normal(spec.size).astype(np.float32)
    server = ServerConfig(**hparams)
    host, weights = make_optimizer(server.optimizer, spec.size, **server.optimizer_hparams()), init.copy()
    device = AllreduceExchange(OneRank(), init, server, xp=cupy)
    assert (device.on_device, device.reduction) == (True, "none")
    bufs = FlatBuffers(spec, cupy, device)
    assert bufs.params is device.weights and bufs.pushed is bufs.grad  # nothing crosses to the host
    for _ in range(5):
        bufs.pull()
        g = rng.standard_normal(spec.size).astype(np.float32)
        bufs.grad[...] = cupy.asarray(g)
        bufs.download_grad()
        device.push(bufs.pushed).wait()
        host.step(weights, g)
    assert device.clock == host.steps == 5
    got = device.host_weights()
    assert isinstance(got, np.ndarray)
    assert np.linalg.norm(got - weights) / np.linalg.norm(weights) < 1e-5


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.slow
def test_two_ranks_on_gpus_train_and_say_how_they_sum(tmp_path):
    from tests.gpu import cupy_or_skip

    gpus = cupy_or_skip().cuda.runtime.getDeviceCount()
    out = tmp_path / "ar"
    code, _, err, _ = run_mpiexec(
        2,
        [
            "-m",
            "psgrid.cluster.cli",
            "allreduce",
            "--config",
            "mnist",
            "--device",
            "gpu",
            "--steps",
            "60",
            "--eval-every",
            "0",
            "--out",
            str(out),
        ],
        timeout=300,
    )
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    if gpus == 1:  # NCCL refuses two ranks on one device: the host's MPI sums, said in one line
        assert err.count("NCCL needs a GPU per rank") == 1, err
    else:
        assert "NCCL needs" not in err
    assert summary["steps"] == 120 and summary["test_accuracy"] > 0.5


def test_the_baselines_rate_schedule_runs_over_the_jobs_steps_whatever_mode_the_file_names():
    from psgrid.cluster.job.config import apply_overrides, load_job
    from psgrid.cluster.mpi.allreduce import allreduce_server

    job = apply_overrides(load_job("mnist"), {"mode": "async", "workers": 4, "steps": 50, "lr_schedule": "cosine"})
    server = allreduce_server(job)
    # one Allreduce a step: 50 updates, not the 4 x 50 pushes the file's async would make
    assert (server.lr_updates, server.mode) == (50, "sync")
    assert server.schedule().factor(49) > 0 and server.schedule().factor(50) == 0
    # a length the job sets is kept
    fixed = apply_overrides(job, {"lr_updates": 80})
    assert allreduce_server(fixed).lr_updates == 80
