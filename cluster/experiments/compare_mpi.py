"""``psctl compare --mpi``: the same experiment under ``mpiexec`` or ``srun``, each run on a sub-communicator.

Every rank plans the same runs. For each one the first ranks split off a communicator of the
size that run needs and run it as ``psctl mpi`` (1 coordinator + S shards + W workers) or
``psctl allreduce`` (W ranks) would; the other ranks wait at a barrier. World rank 0 is rank 0 of
every run, so it coordinates each, and it writes the experiment's results and report.

As with ``psctl mpi``, an exception on any rank aborts the whole job; the runs that finished stay
in the output folder, and ``--resume`` runs the rest. Ctrl-C, which mpiexec passes to every rank,
stops the run under way as ``psctl mpi`` or ``psctl allreduce`` stops (its summary says
``interrupted``); the ranks meet once more and world rank 0 writes the finished runs' results and
report and says so in one line. (SIGTERM stops a shards' run so too; an all-reduce run's ranks leave
their collective at once, and the job may abort.)
"""

from __future__ import annotations

import sys

from psgrid.cluster.errors import UsageError
from psgrid.cluster.experiments.compare import Compare, prepare, table_text, write_results
from psgrid.cluster.experiments.experiment import Run
from psgrid.cluster.mpi.comm import meet_after_signal, wait_request
from psgrid.cluster.mpi.job import min_ranks
from psgrid.cluster.run.interrupts import ignore_signals, received_signal, signal_heard


def ranks_needed(run: Run, shards: int) -> int:
    return min_ranks(shards) - 1 + run.workers if run.mode.uses_shards else run.workers


class MPICompare(Compare):
    """Runs an Experiment on ``comm`` (default COMM_WORLD); :meth:`run` returns this rank's exit code."""

    def __init__(self, experiment, *, comm=None, resume: bool = False, progress: bool | None = None):
        super().__init__(experiment, resume=resume, progress=progress)
        if comm is None:
            from mpi4py import MPI

            comm = MPI.COMM_WORLD
        self.comm = comm

    def run(self) -> int:
        from mpi4py import MPI

        x, comm = self.x, self.comm
        rank, size = comm.Get_rank(), comm.Get_size()
        todo, error = None, None
        if rank == 0:
            need = max(ranks_needed(r, x.job.shards) for r in x.runs)
            try:
                if size < need:
                    raise UsageError(
                        f"psctl compare --mpi needs at least {need} ranks for its largest run "
                        f"(1 coordinator + {x.job.shards} shard(s) + {max(r.workers for r in x.runs)} "
                        f"workers); got {size}"
                    )
                todo = [r.id for r in prepare(x, self.resume)]
            except UsageError as e:
                error = str(e)
        todo, error = comm.bcast((todo, error), root=0)
        if error:
            if rank == 0:
                print(f"psctl compare: error: {error}", file=sys.stderr, flush=True)
            return 2
        if rank == 0:
            skipped = len(x.runs) - len(todo)
            print(
                f"psctl compare: {len(x.runs)} runs in {x.out} on {size} ranks"
                + (f" ({skipped} already finished, skipped)" if skipped else ""),
                file=sys.stderr,
                flush=True,
            )
        ending = None  # this rank's barrier at the end of a run, while it waits there
        try:
            for run in (r for r in x.runs if r.id in todo):
                sub = comm.Split(0 if rank < ranks_needed(run, x.job.shards) else MPI.UNDEFINED, rank)
                if sub != MPI.COMM_NULL:
                    try:
                        self.run_on(run, sub)
                    finally:
                        sub.Free()
                ending = comm.Ibarrier()
                wait_request(ending, None, f"the end of run {run.id}")
                ending = None
                if rank == 0:
                    self.record(run)
        except KeyboardInterrupt:
            ignore_signals()  # the rest is bounded by its own timeouts
            return self._stopped(ending, received_signal())
        if rank == 0:
            print(table_text(write_results(x), x.settings.get("target_accuracy")), flush=True)
        return 0

    def run_on(self, run: Run, sub) -> None:
        """One run on ``sub``; KeyboardInterrupt once a Ctrl-C stopped it (on every rank of ``sub``)."""
        job = self.x.run_job(run)
        if run.mode.uses_shards:
            from psgrid.cluster.mpi.job import MPIJob

            part = MPIJob(job, sub, progress=self.progress_enabled)
            try:
                part.run()
            except KeyboardInterrupt:
                ignore_signals()
                part.stop_interrupted(received_signal(), say=False)  # its ranks meet, its shard stops
                raise
        else:
            from psgrid.cluster.mpi.allreduce import run_allreduce

            code = run_allreduce(job, sub, progress=self.progress_enabled, quiet=True)
            # Its ranks stopped together at a step (worker/allreduce.py); or the Ctrl-C came after their last
            # look, and the run ended: it stops the experiment here, where the other ranks stop too.
            if code >= 128 or signal_heard() is not None:
                raise KeyboardInterrupt

    def _stopped(self, ending, signum: int) -> int:
        """After Ctrl-C: every rank meets once more (at the barrier it waited at, if it did), then rank 0 writes
        the finished runs' results and report; returns 128 + ``signum``."""
        x, comm = self.x, self.comm
        name = meet_after_signal(comm, signum, "psctl compare", waiting=ending)
        if comm.Get_rank() == 0:
            print(table_text(write_results(x), x.settings.get("target_accuracy")), flush=True)
            print(
                f"psctl compare: {name}: stopped every rank; the finished runs are in {x.out} "
                f"(psctl compare ... --resume finishes the rest)",
                file=sys.stderr,
                flush=True,
            )
        return 128 + signum
