"""What a job survives, end to end through ``psctl launch``: dead, hung and never-joined workers,
a killed shard restarted from its checkpoint, Ctrl-C followed by ``--resume``, and a launcher stopped
while it rewrites the job's file.

Each test runs real processes on loopback and ends every one of them by its pid.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.support import ROOT, Launch, child_pids, coordinator_events, launch_env, steps_seen, wait_for

MNIST = ["--config", "mnist", "--eval-every", "0", "--no-progress", "--lease-s", "2"]


def summary_of(out) -> dict:
    return json.loads((out / "summary.json").read_text())


def worker_events(out, rank: int, kind: str) -> list[dict]:
    path = out / "metrics" / f"worker-{rank}.jsonl"
    if not path.exists():  # an attempt stopped before the worker wrote anything
        return []
    return [e for e in map(json.loads, path.read_text().splitlines()) if e.get("event") == kind]


# ----- workers --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_a_worker_killed_in_any_mode_is_named_and_the_job_completes(tmp_path, mode):
    with Launch(tmp_path, *MNIST, "--mode", mode, "--workers", "3", "--steps", "250") as launch:
        launch.wait_for(lambda: steps_seen(launch.out, 2) >= 10, 60, "worker 2 training")
        victim = child_pids(launch.out)["workers"][2]
        os.kill(victim, signal.SIGKILL)
        code = launch.wait(120)
        text = launch.text()
    assert code == 0, text
    summary = summary_of(launch.out)
    (failure,) = summary["failures"]
    assert (failure["name"], failure["pid"], failure["exit_code"], failure["tolerated"]) == (
        "worker 2",
        victim,
        -9,
        True,
    )
    assert "tolerated failure: worker 2" in text
    assert summary["workers_completed"] == 2
    survivors = summary["worker_results"][:2]
    assert [(w["completed"], w["steps"]) for w in survivors] == [(True, 250), (True, 250)], survivors
    if mode == "async":  # every push of the survivors was applied: the kill cost them nothing
        assert all(s["applied_updates"] == s["pushes"] >= 500 for s in summary["shard_stats"])
    else:  # the others waited on it: one lease, not forever (async never waits)
        assert all(s["evictions"] >= 1 for s in summary["shard_stats"])
    # The job still learned. Sync and ssp land near 0.92 whatever the timing; async's accuracy
    # depends on how the survivors' pushes interleave under load (15 runs at load 9 to 12: 0.905 to
    # 0.925; once 0.834 in the full suite at load 2 to 6), so its bar is set well below that spread.
    bar = 0.75 if mode == "async" else 0.85
    assert summary["test_accuracy"] > bar, summary["test_accuracy"]


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_hung_worker_with_a_live_heartbeat_is_evicted_and_stopped(tmp_path, mode):
    # Worker 1 sleeps 10^6 times its compute after its first gradient: its heartbeat thread lives on.
    args = [
        *MNIST,
        "--mode",
        mode,
        "--staleness",
        "1",
        "--steps",
        "120",
        "--stragglers",
        "1:1000000",
        "--set",
        "progress_timeout_s=3",
    ]
    with Launch(tmp_path, *args) as launch:
        code = launch.wait(120)
        text = launch.text()
    assert code == 0, text
    summary = summary_of(launch.out)
    assert summary["worker_results"][0]["completed"] and summary["worker_results"][0]["steps"] == 120
    (failure,) = summary["failures"]
    assert failure["name"] == "worker 1" and failure["tolerated"]
    assert "progress_timeout_s = 3 s" in failure["reason"]
    assert "worker 1 was evicted by the shards" in text
    assert sum(s["stalled_evictions"] for s in summary["shard_stats"]) >= 1
    log = (launch.out / "logs" / "server-0.log").read_text()
    assert "evicted worker 1: the others waited on it and it pushed nothing" in log


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_killed_before_it_joins_is_not_waited_for(tmp_path):
    args = [*MNIST, "--mode", "sync", "--steps", "60", "--set", "join_timeout_s=100"]
    with Launch(tmp_path, *args) as launch:
        # Killed as soon as it exists: it is still importing, long before it can register.
        pids = wait_for(lambda: child_pids(launch.out).get("workers"), 30, "workers started", poll=0.01)
        os.kill(pids[1], signal.SIGKILL)
        code = launch.wait(100)
        text = launch.text()
    assert code == 0, text
    assert (
        "worker 1 was killed by SIGKILL (exit code -9) before it joined; the shards were told not to wait for it"
        in text
    )
    summary = summary_of(launch.out)
    assert summary["worker_results"][0]["completed"]
    assert all(set(s["departed"]) == {0, 1} for s in summary["shard_stats"])  # 1 reported gone, 0 left
    started = next(e["time"] for e in coordinator_events(launch.out) if e["event"] == "workers_started")
    (start,) = worker_events(launch.out, 0, "start")
    assert start["time"] - started < 30, "worker 0 waited for the dead worker (join_timeout_s is 100 s)"
    # wall_s is training time: from the first step, not from the processes' start
    assert summary["wall_s"] <= worker_events(launch.out, 0, "done")[0]["time"] - start["time"] + 1.0


# ----- shards ---------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_killed_shard_is_restarted_from_its_checkpoint_and_the_job_completes(tmp_path, mode):
    every = 10
    args = [
        *MNIST,
        "--mode",
        mode,
        "--shards",
        "2",
        "--steps",
        "300",
        "--restart-failed",
        "--set",
        f"checkpoint_dir={tmp_path / 'ckpt'}",
        "--set",
        f"checkpoint_every={every}",
    ]
    with Launch(tmp_path, *args) as launch:
        launch.wait_for(lambda: steps_seen(launch.out, 0) >= 40, 60, "worker 0 training")
        victim = child_pids(launch.out)["shards"][1]
        os.kill(victim, signal.SIGKILL)
        code = launch.wait(150)
        text = launch.text()
    assert code == 0, text
    summary = summary_of(launch.out)
    (restart,) = summary["restarts"]
    assert (restart["shard"], restart["pid"], restart["exit_code"]) == (1, victim, -9)
    assert f"server 1 was killed by SIGKILL (exit code -9); restarting it on {summary['addresses'][1]}" in text
    shard0, shard1 = summary["shard_stats"]
    # the restarted shard went on from its checkpoint's version, on the same address
    assert shard1["restored_version"] == restart["checkpoint_version"] >= every
    # What it lost is what came after its last complete checkpoint: fewer than `every` updates, or
    # fewer than twice that where the kill landed while the next one was being written (18 seen once
    # at load), and the pushes in flight (two per worker: each has two gradient buffers).
    assert 0 <= shard1["lost_updates"] < 2 * every + 2 * 2
    assert shard0["lost_updates"] == 0
    # every update the restarted shard did not lose, it applied
    assert shard1["version"] + shard1["lost_updates"] == shard0["version"]
    assert all(w["completed"] for w in summary["worker_results"])
    # A sanity bar, not the test's point: async's 300 steps around a restart ended at 0.82 once, under
    # three test processes on 2 cores, and at 0.744 in CI on 2026-11-30 (async at the job's lr with auto
    # momentum scatters: 0.80-0.91 in 8 runs of 200 steps, 3 workers, no restart); chance is 0.1.
    assert summary["test_accuracy"] > (0.6 if mode == "async" else 0.85), summary["test_accuracy"]
    assert "restored its checkpoint at version" in (launch.out / "logs" / "server-1.log").read_text()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_shard_killed_before_its_first_interval_comes_back_with_the_jobs_first_weights(tmp_path):
    """Its first checkpoint is the weights it was given: it came back with none, and every worker failed on it."""
    args = [*MNIST, "--mode", "sync", "--shards", "2", "--steps", "200", "--restart-failed"]
    args += ["--set", f"checkpoint_dir={tmp_path / 'ckpt'}", "--set", "checkpoint_every=100000"]
    with Launch(tmp_path, *args) as launch:
        launch.wait_for(lambda: steps_seen(launch.out, 0) >= 20, 60, "worker 0 training")
        victim = child_pids(launch.out)["shards"][1]
        os.kill(victim, signal.SIGKILL)
        code = launch.wait(150)
        text = launch.text()
    assert code == 0, text
    assert "from its checkpoint at version 0 (restart 1 of" in text, text
    summary = summary_of(launch.out)
    (restart,) = summary["restarts"]
    assert (restart["shard"], restart["checkpoint_version"]) == (1, 0)
    shard0, shard1 = summary["shard_stats"]
    assert shard1["restored_version"] == 0 and shard1["lost_updates"] >= 20
    assert shard1["version"] + shard1["lost_updates"] == shard0["version"] == 200
    assert all(w["completed"] for w in summary["worker_results"])


ATTEMPTS = 14  # Ctrl-Cs at random moments, 0.3 to 3 s after each start


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_ctrl_c_at_random_moments_then_resume_finishes_the_total_steps(tmp_path):
    # While it is interrupted, each step sleeps 10 ms on average (a sync round waits for the slower of
    # two: 15 ms): the 14 attempts sleep 20.6 s before their Ctrl-Cs, room for 1,400 rounds at most
    # (about 400 seen), so 1600 steps are more than they can make and every Ctrl-C lands in the job (in
    # its start, its training or its end of an attempt). The last resume drops the sleep and finishes
    # the rest, at about 2 ms a round: every step past what the attempts need costs the suite time
    # (2500 steps cost it about 900 rounds more).
    steps = 1600
    args = [
        *MNIST,
        "--mode",
        "sync",
        "--shards",
        "2",
        "--steps",
        str(steps),
        "--set",
        "checkpoint_every=50",
        "--set",
        f"checkpoint_dir={tmp_path / 'ckpt'}",
        "--set",
        'stragglers=["0:exp:10", "1:exp:10"]',
    ]
    rng = random.Random(9)
    out = tmp_path / "run"
    for attempt in range(ATTEMPTS):
        # A launch stopped before it wrote its job.toml has nothing to resume (resume.py says so and to
        # launch again with --overwrite, as a user then does): on a loaded machine the first Ctrl-C may land there.
        if (out / "job.toml").exists():
            flags = ["--no-progress", "--resume", str(out)]
        else:
            flags = [*args, "--overwrite"] if attempt else args
        with Launch(tmp_path, *flags, log=f"launch-{attempt}.log") as launch:
            time.sleep(rng.uniform(0.3, 3.0))
            launch.proc.send_signal(signal.SIGINT)
            code = launch.wait(60)
            # 130, or Python's own exit by the signal (-2, which a shell also shows as 130): seen once, with
            # "psctl launch: interrupted" said, on a machine loaded by a second test process.
            assert code in (128 + signal.SIGINT, -signal.SIGINT), launch.text()
            if "psctl launch:" not in launch.text():  # still starting (a loaded machine): nothing ran
                assert launch.text() in ("", "psctl: interrupted\n"), launch.text()
    from psgrid.psserver.state import checkpoint_files as checkpoint

    kept = [checkpoint.read_manifest(checkpoint.shard_dir(tmp_path / "ckpt", i, 2)) for i in (0, 1)]
    with Launch(
        tmp_path, "--no-progress", "--resume", str(out), "--set", "stragglers=[]", log="launch-last.log"
    ) as last:
        assert last.wait(240) == 0, last.text()
    summary = summary_of(out)
    assert summary["status"] == "ok"
    for s in summary["shard_stats"]:
        assert s["min_clock"] == steps, s  # every round of the job closed on every shard
    attempts = sorted((out / "attempts").iterdir())
    # Each resume that began moved the attempt before it aside; one stopped while still starting did not.
    began = sum("psctl launch:" in (tmp_path / f"launch-{n}.log").read_text() for n in range(1, ATTEMPTS)) + 1
    assert 0 < len(attempts) <= began
    for rank in (0, 1):  # the steps of all attempts together reach the job's last step
        last_steps = [e["step"] for folder in [*attempts, out] for e in worker_events(folder, rank, "step")]
        assert max(last_steps) == steps - 1
    # The last attempt made only what was left: none of the rounds its shards restored. On a loaded machine
    # every Ctrl-C may land before the first trained round was checkpointed: then the shards restore their
    # initial weights (version 0, round 0) or nothing, and the last attempt makes all of it.
    # (A worker resumes at the earliest clock a shard has for it.)
    restored = summary["resumed"] or []
    resumed_at = min((c["clocks"].get("0", c["closed_rounds"]) for c in restored), default=0)
    assert summary["worker_results"][0]["steps"] == steps - resumed_at, (restored, summary["worker_results"])
    if not all(kept):
        assert "the job starts from the beginning" in last.text(), last.text()
    assert summary["test_accuracy"] > 0.85


def _final_clocks(ckpt, shards: int) -> list[dict[int, int]]:
    """Per shard, the clock of every worker in its latest checkpoint (live or departed)."""
    from psgrid.psserver.state import checkpoint_files as checkpoint

    found = []
    for i in range(shards):
        directory = checkpoint.shard_dir(ckpt, i, shards)
        meta = checkpoint.load_meta(directory / checkpoint.read_manifest(directory)["file"])
        found.append({int(w): c for w, c in {**meta["departed"], **meta["clocks"]}.items()})
    return found


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_resume_from_shards_checkpointed_rounds_apart_finishes_in_every_mode(tmp_path, mode):
    # A finished job, then shard 1 goes back to its oldest kept checkpoint, as if it could not write
    # the later ones: it is 10 rounds (sync) or 10 pushes (async, ssp) behind shard 0.
    from psgrid.psserver.state import checkpoint_files as checkpoint

    steps, ckpt = 60, tmp_path / "ckpt"
    args = [
        *MNIST,
        # Longer leases than MNIST's 2 s: a worker evicted on a loaded machine rejoins ahead of the shard
        # that evicted it, whose missed pushes are lost updates (seen once: 3 in ssp) that this test is not about.
        "--lease-s",
        "10",
        "--mode",
        mode,
        "--staleness",
        "2",
        "--shards",
        "2",
        "--steps",
        str(steps),
        "--set",
        f"checkpoint_dir={ckpt}",
        "--set",
        "checkpoint_every=5",
    ]
    with Launch(tmp_path, *args, log="first.log") as first:
        assert first.wait(120) == 0, first.text()
    behind = checkpoint.shard_dir(ckpt, 1, 2)
    files = sorted(p.name for p in behind.glob("ckpt-*.npz"))
    oldest = checkpoint.load_meta(behind / files[0])["version"]
    (behind / checkpoint.MANIFEST).write_text(json.dumps({"file": files[0], "version": oldest}))
    for name in files[1:]:
        (behind / name).unlink()
    with Launch(tmp_path, "--no-progress", "--resume", str(tmp_path / "run"), log="resume.log") as resumed:
        code = resumed.wait(150)  # it hung here: shard 1 waited for rounds nobody pushed
        text = resumed.text()
    assert code == 0, text
    summary = summary_of(resumed.out)
    stats = summary["shard_stats"]
    assert summary["status"] == "ok" and summary["lost_updates"] == 0, text
    assert all(w["completed"] for w in summary["worker_results"])
    # every worker reached the job's last step on every shard, and each shard applied every step once
    assert _final_clocks(ckpt, 2) == [{0: steps, 1: steps}] * 2
    assert stats[0]["version"] == stats[1]["version"], (stats, text)
    if mode == "sync":
        # both shards went back to the round shard 1 had: one model, nothing taken as a duplicate
        assert [s["min_clock"] for s in stats] == [steps, steps]
        assert [s["restored_version"] for s in stats] == [steps - 10] * 2
        assert sum(s["duplicates"] for s in stats) < 20, stats  # not the 2 x 10 replayed pushes (a retry may be one)
        assert f"every shard resumes at round {steps - 10}, where the slowest stopped" in text
        aside = tmp_path / "run" / "attempts" / "1" / "superseded-checkpoints" / "shard-0-of-2"
        assert sorted(p.name for p in aside.iterdir()) == [f"ckpt-{v:012d}.npz" for v in (steps - 5, steps)]
    else:
        # each worker resumed at shard 1's clock for it; shard 0 took the 10 pushes it had as duplicates
        assert [s["restored_version"] for s in stats] == [2 * steps, oldest]
        assert [s["duplicates"] for s in stats] == [2 * steps - oldest, 0]
    # A sanity bar, not the test's point: 60 async steps after a resume scatter widely (0.68 to 0.90 in
    # 20 runs at load 3 to 13, 0.77 on the tree before the layout change too); sync gives 0.889 every time.
    assert summary["test_accuracy"] > (0.6 if mode == "async" else 0.8)


# ----- resume: what is checked before anything starts ----------------------------------------------


def _job(tmp_path, shards=2, mode="sync", ckpt=True):
    from psgrid.cluster.job.config import job_from_dict

    server = {"mode": mode, **({"checkpoint_dir": str(tmp_path / "ckpt")} if ckpt else {})}
    return job_from_dict({"job": {"shards": shards, "out": str(tmp_path / "run")}, "server": server})


def _fake_checkpoint(tmp_path, shard, of, version, mode="sync", spec="S"):
    from psgrid.psserver.state import checkpoint_files as checkpoint

    meta = {
        "version": version,
        "mode": mode,
        "spec": spec,
        "clocks": {"0": version, "1": version},
        "closed_rounds": version,
    }
    checkpoint.save(checkpoint.shard_dir(tmp_path / "ckpt", shard, of), {"w": np.zeros(2)}, meta)


def test_resume_refuses_checkpoints_that_do_not_belong_together(tmp_path):
    from psgrid.cluster.errors import UsageError
    from psgrid.cluster.run.resume import align, check_resumable, describe

    with pytest.raises(UsageError, match="ran without checkpoints. Set \\[server\\] checkpoint_dir"):
        check_resumable(_job(tmp_path, ckpt=False), tmp_path / "run")
    assert check_resumable(_job(tmp_path), tmp_path / "run") == []  # stopped before any: from the start
    early = tmp_path / "early"  # stopped in its first second: one shard had its initial weights
    _fake_checkpoint(early, 0, 2, 0)
    assert check_resumable(_job(early), early / "run") == []
    _fake_checkpoint(tmp_path, 0, 2, 40)
    with pytest.raises(UsageError, match=r"shard\(s\) \[1\] have no checkpoint .* shard 0 at version 40 \(round 40\)"):
        check_resumable(_job(tmp_path), tmp_path / "run")
    _fake_checkpoint(tmp_path, 1, 2, 39)
    found = check_resumable(_job(tmp_path), tmp_path / "run")
    assert [c.version for c in found] == [40, 39]
    assert (
        "shard(s) [0] keep no checkpoint of round 39 (rounds kept: shard 0: 40; shard 1: 39), and no round is "
        "kept by all of them"
    ) in describe(align(_job(tmp_path), found))
    with pytest.raises(UsageError, match="written in mode 'sync', the job says 'async'"):
        check_resumable(_job(tmp_path, mode="async"), tmp_path / "run")
    with pytest.raises(UsageError, match="for another number of shards"):
        check_resumable(_job(tmp_path, shards=3), tmp_path / "run")
    _fake_checkpoint(tmp_path, 1, 2, 41, spec="other")
    with pytest.raises(UsageError, match="hold different models"):
        check_resumable(_job(tmp_path), tmp_path / "run")


def test_resume_brings_sync_shards_ahead_back_to_the_round_of_the_slowest(tmp_path):
    from psgrid.cluster.run.resume import align, check_resumable, describe, rewind
    from psgrid.psserver.state import checkpoint_files as checkpoint

    out = tmp_path / "run"
    for version in (30, 35, 40):
        _fake_checkpoint(tmp_path, 0, 2, version)
    for version in (25, 30, 35):
        _fake_checkpoint(tmp_path, 1, 2, version)
    assert align(_job(tmp_path, mode="async"), check_resumable(_job(tmp_path), out)).rewound == []  # clocks only
    job = _job(tmp_path)
    alignment = align(job, check_resumable(job, out))
    assert [(c.shard, c.closed_rounds) for c in alignment.restore] == [(0, 35), (1, 35)]
    assert "every shard resumes at round 35, where the slowest stopped" in describe(alignment)
    rewind(job, alignment, out)
    ahead = checkpoint.shard_dir(tmp_path / "ckpt", 0, 2)
    assert checkpoint.read_manifest(ahead) == {"file": "ckpt-000000000035.npz", "version": 35}
    assert sorted(p.name for p in ahead.glob("ckpt-*")) == ["ckpt-000000000030.npz", "ckpt-000000000035.npz"]
    assert [p.name for p in (out / "superseded-checkpoints" / ahead.name).iterdir()] == ["ckpt-000000000040.npz"]
    again = align(job, check_resumable(job, out))
    assert [c.version for c in again.restore] == [35, 35] and again.rewound == []
    assert describe(again).endswith("shard 1 at version 35 (round 35)")  # nothing left to reconcile
    # Shard 1 stopped at a round shard 0 did not keep: going back to 30 would redo 5 rounds the job has.
    _fake_checkpoint(tmp_path, 1, 2, 37)
    _fake_checkpoint(tmp_path, 0, 2, 38)
    alignment = align(job, check_resumable(job, out))
    assert [c.version for c in alignment.restore] == [38, 37] and alignment.rewound == []
    assert (
        "shard(s) [0] keep no checkpoint of round 37 (rounds kept: shard 0: 30, 35, 38; shard 1: 30, 35, 37), "
        "and going back to round 35, the latest all of them kept, would redo 2 round(s)"
    ) in describe(alignment)


def test_a_checkpoint_newer_than_the_manifest_is_not_kept(tmp_path):
    from psgrid.psserver.state import checkpoint_files as checkpoint

    for version in (1, 2, 3):
        checkpoint.save(tmp_path, {"w": np.zeros(1)}, {"version": version})
    (tmp_path / checkpoint.MANIFEST).write_text(json.dumps({"file": "ckpt-000000000002.npz", "version": 2}))
    assert [p.name for p in checkpoint.kept(tmp_path)] == ["ckpt-000000000002.npz", "ckpt-000000000001.npz"]
    with pytest.raises(FileNotFoundError, match="keeps no checkpoint of version 7"):
        checkpoint.rewind(tmp_path, 7, tmp_path / "aside")
    assert checkpoint.read_manifest(tmp_path)["version"] == 2  # a refused rewind changes nothing


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_completed_job_is_not_resumed_unless_given_further_to_go(tmp_path, capsys, monkeypatch):
    """Resumed as it was, a completed job made no step and put a summary of 0 steps in place of the real one."""
    from psgrid.cluster.cli import main

    args = [*MNIST, "--steps", "30", "--set", f"checkpoint_dir={tmp_path / 'ckpt'}", "--set", "checkpoint_every=10"]
    with Launch(tmp_path, *args) as first:
        assert first.wait(120) == 0, first.text()
    done = summary_of(first.out)
    monkeypatch.chdir(tmp_path)
    assert main(["launch", "--resume", str(first.out)]) == 2
    err = capsys.readouterr().err
    assert "every worker is at the job's last step (30) in the shards' checkpoints" in err and err.count("\n") == 1
    assert summary_of(first.out) == done and not (first.out / "attempts").exists()
    with Launch(tmp_path, "--no-progress", "--resume", str(first.out), "--steps", "45", log="more.log") as more:
        assert more.wait(120) == 0, more.text()
    summary = summary_of(first.out)
    # the 15 steps more, to clock 45 on every shard (a worker that joins rounds late is moved on: fewer of its own)
    assert summary["status"] == "ok" and 15 <= summary["steps"] <= 2 * 15, summary["worker_results"]
    assert all(s["min_clock"] == 45 for s in summary["shard_stats"]), summary["shard_stats"]
    assert (first.out / "attempts" / "1" / "summary.json").exists()


def test_resume_cli_errors_name_the_fix(tmp_path, capsys):
    from psgrid.cluster.cli import main

    assert main(["launch", "--resume", str(tmp_path)]) == 2
    assert "no job.toml there; give the folder of an earlier psctl launch" in capsys.readouterr().err
    (tmp_path / "job.toml").write_text("[job]\nworkers = 1\n")
    assert main(["launch", "--resume", str(tmp_path), "--config", "mnist"]) == 2
    assert "leave out --config" in capsys.readouterr().err
    assert main(["launch", "--resume", str(tmp_path)]) == 2
    assert "its job ran without checkpoints" in capsys.readouterr().err


# psctl whose every open of a job.toml for writing takes SECONDS more (as under strace delaying its openat):
# the moment after the open, where a rewrite in place had already emptied the file, lasts.
SLOW_JOB_WRITE = """
import os, sys, time
real_open = os.open
def slow_open(path, flags, *args, **kwargs):
    fd = real_open(path, flags, *args, **kwargs)
    if "job.toml" in os.path.basename(os.fsdecode(path)) and flags & (os.O_WRONLY | os.O_RDWR):
        print("writing job.toml", file=sys.stderr, flush=True)
        time.sleep(float(sys.argv[1]))
    return fd
