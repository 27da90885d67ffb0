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
the GPU's memory where CuPy can tell it, and device shards (``shard_device = "gpu"``) against the
free memory of the GPUs they are placed on (:func:`device_shard_problem`).
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
    shard_bytes: int  # one shard (its 1/S slice)
    worker_bytes: int  # one worker
    gpu_bytes: int  # one worker's arrays on its GPU, when it trains on one

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
    parts = [
        f"1 {what} needs {gib(size)}" if n == 1 else f"{n} {what}s need {gib(n * size)} ({gib(size)} each)"
        for n, what, size in ((shards, "shard", fp.shard_bytes), (workers, "worker", fp.worker_bytes))
        if n
    ]
    return (
        f"{fp.describe()} does not fit: {' and '.join(parts)} at least, and {where} has {gib(available)} "
        f"available; make the model smaller, or spread it over more nodes with psctl mpi"
    )


def gpu_problem(fp: Footprint, total: int | None) -> str | None:
    if total is None or fp.gpu_bytes <= total:
        return None
    return (
        f"{fp.describe()} does not fit on a GPU: a worker's weights and gradients need {gib(fp.gpu_bytes)} "
        f"at least, and its GPU has {gib(total)}; make the model smaller, or use --device cpu"
    )


def _amount(n: int) -> str:
    """GiB, or MiB below 10 GiB: a GPU's free memory is often a few GiB, and 0.4 against 0.4 says nothing."""
    return gib(n) if n >= 10 * GIB else f"{n / (1 << 20):,.1f} MiB"


def gpu_count() -> int:
    """The GPUs CuPy sees in this process (call only where psserver.state.device.gpu_problem() is None)."""
    import cupy

    return int(cupy.cuda.runtime.getDeviceCount())


def gpu_free_bytes(index: int) -> int:
    """The free memory of GPU ``index`` now (cudaMemGetInfo), asked only where a device shard would go."""
    import cupy

    with cupy.cuda.Device(index):
        return int(cupy.cuda.runtime.memGetInfo()[0])


def device_shard_problem(fp: Footprint, job, indices, count: int, free_of=gpu_free_bytes) -> str | None:
    """Why the device shards ``indices`` of ``job`` do not fit in this host's ``count`` GPUs (None: they fit).

    Shard i goes on GPU i mod ``count`` (or the job's ``gpu``), as the shard places itself; per GPU,
    the shards on it need :func:`~psgrid.psserver.state.device.shard_device_bytes` each (their ring,
    optimizer state and every worker's gradient slots), against ``free_of(gpu)``: asked once per GPU
    that gets a shard.
    """
    from psgrid.cluster.job.shard_device import shards_by_gpu
    from psgrid.psserver.sharding import shard_ranges
    from psgrid.psserver.state.device import shard_device_bytes

    s = job.server
    if s.gpu >= count:
        return f"gpu = {s.gpu} asked for, but this host has {count} GPU(s) (0..{count - 1}); use gpu = -1"
    ranges = shard_ranges(fp.params, job.shards)
    for gpu, placed in sorted(shards_by_gpu(indices, s.gpu, count).items()):
        need = sum(
            shard_device_bytes(ranges[i][1] - ranges[i][0], s.optimizer, s.momentum, job.workers) for i in placed
        )
        free = free_of(gpu)
        if need > free:
            who = f"shard {placed[0]} needs" if len(placed) == 1 else f"shards {', '.join(map(str, placed))} need"
            return (
                f"{who} {_amount(need)} on GPU {gpu} (weights, optimizer state and {job.workers} worker(s)' "
                f"gradient slots, for {fp.describe()}), and it has {_amount(free)} free"
            )
    return None


def check_here(job) -> Footprint:
    """Refuse (ConfigError) a job whose shards and workers, all on this host, cannot fit in its memory."""
    fp = footprint(job)
    problem = host_problem(fp, job.shards, job.workers, available_bytes(), "this machine")
    if problem is None and job.train.device == "gpu":
        problem = gpu_problem(fp, gpu_total_bytes())
    if problem:
        raise ConfigError(problem)
    return fp
