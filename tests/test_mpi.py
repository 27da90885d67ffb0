"""psctl mpi under the mpiexec of the MPI in the registry (the mpich wheel of the [test] extra)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest

from psgrid.cluster.mpi.job import min_ranks, too_few_ranks_message
from psgrid.cluster.mpi.mpich_shm import mapped_init_shm
from tests.gpu import cupy_or_skip
from tests.support import assert_token_kept, run_mpiexec

RAISE_ON_RANK = Path(__file__).resolve().parent / "mpi_raise_on_rank.py"
FAKE_GPUS = Path(__file__).resolve().parent / "mpi_fake_gpus.py"


def run_mpi(n: int, *args: str, timeout: float = 120, extra_env: dict | None = None):
    """``mpiexec -n N python -m cluster.cli mpi ARGS``: (exit code, stdout, stderr, seconds)."""
    return run_mpiexec(n, ["-m", "psgrid.cluster.cli", "mpi", *args], timeout, extra_env)


def test_too_few_ranks_message():
    assert min_ranks(2) == 4
    assert too_few_ranks_message(2, 3) == (
        "psctl mpi needs at least 4 ranks (1 coordinator + 2 shards + at least 1 worker); got 3"
    )
    assert too_few_ranks_message(1, 2) == (
        "psctl mpi needs at least 3 ranks (1 coordinator + 1 shard + at least 1 worker); got 2"
    )


def check_summary(out_dir: Path, shards: int, workers: int) -> dict:
    summary = json.loads((out_dir / "summary.json").read_text())
    assert (summary["status"], summary["launcher"]) == ("ok", "mpi")
    assert (summary["shards"], summary["workers"], summary["ranks"]) == (shards, workers, 1 + shards + workers)
    for key in ("mode", "steps", "wall_s", "samples_per_s", "train_accuracy", "test_accuracy"):
        assert summary[key] is not None, key
    assert summary["steps"] == 40 * workers
    assert summary["test_accuracy"] > 0.7
    assert len(summary["shard_stats"]) == shards
    assert sorted((out_dir / "addr").iterdir()) == [out_dir / "addr" / f"shard-{i}" for i in range(shards)]
    events = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    assert {e["rank"] for e in events if e["event"] == "done"} == set(range(workers))
    # rank 0 reads each worker's records twice (its file and its message): every sample counted once
    assert summary["samples"] == sum(e["samples"] for e in events if e["event"] == "step")
    # secure by default: one token for the job, sent over MPI, written only where its owner alone reads it
    assert_token_kept(out_dir)
    assert summary["config"]["server"]["token"] == summary["config"]["train"]["token"] == "<redacted>"
    assert (out_dir / "addr" / "shard-0").read_text().splitlines()[1] == f"job {summary['job_id']}"
    return summary


@pytest.mark.mpi
@pytest.mark.slow
def test_four_ranks(tmp_path):
    code, out, err, took = run_mpi(
        4, "--config", "mnist", "--shards", "1", "--steps", "40", "--out", str(tmp_path / "run")
    )
    assert code == 0, err
    summary = check_summary(tmp_path / "run", shards=1, workers=2)
    assert "mnist (sync, 1 shard, 2 workers): 80 steps in " in out and "test accuracy" in out
    # each shard rank resolved "auto" on its node (CPU workers: host shards), and the job records it
    assert summary["shard_device"] == summary["config"]["server"]["shard_device"] == "cpu"
    assert "psctl mpi: shard 0/1 on the CPU listening on " in err
    print(f"mpiexec -n 4 took {took:.1f} s")


@pytest.mark.mpi
@pytest.mark.slow
def test_six_ranks_two_shards(tmp_path):
    code, out, err, took = run_mpi(
        6,
        "--config",
        "mnist",
        "--shards",
        "2",
        "--steps",
        "40",
        "--set",
        "metrics_port=0",
        "--out",
        str(tmp_path / "run"),
    )
    assert code == 0, err
    summary = check_summary(tmp_path / "run", shards=2, workers=3)
    assert [s["end"] - s["begin"] for s in summary["shard_stats"]] == [50885, 50885]  # 101,770 parameters halved
    for i in range(2):  # where each shard served its metrics, as psctl launch writes it (psctl status reads it)
        (served,) = re.findall(rf"shard {i}/2 .* metrics on [^:]+:(\d+)\)", err)
        assert (tmp_path / "run" / "addr" / f"shard-{i}").read_text().splitlines()[2] == f"metrics {served}"
    print(f"mpiexec -n 6 took {took:.1f} s")


@pytest.mark.mpi
def test_too_few_ranks_fails_at_once(tmp_path):
    code, out, err, took = run_mpi(2, "--config", "mnist", "--shards", "1", "--out", str(tmp_path / "run"), timeout=60)
    assert code != 0
    assert "psctl mpi needs at least 3 ranks (1 coordinator + 1 shard + at least 1 worker); got 2" in err
    assert took < 30
    assert not (tmp_path / "run").exists()


@pytest.mark.mpi
def test_more_workers_than_gpus_fails_at_once_on_every_rank(tmp_path):
    # 6 ranks, 1 shard: 4 workers for the 2 GPUs every rank sees
    code, out, err, took = run_mpiexec(
        6,
        [str(FAKE_GPUS), "2", "--", "mpi", "--config", "mnist", "--shards", "1", "--out", str(tmp_path / "run")],
        timeout=60,
    )
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.startswith("psctl mpi")]
    assert lines == [
        "psctl mpi: error: 6 ranks leave 4 workers beside the coordinator and 1 shard, for 2 GPUs on "
        "1 node; run 4 ranks (-n 4), or keep 6 ranks with --shards 3 for one worker per GPU, or let "
        "workers share GPUs with --oversubscribe"
    ], err
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()
    assert took < 30


@pytest.mark.gpu
@pytest.mark.mpi
@pytest.mark.slow
def test_each_worker_trains_on_a_gpu_of_its_own(tmp_path):
    cupy = cupy_or_skip()
    total = cupy.cuda.runtime.getDeviceCount()
    gpus = min(total, 4)
    code, _, err, _ = run_mpi(
        2 + gpus,
        "--config",
        "mnist",
        "--shards",
        "1",
        "--steps",
        "40",
        "--device",
        "gpu",
        "--out",
        str(tmp_path / "run"),
    )
    assert code == 0, err
    summary = check_summary(tmp_path / "run", shards=1, workers=gpus)
    assert sorted(w["device"] for w in summary["worker_results"]) == [f"cuda:{i}" for i in range(gpus)]
    # one worker more than there are GPUs: refused on every rank before anything starts
    code, _, err, took = run_mpi(
        3 + total,
        "--config",
        "mnist",
        "--shards",
        "1",
        "--device",
        "gpu",
        "--out",
        str(tmp_path / "refused"),
        timeout=60,
    )
    assert code == 2 and f"psctl mpi: error: {3 + total} ranks leave {1 + total} workers" in err, err
    assert not (tmp_path / "refused").exists()


SHM_SCRIPT = """
import os, sys, time
from mpi4py import MPI
from psgrid.cluster.mpi.mpich_shm import mapped_init_shm, unlink_init_shm

