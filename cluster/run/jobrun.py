"""One job's lifecycle as its coordinator sees it, whoever starts the processes.

``psctl launch`` (cluster/run/launch.py), ``psgrid.LocalCluster`` (cluster/run/local.py), ``psctl mpi``'s
rank 0 (cluster/mpi/rank_zero.py), ``psctl allreduce``'s rank 0 (cluster/mpi/allreduce.py) and a job on
emulated hosts (cluster/hosts/job.py) run a job the same way: log its start, start the children, follow
the workers to their ends, evaluate and stop the shards; then, however it went, stop what still runs,
log the end, build ``summary.json``, merge ``metrics.jsonl``, write both and let go of the folder.
:meth:`JobRun.run` is that sequence, written once; each of them is a :class:`Backend` that says only
what differs: how its children start, how their ends are awaited, how the job is finished, and what
its summary reports.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol

from psgrid.cluster.errors import JobFailed
from psgrid.cluster.job.outdir import release
from psgrid.cluster.run import coordinator as co
from psgrid.cluster.run.interrupts import Interrupted, received_signal


class Backend(Protocol):
    """What one way of running a job says of its own; :meth:`JobRun.run` calls it in this order."""

    def start(self, run: JobRun) -> None:
        """Start the job's children (shards, then workers); returns once they run."""

    def follow(self, run: JobRun) -> float | None:
        """Wait until the workers have ended, folding their events into ``run``; returns the training wall
        time (None: the workers' own records give it)."""

    def finish(self, run: JobRun) -> None:
        """After training: evaluate, read the shards' counters and stop them (most call :meth:`JobRun.finish`)."""

    def stop(self, run: JobRun) -> None:
        """Stop whatever still runs, however the job ended (bounded by its own timeouts)."""

    def report(self, run: JobRun) -> dict:
        """The summary's fields of this backend's: ``addresses`` and ``worker_exits``, and ``sources`` or
        extra fields as :meth:`JobRun.end` takes them."""


class JobRun:
    """What a coordinator records of one job, from its start to its summary.

    Parameters
    ----------
    job : JobConfig
        The job as it runs (with its token and job id).
    out : Path
        Its output folder.
    launcher : str
        The summary's ``launcher``: ``launch``, ``local``, ``mpi``, ``allreduce`` or ``emulated``.
    command : list of str, optional
        The user's command each worker runs instead of the built-in trainer.
    log_events : bool
        Keep the coordinator's own event log (``OUT/metrics/coordinator.jsonl``); all-reduce has no
        coordinator apart from its workers, and none.
    """

    def __init__(self, job, out: Path, launcher: str, *, command: list[str] | None = None, log_events: bool = True):
        self.job = job
        self.out = Path(out)
        self.launcher = launcher
        self.command = command
        self.state = co.JobState()
        self.tail = co.MetricsTail()
        self.log = co.EventLog(self.out / "metrics" / "coordinator.jsonl") if log_events else None
        self.failures: list[dict] = []  # every child that failed, tolerated or not
        self.status, self.message = "ok", None
        self.evaluation: dict | None = None
        self.shard_stats: list[dict] = []
        self.train_wall_s: float | None = None  # as the backend's follow measured it
        self.final_summary: dict | None = None  # summary.json as :meth:`run` wrote it
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
        self.event(
            "job_start",
            name=job.name,
            mode=job.mode,
            shards=job.shards,
            workers=job.workers,
            shard_device=job.server.shard_device,
            out=str(self.out),
            **fields,
        )

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
        elif isinstance(error, KeyboardInterrupt):  # an MPI rank's signal (cluster/run/interrupts.py)
            self.status, self.message = "interrupted", f"stopped by {signal.Signals(received_signal()).name}"
        else:
            # Evaluation, stats or shutdown failing after training: the job did not complete cleanly.
            self.status, self.message = "failed", f"{type(error).__name__}: {error}"

    # -- the whole job -----------------------------------------------------------------------

    def run(self, backend: Backend, **start_fields) -> dict:
        """The whole job through ``backend``: start, follow, finish, then end however it went.

        ``start_fields`` go to the ``job_start`` event. Returns the summary.

        Raises
        ------
        JobFailed, Interrupted, KeyboardInterrupt
            What ended the job, once its summary is written; any other exception is a JobFailed whose
            message is the summary's.
        """
        self.start(**start_fields)
        return self._until_end(
            backend,
            [lambda: backend.start(self), lambda: self._follow(backend), lambda: backend.finish(self)],
            end=True,
        )

    def begin(self, backend: Backend, **start_fields) -> None:
        """:meth:`run`'s start alone (a start that fails ends the job, as in :meth:`run`).

        ``psgrid.LocalCluster`` begins when it is made and concludes when it is closed.
        """
        self.start(**start_fields)
        self._until_end(backend, [lambda: backend.start(self)], end=False)

    def conclude(self, backend: Backend) -> dict:
        """:meth:`run` after its start: follow, finish, end. Returns the summary."""
        return self._until_end(backend, [lambda: self._follow(backend), lambda: backend.finish(self)], end=True)

    def _follow(self, backend: Backend) -> None:
        self.train_wall_s = backend.follow(self)

    def _until_end(self, backend: Backend, steps: list, *, end: bool) -> dict | None:
        """Take ``steps``; the job ends after them if ``end``, and at once if one raises (which is raised on).

        The end is in ``finally``: a signal that lands anywhere in between still stops the children.
        """
        failed = True
        try:
            for step in steps:
                step()
            failed = False
        except BaseException as e:
            self.ended_by(e)
            if isinstance(e, Exception) and not isinstance(e, (JobFailed, Interrupted)):
                raise JobFailed(self.message) from e
            raise
        finally:
            if end or failed:
                self._end_with(backend)
        return self.final_summary

    def _end_with(self, backend: Backend) -> None:
        try:
            backend.stop(self)
        finally:
            # What the stopped workers wrote after the follow's last read (an interrupt ends it between two)
            # counts too: the summary is built from this state, and metrics.jsonl merges every line.
            self.refresh()
            self.final_summary = self.end(train_wall_s=self.train_wall_s, **backend.report(self))
            release(self.out)  # the job is over: the folder may be taken again

    # -- at the end --------------------------------------------------------------------------

    def summary(
        self,
        *,
        addresses: list[str],
        worker_exits: dict[int, int | None],
        train_wall_s: float | None,
        status: str | None = None,
        message: str | None = None,
        shard_stats: list[dict] | None = None,
        restarts: list[dict] | None = None,
        resumed: list[dict] | None = None,
        **extra,
    ) -> dict:
        """summary.json as it stands (``status``, ``message`` and ``shard_stats`` default to the recorded ones).

        ``extra`` fields are set after the common ones (``mode="allreduce"``, ``ranks=N``), then ``command``.
        """
        summary = co.build_summary(
            self.job,
            launcher=self.launcher,
            status=status or self.status,
            message=self.message if status is None else message,
            addresses=addresses,
            state=self.state,
            train_wall_s=train_wall_s,
            total_wall_s=time.monotonic() - self.t0,
            evaluation=self.evaluation,
            shard_stats=self.shard_stats if shard_stats is None else shard_stats,
            failures=self.failures,
            worker_exits=worker_exits,
            out=str(self.out),
            restarts=restarts,
            resumed=resumed,
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
