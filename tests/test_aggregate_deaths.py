"""A host's aggregation survives the kill -9 of one of its workers, end to end through ``psctl launch``.

Two workers on one host (``aggregate = "host"``: the shards see one worker, the host's leader). A
dead follower is left out of the host's sum; when the leader dies the follower goes on as a worker
of its own, after the shards' lease of the leader. Either way the job completes, as the failure
contract says it does for a dead worker (docs/reliability.md). Every process is ended by its pid.
"""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.support import Launch, child_pids, steps_seen

STEPS = 600
JOB = [
    "--config",
    "mnist",
    "--eval-every",
    "0",
    "--no-progress",
    "--lease-s",
    "2",
    "--workers",
    "2",
    "--steps",
    str(STEPS),
    "--set",
    "train.aggregate=host",
]


def records(out, rank: int, kind: str) -> list[dict]:
    path = out / "metrics" / f"worker-{rank}.jsonl"
    return [e for e in map(json.loads, path.read_text().splitlines()) if e.get("event") == kind]


@pytest.mark.slow
@pytest.mark.timeout(150)
# (a leader leaving in async is tests/test_aggregate.py's, in one process: no lease to wait for there)
@pytest.mark.parametrize(
    ("victim", "mode"), [(1, "sync"), (1, "async"), (0, "sync")], ids=["follower-sync", "follower-async", "leader-sync"]
)
def test_a_killed_worker_of_an_aggregating_host_leaves_the_job_completing(tmp_path, mode, victim):
    with Launch(tmp_path, *JOB, "--mode", mode) as launch:
        launch.wait_for(lambda: steps_seen(launch.out, victim) >= 20, 60, f"worker {victim} training")
        pid = child_pids(launch.out)["workers"][victim]
        os.kill(pid, signal.SIGKILL)
        code = launch.wait(120)
        text = launch.text()
    assert code == 0, text
    summary = json.loads((launch.out / "summary.json").read_text())
    (failure,) = summary["failures"]
    assert (failure["name"], failure["pid"], failure["exit_code"], failure["tolerated"]) == (
        f"worker {victim}",
        pid,
        -9,
        True,
    )
    survivor = 1 - victim
    result = summary["worker_results"][survivor]
    assert (result["completed"], result["steps"]) == (True, STEPS), result
    steps = records(launch.out, survivor, "step")
    assert len(steps) == STEPS and {s["outcome"] for s in steps[-10:]} <= {"APPLIED", "ACCUMULATED"}
    log = (launch.out / "logs" / f"worker-{survivor}.log").read_text()
    assert "Traceback" not in log, log
    if victim == 0:  # the follower went on as a worker of its own: a new id, its own plane to the shards
        assert "it pushes to the shards on its own from now on" in log, log
        assert steps[0]["worker"] == 0 and steps[-1]["worker"] != 0
    else:  # the leader went on alone, its pushes applied
        assert "the worker of local rank 1" in log and "the host goes on without it" in log, log
        assert {s["worker"] for s in steps} == {0}
    assert summary["test_accuracy"] > 0.8, summary["test_accuracy"]
