"""Checks made before any process of a job starts: each failure is one line that names the fix.

A job that cannot train should say so before shards bind, workers load data or ranks
wait on each other, in words that point at what to change: the flag the user typed
(``--dataset``), or the job-file key when the value came from the file. The commands call

* :func:`check_job` on every job they load (names of models and datasets, steps, TLS
  settings that cannot agree) and :func:`check_device` where workers will run;
* :func:`check_shard_device` where device shards will run (a usable GPU, and room in each
  GPU's free memory for the shards placed on it);
* :func:`refuse_mpi_rank` in ``psctl launch`` (a launcher started once per MPI rank) and
  :func:`require_mpi` in ``psctl mpi`` (mpi4py present, and running under a launcher);
* :func:`check_port_free` before a shard binds a fixed port;
* :func:`probe_shards` before a worker or ``psctl status`` talks to shards: a shard that
  cannot be reached, or whose TLS handshake fails, is named with the reason within
  seconds, instead of after the client's ``retry_s`` of silent retries.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
from collections.abc import Mapping

from psgrid.cluster.errors import ConfigError, UsageError
from psgrid.psserver.client.reach import REACH_WAIT_S, probe

IMAGE_DATASETS = ("mnist5k", "digits")


# What this process's command line set, by job-file key ({"device": "--device"}), for checks made far from it
# (a worker rank of psctl mpi): filled by the command that parsed the flags (cluster/commands/common.py).
command_line: dict[str, str] = {}


class Names:
    """How a message names a setting: the flag or ``--set`` that gave it, else its job-file key and file.

    ``flags`` maps a job-file key to what set it on the command line: ``{"steps": "--steps"}`` or
    ``{"steps": "--set steps=0"}``.
    """

    def __init__(self, flags: Mapping[str, str] | None = None, source: str | None = None):
        self.flags = dict(command_line if flags is None else flags)
        self.source = re.sub(r"( \(with overrides\))+$", "", source or "") or None

    def setting(self, key: str, value) -> str:
        """The setting as the user wrote it: ``--steps 0``, ``--set steps=0`` or ``steps = 0 (job.toml)``."""
        given = self.flags.get(key)
        if given and given.startswith("--set"):
            return given
        if given:
            return f"{given} {value}"
        where = f" ({self.source})" if self.source and not self.source.startswith("override") else ""
        return f"{key} = {_toml(value)}{where}"

    def __call__(self, key: str) -> str:
        """The name to change it by: the flag, else the key."""
        given = self.flags.get(key, key)
        return key if given.startswith("--set") else given


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return json.dumps(value) if isinstance(value, (str, list)) else str(value)


# ---------------------------------------------------------------------------------------------
# The job


def check_job(job, flags: Mapping[str, str] | None = None, *, starts_shards: bool = True) -> None:
    """Refuse a job that cannot train; ``flags`` maps job-file keys to the flags that set them.

    With ``starts_shards`` (launch, mpi, compare) the shards' and the workers' settings must also
    agree; a worker alone (``psctl worker``) talks to shards that someone else configured.

    Raises
    ------
    ConfigError
        One line naming the setting (its flag, or its key) and what to write instead.
    """
    from psgrid.worker.data import DATASETS
    from psgrid.worker.models import MODELS
    from psgrid.worker.models.mlp import ACTIVATIONS

    name = Names(flags, job.source)
    t = job.train
    if t.model not in MODELS:
        raise ConfigError(f"{name.setting('model', t.model)}: no such model; choose {_either(MODELS)}")
    if t.dataset not in DATASETS:
        raise ConfigError(f"{name.setting('dataset', t.dataset)}: no such dataset; choose {_either(DATASETS)}")
    if t.model == "mlp" and t.activation not in ACTIVATIONS:
        raise ConfigError(
            f"{name.setting('activation', t.activation)}: no such activation; choose {_either(ACTIVATIONS)}"
        )
    if t.model == "cnn" and t.dataset not in IMAGE_DATASETS and not (t.dataset == "synthetic" and t.synthetic_image):
        raise ConfigError(
            f"{name.setting('model', t.model)} needs images, and {name.setting('dataset', t.dataset)} "
            f"has flat features: choose {name('dataset')} mnist5k or digits, set synthetic_image = "
            f"[C, H, W], or choose {name('model')} mlp"
        )
    if t.model in ("mlp", "cnn") and (not t.hidden or any(h < 1 for h in t.hidden)):
        raise ConfigError(f"{name.setting('hidden', t.hidden)}: give positive layer widths, e.g. [128]")
    if t.steps == 0 and t.epochs == 0:
        raise ConfigError(
            f"{name.setting('steps', 0)} trains nothing: give {name('steps')} 1 or more (or {name('epochs')} 1 or more)"
        )
    if starts_shards:
        _check_tls_pairing(job)


def check_stragglers(job, flags: Mapping[str, str] | None = None) -> None:
    """Refuse a straggler setting that names a worker the job does not have (psctl compare refuses it alike).

    Called where the number of workers is known: at once by ``psctl launch``, once the ranks are
    counted by ``psctl mpi``.
    """
    from psgrid.worker.straggler import parse_stragglers

    ranks = [s.rank for s in parse_stragglers(job.train.stragglers)]
    if not ranks or max(ranks) < job.workers:
        return
    name = Names(flags, job.source)
    given = name.flags.get("stragglers", "")
    said = (
        f"{given} {','.join(job.train.stragglers)}"
        if given.startswith("--str")
        else name.setting("stragglers", job.train.stragglers)
    )
    raise ConfigError(
        f"{said}: worker {max(ranks)} does not exist in a job of {job.workers} worker"
        f"{'s' if job.workers != 1 else ''} (ranks are 0..{job.workers - 1})"
    )


def _check_tls_pairing(job) -> None:
    """Shards and workers of one job must agree on TLS: what the shards ask for, the workers must have."""
    s, t = job.server, job.train
    if s.tls_ca and not t.tls_cert:
        raise ConfigError(
            "[server] tls_ca makes the shards require client certificates: set [train] tls_cert and "
            "tls_key (psctl certs DIR makes them), or leave out [server] tls_ca"
        )
    if t.tls_ca and not s.tls_cert:
        raise ConfigError(
            "[train] tls_ca asks for TLS but the shards have no certificate: set [server] tls_cert "
            "and tls_key, or leave out [train] tls_ca"
        )


def check_device(train, flags: Mapping[str, str] | None = None) -> None:
    """Refuse ``device = "gpu"`` where CuPy or a CUDA GPU is missing, before anything starts."""
    if train.device != "gpu":
        return
    from psgrid.worker.backend import gpu_unavailable

    why = gpu_unavailable()
    if why:
        raise ConfigError(
            f"{Names(flags).setting('device', 'gpu')}, but {why}: install psgrid[cuda12] or "
            f"psgrid[cuda13] (CuPy for CUDA 12 or 13) on a machine with an NVIDIA GPU, "
            f"or use --device cpu"
        )


def check_shard_device(
    job, flags: Mapping[str, str] | None = None, *, indices=None, sized: bool = True, free_of=None
) -> None:
    """Refuse device shards this host cannot hold, before anything starts.

    ``job.server.shard_device`` as the job gives it (``auto`` is resolved here, as the launchers do);
    nothing is checked, and CuPy never imported, unless the shards resolve to "gpu". Then this process
    must see a GPU, and per GPU the shards ``indices`` (default: all of them) placed on it must fit in
    its free memory (``free_of(gpu)``, default cudaMemGetInfo); ``sized=False`` (a user's script, whose
    model is its own) checks the GPU alone.

    Raises
    ------
    ConfigError
        One line: the setting, what is missing or how much is needed against what is free, and the fix.
    """
    from psgrid.cluster.job.shard_device import resolve_shard_device

    if resolve_shard_device(job.server, job.train) != "gpu":
        return
    from psgrid.cluster.job import memory
    from psgrid.psserver.state.device import gpu_problem

    name = Names(flags, job.source)
    said = name.setting("shard_device", job.server.shard_device)
    if job.server.shard_device == "auto":  # often no one's choice but the default's: the rule is the news
        said = 'shard_device = "auto" (GPU workers, so the shards keep their state on a GPU)'
    problem = gpu_problem()
    if problem is None and sized:
        indices = range(job.shards) if indices is None else indices
        problem = memory.device_shard_problem(
            memory.footprint(job), job, indices, memory.gpu_count(), free_of or memory.gpu_free_bytes
        )
        if problem:
            problem += f"; use fewer workers or a smaller model, or {_host_shards(name)}"
    if problem:
        raise ConfigError(f"{said}: {problem}")


def check_mps(job, *, launcher: str = "psctl launch") -> None:
    """``[job] mps = true`` where it cannot be had: one line, before anything starts.

    ``psctl launch``, compare and bench start the job's daemon (cluster/run/mps.py), so they need its
    control binary unless a daemon serves them already; under ``psctl mpi`` (and ``compare --mpi``) the
    ranks are mpiexec's, and a ``psgrid.LocalCluster`` program chose its GPU context before it started.
    """
    if not job.mps:
        return
    if launcher != "psctl launch":
        raise ConfigError(
            f"[job] mps = true is for psctl launch, compare and bench, which start a daemon for the job: {launcher} "
            "does not; start an MPS control daemon (nvidia-cuda-mps-control -d, or your scheduler's MPS) before "
            "it and set mps = false"
        )
    from psgrid.cluster.run.mps import mps_problem

    problem = mps_problem()
    if problem:
        raise ConfigError(problem)


def _host_shards(name: Names) -> str:
    """How to put the shards back on the host, in the words of the command that runs the job."""
    given = name.flags.get("shard_device", "")
    flag = given if given.startswith("--") and not given.startswith("--set") else None
    return f"{flag} cpu" if flag else "--set shard_device=cpu (host shards)"


def check_machine(job, flags: Mapping[str, str] | None = None) -> None:
    """What this machine must offer a job that ``psctl launch`` runs here: its GPUs, memory, metrics ports."""
    from psgrid.cluster.job import memory

    check_device(job.train, flags)
    memory.check_here(job)
    check_shard_device(job, {**command_line, **(flags or {})})  # a --set shard_device=gpu is named as such
    base = job.server.metrics_port
    if base:
        for i in range(job.shards):
            check_port_free("127.0.0.1", base + i, "metrics_port" if i == 0 else f"metrics_port + {i}")


def gathered_device_problem(comm, is_worker: bool, train) -> str | None:
    """Under MPI: the first worker rank's :func:`check_device` problem, the same answer on every rank.

    Each worker rank checks its own node (one may lack CuPy or a GPU); a collective, so call it on every rank.
    """
    problem = None
    if is_worker:
        try:
            check_device(train)
        except ConfigError as e:
            problem = f"rank {comm.Get_rank()} on {socket.gethostname()}: {e}"
    return next((p for p in comm.allgather(problem) if p), None)


def _either(names) -> str:
    names = [str(n) for n in names]
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else names[0]


# ---------------------------------------------------------------------------------------------
# MPI launchers

# (rank, size) variables each launcher sets for its processes: MPICH's and Intel's hydra, srun --mpi=pmi2
# (PMI_*), Open MPI, MVAPICH.
_LAUNCHER_VARS = (
    ("PMI_RANK", "PMI_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("MV2_COMM_WORLD_RANK", "MV2_COMM_WORLD_SIZE"),
)


def launcher_rank() -> tuple[int, int] | None:
    """``(rank, size)`` when this process is one of several started by mpiexec or srun, else None."""
    env = os.environ
    for rank, size in _LAUNCHER_VARS:
        if env.get(rank, "").isdigit() and env.get(size, "").isdigit():
            return int(env[rank]), int(env[size])
    # srun without an MPI plugin: a job step's tasks (not the batch script itself, which has no step of its own).
    step = env.get("SLURM_STEP_ID", "")
    if (
        step.isdigit()
        and int(step) < 0xFFFFFFF0
        and env.get("SLURM_PROCID", "").isdigit()
        and env.get("SLURM_STEP_NUM_TASKS", "").isdigit()
    ):
        return int(env["SLURM_PROCID"]), int(env["SLURM_STEP_NUM_TASKS"])
    if env.get("PMIX_RANK", "").isdigit():
        return int(env["PMIX_RANK"]), 0  # PMIx gives no size in the environment; 0: unknown
    return None


def quiet_rank() -> bool:
    """True on MPI ranks other than 0: an error every rank meets is printed by rank 0 alone."""
    found = launcher_rank()
    return bool(found and found[0] > 0 and found[1] != 1)


def refuse_mpi_rank(command: str, instead: str = "psctl mpi") -> None:
    """``psctl launch`` runs a whole job itself: started once per rank, N launchers would collide."""
    found = launcher_rank()
    if found and found[1] != 1:
        n = found[1] or "N"
        raise UsageError(
            f"psctl {command} starts a whole job by itself and is running as rank {found[0]} of {n} "
            f"under mpiexec or srun: use 'mpiexec -n {n} {instead} ...' (same options) instead"
        )


def require_mpi(command: str) -> None:
    """``psctl mpi`` needs mpi4py and a launcher; say which is missing, and the fix, before MPI starts."""
    try:
        import mpi4py  # noqa: F401 - the package alone: MPI starts with mpi4py.MPI
    except ImportError:
        raise UsageError(
            f"psctl {command} needs mpi4py: pip install 'psgrid[mpi]' (mpi4py and MPICH, with its "
            f"mpiexec), then run 'mpiexec -n 4 psctl {command} ...'"
        ) from None
    found = launcher_rank()
    if found is None or found[1] == 1:
        if _alone_in_mpi():
            raise UsageError(
                f"psctl {command} runs one role per MPI rank and was started as a single process: run "
                f"it under a launcher ('mpiexec -n 4 psctl {command} ...' or srun), or use "
                f"'psctl launch' for a job on this machine without MPI"
            )
    elif found[1] > 1 and _alone_in_mpi():
        raise UsageError(launcher_mismatch_message(found[1]))


def _alone_in_mpi() -> bool:
    """Start MPI; whether this process is a world of one (a singleton, refused by the caller).

    A singleton's MPICH maps a start-up file of its own in /dev/shm and unlinks it only in
    MPI_Finalize: under ``srun --mpi=none`` with ``KillOnBadExit`` the other tasks are killed once
    the first is refused, before they finalize. Unlinked at once here, it is gone however they end.
    """
    from mpi4py import MPI

    from psgrid.cluster.mpi.mpich_shm import unlink_init_shm

    if MPI.COMM_WORLD.Get_size() != 1:
        return False
    unlink_init_shm(MPI.COMM_WORLD)
    return True


def launcher_mismatch_message(processes: int, env=None) -> str:
    """Why ``processes`` processes each see an MPI world of one, and the fix: under Slurm, an srun
    without the PMI plugin mpi4py's MPI speaks (a site whose ``MpiDefault`` is none); else an
    mpiexec of another MPI."""
    env = os.environ if env is None else env
    if any(k in env for k in ("SLURM_STEP_ID", "SLURM_JOB_ID", "SLURM_PROCID")):
        return (
            f"srun started {processes} tasks but MPI sees each alone: srun did not wire them together "
            f"(this site's default plugin is not one mpi4py's MPI speaks); run 'srun --mpi=pmi2 ...' "
            f"for the mpich of psgrid[mpi] (or the plugin your site recommends for an mpi4py built on "
            f"its MPI: 'srun --mpi=list' shows them)"
        )
    return (
        f"mpiexec started {processes} processes but MPI sees each alone: that mpiexec belongs "
        f"to another MPI than mpi4py's; use the mpiexec installed with psgrid[mpi] (the "
        f"one beside this python) or rebuild mpi4py for your MPI"
    )


# ---------------------------------------------------------------------------------------------
# Ports and shards


def check_port_free(host: str, port: int, flag: str) -> None:
    """Refuse a fixed port that something already listens on (port 0 picks a free one and always works)."""
    if not port:
        return
    family = socket.AF_INET6 if ":" in host.strip("[]") else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # As the server will: SO_REUSEADDR lets a port in TIME_WAIT be taken, never one with a listener.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.strip("[]"), port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                key = flag.split(" + ")[0]  # "metrics_port + 1" (shard 1's) is set as metrics_port
                raise UsageError(
                    f"{flag} {port}: {host}:{port} is already in use (another shard, or another "
                    f"program): choose another {key}, or {key} 0 for any free port"
                ) from None
            raise UsageError(f"{flag} {port}: cannot bind {host}:{port} ({e.strerror})") from None


def probe_shards(addresses: list[str], train, wait_s: float = REACH_WAIT_S) -> None:
    """Reach every shard and complete a TLS handshake as the job's workers will, or say why not.

    Raises
    ------
    UsageError
        One line naming the shard, its address, what failed (refused, no route, no client
        certificate, an unknown CA, TLS on one side only) and what to change.
    """
    for i, address in enumerate(addresses):
        problem = probe(address, train, wait_s)
        if problem:
            raise UsageError(f"shard {i} at {address}: {problem}")
