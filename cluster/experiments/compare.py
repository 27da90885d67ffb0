"""``psctl compare``: every mode of an experiment on the same job, one run after another, then a report.

The runs are planned by :mod:`psgrid.cluster.experiments.experiment` (modes x worker counts x straggler
settings x repeats, repeats outermost) and each writes its own folder ``D/runs/RUN``: a
parameter-server mode is a ``psctl launch`` job, ``allreduce`` a ``psctl allreduce`` job under
the ``mpiexec`` of the ``mpi`` extra. Repeat r of every mode has the same seed (base+r unless
pinned: experiment.repeat_seeds), so within a repeat every mode starts from the same weights and
sees the same data in the same order, and across repeats those differ.

With ``--tune`` the tune runs (:mod:`psgrid.cluster.experiments.tuning`) come first, then the repeats at each
mode's best point; with a command after ``--`` every parameter-server run runs it as ``psctl launch
-- CMD`` does (cluster/run/script.py), and its numbers are what ``psgrid.init``'s session logged.

After each run ``D/results.jsonl`` gets its steps and ``D/summary.csv`` is rewritten, so a stopped
experiment keeps what finished; at the end (also after Ctrl-C) ``D/report.md`` and
``D/report.html`` are written. ``--resume`` skips the runs whose folder holds a finished summary.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from psgrid.cluster.errors import JobFailed, UsageError
from psgrid.cluster.experiments import provenance, stability, tuning
from psgrid.cluster.experiments import results as res
from psgrid.cluster.experiments import target as targets
from psgrid.cluster.experiments.experiment import NO_STRAGGLERS, TUNE, Mode, Run, Settings, plan, tune_plan
from psgrid.cluster.experiments.resumable import check_resumable
from psgrid.cluster.experiments.settings import schedule_note
from psgrid.cluster.experiments.stability import refused_non_finite
from psgrid.cluster.job import credentials
from psgrid.cluster.job.config import JobConfig, apply_overrides
from psgrid.cluster.job.outdir import LOCK_FILE, lock
from psgrid.cluster.job.records import write_job_file
from psgrid.cluster.mpi import hydra_topology
from psgrid.cluster.mpi.mpiexec import mpiexec_path, unbound_args
from psgrid.cluster.run import coordinator as co
from psgrid.cluster.run.interrupts import Interrupted, listen_for_interrupts
from psgrid.cluster.run.launch import Launcher, prepare_out
from psgrid.cluster.run.procs import Child, child_env, psctl_argv, stop_children, usable_cpus
from psgrid.psserver import files

SETTINGS_FILE = "experiment.json"
CHOSEN_FILE = "chosen.json"  # with --tune: the points the repeats run at, fixed once the tune runs are done
POLL_S = 0.2
# A local all-reduce run is a single-host MPI job: keep every transport on loopback unless told otherwise
# (MPICH's launcher, UCX, libfabric, Open MPI's launcher and TCP transport), and let MPICH's launcher
# write no topology file that a failed run would leave in /tmp (cluster/mpi/hydra_topology.py).
LOCAL_MPI_ENV = {
    "HYDRA_IFACE": "lo",
    "UCX_TLS": "self,sm",
    "UCX_NET_DEVICES": "lo",
    "FI_TCP_IFACE": "lo",
    "OMPI_MCA_oob_tcp_if_include": "lo",
    "OMPI_MCA_btl_tcp_if_include": "lo",
    **hydra_topology.ENV,
}


@dataclass
class Experiment:
    """What to run and where its results go."""

    job: JobConfig  # the base job: every run is this job with its mode, workers and stragglers
    modes: list[Mode]
    workers: list[int]
    stragglers: list[str]
    repeats: int
    out: Path
    target: float | None  # test accuracy to reach; None: by the rule of target.py
    settings: dict  # written to D/experiment.json and the report
    grid: list[Settings] = field(default_factory=list)  # --tune's points; empty: no tuning
    tune_steps: int | None = None  # steps per worker of a tune run; None: the job's
    mode_settings: dict[str, Settings] = field(default_factory=dict)  # per mode label, on every run of it
    command: list[str] | None = None  # the user's script, run by each worker
    seeds: list[int] | None = None  # repeat r's seed; None: the job's for every run
    tune_repeats: int = 1  # runs of each grid point
    tensorboard: Path | None = None  # where each run's TensorBoard events go
    attempt: dict | None = None  # this attempt's record (provenance.attempt_of), once prepare has checked D

    def ran(self, run: Run) -> None:
        """Note in D/experiment.json that this attempt ran ``run``; its first run adds the attempt there."""
        if self.attempt is None:
            return
        attempts = self.settings.setdefault("attempts", [])
        if not any(a is self.attempt for a in attempts):
            attempts.append(self.attempt)
        self.attempt["runs"].append(run.id)
        co.write_json(self.out / SETTINGS_FILE, self.settings)

    @property
    def tune_runs(self) -> list[Run]:
        if not self.grid:
            return []
        return [
            Run(
                r.mode,
                r.workers,
                r.stragglers,
                r.repeat,
                self.mode_settings.get(r.mode.label, ()) + r.settings,
                TUNE,
                r.seed,
            )
            for r in tune_plan(self.modes, self.workers, self.stragglers, self.grid, self.tune_repeats, self.seeds)
        ]

    def repeat_runs(self, chosen: dict[tuple, Settings]) -> list[Run]:
        """The repeats, each group at its chosen settings (a group tuning chose nothing for: its mode's own)."""
        settings = {
            (m.label, w, s): chosen.get((m.label, w, s), self.mode_settings.get(m.label, ()))
            for m in self.modes
            for w in self.workers
            for s in self.stragglers
        }
        return plan(self.modes, self.workers, self.stragglers, self.repeats, settings, self.seeds)

    @property
    def runs(self) -> list[Run]:
        """Every run planned so far: the tune runs, then the repeats at the points chosen from them."""
        return self.tune_runs + self.repeat_runs(chosen_settings(self, tune_rows(self)[0]))

    @property
    def classes(self) -> int | None:
        """The number of classes, for the chance test of divergence (a script's: --classes, else None)."""
        if self.settings.get("classes"):
            return int(self.settings["classes"])
        if self.command:
            return None
        return self.job.train.synthetic_classes if self.job.train.dataset == "synthetic" else 10

    def run_dir(self, run: Run) -> Path:
        return self.out / "runs" / run.id

    def run_job(self, run: Run) -> JobConfig:
        overrides = {
            "mode": run.mode.mode,
            "workers": run.workers,
            "out": str(self.run_dir(run)),
            "name": f"{self.job.name}-{run.id}",
            "stragglers": [] if run.stragglers == NO_STRAGGLERS else run.stragglers.split(","),
        }
        if run.mode.staleness is not None:
            overrides["staleness"] = run.mode.staleness
        overrides.update(run.settings)
        if run.seed is not None:
            overrides["seed"] = run.seed
        if run.phase == TUNE and self.tune_steps:
            # A shorter run's rate schedule runs over its own updates (derived from its steps), as the full
            # run's does over the job's: a length the job set would leave a tuning run at nearly full rate.
            overrides.update({"train.steps": self.tune_steps, "train.epochs": 0, "lr_updates": 0})
        return apply_overrides(self.job, overrides)

    def finished(self, run: Run) -> bool:
        return done(self.run_dir(run))


def done(run_dir: Path) -> bool:
    """Whether the run in ``run_dir`` needs no running again: it finished, or it diverged (its result)."""
    summary = res.read_summary(run_dir)
    return bool(summary) and (summary.get("status") == "ok" or refused_non_finite(summary))


def experiment_from(job: JobConfig, settings: dict, out: Path) -> Experiment:
    """The experiment that ``settings`` (as :func:`settings_for` writes them) describe, on ``job``."""
    from psgrid.cluster.experiments.experiment import parse_modes

    def as_settings(pairs) -> Settings:
        return tuple((k, v) for k, v in pairs)

    grid = tuning.points(settings.get("tune") or {})
    mode_settings = {m: as_settings(p) for m, p in (settings.get("mode_defaults") or {}).items()}
    for m, p in (settings.get("mode_settings") or {}).items():  # given for a mode: over its defaults
        given = as_settings(p)
        mode_settings[m] = tuple(kv for kv in mode_settings.get(m, ()) if kv[0] not in dict(given)) + given
    # An experiment written before seeds varied ran every repeat at the job's seed: so it is read back.
    seeds = settings.get("seeds")
    return Experiment(
        job,
        parse_modes(",".join(settings["modes"])),
        list(settings["workers"]),
        list(settings["stragglers"]),
        settings["repeats"],
        out,
        settings.get("target_accuracy"),
        settings,
        grid=grid if settings.get("tune") else [],
        tune_steps=settings.get("tune_steps"),
        mode_settings=mode_settings,
        command=settings.get("script"),
        seeds=list(seeds) if seeds else [job.train.seed] * max(settings["repeats"], 1),
        tune_repeats=int(settings.get("tune_repeats") or 1),
        tensorboard=Path(settings["tensorboard"]) if settings.get("tensorboard") else None,
    )


def prepare(experiment: Experiment, resume: bool) -> list[Run]:
    """Create or check D; returns the runs still to do (with --tune: the tune runs; the repeats come after)."""
    out = experiment.out
    lock(out)  # held while the experiment runs: another psctl compare may not take the folder
    settings_file = out / SETTINGS_FILE
    experiment.attempt = provenance.attempt_of(experiment.settings)
    if settings_file.exists():
        if not resume:
            raise UsageError(f"{out} already holds an experiment; add --resume to finish it, or choose another --out")
        saved = json.loads(settings_file.read_text())
        check_resumable(saved, experiment.settings, out)
        # What ran stays recorded as it ran: this attempt is added once it runs something (Experiment.ran).
        experiment.settings = provenance.resumed(saved, experiment.settings)
    elif out.exists() and any(p.name != LOCK_FILE for p in out.iterdir()):
        raise UsageError(f"{out} is not empty and holds no experiment; choose another --out")
    experiment.settings.setdefault("attempts", [])
    files.make_dirs(out / "runs")
    co.write_json(settings_file, experiment.settings)
    for folder in (f for f in (out / "runs").iterdir() if f.is_dir() and not f.is_symlink()):
        if not done(folder):
            shutil.rmtree(folder, ignore_errors=True)  # a run cut short starts again
    return [r for r in (experiment.tune_runs or experiment.runs) if not experiment.finished(r)]


class ExperimentProgress:
    """One bar over every step of every run; each run gets a view that feeds it."""

    def __init__(self, runs: list[Run], steps_per_worker: int | None, enabled: bool | None, done: int):
        from tqdm import tqdm

        total = None if not steps_per_worker else sum(steps_per_worker * r.workers for r in runs)
        show = sys.stderr.isatty() if enabled is None else enabled
        self.bar = tqdm(
            total=total, unit="step", disable=not show, file=sys.stderr, dynamic_ncols=True, mininterval=0.5
        )
        self.count, self.done = len(runs) + done, done

    def for_run(self, run: Run) -> RunProgress:
        self.done += 1
        self.bar.set_description(
            f"[{self.done}/{self.count}] {'tune ' if run.phase == TUNE else ''}"
            f"{run.mode.label} w{run.workers} "
            f"{'' if run.stragglers == NO_STRAGGLERS else 'stragglers ' + run.stragglers + ' '}"
            + (tuning_label(run) if run.phase == TUNE else f"repeat {run.repeat + 1}")
            + ("" if run.seed is None else f" seed {run.seed}"),
            refresh=False,
        )
        return RunProgress(self.bar)

    def close(self) -> None:
        self.bar.close()


class RunProgress:
    """The Progress surface :class:`~psgrid.cluster.run.launch.Launcher` feeds, adding to the experiment's bar."""

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


def tuning_label(run: Run) -> str:
    from psgrid.cluster.experiments.experiment import settings_text

    return settings_text(run.settings)


def run_parameter_server(job: JobConfig, out: Path, progress: RunProgress, command: list[str] | None = None) -> None:
    """One parameter-server run, as ``psctl launch [-- CMD]`` runs it (JobFailed / Interrupted propagate)."""
    Launcher(job, prepare_out(job), bar=progress, quiet=True, command=command).run()


def run_allreduce_local(job: JobConfig, out: Path, progress: RunProgress) -> None:
    """One all-reduce run: ``mpiexec -n W psctl allreduce`` on this machine, its ranks bound to no core."""
    files.make_dirs(out)
    job_file = write_job_file(out, job, "by psctl compare")
    mpiexec = mpiexec_path()
    argv = [
        mpiexec,
        *unbound_args(mpiexec),
        "-n",
        str(job.workers),
        *psctl_argv(
            "allreduce", "--config", str(job_file), "--out", str(out), "--no-progress", "--ranks", str(job.workers)
        ),
    ]
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
        raise JobFailed(
            f"mpiexec -n {job.workers} psctl allreduce {child.describe_exit()}. "
            f"Last lines of {child.log_path}:\n{child.tail()}"
        )


class Compare:
    """Runs an :class:`Experiment` on this machine; :meth:`run` returns the exit code."""

    def __init__(self, experiment: Experiment, *, resume: bool = False, progress: bool | None = None):
        self.x = experiment
        self.resume = resume
        self.progress_enabled = progress

    def run(self) -> int:
        x = self.x
        if any(not r.mode.uses_shards for r in x.runs) and not mpiexec_path():
            raise UsageError(
                "the allreduce mode runs under mpiexec, which was not found: "
                "pip install 'psgrid[mpi]' (it brings mpi4py and MPICH)"
            )
        todo = prepare(x, self.resume)
        if note := schedule_note(x):
            print(f"psctl compare: {note}", file=sys.stderr, flush=True)
        failed, interrupted = [], None
        old = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            interrupted = self.run_all(todo, len(x.tune_runs or x.runs), failed)
            if x.grid and interrupted is None:
                chosen = chosen_settings(x, tune_rows(x)[0])
                save_chosen(x, chosen)
                repeats = x.repeat_runs(chosen)
                interrupted = self.run_all([r for r in repeats if not x.finished(r)], len(repeats), failed)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
        rows = self.write_results()
        self.print_table(rows)
        if interrupted is not None:
            print(
                f"psctl compare: {interrupted}: stopped; the finished runs are in {x.out} "
                f"(psctl compare ... --resume finishes the rest)",
                file=sys.stderr,
            )
            return 128 + interrupted.signum
        if failed:
            print(
                f"psctl compare: {len(failed)} run(s) failed: {', '.join(r.id for r in failed)}; "
                f"see their logs under {x.out / 'runs'}",
                file=sys.stderr,
            )
            return 1
        return 0

    def run_all(self, todo: list[Run], planned: int, failed: list[Run]) -> Interrupted | None:
        """Run ``todo`` (of ``planned`` runs in this phase), one after another; the Ctrl-C that stopped them."""
        x = self.x
        skipped = planned - len(todo)
        phase = "tune runs" if todo and todo[0].phase == TUNE else "runs"
        print(
            f"psctl compare: {planned} {phase} in {x.out}"
            + (f" ({skipped} already finished, skipped)" if skipped else ""),
            file=sys.stderr,
            flush=True,
        )
        steps = (
            x.tune_steps
            if phase == "tune runs" and x.tune_steps
            else (None if x.job.train.epochs else x.job.train.steps)
        )
        bar = ExperimentProgress(todo, None if x.command else steps, self.progress_enabled, skipped)
        try:
            for run in todo:
                listen_for_interrupts()  # a run's cleanup ignores signals; the next run must hear them again
                try:
                    self.run_one(run, bar.for_run(run))
                except JobFailed as e:
                    if x.finished(run):  # stopped on the shards' non_finite refusal: a result, not a failure
                        bar.bar.write(
                            f"psctl compare: run {run.id} diverged: its weights or gradients turned "
                            f"non-finite and the shards refused them",
                            file=sys.stderr,
                        )
                    else:
                        failed.append(run)
                        bar.bar.write(f"psctl compare: run {run.id} failed: {e}", file=sys.stderr)
                self.record(run)
        except Interrupted as e:
            return e
        finally:
            bar.close()
        return None

    def run_one(self, run: Run, progress: RunProgress) -> None:
        job, out = self.x.run_job(run), self.x.run_dir(run)
        if run.mode.uses_shards:
            run_parameter_server(job, out, progress, self.x.command)
        else:
            run_allreduce_local(job, out, progress)

    def record(self, run: Run) -> None:
        """Add the run's steps to results.jsonl (an interrupted run's are added when it is done again)."""
        events = res.run_events(self.x.run_dir(run))
        with files.open_new(self.x.out / "results.jsonl", "a") as f:
            for line in res.result_lines(run, events):
                f.write(line + "\n")
        self.x.ran(run)
        if self.x.tensorboard is not None:
            from psgrid.cluster.experiments.tensorboard import experiment_logdir, write_run

            write_run(experiment_logdir(self.x.tensorboard, self.x.out), run.id, events)

    def write_results(self) -> list[dict]:
        return write_results(self.x)

    def print_table(self, rows: list[dict]) -> None:
        print(table_text(rows, rows[-1]["target_accuracy"] if rows else None))


def _rows(x: Experiment, runs: list[Run]) -> tuple[list[dict], dict[str, list[dict]]]:
    """The rows (no target yet) and events of those of ``runs`` that have a summary."""
    present = [r for r in runs if res.read_summary(x.run_dir(r)) is not None]
    events = {r.id: res.run_events(x.run_dir(r)) for r in present}
    return [
        res.summarize_run(r, res.read_summary(x.run_dir(r)), events[r.id], None, x.classes) for r in present
    ], events


def tune_rows(x: Experiment) -> tuple[list[dict], dict[str, list[dict]], float | None]:
    """The tune runs' rows, each timed to the tuning target; their events; the target."""
    rows, events = _rows(x, x.tune_runs)
    target = tuning.tuning_target(rows, x.target)
    for row in rows:
        res.set_target(row, events[row["run"]], target)
    return stability.mark(rows), events, target


def chosen_settings(x: Experiment, rows: list[dict]) -> dict[tuple, Settings]:
    """Each (mode, workers, stragglers) group's settings at its best grid point.

    Once the repeats have started they are the saved ones (D/chosen.json): a report written again
    for another target must not relabel the repeats with points they did not run at.
    """
    try:
        saved = json.loads((x.out / CHOSEN_FILE).read_text())
        return {(c["mode"], c["workers"], c["stragglers"]): tuple((k, v) for k, v in c["settings"]) for c in saved}
    except (FileNotFoundError, ValueError, KeyError, TypeError):
        pass
    by_id = {r.id: r.settings for r in x.tune_runs}
    return {group: by_id[runs[0]["run"]] for group, runs in tuning.choose(rows).items()}


def save_chosen(x: Experiment, chosen: dict[tuple, Settings]) -> None:
    co.write_json(
        x.out / CHOSEN_FILE,
        [
            {"mode": m, "workers": w, "stragglers": s, "settings": [list(kv) for kv in p]}
            for (m, w, s), p in chosen.items()
        ],
    )


def write_results(x: Experiment) -> list[dict]:
    """summary.csv, a results.jsonl of exactly the runs there are, and the report; returns the rows."""
    from psgrid.cluster.experiments.report import Tuning, write_report

    tuned, tune_events, tune_target = tune_rows(x)
    chosen = chosen_settings(x, tuned)
    repeats = x.repeat_runs(chosen)
    rows, events = _rows(x, repeats)
    # One target for tuning and the report: the given one, else tuning's, else the rule over the repeats.
    target, source = x.target, targets.GIVEN
    if target is None and x.grid:
        target, source = tune_target, targets.TUNING
    if target is None:
        target, source = targets.auto_target(rows), targets.AUTO
    for row in rows:
        res.set_target(row, events[row["run"]], target)
    stability.mark(rows)
    every = tuned + rows
    res.write_csv(x.out / "summary.csv", every)
    by_id = {r.id: r for r in x.tune_runs + repeats}
    all_events = {**tune_events, **events}
    with files.replacing(x.out / "results.jsonl") as f:
        for row in every:
            for line in res.result_lines(by_id[row["run"]], all_events[row["run"]]):
                f.write(line + "\n")
    if every:
        write_report(
            x.out,
            dict(x.settings, target_accuracy=target, target_source=source),
            rows,
            events,
            tuning=Tuning(tuned, _chosen_runs(x, chosen), tune_target) if x.grid else None,
        )
    return every


def _chosen_runs(x: Experiment, chosen: dict[tuple, Settings]) -> dict[tuple, list[str]]:
    """Each group's chosen point as the ids of its tune runs (one per tune repeat)."""
    runs: dict[tuple, list[str]] = {}
    for r in x.tune_runs:
        if chosen.get((r.mode.label, r.workers, r.stragglers)) == r.settings:
            runs.setdefault((r.mode.label, r.workers, r.stragglers), []).append(r.id)
    return runs


def rewrite_report(
    out: Path,
    target: float | None = None,
    classes: int | None = None,
    tensorboard: str | Path | None = None,
    command: str | None = None,
) -> list[dict]:
    """Write summary.csv, results.jsonl and the report of the experiment in ``out`` again, from its runs.

    Nothing is run; the settings (machine included) are those saved when it ran, except the target
    accuracy and the number of classes when given: those are saved in D/experiment.json with ``command``
    (the ``--report-only`` command line) as ``report_command``, which the report shows beside the command
    that ran the experiment. With ``tensorboard`` every run's events are written there too.
    """
    from psgrid.cluster.job.config import job_from_dict

    try:
        settings = json.loads((out / SETTINGS_FILE).read_text())
    except (FileNotFoundError, ValueError):
        raise UsageError(f"{out} holds no experiment ({SETTINGS_FILE} is missing or unreadable)") from None
    if target is not None:
        settings.update(target_accuracy=target, target_source=targets.GIVEN)
    if classes is not None:
        settings["classes"] = classes
    if target is not None or classes is not None:
        # The report says its target was given: the record says by which command, and keeps it for the next.
        settings["report_command"] = command or "psctl compare --report-only (command not recorded)"
        co.write_json(out / SETTINGS_FILE, settings)
    x = experiment_from(job_from_dict(settings["job"]), settings, out)
    if tensorboard is not None:
        from psgrid.cluster.experiments.tensorboard import experiment_logdir, write_run

        logdir = experiment_logdir(Path(tensorboard), out)
        for run in x.runs:
            if res.read_summary(x.run_dir(run)) is not None:
                write_run(logdir, run.id, res.run_events(x.run_dir(run)))
    return write_results(x)


def table_text(rows: list[dict], target: float | None) -> str:
    """The terminal's summary: one line per run."""
    head = (
        f"{'run':<36} {'seed':>5} {'status':<11} {'to target':>10} {'test acc':>8} {'samples/s':>10} {'staleness':>9}"
    )
    lines = [head + (f"   (target {target:.4f})" if target is not None else "")]
    for r in rows:
        ttt = "-" if r["time_to_target_s"] is None else f"{r['time_to_target_s']:.2f} s"
        acc = "-" if r["final_test_accuracy"] is None else f"{r['final_test_accuracy']:.4f}"
        sps = "-" if r["samples_per_s"] is None else f"{r['samples_per_s']:.0f}"
        st = "-" if r["mean_staleness"] is None else f"{r['mean_staleness']:.2f}"
        status = r["status"]
        if status in ("ok", stability.DIVERGED):
            # What a reader must know first: diverged, or a setting that does not train reliably (stability.py).
            status = "invalid" if r.get("invalid_metrics") else r.get("stability") or status
        seed = "-" if r.get("seed") is None else str(r["seed"])
        lines.append(f"{r['run']:<36} {seed:>5} {status:<11} {ttt:>10} {acc:>8} {sps:>10} {st:>9}")
    return "\n".join(lines)
