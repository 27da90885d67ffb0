"""``psctl allreduce``: a job trained with no shards, gradients averaged by MPI Allreduce.

The baseline that ``psctl compare`` measures the parameter-server modes against (see
:mod:`psgrid.worker.allreduce`). Every rank is a worker; rank 0 also evaluates the final weights
and writes ``OUT/summary.json`` and ``OUT/metrics.jsonl`` with the fields ``psctl launch`` writes
(``mode`` is ``allreduce``, ``shards`` is 0), so one reader serves both.

With GPU workers the weights, the optimizer and the update stay on each rank's GPU and the sum
is NCCL's, or the host MPI's where ranks share a GPU (said in one line).

As in :mod:`psgrid.cluster.mpi.job`: an exception on any rank prints the rank and host and aborts the
job, and the communicator is a parameter.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import threading
import traceback
from pathlib import Path

from psgrid.cluster.errors import UsageError
from psgrid.cluster.job.config import JobConfig, apply_overrides
from psgrid.cluster.job.rate_schedule import scheduled
from psgrid.cluster.job.records import write_job_file
from psgrid.cluster.mpi.comm import abort, meet_after_signal
from psgrid.cluster.mpi.mpich_shm import unlink_init_shm
from psgrid.cluster.run import coordinator as co
from psgrid.cluster.run.interrupts import ignore_signals, note_signals, received_signal, signal_heard
from psgrid.cluster.run.jobrun import JobRun
from psgrid.cluster.run.procs import limit_blas_threads, usable_cpus

TAG_RESULT = 72


class ProgressThread:
    """Rank 0 trains too: a thread follows every rank's metrics file for the progress bar."""

    def __init__(self, run: JobRun, paths: list[Path], enabled: bool | None):
        self.state = co.JobState()
        self.tail = co.MetricsTail(paths)
        self.progress = run.progress(enabled, mode="allreduce")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="psctl-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.progress.update(self.state, self.state.update(self.tail.read()))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.progress.update(self.state, self.state.update(self.tail.read()))
        self.progress.close()


def run_allreduce(
    job: JobConfig, comm=None, *, progress: bool | None = None, quiet: bool = False, ranks: int | None = None
) -> int:
    """Run this rank's part of ``job`` as all-reduce data parallelism on ``comm`` (default COMM_WORLD).

    The number of ranks is the number of workers; with ``ranks``, any other number is an error
    (an ``mpiexec`` of another MPI than mpi4py's starts N separate one-rank jobs, each of which
    would train alone). Returns the exit code; any exception on any rank is printed with its rank
    and host and aborts the job.
    """
    world = comm is None
    if world:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    old = note_signals()  # Ctrl-C, which mpiexec passes to every rank: all stop at one step
    try:
        if world:  # the job is ours: leave no MPICH file in /dev/shm, however it ends
            unlink_init_shm(comm)
        if ranks is not None and comm.Get_size() != ranks:
            print(
                f"psctl allreduce: error: expected {ranks} ranks, this job has {comm.Get_size()}; is this "
                f"mpiexec from the MPI that mpi4py uses? (mpi4py: {_mpi_library()})",
                file=sys.stderr,
                flush=True,
            )
            return 2
        return _run(job, comm, progress, quiet)
    except KeyboardInterrupt:  # (SIGTERM under psctl compare --mpi) before the job's folder was known
        ignore_signals()
        return _stopped(comm, received_signal(), None)
    except BaseException:
        print(
            f"psctl allreduce: rank {rank} on {socket.gethostname()} failed; aborting the job:\n"
            f"{traceback.format_exc()}",
            file=sys.stderr,
            flush=True,
        )
        abort(comm)
        raise  # not reached: Abort ends the process
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _stopped(comm, signum: int, out, say: bool = True) -> int:
    """After Ctrl-C: the ranks meet once more, rank 0 says so in one line; returns 128 + ``signum``.

    Rank 0's summary (status ``interrupted``) is written as the job ends.
    """
    name = meet_after_signal(comm, signum, "psctl allreduce")
    if say and comm.Get_rank() == 0:
        where = f"; partial results in {out}" if out is not None else "; nothing had started"
        print(f"psctl allreduce: {name}: stopped every rank{where}", file=sys.stderr, flush=True)
    return 128 + signum


def _mpi_library() -> str:
    from mpi4py import MPI

    return MPI.Get_library_version().splitlines()[0].strip("\x00 ")


