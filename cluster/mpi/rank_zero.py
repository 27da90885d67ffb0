"""``psctl mpi``'s rank 0 as cluster/run/jobrun.py's Backend: the job's children are ranks, their ends messages.

mpiexec (or srun) started every rank, and the shard ranks serve before rank 0 begins, so starting is
saying so. Each worker rank sends its result and its events when done (rank 0 may not see that node's
files); rank 0 follows those messages for the progress bar, and the failures that ranks report before
the job aborts (cluster/mpi/report.py). The shards stop at the final evaluation's Shutdown; a job that
failed is aborted by the caller, so nothing is left to stop here.
"""

from __future__ import annotations

import sys
import time

from psgrid.cluster.errors import JobFailed
from psgrid.cluster.job.rate_schedule import derived_note, pushing_clients, scheduled
from psgrid.cluster.mpi import report as mpi_report
from psgrid.cluster.mpi.comm import POLL_S
from psgrid.cluster.mpi.placement import worker_hosts
from psgrid.cluster.run import script as user_script
from psgrid.cluster.run.jobrun import JobRun

TAG_DONE = 71  # a worker rank's result and events, sent to rank 0


class RankZero:
    """Rank 0 of ``part`` (a :class:`~psgrid.cluster.mpi.job.MPIJob` whose shards are serving)."""

    def __init__(self, part):
        self.part = part
        self.received: dict[int, list[dict]] = {}  # worker rank -> the events it sent with its results

    def start(self, run: JobRun) -> None:
        part, job = self.part, self.part.job
        run.event("shards_ready", addresses=part.addresses)
        model = f" of {part.model}" if part.model else ""  # a script's model is its own
        hosts = worker_hosts(part.placement)
        applied = scheduled(job, hosts=hosts).server.describe_optimizer(
            pushing_clients(job, hosts)
        )  # the shards' length
        print(
            f"psctl mpi: {part.size} ranks: coordinator on {part.hostname}, {job.shards} shard(s) at "
            f"{','.join(part.addresses)} applying {applied}, {job.workers} worker(s){model}; output in {part.out}",
            file=sys.stderr,
            flush=True,
        )
        if part.command and (note := derived_note(job)):  # a script's steps are its own
            print(f"psctl mpi: {note}", file=sys.stderr, flush=True)
        for r in range(job.workers):
            run.tail.add(part.out / "metrics" / f"worker-{r}.jsonl")

    def follow(self, run: JobRun) -> float:
        """The workers' results as they arrive, the progress bar, failures; returns the training wall time.

        Raises JobFailed when a rank reported a failure or ``timeout_s`` ran out.
        """
        from mpi4py import MPI

        comm, job = self.part.comm, self.part.job
        start, last_done = time.time(), None
        progress = run.progress(self.part.progress)
        try:
            st = MPI.Status()
            while len(self.received) < job.workers:
                while comm.iprobe(source=MPI.ANY_SOURCE, tag=TAG_DONE, status=st):
                    msg = comm.recv(source=st.Get_source(), tag=TAG_DONE)
                    self._received(run, self.part.placement.roles[st.Get_source()].index, msg)
                    last_done = time.time()
                # ranks that raised and said so before the abort (cluster/mpi/report.py)
                failed = mpi_report.failures_reported(comm)
                if failed:
                    run.failures.extend(failed)
                    raise JobFailed(mpi_report.describe(failed))
                run.refresh(progress)
                if job.timeout_s and time.monotonic() - run.t0 > job.timeout_s:
                    raise JobFailed(f"training did not finish within timeout_s = {job.timeout_s:g} s")
                time.sleep(POLL_S * 4)
            progress.update(run.state, [])
        finally:
            progress.close()
        return (last_done or time.time()) - start

    def _received(self, run: JobRun, wrank: int, msg: dict) -> None:
        self.received[wrank] = msg["events"]
        run.refresh(events=msg["events"])
        # a worker rank whose command failed (cluster/run/script.py)
        if user_script.record_failure(msg, run.failures, run.event, wrank):
            return
        run.state.done.setdefault(wrank, {"event": "done", **msg["result"]})
        run.event("worker_exit", rank=wrank, exit_code=0)

    def finish(self, run: JobRun) -> None:
        if self.part.command:
            user_script.check_completed(run.failures, self.part.job.workers)
        run.finish(self.part.addresses)
        if self.part.command:
            user_script.check_joined(run.state, run.failures)

    def stop(self, run: JobRun) -> None:
        """Nothing: the shards stopped at the evaluation's Shutdown, or the caller aborts the job."""

    def report(self, run: JobRun) -> dict:
        run.refresh()  # the lines the workers' files gained since the last look (a job stopped: its last steps)
        exits = {r: next((f.get("exit_code", 1) for f in run.failures if f["index"] == r), 0) for r in self.received}
        events = [e for sent in self.received.values() for e in sent]
        # A worker that sent none (the job was stopped, or it failed first): its file, where this node sees it
        # (its own node, or a shared file system), as the progress bar read it; an interrupted job kept 3 lines.
        unsent = [self.part.out / "metrics" / f"worker-{r}.jsonl" for r in range(self.part.job.workers)]
        unsent = [path for r, path in enumerate(unsent) if r not in self.received and path.exists()]
        return {
            "sources": [self.part.out / "metrics" / "coordinator.jsonl", events, *unsent],
            "addresses": self.part.addresses,
            "worker_exits": exits,
            "ranks": self.part.size,
        }