world = MPI.COMM_WORLD
mapped = mapped_init_shm()
unlink_init_shm(world)
print(f"rank {world.rank} mapped {','.join(mapped)}", flush=True)
world.allreduce(1)                      # MPI still works on the unlinked mappings
world.Barrier()
if world.rank == 1:
    time.sleep(1.0)                     # every rank's line forwarded by mpiexec first: an abort drops what is in flight
    world.Abort(1)                      # which leaves MPICH's file behind, unless it was unlinked
time.sleep(30)
"""


@pytest.mark.mpi
def test_an_aborted_job_leaves_no_mpich_file_in_dev_shm():
    code, out, err, _ = run_mpiexec(3, ["-c", SHM_SCRIPT], timeout=60)
    assert code != 0
    # the ranks' lines may run together in mpiexec's forwarding: find the names, not the lines
    mapped = set(re.findall(r"/dev/shm/mpich_shm_[0-9a-f]+_[0-9]+", out))
    assert out.count(" mapped /dev/shm/mpich_shm_") == 3 and len(mapped) == 1, out + err  # one file per node
    assert not Path(next(iter(mapped))).exists()


ABORT_SCRIPT = """
import time
from mpi4py import MPI
from psgrid.cluster.mpi.mpich_shm import unlink_init_shm

