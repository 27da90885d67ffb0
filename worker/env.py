"""The job a script belongs to, as its launcher puts it in the environment.

``psctl launch -- python train.py`` and ``psctl mpi -- python train.py`` run the user's command
once per worker, with these variables set (as ``torchrun`` and ``horovodrun`` do); a script
started by hand may set them itself, and :func:`psgrid.init` also takes them as arguments:

=====================  ==========================================================================
``PSGRID_ADDRESSES``   every shard's ``host:port``, comma-separated, in shard order
``PSGRID_RANK``        this worker's rank, ``0 .. PSGRID_WORLD_SIZE-1`` (its worker id)
``PSGRID_WORLD_SIZE``  the job's number of workers (sync and ssp wait for that many to join)
``PSGRID_LOCAL_RANK``  this worker's index among the job's workers on its node
``PSGRID_GPU``         the GPU (CUDA device index) this worker uses; unset where it has none
``PSGRID_TOKEN``       the job's bearer token (in the environment only, never on a command line)
``PSGRID_TLS_CA``      CA file the shards' certificates chain to (TLS); also ``PSGRID_TLS_CERT``,
                       ``PSGRID_TLS_KEY``: the worker's client certificate and key (mutual TLS)
``PSGRID_METRICS``     the JSON-lines file the worker's step, eval and done records go to
``PSGRID_JOB_FILE``    the job as it runs (``OUT/job.toml``): the client reads its ``[train]``
                       transport settings (``data_plane``, ``wire_dtype``, deadlines) from it
``PSGRID_OUT``         the job's output folder
``PSGRID_SEED``        the job's ``[train] seed``: what a script seeds its weights and data order from, so
                       that ``psctl compare``'s repeats (seed base+r) vary them
``PSGRID_HOST_SHARD``  with ``shard_placement = "worker"`` under ``psctl launch -- CMD``: the shard this
                       worker's process hosts (its address published in ``PSGRID_ADDRESS_DIR``,
                       where the other shards' are found; cluster/run/hosted_script.py)
``PSGRID_HOST_GROUP``  with ``aggregate = "host"`` under ``psctl mpi``: ``HOST,HOSTS,LOCAL,SIZE,WORLD``,
                       where this worker stands among the nodes (worker/aggregate.py's HostGroup);
                       unset, a worker's rank and local rank say it
=====================  ==========================================================================

This module is the one place the names are spelled; the launchers (cluster/run/script.py) write
them with :meth:`JobEnv.to_env` and the user API reads them with :func:`job_env`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from psgrid.psserver import lifeline

ADDRESSES = "PSGRID_ADDRESSES"
RANK = "PSGRID_RANK"
WORLD_SIZE = "PSGRID_WORLD_SIZE"
LOCAL_RANK = "PSGRID_LOCAL_RANK"
GPU = "PSGRID_GPU"
TOKEN = "PSGRID_TOKEN"  # the same variable cluster/job/credentials.py hands to every child
TLS_CA = "PSGRID_TLS_CA"
TLS_CERT = "PSGRID_TLS_CERT"
TLS_KEY = "PSGRID_TLS_KEY"
METRICS = "PSGRID_METRICS"
JOB_FILE = "PSGRID_JOB_FILE"
OUT = "PSGRID_OUT"
HOST_GROUP = "PSGRID_HOST_GROUP"
HOST_SHARD = "PSGRID_HOST_SHARD"
ADDRESS_DIR = "PSGRID_ADDRESS_DIR"
SEED = "PSGRID_SEED"
# Set by a launcher for its children (cluster/run/procs.py): a script watches it and stops when its
# launcher vanished without stopping it (kill -9), as psctl's own children do.
PARENT = lifeline.PARENT_ENV

NAMES = (
    ADDRESSES,
    RANK,
    WORLD_SIZE,
    LOCAL_RANK,
    GPU,
    TOKEN,
    TLS_CA,
    TLS_CERT,
    TLS_KEY,
    METRICS,
    JOB_FILE,
    OUT,
    HOST_GROUP,
    HOST_SHARD,
    ADDRESS_DIR,
    SEED,
)


@dataclass(frozen=True)
class JobEnv:
    """One worker's view of its job: where the shards are, who it is, what it may use."""

    addresses: list[str] = field(default_factory=list)
    rank: int | None = None
    world: int | None = None
    local_rank: int = 0
    gpu: int | None = None
    token: str | None = None
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    metrics: str | None = None
    job_file: str | None = None
    out: str | None = None
    host_group: tuple[int, ...] | None = None
    host_shard: int | None = None
    address_dir: str | None = None
    seed: int | None = None

    @property
    def device(self) -> str:
        """``"cuda:N"`` for the worker's GPU, else ``"cpu"`` (what ``torch.device`` takes)."""
        return "cpu" if self.gpu is None else f"cuda:{self.gpu}"

    def to_env(self) -> dict[str, str]:
        """The variables that describe this job to a child process (unset values left out)."""
        values = {
            ADDRESSES: ",".join(self.addresses),
            RANK: self.rank,
            WORLD_SIZE: self.world,
            LOCAL_RANK: self.local_rank,
            GPU: self.gpu,
            TOKEN: self.token,
            TLS_CA: self.tls_ca,
            TLS_CERT: self.tls_cert,
            TLS_KEY: self.tls_key,
            METRICS: self.metrics,
            JOB_FILE: self.job_file,
            OUT: self.out,
            HOST_GROUP: ",".join(map(str, self.host_group)) if self.host_group else None,
            HOST_SHARD: self.host_shard,
            ADDRESS_DIR: self.address_dir,
            SEED: self.seed,
        }
        return {name: str(value) for name, value in values.items() if value not in (None, "")}


