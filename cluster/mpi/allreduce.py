"""``psctl allreduce``: a job trained with no shards, gradients averaged by MPI Allreduce.

The baseline that ``psctl compare`` measures the parameter-server modes against (see
:mod:`psgrid.worker.allreduce`). Every rank is a worker; rank 0 also evaluates the final weights
and writes ``OUT/summary.json`` and ``OUT/metrics.jsonl`` with the fields ``psctl launch`` writes
(``mode`` is ``allreduce``, ``shards`` is 0), so one reader serves both.

As in :mod:`psgrid.cluster.mpi.job`: an exception on any rank prints the rank and host and aborts the
job, and the communicator is a parameter.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path

from psgrid.cluster.run import coordinator as co
from psgrid.cluster.job.config import JobConfig, apply_overrides
from psgrid.cluster.errors import UsageError
from psgrid.cluster.mpi.job import _abort
from psgrid.cluster.mpi.mpich_shm import unlink_init_shm
from psgrid.cluster.run.procs import limit_blas_threads, usable_cpus
from psgrid.psserver import files

TAG_RESULT = 72


class ProgressThread:
    """Rank 0 trains too: a thread follows every rank's metrics file for the progress bar."""

    def __init__(self, job: JobConfig, paths: list[Path], enabled: bool | None):
        self.state = co.JobState()
        self.tail = co.MetricsTail(paths)
        self.progress = co.Progress(co.total_steps(job), enabled, desc=f"{job.name} allreduce")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="psctl-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.progress.update(self.state, self.state.update(self.tail.read()))

    def close(self) -> co.JobState:
        self._stop.set()
        self._thread.join(timeout=5.0)
        self.progress.update(self.state, self.state.update(self.tail.read()))
        self.progress.close()
        return self.state


def run_allreduce(job: JobConfig, comm=None, *, progress: bool | None = None, quiet: bool = False,
                  ranks: int | None = None) -> int:
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
    try:
        if world:   # the job is ours: leave no MPICH file in /dev/shm, however it ends
            unlink_init_shm(comm)
        if ranks is not None and comm.Get_size() != ranks:
            print(f"psctl allreduce: error: expected {ranks} ranks, this job has {comm.Get_size()}; is this "
                  f"mpiexec from the MPI that mpi4py uses? (mpi4py: {_mpi_library()})", file=sys.stderr, flush=True)
            return 2
        return _run(job, comm, progress, quiet)
    except BaseException:
        print(f"psctl allreduce: rank {rank} on {socket.gethostname()} failed; aborting the job:\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        _abort(comm)
        raise  # not reached: Abort ends the process


def _mpi_library() -> str:
    from mpi4py import MPI

    return MPI.Get_library_version().splitlines()[0].strip("\x00 ")


def _run(job: JobConfig, comm, progress: bool | None, quiet: bool) -> int:
    from psgrid.worker.allreduce import AllreduceExchange
    from psgrid.worker.evaluate import evaluate_weights
    from psgrid.worker.loop import build, train_loop

    rank, size = comm.Get_rank(), comm.Get_size()
    try:
        job = apply_overrides(job, {"workers": size})
    except UsageError as e:
        if rank == 0:
            print(f"psctl allreduce: error: {e}", file=sys.stderr, flush=True)
        return 2
    limit_blas_threads(max(1, usable_cpus() // size))
    out, error = None, None
    if rank == 0:
        try:
            from psgrid.cluster.run.launch import prepare_out

            out = str(prepare_out(job))
        except UsageError as e:
            error = str(e)
    out, error = comm.bcast((out, error), root=0)
    if error:
        if rank == 0:
            print(f"psctl allreduce: error: {error}", file=sys.stderr, flush=True)
        return 2
    out = Path(out)
    metrics_files = [out / "metrics" / f"worker-{r}.jsonl" for r in range(size)]
    t0 = time.monotonic()
    follower = None
    if rank == 0:
        files.write_text(out / "job.toml", f"# resolved job, as run by psctl allreduce\n{job.to_toml()}")
        if not quiet:
            print(f"psctl allreduce: {size} worker(s), no shards; output in {out}", file=sys.stderr, flush=True)
        follower = ProgressThread(job, metrics_files, progress)

    train = job.train
    train.validate()
    os.environ.setdefault("LOCAL_RANK", str(rank))
    xp, device_name, data, model = build(train, rank, size)
    init = model.spec.pack(model.init_params(train.seed, train.init_scale))
    exchange = AllreduceExchange(comm, init, job.server, train.wire_dtype)
    result = train_loop(train, exchange, rank, xp, device_name, data, model, str(metrics_files[rank]))
    result["wait_s"] = exchange.wait_s
    events = co.MetricsTail([metrics_files[rank]]).read()   # rank 0 may not see this node's files
    results = comm.gather({"result": result, "events": events}, root=0)
    if rank != 0:
        return 0

    follower.close()
    worker_events = [e for r in results for e in r["events"]]
    state = co.JobState()
    state.update(worker_events)
    for r in results:
        state.done[r["result"]["rank"]] = {"event": "done", **r["result"]}
    evaluation = evaluate_weights(train, exchange.weights, version=exchange.clock)
    summary = co.build_summary(
        job, launcher="allreduce", status="ok", addresses=[], state=state, train_wall_s=None,
        total_wall_s=time.monotonic() - t0, evaluation=evaluation, shard_stats=[], failures=[],
        worker_exits={r: 0 for r in range(size)}, out=str(out))
    summary.update(mode="allreduce", shards=0, ranks=size,
                   wait_s_by_worker=[r["result"]["wait_s"] for r in sorted(results, key=lambda r: r["result"]["rank"])])
    co.merge_metrics([worker_events], out / "metrics.jsonl")
    co.write_json(out / "summary.json", summary)
    if not quiet:
        print(co.headline(summary), flush=True)
        print(f"psctl allreduce: summary in {out / 'summary.json'}, metrics in {out / 'metrics.jsonl'}",
              file=sys.stderr, flush=True)
    return 0