unlink_init_shm(MPI.COMM_WORLD)         # both ranks are through MPI_Init, which read the topology;
                                        # and MPICH's start-up file in /dev/shm is not left by the abort
if MPI.COMM_WORLD.rank == 1:
    MPI.COMM_WORLD.Abort(3)
time.sleep(30)
"""


@pytest.mark.mpi
def test_an_aborted_job_leaves_no_hydra_topology_file_in_tmp():
    from glob import glob

    from psgrid.cluster.experiments.compare import LOCAL_MPI_ENV
    from psgrid.cluster.mpi.hydra_topology import ENV, LEFTOVERS

    # Another mpiexec on this machine may add its own file meanwhile: in CI nothing else runs.
    before = set(glob(LEFTOVERS))
    code, out, err, _ = run_mpiexec(2, ["-c", ABORT_SCRIPT], timeout=60)
    assert code == 3, out + err
    assert set(glob(LEFTOVERS)) - before == set()
    assert LOCAL_MPI_ENV.items() >= ENV.items()  # psctl compare's own mpiexec gets the same


def test_mapped_init_shm_reads_only_named_mpich_files(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f0000000000-7f0000400000 rw-s 00000000 00:1a 123 /dev/shm/mpich_shm_1a2b3c_0\n"
        "7f0000400000-7f0000800000 rw-s 00000000 00:1a 123 /dev/shm/mpich_shm_1a2b3c_0\n"
        "7f0000800000-7f0000900000 rw-s 00000000 00:1a 124 /dev/shm/mpich_shm_99_0 (deleted)\n"
        "7f0000900000-7f0000a00000 rw-s 00000000 00:1a 125 /dev/shm/other_file\n"
        "7f0000a00000-7f0000b00000 rw-p 00000000 00:00 0 \n"
    )
    assert mapped_init_shm(str(maps)) == ["/dev/shm/mpich_shm_1a2b3c_0"]
    assert mapped_init_shm(str(tmp_path / "absent")) == []


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 1, 3])  # the coordinator, a shard, a worker
def test_a_rank_that_raises_ends_the_job(tmp_path, rank):
    out = tmp_path / "run"
    busy = out / "metrics" / "worker-0.jsonl"  # the rank raises once worker 0 (rank 2) is training
    code, stdout, err, took = run_mpiexec(
        4,
        [
            str(RAISE_ON_RANK),
            str(rank),
            str(busy),
            "--",
            "mpi",
            "--config",
            "mnist",
            "--shards",
            "1",
            "--steps",
            "100000",
            "--out",
            str(out),
        ],
        timeout=120,
    )
    ended = time.time()
    assert code != 0
    assert f"psctl mpi: rank {rank} on " in err and "failed; aborting the job" in err, f"{code}\n{stdout}\n{err}"
    raised = float(re.search(r"raising on purpose at t=([0-9.]+)", err).group(1))
    assert ended - raised < 30, f"the job took {ended - raised:.0f} s to end after rank {rank} raised"
    assert '"event": "start"' in busy.read_text()


SUBCOMM_SCRIPT = """
import sys
from mpi4py import MPI
from psgrid.cluster.job.config import apply_overrides, load_job
from psgrid.cluster.mpi.job import run_mpi

world = MPI.COMM_WORLD
sub = world.Split(0 if world.rank < 3 else 1, world.rank)
code = 0
if world.rank < 3:  # ranks 0-2 run a job on their own communicator; rank 3 stays out of it
    job = apply_overrides(load_job("mnist"), {"shards": 1, "steps": 20, "eval_every": 0, "out": sys.argv[1]})
    code = run_mpi(job, comm=sub)
