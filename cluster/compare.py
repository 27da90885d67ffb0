"""``psctl compare``: every mode of an experiment on the same job, one run after another, then a report.

The runs are planned by :mod:`psgrid.cluster.experiment` (modes x worker counts x straggler
settings x repeats, repeats outermost) and each writes its own folder ``D/runs/RUN``: a
parameter-server mode is a ``psctl launch`` job, ``allreduce`` a ``psctl allreduce`` job under
the ``mpiexec`` of the ``mpi`` extra. Every run has the job's seed, so every mode starts from the
same weights and sees the same data in the same order.

After each run ``D/results.jsonl`` gets its steps and ``D/summary.csv`` is rewritten, so a stopped
experiment keeps what finished; at the end (also after Ctrl-C) ``D/report.md`` and
``D/report.html`` are written. ``--resume`` skips the runs whose folder holds a finished summary.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from psgrid.cluster import coordinator as co
from psgrid.cluster import credentials
from psgrid.cluster import results as res
from psgrid.cluster.config import JobConfig, apply_overrides
from psgrid.cluster.errors import JobFailed, UsageError
from psgrid.cluster.experiment import NO_STRAGGLERS, Run
from psgrid.cluster.interrupts import Interrupted, listen_for_interrupts
from psgrid.cluster.launch import Launcher, prepare_out
from psgrid.cluster.outdir import LOCK_FILE, lock
from psgrid.cluster.procs import Child, child_env, psctl_argv, stop_children, usable_cpus

SETTINGS_FILE = "experiment.json"
POLL_S = 0.2
# A local all-reduce run is a single-host MPI job: keep every transport on loopback unless told otherwise
# (MPICH's launcher, UCX, libfabric, Open MPI's launcher and TCP transport).
LOCAL_MPI_ENV = {"HYDRA_IFACE": "lo", "UCX_TLS": "self,sm", "UCX_NET_DEVICES": "lo", "FI_TCP_IFACE": "lo",
                 "OMPI_MCA_oob_tcp_if_include": "lo", "OMPI_MCA_btl_tcp_if_include": "lo"}


@dataclass
class Experiment:
    """What to run and where its results go."""

    job: JobConfig                # the base job: every run is this job with its mode, workers and stragglers
    runs: list[Run]
    out: Path
    target: float | None          # test accuracy to reach; None: the highest every run reached
    settings: dict                # written to D/experiment.json and the report

    def run_dir(self, run: Run) -> Path:
        return self.out / "runs" / run.id

    def run_job(self, run: Run) -> JobConfig:
        overrides = {"mode": run.mode.mode, "workers": run.workers, "out": str(self.run_dir(run)),
                     "name": f"{self.job.name}-{run.id}",
                     "stragglers": [] if run.stragglers == NO_STRAGGLERS else run.stragglers.split(",")}
        if run.mode.staleness is not None:
            overrides["staleness"] = run.mode.staleness
        return apply_overrides(self.job, overrides)

    def finished(self, run: Run) -> bool:
        summary = res.read_summary(self.run_dir(run))
        return bool(summary) and summary.get("status") == "ok"


def mpiexec_path() -> str | None:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


def prepare(experiment: Experiment, resume: bool) -> list[Run]:
    """Create or check D; returns the runs still to do."""
    out = experiment.out
    lock(out)       # held while the experiment runs: another psctl compare may not take the folder
    settings_file = out / SETTINGS_FILE
    if settings_file.exists():
        if not resume:
            raise UsageError(f"{out} already holds an experiment; add --resume to finish it, or choose another --out")
        saved = json.loads(settings_file.read_text())
        if _plan_of(saved) != _plan_of(experiment.settings):
            raise UsageError(f"{out} holds an experiment with other settings ({_describe(saved)}); "
                             f"--resume needs the same job, modes, workers, stragglers and repeats")
    elif out.exists() and any(p.name != LOCK_FILE for p in out.iterdir()):
        raise UsageError(f"{out} is not empty and holds no experiment; choose another --out")
    (out / "runs").mkdir(parents=True, exist_ok=True)
    co.write_json(settings_file, experiment.settings)
    todo = []
    for run in experiment.runs:
        if experiment.finished(run):
            continue
        shutil.rmtree(experiment.run_dir(run), ignore_errors=True)   # a run cut short starts again
        todo.append(run)
    return todo


def _plan_of(settings: dict) -> tuple:
    return tuple(json.dumps(settings.get(k), sort_keys=True) for k in ("job", "modes", "workers", "stragglers",
                                                                       "repeats", "backup_workers"))


def _describe(settings: dict) -> str:
    return (f"modes {','.join(settings.get('modes', []))}, workers {settings.get('workers')}, "
            f"stragglers {settings.get('stragglers')}, repeats {settings.get('repeats')}")


class ExperimentProgress:
    """One bar over every step of every run; each run gets a view that feeds it."""

    def __init__(self, runs: list[Run], steps_per_worker: int | None, enabled: bool | None, done: int):
        from tqdm import tqdm

        total = None if not steps_per_worker else sum(steps_per_worker * r.workers for r in runs)
        show = sys.stderr.isatty() if enabled is None else enabled
        self.bar = tqdm(total=total, unit="step", disable=not show, file=sys.stderr, dynamic_ncols=True,
                        mininterval=0.5)
        self.count, self.done = len(runs) + done, done

    def for_run(self, run: Run) -> "RunProgress":
        self.done += 1
        self.bar.set_description(f"[{self.done}/{self.count}] {run.mode.label} w{run.workers} "
                                 f"{'' if run.stragglers == NO_STRAGGLERS else 'stragglers ' + run.stragglers + ' '}"
                                 f"repeat {run.repeat + 1}", refresh=False)
        return RunProgress(self.bar)

    def close(self) -> None:
        self.bar.close()


class RunProgress:
    """The Progress surface :class:`~psgrid.cluster.launch.Launcher` feeds, adding to the experiment's bar."""

    def __init__(self, bar):
        self.bar, self.shown = bar, 0

    @property
    def enabled(self) -> bool:
        return not self.bar.disable

    def update(self, state: co.JobState, evals: list[dict]) -> None:
        if state.steps > self.shown:
            self.bar.update(state.steps - self.shown)
            self.shown = state.steps
        post = co.postfix(state)
        if post and self.enabled:
            self.bar.set_postfix(post, refresh=False)

    def close(self) -> None:
        pass


