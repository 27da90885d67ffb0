"""The user's own command, once per worker: ``psctl launch -- CMD`` and ``psctl mpi -- CMD``.

As ``torchrun`` and ``horovodrun`` do, the shards start as for any job, then each worker runs the
user's command (``python train.py ARGS``) instead of the built-in trainer, with the job in its
environment (worker/env.py: shard addresses, rank, world size, local rank and GPU, the token, TLS
files, the metrics file). A script that uses ``psgrid.init`` writes the built-in loop's records
to that metrics file, so the launcher shows the same progress bar and writes the same summary.

Its output goes to ``OUT/logs/worker-R.log`` as a built-in worker's does, and is copied to the
terminal with each line prefixed by the worker's rank (:class:`OutputRelay`). A failure is a
worker's failure: under ``launch`` (cluster/run/launch.py) and under ``mpi`` alike, a worker whose
command exits non-zero is tolerated while another completes, and one that fails before it
joined is reported gone to the shards at once, so nobody waits for it.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from psgrid.cluster.errors import UsageError
from psgrid.cluster.job import credentials
from psgrid.cluster.job.records import JOB_FILE, write_job_file
from psgrid.cluster.run import coordinator as co
from psgrid.cluster.run.procs import Child, child_env, stop_children, usable_cpus
from psgrid.psserver import files
from psgrid.worker.env import JobEnv

# A bare `python` runs on the interpreter psctl runs on: the script sees psgrid and its dependencies
# even where that interpreter's environment was not activated (torchrun does the same).
PYTHONS = ("python", "python3")
# What makes a process take itself for a rank of an MPI job; a script started by an MPI rank must not
# inherit it, or an mpi4py it imports would try to join the job as that rank.
MPI_PREFIXES = ("PMI_", "PMIX_", "OMPI_", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
POLL_S = 0.1


def resolve_command(command: list[str] | None) -> list[str]:
    """The argv each worker runs, checked before any process starts (UsageError naming the fix)."""
    if not command:
        raise UsageError("nothing after --: give the command each worker runs, e.g. -- python train.py")
    program = command[0]
    if program in PYTHONS:
        program = sys.executable
    elif os.sep not in program:
        found = shutil.which(program)
        if found is None:
            raise UsageError(f"the command after --: no program {program!r} on PATH")
    elif not (os.path.isfile(program) and os.access(program, os.X_OK)):
        raise UsageError(f"the command after --: {program} is not an executable file")
    script = command[1] if len(command) > 1 else ""
    if program == sys.executable and script.endswith(".py") and not os.path.isfile(script):
        raise UsageError(f"the command after --: no script {script} (relative to {os.getcwd()})")
    return [program, *command[1:]]


def for_command(job, command: list[str] | None, *, named: bool = True, local_gpus: bool = True):
    """``job`` as it runs ``command``: named after its script unless a name was given.

    With ``local_gpus`` (psctl launch: every worker runs here) a GPU asked for where none is
    visible is refused before any process starts.
    """
    if command is None:
        return job
    if not named:
        from psgrid.cluster.job.config import apply_overrides

        job = apply_overrides(job, {"name": default_name(command)})
    if local_gpus:
        gpu_for(0, job.train.device)
    return job


def default_name(command: list[str]) -> str:
    """A job name for the command: its script's name (``train`` for ``python train.py``), else its program's."""
    script = next((arg for arg in command[1:] if arg.endswith(".py")), None)
    return Path(script or command[0]).stem or "script"


def visible_gpus() -> int:
    """CUDA devices this process may use, found without loading CUDA (CUDA_VISIBLE_DEVICES, the driver)."""
    mask = os.environ.get("CUDA_VISIBLE_DEVICES")
    if mask is not None:
        count = 0
        for item in mask.split(","):
            if not item.strip() or item.strip().startswith("-"):
                break  # CUDA ignores the list from the first invalid entry on
            count += 1
        return count
    return _driver_gpus()


@functools.lru_cache(maxsize=1)
def _driver_gpus() -> int:
    """The GPUs the NVIDIA driver shows this machine (or container): nvidia-smi, else /proc."""
    if shutil.which("nvidia-smi"):
        try:
            listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            listed = None
        if listed is not None and listed.returncode == 0:
            return sum(line.startswith("GPU ") for line in listed.stdout.splitlines())
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))  # may count GPUs a container cannot use
    except OSError:
        return 0


def gpu_for(local_rank: int, device: str, gpus: int | None = None) -> int | None:
    """The GPU a worker with this local rank uses (as the built-in worker picks: local rank modulo GPUs)."""
    if device == "cpu":
        return None
    gpus = visible_gpus() if gpus is None else gpus
    if gpus == 0:
        if device == "gpu":
            raise UsageError("device = gpu, but no CUDA GPU is visible on this machine: use --device cpu or auto")
        return None
    return local_rank % gpus


def worker_env(
    base: dict[str, str],
    job,
    out: Path,
    addresses: list[str],
    rank: int,
    world: int,
    local_rank: int,
    host_group: tuple[int, ...] | None = None,
) -> dict[str, str]:
    """The environment of worker ``rank``'s command: ``base`` with the job in it (worker/env.py)."""
    out = Path(out).resolve()
    train = job.train

    def path(value):
        return str(Path(value).resolve()) if value else None

    described = JobEnv(
        addresses=list(addresses),
        rank=rank,
        world=world,
        local_rank=local_rank,
        gpu=gpu_for(local_rank, train.device),
        token=train.token,
        tls_ca=path(train.tls_ca),
        tls_cert=path(train.tls_cert),
        tls_key=path(train.tls_key),
        metrics=str(out / "metrics" / f"worker-{rank}.jsonl"),
        job_file=str(out / "job.toml"),
        out=str(out),
        host_group=host_group,
        seed=train.seed,
    )
    env = {k: v for k, v in base.items() if not k.startswith(MPI_PREFIXES)}
    env.update(described.to_env())
    env["LOCAL_RANK"] = str(local_rank)
    return env


