"""``psgrid.LocalCluster``: a job's shards (and optionally its workers) in the background, for notebooks.

As Dask's ``LocalCluster``::

    with psgrid.LocalCluster(shards=2, mode="sync", lr=0.1) as cluster:
        ps = cluster.init(model)              # this notebook is the job's worker
        for x, y in batches:
            ps.pull(); ...; ps.push(grads, loss=loss)
        ps.close()
    cluster.summary()                         # what summary.json says

The shards run as ``psctl server`` processes (the launcher's own code, cluster/run/launch.py), so
training in the notebook does not share their interpreter. ``workers=W`` also starts W workers
in the background: the built-in trainer of the job, or ``command=[...]`` (your own script, as
``psctl launch -- CMD``); ``wait()`` returns when they are done. Leaving the ``with`` block (or
``close()``) stops every process it started and keeps the summary; a cluster the program forgets
is stopped when it is collected or the interpreter exits. A block left by Ctrl-C or an exception
ends the job as ``interrupted`` or ``failed`` (never ``ok``), said in one line.
"""

from __future__ import annotations

import re
import shlex
import shutil
import sys
import tempfile
import threading
import weakref
from pathlib import Path

from psgrid.cluster.errors import ConfigError, UsageError
from psgrid.cluster.job import rate_schedule
from psgrid.cluster.job.config import JobConfig, apply_overrides, load_job
from psgrid.cluster.job.mode_defaults import note as mode_note
from psgrid.cluster.job.mode_defaults import with_mode_defaults
from psgrid.cluster.job.outdir import release
from psgrid.cluster.run import coordinator as co
from psgrid.cluster.run import script as user_script
from psgrid.cluster.run.hosting import check_placement
from psgrid.cluster.run.jobrun import JobRun
from psgrid.cluster.run.launch import Launcher, prepare_out
from psgrid.cluster.run.preflight import check_job, check_mps, check_shard_device
from psgrid.psserver import files


