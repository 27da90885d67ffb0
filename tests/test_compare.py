"""psctl compare end to end: every mode of a tiny job, the report and plots, resume, Ctrl-C and --mpi."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tests import support
from tests.support import MPI_ENV, ROOT, run_mpiexec

TINY = ["--config", "mnist", "--steps", "30", "--eval-every", "10", "--batch-size", "32", "--shards", "1"]
PNG = b"\x89PNG\r\n\x1a\n"


def psctl(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return support.psctl(*args, timeout=timeout, env=dict(os.environ, **MPI_ENV))


def rows_of(out) -> list[dict]:
    with open(out / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


@pytest.mark.slow
@pytest.mark.mpi
def test_compare_runs_every_mode_and_writes_the_report(tmp_path):
    out = tmp_path / "cmp"
    # How long it takes is the test's timeout's business, not a bar: it took 61 s once at load 13.
    p = psctl(
        "compare",
        *TINY,
        "--workers",
        "2",
        "--modes",
        "sync,async,ssp:2,allreduce",
        "--stragglers",
        "none",
        "--stragglers",
        "1:3",
        "--out",
        str(out),
    )
    assert p.returncode == 0, p.stderr
    rows = rows_of(out)
    modes = ["sync", "async", "ssp:2", "allreduce"]
    assert sorted((r["mode"], r["stragglers"]) for r in rows) == sorted((m, s) for m in modes for s in ("none", "1:3"))
    assert all(r["status"] == "ok" and float(r["samples_per_s"]) > 0 for r in rows)
    assert all(0.0 < float(r["final_test_accuracy"]) <= 1.0 for r in rows)
    # The straggler's injected delay is in the results, and only where a straggler was asked for.
    assert all((float(r["delay_s"]) > 0) == (r["stragglers"] == "1:3") for r in rows)
    steps = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert {s["run"] for s in steps} == {r["run"] for r in rows}
    assert sum(1 for s in steps if s["event"] == "step") == 8 * 2 * 30
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    for mode in modes:
        assert mode in md and mode in html
    assert "data:image/png;base64," in html and 'src="plots/' not in html
    pngs = sorted((out / "plots").glob("*.png"))
    assert {p.name for p in pngs} >= {
        "accuracy_vs_time.png",
        "loss_vs_steps.png",
        "samples_per_s.png",
        "staleness.png",
        "timeline.png",
    }
    for png in pngs:
        data = png.read_bytes()
        assert data.startswith(PNG) and len(data) > 5000, png.name
    assert "Reading" in md and "reached the target" in md


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_and_keeps_the_finished_runs(tmp_path):
    out = tmp_path / "cmp"
    env = dict(os.environ)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "psgrid.cluster.cli",
            "compare",
            *TINY,
            "--workers",
            "1",
            "--modes",
            "sync,async,ssp:1",
            # The first run finishes in 30 steps; the second, which Ctrl-C stops as soon as its worker
            # starts, could never finish before it (it was 400 steps for every run).
            "--mode-set",
            "async:steps=100000",
            "--out",
            str(out),
        ],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        first = out / "runs" / "sync-w1-r0" / "summary.json"
        deadline = time.monotonic() + 90
        while not (out / "runs" / "async-w1-r0" / "metrics" / "worker-0.jsonl").exists():
            assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert proc.returncode == 130, err
    assert "--resume" in err
    assert json.loads(first.read_text())["status"] == "ok"
    rows = {r["run"]: r["status"] for r in rows_of(out)}
    assert rows["sync-w1-r0"] == "ok" and rows.get("async-w1-r0") == "interrupted"
    assert "ssp1-w1-r0" not in rows
    # No child of the stopped run is left: every pid its launcher recorded is gone.
    log = [
        json.loads(line)
        for line in (out / "runs" / "async-w1-r0" / "metrics" / "coordinator.jsonl").read_text().splitlines()
    ]
    pids = [p for e in log for p in e.get("pids", [])]
    assert pids and not [p for p in pids if _alive(p)]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.mpi
def test_compare_under_mpiexec_runs_each_run_on_its_ranks(tmp_path):
    out = tmp_path / "cmp"
    code, stdout, err, _ = run_mpiexec(
        4,
        [
            "-m",
            "psgrid.cluster.cli",
            "compare",
            "--mpi",
            *TINY,
            "--workers",
            "2",
            "--modes",
            "sync,allreduce",
            "--out",
            str(out),
        ],
        timeout=180,
    )
    assert code == 0, err
    rows = rows_of(out)
    assert sorted(r["mode"] for r in rows) == ["allreduce", "sync"] and all(r["status"] == "ok" for r in rows)
    assert json.loads((out / "runs" / "sync-w2-r0" / "summary.json").read_text())["launcher"] == "mpi"
    # The same algorithm on both: the same final accuracy.
    assert rows[0]["final_test_accuracy"] == rows[1]["final_test_accuracy"]
    assert (out / "report.html").exists()


@pytest.mark.mpi
def test_compare_under_mpiexec_with_too_few_ranks_fails_at_once(tmp_path):
    code, _, err, took = run_mpiexec(
        2,
        [
            "-m",
            "psgrid.cluster.cli",
            "compare",
            "--mpi",
            *TINY,
            "--workers",
            "2",
            "--modes",
            "sync",
            "--out",
            str(tmp_path / "cmp"),
        ],
    )
    assert code != 0 and "needs at least 4 ranks" in err
    assert not (tmp_path / "cmp").exists()


def _num(text: str):
    return None if text == "" else float(text)


@pytest.mark.slow
def test_tune_runs_the_repeats_of_each_mode_at_its_own_best_grid_point(tmp_path):
    out = tmp_path / "cmp"
    p = psctl(
        "compare",
        *TINY,
        "--workers",
        "1",
        "--modes",
        "sync,async",
        "--tune",
        "lr=0.01,0.2",
        "--tune-steps",
        "20",
        "--tune-repeats",
        "1",
        "--out",
        str(out),
        "--no-progress",
    )
    assert p.returncode == 0, p.stderr
    rows = rows_of(out)
    tune = [r for r in rows if r["phase"] == "tune"]
    repeats = [r for r in rows if r["phase"] == "repeat"]
    # async's points carry its own default (async_momentum=auto) before the grid's value.
    assert sorted((r["mode"], r["settings"]) for r in tune) == [
        ("async", "async_momentum=auto lr=0.01"),
        ("async", "async_momentum=auto lr=0.2"),
        ("sync", "lr=0.01"),
        ("sync", "lr=0.2"),
    ]
    assert all(r["status"] == "ok" and int(r["steps"]) == 20 for r in tune)  # --tune-steps
    for mode in ("sync", "async"):
        points = [r for r in tune if r["mode"] == mode]
        # Best: not diverged, then the earliest to the target, then the best final accuracy.
        best = min(
            points,
            key=lambda r: (
                r["diverged"] == "1",
                _num(r["time_to_target_s"]) is None,
                _num(r["time_to_target_s"]) or 0.0,
                -float(r["final_test_accuracy"]),
            ),
        )
        (rep,) = [r for r in repeats if r["mode"] == mode]
        assert rep["settings"] == best["settings"], (mode, points)
        assert int(rep["steps"]) == 30
        lr = float(best["settings"].split("lr=")[1])
        assert f"lr = {lr}" in (out / "runs" / rep["run"] / "job.toml").read_text()  # what the run ran with
    md = (out / "report.md").read_text()
    assert "## Tuning" in md and "### Sensitivity, 1 worker, no stragglers" in md and "| lr=0.01 |" in md
    assert (out / "plots" / "sensitivity.png").read_bytes().startswith(PNG)
    # Written again for another target, the report keeps the points the repeats ran at.
    again = psctl("compare", "--report-only", "--out", str(out), "--target-accuracy", "0.05")
    assert again.returncode == 0, again.stderr
    assert [(r["run"], r["settings"]) for r in rows_of(out) if r["phase"] == "repeat"] == [
        (r["run"], r["settings"]) for r in repeats
    ]


@pytest.mark.slow
def test_a_diverged_mode_is_marked_said_first_and_never_sets_the_target_and_resume_runs_only_what_is_missing(tmp_path):
    # One experiment of two runs, one of them diverging, for two facts: what a diverged mode's results say, and
    # what --resume runs (each checked on the experiment before the other; they took two experiments alike).
    out = tmp_path / "cmp"
    args = [
        "compare",
        *TINY,
        "--workers",
        "1",
        "--modes",
        "sync,async",
        "--mode-set",
        "async:lr=50",
        "--out",
        str(out),
        "--no-progress",
    ]
    p = psctl(*args)
    assert p.returncode == 0, p.stderr
    rows = {r["mode"]: r for r in rows_of(out)}
    assert (rows["sync"]["diverged"], rows["async"]["diverged"]) == ("0", "1")
    assert rows["async"]["settings"] == "async_momentum=auto lr=50" and rows["sync"]["settings"] == ""
    # The automatic target is 95% of the best setting's median final accuracy (sync's), never the diverged run's.
    assert float(rows["sync"]["target_accuracy"]) == round(0.95 * float(rows["sync"]["final_test_accuracy"]), 4)
    assert float(rows["sync"]["target_accuracy"]) > float(rows["async"]["best_test_accuracy"])
    assert rows["async"]["stability"] == "diverged"
    reading = (out / "report.md").read_text().split("## Reading\n\n")[1]
    assert reading.startswith("Diverged: async in 1 of 1 run (1 worker, no stragglers, async_momentum=auto lr=50).")
    assert "lower learning rate" in reading.splitlines()[0]

    # Resume runs only what is missing.
    again = psctl(*args)
    assert again.returncode == 2 and "--resume" in again.stderr  # an experiment is never overwritten
    (out / "runs" / "async-w1-r0" / "summary.json").unlink()  # as if cut short
    resumed = psctl(*args, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "1 already finished, skipped" in resumed.stderr
    assert sorted(r["run"] for r in rows_of(out)) == ["async-w1-r0", "sync-w1-r0"]
    steps = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(s["run"] for s in steps if s["event"] == "step") == ["async-w1-r0"] * 30 + ["sync-w1-r0"] * 30
    # sync alone (without async's setting, which names a mode it no longer has): another plan
    other = psctl(
        *[a if a != "sync,async" else "sync" for a in args if a not in ("--mode-set", "async:lr=50")], "--resume"
    )
    assert other.returncode == 2 and "other settings" in other.stderr
    # The report again, for another target, from the runs there are: nothing runs.
    report = psctl("compare", "--report-only", "--out", str(out), "--target-accuracy", "0.5")
    assert report.returncode == 0, report.stderr
    rows = rows_of(out)
    assert len(rows) == 2 and all(float(r["target_accuracy"]) == 0.5 for r in rows)
    assert "0.500" in (out / "report.md").read_text()


@pytest.mark.slow
def test_compare_runs_a_users_script_in_every_mode(tmp_path):
    out = tmp_path / "cmp"
    p = psctl(
        "compare",
        "--workers",
        "2",
        "--shards",
        "1",
        "--classes",
        "10",
        "--out",
        str(out),
        "--no-progress",
        "--",
        "python",
        "examples/train_cupy.py",
        "--steps",
        "30",
        "--eval-every",
        "10",
    )
    assert p.returncode == 0, p.stderr
    rows = rows_of(out)
    assert sorted(r["mode"] for r in rows) == ["async", "ssp:2", "sync"]
    assert all(r["status"] == "ok" and r["diverged"] == "0" and int(r["steps"]) == 60 for r in rows)
    accuracy = {r["mode"]: (r["final_test_accuracy"], r["best_test_accuracy"], r["time_to_target_s"]) for r in rows}
    # Every mode learned (its best) and none fell to chance, 0.1 (its last). Async's last evaluation, after 60
    # pushes with the job's momentum 0.9 and two workers' staleness, swings: 8 runs of this command gave
    # 0.37 to 0.81 (best 0.57 to 0.81), and a CI run failed the former bar of 0.5 at 0.486.
    assert all(0.5 < float(r["best_test_accuracy"]) <= 1.0 and float(r["final_test_accuracy"]) > 0.2 for r in rows), (
        accuracy
    )
    # The target is 95% of the best mode's final accuracy (one run each): that mode reached it.
    best = max(rows, key=lambda r: float(r["final_test_accuracy"]))
    assert float(best["target_accuracy"]) == round(0.95 * float(best["final_test_accuracy"]), 4)
    assert best["time_to_target_s"], accuracy
    for r in rows:  # each run's shards had its mode
        assert f'mode = "{r["mode"].partition(":")[0]}"' in (out / "runs" / r["run"] / "job.toml").read_text()
    md = (out / "report.md").read_text()
    assert all(f"| {m} |" in md for m in ("sync", "async", "ssp:2")) and "reached the target" in md
    refused = psctl(
        "compare", "--modes", "sync,allreduce", "--out", str(tmp_path / "no"), "--", "python", "examples/train_cupy.py"
    )
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "allreduce" in refused.stderr and not (tmp_path / "no").exists()


OPEN_MPI_VERSION = "mpiexec (Open MPI) 5.0.3\n\nReport bugs to https://www.open-mpi.org/community/help/\n"
HYDRA_VERSION = "HYDRA build details:\n    Version:                                 5.0.2\n"


@pytest.mark.parametrize(
    "said, unbound", [(OPEN_MPI_VERSION, ["--bind-to", "none"]), (HYDRA_VERSION, [])], ids=["open-mpi", "mpich"]
)
def test_the_allreduce_runs_start_mpiexec_unbound_on_open_mpi(tmp_path, monkeypatch, said, unbound):
    # Open MPI binds each rank to one core, where a GPU rank's loader then shares it with the loop
    # (docs/performance.md: 165,653 against 226,828 samples/s); MPICH's hydra binds nothing by default.
    from psgrid.cluster.experiments import compare
    from psgrid.cluster.job.config import JobConfig, apply_overrides
    from psgrid.cluster.mpi import mpiexec

    fake = tmp_path / "mpiexec"
    fake.write_text(f"#!/bin/sh\ncat <<'END'\n{said}END\n")
    fake.chmod(0o755)
    mpiexec.is_open_mpi.cache_clear()
    monkeypatch.setattr(compare, "mpiexec_path", lambda: str(fake))
    started = []

    class Started(Exception):
        pass

    def child(name, argv, log, env):
        started.append(argv)
        raise Started

    monkeypatch.setattr(compare, "Child", child)
    job = apply_overrides(JobConfig(name="t"), {"workers": 2, "out": str(tmp_path / "run")})
    with pytest.raises(Started):
        compare.run_allreduce_local(job, tmp_path / "run", None)
    assert started[0][: 3 + len(unbound)] == [str(fake), *unbound, "-n", "2"]
    mpiexec.is_open_mpi.cache_clear()
