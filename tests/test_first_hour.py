"""The first hour of a new user: each mistake is one line naming the fix, a non-zero exit, nothing left running.

Every command runs as ``psctl`` would, in a session of its own; afterwards no process of that session may
be alive (a shard or worker it started, an MPI rank), and nothing may have been started at all where the
check belongs before any process starts (no ``runs/`` folder appears in the command's folder).
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.support import MPI_ENV, ROOT, mpiexec, steps_seen

pytestmark = pytest.mark.timeout(120)

CHOOSE_DATASET = "no such dataset; choose mnist5k, digits or synthetic"
NO_CUPY = "--device gpu, but CuPy does not import here"


def session_pids(sid: int) -> list[int]:
    """Live processes of session ``sid`` (zombies excluded)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[3]) == sid:
            found.append(int(entry.name))
    return found


def run(argv: list[str], cwd: Path, env: dict | None = None, timeout: float = 60):
    """Run ``argv`` in a new session: (exit code, stderr, seconds); fails if any process of the session is left,
    or (under mpiexec) a file of hydra's in /tmp or MPICH's in /dev/shm (psgrid's own shared memory is memfd)."""
    since = time.time() - 1
    started = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
    took = time.monotonic() - started
    deadline = time.monotonic() + 5
    while (left := session_pids(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{argv} left processes {left} running"
    if Path(argv[0]).name.startswith("mpiexec"):
        assert not left_behind(since), f"{argv} left files behind"
    return proc.returncode, err, took


def env_with(*paths: Path, **extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "PSGRID_TOKEN")}
    env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in paths), *filter(None, [env.get("PYTHONPATH")])])
    return {**env, **extra}


def psctl(*args: str) -> list[str]:
    return [sys.executable, "-m", "psgrid.cluster.cli", *args]


def one_line(code: int, err: str, fragment: str, expected_code: int = 2) -> str:
    assert code == expected_code, f"exit code {code}, expected {expected_code}:\n{err}"
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line, got:\n{err}"
    assert fragment in lines[0], f"{fragment!r} not in {lines[0]!r}"
    return lines[0]


@pytest.fixture
def no_cupy(tmp_path) -> Path:
    """A folder to put first on PYTHONPATH in which ``import cupy`` fails, as on a machine without CuPy."""
    folder = tmp_path / "no-cupy"
    (folder / "cupy").mkdir(parents=True)
    (folder / "cupy" / "__init__.py").write_text("raise ImportError(\"No module named 'cupy' (test)\")\n")
    return folder


@pytest.fixture
def no_mpi4py(tmp_path) -> Path:
    folder = tmp_path / "no-mpi4py"
    (folder / "mpi4py").mkdir(parents=True)
    (folder / "mpi4py" / "__init__.py").write_text("raise ImportError(\"No module named 'mpi4py' (test)\")\n")
    return folder


# ---- the job: checked before any process starts ------------------------------------------------------


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["launch", "--dataset", "mnist"], f"psctl launch: error: --dataset mnist: {CHOOSE_DATASET}"),
        (["launch", "--model", "resnet"], "--model resnet: no such model; choose softmax, mlp or cnn"),
        (["launch", "--steps", "0"], "--steps 0 trains nothing: give --steps 1 or more"),
        (["launch", "--set", "steps=0"], "--set steps=0 trains nothing"),
        (["launch", "--model", "cnn", "--dataset", "synthetic"], "--model cnn needs images"),
        (["compare", "--out", "cmp", "--dataset", "mnist"], f"psctl compare: error: --dataset mnist: {CHOOSE_DATASET}"),
        (["worker", "--addresses", "127.0.0.1:9", "--dataset", "mnist"], f"--dataset mnist: {CHOOSE_DATASET}"),
        (["server", "--set", "mode=bsp"], "psctl server: error: --set mode=bsp: mode must be one of"),
        # an error about a flag names the flag, not the job-file key
        (["launch", "--staleness", "-1"], "psctl launch: error: --staleness must be >= 0, got -1"),
        (["launch", "--batch-size", "-1"], "psctl launch: error: --batch-size must be >= 0, got -1"),
        (
            ["server", "--shard", "2", "--num-shards", "2"],
            "psctl server: error: --shard 2: shard index 2 is outside 0..1",
        ),
    ],
)
def test_a_job_that_cannot_train_is_refused_before_anything_starts(tmp_path, args, fragment):
    code, err, _ = run(psctl(*args), tmp_path, env_with())
    one_line(code, err, fragment)
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cmp").exists()


