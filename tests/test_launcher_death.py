"""A launcher killed with SIGKILL while its children start, or later, leaves none of them running.

Each case starts ``psctl launch`` (or ``psctl compare``) under tests/launcher_kill_probe.py, which
kills it at a given moment after its first child appeared and then counts, by parent pid, the
processes it started that are still alive 5 s later (the probe is their subreaper, so none escapes
the count, grandchildren included) and ends them by pid.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.support import MPI_ENV, ROOT

JOB = ["--config", "mnist", "--steps", "100000", "--eval-every", "0", "--no-progress"]
PROBE_TIMEOUT_S = 100.0


def kill_launcher(tmp_path, delay_s: float, command: str, *args: str) -> dict:
    argv = [sys.executable, "-m", "tests.launcher_kill_probe", str(delay_s), str(tmp_path / "run"), command, *args]
    probe = subprocess.Popen(
        argv, cwd=ROOT, env=dict(os.environ, **MPI_ENV), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        out, err = probe.communicate(timeout=PROBE_TIMEOUT_S)
    finally:
        if probe.poll() is None:  # it ends what it counted before it returns; only a hang leaves it here
            probe.kill()
            probe.communicate(timeout=10)
    assert probe.returncode == 0, err
    found = json.loads(out.strip().splitlines()[-1])
    found["log"] = (tmp_path / "launch.log").read_text()
    return found


@pytest.mark.slow
@pytest.mark.parametrize("delay_s", [0.0, 0.05, 0.125, 0.3, 0.6, 1.0])
def test_no_child_outlives_a_launcher_killed_while_they_start(tmp_path, delay_s):
    found = kill_launcher(tmp_path, delay_s, "launch", *JOB)
    assert found["children"] >= 1, "the launcher was killed before it started any child"
    assert found["survivors"] == [], (
        f"{len(found['survivors'])} processes alive 5 s after the launcher's "
        f"kill -9: {found['survivors']}\n{found['log']}"
    )


@pytest.mark.slow
def test_no_child_outlives_a_launcher_killed_while_training(tmp_path):
    found = kill_launcher(tmp_path, 4.0, "launch", *JOB, "--workers", "1")
    assert found["children"] >= 2
    assert found["survivors"] == [], found


@pytest.mark.slow
@pytest.mark.mpi
def test_no_rank_outlives_a_compare_killed_during_its_allreduce_run(tmp_path):
    # mpiexec is compare's child; its ranks are the proxy's, and inherit the lifeline through both.
    found = kill_launcher(tmp_path, 3.0, "compare", *JOB, "--modes", "allreduce", "--workers", "2")
    assert found["children"] == 1
    assert list((tmp_path / "run").rglob("worker-*.jsonl")), "the ranks had not started"
    assert found["survivors"] == [], found
