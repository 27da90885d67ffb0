"""One job's lifecycle as its coordinator sees it, whoever starts the processes.

``psctl launch`` (cluster/run/launch.py), ``psgrid.LocalCluster`` (cluster/run/local.py), ``psctl mpi``'s
rank 0 (cluster/mpi/job.py) and ``psctl allreduce``'s rank 0 (cluster/mpi/allreduce.py) run a job the
same way: log its start, follow the workers' events for the progress bar, evaluate and stop the shards,
log its end, build ``summary.json``, merge ``metrics.jsonl`` and write both. :class:`JobRun` is that
sequence; each of them keeps only what differs: how the processes start, and how progress arrives.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Iterable

from psgrid.cluster.errors import JobFailed
from psgrid.cluster.run import coordinator as co
from psgrid.cluster.run.interrupts import Interrupted


class JobRun:
    """What a coordinator records of one job, from its start to its summary.

    Parameters
    ----------
    job : JobConfig
        The job as it runs (with its token and job id).
    out : Path
        Its output folder.
    launcher : str
        The summary's ``launcher``: ``launch``, ``local``, ``mpi`` or ``allreduce``.
    command : list of str, optional
        The user's command each worker runs instead of the built-in trainer.
    log_events : bool
        Keep the coordinator's own event log (``OUT/metrics/coordinator.jsonl``); all-reduce has no
        coordinator apart from its workers, and none.
    """

    def __init__(self, job, out: Path, launcher: str, *, command: list[str] | None = None,
                 log_events: bool = True):
        self.job = job
        self.out = Path(out)
        self.launcher = launcher
        self.command = command
        self.state = co.JobState()
        self.tail = co.MetricsTail()
        self.log = co.EventLog(self.out / "metrics" / "coordinator.jsonl") if log_events else None
        self.failures: list[dict] = []      # every child that failed, tolerated or not
        self.status, self.message = "ok", None
        self.evaluation: dict | None = None
        self.shard_stats: list[dict] = []
        self.t0 = time.monotonic()

    # -- while it runs -----------------------------------------------------------------------

    def event(self, kind: str, /, **fields) -> None:
        """One line of the coordinator's event log (none kept: nothing)."""
        if self.log is not None:
            self.log(kind, **fields)

    def start(self, **fields) -> None:
        """The job starts now (its total wall time counts from here)."""
        job = self.job
        self.t0 = time.monotonic()
        self.event("job_start", name=job.name, mode=job.mode, shards=job.shards, workers=job.workers,
                   shard_device=job.server.shard_device, out=str(self.out), **fields)

    def progress(self, enabled: bool | None, *, mode: str | None = None) -> co.Progress:
        """The progress bar over every worker's steps (no total for a script: its steps are its own)."""
        total = None if self.command else co.total_steps(self.job)
        return co.Progress(total, enabled, desc=f"{self.job.name} {mode or self.job.mode}")

    def refresh(self, progress=None, events: Iterable[dict] | None = None) -> list[dict]:
        """Fold the workers' new events (``events``, else those appended to their files) into the state."""
        evals = self.state.update(self.tail.read() if events is None else events)
        if progress is not None:
            progress.update(self.state, evals)
        return evals

    def finish(self, addresses: list[str], *, evaluate: bool = True, workers_evaluate: bool = False) -> None:
        """Evaluate the final weights, read the shards' counters and stop the shards.

        A script's workers evaluate as they see fit (``workers_evaluate`` for other workers that do, as a
        notebook's sessions): their latest evaluations are the job's. ``evaluate=False`` skips the
        evaluation (the job did not end well).
        """
        from psgrid.cluster.run import script as user_script

        if self.command or workers_evaluate:
            self.evaluation, self.shard_stats = user_script.finish(self.job, addresses, self.state)
        else:
            self.evaluation, self.shard_stats = co.finish(self.job, addresses, evaluate=evaluate)
        self.event("final_eval", **(self.evaluation or {}))
        for s in self.shard_stats:
            self.event("shard_stats", **s)

    def ended_by(self, error: BaseException) -> None:
        """Record the status and one-line message of the exception that ended the job."""
        if isinstance(error, JobFailed):
            self.status, self.message = error.status, str(error)
        elif isinstance(error, Interrupted):
            self.status, self.message = "interrupted", f"stopped by {error}"
        else:
            # Evaluation, stats or shutdown failing after training: the job did not complete cleanly.
            self.status, self.message = "failed", f"{type(error).__name__}: {error}"

    # -- at the end --------------------------------------------------------------------------

    def summary(self, *, addresses: list[str], worker_exits: dict[int, int | None], train_wall_s: float | None,
                status: str | None = None, message: str | None = None, shard_stats: list[dict] | None = None,
                restarts: list[dict] | None = None, resumed: list[dict] | None = None, **extra) -> dict:
        """summary.json as it stands (``status``, ``message`` and ``shard_stats`` default to the recorded ones).

        ``extra`` fields are set after the common ones (``mode="allreduce"``, ``ranks=N``), then ``command``.
        """
        summary = co.build_summary(
            self.job, launcher=self.launcher, status=status or self.status,
            message=self.message if status is None else message, addresses=addresses, state=self.state,
            train_wall_s=train_wall_s, total_wall_s=time.monotonic() - self.t0, evaluation=self.evaluation,
            shard_stats=self.shard_stats if shard_stats is None else shard_stats, failures=self.failures,
            worker_exits=worker_exits, out=str(self.out), restarts=restarts, resumed=resumed,
        )
        summary.update(extra)
        if self.command:
            summary["command"] = self.command
        return summary

    def end(self, *, sources: list | None = None, **summary_fields) -> dict:
        """Log the end, then write ``summary.json`` and ``metrics.jsonl``; returns the summary.

        ``sources`` are merged into ``metrics.jsonl`` (files or lists of events; default: every file in
        ``OUT/metrics``); ``summary_fields`` go to :meth:`summary`.
        """
        self.event("job_end", status=self.status, message=self.message)
        self.close()
        summary = self.summary(**summary_fields)
        if sources is None:
            sources = sorted((self.out / "metrics").glob("*.jsonl"))
        co.merge_metrics(sources, self.out / "metrics.jsonl")
        co.write_json(self.out / "summary.json", summary)
        return summary

    def close(self) -> None:
        """Close the event log (again: nothing)."""
        if self.log is not None:
            self.log.close()