os.open = slow_open
from psgrid.cluster.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT])
def test_a_launcher_stopped_while_it_rewrites_job_toml_leaves_the_job_resumable(tmp_path, sig):
    from psgrid.cluster.job.config import load_job
    from psgrid.cluster.run.resume import check_resumable

    out = tmp_path / "run"
    out.mkdir()
    (out / "job.toml").write_text(_job(tmp_path).to_toml())
    for shard in (0, 1):
        _fake_checkpoint(tmp_path, shard, 2, 40)
    log = tmp_path / "resume.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [sys.executable, "-c", SLOW_JOB_WRITE, "2", "launch", "--resume", str(out), "--no-progress"],
            cwd=ROOT,
            env=launch_env(),
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        wait_for(lambda: "writing job.toml" in log.read_text() or proc.poll() is not None, 60, "the rewrite")
        assert proc.poll() is None, log.read_text()
        proc.send_signal(sig)  # SIGINT is held until the new job.toml is in place, then stops the launcher
        code = proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    assert code == (-sig if sig == signal.SIGKILL else 128 + sig), log.read_text()
    job = load_job(str(out / "job.toml"), redacted_ok=True)
    assert job.server.checkpoint_dir == str(tmp_path / "ckpt"), (out / "job.toml").read_text()
    assert [c.version for c in check_resumable(job, out)] == [40, 40]
