"""``srun`` on a real Slurm: the one-node cluster of the ``slurm`` fixture (tests/slurm.py), started once per session."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import wait_for

RAISE_ON_RANK = Path(__file__).resolve().parent / "mpi_raise_on_rank.py"
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
PSCTL = [sys.executable, "-m", "psgrid.cluster.cli"]

pytestmark = [pytest.mark.mpi, pytest.mark.slow]


def assert_nothing_left(slurm) -> None:
    """No job step or task of the cluster still runs, and no MPICH file of its jobs is in /dev/shm."""
    wait_for(lambda: not slurm.strays(), 15, "the job's processes to end")
    assert slurm.shm_leftovers() == []


def test_without_slurm_a_users_machine_skips_the_srun_tests_and_ci_fails_them(tmp_path, monkeypatch):
    from tests.slurm import PACKAGES, REQUIRE_SLURM, find_programs

    monkeypatch.delenv(REQUIRE_SLURM, raising=False)
    with pytest.raises(pytest.skip.Exception) as skipped:  # a folder holding no Slurm program
        find_programs(str(tmp_path))
    assert f"apt-get install --no-install-recommends {PACKAGES}" in str(skipped.value)
    assert "\n" not in str(skipped.value) and "srun" in str(skipped.value)
    monkeypatch.setenv(REQUIRE_SLURM, "1")  # what .ci/run exports
    with pytest.raises(pytest.fail.Exception) as failed:
        find_programs(str(tmp_path))
    assert PACKAGES in str(failed.value) and REQUIRE_SLURM in str(failed.value)
    ci = (Path(__file__).resolve().parent.parent / ".ci" / "run").read_text()
    assert f"export {REQUIRE_SLURM}=1" in ci


def test_srun_runs_the_default_job_to_its_accuracy(slurm, tmp_path):
    out = tmp_path / "run"
    result = slurm.srun(5, [*PSCTL, "mpi", "--config", "mnist", "--out", str(out)], timeout=180)
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    # one job of 5 ranks (srun --mpi=pmi2 wired MPI): 1 coordinator, the job file's 2 shards, 2 workers
    assert (summary["status"], summary["launcher"], summary["ranks"]) == ("ok", "mpi", 5)
    assert (summary["shards"], summary["workers"], summary["steps"]) == (2, 2, 800)
    assert summary["test_accuracy"] >= 0.9, summary["test_accuracy"]
    assert "mnist (sync, 2 shards, 2 workers): 800 steps in " in result.stdout
    assert_nothing_left(slurm)


def test_srun_runs_a_users_script_on_each_worker_rank(slurm, tmp_path):
    out = tmp_path / "run"
    result = slurm.srun(
        5,
        [
            *PSCTL,
            "mpi",
            "--shards",
            "1",
            "--no-progress",
            "--out",
            str(out),
            "--",
            "python",
            str(EXAMPLES / "train_cupy.py"),
        ],
        timeout=180,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    # 1 coordinator, 1 shard and 3 worker ranks, each running the script with the job in its environment
    assert (summary["status"], summary["launcher"], summary["ranks"]) == ("ok", "mpi", 5)
    assert (summary["shards"], summary["workers"], summary["workers_completed"]) == (1, 3, 3)
    assert summary["test_accuracy"] >= 0.88, summary["test_accuracy"]
    assert all(f"[rank {r}] worker {r} of 3" in result.stdout for r in range(3)), result.stdout[-2000:]
    assert_nothing_left(slurm)


def test_a_rank_that_raises_ends_the_step_within_seconds(slurm, tmp_path):
    out = tmp_path / "run"
    busy = out / "metrics" / "worker-0.jsonl"  # rank 4 (worker 1) raises once worker 0 (rank 3) trains
    result = slurm.srun(
        5,
        [
            sys.executable,
            str(RAISE_ON_RANK),
            "4",
            str(busy),
            "--",
            "mpi",
            "--config",
            "mnist",
            "--steps",
            "100000",
            "--out",
            str(out),
        ],
        timeout=120,
    )
    ended = time.time()
    assert result.returncode != 0
    assert "psctl mpi: rank 4 on " in result.stderr and "failed; aborting the job" in result.stderr, result.stderr
    raised = float(re.search(r"raising on purpose at t=([0-9.]+)", result.stderr).group(1))
    assert ended - raised < 10, f"the step took {ended - raised:.1f} s to end after rank 4 raised"
    print(f"srun: the step ended {ended - raised:.2f} s after rank 4 raised")
    assert '"event": "start"' in busy.read_text()
    assert_nothing_left(slurm)


# Each rank dies of SIGKILL once MPI is up: nothing of MPICH's runs after it. (With MPI_Abort the file was
# left in most runs but not all: the aborting rank's own clean-up could unlink it before srun killed it.)
ABORT_SCRIPT = (
    "import os, signal; from mpi4py import MPI; MPI.COMM_WORLD.Barrier(); "
    "print('initialized', flush=True); os.kill(os.getpid(), signal.SIGKILL)"
)


def test_the_cluster_finds_and_removes_what_a_plain_mpi_job_leaves_in_dev_shm(slurm):
    # A program that does not unlink MPICH's start-up file, as psctl does, leaves it when it is killed;
    # the fixture knows it by the job's id and removes it on stop.
    # The node may still be ending the step before (its ranks were killed): a launch that never reached
    # MPI_Init leaves nothing to find, so try again until MPI has started (and the job aborted).
    for _ in range(3):
        result = slurm.srun(2, [sys.executable, "-c", ABORT_SCRIPT], timeout=60)
        if "initialized" in result.stdout:
            break
        time.sleep(2)
    assert "initialized" in result.stdout and result.returncode != 0, result.stdout + result.stderr
    left = slurm.shm_leftovers()
    assert len(left) == 1 and left[0].stat().st_size > 0, left
    for path in left:  # this test's own leftover, so later tests see a clean /dev/shm
        path.unlink()
    assert_nothing_left(slurm)


@pytest.mark.parametrize(
    "script, options",
    [
        ("one-node.sbatch", ()),
        ("multi-node.sbatch", ("--nodes=1", "--ntasks-per-node=7")),  # the test's cluster has one node
    ],
)
def test_the_example_sbatch_scripts_give_each_gpu_a_worker(slurm, tmp_path, script, options):
    # The node's 4 GPUs are made up, so the job trains on the CPU; the scripts' arithmetic is real:
    # 7 tasks and 4 GPUs make 1 coordinator, 2 shards and 4 workers.
    out = tmp_path / "run"
    result = slurm.sbatch(
        EXAMPLES / "slurm" / script,
        "--device",
        "cpu",
        "--steps",
        "20",
        "--eval-every",
        "0",
        "--out",
        str(out),
        options=options,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["ranks"], summary["shards"], summary["workers"]) == ("ok", 7, 2, 4)
    assert_nothing_left(slurm)


def test_srun_without_the_pmi2_plugin_says_to_add_it(slurm, tmp_path):
    # A site whose MpiDefault is none (as this cluster's) starts N unwired tasks from a plain srun:
    # each sees an MPI world of one. One line names the srun flag, on rank 0 only.
    result = slurm.srun(
        4, [*PSCTL, "mpi", "--config", "mnist", "--out", str(tmp_path / "run")], options=("--mpi=none",), timeout=60
    )
    assert result.returncode != 0, result.stdout + result.stderr
    # srun's and slurmstepd's own lines aside (KillOnBadExit ends the other tasks)
    lines = [line for line in result.stderr.splitlines() if line.startswith("psctl")]
    assert len(lines) == 1, result.stderr
    assert "srun started 4 tasks but MPI sees each alone" in lines[0], lines[0]
    assert "srun --mpi=pmi2" in lines[0] and "srun --mpi=list" in lines[0], lines[0]
    assert not (tmp_path / "run").exists()
    assert_nothing_left(slurm)


# The sites' ways of saying how many GPUs a node has, each alone: --gpus-per-node (with or without a
# type), --gres=gpu:4 (SLURM_GPUS_ON_NODE, SLURM_JOB_GPUS, CUDA_VISIBLE_DEVICES, SLURM_GRES).
GPU_VARIABLES = [
    {"SLURM_GPUS_ON_NODE": "4"},
    {"SLURM_GPUS_PER_NODE": "4"},
    {"SLURM_GPUS_PER_NODE": "a100:4"},
    {"SLURM_JOB_GPUS": "0,1,2,3"},
    {"CUDA_VISIBLE_DEVICES": "4,5,6,7"},
    {"SLURM_GRES": "gpu:4"},
    {"SLURM_GRES": "gpu:a100:4"},
]


@pytest.mark.parametrize("script, nodes, tasks", [("one-node.sbatch", 1, 7), ("multi-node.sbatch", 2, 10)])
@pytest.mark.parametrize("gpu_env", GPU_VARIABLES, ids=lambda env: "-".join(f"{k}={v}" for k, v in env.items()))
def test_the_sbatch_scripts_count_gpus_from_whichever_variable_the_site_sets(tmp_path, script, nodes, tasks, gpu_env):
    # The script itself under bash (set -euo pipefail), with a stand-in srun that prints its arguments.
    # No Slurm needed: this runs on any machine with bash.
    fake = tmp_path / "srun"
    fake.write_text('#!/bin/sh\necho "srun $*"\n')
    fake.chmod(0o755)
    env = {
        "PATH": f"{tmp_path}:/usr/bin:/bin",
        "SLURM_NTASKS": str(tasks),
        "SLURM_NNODES": str(nodes),
        "SLURM_JOB_NAME": "psgrid",
        "SLURM_JOB_ID": "12",
        **gpu_env,
    }
    result = subprocess.run(
        ["bash", str(EXAMPLES / "slurm" / script), "--steps", "5"], env=env, capture_output=True, text=True, timeout=10
    )
    assert result.returncode == 0, result.stderr
    # 4 GPUs a node: one-node 7 tasks = 1 + 2 shards + 4 workers; two nodes of 5 = 1 + 1 shard + 8 workers
    shards = tasks - 1 - 4 * nodes
    assert f" --shards {shards} " in result.stdout and result.stdout.rstrip().endswith("--steps 5"), result.stdout


def test_an_sbatch_script_without_any_gpu_variable_says_which_it_read(tmp_path):
    env = {
        "PATH": "/usr/bin:/bin",
        "SLURM_NTASKS": "7",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NAME": "psgrid",
        "SLURM_JOB_ID": "12",
    }
    result = subprocess.run(
        ["bash", str(EXAMPLES / "slurm" / "one-node.sbatch")], env=env, capture_output=True, text=True, timeout=10
    )
    assert result.returncode != 0
    assert (
        result.stderr.count("\n") == 1 and "SLURM_GPUS_ON_NODE" in result.stderr and "--gpus-per-node" in result.stderr
    ), result.stderr
