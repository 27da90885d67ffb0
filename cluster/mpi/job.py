"""``psctl mpi``: a whole job under ``mpiexec`` or ``srun``, roles given by rank.

Rank 0 coordinates (progress, final evaluation, summary), S ranks each serve one shard
in-process, and every other rank is a worker. Which ranks serve and which train is decided by
:mod:`psgrid.cluster.mpi.placement` from every rank's host and GPUs: one worker per GPU on every node
(or a one-line error naming the numbers to run), ranks 1..S as the shards in a CPU job.
The shards bind port 0; their real addresses are gathered on rank 0 and broadcast.

Two habits from ``mpi4py.run`` and ``dask_mpi.initialize``: an unhandled exception on any
rank prints that rank, its host and the traceback and calls ``comm.Abort(1)``, so the job
ends instead of hanging; too few ranks fails at once on every rank.  The communicator is
a parameter, so the bootstrap runs on any (sub-)communicator.

Ranks that wait (the coordinator for the workers, everyone at the end) poll non-blocking
MPI calls with a sleep: a blocking MPICH collective spins a core, and on a small machine
the spinning ranks would take the CPU the workers train on.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import sys
import traceback
from pathlib import Path

from psgrid.cluster.errors import JobFailed, UsageError
from psgrid.cluster.job import credentials, memory
from psgrid.cluster.job.config import JobConfig, apply_overrides
from psgrid.cluster.job.rate_schedule import scheduled
from psgrid.cluster.job.records import write_job_file
from psgrid.cluster.job.shard_device import resolve_shard_device
from psgrid.cluster.mpi import report as mpi_report
from psgrid.cluster.mpi.comm import abort, meet_after_signal, wait_request
from psgrid.cluster.mpi.mpich_shm import unlink_init_shm
from psgrid.cluster.mpi.placement import SERVER, WORKER, Placement, PlacementError, Role, place, worker_hosts
from psgrid.cluster.mpi.rank_zero import TAG_DONE, RankZero
from psgrid.cluster.run import coordinator as co
from psgrid.cluster.run import preflight
from psgrid.cluster.run import script as user_script
from psgrid.cluster.run.interrupts import ignore_signals, received_signal, stop_on_signals
from psgrid.cluster.run.jobrun import JobRun
from psgrid.cluster.run.procs import limit_blas_threads, usable_cpus
from psgrid.psserver import files
from psgrid.psserver.protocol import format_address_file

LOOPBACK = "127.0.0.1"


def min_ranks(shards: int) -> int:
    return shards + 2


def too_few_ranks_message(shards: int, size: int) -> str:
    return (
        f"psctl mpi needs at least {min_ranks(shards)} ranks (1 coordinator + {shards} shard"
        f"{'s' if shards != 1 else ''} + at least 1 worker); got {size}"
    )


def interface_address(iface: str) -> str:
    """The IPv4 address of a network interface (Linux), e.g. ``ib0`` -> ``10.1.2.3``."""
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            packed = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", iface[:15].encode()))  # SIOCGIFADDR
        except OSError as e:
            raise UsageError(f"--iface {iface}: no IPv4 address on that interface ({e.strerror})") from None
    return socket.inet_ntoa(packed[20:24])


def bind_and_advertise(host: str | None, iface: str | None, single_node: bool) -> tuple[str, str]:
    """Where a shard binds, and the host name other ranks use to reach it."""
    if iface:
        ip = interface_address(iface)
        return ip, ip
    if host:
        if host in ("0.0.0.0", "::", "[::]"):
            return host, socket.gethostname()
        return host, host
    if single_node:
        return LOOPBACK, LOOPBACK
    return "0.0.0.0", socket.gethostname()


class MPIJob:
    """One rank's part of an MPI job; :meth:`run` returns this rank's exit code."""

    def __init__(
        self,
        job: JobConfig,
        comm,
        *,
        host: str | None = None,
        iface: str | None = None,
        progress: bool | None = None,
        command: list[str] | None = None,
        oversubscribe: bool = False,
    ):
        self.comm = comm
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.hostname = socket.gethostname()
        self.job0 = job
        self.job = job
        self.host, self.iface = host, iface
        self.progress = progress
        self.command = command  # the user's own command, run by each worker rank (cluster/run/script.py)
        self.oversubscribe = oversubscribe
        self.placement: Placement | None = None  # every rank's role, once run() has gathered them
        self.role, self.index = ("coordinator", 0) if self.rank == 0 else ("rank", self.rank)  # until placed
        self.out: Path | None = None
        self.server = None  # this rank's running shard, when it serves one
        self.model = None  # "a 101,770-parameter mlp", for rank 0's first line

    # -- setup -------------------------------------------------------------------------------

    def check_size(self) -> str | None:
        if self.size < min_ranks(self.job0.shards):
            return too_few_ranks_message(self.job0.shards, self.size)
        return None

    def place_ranks(self) -> Placement:
        """Every rank's role, from every rank's host and GPUs (the same answer on every rank).

        Raises PlacementError on every rank alike; caps this rank's BLAS threads at the node's
        CPUs divided among its workers.
        """
        from psgrid.worker.backend import visible_gpus

        gpus = visible_gpus() if self.job.train.device != "cpu" else []
        reports = self.comm.allgather((self.hostname, gpus))
        placement = place(
            [h for h, _ in reports],
            [g for _, g in reports],
            self.job.shards,
            device=self.job.train.device,
            oversubscribe=self.oversubscribe,
        )
        limit_blas_threads(usable_cpus() // max(1, placement.workers_on(placement.roles[self.rank].node)))
        return placement

    def run(self) -> int:
        problem = self.check_size()
        if problem:
            if self.rank == 0:  # every rank fails at once; one says why
                print(problem, file=sys.stderr, flush=True)
            return 2
        workers = self.size - 1 - self.job0.shards
        # The number of ranks decides the number of workers; every rank computes the same job.
        try:
            self.job = apply_overrides(self.job0, {"workers": workers})
            preflight.check_stragglers(self.job)
        except UsageError as e:
            if self.rank == 0:
                print(f"psctl mpi: error: {e}", file=sys.stderr, flush=True)
            return 2
        try:
            self.placement = self.place_ranks()
        except PlacementError as e:
            if self.rank == 0:
                print(f"psctl mpi: error: {e}", file=sys.stderr, flush=True)
            return 2
        me = self.placement.roles[self.rank]
        self.role, self.index = me.kind, me.index
        single_node = len(self.placement.hosts) == 1
        if self.rank == 0:
            for note in self.placement.notes:
                print(f"psctl mpi: warning: {note}", file=sys.stderr, flush=True)
        problem = preflight.gathered_device_problem(self.comm, self.role == "worker", self.job.train)
        if not problem and not self.command:  # a script's model is its own
            problem = self.memory_problem()
        if not problem:
            problem = self.shard_device_problem()
        if problem:  # before any shard binds: a worker rank cannot compute where the job asks
            if self.rank == 0:
                print(f"psctl mpi: error: {problem}", file=sys.stderr, flush=True)
            return 2
        # One token and one job id for the whole job, made on rank 0 and sent over MPI: never in a file or argv.
        made = (credentials.new_token(), credentials.new_job_id()) if self.rank == 0 else None
        self.job = credentials.secure(self.job, *self.comm.bcast(made, root=0))

        out, error = None, None
        if self.rank == 0:
            try:
                out = str(_prepare_out(self.job))
            except UsageError as e:
                error = str(e)
        out, error = self.comm.bcast((out, error), root=0)
        if error:
            if self.rank == 0:
                print(f"psctl mpi: error: {error}", file=sys.stderr, flush=True)
            return 2
        self.out = Path(out)
        mpi_report.tee_to_log(self.out, self.rank, self.role, self.index)  # OUT/logs/ROLE-I.log
        if self.rank == 0:
            write_job_file(self.out, self.job, "by psctl mpi")

        running = None
        if self.role == "server":
            running, address = self.start_server(single_node)
            self.server = running
        else:
            address = None
        self.addresses = self.share_addresses(address)

        if self.role == "coordinator":
            code = self.coordinate()
        elif self.role == "server":
            self.serve_until_shutdown(running)
            code = 0
        else:
            self.train(me)
            code = 0
        wait_request(self.comm.Ibarrier(), None, "final barrier")
        mpi_report.untee()
        return code

    def share_addresses(self, shard) -> list[str]:
        """Every shard's address in shard order, from the shard ranks' ``(address, device, metrics port)``; collective.

        Rank 0 writes them where ``psctl status --address-dir`` reads them, as psctl launch does (with the
        port each serves its metrics on, where it does), and records the device the shards resolved on
        their nodes in the job.
        """
        addresses = self.comm.gather(shard, root=0)
        if self.rank == 0:
            addresses, devices, metrics_ports = zip(*(addresses[r] for r in self.placement.ranks(SERVER)))
            addresses = list(addresses)
            self.job = with_devices(self.job, devices)
            write_job_file(self.out, self.job, "by psctl mpi")
            for i, (a, port) in enumerate(zip(addresses, metrics_ports)):
                text = format_address_file(a, self.job.server.job_id, port)
                files.replace_text(self.out / "addr" / f"shard-{i}", text)
            credentials.write_token_file(self.out, self.job)
        return self.comm.bcast(addresses, root=0)

    def memory_problem(self) -> str | None:
        """Whether the ranks of each node fit in its memory (and a GPU worker's arrays on its GPU); collective."""
        fp = memory.footprint(self.job)
        me = self.placement.roles[self.rank]
        here = [r for r, role in enumerate(self.placement.roles) if role.node == me.node]
        problem = None
        if self.rank == here[0]:  # one rank per node speaks for it
            kinds = [self.placement.roles[r].kind for r in here]
            problem = memory.host_problem(
                fp, kinds.count(SERVER), kinds.count(WORKER), memory.available_bytes(), f"node {self.hostname}"
            )
        if problem is None and me.kind == WORKER and self.job.train.device == "gpu":
            problem = memory.gpu_problem(fp, memory.gpu_total_bytes())
        if self.rank == 0:
            self.model = fp.describe()
        return next((p for p in self.comm.allgather(problem) if p), None)

    def shard_device_problem(self) -> str | None:
        """Whether this node's device shards fit in its GPUs (each shard rank checks its own node); collective.

        ``shard_device = "auto"`` is resolved by each shard rank for its own node, as it will start.
        """
        me = self.placement.roles[self.rank]
        problem = None
        if me.kind == SERVER:
            here = [r.index for r in self.placement.roles if r.kind == SERVER and r.node == me.node]
            try:
                preflight.check_shard_device(self.job, indices=here, sized=not self.command)
            except UsageError as e:
                problem = f"shard {me.index} (rank {self.rank} on {self.hostname}): {e}"
        return next((p for p in self.comm.allgather(problem) if p), None)

    # -- roles -------------------------------------------------------------------------------

    def start_server(self, single_node: bool):
        from psgrid.psserver.server import serve

        bind, advertise = bind_and_advertise(self.host, self.iface, single_node)
        # a rate schedule's length needs the hosts (aggregate = "host"): known here, from the placement
        job = scheduled(self.job, hosts=worker_hosts(self.placement))
        config = job.server_config(self.index, host=bind, port=0)
        config.shard_device = resolve_shard_device(config, self.job.train)  # for this node's workers
        running = serve(config)
        address = f"{advertise}:{running.port}"
        metrics = f", metrics on {advertise}:{running.metrics.port}" if running.metrics else ""
        print(
            f"psctl mpi: shard {self.index}/{self.job.shards} on the {config.shard_device.upper()} listening on "
            f"{address} (rank {self.rank} on {self.hostname}, mode {config.mode}{metrics})",
            file=sys.stderr,
            flush=True,
        )
        return running, (address, config.shard_device, running.metrics.port if running.metrics else None)

    def serve_until_shutdown(self, running) -> None:
        # Ends when the coordinator's Shutdown RPC arrives; if the coordinator dies, mpiexec ends us.
        while not running.shutdown_requested.wait(timeout=1.0):
            if running.wait(timeout=0):
                return
        running.stop(grace=1.0)

    def train(self, me: Role) -> None:
        from psgrid.cluster.run.preflight import probe_shards
        from psgrid.worker.loop import run_worker

        # Unreachable, or a TLS handshake that fails: said now in one line (the client retried for
        # retry_s first, then every worker rank printed its traceback), as psctl worker says it.
        probe_shards(self.addresses, self.job.train)
        # The worker's GPU reaches select_gpu as LOCAL_RANK (taken modulo the GPUs it sees), as torchrun's does.
        os.environ["LOCAL_RANK"] = str(me.gpu if me.gpu is not None else me.local_rank)
        metrics = self.out / "metrics" / f"worker-{self.index}.jsonl"
        files.make_dirs(metrics.parent)
        group = None
        if self.job.train.aggregate == "host":  # one aggregator per node: its worker of local rank 0
            from psgrid.cluster.mpi.placement import host_group

            group = host_group(self.placement, self.rank)
        if self.command:
            gpu = me.gpu if me.gpu is not None else (me.local_rank or 0)
            message = user_script.run_on_rank(
                self.command, self.job, self.out, self.addresses, self.index, self.job.workers, gpu, group
            )
        else:
            if group is not None:
                from psgrid.worker.aggregate import HostGroup

                group = HostGroup(*group)
            result = run_worker(
                self.job.train,
                self.addresses,
                self.index,
                self.job.workers,
                metrics_path=str(metrics),
                host_group=group,
            )
            # Send the events along: rank 0 may not see this node's files (no shared file system).
            message = {"result": result, "events": co.MetricsTail([metrics]).read()}
        wait_request(self.comm.isend(message, dest=0, tag=TAG_DONE), None, "sending results to rank 0")

    def coordinate(self) -> int:
        """Rank 0: follow the job, evaluate, stop the shards, write the summary; returns the exit code."""
        out = self.out
        run = JobRun(self.job, out, "mpi", command=self.command)
        try:
            summary = run.run(RankZero(self), launcher="mpi", ranks=self.size)
        except JobFailed:  # the summary says how it ended; KeyboardInterrupt goes on to stop_interrupted
            summary = None
        if run.status not in ("ok", "failed"):  # a mistake of the user's: every rank ended as it should
            print(
                f"psctl mpi: {run.message} (status {run.status}; summary in {out / 'summary.json'})",
                file=sys.stderr,
                flush=True,
            )
            return 1
        if run.status != "ok":
            print(
                f"psctl mpi: job failed: {run.message}; summary in {out / 'summary.json'}", file=sys.stderr, flush=True
            )
            abort(self.comm)
            return 1  # Abort ends every rank; where it returns (a world of one), the job failed all the same
        print(co.headline(summary), flush=True)
        print(
            f"psctl mpi: summary in {out / 'summary.json'}, metrics in {out / 'metrics.jsonl'}",
            file=sys.stderr,
            flush=True,
        )
        return 0

    def stop_interrupted(self, signum: int, say: bool = True) -> int:
        """After Ctrl-C or SIGTERM, which every rank hears: stop this rank's part and end with the others.

        mpiexec and srun pass the signal to every rank; each stops what it runs, the ranks meet
        once more, and rank 0 says in one line what happened (its summary, status ``interrupted``,
        is written by :meth:`coordinate`). Returns 128 + ``signum``. A rank that does not come
        within ``INTERRUPT_WAIT_S`` (the signal reached only some ranks) makes the job abort.
        """
        name = meet_after_signal(self.comm, signum, "psctl mpi")  # a shard serves on until the workers left it
        if self.server is not None:
            self.server.stop(grace=0.5)
        if say and self.rank == 0:  # (psctl compare --mpi says it once for the experiment)
            where = f"; partial results in {self.out}" if self.out is not None else "; nothing had started"
            print(f"psctl mpi: {name}: stopped every rank{where}", file=sys.stderr, flush=True)
        mpi_report.untee()
        return 128 + signum


def with_devices(job: JobConfig, devices) -> JobConfig:
    """``job`` as its shards run: with the device they resolved on their nodes, where they all agree."""
    if len(set(devices)) != 1:
        return job  # nodes that differ: each shard's log line says its own
    return dataclasses.replace(job, server=dataclasses.replace(job.server, shard_device=devices[0]))


def _prepare_out(job: JobConfig) -> Path:
    from psgrid.cluster.run.launch import prepare_out

    return prepare_out(job)


def run_mpi(
    job: JobConfig,
    comm=None,
    *,
    host: str | None = None,
    iface: str | None = None,
    progress: bool | None = None,
    command: list[str] | None = None,
    oversubscribe: bool = False,
) -> int:
    """Run this rank's part of ``job`` on ``comm`` (default ``MPI.COMM_WORLD``); returns the exit code.

    Any exception on any rank is printed with the rank and host and aborts the whole job. With
    ``command``, each worker rank runs it instead of the built-in trainer (cluster/run/script.py); with
    ``oversubscribe``, workers may share GPUs when there are more of them than GPUs.
    """
    world = comm is None
    if world:
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    part = None
    old = stop_on_signals()
    try:
        if world:  # the job is ours: leave no MPICH file in /dev/shm, however it ends
            unlink_init_shm(comm)
        part = MPIJob(
            job, comm, host=host, iface=iface, progress=progress, command=command, oversubscribe=oversubscribe
        )
        return part.run()
    except KeyboardInterrupt:
        ignore_signals()  # the cleanup is bounded by its own timeouts; a second Ctrl-C must not cut it
        if part is None:
            return 128 + received_signal()
        return part.stop_interrupted(received_signal())
    except BaseException as e:
        # A mistake of the job's (a UsageError: one line naming the fix), else what went wrong and where.
        detail = f" {e}" if isinstance(e, UsageError) else f"\n{traceback.format_exc()}"
        print(
            f"psctl mpi: rank {rank} on {socket.gethostname()} failed; aborting the job:{detail}",
            file=sys.stderr,
            flush=True,
        )
        if part is not None:  # rank 0 writes a partial summary, then aborts the job itself
            mpi_report.tell_coordinator(comm, rank, part.role, part.index, f"{type(e).__name__}: {e}")
        abort(comm)
        raise  # not reached: Abort ends the process
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
