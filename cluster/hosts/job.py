"""Run one job on an :class:`~psgrid.cluster.hosts.network.EmulatedNetwork`, each process inside its host.

As on real hosts: shard i listens on its host's address (``psctl server --host ADDRESS --port 0``)
and publishes it in ``OUT/addr/shard-I``; workers get every shard's address and reach a shard on
another host over its network planes (TCP and gRPC; the shared-memory plane is offered on an
abstract Unix socket, which a network namespace does not share, so only a worker on the shard's own
host uses it). The token travels in the environment and the job file has it redacted, as under
``psctl launch``. Workers of one host have consecutive ranks and are told ``LOCAL_RANK`` and
``LOCAL_SIZE`` (what ``aggregate = "host"`` groups by).

Every process is started in its own process group and ended by that group, on success, failure
and interruption alike, before the network is removed. The job's lifecycle (its event log, summary
and merged metrics) is cluster/run/jobrun.py's, as under ``psctl launch``.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from psgrid.cluster.errors import JobFailed
from psgrid.cluster.hosts.network import EmulatedNetwork
from psgrid.cluster.job import credentials
from psgrid.cluster.job.config import JobConfig
from psgrid.cluster.job.records import write_job_file
from psgrid.cluster.run.jobrun import JobRun
from psgrid.cluster.run.procs import Child, child_env, psctl_argv, stop_children
from psgrid.psserver import files
from psgrid.psserver.protocol import parse_address_file

POLL_S = 0.05
STOP_GRACE_S = 5.0


@dataclass
class EmulatedResult:
    """What one emulated job did: the workers' summaries, rank 0's last accuracy and the links' bytes."""

    workers: list[dict]
    accuracy: float | None
    wall_s: float  # from the first worker's first step to the last worker's last
    link_bytes: dict[str, int]  # carried by the host links while the workers trained: to and from the hosts
    steps: int  # steps per worker
    records: list[list[dict]] = field(default_factory=list)  # each worker's step records
    starts: list[dict] = field(default_factory=list)  # each worker's start record (its data planes)

    @property
    def samples(self) -> int:
        return sum(w["samples"] for w in self.workers)

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def bytes_per_step(self) -> float:
        """Bytes the host links carried per step of the job (every worker's step c together), both ways."""
        return (self.link_bytes["to_hosts"] + self.link_bytes["from_hosts"]) / max(1, self.steps)