world.Barrier()
sys.exit(code)
"""


@pytest.mark.mpi
@pytest.mark.slow
def test_the_communicator_is_injectable(tmp_path):
    out = tmp_path / "run"
    code, _, err, _ = run_mpiexec(4, ["-c", SUBCOMM_SCRIPT, str(out)])
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["ranks"], summary["shards"], summary["workers"], summary["steps"]) == (3, 1, 1, 20)


def test_the_one_alone_message_names_srun_under_slurm_and_mpiexec_elsewhere():
    from psgrid.cluster.run.preflight import launcher_mismatch_message

    under_slurm = launcher_mismatch_message(4, {"SLURM_JOB_ID": "7", "SLURM_STEP_ID": "0", "SLURM_PROCID": "0"})
    assert under_slurm.startswith("srun started 4 tasks but MPI sees each alone")
    assert "srun --mpi=pmi2" in under_slurm and "srun --mpi=list" in under_slurm
    elsewhere = launcher_mismatch_message(4, {"PMI_RANK": "0", "PMI_SIZE": "4"})
    assert elsewhere.startswith("mpiexec started 4 processes") and "srun" not in elsewhere


@pytest.mark.mpi
@pytest.mark.timeout(60)
@pytest.mark.parametrize("launcher", [{}, {"PMI_RANK": "0", "PMI_SIZE": "4"}], ids=["alone", "mismatched"])
def test_a_refused_world_of_one_leaves_no_mpich_file_even_when_killed_before_it_finalizes(launcher):
    """``srun --mpi=none`` starts N singletons; once one is refused KillOnBadExit kills the others, before
    MPI_Finalize would unlink their start-up files (/dev/shm/mpich_shm_<pid in hex>_<node>)."""
    import os
    import subprocess
    import sys

    code = (
        "import os, sys\n"
        "from psgrid.cluster.errors import UsageError\n"
        "from psgrid.cluster.run.preflight import require_mpi\n"
        "try:\n"
        "    require_mpi('mpi')\n"
        "except UsageError as e:\n"
        "    print(os.getpid(), str(e).split(':')[0], flush=True)\n"
        "os._exit(0)  # as a task killed before MPI_Finalize\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "SLURM_", "PMIX_", "MPI_LOCAL"))}
    done = subprocess.run(
        [sys.executable, "-c", code], env={**env, **launcher}, capture_output=True, text=True, timeout=50
    )
    assert done.returncode == 0, done.stderr
    pid, said = done.stdout.split(maxsplit=1)
    assert said.startswith("psctl mpi runs one role" if not launcher else "mpiexec started 4 processes")
    left = list(Path("/dev/shm").glob(f"mpich_shm_{int(pid):x}_*"))
    for path in left:
        path.unlink()
    assert left == []


def test_every_srun_line_of_the_readme_and_the_help_names_its_pmi_plugin():
    # Without --mpi=pmi2 a site whose MpiDefault is none starts N one-rank jobs.
    from psgrid.cluster.commands.mpi import EXAMPLES

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    lines = [
        line.strip() for text in (EXAMPLES, readme) for line in text.splitlines() if line.strip().startswith("srun ")
    ]
    assert len(lines) >= 4
    assert all(line.startswith("srun --mpi=") for line in lines), [x for x in lines if "--mpi=" not in x]


def test_slurm_host_and_task_lists_expand_as_slurm_writes_them():
    from psgrid.cluster.mpi.plan import expand_nodelist, expand_tasks_per_node

    assert expand_nodelist("gpu[01-03,07],login") == ["gpu01", "gpu02", "gpu03", "gpu07", "login"]
    assert expand_nodelist("rack[1-2]-n[8-9]") == ["rack1-n8", "rack1-n9", "rack2-n8", "rack2-n9"]
    assert expand_nodelist("a,b") == ["a", "b"]
    assert expand_tasks_per_node("6,5") == [6, 5] and expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]


# What sbatch --nodes=2 --ntasks=11 --gres=gpu:4 sets in its batch script (no SLURM_GPUS_PER_NODE there)
FAKE_ALLOCATION = {
    "SLURM_JOB_ID": "4242",
    "SLURM_NTASKS": "11",
    "SLURM_NNODES": "2",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_TASKS_PER_NODE": "6,5",
    "SLURM_JOB_GPUS": "0,1,2,3",
    "SLURM_GRES": "gpu:4",
}


def run_plan(tmp_path: Path, *args: str, env: dict | None = None):
    import os
    import subprocess
    import sys

    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PMI_", "OMPI_", "CUDA_VISIBLE"))}
    clean.update(**(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "psgrid.cluster.cli", "mpi", "--plan", *args],
        cwd=tmp_path,
        env=clean,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_plan_prints_the_layout_of_the_slurm_allocation_without_starting_anything(tmp_path):
    result = run_plan(tmp_path, "--config", "mnist", "--shards", "2", env=FAKE_ALLOCATION)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0] == (
        "psctl mpi --plan (Slurm job 4242: 11 ranks on 2 nodes, 4 GPUs each): 1 coordinator, "
        "2 shards, 8 workers; nothing started"
    ), lines[0]
    rows = [line.split() for line in lines[2:]]
    # the first node (6 tasks): the coordinator, a shard and 4 workers; the second (5): a shard and 4 workers
    assert rows[0] == ["0", "gpu07", "coordinator", "-"]
    assert [r[1:] for r in rows if r[2] == "shard"] == [["gpu07", "shard", "0", "-"], ["gpu08", "shard", "1", "-"]]
    workers = [(r[1], r[4]) for r in rows if r[2] == "worker"]
    assert workers == [("gpu07", g) for g in "0123"] + [("gpu08", g) for g in "0123"], workers
    assert list(tmp_path.iterdir()) == [] and result.stderr == ""  # no runs/ folder, no MPI


def test_plan_of_given_numbers_names_the_fix_as_the_job_would(tmp_path):
    result = run_plan(tmp_path, "--np", "12", "--nodes", "2", "--gpus-per-node", "4", "--shards", "2")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip() == (
        "psctl mpi: error: 12 ranks leave 9 workers beside the coordinator and 2 shards, for 8 GPUs on 2 nodes; "
        "run 11 ranks (srun -N 2 -n 11 --gpus-per-node=4), or keep 12 ranks with --shards 3 for one worker per "
        "GPU, or let workers share GPUs with --oversubscribe"
    )
    cpu = run_plan(tmp_path, "--np", "4", "--shards", "1")  # no GPUs: ranks 1..S serve
    assert cpu.returncode == 0, cpu.stderr
    assert [line.split()[2] for line in cpu.stdout.splitlines()[2:]] == ["coordinator", "shard", "worker", "worker"]
    alone = run_plan(tmp_path)
    assert (
        alone.returncode == 2 and "--plan needs the number of ranks" in alone.stderr and alone.stderr.count("\n") == 1
    )
    assert list(tmp_path.iterdir()) == []


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_rank_that_cannot_complete_a_tls_handshake_says_why_in_one_line(tmp_path):
    """The shards require client certificates of their CA; the workers have the certificates but not the CA."""
    from psgrid.cluster.job.pki import make_certs

    pki = tmp_path / "pki"
    make_certs(pki, ["localhost", "127.0.0.1"])
    job = tmp_path / "tls.toml"
    job.write_text(
        f'[server]\ntls_cert = "{pki / "shard.pem"}"\ntls_key = "{pki / "shard.key"}"\ntls_ca = "{pki / "ca.pem"}"\n'
        f'[train]\ntls_cert = "{pki / "client.pem"}"\ntls_key = "{pki / "client.key"}"\n'
    )
    code, _, err, took = run_mpi(4, "--config", str(job), "--shards", "1", "--out", str(tmp_path / "run"))
    assert code != 0 and took < 60, (code, took, err)
    said = [line for line in err.splitlines() if "failed; aborting the job" in line]
    assert said and all("TLS handshake failed" in line for line in said), err
    assert "Traceback" not in err and "'NoneType' object is not subscriptable" not in err, err