def _terminal(line: str) -> None:
    from tqdm import tqdm

    tqdm.write(line, file=sys.stdout)  # above a progress bar, which it redraws


class OutputRelay:
    """Copies the new lines of the workers' logs to the terminal, each prefixed by its worker's rank."""

    def __init__(self, logs: dict[int, Path], write=_terminal):
        self.logs = dict(logs)
        self.write = write
        self._offsets = {rank: 0 for rank in self.logs}
        self._partial = {rank: b"" for rank in self.logs}

    def pump(self, final: bool = False) -> None:
        """Write every complete new line; with ``final``, also what a log ends with after its last newline."""
        for rank, path in self.logs.items():
            try:
                with open(path, "rb") as f:
                    f.seek(self._offsets[rank])
                    data = f.read()
            except FileNotFoundError:
                continue
            self._offsets[rank] += len(data)
            lines = (self._partial[rank] + data).split(b"\n")
            self._partial[rank] = lines.pop()
            if final and self._partial[rank]:
                lines.append(self._partial[rank])
                self._partial[rank] = b""
            for line in lines:
                self.write(f"[rank {rank}] {line.decode('utf-8', errors='replace').rstrip(chr(13))}")


def evaluation(state: co.JobState, shard_stats: list[dict]) -> dict | None:
    """The summary's accuracies: every script's latest eval record, averaged (psctl cannot evaluate their model)."""
    found = state.evaluation()
    if shard_stats:
        found["version"] = max(s.get("version", 0) for s in shard_stats)
    return found or None


def finish(job, addresses: list[str], state: co.JobState) -> tuple[dict | None, list[dict]]:
    """:func:`coordinator.finish` for a job of user commands: the shards' counters, then shut them down."""
    _, shard_stats = co.finish(job, addresses, evaluate=False)
    return evaluation(state, shard_stats), shard_stats


def blas_threads() -> int:
    """The BLAS threads this process runs with (psctl mpi limits them per node), for a child to use as many."""
    from threadpoolctl import threadpool_info

    counts = [info["num_threads"] for info in threadpool_info()]
    return min(counts) if counts else usable_cpus()


