"""The training loop of one worker: pull, compute, push, and record what each took.

Parameters and gradients live in one flat device buffer each, with
per-parameter views that the model reads and writes. A pull lands in a pinned
host buffer and moves to the device in one copy; a gradient moves back in one
copy and is pushed from pinned memory. On the CPU the host and device buffers
are the same array, so there is no copy at all.

In async and ssp modes the push of step c runs in the background while the
pull for step c+1 proceeds; in sync mode that pull would wait for the round to
close anyway, so the loop stays in order.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from psgrid.psserver.client import ShardedClient
from psgrid.worker.backend import get_xp, pinned_empty, select_gpu
from psgrid.worker.config import TrainConfig
from psgrid.worker.data import BatchLoader, load_dataset
from psgrid.worker.models import accuracy, build_model

log = logging.getLogger("worker")

LOCAL_RANK_VARS = ("LOCAL_RANK", "MPI_LOCALRANKID", "OMPI_COMM_WORLD_LOCAL_RANK", "PMI_LOCAL_RANK", "SLURM_LOCALID")


def local_rank(default: int) -> int:
    for var in LOCAL_RANK_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return default


class MetricsWriter:
    """Appends one JSON object per line and flushes it, so a reader tailing the file sees whole lines."""

    def __init__(self, path: str | os.PathLike | None):
        self.file = None
        self.lock = threading.Lock()
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", buffering=1)

    def write(self, **record) -> None:
        if self.file is None:
            return
        record.setdefault("time", time.time())
        line = json.dumps(record, default=float)
        with self.lock:
            self.file.write(line + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


class FlatBuffers:
    """Flat parameter and gradient buffers on the device, mirrored in pinned host memory."""

    def __init__(self, spec, xp):
        self.xp = xp
        self.host_params = pinned_empty(spec.size, np.float32, xp)
        self.host_grad = pinned_empty(spec.size, np.float32, xp)
        if xp is np:
            self.params, self.grad = self.host_params, self.host_grad
        else:
            self.params, self.grad = spec.flat(xp), spec.flat(xp)
        self.param_views = spec.views(self.params)
        self.grad_views = spec.views(self.grad)

    def upload_params(self) -> None:
        if self.xp is not np:
            self.params.set(self.host_params)

    def download_grad(self) -> None:
        if self.xp is not np:
            self.grad.get(out=self.host_grad)


def build(train: TrainConfig, rank: int, world: int, device: str | None = None):
    """The array module, dataset shard and model a worker of this config trains."""
    xp, device_name = get_xp(device or train.device)
    if xp is not np:
        device_name = f"cuda:{select_gpu(local_rank(rank))}"   # one GPU per worker: its local rank's
    kw = {}
    if train.dataset == "synthetic":
        kw = dict(features=train.synthetic_features, samples=train.synthetic_samples,
                  classes=train.synthetic_classes)
    data = load_dataset(train.dataset, rank=rank, world=world, seed=train.seed, **kw)
    model = build_model(train.model, data.input_shape, data.num_classes, hidden=tuple(train.hidden),
                        activation=train.activation)
    return xp, device_name, data, model


def steps_for(train: TrainConfig, shard_rows: int) -> int:
    if train.epochs:
        batch = shard_rows if train.batch_size == 0 else min(train.batch_size, shard_rows)
        return train.epochs * math.ceil(shard_rows / batch)
    return train.steps


def make_client(train: TrainConfig, servers: list[str]) -> ShardedClient:
    return ShardedClient(servers, chunk_bytes=train.chunk_bytes, wire_dtype=train.wire_dtype,
                         deadline_s=train.deadline_s, retry_s=train.retry_s, token=train.token,
                         tls_ca=train.tls_ca, tls_cert=train.tls_cert, tls_key=train.tls_key)


def run_worker(train: TrainConfig, servers: list[str], rank: int, world: int,
               metrics_path: str | None = None) -> dict:
    """Train worker ``rank`` of ``world`` against the shards at ``servers`` until its steps are done.

    Returns a summary ``{"rank", "worker", "steps", "samples", "wall_s", "final_loss", "device"}``
    and appends per-step JSON lines to ``metrics_path`` (see docs/architecture.md).
    """
    train.validate()
    xp, device_name, data, model = build(train, rank, world)
    spec = model.spec
    metrics = MetricsWriter(metrics_path)
    client = make_client(train, servers)
    loader = None
    pusher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="push")
    try:
        # The rank is the worker id, so a sync round sums its gradients in the same order every run.
        worker_id = client.register(spec, worker_id=rank)
        client.start_heartbeats(train.heartbeat_s)
        client.init(spec.pack(model.init_params(train.seed, train.init_scale)))
        steps = steps_for(train, len(data.train_y))
        metrics.write(event="start", rank=rank, worker=worker_id, host=socket.gethostname(), device=device_name,
                      mode=client.mode, steps=steps, params=spec.size, shard_rows=len(data.train_y))
        # Start together: in sync a round closes with the members present, so a worker that
        # began alone would train the first rounds by itself.
        joined = client.wait_for_members(world, train.join_timeout_s)
        if joined < world:
            log.warning("worker %d starting with %d of %d workers registered after %.0fs",
                        rank, joined, world, train.join_timeout_s)
        bufs = FlatBuffers(spec, xp)
        loader = BatchLoader(data.train_x, data.train_y, train.batch_size, xp=xp, seed=train.seed + 1000 * rank)
        overlap = client.mode in ("async", "ssp")
        delay = train.step_delay_s if rank in train.straggler_ranks else 0.0
        test_x, test_y = xp.asarray(data.test_x), xp.asarray(data.test_y)
        pending = None           # the push in flight (async, ssp): a future of its step record
        samples = 0
        loss_value = float("nan")
        start = time.perf_counter()
        for step in range(steps):
            t0 = time.perf_counter()
            # While a push of clock c is in flight, this pull is for the step after it: clock c+1.
            clock = client.clock if pending is None else pending.clock + 1
            versions = client.pull(bufs.host_params, clock=clock)
            bufs.upload_params()              # pull_s: from the request to the weights on the device
            pull_s = time.perf_counter() - t0
            if pending is not None:
                metrics.write(**pending.result())
                pending = None
            t1 = time.perf_counter()
            x, y = next(loader)
            loss = model.loss_and_grad(bufs.param_views, x, y, bufs.grad_views)
            bufs.download_grad()          # compute_s includes this copy to the host, which also synchronizes
            loss_value = float(loss)
            if delay:
                time.sleep(delay)
            compute_s = time.perf_counter() - t1
            samples += len(y)
            record = dict(event="step", rank=rank, worker=worker_id, step=step, clock=client.clock,
                          loss=loss_value, pull_s=pull_s, compute_s=compute_s, samples=len(y))
            job = _push_job(client, bufs.host_grad, versions, record)
            if overlap:
                pending = pusher.submit(job)
                pending.clock = record["clock"]
            else:
                metrics.write(**job())
            if rank == 0 and train.eval_every and (step + 1) % train.eval_every == 0:
                acc = accuracy(model, bufs.param_views, test_x, test_y)
                metrics.write(event="eval", rank=rank, step=step + 1, test_accuracy=acc)
        if pending is not None:
            metrics.write(**pending.result())
        wall = time.perf_counter() - start
        result = {"rank": rank, "worker": worker_id, "steps": steps, "samples": samples, "wall_s": wall,
                  "final_loss": loss_value, "device": device_name}
        metrics.write(event="done", **result)
        return result
    finally:
        pusher.shutdown(wait=True)
        if loader is not None:
            loader.close()
        try:
            client.leave()
        finally:
            client.close()
            metrics.close()


def _push_job(client: ShardedClient, grad: np.ndarray, versions: list[int], record: dict):
    """A callable that pushes ``grad`` and completes the step's metrics record."""

    def job() -> dict:
        t = time.perf_counter()
        results = client.push(grad, versions=versions)
        record["push_s"] = time.perf_counter() - t
        record["staleness"] = max((r["staleness"] for r in results), default=0)
        record["outcome"] = results[0]["outcome"] if len({r["outcome"] for r in results}) == 1 else "MIXED"
        record["bytes"] = grad.nbytes * 2     # this push and the pull that preceded it
        return record

    return job
