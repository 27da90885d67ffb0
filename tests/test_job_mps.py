"""``[job] mps = true``: the launcher's own MPS control daemon, named to every child, quit when the job ends.

No GPU is needed: a stand-in ``nvidia-cuda-mps-control`` on PATH behaves as the real one does toward
the launcher. Run with ``-f`` it makes its control pipe (a FIFO) in ``CUDA_MPS_PIPE_DIRECTORY`` and
serves commands written to it until ``quit``; run without, it writes its standard input to that pipe
(how ``echo quit | nvidia-cuda-mps-control`` reaches the daemon). It records what it did in a file.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support import ROOT, alive, psctl, wait_for
from tests.test_launcher_death import kill_launcher

FAKE_CONTROL = """#!{python}
import os, sys, time
record = os.environ["FAKE_MPS_RECORD"]
pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
control = os.path.join(pipe, "control")
def say(**fields):
    with open(record, "a") as f:
        f.write(__import__("json").dumps(fields) + "\\n")
if sys.argv[1:] == ["-f"]:
    if os.environ.get("FAKE_MPS_FAIL"):
        sys.exit(3)
    say(event="daemon", pid=os.getpid(), pipe=pipe, log=os.environ.get("CUDA_MPS_LOG_DIRECTORY"),
        log_exists=os.path.isdir(os.environ.get("CUDA_MPS_LOG_DIRECTORY", "")))
    os.mkfifo(control)
    while True:
        with open(control) as f:
            for line in f:
                say(event="command", command=line.strip())
                if line.strip() == "quit":
                    sys.exit(0)
else:
    with open(control, "w") as f:
        f.write(sys.stdin.read())
"""

SCRIPT = """
import json, os, sys
import numpy as np
import psgrid
params = {"w": np.zeros(4, np.float32)}
ps = psgrid.init(params)
for _ in range(3):
    ps.pull()
    ps.push({"w": np.ones(4, np.float32)}, loss=1.0, samples=1)