def job_env(environ: Mapping[str, str] | None = None) -> JobEnv:
    """The job described by ``environ`` (default: this process's environment).

    Variables that are not set are None (``local_rank`` 0); a value that is not what its
    variable takes is a ``ValueError`` naming the variable.
    """
    environ = os.environ if environ is None else environ

    def text(name: str) -> str | None:
        return environ.get(name, "").strip() or None

    def number(name: str, low: int) -> int | None:
        value = text(name)
        if value is None:
            return None
        if not value.isdigit() or int(value) < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
        return int(value)

    addresses = [a.strip() for a in (text(ADDRESSES) or "").split(",") if a.strip()]
    for address in addresses:
        host, sep, port = address.rpartition(":")
        if not (sep and host and port.isdigit()):
            raise ValueError(f"{ADDRESSES} must be host:port[,host:port...], got {address!r}")
    env = JobEnv(
        addresses=addresses,
        rank=number(RANK, 0),
        world=number(WORLD_SIZE, 1),
        local_rank=number(LOCAL_RANK, 0) or 0,
        gpu=number(GPU, 0),
        token=text(TOKEN),
        tls_ca=text(TLS_CA),
        tls_cert=text(TLS_CERT),
        tls_key=text(TLS_KEY),
        metrics=text(METRICS),
        job_file=text(JOB_FILE),
        out=text(OUT),
        host_group=_host_group(text(HOST_GROUP)),
        host_shard=number(HOST_SHARD, 0),
        address_dir=text(ADDRESS_DIR),
        seed=number(SEED, 0),
    )
    if env.host_shard is not None and not (env.address_dir and env.job_file):
        raise ValueError(
            f"{HOST_SHARD} needs {ADDRESS_DIR} and {JOB_FILE}: where the shards publish their "
            f"addresses, and the job whose shard this process hosts"
        )
    if env.rank is not None and env.world is not None and env.rank >= env.world:
        raise ValueError(f"{RANK} ({env.rank}) must be less than {WORLD_SIZE} ({env.world})")
    return env


def _host_group(value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    parts = value.split(",")
    if len(parts) != 5 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"{HOST_GROUP} must be HOST,HOSTS,LOCAL,SIZE,WORLD (five integers), got {value!r}")
    return tuple(int(p) for p in parts)


def watch_launcher() -> None:
    """Stop this process (SIGTERM) when the launcher that started it is gone.

    A launcher stops its children itself; this covers the launcher killed with SIGKILL, which
    would leave a user's script training against shards that are gone, even one killed before the
    script got here (psserver/lifeline.py). Nothing happens when no launcher started this process.
    """
    lifeline.watch()