def test_a_job_file_key_is_named_with_its_file(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('dataset = "mnist"\n')
    code, err, _ = run(psctl("launch", "--config", str(job)), tmp_path, env_with())
    one_line(code, err, f'dataset = "mnist" ({job}): {CHOOSE_DATASET}')


def test_the_activations_a_job_may_name_are_the_models_own(monkeypatch):
    # One list: an activation the MLP gains is accepted before the job starts, without a second edit.
    from psgrid.cluster.errors import ConfigError
    from psgrid.cluster.job.config import JobConfig, apply_overrides
    from psgrid.cluster.run.preflight import check_job
    from psgrid.worker.models import mlp

    job = apply_overrides(JobConfig(name="x"), {"activation": "tanh"})
    with pytest.raises(ConfigError, match="no such activation; choose relu or sigmoid"):
        check_job(job)
    monkeypatch.setitem(mlp.ACTIVATIONS, "tanh", mlp.ACTIVATIONS["sigmoid"])
    check_job(job)


@pytest.mark.parametrize("command", [["launch"], ["compare", "--out", "cmp"], ["worker", "--addresses", "127.0.0.1:9"]])
def test_a_gpu_asked_for_without_cupy(tmp_path, no_cupy, command):
    code, err, _ = run(psctl(*command, "--device", "gpu"), tmp_path, env_with(no_cupy))
    line = one_line(code, err, NO_CUPY)
    assert "install psgrid[cuda12] or psgrid[cuda13]" in line and "or use --device cpu" in line
    assert not (tmp_path / "runs").exists()


# ---- MPI: the wrong launcher, no mpi4py, one rank ----------------------------------------------------


@pytest.mark.mpi
def test_launch_under_mpiexec_suggests_psctl_mpi(tmp_path):
    code, err, took = run([mpiexec(), "-n", "3", *psctl("launch", "--steps", "5")], tmp_path, env_with(**MPI_ENV))
    one_line(
        code,
        err,
        "psctl launch: error: psctl launch starts a whole job by itself and is running as rank 0 "
        "of 3 under mpiexec or srun: use 'mpiexec -n 3 psctl mpi ...' (same options) instead",
    )
    assert not (tmp_path / "runs").exists()


@pytest.mark.mpi
def test_mpi_job_checks_are_said_once_before_any_shard_starts(tmp_path, no_cupy):
    code, err, _ = run([mpiexec(), "-n", "3", *psctl("mpi", "--dataset", "mnist")], tmp_path, env_with(**MPI_ENV))
    one_line(code, err, f"psctl mpi: error: --dataset mnist: {CHOOSE_DATASET}")
    code, err, _ = run([mpiexec(), "-n", "3", *psctl("mpi", "--shards", "2")], tmp_path, env_with(**MPI_ENV))
    one_line(code, err, "psctl mpi needs at least 4 ranks (1 coordinator + 2 shards + at least 1 worker); got 3")
    code, err, _ = run(
        [mpiexec(), "-n", "3", *psctl("mpi", "--device", "gpu", "--shards", "1")],
        tmp_path,
        env_with(no_cupy, **MPI_ENV),
    )
    # Placement asks every rank which GPUs it sees, before anything starts: none here.
    line = one_line(code, err, "psctl mpi: error: device = gpu, but no rank sees a CUDA GPU")
    assert "install psgrid[gpu] (CuPy) where the workers run, or use --device cpu" in line
    assert not (tmp_path / "runs").exists()


def test_mpi_without_mpi4py_names_the_extra(tmp_path, no_mpi4py):
    code, err, _ = run(psctl("mpi"), tmp_path, env_with(no_mpi4py))
    one_line(code, err, "psctl mpi: error: psctl mpi needs mpi4py: pip install 'psgrid[mpi]'")


@pytest.mark.mpi
def test_mpi_outside_mpiexec_says_how_to_run_it(tmp_path):
    code, err, _ = run(psctl("mpi", "--steps", "5"), tmp_path, env_with())
    one_line(
        code,
        err,
        "psctl mpi: error: psctl mpi runs one role per MPI rank and was started as a single "
        "process: run it under a launcher ('mpiexec -n 4 psctl mpi ...' or srun)",
    )
    assert not (tmp_path / "runs").exists()


def test_mpi_plan_checks_a_layout_before_the_queue_without_mpi4py_or_anything_started(tmp_path, no_mpi4py):
    # On a login node, without mpi4py even: the numbers one will ask Slurm for, a layout that cannot run
    # refused with the job's own line, one that can printed; nothing written, nothing left running.
    plan = ["mpi", "--plan", "--np", "11", "--nodes", "2", "--gpus-per-node", "4", "--shards", "2"]
    code, err, took = run(psctl(*plan), tmp_path, env_with(no_mpi4py))
    assert code == 0 and err == "" and took < 30, err
    code, err, took = run(psctl(*plan[:2], "--np", "12", *plan[4:]), tmp_path, env_with(no_mpi4py))
    one_line(
        code,
        err,
        "psctl mpi: error: 12 ranks leave 9 workers beside the coordinator and 2 shards, for 8 GPUs "
        "on 2 nodes; run 11 ranks (srun -N 2 -n 11 --gpus-per-node=4)",
    )
    code, err, _ = run(psctl("mpi", "--np", "11"), tmp_path, env_with(no_mpi4py))
    one_line(code, err, "psctl mpi: error: --np only describes a job for --plan")
    assert list(tmp_path.iterdir()) == [tmp_path / "no-mpi4py"]


def test_an_sbatch_script_under_gres_counts_its_gpus(tmp_path):
    # --gres=gpu:4 sets no SLURM_GPUS_PER_NODE: the example scripts stopped with 'unbound variable'.
    fake = tmp_path / "srun"
    fake.write_text('#!/bin/sh\necho "srun $*"\n')
    fake.chmod(0o755)
    env = {
        "PATH": f"{tmp_path}:/usr/bin:/bin",
        "SLURM_NTASKS": "7",
        "SLURM_NNODES": "1",
        "SLURM_JOB_NAME": "p",
        "SLURM_JOB_ID": "3",
        "SLURM_JOB_GPUS": "0,1,2,3",
        "SLURM_GRES": "gpu:4",
    }
    result = subprocess.run(
        ["bash", str(ROOT / "examples" / "slurm" / "one-node.sbatch")],
        env=env,
        capture_output=True,
        text=True,
        timeout=10,
    )
    assert result.returncode == 0 and result.stderr == "", result.stderr
    assert result.stdout.startswith("srun --mpi=pmi2 psctl mpi --shards 2 --device gpu "), result.stdout


# ---- ports, unreachable shards, TLS ------------------------------------------------------------------


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_a_port_already_in_use(tmp_path, busy_port, flag):
    code, err, _ = run(psctl("server", flag, str(busy_port)), tmp_path, env_with())
    one_line(code, err, f"psctl server: error: {flag} {busy_port}: 127.0.0.1:{busy_port} is already in use")


def test_a_metrics_port_in_use_stops_launch_before_it_starts(tmp_path, busy_port):
    code, err, _ = run(psctl("launch", "--set", f"metrics_port={busy_port}"), tmp_path, env_with())
    one_line(code, err, f"metrics_port {busy_port}: 127.0.0.1:{busy_port} is already in use")
    assert not (tmp_path / "runs").exists()
    # shard 1's port is metrics_port + 1: the fix names the key to set, not the sum
    code, err, _ = run(psctl("launch", "--set", f"metrics_port={busy_port - 1}"), tmp_path, env_with())
    one_line(code, err, f"metrics_port + 1 {busy_port}: 127.0.0.1:{busy_port} is already in use")
    assert "choose another metrics_port, or metrics_port 0 for any free port" in err, err


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_unreachable_shards_are_said_within_seconds(tmp_path):
    port = closed_port()
    code, err, took = run(psctl("worker", "--addresses", f"127.0.0.1:{port}", "--steps", "1"), tmp_path, env_with())
    said = (
        f"psctl worker: error: shard 0 at 127.0.0.1:{port}: cannot connect for 5 s (Connection refused): is the "
        "shard running, at that address? (psctl server prints its address; psctl launch starts shards and workers "
        "together)"
    )
    assert one_line(code, err, said) == said
    assert took < 15, f"took {took:.0f} s"  # the probe's 5 s, not the client's retry_s of 30


@pytest.fixture(scope="module")
def tls_shard(tmp_path_factory):
    """A ``psctl server`` that requires client certificates of its CA; yields (address, pki folder).

    One for the module: the tests only knock on it with the wrong credentials, which changes nothing."""
    from psgrid.cluster.job.pki import make_certs

    tmp_path = tmp_path_factory.mktemp("tls-shard")
    pki = tmp_path / "pki"
    make_certs(pki, ["localhost", "127.0.0.1"])
    job = tmp_path / "shard.toml"
    job.write_text(
        f'[server]\ntls_cert = "{pki / "shard.pem"}"\ntls_key = "{pki / "shard.key"}"\ntls_ca = "{pki / "ca.pem"}"\n'
    )
    addr = tmp_path / "addr"
    log = open(tmp_path / "shard.log", "wb")
    proc = subprocess.Popen(
        psctl("server", "--config", str(job), "--address-file", str(addr)),
        cwd=tmp_path,
        env=env_with(),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not addr.exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "shard.log").read_text()
            time.sleep(0.05)
        yield addr.read_text().splitlines()[0], pki
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        log.close()


def worker_job(tmp_path: Path, name: str, **tls: Path) -> Path:
    job = tmp_path / f"{name}.toml"
    job.write_text("[train]\n" + "".join(f'{k} = "{v}"\n' for k, v in tls.items()))
    return job


def test_tls_handshake_failures_say_why(tmp_path, tls_shard):
    from psgrid.cluster.job.pki import make_certs

    address, pki = tls_shard
    other = tmp_path / "other-pki"
    make_certs(other, ["localhost", "127.0.0.1"])
    cases = [
        (
            worker_job(tmp_path, "no-cert", tls_ca=pki / "ca.pem"),
            "TLS handshake failed: the shard requires a client certificate: set [train] tls_cert and tls_key",
        ),
        (
            worker_job(
                tmp_path,
                "other-ca",
                tls_ca=other / "ca.pem",
                tls_cert=other / "client.pem",
                tls_key=other / "client.key",
            ),
            f"TLS handshake failed: its certificate is not signed by [train] tls_ca ({other / 'ca.pem'}): unknown CA",
        ),
        (
            worker_job(tmp_path, "plain"),
            "the shard speaks TLS and the job has no TLS settings for its workers: set [train] tls_ca",
        ),
    ]
    for job, fragment in cases:
        code, err, took = run(psctl("worker", "--config", str(job), "--addresses", address), tmp_path, env_with())
        one_line(code, err, f"psctl worker: error: shard 0 at {address}: {fragment}")
        assert took < 15


def test_status_names_the_tls_problem(tmp_path, tls_shard):
    address, pki = tls_shard
    job = worker_job(tmp_path, "no-cert", tls_ca=pki / "ca.pem")
    code, err, _ = run(psctl("status", "--addresses", address, "--config", str(job)), tmp_path, env_with())
    one_line(code, err, "the shard requires a client certificate", expected_code=1)


# ---- output folders, status of a finished job -------------------------------------------------------


def test_an_earlier_run_is_kept_unless_overwrite(tmp_path):
    out = tmp_path / "run"
    (out / "logs").mkdir(parents=True)
    (out / "summary.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    code, err, _ = run(psctl("launch", "--out", str(out), "--steps", "5"), tmp_path, env_with())
    one_line(code, err, f"{out} already holds a run: choose another --out, add --overwrite to replace it")
    assert (out / "summary.json").read_text() == "{}"

    from psgrid.cluster.job.config import JobConfig
    from psgrid.cluster.job.outdir import prepare, release

    prepare(JobConfig(out=str(out), overwrite=True))
    release(out)
    assert not (out / "summary.json").exists() and (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.iterdir()) == [".psgrid.lock", "addr", "logs", "metrics", "notes.txt"]


def test_an_out_that_cannot_be_a_folder_is_one_line_and_nothing_made(tmp_path):
    file = tmp_path / "a-file"
    file.write_text("mine")
    for out, fragment in [
        (file, f"--out {file} is a file, not a folder: give a folder"),
        (file / "run", f"--out {file / 'run'}: {file} is a file, not a folder"),
    ]:
        code, err, _ = run(psctl("launch", "--out", str(out), "--steps", "5"), tmp_path, env_with())
        one_line(code, err, fragment)
    assert file.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_default_output_folders_never_collide(tmp_path, monkeypatch):
    from psgrid.cluster.job.config import JobConfig
    from psgrid.cluster.job.outdir import prepare

    monkeypatch.chdir(tmp_path)
    job = JobConfig(name="same")
    monkeypatch.setattr(JobConfig, "default_out", lambda self, now=None: "runs/same-20260101-120000")
    folders = [prepare(job) for _ in range(3)]  # three launches in the same second
    assert [f.name for f in folders] == ["same-20260101-120000", "same-20260101-120000-2", "same-20260101-120000-3"]


def test_status_of_a_finished_job_reads_its_summary(tmp_path, capsys):
    from psgrid.cluster.cli import main

    shard = {
        "shard_index": 0,
        "address": "127.0.0.1:45123",
        "mode": "sync",
        "version": 400,
        "members": 2,
        "min_clock": 200,
        "max_clock": 200,
        "applied_updates": 400,
        "dropped_late": 3,
        "mean_staleness": 0.0,
        "max_staleness": 0,
    }
    (tmp_path / "addr").mkdir()
    (tmp_path / "addr" / "shard-0").write_text("127.0.0.1:45123\njob abc\n")  # nobody listens there any more
    (tmp_path / "summary.json").write_text(
        json.dumps(
            {
                "name": "mnist",
                "status": "ok",
                "steps": 400,
                "test_accuracy": 0.9,
                "out": str(tmp_path),
                "shard_stats": [shard],
            }
        )
    )
    assert main(["status", "--address-dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("mnist finished: status ok, 400 steps, test accuracy 0.9000")
    assert lines[1] == "(from its summary.json: the shards have stopped)"
    assert lines[5].split() == ["0", "127.0.0.1:45123", "400", "2", "200/200", "400", "3", "0.00/0"]
    assert max(len(line) for line in lines) <= 80


# ---- a worker started by hand limits its BLAS threads -----------------------------------------------

BLAS_PROBE = """
import json, sys
from threadpoolctl import threadpool_info
import psgrid.cluster.run.preflight as preflight
import psgrid.worker.loop as loop
preflight.probe_shards = lambda *a, **k: None
loop.run_worker = lambda *a, **k: {"blas": max([p["num_threads"] for p in threadpool_info()] or [1])}
from psgrid.cluster.cli import main
sys.exit(main(["worker", "--addresses", "127.0.0.1:9", "--world", sys.argv[1]]))
"""


def test_a_worker_started_by_hand_limits_its_blas_threads(tmp_path):
    from threadpoolctl import threadpool_info

    from psgrid.cluster.run.procs import usable_cpus

    if not threadpool_info():
        pytest.fail("numpy loaded no BLAS that threadpoolctl sees")
    for world, env in [(2, env_with()), (1, env_with(OMP_NUM_THREADS="1"))]:
        done = subprocess.run(
            [sys.executable, "-c", BLAS_PROBE, str(world)],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        blas = json.loads(done.stdout.strip().splitlines()[-1])["blas"]
        # as psctl launch gives its workers: the CPUs divided among the job's workers (or what the user set)
        assert blas == (max(1, usable_cpus() // world) if "OMP_NUM_THREADS" not in env else 1)


# ---- psctl mpi writes what the README says, and a partial summary when a rank dies --------------------


@pytest.mark.mpi
@pytest.mark.slow
def test_mpi_writes_its_job_and_logs_and_a_partial_summary_when_a_rank_raises(tmp_path):
    from tests.support import run_mpiexec

    out = tmp_path / "run"
    busy = out / "metrics" / "worker-0.jsonl"  # worker 1 (rank 3) raises once worker 0 trains
    raiser = ROOT / "tests" / "mpi_raise_on_rank.py"
    code, _, err, took = run_mpiexec(
        4,
        [
            str(raiser),
            "3",
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
    assert code != 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed" and summary["launcher"] == "mpi"
    (failure,) = summary["failures"]
    assert (failure["rank"], failure["role"], failure["index"], failure["name"]) == (3, "worker", 1, "worker 1")
    assert "RuntimeError: rank 3: raising on purpose" in failure["error"]
    assert summary["message"].startswith("rank 3 (worker 1 on ")
    assert summary["ranks"] == 4 and took < 60
    # the job as it ran, and one log per rank, as psctl launch writes them
    assert "[train]" in (out / "job.toml").read_text() and '"<redacted>"' in (out / "job.toml").read_text()
    logs = {p.name: p.read_text() for p in (out / "logs").iterdir()}
    assert set(logs) == {"coordinator.log", "server-0.log", "worker-0.log", "worker-1.log"}
    assert "raising on purpose" in logs["worker-1.log"] and "listening on" in logs["server-0.log"]
    assert "job failed" in logs["coordinator.log"]


# ---- a folder in use is never taken ------------------------------------------------------------------


def test_a_live_output_folder_is_never_taken(tmp_path):
    out = tmp_path / "run"
    env = env_with()
    first = subprocess.Popen(
        psctl("launch", "--out", str(out), "--dataset", "synthetic", "--steps", "100000"),
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (out / "addr" / "shard-0").exists():  # the lock is taken before any shard starts
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read()
            time.sleep(0.05)
        for extra in (["--overwrite"], [], ["--resume", str(out)]):
            args = ["--out", str(out), "--steps", "5", *extra] if extra[:1] != ["--resume"] else extra
            code, err, took = run(psctl("launch", *args), tmp_path, env)
            line = one_line(code, err, f"{out} is in use by a running job (pid {first.pid}: ")
            assert "psgrid.cluster.cli launch --out" in line and "choose another --out" in line
            assert took < 30
        assert first.poll() is None, "the running job was disturbed"
        assert not (out / "summary.json").exists()
    finally:
        os.killpg(first.pid, signal.SIGINT)
        try:
            first.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(first.pid, signal.SIGKILL)
            first.communicate(timeout=10)
    assert first.returncode == 130
    # once it has ended, the folder is free again: refused only because it holds a run
    code, err, _ = run(psctl("launch", "--out", str(out), "--steps", "5"), tmp_path, env)
    one_line(code, err, f"{out} already holds a run")


# ---- Ctrl-C under mpiexec ends as under psctl launch ------------------------------------------------


def left_behind(since: float) -> list[str]:
    """MPI's files made since ``since`` that are still there 5 s on: hydra's in /tmp, MPICH's and ours in /dev/shm.

    Another test's job (the other test process's, running meanwhile) may own a new file: one a live
    process holds open or mapped is someone's still, and hydra's are left alone while another
    session's mpiexec runs; ours must not outlive the command.
    """

    def found():
        tmp = [p for p in Path("/tmp").glob("hydra_hwloc_xmlfile_*")] if not _other_mpiexec() else []
        shm = [p for p in Path("/dev/shm").iterdir()]
        fresh = [str(p) for p in tmp + shm if _made_after(p, since)]
        return [p for p in fresh if p not in _held_files()] if fresh else []

    deadline = time.monotonic() + 5
    while (left := found()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


def _held_files() -> set[str]:
    """Every file some live process holds open or has mapped."""
    held = set()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            held.update(os.readlink(fd) for fd in (entry / "fd").iterdir())
            held.update(
                line.split(None, 5)[5] for line in (entry / "maps").read_text().splitlines() if line.count(" ") >= 5
            )
        except (OSError, IndexError):
            continue
    return {h.removesuffix(" (deleted)").strip() for h in held}


def _other_mpiexec() -> bool:
    """Whether an mpiexec runs that is not this test's (the other test process's jobs: its hydra files are its)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip().startswith("mpiexec"):
                    return True
            except OSError:
                continue
    return False


def _made_after(path: Path, since: float) -> bool:
    try:
        return path.stat().st_mtime >= since
    except FileNotFoundError:
        return False


def ctrl_c_under_mpiexec(tmp_path: Path, argv: list[str], ready) -> tuple[subprocess.Popen, str]:
    """``mpiexec -n 4 ARGV``, sent SIGINT (what Ctrl-C in the terminal does) once ``ready()``; (process, stderr)."""
    proc = subprocess.Popen(
        [mpiexec(), "-n", "4", *argv],
        cwd=tmp_path,
        env=env_with(**MPI_ENV),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 90
        while not ready():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
    return proc, err


@pytest.mark.mpi
@pytest.mark.parametrize("command", ["mpi", "allreduce"])
def test_ctrl_c_under_mpiexec_stops_every_rank_in_one_line(tmp_path, command):
    out = tmp_path / "run"
    since = time.time() - 1
    argv = psctl(command, "--dataset", "synthetic", "--steps", "1000000", "--out", str(out))
    proc, err = ctrl_c_under_mpiexec(tmp_path, argv, lambda: steps_seen(out, 0) >= 20)  # every rank is busy
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    # after the job's start lines and the progress, one line says what happened
    said = [
        line
        for line in err.splitlines()
        if line.strip()
        and not line.startswith("[")
        and " listening on " not in line
        and " ranks: coordinator on " not in line
        and " worker(s), no shards; output in " not in line
    ]
    assert said == [f"psctl {command}: SIGINT: stopped every rank; partial results in {out}"], err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["message"] == "stopped by SIGINT"
    # the steps made so far are the job's record: the workers' files, merged (3 lines, or none, before)
    merged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in merged if e.get("event") == "step"]
    # (a worker may still write a step as rank 0 writes the summary: the two need not agree to the step)
    assert steps and summary["steps"] > 0, summary["steps"]
    assert not session_pids(proc.pid)
    assert not left_behind(since), "the job left files behind"


@pytest.mark.mpi
@pytest.mark.parametrize("modes", ["sync,allreduce", "allreduce,sync"])
def test_ctrl_c_under_compare_mpi_stops_every_rank_and_keeps_what_finished(tmp_path, modes):
    """It printed a traceback per rank and aborted (exit 1), with no results or report of the runs before."""
    out = tmp_path / "exp"
    since = time.time() - 1
    argv = psctl("compare", "--mpi", "--modes", modes, "--workers", "2", "--shards", "1", "--dataset", "synthetic")
    first = next(iter(modes.split(",")))
    proc, err = ctrl_c_under_mpiexec(
        tmp_path,
        [*argv, "--steps", "1000000", "--out", str(out)],
        lambda: any(steps_seen(d, 0) >= 20 for d in (out / "runs").glob(f"{first}-*")),
    )
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and "Abort(" not in err, err
    said = [line for line in err.splitlines() if "SIGINT" in line]
    assert said == [
        f"psctl compare: SIGINT: stopped every rank; the finished runs are in {out} "
        "(psctl compare ... --resume finishes the rest)"
    ], err
    (run,) = [d for d in (out / "runs").iterdir() if d.name.startswith(first)]
    assert json.loads((run / "summary.json").read_text())["status"] == "interrupted"
    assert (out / "report.md").exists()  # written for what finished (nothing, here): --resume runs the rest
    assert not session_pids(proc.pid)
    assert not left_behind(since), "the job left files behind"


# ---- mistakes that used to end as "ok" ---------------------------------------------------------------

NO_INIT = "no worker joined the job: the command exited 0 without calling psgrid.init, so nothing was trained"


def test_a_script_that_never_calls_init_is_not_ok(tmp_path):
    (tmp_path / "noinit.py").write_text('print("training, I think")\n')
    out = tmp_path / "run"
    code, err, took = run(psctl("launch", "--out", str(out), "--", "python", "noinit.py"), tmp_path, env_with())
    said = [line for line in err.splitlines() if " shard(s) at " not in line]  # the job's start line
    one_line(code, "\n".join(said), f"psctl launch: {NO_INIT}", expected_code=1)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "not_joined" and summary["message"].startswith(NO_INIT)
    assert took < 60


@pytest.mark.mpi
def test_a_script_that_never_calls_init_is_not_ok_under_mpiexec(tmp_path):
    (tmp_path / "noinit.py").write_text('print("training, I think")\n')
    out = tmp_path / "run"
    code, err, _ = run(
        [mpiexec(), "-n", "4", *psctl("mpi", "--out", str(out), "--", "python", "noinit.py")],
        tmp_path,
        env_with(**MPI_ENV),
    )
    said = [line for line in err.splitlines() if " listening on " not in line and " ranks: coordinator " not in line]
    one_line(code, "\n".join(said), f"psctl mpi: {NO_INIT}", expected_code=1)
    assert json.loads((out / "summary.json").read_text())["status"] == "not_joined"


@pytest.mark.parametrize(
    "args, fragment",
    [
        (
            ["--stragglers", "2:3"],
            "psctl launch: error: --stragglers 2:3: worker 2 does not exist in a job of 2 workers (ranks are 0..1)",
        ),
        (
            ["--workers", "3", "--set", 'stragglers=["1:3","5:exp:20"]'],
            'psctl launch: error: --set stragglers=["1:3","5:exp:20"]: worker 5 does not exist in a job of 3 workers',
        ),
    ],
)
def test_a_straggler_that_is_no_worker_is_refused(tmp_path, args, fragment):
    code, err, took = run(psctl("launch", *args), tmp_path, env_with())
    one_line(code, err, fragment)
    assert not (tmp_path / "runs").exists() and took < 30


LOCAL_INTERRUPTED = """
import sys
import psgrid
try:
    with psgrid.LocalCluster(shards=2, out=sys.argv[1]) as cluster:
        cluster.stats()
        raise KeyboardInterrupt      # Ctrl-C in the notebook cell
except KeyboardInterrupt:
    sys.exit(130)
"""


def test_a_local_cluster_interrupted_in_its_with_block_is_not_ok(tmp_path):
    out = tmp_path / "lc"
    code, err, _ = run([sys.executable, "-c", LOCAL_INTERRUPTED, str(out)], tmp_path, env_with())
    one_line(
        code,
        err,
        "psgrid.LocalCluster: KeyboardInterrupt inside the with block: stopped its processes, "
        f"job interrupted; summary in {out / 'summary.json'}",
        expected_code=130,
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["launcher"] == "local"


# ---- a model too big for the machine -----------------------------------------------------------------

HUGE = "hidden=[200000,200000]"  # 40 billion parameters: 160 GB a copy in float32, more than any one host here


def test_a_model_too_big_for_memory_is_refused_before_anything_starts(tmp_path):
    code, err, took = run(psctl("launch", "--model", "mlp", "--set", HUGE), tmp_path, env_with())
    line = one_line(code, err, "psctl launch: error: a 40,159,200,010-parameter mlp does not fit: 2 shards need ")
    assert "and this machine has " in line and "make the model smaller" in line
    assert not (tmp_path / "runs").exists() and took < 10


@pytest.mark.mpi
def test_a_model_too_big_for_a_node_is_refused_under_mpiexec(tmp_path):
    code, err, _ = run(
        [mpiexec(), "-n", "4", *psctl("mpi", "--model", "mlp", "--set", HUGE)], tmp_path, env_with(**MPI_ENV)
    )
    line = one_line(code, err, "psctl mpi: error: a 40,159,200,010-parameter mlp does not fit: 2 shards need ")
    assert "1 worker needs " in line and "and node " in line
    assert not (tmp_path / "runs").exists()


def test_what_a_model_needs_is_told_per_process():
    from psgrid.cluster.job.config import JobConfig, apply_overrides
    from psgrid.cluster.job.memory import GIB, footprint, gpu_problem, host_problem

    job = apply_overrides(JobConfig(), {"model": "mlp", "hidden": [100000, 100000], "optimizer": "adam", "shards": 2})
    fp = footprint(job)
    assert fp.params == 784 * 100000 + 100000 + 100000 * 100000 + 100000 + 100000 * 10 + 10
    assert fp.shard_bytes == -(-fp.params // 2) * 4 * 4  # weights, gradients, Adam's two slots
    assert fp.worker_bytes == 2 * 4 * fp.params + 8 * 100000 * 100000
    assert host_problem(fp, 2, 2, 2000 * GIB, "this machine") is None
    said = host_problem(fp, 2, 2, 16 * GIB, "this machine")
    assert said.startswith(
        "a 10,079,600,010-parameter mlp does not fit: 2 shards need 150.2 GiB (75.1 GiB each) "
        "and 2 workers need 299.2 GiB (149.6 GiB each) at least, and this machine has 16.0 GiB"
    ), said
    assert "its GPU has 40.0 GiB" in gpu_problem(fp, 40 * GIB) and gpu_problem(fp, 200 * GIB) is None


# A job starts by saying its parameter count: asserted on the launch that test_launch.py's
# test_tiny_job_completes_with_a_summary runs anyway.


# ---- psgrid.init against a wrong address -------------------------------------------------------------

INIT_AT = """
import sys
import numpy as np
import psgrid
try:
    psgrid.init({"w": np.zeros(3, np.float32)}, addresses=[sys.argv[1]], world=1)
except ConnectionError as e:      # what a user's script sees
    print(e, file=sys.stderr)
    sys.exit(1)
"""
NOT_A_SHARD = "not a psgrid shard: check the address (psctl server prints its own)"


@pytest.fixture
def http_server():
    """An HTTP server on 127.0.0.1 port 0 (a wrong port that something else answers on)."""
    import http.server
    import threading

    server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(10)


@pytest.fixture
def silent_listener():
    """A socket that accepts connections and never says a word."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield f"127.0.0.1:{s.getsockname()[1]}"


def test_init_against_nothing_says_so_within_seconds(tmp_path):
    address = f"127.0.0.1:{closed_port()}"
    code, err, took = run([sys.executable, "-c", INIT_AT, address], tmp_path, env_with())
    one_line(code, err, f"psgrid.init: shard 0 at {address}: cannot connect for 5 s (Connection refused)", 1)
    assert took < 15, f"took {took:.0f} s"


@pytest.mark.parametrize(
    "endpoint, what",
    [
        ("http_server", "an HTTP server answered"),
        ("silent_listener", "something listens there but did not answer in 3 s"),
    ],
)
def test_init_against_something_that_is_no_shard_says_what_answered(tmp_path, request, endpoint, what):
    address = request.getfixturevalue(endpoint)
    code, err, took = run([sys.executable, "-c", INIT_AT, address], tmp_path, env_with())
    one_line(code, err, f"psgrid.init: shard 0 at {address}: {what}; {NOT_A_SHARD}", 1)
    assert took < 10, f"took {took:.0f} s"


def test_a_worker_with_tls_against_an_http_server_is_not_told_about_tls(tmp_path, http_server):
    from psgrid.cluster.job.pki import make_certs

    make_certs(tmp_path / "pki", ["localhost", "127.0.0.1"])
    job = worker_job(tmp_path, "tls", tls_ca=tmp_path / "pki" / "ca.pem")
    code, err, took = run(psctl("worker", "--config", str(job), "--addresses", http_server), tmp_path, env_with())
    one_line(code, err, f"psctl worker: error: shard 0 at {http_server}: an HTTP server answered; {NOT_A_SHARD}")
    assert took < 10


# ---- LocalCluster's settings: named as the call gave them ---------------------------------------------


@pytest.mark.parametrize(
    "settings, said",
    [
        (
            {"mode": "asynch"},
            "psgrid.LocalCluster(mode='asynch'): mode must be one of ('sync', 'async', 'ssp'), got "
            "'asynch' (did you mean 'async'?)",
        ),
        (
            {"lr": 0.1, "stepz": 3},
            "psgrid.LocalCluster(stepz=3): unknown key 'stepz' (did you mean 'steps'?); valid keys: ",
        ),
        (
            {"optimizer": "adma"},
            "psgrid.LocalCluster(optimizer='adma'): optimizer must be one of ('sgd', 'adam'), got "
            "'adma' (did you mean 'adam'?)",
        ),
    ],
)
def test_a_local_cluster_setting_that_is_wrong_is_named_with_a_suggestion(tmp_path, settings, said):
    from psgrid import LocalCluster
    from psgrid.cluster.errors import ConfigError

    with pytest.raises(ConfigError) as caught:
        LocalCluster(out=str(tmp_path / "lc"), **settings)
    assert str(caught.value).startswith(said), str(caught.value)
    assert caught.value.__context__ is None or caught.value.__suppress_context__  # one error, not a chain
    assert "job file" not in str(caught.value) and "override" not in str(caught.value)


def test_a_local_cluster_whose_command_is_refused_makes_no_folder(tmp_path, monkeypatch):
    """The refusal came after the folder was made: a temporary one was left, and out= held a lock as if a run."""
    from psgrid import LocalCluster
    from psgrid.cluster.errors import UsageError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where a temporary output folder would go
    out = tmp_path / "lc"
    for kwargs, said in [
        ({"command": ["/nonexistent/prog"]}, "/nonexistent/prog is not an executable file"),
        ({"command": "python x.py"}, "command must be a list of arguments, as subprocess takes: ['python', 'x.py']"),
        ({"command": ["/nonexistent/prog"], "out": str(out)}, "/nonexistent/prog is not an executable file"),
    ]:
        with pytest.raises(UsageError, match=re.escape(said)):
            LocalCluster(workers=1, **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_a_local_clusters_background_workers_are_checked_as_psctl_launch_checks_its_own(tmp_path, monkeypatch):
    """steps=0 was accepted: the workers started, trained nothing, and the job said ok."""
    from psgrid import LocalCluster
    from psgrid.cluster.errors import ConfigError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(ConfigError, match=re.escape("steps = 0 trains nothing: give steps 1 or more")):
        LocalCluster(workers=1, steps=0)
    assert list(tmp_path.iterdir()) == []


def test_a_job_file_value_that_is_almost_right_gets_a_suggestion(tmp_path):
    job = tmp_path / "job.toml"
    job.write_text('mode = "asynch"\n')
    code, err, _ = run(psctl("launch", "--config", str(job)), tmp_path, env_with())
    one_line(
        code, err, f"{job}: [server] mode must be one of ('sync', 'async', 'ssp'), got 'asynch' (did you mean 'async'?)"
    )


def test_the_torch_example_says_how_to_get_pytorch(tmp_path):
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError(\"No module named 'torch' (test)\")\n")
    code, err, _ = run([sys.executable, str(ROOT / "examples" / "train_torch.py")], tmp_path, env_with(tmp_path))
    one_line(
        code,
        err,
        "examples/train_torch.py needs PyTorch, which psgrid does not install: pip install torch",
        expected_code=1,
    )


def test_metrics_port_0_says_the_ports_it_bound(tmp_path):
    import re

    code, err, _ = run(psctl("launch", "--steps", "2", "--set", "metrics_port=0", "--out", "run"), tmp_path, env_with())
    assert code == 0, err
    found = re.search(r"shard\(s\) at \S+ \(metrics on 127\.0\.0\.1:(\d+),127\.0\.0\.1:(\d+)\) applying ", err)
    assert found and 0 not in {int(found[1]), int(found[2])} and found[1] != found[2], err
    from psgrid.psserver.protocol import parse_address_file, parse_metrics_port

    text = (tmp_path / "run" / "addr" / "shard-1").read_text()
    assert parse_metrics_port(text) == int(found[2]) and parse_address_file(text)[1]


# ---- psctl status with no argument: the newest job, and a stopped job's last counters ---------------


def test_status_without_arguments_shows_the_newest_job_and_a_stopped_jobs_last_counters(tmp_path):
    code, err, _ = run(psctl("status"), tmp_path, env_with())
    one_line(code, err, "psctl status: error: no job folder in runs/ here: give --address-dir DIR")

    job = subprocess.Popen(
        psctl("launch", "--dataset", "synthetic", "--steps", "1000000", "--no-progress"),
        cwd=tmp_path,
        env=env_with(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while (
            not list(tmp_path.glob("runs/*/metrics/worker-0.jsonl"))
            or '"step"' not in next(tmp_path.glob("runs/*/metrics/worker-0.jsonl")).read_text()
        ):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()[1]
            time.sleep(0.05)
        time.sleep(2.5)  # the launcher reads the shards' counters every second
        os.killpg(job.pid, signal.SIGINT)
        job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.communicate(timeout=10)
    assert job.returncode == 130
    done = subprocess.run(psctl("status"), cwd=tmp_path, env=env_with(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    (folder,) = tmp_path.glob("runs/*")
    assert done.stderr.strip() == f"psctl status: the newest job here, runs/{folder.name}"
    lines = done.stdout.splitlines()
    assert lines[0].startswith("mnist ended: status interrupted, "), done.stdout
    assert lines[1] == "(from its summary.json: the shards have stopped; counters as last seen while it ran)"
    versions = [int(line.split()[2]) for line in lines[5:7]]
    assert len(versions) == 2 and min(versions) > 0, done.stdout


# ---- the optimizer the shards apply is said, and recorded as it applies -------------------------------


def test_a_script_is_told_the_optimizer_the_shards_apply(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "import numpy as np, psgrid\nps = psgrid.init({'w': np.zeros(4, np.float32)})\n"
        "ps.pull()\nps.push({'w': np.ones(4, np.float32)})\nps.close()\n"
    )
    code, err, _ = run(psctl("launch", "--out", "run", "--", "python", str(script)), tmp_path, env_with())
    assert code == 0, err
    assert " applying sgd (lr 0.05, momentum 0.9); starting 2 worker(s); logs in " in err  # --config mnist's
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["optimizer"] == {
        "optimizer": "sgd",
        "lr": 0.05,
        "momentum": 0.9,
        "nesterov": False,
        "weight_decay": 0.0,
    }


def test_only_the_settings_an_optimizer_uses_are_recorded():
    from psgrid.psserver.config import ServerConfig

    adam = ServerConfig(optimizer="adam", lr=1e-3, momentum=0.9)
    assert adam.applied_optimizer() == {
        "optimizer": "adam",
        "lr": 1e-3,
        "beta1": 0.9,
        "beta2": 0.999,
        "eps": 1e-8,
        "weight_decay": 0.0,
    }
    assert adam.describe_optimizer() == "adam (lr 0.001, beta1 0.9, beta2 0.999, eps 1e-08)"
    assert ServerConfig(lr=0.1).describe_optimizer() == "sgd (lr 0.1)"


def test_auto_momentum_is_said_as_what_the_shards_apply():
    """The launch line said momentum 0.9 while 4 async workers' shards applied 0.15 (async_momentum = "auto")."""
    from psgrid.cluster.job.config import apply_overrides, load_job
    from psgrid.cluster.job.rate_schedule import pushing_clients
    from psgrid.psserver.config import ServerConfig

    auto = ServerConfig(mode="async", lr=0.05, momentum=0.9, async_momentum="auto")
    assert auto.describe_optimizer(4) == "sgd (lr 0.05, momentum 0.9 less asynchrony's, 0.15 with 4 workers live)"
    assert auto.applied_optimizer(4) == {**auto.applied_optimizer(), "momentum_applied": pytest.approx(0.15)}
    assert auto.applied_optimizer()["async_momentum"] == "auto"
    adam = ServerConfig(mode="ssp", optimizer="adam", beta1=0.9, async_momentum="auto")
    assert "beta1 0.9 less asynchrony's, 0.4 with 2 workers live" in adam.describe_optimizer(2)
    for quiet in (
        ServerConfig(mode="sync", momentum=0.9, async_momentum="auto"),
        ServerConfig(mode="async", momentum=0.9),
    ):
        assert "asynchrony" not in quiet.describe_optimizer(4) and "async_momentum" not in quiet.applied_optimizer(4)
    job = apply_overrides(load_job("mnist"), {"mode": "async", "workers": 4})
    assert pushing_clients(job, hosts=2) == 4
    assert pushing_clients(apply_overrides(job, {"aggregate": "host"}), hosts=2) == 2  # one leader a host pushes


# ---- progress lines: one per evaluation step, in order; accuracy of every worker ----------------------


def test_progress_lines_come_once_per_step_in_order_and_accuracy_is_every_workers(capsys):
    from psgrid.cluster.run.coordinator import JobState, Progress

    state, progress = JobState(), Progress(800, enabled=False)
    batch = [
        {"event": "eval", "rank": 1, "step": 50, "test_accuracy": 0.5, "train_accuracy": 0.6},
        {"event": "eval", "rank": 0, "step": 100, "test_accuracy": 0.7, "train_accuracy": 0.8},
        {"event": "eval", "rank": 0, "step": 50, "test_accuracy": 0.5, "train_accuracy": 0.5},
        {"event": "eval", "rank": 1, "step": 100, "test_accuracy": 0.7, "train_accuracy": 0.6},
    ]
    progress.update(state, state.update(batch))
    progress.update(state, state.update(batch[2:]))  # psctl mpi hands the same events over again
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(":")[0].split("] ")[1] for line in lines] == ["worker 1 step 50", "worker 0 step 100"], lines
    assert state.evaluation() == pytest.approx({"test_accuracy": 0.7, "train_accuracy": 0.7})
    progress.close()


def test_a_resumed_jobs_progress_lines_count_from_where_it_was(capsys):
    """The lines' count is the bar's: steps made before the resume count, as they do in its total."""
    from psgrid.cluster.run.coordinator import JobState, Progress

    state, progress = JobState(), Progress(4000, enabled=False)
    starts = [{"event": "start", "rank": r, "time": 1.0, "first_step": 1000, "steps": 2000} for r in (0, 1)]
    steps = [{"event": "step", "rank": r, "step": 1000 + s, "loss": 1.0} for r in (0, 1) for s in range(40)]
    progress.update(state, state.update([*starts, *steps, {"event": "eval", "rank": 0, "step": 1040}]))
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"[{state.position}/4000 steps] worker 0 step 1040") and state.position == 2080, line
    progress.close()