ps.close()
with open(os.path.join(sys.argv[1], f"env-{ps.rank}.json"), "w") as f:
    json.dump({k: os.environ.get(k) for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")}, f)
"""


@pytest.fixture
def fake_mps(tmp_path, monkeypatch):
    """A stand-in control binary first on PATH; returns its record file."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    control = bin_dir / "nvidia-cuda-mps-control"
    control.write_text(FAKE_CONTROL.format(python=sys.executable))
    control.chmod(0o755)
    record = tmp_path / "mps-record.jsonl"
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_MPS_RECORD", str(record))
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)
    return record


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(150)
def test_every_worker_of_a_job_with_mps_finds_the_jobs_daemon_which_quits_when_the_job_ends(tmp_path, fake_mps):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "run"
    done = psctl("launch", "--mps", "--workers", "2", "--out", str(out), "--no-progress", "--", sys.executable,
                 str(script), str(tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = records(fake_mps)
    daemon = next(r for r in said if r["event"] == "daemon")
    assert [r["command"] for r in said if r["event"] == "command"] == ["quit"]  # asked to quit, once
    assert daemon["log_exists"], said
    for rank in (0, 1):
        env = json.loads((tmp_path / f"env-{rank}.json").read_text())
        assert env == {"CUDA_MPS_PIPE_DIRECTORY": daemon["pipe"], "CUDA_MPS_LOG_DIRECTORY": daemon["log"]}
    wait_for(lambda: not alive(daemon["pid"]), 15, "the daemon to end with the job")
    folder = Path(daemon["pipe"]).parent
    assert not folder.exists(), f"the daemon's folder {folder} was left behind"
    assert "without MPS" not in done.stderr


def test_a_job_with_mps_where_no_daemon_can_start_is_refused_in_one_line_before_anything_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(Path(sys.executable).parent))  # no nvidia-cuda-mps-control there
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    out = tmp_path / "run"
    done = psctl("launch", "--config", "mnist", "--mps", "--out", str(out), "--no-progress", timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "nvidia-cuda-mps-control" in lines[0] and "mps = false" in lines[0], lines
    assert not out.exists()


@pytest.mark.timeout(150)
def test_a_daemon_that_serves_already_is_used_and_none_is_started(tmp_path, fake_mps, monkeypatch):
    served = tmp_path / "site-mps"
    served.mkdir()
    (served / "control").touch()  # the pipe of a daemon the machine's owner runs
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(served))
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    done = psctl("launch", "--mps", "--workers", "1", "--out", str(tmp_path / "run"), "--no-progress", "--",
                 sys.executable, str(script), str(tmp_path))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert records(fake_mps) == []  # no daemon of the job's own
    assert json.loads((tmp_path / "env-0.json").read_text())["CUDA_MPS_PIPE_DIRECTORY"] == str(served)


@pytest.mark.timeout(120)
def test_a_daemon_that_does_not_start_fails_the_job_in_one_line_naming_its_log(tmp_path, fake_mps, monkeypatch):
    monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    out = tmp_path / "run"
    done = psctl("launch", "--config", "mnist", "--mps", "--out", str(out), "--no-progress", timeout=100)
    assert done.returncode == 1, done.stderr
    assert "MPS control daemon" in done.stderr and str(out / "logs" / "mps.log") in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "failed"
    assert not list((out / "addr").glob("shard-*")), "a shard started though the daemon did not"


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_a_launcher_killed_outright_leaves_no_daemon_and_no_folder(tmp_path, fake_mps):
    found = kill_launcher(
        tmp_path, 4.0, "launch", "--config", "mnist", "--steps", "100000", "--eval-every", "0", "--no-progress",
        "--workers", "1", "--mps",
    )  # fmt: skip
    daemon = next(r for r in records(fake_mps) if r["event"] == "daemon")
    assert found["survivors"] == [], found
    assert not alive(daemon["pid"])
    assert not Path(daemon["pipe"]).parent.exists()
    assert [r["command"] for r in records(fake_mps) if r["event"] == "command"] == ["quit"]


def test_a_launcher_stopped_by_sigterm_quits_its_daemon(tmp_path, fake_mps):
    launcher = subprocess.Popen(
        [sys.executable, "-m", "psgrid.cluster.cli", "launch", "--config", "mnist", "--steps", "100000",
         "--eval-every", "0", "--no-progress", "--workers", "1", "--mps", "--out", str(tmp_path / "run")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        wait_for(lambda: any(r["event"] == "daemon" for r in records(fake_mps)), 60, "the job's daemon")
        time.sleep(1.0)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate(timeout=10)
    assert launcher.returncode == 128 + signal.SIGTERM, err
    daemon = next(r for r in records(fake_mps) if r["event"] == "daemon")
    wait_for(lambda: not alive(daemon["pid"]), 15, "the daemon to end with its launcher")
    assert [r["command"] for r in records(fake_mps) if r["event"] == "command"] == ["quit"]
    assert not Path(daemon["pipe"]).parent.exists()


@pytest.mark.parametrize(
    "argv",
    [
        ["mpi", "--config", "mnist", "--set", "mps=true"],
        ["compare", "--config", "mnist", "--mpi", "--set", "mps=true", "--modes", "sync", "--out", "OUT"],
    ],
    ids=["psctl mpi", "psctl compare --mpi"],
)
def test_mps_under_mpiexec_is_refused_in_one_line_naming_what_to_do(tmp_path, fake_mps, argv):
    argv = [str(tmp_path / "out") if a == "OUT" else a for a in argv]
    done = psctl(*argv, timeout=60)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "mps = true" in lines[0] and "nvidia-cuda-mps-control -d" in lines[0], lines
    assert records(fake_mps) == []


def test_a_local_cluster_refuses_mps_in_one_line(tmp_path):
    import psgrid
    from psgrid.cluster.errors import ConfigError

    with pytest.raises(ConfigError, match="LocalCluster does not"):
        psgrid.LocalCluster(config="mnist", mps=True, out=str(tmp_path / "run"))