class LocalCluster:
    """Shards of one job on this machine, started in the background.

    Parameters
    ----------
    shards : int
        Shard processes.
    mode : {"sync", "async", "ssp"}, optional
        Consistency (default: the job's).
    workers : int
        Workers started in the background (0: none; the program joins with :meth:`init`).
    command : list of str, optional
        What each background worker runs (``["python", "train.py"]``); default: the built-in trainer.
    config : str, optional
        A job file or packaged example (``"mnist"``) to start from; default: the defaults.
    out : str, optional
        Output folder (logs, metrics, summary.json); default: a temporary folder, removed on close.
    progress : bool
        Show the background workers' progress bar.
    **settings
        Any job-file key (``lr=0.1``, ``optimizer="adam"``, ``steps=200``, ``server.lease_s=5`` ...).
    """

    def __init__(
        self,
        shards: int = 1,
        mode: str | None = None,
        *,
        workers: int = 0,
        command: list[str] | None = None,
        config: str | None = None,
        out: str | None = None,
        progress: bool = False,
        **settings,
    ):
        job = load_job(config) if config else JobConfig(name="local")
        overrides = {"shards": shards, "mode": mode, **settings}
        # With no background workers the program's own sessions are the job's workers: one unless it says more.
        overrides["workers"] = workers or 1
        if out is not None:
            overrides["out"] = out
        job = _with_settings(job, overrides)
        job, added = with_mode_defaults(job, {key.rpartition(".")[2] for key in settings}, config)
        if line := mode_note(job, added, "psgrid.LocalCluster"):
            print(line, file=sys.stderr, flush=True)
        if (not workers or command is not None) and (line := rate_schedule.derived_note(job)):
            print(f"psgrid.LocalCluster: {line}", file=sys.stderr, flush=True)  # the program's steps are its own
        if workers and command is None:  # background workers of the built-in trainer: what psctl launch checks
            check_job(job)
        check_placement(job, launcher="psgrid.LocalCluster")  # its sessions host no shard
        check_mps(job, launcher="psgrid.LocalCluster")  # its program's process chose its GPU context already
        # Device shards that cannot fit are refused before anything starts; without background workers
        # the model is the program's own (psgrid.init's params), and only the GPU itself is checked.
        check_shard_device(job, {}, sized=bool(workers) and command is None)
        if isinstance(command, (str, bytes)):
            raise UsageError(f"command must be a list of arguments, as subprocess takes: {_as_list(command)}")
        # Checked before the folder is made: a refused command leaves nothing behind, nor a lock in out.
        resolved = user_script.resolve_command(command) if command is not None else None
        self._temporary = out is None
        if out is None:
            out_dir = Path(tempfile.mkdtemp(prefix="psgrid-local-"))
            for sub in ("addr", "logs", "metrics"):
                files.make_dirs(out_dir / sub)
        else:
            out_dir = prepare_out(job)
        self.out = out_dir
        self.command = resolved
        self._launcher = Launcher(
            job,
            out_dir,
            progress,
            quiet=True,
            command=self.command,
            launcher="local",
            bar=None if progress else _NoBar(),
        )
        self._run = self._launcher.jobrun  # its events, the workers' progress, its summary
        self.job = self._launcher.job  # with its token and job id
        self._backend = LocalJob(self._launcher, workers)
        self._summary: dict | None = None
        # Stops the processes of a cluster nobody closed, when it is collected or at interpreter exit.
        self._finalizer = weakref.finalize(self, _stop, self._launcher, out_dir, self._temporary)
        try:
            self._run.begin(self._backend, launcher="local")  # the rest of the lifecycle when it is closed
        except BaseException:
            self._finalizer()
            raise

    # ----- what it gives ----------------------------------------------------------------------------

    @property
    def addresses(self) -> list[str]:
        """Every shard's ``host:port``, in shard order."""
        return list(self._launcher.addresses)

    @property
    def token(self) -> str | None:
        """The job's bearer token (made for it; every client needs it)."""
        return self.job.server.token

    def client(self, spec, **options):
        """A :class:`psgrid.Client` of this cluster's shards (join it with ``with``); ``options`` override the job's."""
        from psgrid.psserver.client.client import Client
        from psgrid.worker.api import CLIENT_SETTINGS

        self._require_open("client")
        train = self.job.train
        settings = {key: getattr(train, key) for key in CLIENT_SETTINGS}
        settings.update(token=self.token, **options)
        return Client(self.addresses, spec, **settings)

    def init(self, params, *, rank: int = 0, world: int | None = None, **options):
        """:func:`psgrid.init` on this cluster: a session of worker ``rank`` of ``world`` (default: the job's)."""
        from psgrid.worker.api import init

        self._require_open("init")
        options.setdefault("token", self.token)
        metrics = self.out / "metrics" / f"worker-{rank}.jsonl"
        self._run.tail.add(metrics)  # its records make the summary
        return init(
            params,
            addresses=self.addresses,
            rank=rank,
            world=world or self.job.workers,
            metrics=str(metrics),
            job_file=str(self.out / "job.toml"),
            **options,
        )

    def stats(self) -> list[dict]:
        """Every shard's clocks, members and counters now."""
        from psgrid.worker.loop import make_admin

        self._require_open("stats")
        with make_admin(self.job.train, self.addresses, deadline_s=10.0, retry_s=2.0) as admin:
            return admin.stats()

    def wait(self, timeout: float | None = None) -> None:
        """Until the background workers are done (none: at once); raises JobFailed if none completed."""
        thread, outcome = self._backend.thread, self._backend.outcome
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"the workers are still training after {timeout} s")
        if "error" in outcome:
            raise outcome["error"]

    def summary(self) -> dict:
        """What summary.json says: the final one once closed, else the job so far (``status`` "running")."""
        if self._summary is not None:
            return self._summary
        self._run.refresh()
        return self._build(status="running", shard_stats=self._stats_or_none())

    def _require_open(self, what: str) -> None:
        """Refuse ``what`` of a closed cluster in one line (its shards are gone: it read as a lost job file, or retried)."""
        if self._summary is not None:
            raise RuntimeError(
                f"LocalCluster.{what}: this cluster is closed (its shards have stopped); its summary() is kept"
            )

    # ----- closing ----------------------------------------------------------------------------------

    def close(self) -> dict:
        """Stop the workers still running, read the shards' counters, stop the shards; returns the summary."""
        return self._close(None)

    def _close(self, error: BaseException | None) -> dict:
        """:meth:`close`; ``error`` ended the ``with`` block, and so the job (interrupted or failed)."""
        if self._summary is not None:
            return self._summary
        run = self._run
        if isinstance(error, KeyboardInterrupt):
            run.status, run.message = "interrupted", "KeyboardInterrupt inside the with block"
        elif error is not None:
            run.status, run.message = "failed", f"{type(error).__name__} inside the with block: {error}"
        try:
            run.conclude(self._backend)
        finally:
            self._summary = run.final_summary
            self._finalizer()
        if error is not None:
            kept = "" if self._temporary else f"; summary in {self.out / 'summary.json'}"
            print(
                f"psgrid.LocalCluster: {run.message}: stopped its processes, job {run.status}{kept}",
                file=sys.stderr,
                flush=True,
            )
        return self._summary

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._close(exc)

    def __repr__(self) -> str:
        state = "closed" if self._summary is not None else f"at {','.join(self.addresses)}"
        return f"LocalCluster({self.job.shards} shards, {self.job.mode}, {state})"

    # ----- helpers ----------------------------------------------------------------------------------

    def _stats_or_none(self) -> list[dict]:
        try:
            return [co.shard_summary(s) for s in self.stats()]
        except Exception:  # noqa: BLE001 - a live summary without counters is still a summary
            return []

    def _build(self, **fields) -> dict:
        backend = self._backend
        wall = backend.outcome.get("train_wall_s")
        return self._run.summary(**backend.report(self._run), train_wall_s=wall, **fields)