def run_on_rank(
    command: list[str],
    job,
    out: Path,
    addresses: list[str],
    rank: int,
    world: int,
    local_rank: int,
    host_group: tuple[int, ...] | None = None,
) -> dict:
    """Run the command as worker ``rank`` of an MPI job; returns the message for the coordinator.

    ``host_group``: where the worker stands among the nodes, for ``aggregate = "host"`` (worker/env.py).

    ``{"result": done record, "events": [...]}`` when it exits 0, ``{"failure": {...}, "events":
    [...]}`` otherwise; a command that failed before it joined is reported gone to the shards first.
    """
    out = Path(out)
    # Not logs/worker-R.log: under psctl mpi that is this rank's own output (mpi_report.tee_to_log),
    # which the relay below writes to; reading it back would prefix the same lines without end.
    log = out / "logs" / f"worker-{rank}-command.log"
    metrics = out / "metrics" / f"worker-{rank}.jsonl"
    files.make_dirs(metrics.parent)
    _ensure_job_file(job, out)
    base = child_env(credentials.child_env(job), threads=blas_threads())
    child = Child(
        f"worker {rank}", command, log, worker_env(base, job, out, addresses, rank, world, local_rank, host_group)
    )
    relay = OutputRelay({rank: log}, write=lambda line: print(line, flush=True))
    try:
        while child.wait(POLL_S) is None:
            relay.pump()
    finally:
        stop_children([child])  # this rank is being stopped: so is its command
        relay.pump(final=True)
    events = co.MetricsTail([metrics]).read()
    if child.returncode == 0:
        done = next((e for e in events if e.get("event") == "done"), {"rank": rank})
        return {"result": {k: v for k, v in done.items() if k != "event"}, "events": events}
    if not any(e.get("event") == "start" for e in events):
        _report_gone(job, addresses, rank)
    print(
        f"psctl mpi: worker {rank} ({' '.join(command)}) {child.describe_exit()} (log: {log})",
        file=sys.stderr,
        flush=True,
    )
    return {
        "failure": {
            "name": child.name,
            "role": "worker",
            "index": rank,
            "pid": child.pid,
            "exit_code": child.returncode,
            "tolerated": True,
            "log": str(log),
            "tail": child.tail(10),
        },
        "events": events,
    }


def _ensure_job_file(job, out: Path) -> None:
    """``OUT/job.toml`` (token redacted) for the command's PSGRID_JOB_FILE, where this node has none yet.

    Every worker rank of a node without a shared file system needs its own; ranks that share one
    write the same text, each through its own temporary file, so a reader never sees half of it.
    """
    if not (out / JOB_FILE).exists():
        write_job_file(out, job, "by psctl mpi")


def _report_gone(job, addresses: list[str], rank: int) -> None:
    """Tell the shards that worker ``rank`` will not join, so the others stop waiting for it."""
    from psgrid.worker.loop import make_admin

    with make_admin(job.train, addresses, deadline_s=10.0, retry_s=2.0) as admin:
        admin.report_gone(rank)


def record_failure(msg: dict, failures: list[dict], log, wrank: int) -> bool:
    """Fold a worker rank's failure message into the coordinator's record; False for a completed worker."""
    failure = msg.get("failure")
    if failure is None:
        return False
    failures.append(failure)
    log("worker_exit", rank=wrank, exit_code=failure["exit_code"])
    print(
        f"psctl mpi: {failure['name']} exited with code {failure['exit_code']}; the others go on "
        f"(log: {failure['log']})",
        file=sys.stderr,
        flush=True,
    )
    return True


def check_joined(state: co.JobState, failures: list[dict]) -> None:
    """A job whose commands all exited 0 and none joined the shards trained nothing: not ``ok``."""
    from psgrid.cluster.errors import JobFailed

    if not state.started and not failures:
        raise JobFailed(
            "no worker joined the job: the command exited 0 without calling psgrid.init, so nothing "
            "was trained; call ps = psgrid.init(model) in it (README, 'Your own training script')",
            status="not_joined",
        )


def check_completed(failures: list[dict], workers: int) -> None:
    """A job in which no worker completed failed, as under psctl launch."""
    from psgrid.cluster.errors import JobFailed

    if len(failures) >= workers:
        for f in failures:
            f["tolerated"] = False
        exits = "; ".join(f"{f['name']} exited with code {f['exit_code']}" for f in failures)
        raise JobFailed(f"no worker completed ({exits})")
