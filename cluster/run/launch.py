"""``psctl launch``: a whole job on this machine, S shard processes and W worker processes.

The launcher writes the resolved job to ``OUT/job.toml`` (every child reads it, and it
records exactly what ran), starts the shards on port 0 and waits for the addresses they
publish in ``OUT/addr/shard-I``, starts the workers, follows their metrics for the
progress bar, and at the end evaluates, stops the shards and writes ``OUT/summary.json``
and ``OUT/metrics.jsonl``.

What the job survives (docs/reliability.md has the whole contract):

* a worker that dies is evicted by the shards after ``lease_s`` and the others go on, in
  every mode, as long as one worker completes; one that dies before it joined is reported
  gone to the shards at once, so nobody waits ``join_timeout_s`` for it;
* a worker whose loop hangs while its heartbeat lives is evicted by the shards after
  ``progress_timeout_s`` (sync and ssp), and then stopped here;
* a shard holds a slice of the weights that exists nowhere else: one that exits ends the
  job, unless ``restart_failed`` is set, when it is started again on its address from its
  latest checkpoint (the workers retry meanwhile).

With ``shard_placement = "worker"`` (GeePS' placement) worker i hosts shard i in its own process
(cluster/run/hosting.py): one child is then both, its death is both's, and a restarted shard
comes back as a process of its own.

Every failure is listed in the summary. ``--resume DIR`` continues a stopped job from its
shards' checkpoints toward its total steps (cluster/run/resume.py).
"""

from __future__ import annotations

import signal
import sys
import time
from pathlib import Path

from psgrid.cluster.errors import JobFailed, UsageError
from psgrid.cluster.job import credentials, rate_schedule
from psgrid.cluster.job.config import JobConfig
from psgrid.cluster.job.memory import footprint
from psgrid.cluster.job.outdir import lock, release
from psgrid.cluster.job.records import signals_held, write_command_file, write_job_file
from psgrid.cluster.job.shard_device import mps_note, with_shard_device
from psgrid.cluster.run import coordinator as co
from psgrid.cluster.run import script as user_script
from psgrid.cluster.run.interrupts import (
    Interrupted,
    check_interrupted,
    deferred_signals,
    ignore_signals,
    listen_for_interrupts,
    signal_heard,
)
from psgrid.cluster.run.jobrun import JobRun
from psgrid.cluster.run.procs import Child, child_env, psctl_argv, stop_children, usable_cpus
from psgrid.cluster.run.watch import ShardWatch
from psgrid.psserver.protocol import parse_address_file, parse_metrics_port
from psgrid.worker.env import ADDRESS_DIR, HOST_SHARD

POLL_S = 0.2
STOP_GRACE_S = 5.0
SERVER_EXIT_TIMEOUT_S = 15.0


def prepare_out(job: JobConfig, resume: bool = False) -> Path:
    """The job's output folder, ready for this run (cluster/job/outdir.py: never a collision, ``--overwrite``).

    With ``resume`` the earlier attempt's files move to ``attempts/N`` first (cluster/run/resume.py).
    """
    from psgrid.cluster.job.outdir import prepare

    if resume:
        from psgrid.cluster.run.resume import archive_attempt

        lock(Path(job.out))  # before anything is moved: a job still running there keeps its files
        archive_attempt(Path(job.out))
    return prepare(job, resume=resume)


