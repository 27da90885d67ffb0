"""``psctl launch``: a whole job on this machine, S shard processes and W worker processes.

The launcher writes the resolved job to ``OUT/job.toml`` (every child reads it, and it
records exactly what ran), starts the shards on port 0 and waits for the addresses they
publish in ``OUT/addr/shard-I``, starts the workers, follows their metrics for the
progress bar, and at the end evaluates, stops the shards and writes ``OUT/summary.json``
and ``OUT/metrics.jsonl``.

What the job survives: a worker that fails is evicted by the shards after ``lease_s``
and the others go on (in every mode), so worker failures are tolerated as long as one
worker completes; they are listed in the summary.  A shard holds a slice of the weights
that exists nowhere else, so a shard that exits early ends the job.
"""

from __future__ import annotations

import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from psgrid.cluster import coordinator as co
from psgrid.cluster.config import JobConfig
from psgrid.cluster.errors import JobFailed, UsageError
from psgrid.cluster.procs import Child, child_env, psctl_argv, stop_children, usable_cpus

POLL_S = 0.2
STOP_GRACE_S = 5.0
SERVER_EXIT_TIMEOUT_S = 15.0


class Interrupted(Exception):
    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def prepare_out(job: JobConfig) -> Path:
    out = Path(job.out or job.default_out())
    if out.exists() and any((out / name).exists() for name in ("summary.json", "metrics", "addr", "logs")):
        raise UsageError(f"{out} already holds a run; choose another --out or remove it")
    for sub in ("addr", "logs", "metrics"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    return out


class Launcher:
    """Runs one job; :meth:`run` returns the summary or raises JobFailed / Interrupted after cleaning up."""

    def __init__(self, job: JobConfig, out: Path, progress: bool | None = None, *, bar=None,
                 quiet: bool = False):
        self.job = job
        self.out = out
        self.progress_enabled = progress
        self.bar = bar          # a caller's progress bar (psctl compare's, over many jobs) instead of our own
        self.quiet = quiet
        self.shards: list[Child] = []  # the psctl server processes, in shard order
        self.workers: list[Child] = []
        self.addresses: list[str] = []
        self.failures: list[dict] = []
        self.state = co.JobState()
        self.tail = co.MetricsTail()
        self.log = co.EventLog(out / "metrics" / "coordinator.jsonl")
        self.job_file = out / "job.toml"
        self.job_file.write_text(f"# resolved job, as run by psctl launch\n{job.to_toml()}")
        cpus = usable_cpus()
        self.worker_env = child_env(threads=max(1, cpus // job.workers))
        self.shard_env = child_env(threads=1)

    # -- phases ------------------------------------------------------------------------------

    def start_shards(self) -> None:
        job = self.job
        for i in range(job.shards):
            addr_file = self.out / "addr" / f"shard-{i}"
            argv = psctl_argv("server", "--config", str(self.job_file), "--shard", str(i),
                              "--num-shards", str(job.shards), "--port", "0", "--address-file", str(addr_file))
            with _deferred_signals():  # a signal between fork and append would leave a child we do not know
                self.shards.append(Child(f"server {i}", argv, self.out / "logs" / f"server-{i}.log",
                                         self.shard_env))
        deadline = time.monotonic() + job.start_timeout_s
        files = [self.out / "addr" / f"shard-{i}" for i in range(job.shards)]
        while not all(f.exists() for f in files):
            self._check_shards()
            if time.monotonic() > deadline:
                missing = [s.name for s, f in zip(self.shards, files) if not f.exists()]
                raise JobFailed(f"{', '.join(missing)} did not publish an address within "
                                f"{job.start_timeout_s:.0f} s; see {self.out / 'logs'}")
            time.sleep(0.05)
        self.addresses = [f.read_text().strip() for f in files]
        self.log("shards_ready", addresses=self.addresses, pids=[s.pid for s in self.shards])

    def start_workers(self) -> None:
        job = self.job
        addresses = ",".join(self.addresses)
        for rank in range(job.workers):
            metrics = self.out / "metrics" / f"worker-{rank}.jsonl"
            argv = psctl_argv("worker", "--config", str(self.job_file), "--addresses", addresses,
                              "--rank", str(rank), "--world", str(job.workers), "--metrics", str(metrics))
            env = dict(self.worker_env, LOCAL_RANK=str(rank))
            with _deferred_signals():
                self.workers.append(Child(f"worker {rank}", argv, self.out / "logs" / f"worker-{rank}.log", env))
            self.tail.add(metrics)
        self.log("workers_started", pids=[w.pid for w in self.workers])

    def follow(self) -> float:
        """Wait for every worker to end, feeding the progress bar; returns the training wall time."""
        job = self.job
        start = time.monotonic()
        progress = self.bar or co.Progress(co.total_steps(job), self.progress_enabled, desc=f"{job.name} {job.mode}")
        reported: set[int] = set()
        try:
            while True:
                evals = self.state.update(self.tail.read())
                progress.update(self.state, evals)
                self._check_shards()
                for rank, w in enumerate(self.workers):
                    code = w.poll()
                    if code is not None and rank not in reported:
                        reported.add(rank)
                        self.log("worker_exit", rank=rank, exit_code=code)
                        if code != 0:
                            self._record_failure(w, "worker", rank, tolerated=True)
                            progress.bar.write(f"psctl launch: {w.name} {w.describe_exit()}; the others go on "
                                               f"(log: {w.log_path})", file=sys.stderr)
                if len(reported) == len(self.workers):
                    break
                if job.timeout_s and time.monotonic() - start > job.timeout_s:
                    raise JobFailed(f"training did not finish within timeout_s = {job.timeout_s:g} s")
                time.sleep(POLL_S)
            self.state.update(self.tail.read())
            progress.update(self.state, [])
        finally:
            if progress is not self.bar:
                progress.close()
        wall = max((w.ended or time.time()) for w in self.workers) - min(w.started for w in self.workers)
        if not any(w.returncode == 0 for w in self.workers):
            for f in self.failures:
                f["tolerated"] = False
            exits = "; ".join(f"{w.name} {w.describe_exit()}" for w in self.workers)
            first = self.workers[0]
            raise JobFailed(f"no worker completed ({exits}). Last lines of {first.log_path}:\n"
                            f"{_indent(first.tail())}")
        return wall

    def _check_shards(self) -> None:
        for i, s in enumerate(self.shards):
            if s.poll() is not None:
                self._record_failure(s, "server", i, tolerated=False)
                raise JobFailed(f"{s.name} (pid {s.pid}) {s.describe_exit()}; a job cannot go on without "
                                f"one of its shards. Last lines of {s.log_path}:\n{_indent(s.tail())}")

    def _record_failure(self, child: Child, role: str, index: int, tolerated: bool) -> None:
        if any(f["name"] == child.name for f in self.failures):
            return
        self.failures.append({
            "name": child.name, "role": role, "index": index, "pid": child.pid,
            "exit_code": child.returncode, "tolerated": tolerated, "log": str(child.log_path),
            "tail": child.tail(10),
        })

    def wait_shards(self) -> None:
        deadline = time.monotonic() + SERVER_EXIT_TIMEOUT_S
        for s in self.shards:
            s.wait(deadline - time.monotonic())
        stop_children(self.shards, STOP_GRACE_S)

    def stop_all(self) -> None:
        stop_children(self.workers + self.shards, STOP_GRACE_S)

    # -- the whole job -----------------------------------------------------------------------

    def run(self) -> dict:
        t0 = time.monotonic()
        job = self.job
        self.log("job_start", name=job.name, mode=job.mode, shards=job.shards, workers=job.workers,
                 out=str(self.out))
        status, message = "ok", None
        evaluation, shard_stats, train_wall = None, [], None
        try:
            self.start_shards()
            if not self.quiet:
                print(f"psctl launch: {job.shards} shard(s) at {','.join(self.addresses)}; starting "
                      f"{job.workers} worker(s); logs in {self.out / 'logs'}", file=sys.stderr, flush=True)
            self.start_workers()
            train_wall = self.follow()
            evaluation, shard_stats = co.finish(job, self.addresses)
            self.log("final_eval", **(evaluation or {}))
            for s in shard_stats:
                self.log("shard_stats", **s)
            self.wait_shards()
        except JobFailed as e:
            status, message = "failed", str(e)
            raise
        except Interrupted as e:
            status, message = "interrupted", f"stopped by {e}"
            raise
        except Exception as e:
            # Evaluation, stats or shutdown failing after training: the job did not complete cleanly.
            status, message = "failed", f"{type(e).__name__}: {e}"
            raise JobFailed(message) from e
        finally:
            _ignore_signals()
            self.stop_all()
            exits = {rank: w.returncode for rank, w in enumerate(self.workers)}
            self.log("job_end", status=status, message=message)
            self.log.close()
            summary = co.build_summary(
                job, launcher="launch", status=status, addresses=self.addresses, state=self.state,
                train_wall_s=train_wall, total_wall_s=time.monotonic() - t0, evaluation=evaluation,
                shard_stats=shard_stats, failures=self.failures, worker_exits=exits, out=str(self.out),
                message=message,
            )
            co.merge_metrics(sorted((self.out / "metrics").glob("*.jsonl")), self.out / "metrics.jsonl")
            co.write_json(self.out / "summary.json", summary)
        return summary


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.splitlines()) or "    (empty log)"


_defer = {"depth": 0, "pending": None}


def _raise_interrupted(signum, frame):
    if _defer["depth"]:
        _defer["pending"] = signum
    else:
        raise Interrupted(signum)


@contextmanager
def _deferred_signals():
    """Hold Ctrl-C and SIGTERM until the block ends; a signal mask would be inherited by the children."""
    _defer["depth"] += 1
    try:
        yield
    finally:
        _defer["depth"] -= 1
        pending, _defer["pending"] = _defer["pending"], None
        if pending is not None and not _defer["depth"]:
            raise Interrupted(pending)


def _ignore_signals() -> None:
    # Cleanup is bounded by its own timeouts; a second Ctrl-C must not cut it short and orphan children.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)


def launch(job: JobConfig, progress: bool | None = None) -> int:
    """Run ``job`` on this machine; returns the exit code (0 ok, 1 job failed, 128+N on signal N)."""
    out = prepare_out(job)
    old = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        summary = Launcher(job, out, progress).run()
    except JobFailed as e:
        print(f"psctl launch: job failed: {e}", file=sys.stderr)
        print(f"psctl launch: summary in {out / 'summary.json'}", file=sys.stderr)
        return 1
    except Interrupted as e:
        print(f"psctl launch: {e}: stopped every child; partial results in {out}", file=sys.stderr)
        return 128 + e.signum
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    tolerated = [f for f in summary["failures"] if f["tolerated"]]
    for f in tolerated:
        print(f"psctl launch: tolerated failure: {f['name']} exited with code {f['exit_code']} (log: {f['log']})",
              file=sys.stderr)
    print(co.headline(summary))
    print(f"psctl launch: summary in {out / 'summary.json'}, metrics in {out / 'metrics.jsonl'}", file=sys.stderr)
    return 0

