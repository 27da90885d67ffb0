"""The built-in trainer: one of psgrid's models on one of its data sets, step after step.

What happens around each step's compute (the pull, the gradient buffers, the overlap of a push
with the next step, the pull-ahead, a straggler's delay, the records) is the
:class:`~psgrid.worker.core.WorkerCore`'s, which a user's script (worker/api.py) goes through
too; this module adds the model, the data, the warm-up and the evaluations.
"""

from __future__ import annotations

import math
import os
import time

import numpy as np

from psgrid.psserver.client.admin import Admin
from psgrid.psserver.client.client import Client
from psgrid.worker.backend import current_gpu, get_xp, pinner_for, select_gpu, sync
from psgrid.worker.config import TrainConfig
from psgrid.worker.core import WorkerCore, client_settings, open_exchange, overlaps, security  # noqa: F401
from psgrid.worker.data import BatchLoader, load_dataset
from psgrid.worker.models import accuracy, build_model
from psgrid.worker.records import MetricsWriter

LOCAL_RANK_VARS = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_LOCAL_RANK", "SLURM_LOCALID")


def local_rank(default: int | None) -> int | None:
    for var in LOCAL_RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return default


def build(train: TrainConfig, rank: int, world: int, device: str | None = None):
    """The array module, dataset shard and model a worker of this config trains."""
    xp, device_name = get_xp(device or train.device)
    if xp is not np:
        device_name = f"cuda:{select_gpu(local_rank(rank))}"  # one GPU per worker: its local rank's
    kw, seed = {}, train.seed  # seed shuffles a shipped dataset before it is dealt out
    if train.dataset == "synthetic":
        kw = dict(
            features=train.synthetic_features,
            samples=train.synthetic_samples,
            classes=train.synthetic_classes,
            test_samples=train.synthetic_test_samples,
            image=tuple(train.synthetic_image) or None,
        )
        seed = train.synthetic_seed  # the task itself: the same for every run of the job, whatever its seed
    data = load_dataset(train.dataset, rank=rank, world=world, seed=seed, **kw)
    model = build_model(
        train.model, data.input_shape, data.num_classes, hidden=tuple(train.hidden), activation=train.activation
    )
    return xp, device_name, data, model


def steps_for(train: TrainConfig, shard_rows: int) -> int:
    if train.epochs:
        batch = shard_rows if train.batch_size == 0 else min(train.batch_size, shard_rows)
        return train.epochs * math.ceil(shard_rows / batch)
    return train.steps


def make_client(
    train: TrainConfig,
    addresses: list[str],
    spec,
    *,
    worker_id: int | None = None,
    world: int | None = None,
    init=None,
    xp=np,
) -> Client:
    """A client of the job's shards with the job's transport settings (no aggregation: :func:`open_exchange`)."""
    return Client(
        addresses,
        spec,
        worker_id=worker_id,
        world=world,
        init=init,
        pin_memory=pinner_for(xp),
        gpu=current_gpu(xp),
        **client_settings(train),
    )


def make_admin(train: TrainConfig, addresses: list[str], **kw) -> Admin:
    return Admin(
        addresses,
        data_plane=train.data_plane,
        chunk_bytes=train.chunk_bytes,
        shared_memory=train.shared_memory,
        **security(train),
        **kw,
    )


def run_worker(
    train: TrainConfig, addresses: list[str], rank: int, world: int, metrics_path: str | None = None, host_group=None
) -> dict:
    """Train worker ``rank`` of ``world`` against the shards at ``addresses`` until its steps are done.

    Returns a summary ``{"rank", "worker", "steps", "samples", "wall_s", "final_loss", "device"}``
    and appends per-step JSON lines to ``metrics_path`` (see docs/worker.md). With
    ``aggregate = "host"``, ``host_group`` (a :class:`~psgrid.worker.aggregate.HostGroup`) says where
    this worker stands among the hosts; by default its rank and ``LOCAL_SIZE`` do.
    """
    train.validate()
    xp, device_name, data, model = build(train, rank, world)
    spec = model.spec
    # The rank is the worker id, so a sync round sums its gradients in the same order every run;
    # entering waits for the whole job, since sync and ssp count the members they have.
    init = lambda: spec.pack(model.init_params(train.seed, train.init_scale))  # noqa: E731
    exchange = open_exchange(
        train,
        addresses,
        spec,
        rank=rank,
        world=world,
        init=init,
        xp=xp,
        gpu=current_gpu(xp),
        options=client_settings(train),
        host_group=host_group,
        local_rank=local_rank(None),
    )
    return train_loop(train, exchange, rank, xp, device_name, data, model, metrics_path)