class LocalJob:
    """A LocalCluster's job as cluster/run/jobrun.py's Backend: the launcher's shards and background workers,
    whose ends are awaited when the cluster is closed (a thread follows them meanwhile)."""

    def __init__(self, launcher: Launcher, workers: int):
        self.launcher = launcher
        self.background = workers  # workers started here (0: the program's own sessions are the workers)
        self.thread: threading.Thread | None = None
        self.outcome: dict = {}  # the background workers' training wall time, or the error that ended them

    def start(self, run: JobRun) -> None:
        self.launcher.start_shards()
        if self.background:
            self.launcher.start_workers()
            self.thread = threading.Thread(target=self._follow_workers, name="psgrid-local-cluster", daemon=True)
            self.thread.start()

    def _follow_workers(self) -> None:
        try:
            self.outcome["train_wall_s"] = self.launcher.follow()
        except Exception as exc:  # noqa: BLE001 - handed to wait() and close()
            self.outcome["error"] = exc

    def follow(self, run: JobRun) -> float | None:
        """At close: the background workers' end; those still training are stopped (the job was closed)."""
        if self.thread is not None and self.thread.is_alive():
            if run.status == "ok":
                run.status, run.message = "interrupted", "closed while its workers were training"
            self.launcher.stop_workers()
            self.thread.join(30)
        if "error" in self.outcome and run.status == "ok":
            run.status, run.message = "failed", str(self.outcome["error"])
        return self.outcome.get("train_wall_s")

    def finish(self, run: JobRun) -> None:
        self.launcher.stop_watching()
        run.refresh()
        # Without background workers the program's own sessions trained: their evaluations are the job's.
        run.finish(self.launcher.addresses, evaluate=run.status == "ok", workers_evaluate=not self.background)
        self.launcher.wait_shards()

    def stop(self, run: JobRun) -> None:
        self.launcher.stop_all()
        self.launcher.keep_last_shard_stats(run)

    def report(self, run: JobRun) -> dict:
        return {"addresses": list(self.launcher.addresses), "worker_exits": self.launcher.worker_exits()}


def _with_settings(job: JobConfig, settings: dict) -> JobConfig:
    """``job`` with the constructor's settings; a wrong one is named as the call gave it, with a did-you-mean."""
    try:
        return apply_overrides(job, settings)
    except ConfigError:
        pass
    for key, value in settings.items():  # which one: the job-file message would name an "override"
        try:
            apply_overrides(job, {key: value})
        except ConfigError as e:
            said = re.sub(r"^.*?: \[(job|server|train)\] ", "", str(e)).replace(" in a job file", "")
            raise ConfigError(f"psgrid.LocalCluster({key}={value!r}): {said}") from None
    return apply_overrides(job, settings)  # settings that are wrong only together: as the job file says


class _NoBar:
    """What the launcher needs of a progress bar, without one (tqdm starts a thread even for a hidden bar)."""

    class bar:  # noqa: N801 - stands for the tqdm instance a progress bar holds
        @staticmethod
        def write(text: str, file=None) -> None:
            print(text, file=file or sys.stderr, flush=True)

    def update(self, state, evals) -> None:
        pass


def _stop(launcher: Launcher, out: Path, temporary: bool) -> None:
    """Stop every process and thread a cluster started and remove its temporary folder (also for one never closed)."""
    launcher.stop_all()
    launcher.jobrun.close()
    release(out)
    if temporary:
        shutil.rmtree(out, ignore_errors=True)


def _as_list(command: str | bytes) -> str:
    """How a command given as one string reads as a list, for the refusal (its own words where it will not split)."""
    text = command.decode(errors="replace") if isinstance(command, bytes) else command
    try:
        return repr(shlex.split(text))
    except ValueError:  # unbalanced quotes
        return f"[...] (the words of {text!r})"
