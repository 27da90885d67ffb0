"""The user's own command under psctl launch and psctl mpi: the job in its environment, failures as a worker's."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest

from psgrid.cluster.cli import main
from psgrid.cluster.run import script
from tests.support import ROOT, Launch, assert_token_kept, run_launch, run_mpiexec, steps_seen

EXAMPLE = "examples/train_cupy.py"
USER_SCRIPT = "tests/user_script.py"


# -- units -------------------------------------------------------------------------------------


def test_a_command_is_checked_before_anything_starts(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    out = tmp_path / "run"
    for command, message in [
        ([], "nothing after --: give the command each worker runs, e.g. -- python train.py"),
        (["no-such-program-here"], "no program 'no-such-program-here' on PATH"),
        (["python", "missing.py"], "no script missing.py"),
        (["./README.md"], "./README.md is not an executable file"),
    ]:
        assert main(["launch", "--out", str(out), "--", *command]) == 2
        err = capsys.readouterr().err
        assert err.startswith("psctl launch: error: the command after --") or "nothing after --" in err, err
        assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
    with pytest.raises(SystemExit) as exit_:
        main(["server", "--", "python", "train.py"])
    assert exit_.value.code == 2
    assert (
        "psctl: error: only launch, mpi and compare run a command of yours after --, not server"
        in capsys.readouterr().err
    )


def test_python_is_the_interpreter_psctl_runs_on(monkeypatch):
    import sys

    monkeypatch.chdir(ROOT)
    assert script.resolve_command(["python", EXAMPLE, "--steps", "3"]) == [sys.executable, EXAMPLE, "--steps", "3"]
    assert script.default_name([sys.executable, EXAMPLE]) == "train_cupy"
    assert script.default_name(["/bin/echo", "hi"]) == "echo"


def test_each_worker_gets_the_job_in_its_environment(tmp_path, monkeypatch):
    from psgrid.cluster.job.config import apply_overrides, load_job
    from psgrid.worker.env import job_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    job = apply_overrides(load_job("mnist"), {"token": "secret-token", "train.tls_ca": "ca.pem", "seed": 11})
    base = {"PATH": "/bin", "PMI_RANK": "4", "OMPI_COMM_WORLD_RANK": "4", "PMIX_RANK": "4"}
    env = script.worker_env(base, job, tmp_path, ["127.0.0.1:1", "127.0.0.1:2"], rank=3, world=4, local_rank=3)
    assert not any(k.startswith(("PMI_", "PMIX_", "OMPI_")) for k in env)  # it is not an MPI rank
    seen = job_env(env)
    assert (seen.addresses, seen.rank, seen.world, seen.local_rank, seen.gpu) == (
        ["127.0.0.1:1", "127.0.0.1:2"],
        3,
        4,
        3,
        1,
    )  # local rank 3 of 2 visible GPUs
    assert seen.token == "secret-token" and seen.tls_ca == str(Path("ca.pem").resolve())
    assert seen.metrics == str(tmp_path.resolve() / "metrics" / "worker-3.jsonl")
    assert seen.job_file == str(tmp_path.resolve() / "job.toml") and env["LOCAL_RANK"] == "3"
    assert seen.seed == 11  # the job's [train] seed, which compare's repeats vary


def test_gpus_are_counted_without_cuda(monkeypatch):
    from psgrid.cluster.errors import UsageError

    for mask, count in [("0,1,2", 3), ("", 0), ("1,-1,2", 1), ("-1", 0)]:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", mask)
        assert script.visible_gpus() == count, mask
    assert script.gpu_for(5, "auto", gpus=2) == 1 and script.gpu_for(5, "cpu", gpus=2) is None
    assert script.gpu_for(0, "auto", gpus=0) is None
    with pytest.raises(UsageError, match="device = gpu, but no CUDA GPU is visible"):
        script.gpu_for(0, "gpu", gpus=0)


def test_output_is_relayed_line_by_line_with_the_rank(tmp_path):
    logs = {0: tmp_path / "0.log", 1: tmp_path / "1.log"}
    lines: list[str] = []
    relay = script.OutputRelay(logs, write=lines.append)
    logs[0].write_text("hello\nhal")
    relay.pump()
    assert lines == ["[rank 0] hello"]
    with open(logs[0], "a") as f:
        f.write("f a line\r\n")
    logs[1].write_bytes(b"bad \xff byte")
    relay.pump(final=True)
    assert lines == ["[rank 0] hello", "[rank 0] half a line", "[rank 1] bad \ufffd byte"]


# -- whole jobs --------------------------------------------------------------------------------


def read_events(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_launch_runs_the_example_once_per_worker(tmp_path):
    code, text, out = run_launch(tmp_path, "--workers", "2", "--no-progress", "--", "python", EXAMPLE)
    assert code == 0, text
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["name"], summary["workers"], summary["workers_completed"]) == (
        "ok",
        "train_cupy",
        2,
        2,
    )
    assert summary["steps"] == 600 and summary["samples"] == 600 * 32 and summary["samples_per_s"] > 0
    assert summary["test_accuracy"] >= 0.88, summary["test_accuracy"]
    assert summary["command"][1:] == [EXAMPLE]
    assert all(s["applied_updates"] == 300 and s["pushes"] == 600 for s in summary["shard_stats"])  # sync rounds
    kinds = {(e["event"], e.get("rank")) for e in read_events(out)}
    assert {("start", 0), ("start", 1), ("step", 0), ("step", 1), ("eval", 0), ("done", 0), ("done", 1)} <= kinds
    for rank in range(2):  # CuPy where the machine has a GPU, else NumPy
        assert re.search(rf"\[rank {rank}\] worker {rank} of 2 \((numpy|cupy)\): 300 steps", text), text
    assert "train_cupy (sync, 2 shards, 2 workers): 600 steps in " in text
    assert_token_kept(out)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_script_that_fails_before_it_joins_is_a_tolerated_worker_failure(tmp_path):
    t = time.monotonic()
    code, text, out = run_launch(
        tmp_path,
        "--workers",
        "2",
        "--no-progress",
        "--set",
        "join_timeout_s=100",
        "--",
        "python",
        USER_SCRIPT,
        "20",
        "exit-before-join:1",
    )
    assert code == 0, text
    assert time.monotonic() - t < 60, "worker 0 waited for the one that never joined"
    summary = json.loads((out / "summary.json").read_text())
    (failure,) = summary["failures"]
    assert (failure["name"], failure["exit_code"], failure["tolerated"]) == ("worker 1", 3, True)
    assert summary["workers_completed"] == 1 and summary["steps"] == 20
    assert "tolerated failure: worker 1 exited with code 3" in text
    assert "shards were told not to wait for it" in text


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_job_whose_scripts_all_fail_fails(tmp_path):
    code, text, out = run_launch(
        tmp_path, "--workers", "2", "--no-progress", "--", "python", USER_SCRIPT, "20", "exit-before-join:all"
    )
    assert code == 1, text
    assert "no worker completed (worker 0 exited with code 3; worker 1 exited with code 3)" in text
    assert json.loads((out / "summary.json").read_text())["status"] == "failed"


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_mpi_runs_the_example_on_each_worker_rank(tmp_path):
    out = tmp_path / "run"
    code, stdout, err, took = run_mpiexec(
        4,
        [
            "-m",
            "psgrid.cluster.cli",
            "mpi",
            "--shards",
            "1",
            "--no-progress",
            "--out",
            str(out),
            "--",
            "python",
            EXAMPLE,
        ],
        timeout=150,
    )
    assert code == 0, f"{stdout}\n{err}"
    summary = json.loads((out / "summary.json").read_text())
    assert (summary["status"], summary["launcher"], summary["shards"], summary["workers"]) == ("ok", "mpi", 1, 2)
    assert summary["workers_completed"] == 2 and summary["steps"] == 600 and summary["failures"] == []
    assert summary["test_accuracy"] >= 0.88, summary["test_accuracy"]
    assert "[rank 0] worker 0 of 2 (numpy): 300 steps" in stdout and "[rank 1] worker 1 of 2" in stdout
    # Each line of a script once, with one prefix (its rank's own log is not read back into the relay).
    lines = stdout.splitlines()
    assert sum("worker 0 of 2 (numpy): 300 steps" in line for line in lines) == 1, stdout[-2000:]
    assert not any(line.startswith(("[rank 0] [rank", "[rank 1] [rank")) for line in lines), stdout[-2000:]
    assert {e["rank"] for e in read_events(out) if e["event"] == "done"} == {0, 1}
    assert_token_kept(out)
    print(f"mpiexec -n 4 psctl mpi -- python {EXAMPLE} took {took:.1f} s")


@pytest.mark.mpi
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_mpi_tolerates_a_script_that_fails_while_another_completes(tmp_path):
    out = tmp_path / "run"
    code, stdout, err, took = run_mpiexec(
        4,
        [
            "-m",
            "psgrid.cluster.cli",
            "mpi",
            "--shards",
            "1",
            "--no-progress",
            "--set",
            "join_timeout_s=100",
            "--out",
            str(out),
            "--",
            "python",
            USER_SCRIPT,
            "20",
            "exit-before-join:0",
        ],
        timeout=150,
    )
    assert code == 0, f"{stdout}\n{err}"
    assert took < 90, "worker 1 waited for the one that never joined"
    summary = json.loads((out / "summary.json").read_text())
    (failure,) = summary["failures"]
    assert (failure["name"], failure["exit_code"], failure["tolerated"]) == ("worker 0", 3, True)
    assert summary["workers_completed"] == 1 and summary["worker_results"][0]["exit_code"] == 3
    assert "psctl mpi: worker 0 exited with code 3; the others go on" in err


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_scripts_rate_runs_over_the_jobs_steps_and_psctl_says_so(tmp_path):
    """The shards keep the schedule (the script's own scheduler cannot reach them); its length is the job's."""
    code, text, out = run_launch(
        tmp_path,
        *("--workers", "2", "--mode", "async", "--set", "lr_schedule=linear", "--set", "steps=20", "--no-progress"),
        *("--", "python", EXAMPLE, "--steps", "20", "--eval-every", "0"),
    )
    assert code == 0, text
    assert "lr_schedule linear runs over 40 updates, from [train] steps = 20; a script that runs another" in text
    summary = json.loads((out / "summary.json").read_text())
    # 2 workers x 20 pushes, each an update in async: the rate reached zero with the last one
    assert all(s["applied_updates"] == 40 and s["lr"] == 0.0 for s in summary["shard_stats"])


def step_records(path: Path) -> dict[int, list[int]]:
    """Each rank's step numbers in a metrics file, in the order written."""
    steps: dict[int, list[int]] = {}
    for event in map(json.loads, path.read_text().splitlines()):
        if event.get("event") == "step":
            steps.setdefault(event["rank"], []).append(event["step"])
    return steps


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_resumed_script_makes_only_the_steps_that_are_left(tmp_path):
    """A script looping from ``ps.first_step`` resumes where its shards stopped: it trained every step again."""
    total = 4000
    job = ["--no-progress", "--workers", "2", "--mode", "async"]
    job += ["--set", f"checkpoint_dir={tmp_path / 'ckpt'}", "--set", "checkpoint_every=50"]
    with Launch(tmp_path, *job, "--", "python", USER_SCRIPT, str(total)) as launch:
        launch.wait_for(lambda: steps_seen(launch.out, 0) >= 200, 90, "worker 0 training")
        launch.proc.send_signal(signal.SIGINT)
        assert launch.wait(60) == 128 + signal.SIGINT, launch.text()
    with Launch(tmp_path, "--no-progress", "--resume", str(launch.out), log="resume.log") as resumed:
        assert resumed.wait(120) == 0, resumed.text()
    assert "ps.first_step is where the shards left it" in resumed.text()
    summary = json.loads((launch.out / "summary.json").read_text())
    # Every push of both workers' 4000 steps applied once: none again, none skipped.
    assert [s["version"] for s in summary["shard_stats"]] == [2 * total] * len(summary["shard_stats"]), summary
    starts = {
        e["rank"]: e["first_step"]
        for e in map(json.loads, (launch.out / "metrics.jsonl").read_text().splitlines())
        if e.get("event") == "start"
    }
    assert all(first > 0 for first in starts.values()), starts
    for rank, steps in step_records(launch.out / "metrics.jsonl").items():
        assert steps == list(range(starts[rank], total)), (rank, steps[:3], steps[-3:])
    made = {r["rank"]: r["steps"] for r in summary["worker_results"]}
    assert made == {rank: total - first for rank, first in starts.items()}, (made, starts)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_script_job_resumes_its_own_command(tmp_path, monkeypatch, capsys):
    """``--resume DIR`` of a script job ran the built-in trainer (every worker failed on the model's hash)."""
    job = [
        "--no-progress",
        "--workers",
        "2",
        "--set",
        f"checkpoint_dir={tmp_path / 'ckpt'}",
        "--set",
        "checkpoint_every=20",
    ]
    with Launch(tmp_path, *job, "--", "python", USER_SCRIPT, "100000") as launch:
        launch.wait_for(lambda: steps_seen(launch.out, 0) >= 60, 90, "worker 0 training")
        launch.proc.send_signal(signal.SIGINT)
        assert launch.wait(60) == 128 + signal.SIGINT, launch.text()
    recorded = json.loads((launch.out / "command.json").read_text())
    assert recorded["command"][1:] == [USER_SCRIPT, "100000"] and recorded["cwd"] == str(ROOT)

    monkeypatch.chdir(tmp_path)  # the command's relative paths would mean other files here: refused, nothing started
    assert main(["launch", "--resume", str(launch.out)]) == 2
    err = capsys.readouterr().err
    assert f"in {ROOT}: resume from there (cd {ROOT}), or give the command after --" in err, err
    assert not (launch.out / "attempts").exists()

    with Launch(tmp_path, "--no-progress", "--resume", str(launch.out), log="resume.log") as resumed:
        resumed.wait_for(lambda: "resuming the job's own command" in resumed.text(), 30, "the resume")
        resumed.wait_for(lambda: steps_seen(launch.out, 0) >= 100, 90, "worker 0 training on")
        resumed.proc.send_signal(signal.SIGINT)
        assert resumed.wait(60) == 128 + signal.SIGINT, resumed.text()
    assert "model spec hash" not in resumed.text()
    with Launch(tmp_path, "--no-progress", "--resume", str(launch.out), "--", "python", USER_SCRIPT, "50") as given:
        assert given.wait(120) == 0, given.text()  # a command given after -- is run instead
    assert "resuming with the command given after --; the job ran" in given.text()
    summary = json.loads((launch.out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["command"][1:] == [USER_SCRIPT, "50"], summary
    assert summary["workers_completed"] == 2 and summary["name"] == "user_script"