def _run(job: JobConfig, comm, progress: bool | None, quiet: bool) -> int:
    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        job = apply_overrides(job, {"workers": size})
    except UsageError as e:
        if rank == 0:
            print(f"psctl allreduce: error: {e}", file=sys.stderr, flush=True)
        return 2
    limit_blas_threads(max(1, usable_cpus() // size))
    out = _shared_out(job, comm)
    if out is None:
        return 2
    metrics_files = [out / "metrics" / f"worker-{r}.jsonl" for r in range(size)]
    try:
        if rank != 0:
            _train_and_gather(job, comm, metrics_files[rank])
            return 0
        # Every rank trains; rank 0 also follows the job and writes its summary (no event log of its own).
        run = JobRun(job, out, "allreduce", log_events=False)
        summary = run.run(RankZeroTrains(job, comm, metrics_files, progress, quiet))
    except KeyboardInterrupt:  # rank 0's summary (status interrupted) is written: the ranks stop together
        ignore_signals()
        return _stopped(comm, received_signal(), out, say=not quiet)
    if not quiet:
        print(co.headline(summary), flush=True)
        print(
            f"psctl allreduce: summary in {out / 'summary.json'}, metrics in {out / 'metrics.jsonl'}",
            file=sys.stderr,
            flush=True,
        )
    return 0


class RankZeroTrains:
    """``psctl allreduce``'s rank 0 as cluster/run/jobrun.py's Backend: one of the workers, and their coordinator.

    mpiexec started every rank, so starting is writing the job and following the metrics files for the
    progress bar; rank 0's own training ends when every rank's result is gathered, and the final weights
    (every rank holds them) are evaluated here. Nothing runs apart from the ranks, so nothing is stopped.
    """

    def __init__(self, job: JobConfig, comm, metrics_files: list[Path], progress: bool | None, quiet: bool):
        self.job, self.comm, self.metrics_files = job, comm, metrics_files
        self.progress, self.quiet = progress, quiet
        self.follower: ProgressThread | None = None
        self.exchange = None
        self.results: list[dict] = []  # every rank's result and events, in rank order

    def start(self, run: JobRun) -> None:
        write_job_file(run.out, self.job, "by psctl allreduce")
        if not self.quiet:
            print(
                f"psctl allreduce: {self.comm.Get_size()} worker(s), no shards; output in {run.out}",
                file=sys.stderr,
                flush=True,
            )
        self.follower = ProgressThread(run, self.metrics_files, self.progress)

    def follow(self, run: JobRun) -> None:
        self.exchange, self.results = _train_and_gather(self.job, self.comm, self.metrics_files[0])
        self.stop(run)
        return None  # the training time is the workers' own (first step to last end)

    def finish(self, run: JobRun) -> None:
        from psgrid.worker.evaluate import evaluate_weights

        run.refresh(events=self.events())
        for r in self.results:
            run.state.done[r["result"]["rank"]] = {"event": "done", **r["result"]}
        run.evaluation = evaluate_weights(run.job.train, self.exchange.host_weights(), version=self.exchange.clock)

    def stop(self, run: JobRun) -> None:
        if self.follower is not None:
            self.follower.close()
            self.follower = None

    def report(self, run: JobRun) -> dict:
        if not self.results:  # stopped before the results were gathered: the steps its files hold
            run.refresh(events=self.events())
        by_rank = sorted(self.results, key=lambda r: r["result"]["rank"])
        return {
            "sources": [self.events()],
            "addresses": [],
            "worker_exits": {r: 0 for r in range(len(self.results))},
            "mode": "allreduce",
            "shards": 0,
            "ranks": self.comm.Get_size(),
            "wait_s_by_worker": [r["result"]["wait_s"] for r in by_rank],
        }

    def events(self) -> list[dict]:
        """Every rank's events as gathered at the end; before that (a job stopped) each rank's file rank 0 sees."""
        if self.results:
            return [e for r in self.results for e in r["events"]]
        return co.MetricsTail([path for path in self.metrics_files if path.exists()]).read()


def _train_and_gather(job: JobConfig, comm, metrics: Path):
    """This rank's training, then every rank's result and events gathered on rank 0 (it may not see this
    node's files); returns the exchange and, on rank 0, the results (elsewhere None)."""
    exchange, result = _train(job, comm, metrics)
    events = co.MetricsTail([metrics]).read()
    return exchange, comm.gather({"result": result, "events": events}, root=0)


def _shared_out(job: JobConfig, comm) -> Path | None:
    """The output folder, prepared by rank 0 and told to every rank (None, said by rank 0: it cannot be)."""
    out, error = None, None
    if comm.Get_rank() == 0:
        try:
            from psgrid.cluster.run.launch import prepare_out

            out = str(prepare_out(job))
        except UsageError as e:
            error = str(e)
    out, error = comm.bcast((out, error), root=0)
    if error:
        if comm.Get_rank() == 0:
            print(f"psctl allreduce: error: {error}", file=sys.stderr, flush=True)
        return None
    return Path(out)


def allreduce_server(job: JobConfig):
    """The settings of the baseline's update: the job's server, with one update a step as in a sync round.

    So a rate's schedule runs over ``[train] steps``, whatever mode the job file names.
    """
    return scheduled(dataclasses.replace(job, server=dataclasses.replace(job.server, mode="sync"))).server


def _train(job: JobConfig, comm, metrics: Path):
    """This rank's part of the training, gradients averaged by Allreduce; returns the exchange and the result."""
    from psgrid.worker.allreduce import AllreduceExchange
    from psgrid.worker.loop import build, train_loop

    rank, size = comm.Get_rank(), comm.Get_size()
    train = job.train
    train.validate()
    os.environ.setdefault("LOCAL_RANK", str(rank))
    xp, device_name, data, model = build(train, rank, size)
    init = model.spec.pack(model.init_params(train.seed, train.init_scale))
    # on a GPU: kept there; the ranks stop together when one heard Ctrl-C (run_allreduce)
    exchange = AllreduceExchange(comm, init, allreduce_server(job), train.wire_dtype, xp=xp, heard=signal_heard)
    if rank == 0 and exchange.on_device and usable_cpus() == 1 < (os.cpu_count() or 1):
        # Open MPI binds each rank to one core; a GPU worker's batch loader thread then shares it with the
        # loop (20M MLP on an H100: 165,653 samples/s bound, 226,828 not; docs/performance.md).
        print(
            "psctl allreduce: note: this rank may use 1 core (mpiexec binds ranks to cores); a GPU worker "
            "trains faster with mpiexec --bind-to none",
            file=sys.stderr,
            flush=True,
        )
    result = train_loop(train, exchange, rank, xp, device_name, data, model, str(metrics))
    result["wait_s"] = exchange.wait_s
    return exchange, result