class Launcher:
    """Runs one job; :meth:`run` returns the summary or raises JobFailed / Interrupted after cleaning up."""

    def __init__(
        self,
        job: JobConfig,
        out: Path,
        progress: bool | None = None,
        *,
        bar=None,
        quiet: bool = False,
        resumed: list[dict] | None = None,
        command: list[str] | None = None,
        launcher: str = "launch",
        relay: bool = True,
    ):
        from psgrid.cluster.run.hosting import check_placement

        # here too for the Python API: LocalCluster's own sessions are workers no shard can live in
        check_placement(job, launcher="psgrid.LocalCluster" if launcher == "local" else "psctl launch")
        job = credentials.secure(job)  # a token and a job id of its own, unless the job gives them
        job = with_shard_device(job)  # shard_device "auto" made "cpu" or "gpu" here; job.toml says which
        rate_schedule.schedule_updates(job)  # refused here where it cannot be derived; each shard derives it
        self.job = job
        self.resumed = resumed  # where each shard's checkpoint stood, when this run resumes a job
        self.out = out
        self.progress_enabled = progress
        self.bar = bar  # a caller's progress bar (psctl compare's, over many jobs) instead of our own
        self.quiet = quiet
        self.command = command  # the user's own command, run by each worker instead of the built-in trainer
        self.relay = None  # copies the commands' output to the terminal, prefixed by rank
        self.relays = relay  # whether it does (psctl bench script keeps its output to itself)
        self.shards: list[Child] = []  # the psctl server processes, in shard order
        self.workers: list[Child] = []
        self.addresses: list[str] = []
        self.metrics_at: list[str] = []  # host:port of each shard's Prometheus metrics, where served
        self.restarts: list[dict] = []  # shards started again (restart_failed)
        self.watch: ShardWatch | None = None
        self.started_at: dict[int, float] = {}  # rank -> when its "start" event was seen
        self.why: dict[str, str] = {}  # child name -> what the launcher did to it, and why
        # What the job's coordinator records: its events, the workers' progress, failures, the summary.
        self.jobrun = JobRun(job, out, launcher, command=command)
        self.state = self.jobrun.state
        self.failures = self.jobrun.failures
        if job.server.checkpoint_dir:  # absolute, so a resume from another folder finds the checkpoints
            job.server.checkpoint_dir = str(Path(job.server.checkpoint_dir).resolve())
        self.job_file = write_job_file(out, job, "by psctl launch")
        if command:
            write_command_file(out, command, Path.cwd())
        credentials.write_token_file(out, job)
        cpus = usable_cpus()
        secret = credentials.child_env(job)  # the token travels in the environment, never in argv
        self.worker_env = child_env(secret, threads=max(1, cpus // job.workers))
        self.shard_env = child_env(secret, threads=1)
        # shard_placement = "worker": shard i lives in worker i's process, one child for both
        self.hosting = job.shard_placement == "worker"
        self.trained_at: dict[int, float] = {}  # rank -> when a hosting worker's training ended
        self.mps = None  # the job's own MPS control daemon ([job] mps = true), once started

    # -- phases ------------------------------------------------------------------------------

    def _shard_child(self, i: int, port: int) -> Child:
        addr_file = self.out / "addr" / f"shard-{i}"
        argv = psctl_argv(
            "server",
            "--config",
            str(self.job_file),
            "--shard",
            str(i),
            "--num-shards",
            str(self.job.shards),
            "--port",
            str(port),
            "--address-file",
            str(addr_file),
        )
        return Child(f"server {i}", argv, self.out / "logs" / f"server-{i}.log", self.shard_env)

    def _hosting_child(self, i: int) -> Child:
        """Worker i, hosting shard i in its own process: it publishes the shard's address as a shard would."""
        job = self.job
        if self.command:  # the user's script: psgrid.init hosts the shard (cluster/run/hosted_script.py)
            env = user_script.worker_env(self.worker_env, job, self.out, [], i, job.workers, i)
            env.update({HOST_SHARD: str(i), ADDRESS_DIR: str((self.out / "addr").resolve())})
            return Child(f"worker {i} (hosting shard {i})", self.command, self.out / "logs" / f"worker-{i}.log", env)
        argv = psctl_argv(
            "worker",
            "--config",
            str(self.job_file),
            "--host-shard",
            str(i),
            "--address-dir",
            str(self.out / "addr"),
            "--rank",
            str(i),
            "--world",
            str(job.workers),
            "--metrics",
            str(self._metrics_path(i)),
        )
        return Child(
            f"worker {i} (hosting shard {i})",
            argv,
            self.out / "logs" / f"worker-{i}.log",
            dict(self.worker_env, LOCAL_RANK=str(i)),
        )

    def _metrics_path(self, rank: int) -> Path:
        return self.out / "metrics" / f"worker-{rank}.jsonl"

    def hosts(self, rank: int) -> bool:
        """Whether worker ``rank``'s process is the one that serves a shard (it must not be stopped alone)."""
        return (
            self.hosting
            and rank < len(self.shards)
            and rank < len(self.workers)
            and self.workers[rank] is self.shards[rank]
        )

    def start_shards(self) -> None:
        job = self.job
        for i in range(job.shards):
            with deferred_signals():  # a signal between fork and append would leave a child we do not know
                self.shards.append(self._hosting_child(i) if self.hosting else self._shard_child(i, 0))
        deadline = time.monotonic() + job.start_timeout_s
        files = [self.out / "addr" / f"shard-{i}" for i in range(job.shards)]
        while not all(f.exists() for f in files):
            self._check_shards()
            if time.monotonic() > deadline:
                missing = [s.name for s, f in zip(self.shards, files) if not f.exists()]
                raise JobFailed(
                    f"{', '.join(missing)} did not publish an address within "
                    f"{job.start_timeout_s:.0f} s; see {self.out / 'logs'}"
                )
            check_interrupted()
            time.sleep(0.05)
        texts = [f.read_text() for f in files]
        self.addresses = [parse_address_file(t)[0] for t in texts]
        ports = [parse_metrics_port(t) for t in texts]
        # metrics_port = 0 asks for any free port: say which each shard bound
        self.metrics_at = [f"{a.rpartition(':')[0]}:{p}" for a, p in zip(self.addresses, ports) if p is not None]
        self.jobrun.event("shards_ready", addresses=self.addresses, pids=[s.pid for s in self.shards])
        from psgrid.worker.loop import make_admin

        self.watch = ShardWatch(lambda: make_admin(job.train, self.addresses, deadline_s=10.0, retry_s=2.0)).start()

    def start_workers(self) -> None:
        job = self.job
        addresses = ",".join(self.addresses)
        for rank in range(job.workers):
            metrics = self._metrics_path(rank)
            if self.hosting and rank < job.shards:  # started with its shard, by start_shards
                self.workers.append(self.shards[rank])
                self.jobrun.tail.add(metrics)
                continue
            if self.command:
                argv = self.command
                env = user_script.worker_env(self.worker_env, job, self.out, self.addresses, rank, job.workers, rank)
            else:
                argv = psctl_argv(
                    "worker",
                    "--config",
                    str(self.job_file),
                    "--addresses",
                    addresses,
                    "--rank",
                    str(rank),
                    "--world",
                    str(job.workers),
                    "--metrics",
                    str(metrics),
                )
                env = dict(self.worker_env, LOCAL_RANK=str(rank))
            with deferred_signals():
                self.workers.append(Child(f"worker {rank}", argv, self.out / "logs" / f"worker-{rank}.log", env))
            self.jobrun.tail.add(metrics)
        self.jobrun.event("workers_started", pids=[w.pid for w in self.workers])
        if self.command and self.relays:
            self.relay = user_script.OutputRelay({rank: w.log_path for rank, w in enumerate(self.workers)})

    def follow(self, run: JobRun | None = None) -> float:
        """Wait for every worker to end, feeding the progress bar; returns the training wall time.

        ``run`` is this launcher's own :class:`JobRun` (the Backend's signature); None says the same.
        """
        job = self.job
        start = time.monotonic()
        progress = self.bar or self.jobrun.progress(self.progress_enabled)
        reported: set[int] = set()
        try:
            while True:
                self.jobrun.refresh(progress)
                if self.relay:
                    self.relay.pump()
                self._check_shards()
                for rank, w in enumerate(self.workers):
                    code = w.poll()
                    if code is None and self.hosts(rank) and rank in self.state.done:
                        code = 0  # trained; its process serves its shard on until the job ends
                        self.trained_at.setdefault(rank, time.time())
                    if code is None:
                        self._stop_if_evicted(rank, w, progress)
                    elif rank not in reported:
                        reported.add(rank)
                        self.jobrun.event("worker_exit", rank=rank, exit_code=code)
                        if code == 0 and self.command:  # completed, with or without psgrid.init's records
                            self.state.done.setdefault(rank, {"event": "done", "rank": rank})
                        joined = rank in self.state.started
                        if not joined:
                            # The others wait for the whole job to join: tell the shards not to wait for this one.
                            self.watch.report_gone(rank)
                        if code != 0:
                            self._record_failure(w, "worker", rank, tolerated=True)
                            what = self.why.get(w.name) or f"{w.name} {w.describe_exit()}"
                            before = "" if joined else " before it joined; the shards were told not to wait for it"
                            progress.bar.write(
                                f"psctl launch: {what}{before}; the others go on (log: {w.log_path})", file=sys.stderr
                            )
                if len(reported) == len(self.workers):
                    break
                if job.timeout_s and time.monotonic() - start > job.timeout_s:
                    raise JobFailed(f"training did not finish within timeout_s = {job.timeout_s:g} s")
                check_interrupted()
                time.sleep(POLL_S)
            self.jobrun.refresh()
            progress.update(self.state, [])  # the last evaluations were said by the workers' own lines
        finally:
            if self.relay:
                self.relay.pump(final=True)
            if progress is not self.bar:
                progress.close()
        ended = [self.trained_at.get(rank) or w.ended or time.time() for rank, w in enumerate(self.workers)]
        wall = max(ended) - min(w.started for w in self.workers)
        if not any(code == 0 for code in self.worker_exits().values()):
            for f in self.failures:
                f["tolerated"] = False
            exits = "; ".join(f"{w.name} {w.describe_exit()}" for w in self.workers)
            first = self.workers[0]
            raise JobFailed(f"no worker completed ({exits}). Last lines of {first.log_path}:\n{_indent(first.tail())}")
        return wall

    def _stop_if_evicted(self, rank: int, worker: Child, progress) -> None:
        """Stop a worker whose process lives on after the shards evicted it (a hung training loop)."""
        if rank not in self.state.started or rank in self.state.done or self.watch is None or self.hosts(rank):
            return  # (a hosting worker's process is a shard's too: it is never stopped alone)
        started = self.started_at.setdefault(rank, time.monotonic())
        absent = self.watch.absent_since(rank, started)
        # Two leases and a margin: long enough for an evicted worker that still runs to register again.
        if absent is None or absent < max(2 * self.job.server.lease_s, 5.0):
            return
        self.why[worker.name] = (
            f"{worker.name} was evicted by the shards (no push for progress_timeout_s = "
            f"{self.job.server.progress_timeout_s:g} s while the others waited on it, or no "
            f"heartbeat for lease_s) and did not come back in {absent:.0f} s: stopped it"
        )
        self.jobrun.event("worker_stopped", rank=rank, reason=self.why[worker.name])
        stop_children([worker], STOP_GRACE_S)

    def _check_shards(self) -> None:
        for i, s in enumerate(self.shards):
            if s.poll() is not None:
                if self._may_restart(i):
                    self._restart_shard(i, s)
                    continue
                self._record_failure(s, "server", i, tolerated=False)
                raise JobFailed(
                    f"{s.name} (pid {s.pid}) {s.describe_exit()}; a job cannot go on without "
                    f"one of its shards. Last lines of {s.log_path}:\n{_indent(s.tail())}"
                )

    def _may_restart(self, i: int) -> bool:
        job = self.job
        return bool(
            job.restart_failed and self.addresses and sum(r["shard"] == i for r in self.restarts) < job.max_restarts
        )

    def _restart_shard(self, i: int, dead: Child) -> None:
        """Start shard ``i`` again on its address; it restores its latest checkpoint while clients retry."""
        from psgrid.psserver.state import checkpoint_files as checkpoint

        port = int(self.addresses[i].rpartition(":")[2])
        manifest = checkpoint.read_manifest(checkpoint.shard_dir(self.job.server.checkpoint_dir, i, self.job.shards))
        restart = {
            "name": dead.name,
            "shard": i,
            "pid": dead.pid,
            "exit_code": dead.returncode,
            "time": time.time(),
            "checkpoint_version": None if manifest is None else manifest["version"],
        }
        self.restarts.append(restart)
        self.failures.append(
            {
                "name": dead.name,
                "role": "server",
                "index": i,
                "pid": dead.pid,
                "exit_code": dead.returncode,
                "tolerated": True,
                "restarted": True,
                "log": str(dead.log_path),
                "tail": dead.tail(10),
            }
        )
        self.jobrun.event("shard_restart", **restart)
        n = sum(r["shard"] == i for r in self.restarts)
        hosted = f"; shard {i} comes back as a process of its own" if self.hosts(i) else ""
        print(
            f"psctl launch: {dead.name} {dead.describe_exit()}; restarting it on {self.addresses[i]} from its "
            f"checkpoint at version {restart['checkpoint_version']} (restart {n} of {self.job.max_restarts})"
            f"{hosted}",
            file=sys.stderr,
            flush=True,
        )
        with deferred_signals():
            self.shards[i] = self._shard_child(i, port)

    def _record_failure(self, child: Child, role: str, index: int, tolerated: bool) -> None:
        if any(f["name"] == child.name and f["pid"] == child.pid and f["role"] == role for f in self.failures):
            return
        self.failures.append(
            {
                "name": child.name,
                "role": role,
                "index": index,
                "pid": child.pid,
                "exit_code": child.returncode,
                "tolerated": tolerated,
                "log": str(child.log_path),
                "tail": child.tail(10),
                **({"reason": self.why[child.name]} if child.name in self.why else {}),
            }
        )

    def wait_shards(self) -> None:
        deadline = time.monotonic() + SERVER_EXIT_TIMEOUT_S
        for s in self.shards:
            s.wait(deadline - time.monotonic())
        stop_children(self.shards, STOP_GRACE_S)

    def stop_watching(self) -> None:
        """Stop reading the shards' members (before they are asked to stop)."""
        if self.watch is not None:
            self.watch.close()

    def stop_workers(self) -> None:
        """Stop the workers, but not a process that serves a shard too (stopped with the shards)."""
        stop_children([w for rank, w in enumerate(self.workers) if not self.hosts(rank)], STOP_GRACE_S)

    def stop_all(self) -> None:
        self.stop_watching()
        stop_children(list({id(c): c for c in self.workers + self.shards}.values()), STOP_GRACE_S)

    def worker_exits(self) -> dict[int, int | None]:
        """Each worker's exit code, by rank (None: still running); a hosting worker that trained counts 0."""
        return {rank: 0 if rank in self.trained_at else w.returncode for rank, w in enumerate(self.workers)}

    def last_shard_stats(self) -> list[dict]:
        """Every shard's counters as last read while the job trained (none read: [])."""
        return [co.shard_summary(s) for s in self.watch.last_stats] if self.watch is not None else []

    # -- the whole job, as cluster/run/jobrun.py's Backend -------------------------------------

    def run(self) -> dict:
        """The whole job (cluster/run/jobrun.py); returns the summary or raises JobFailed / Interrupted."""
        return self.jobrun.run(self)

    def start(self, run: JobRun) -> None:
        check_interrupted()  # a Ctrl-C heard before the launcher listened (cluster/run/interrupts.py)
        if self.job.mps:
            self.start_mps()
        self.start_shards()
        if not self.quiet:
            self.announce()
        self.start_workers()

    def announce(self) -> None:
        """One line for the terminal: the shards, where, what they apply, the workers and their model."""
        job = self.job
        model = "" if self.command else f" of {footprint(job).describe()}"  # a script's model is its own
        metrics = f" (metrics on {','.join(self.metrics_at)})" if self.metrics_at else ""
        placed = " (shard i in worker i's process: shard_placement = worker)" if self.hosting else ""
        print(
            f"psctl launch: {job.shards} {job.server.shard_device.upper()} shard(s) at "
            f"{','.join(self.addresses)}{metrics}{placed} applying "
            f"{rate_schedule.scheduled(job).server.describe_optimizer(rate_schedule.pushing_clients(job, hosts=1))}; "
            f"starting {job.workers} worker(s){model}; "
            f"logs in {self.out / 'logs'}",
            file=sys.stderr,
            flush=True,
        )
        # a script's steps are its own: say where the rate schedule's length came from
        for note in (mps_note(job), self.command and rate_schedule.derived_note(job)):
            if note:
                print(f"psctl launch: {note}", file=sys.stderr, flush=True)

    def finish(self, run: JobRun) -> None:
        self.stop_watching()
        run.finish(self.addresses)
        if self.command:
            user_script.check_joined(self.state, self.failures)
        self.wait_shards()

    def stop(self, run: JobRun) -> None:
        ignore_signals()
        try:
            self.stop_all()
        finally:
            if self.mps is not None:
                self.mps.stop()  # last: it served every child until they ended
        self.keep_last_shard_stats(run)

    def start_mps(self) -> None:
        """The job's own MPS control daemon (``[job] mps``), named to every child it starts (cluster/run/mps.py)."""
        from psgrid.cluster.run.mps import JobMps

        self.mps = JobMps(self.out / "logs" / "mps")
        with deferred_signals():  # a signal between its fork and its record would leave a daemon we do not know
            self.mps.spawn()
        try:
            served = self.mps.ready()
        except RuntimeError as e:
            raise JobFailed(str(e), status="failed") from None
        self.shard_env.update(served)
        self.worker_env.update(served)

    def keep_last_shard_stats(self, run: JobRun) -> None:
        """A job stopped or failed before its shards were read at the end: their counters as last seen."""
        if not run.shard_stats:
            run.shard_stats = self.last_shard_stats()

    def report(self, run: JobRun) -> dict:
        return {
            "addresses": self.addresses,
            "worker_exits": self.worker_exits(),
            "restarts": self.restarts,
            "resumed": self.resumed,
        }


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines()) or "    (empty log)"


def launch(
    job: JobConfig, progress: bool | None = None, *, resume: bool = False, command: list[str] | None = None
) -> int:
    """Run ``job`` on this machine; returns the exit code (0 ok, 1 job failed, 128+N on signal N).

    With ``resume``, ``job.out`` is a stopped job's folder: its shards restore their checkpoints.
    With ``command``, each worker runs it instead of the built-in trainer (cluster/run/script.py).
    """
    resumed = None
    if resume:
        from dataclasses import asdict

        from psgrid.cluster.run import resume as resuming

        lock(Path(job.out))  # a job still running there is said as such, before its checkpoints are read
        try:
            alignment = resuming.align(job, resuming.check_resumable(job, Path(job.out)))
            if command is None:
                resuming.refuse_completed(job, alignment.restore)
        except UsageError:
            release(Path(job.out))  # refused before anything moved: the folder is free (psgrid.launch callers)
            raise
        with signals_held():  # every shard rewound before a Ctrl-C is heard
            resuming.rewind(job, alignment, Path(job.out))  # before prepare_out, which archives what it moved aside
        print(f"psctl launch: {resuming.describe(alignment)}", file=sys.stderr, flush=True)
        resumed = [asdict(c) for c in alignment.restore]
    out = prepare_out(job, resume=resume)
    old = listen_for_interrupts()
    try:
        summary = Launcher(job, out, progress, resumed=resumed, command=command).run()
    except JobFailed as e:
        if e.status != "failed":  # a mistake of the user's, said in one line
            print(f"psctl launch: {e} (status {e.status}; summary in {out / 'summary.json'})", file=sys.stderr)
            return 1
        print(f"psctl launch: job failed: {e}", file=sys.stderr)
        print(f"psctl launch: summary in {out / 'summary.json'}", file=sys.stderr)
        return 1
    except Interrupted as e:
        print(f"psctl launch: {e}: stopped every child; partial results in {out}", file=sys.stderr)
        return 128 + e.signum
    except Exception:
        # A Ctrl-C that lands inside library code can come out as that code's own error (a
        # half-opened file's OSError): it was the Ctrl-C, and the exit code says so.
        signum = signal_heard()
        if signum is None:
            raise
        print(
            f"psctl launch: {signal.Signals(signum).name}: stopped every child; partial results in {out}",
            file=sys.stderr,
        )
        return 128 + signum
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    tolerated = [f for f in summary["failures"] if f["tolerated"]]
    for f in tolerated:
        print(
            f"psctl launch: tolerated failure: {f['name']} exited with code {f['exit_code']} (log: {f['log']})",
            file=sys.stderr,
        )
    print(co.headline(summary))
    print(f"psctl launch: summary in {out / 'summary.json'}, metrics in {out / 'metrics.jsonl'}", file=sys.stderr)
    return 0