def run_parameter_server(job: JobConfig, out: Path, progress: RunProgress) -> None:
    """One parameter-server run, as ``psctl launch`` runs it (JobFailed / Interrupted propagate)."""
    Launcher(job, prepare_out(job), bar=progress, quiet=True).run()


def run_allreduce_local(job: JobConfig, out: Path, progress: RunProgress) -> None:
    """One all-reduce run: ``mpiexec -n W psctl allreduce`` on this machine."""
    out.mkdir(parents=True, exist_ok=True)
    job_file = out / "job.toml"
    job_file.write_text(f"# resolved job, as run by psctl compare\n{job.to_toml()}")
    argv = [mpiexec_path(), "-n", str(job.workers),
            *psctl_argv("allreduce", "--config", str(job_file), "--out", str(out), "--no-progress",
                       "--ranks", str(job.workers))]
    env = child_env(credentials.child_env(job), threads=max(1, usable_cpus() // job.workers))
    for key, value in LOCAL_MPI_ENV.items():
        env.setdefault(key, value)
    state, tail = co.JobState(), co.MetricsTail(out / "metrics" / f"worker-{r}.jsonl" for r in range(job.workers))
    child = Child("mpiexec (allreduce)", argv, out / "mpiexec.log", env)
    try:
        while child.poll() is None:
            progress.update(state, state.update(tail.read()))
            if job.timeout_s and time.time() - child.started > job.timeout_s:
                raise JobFailed(f"training did not finish within timeout_s = {job.timeout_s:g} s")
            time.sleep(POLL_S)
        progress.update(state, state.update(tail.read()))
    finally:
        stop_children([child], 5.0)
    if child.returncode != 0 or res.read_summary(out) is None:
        raise JobFailed(f"mpiexec -n {job.workers} psctl allreduce {child.describe_exit()}. "
                        f"Last lines of {child.log_path}:\n{child.tail()}")


class Compare:
    """Runs an :class:`Experiment` on this machine; :meth:`run` returns the exit code."""

    def __init__(self, experiment: Experiment, *, resume: bool = False, progress: bool | None = None):
        self.x = experiment
        self.resume = resume
        self.progress_enabled = progress

    def run(self) -> int:
        x = self.x
        if any(not r.mode.uses_shards for r in x.runs) and not mpiexec_path():
            raise UsageError("the allreduce mode runs under mpiexec, which was not found: "
                             "pip install 'psgrid[mpi]' (it brings mpi4py and MPICH)")
        todo = prepare(x, self.resume)
        skipped = len(x.runs) - len(todo)
        print(f"psctl compare: {len(x.runs)} runs in {x.out}"
              + (f" ({skipped} already finished, skipped)" if skipped else ""), file=sys.stderr, flush=True)
        bar = ExperimentProgress(todo, x.job.train.steps if not x.job.train.epochs else None,
                                 self.progress_enabled, skipped)
        failed, interrupted = [], None
        old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            for run in todo:
                listen_for_interrupts()       # a run's cleanup ignores signals; the next run must hear them again
                try:
                    self.run_one(run, bar.for_run(run))
                except JobFailed as e:
                    failed.append(run)
                    bar.bar.write(f"psctl compare: run {run.id} failed: {e}", file=sys.stderr)
                self.record(run)
        except Interrupted as e:
            interrupted = e
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
            bar.close()
        rows = self.write_results()
        self.print_table(rows)
        if interrupted is not None:
            print(f"psctl compare: {interrupted}: stopped; the finished runs are in {x.out} "
                  f"(psctl compare ... --resume finishes the rest)", file=sys.stderr)
            return 128 + interrupted.signum
        if failed:
            print(f"psctl compare: {len(failed)} run(s) failed: {', '.join(r.id for r in failed)}; "
                  f"see their logs under {x.out / 'runs'}", file=sys.stderr)
            return 1
        return 0

    def run_one(self, run: Run, progress: RunProgress) -> None:
        job, out = self.x.run_job(run), self.x.run_dir(run)
        if run.mode.uses_shards:
            run_parameter_server(job, out, progress)
        else:
            run_allreduce_local(job, out, progress)

    def record(self, run: Run) -> None:
        """Add the run's steps to results.jsonl (an interrupted run's are added when it is done again)."""
        with open(self.x.out / "results.jsonl", "a") as f:
            for line in res.result_lines(run, res.run_events(self.x.run_dir(run))):
                f.write(line + "\n")

    def write_results(self) -> list[dict]:
        return write_results(self.x)

    def print_table(self, rows: list[dict]) -> None:
        print(table_text(rows, self.x.settings.get("target_accuracy")))


def write_results(x: Experiment) -> list[dict]:
    """summary.csv, a results.jsonl of exactly the runs there are, and the report; returns the rows."""
    from psgrid.cluster.report import write_report

    present = [r for r in x.runs if res.read_summary(x.run_dir(r)) is not None]
    events = {r.id: res.run_events(x.run_dir(r)) for r in present}
    target, source = x.target, "given"
    if target is None:
        reached = [res.best_accuracy(events[r.id]) for r in present
                   if res.read_summary(x.run_dir(r)).get("status") == "ok"]
        target = min((a for a in reached if a is not None), default=None)
        source = "auto"
    rows = [res.summarize_run(r, res.read_summary(x.run_dir(r)), events[r.id], target) for r in present]
    res.write_csv(x.out / "summary.csv", rows)
    with open(x.out / "results.jsonl.tmp", "w") as f:
        for r in present:
            for line in res.result_lines(r, events[r.id]):
                f.write(line + "\n")
    os.replace(x.out / "results.jsonl.tmp", x.out / "results.jsonl")
    if rows:
        write_report(x.out, dict(x.settings, target_accuracy=target, target_source=source), rows, events)
    return rows


def rewrite_report(out: Path, target: float | None = None) -> list[dict]:
    """Write summary.csv, results.jsonl and the report of the experiment in ``out`` again, from its runs.

    Nothing is run; the settings (machine included) are those saved when it ran, except the target
    accuracy when one is given.
    """
    from psgrid.cluster.config import job_from_dict
    from psgrid.cluster.experiment import parse_modes, plan

    try:
        settings = json.loads((out / SETTINGS_FILE).read_text())
    except (FileNotFoundError, ValueError):
        raise UsageError(f"{out} holds no experiment ({SETTINGS_FILE} is missing or unreadable)") from None
    runs = plan(parse_modes(",".join(settings["modes"])), settings["workers"], settings["stragglers"],
                settings["repeats"])
    if target is not None:
        settings.update(target_accuracy=target, target_source="given")
    x = Experiment(job_from_dict(settings["job"]), runs, out, settings.get("target_accuracy"), settings)
    return write_results(x)


def table_text(rows: list[dict], target: float | None) -> str:
    """The terminal's summary: one line per run."""
    head = f"{'run':<28} {'status':<11} {'to target':>10} {'test acc':>8} {'samples/s':>10} {'staleness':>9}"
    lines = [head + (f"   (target {target:.4f})" if target is not None else "")]
    for r in rows:
        ttt = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.2f} s"
        acc = "-" if r["final_test_accuracy"] is None else f"{r['final_test_accuracy']:.4f}"
        sps = "-" if r["samples_per_s"] is None else f"{r['samples_per_s']:.0f}"
        st = "-" if r["mean_staleness"] is None else f"{r['mean_staleness']:.2f}"
        lines.append(f"{r['run']:<28} {r['status']:<11} {ttt:>10} {acc:>8} {sps:>10} {st:>9}")
    return "\n".join(lines)


def machine() -> dict:
    """Where the experiment ran, for the report."""
    info = {"host": socket.gethostname(), "cpus": usable_cpus(), "platform": platform.platform(terse=True),
            "python": platform.python_version()}
    try:
        info["load_1m"] = round(os.getloadavg()[0], 2)
    except OSError:
        pass
    return info


def gpu_name(device: str) -> str | None:
    if device == "cpu":
        return None
    try:
        import cupy

        count = cupy.cuda.runtime.getDeviceCount()
        name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
        return f"{count} x {name}"
    except Exception:  # noqa: BLE001 - no CuPy or no GPU: the workers ran on the CPU
        return None


def job_summary(job: JobConfig) -> str:
    t, s = job.train, job.server
    model = t.model + (f" {list(t.hidden)} {t.activation}" if t.model == "mlp" else "")
    batch = "full batch" if t.batch_size == 0 else f"batch {t.batch_size} per worker"
    length = f"{t.epochs} epochs" if t.epochs else f"{t.steps} steps per worker"
    opt = f"{s.optimizer} lr {s.lr:g}" + (f" momentum {s.momentum:g}" if s.optimizer == "sgd" and s.momentum else "")
    return (f"{model} on {t.dataset}, {batch}, {length}, {opt} on the shards, {job.shards} shard(s), "
            f"{'shared memory on one host, else ' if t.shared_memory else ''}{t.data_plane} data plane, "
            f"device {t.device}, seed {t.seed}")


def settings_for(job: JobConfig, *, command: list[str], modes, workers, stragglers, repeats: int,
                 target: float | None, backup_workers: int | None) -> dict:
    info = machine()
    info["gpu"] = gpu_name(job.train.device)
    return {
        "command": "psctl compare " + shlex.join(command),
        "modes": [m.label for m in modes], "workers": list(workers), "stragglers": list(stragglers),
        "repeats": repeats, "backup_workers": backup_workers, "target_accuracy": target,
        "target_source": "given" if target is not None else "auto",
        "machine": info, "job_summary": job_summary(job), "job": job.public_dict(),
        "title": f"psctl compare: {job.name}",
    }

