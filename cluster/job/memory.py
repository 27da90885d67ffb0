"""What a job's model needs in memory, checked before anything starts.

A model too big for the machine (``hidden = [100000, 100000]``: 10 billion parameters) used to
fail after two minutes with a NumPy traceback, in one worker, while the others waited. Its size is
known from the job alone: the parameter count comes from the model's layer shapes (nothing is
allocated), and each process's share is a lower bound of what it must hold:

* a shard: its slice of the weights, the gradients it accumulates, and the optimizer's state
  (one slot for momentum, two for Adam), float32 each;
* a worker: the weights it pulls and the gradients it pushes, float32, plus the largest tensor
  drawn in float64 while the initial weights are made.

``psctl launch`` checks the whole job against this host's available memory; ``psctl mpi`` checks
each node's ranks against that node's. A GPU worker's weights and gradients are checked against
the GPU's memory where CuPy can tell it.
"""

from __future__ import annotations

from dataclasses import dataclass

from psgrid.cluster.errors import ConfigError

FLOAT32 = 4
FLOAT64 = 8
GIB = 1 << 30
# One sample's shape and the classes of the packaged datasets (worker/data.py), known without loading them.
DATASET_SHAPES = {"mnist5k": ((1, 28, 28), 10), "digits": ((1, 8, 8), 10)}


@dataclass(frozen=True)
class Footprint:
    """A job's model and the least memory each of its processes holds."""

    params: int
    model: str
    shard_bytes: int       # one shard (its 1/S slice)
    worker_bytes: int      # one worker
    gpu_bytes: int         # one worker's arrays on its GPU, when it trains on one

    def describe(self) -> str:
        """``a 101,770-parameter mlp``: for the line a job starts with."""
        return f"a {self.params:,}-parameter {self.model}"


def footprint(job) -> Footprint:
    """The parameter count and per-process memory of ``job``'s built-in model."""
    from psgrid.worker.models import build_model

    t = job.train
    if t.dataset == "synthetic":
        shape = tuple(t.synthetic_image) or (t.synthetic_features,)
        classes = t.synthetic_classes
    else:
        shape, classes = DATASET_SHAPES[t.dataset]
    spec = build_model(t.model, shape, classes, hidden=tuple(t.hidden), activation=t.activation).spec
    params = spec.size
    largest = max((p.size for p in spec.params), default=0)
    s = job.server
    slots = 2 if s.optimizer == "adam" else (1 if s.momentum else 0)
    shard = -(-params // job.shards) * FLOAT32 * (2 + slots)
    weights_and_grads = 2 * params * FLOAT32
    return Footprint(params, t.model, shard, weights_and_grads + largest * FLOAT64, weights_and_grads)


def available_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """This host's available memory (MemAvailable), or None where the kernel does not say."""
    try:
        with open(meminfo) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def gpu_total_bytes() -> int | None:
    """The memory of this process's current GPU, where CuPy imports and sees one; else None."""
    try:
        import cupy

        return int(cupy.cuda.runtime.memGetInfo()[1])
    except Exception:  # noqa: BLE001 - no CuPy, no driver, no GPU: nothing to check against
        return None


def gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB"


def host_problem(fp: Footprint, shards: int, workers: int, available: int | None, where: str) -> str | None:
    """Why ``shards`` shards and ``workers`` workers of ``fp`` cannot fit in ``available`` bytes (None: they fit)."""
    need = shards * fp.shard_bytes + workers * fp.worker_bytes
    if available is None or need <= available:
        return None
    parts = [f"1 {what} needs {gib(size)}" if n == 1 else f"{n} {what}s need {gib(n * size)} ({gib(size)} each)"
             for n, what, size in ((shards, "shard", fp.shard_bytes), (workers, "worker", fp.worker_bytes)) if n]
    return (f"{fp.describe()} does not fit: {' and '.join(parts)} at least, and {where} has {gib(available)} "
            f"available; make the model smaller, or spread it over more nodes with psctl mpi")


def gpu_problem(fp: Footprint, total: int | None) -> str | None:
    if total is None or fp.gpu_bytes <= total:
        return None
    return (f"{fp.describe()} does not fit on a GPU: a worker's weights and gradients need {gib(fp.gpu_bytes)} "
            f"at least, and its GPU has {gib(total)}; make the model smaller, or use --device cpu")


def check_here(job) -> Footprint:
    """Refuse (ConfigError) a job whose shards and workers, all on this host, cannot fit in its memory."""
    fp = footprint(job)
    problem = host_problem(fp, job.shards, job.workers, available_bytes(), "this machine")
    if problem is None and job.train.device == "gpu":
        problem = gpu_problem(fp, gpu_total_bytes())
    if problem:
        raise ConfigError(problem)
    return fp