def train_loop(
    train: TrainConfig, exchange, rank: int, xp, device_name: str, data, model, metrics_path: str | None = None
) -> dict:
    """The steps of one worker, whatever moves its weights and gradients.

    ``exchange`` is a :class:`Client` (the shards), a host's aggregation, or an
    :class:`~psgrid.worker.allreduce.AllreduceExchange` (no shards): a context manager with
    ``pull(out)``, ``push(grad, background=)`` returning a handle, and ``mode``, ``worker_id``,
    ``clock``, ``data_planes`` and ``wire_dtype``. Everything around the compute (buffers, overlap,
    pull-ahead, the straggler's delay, what is recorded) is the :class:`WorkerCore`'s, as for a
    user's script, so all are measured on equal terms.
    """
    metrics = MetricsWriter(metrics_path)
    loader = None
    try:
        # On a GPU, the first use of each kernel compiles it (seconds on a fresh machine): do that now,
        # before joining, so that it is not counted in training time (the other workers are warming up
        # or starting meanwhile) and the first run on a machine trains as fast as the next.
        evaluates = rank == 0 and bool(train.eval_every)  # the others never read the test set
        warmup_s = warm_up(model, data, train, xp, evaluate=evaluates)
        with WorkerCore(
            train, exchange, model.spec, rank=rank, xp=xp, metrics=metrics, device_name=device_name
        ) as core:
            steps = steps_for(train, len(data.train_y))
            # `steps` is the clock a worker trains to: one that joins at clock c (a job resumed from its
            # shards' checkpoints, or a replacement worker) makes the steps that are left.
            first_step = min(max(0, exchange.clock), steps)
            core.step = first_step
            core.start(steps=steps, first_step=first_step, shard_rows=len(data.train_y), warmup_s=warmup_s)
            loader = BatchLoader(data.train_x, data.train_y, train.batch_size, xp=xp, seed=train.seed + 1000 * rank)
            # on the evaluating worker's device once (on a GPU, 123 MB for synthetic-cnn's 10,000 images)
            test_x, test_y = (xp.asarray(data.test_x), xp.asarray(data.test_y)) if evaluates else (None, None)
            loss = None
            start = time.perf_counter()
            for step in range(first_step, steps):
                core.pull(last=step + 1 == steps)
                x, y = next(loader)
                loss = model.loss_and_grad(core.param_views, x, y, core.gradient())
                core.push(loss, samples=len(y))
                if evaluates and (step + 1) % train.eval_every == 0:
                    acc = accuracy(model, core.param_views, test_x, test_y)
                    metrics.write(event="eval", rank=rank, step=step + 1, test_accuracy=acc)
            core.finish()
            wall = time.perf_counter() - start
            result = {
                "rank": rank,
                "worker": exchange.worker_id,
                "steps": steps - first_step,
                "samples": core.samples,
                "wall_s": wall,
                "final_loss": float("nan") if loss is None else float(loss),
                "device": device_name,
                "warmup_s": warmup_s,
            }
        metrics.write(event="done", **result)
        return result
    finally:
        if loader is not None:
            loader.close()
        metrics.close()


def warm_up(model, data, train: TrainConfig, xp, *, evaluate: bool) -> float:
    """Run the model's kernels once on a GPU (a step and, with ``evaluate``, an evaluation); seconds taken.

    CuPy compiles a kernel the first time it runs; a step of the real training must not pay
    for that. Nothing to do on the CPU.
    """
    if xp is np:
        return 0.0
    t0 = time.perf_counter()
    spec = model.spec
    params = xp.asarray(spec.pack(model.init_params(train.seed, train.init_scale)))
    grad = spec.flat(xp)
    rows = min(len(data.train_y), train.batch_size or len(data.train_y))
    x, y = xp.asarray(data.train_x[:rows]), xp.asarray(data.train_y[:rows])
    float(model.loss_and_grad(spec.views(params), x, y, spec.views(grad)))
    if evaluate:  # on the whole test set, as the loop does: CuPy picks other kernels for other sizes
        accuracy(model, spec.views(params), xp.asarray(data.test_x), xp.asarray(data.test_y))
    sync(xp)
    return time.perf_counter() - t0