def spread(count: int, hosts: int) -> list[int]:
    """The host of each of ``count`` processes spread evenly and in blocks: ``spread(4, 2) == [0, 0, 1, 1]``."""
    return [i * hosts // count for i in range(count)]


class EmulatedJob:
    """``job`` with shard i on host ``shard_hosts[i]`` and worker r on host ``worker_hosts[r]``.

    Parameters
    ----------
    network : EmulatedNetwork
        Made (entered) by the caller, who removes it after this job has ended.
    job : JobConfig
        The job; its ``shards`` and ``workers`` counts are taken from the two placements.
    out : Path
        A folder for the job file, addresses, logs and metrics.
    shard_hosts, worker_hosts : list of int
        Default: spread evenly over the hosts, in blocks.
    """

    def __init__(
        self,
        network: EmulatedNetwork,
        job: JobConfig,
        out: str | Path,
        *,
        shard_hosts: list[int] | None = None,
        worker_hosts: list[int] | None = None,
    ):
        import dataclasses

        hosts = len(network.hosts)
        self.shard_hosts = shard_hosts if shard_hosts is not None else spread(job.shards, hosts)
        self.worker_hosts = worker_hosts if worker_hosts is not None else spread(job.workers, hosts)
        if self.worker_hosts != sorted(self.worker_hosts):
            raise ValueError(f"workers of one host must have consecutive ranks, got hosts {self.worker_hosts}")
        if not all(0 <= h < hosts for h in self.shard_hosts + self.worker_hosts):
            raise ValueError(f"host indices must be in 0..{hosts - 1}")
        job = dataclasses.replace(job, shards=len(self.shard_hosts), workers=len(self.worker_hosts))
        self.job = credentials.secure(job)
        self.network = network
        self.out = Path(out)
        self.children: list[Child] = []
        self.workers: list[Child] = []
        self.addresses: list[str] = []
        self.job_file: Path | None = None
        self.deadline = 0.0
        self.weights_to: str | Path | None = None
        self.counted: dict[str, dict] = {}  # the links' byte counters before and after the workers trained

    def run(self, timeout_s: float = 120.0, *, weights_to: str | Path | None = None) -> EmulatedResult:
        """Start the shards, then the workers; wait for the workers to end (at most ``timeout_s``); stop all.

        ``weights_to``: save the shards' final weights there (``.npy``), read from inside host 0. The
        lifecycle is cluster/run/jobrun.py's, so ``OUT/summary.json`` and ``OUT/metrics.jsonl`` are
        written as for any job (``launcher`` is ``emulated``; no evaluation: the hosts' shards are out of
        this namespace's reach).
        """
        self.deadline = time.monotonic() + timeout_s
        self.weights_to = weights_to
        JobRun(self.job, self.out, "emulated").run(self)
        return self._result(self.counted["before"], self.counted["after"])

    # -- cluster/run/jobrun.py's Backend -----------------------------------------------------

    def start(self, run: JobRun) -> None:
        self.job_file = self._write_job()
        self.addresses = self._start_shards(self.job_file, self.deadline)
        run.event("shards_ready", addresses=self.addresses, pids=[c.pid for c in self.children])
        self.counted["before"] = self.network.counters()
        self.workers = self._start_workers(self.job_file, self.addresses)
        for rank in range(len(self.workers)):
            run.tail.add(self._metrics_path(rank))

    def follow(self, run: JobRun) -> None:
        self._wait(self.workers, self.deadline)
        self.counted["after"] = self.network.counters()
        run.refresh()
        return None  # the training time is the workers' own (first step to last end)

    def finish(self, run: JobRun) -> None:
        if self.weights_to is not None:
            self._save_weights(self.job_file, self.addresses, Path(self.weights_to), self.deadline)

    def stop(self, run: JobRun) -> None:
        stop_children(self.children, STOP_GRACE_S)

    def report(self, run: JobRun) -> dict:
        exits = {rank: w.returncode for rank, w in enumerate(self.workers)}
        return {"addresses": self.addresses, "worker_exits": exits}

    # -- the parts ---------------------------------------------------------------------------

    def _save_weights(self, job_file: Path, addresses: list[str], path: Path, deadline: float) -> None:
        argv = [
            sys.executable,
            "-c",
            "import sys; from psgrid.cluster.hosts.observe import main; sys.exit(main())",
            "--config",
            str(job_file),
            "--addresses",
            ",".join(addresses),
            "--out",
            str(path),
        ]
        observer = self._child("observer", 0, argv, child_env(credentials.child_env(self.job)))
        self._wait([observer], deadline)

    def _write_job(self) -> Path:
        files.make_dirs(self.out / "addr")
        return write_job_file(self.out, self.job, "on emulated hosts")

    def _child(self, name: str, host: int, argv: list[str], env: dict[str, str]) -> Child:
        child = Child(
            name, self.network.hosts[host].argv(argv), self.out / "logs" / f"{name.replace(' ', '-')}.log", env
        )
        self.children.append(child)
        return child

    def _start_shards(self, job_file: Path, deadline: float) -> list[str]:
        env = child_env(credentials.child_env(self.job), threads=1)
        shards, paths = [], []
        for i, host in enumerate(self.shard_hosts):
            path = self.out / "addr" / f"shard-{i}"
            argv = psctl_argv(
                "server",
                "--config",
                str(job_file),
                "--shard",
                str(i),
                "--num-shards",
                str(self.job.shards),
                "--host",
                self.network.hosts[host].address,
                "--port",
                "0",
                "--address-file",
                str(path),
            )
            shards.append(self._child(f"server {i}", host, argv, env))
            paths.append(path)
        while not all(p.exists() for p in paths):
            self._check(shards)
            if time.monotonic() > deadline:
                raise JobFailed(f"shards did not publish their addresses in time; see {self.out / 'logs'}")
            time.sleep(POLL_S)
        return [parse_address_file(p.read_text())[0] for p in paths]

    def _start_workers(self, job_file: Path, addresses: list[str]) -> list[Child]:
        world = len(self.worker_hosts)
        per_host = {h: self.worker_hosts.count(h) for h in set(self.worker_hosts)}
        # The machine's cores are shared by every host's workers, as psctl launch shares them.
        from psgrid.cluster.run.procs import usable_cpus

        env = child_env(credentials.child_env(self.job), threads=max(1, usable_cpus() // world))
        workers = []
        for rank, host in enumerate(self.worker_hosts):
            local = rank - self.worker_hosts.index(host)
            argv = psctl_argv(
                "worker",
                "--config",
                str(job_file),
                "--addresses",
                ",".join(addresses),
                "--rank",
                str(rank),
                "--world",
                str(world),
                "--metrics",
                str(self._metrics_path(rank)),
            )
            workers.append(
                self._child(
                    f"worker {rank}", host, argv, dict(env, LOCAL_RANK=str(local), LOCAL_SIZE=str(per_host[host]))
                )
            )
        return workers

    def _metrics_path(self, rank: int) -> Path:
        return self.out / "metrics" / f"worker-{rank}.jsonl"

    def _wait(self, workers: list[Child], deadline: float) -> None:
        while any(w.poll() is None for w in workers):
            self._check(self.children)
            if time.monotonic() > deadline:
                raise JobFailed(f"workers did not end in time; see {self.out / 'logs'}")
            time.sleep(POLL_S)
        self._check(self.children)

    def _check(self, children: list[Child]) -> None:
        for child in children:
            code = child.poll()
            if code is not None and code != 0:
                raise JobFailed(
                    f"{child.name} {child.describe_exit()}; last lines of {child.log_path}:\n{child.tail()}"
                )

    def _result(self, before: dict, after: dict) -> EmulatedResult:
        workers, records, starts, accuracy = [], [], [], None
        for rank in range(len(self.worker_hosts)):
            lines = self._metrics_path(rank).read_text().splitlines()
            events = [json.loads(line) for line in lines if line.strip()]
            workers.append(next(e for e in events if e.get("event") == "done"))
            records.append([e for e in events if e.get("event") == "step"])
            starts.append(next(e for e in events if e.get("event") == "start"))
            evals = [e["test_accuracy"] for e in events if e.get("event") == "eval"]
            if rank == 0 and evals:
                accuracy = evals[-1]
        first = [r[0]["started"] for r in records if r]
        wall = max(w["time"] for w in workers) - min(first) if first else 0.0
        link = {k: after[k] - before[k] for k in after}
        return EmulatedResult(workers, accuracy, wall, link, max(w["steps"] for w in workers), records, starts)
