"""JobRun.run (cluster/run/jobrun.py): the one job lifecycle, over a backend that only records what it is asked.

launch, LocalCluster, psctl mpi's and psctl allreduce's rank 0 and emulated hosts are such backends; their
own tests run them whole. These run in this process, with no child, fast.
"""

from __future__ import annotations

import json
import signal

import pytest

from psgrid.cluster.errors import JobFailed
from psgrid.cluster.job.config import job_from_dict
from psgrid.cluster.run.interrupts import Interrupted, received_signal
from psgrid.cluster.run.jobrun import JobRun

STEPS = ["start", "follow", "finish"]
ENDING = ["stop", "report"]


class Recording:
    """A backend that records each call and raises ``error`` in the step named ``fail_in``."""

    def __init__(self, fail_in: str | None = None, error: BaseException | None = None):
        self.calls: list[str] = []
        self.fail_in, self.error = fail_in, error

    def _step(self, name: str) -> None:
        self.calls.append(name)
        if name == self.fail_in:
            raise self.error

    def start(self, run):
        self._step("start")

    def follow(self, run):
        self._step("follow")
        return 1.5

    def finish(self, run):
        self._step("finish")

    def stop(self, run):
        self.calls.append("stop")

    def report(self, run):
        self.calls.append("report")
        return {"addresses": ["127.0.0.1:1"], "worker_exits": {0: 0}, "ranks": 3}


def _run(tmp_path) -> JobRun:
    return JobRun(job_from_dict({"job": {"workers": 1, "shards": 1}}), tmp_path, "launch")


def _events(tmp_path) -> list[str]:
    lines = (tmp_path / "metrics" / "coordinator.jsonl").read_text().splitlines()
    return [json.loads(line)["event"] for line in lines]


def test_a_job_starts_follows_finishes_then_stops_and_writes_what_its_backend_reports(tmp_path):
    backend = Recording()
    summary = _run(tmp_path).run(backend, ranks=3)
    assert backend.calls == STEPS + ENDING
    assert (summary["status"], summary["wall_s"], summary["addresses"], summary["ranks"]) == (
        "ok",
        1.5,
        ["127.0.0.1:1"],
        3,
    )
    assert json.loads((tmp_path / "summary.json").read_text()) == summary
    assert (tmp_path / "metrics.jsonl").is_file() and _events(tmp_path) == ["job_start", "job_end"]


@pytest.mark.parametrize("step", STEPS)
@pytest.mark.parametrize(
    "error, raised, status, message",
    [
        (JobFailed("a shard died"), JobFailed, "failed", "a shard died"),
        (JobFailed("never joined", status="not_joined"), JobFailed, "not_joined", "never joined"),
        (RuntimeError("evaluation broke"), JobFailed, "failed", "RuntimeError: evaluation broke"),
        (Interrupted(signal.SIGTERM), Interrupted, "interrupted", "stopped by SIGTERM"),
        (KeyboardInterrupt(), KeyboardInterrupt, "interrupted", None),  # the signal the rank heard, SIGINT if none
    ],
    ids=["failed", "user's mistake", "other error", "interrupted", "rank's signal"],
)
def test_a_step_that_raises_ends_the_job_there_with_its_summary_written(tmp_path, step, error, raised, status, message):
    backend = Recording(fail_in=step, error=error)
    with pytest.raises(raised) as caught:
        _run(tmp_path).run(backend)
    assert backend.calls == STEPS[: STEPS.index(step) + 1] + ENDING  # nothing after it, the end always
    summary = json.loads((tmp_path / "summary.json").read_text())
    message = message or f"stopped by {signal.Signals(received_signal()).name}"
    assert (summary["status"], summary["message"]) == (status, message)
    if raised is JobFailed and not isinstance(error, JobFailed):
        assert str(caught.value) == message and caught.value.__cause__ is error


def test_a_local_cluster_begins_when_made_and_concludes_when_closed(tmp_path):
    backend, run = Recording(), _run(tmp_path)
    run.begin(backend, launcher="local")
    assert backend.calls == ["start"] and not (tmp_path / "summary.json").exists()
    summary = run.conclude(backend)
    assert backend.calls == STEPS + ENDING and run.final_summary == summary and summary["status"] == "ok"


def test_a_start_that_fails_in_begin_ends_the_job_at_once(tmp_path):
    backend, run = Recording(fail_in="start", error=JobFailed("no address")), _run(tmp_path)
    with pytest.raises(JobFailed, match="no address"):
        run.begin(backend)
    assert backend.calls == ["start", *ENDING]
    assert run.final_summary["status"] == "failed" and (tmp_path / "summary.json").is_file()
