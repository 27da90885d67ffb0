"""The training loop of one worker: pull, compute, push, and record what each took.

Parameters and gradients live in :class:`FlatBuffers` (flat device arrays with views by
name; the host side of the gradient is the client's, in shared memory where the shards are on
this host). In async and ssp the push of step c runs in the background while the pull and the
compute of step c+1 go on, its gradient computed into the other of two host buffers, and it is
waited for before the push of step c+1; with ``pull_ahead`` the pull of step c+1 also runs during
the compute of step c, into a second parameter buffer (worker/prefetch.py). In sync the steps stay
in order.
"""

from __future__ import annotations

import math
import os
import socket
import time

import numpy as np

from psgrid.psserver.client.admin import Admin
from psgrid.psserver.client.client import Client, Handle
from psgrid.worker.backend import current_gpu, get_xp, pinner_for, select_gpu, sync
from psgrid.worker.config import TrainConfig
from psgrid.worker.data import BatchLoader, load_dataset
from psgrid.worker.flat import FlatBuffers
from psgrid.worker.models import accuracy, build_model
from psgrid.worker.prefetch import PullAhead, pulls_ahead
from psgrid.worker.records import MetricsWriter, bytes_per_step
from psgrid.worker.straggler import Delay

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
        device_name = f"cuda:{select_gpu(local_rank(rank))}"   # one GPU per worker: its local rank's
    kw = {}
    if train.dataset == "synthetic":
        kw = dict(features=train.synthetic_features, samples=train.synthetic_samples,
                  classes=train.synthetic_classes, image=tuple(train.synthetic_image) or None)
    data = load_dataset(train.dataset, rank=rank, world=world, seed=train.seed, **kw)
    model = build_model(train.model, data.input_shape, data.num_classes, hidden=tuple(train.hidden),
                        activation=train.activation)
    return xp, device_name, data, model


def steps_for(train: TrainConfig, shard_rows: int) -> int:
    if train.epochs:
        batch = shard_rows if train.batch_size == 0 else min(train.batch_size, shard_rows)
        return train.epochs * math.ceil(shard_rows / batch)
    return train.steps


def security(train: TrainConfig) -> dict:
    return dict(token=train.token, tls_ca=train.tls_ca, tls_cert=train.tls_cert, tls_key=train.tls_key)


def make_client(train: TrainConfig, addresses: list[str], spec, *, worker_id: int | None = None,
                world: int | None = None, init=None, xp=np) -> Client:
    return Client(addresses, spec, worker_id=worker_id, world=world, init=init, data_plane=train.data_plane,
                  shared_memory=train.shared_memory, pin_memory=pinner_for(xp), gpu=current_gpu(xp),
                  wire_dtype=train.wire_dtype,
                  chunk_bytes=train.chunk_bytes, deadline_s=train.deadline_s, retry_s=train.retry_s,
                  heartbeat_s=train.heartbeat_s, join_timeout_s=train.join_timeout_s, **security(train))


def make_admin(train: TrainConfig, addresses: list[str], **kw) -> Admin:
    return Admin(addresses, data_plane=train.data_plane, chunk_bytes=train.chunk_bytes,
                 shared_memory=train.shared_memory, **security(train), **kw)


def run_worker(train: TrainConfig, addresses: list[str], rank: int, world: int,
               metrics_path: str | None = None, host_group=None) -> dict:
    """Train worker ``rank`` of ``world`` against the shards at ``addresses`` until its steps are done.

    Returns a summary ``{"rank", "worker", "steps", "samples", "wall_s", "final_loss", "device"}``
    and appends per-step JSON lines to ``metrics_path`` (see docs/architecture.md). With
    ``aggregate = "host"``, ``host_group`` (a :class:`~psgrid.worker.aggregate.HostGroup`) says where
    this worker stands among the hosts; by default its rank and ``LOCAL_SIZE`` do.
    """
    train.validate()
    xp, device_name, data, model = build(train, rank, world)
    spec = model.spec
    # The rank is the worker id, so a sync round sums its gradients in the same order every run;
    # entering waits for the whole job, since sync and ssp count the members they have.
    init = lambda: spec.pack(model.init_params(train.seed, train.init_scale))  # noqa: E731
    if train.aggregate == "host":       # one client per host, pushing the host's mean (worker/aggregate.py)
        from psgrid.worker.aggregate import HostGroup, host_exchange, rendezvous_name

        group = host_group or HostGroup.of(rank, world, local_rank=local_rank(None))
        exchange = host_exchange(
            group, rendezvous_name(addresses, train.token, group.host), spec.size,
            lambda worker_id, hosts: make_client(train, addresses, spec, worker_id=worker_id, world=hosts, init=init,
                                                 xp=xp),
            wire_dtype=train.wire_dtype, timeout_s=train.join_timeout_s + train.deadline_s + train.retry_s)
    else:
        exchange = make_client(train, addresses, spec, worker_id=rank, world=world, init=init, xp=xp)
    return train_loop(train, exchange, rank, xp, device_name, data, model, metrics_path)


def train_loop(train: TrainConfig, exchange, rank: int, xp, device_name: str, data, model,
               metrics_path: str | None = None) -> dict:
    """The steps of one worker, whatever moves its weights and gradients.

    ``exchange`` is a :class:`Client` (the shards) or an
    :class:`~psgrid.worker.allreduce.AllreduceExchange` (no shards): a context manager with
    ``pull(out)``, ``push(grad, background=)`` returning a handle, and ``mode``, ``worker_id``,
    ``clock``, ``data_planes`` and ``wire_dtype``. Everything else (data order, model, the
    straggler's delay, what is recorded) is the same, so the two are measured on equal terms.
    """
    spec = model.spec
    metrics = MetricsWriter(metrics_path)
    loader = None
    try:
        # On a GPU, the first use of each kernel compiles it (seconds on a fresh machine): do that now,
        # before joining, so that it is not counted in training time (the other workers are warming up
        # or starting meanwhile) and the first run on a machine trains as fast as the next.
        warmup_s = warm_up(model, data, train, xp, evaluate=rank == 0 and bool(train.eval_every))
        with exchange:
            steps = steps_for(train, len(data.train_y))
            # `steps` is the clock a worker trains to: one that joins at clock c (a job resumed from its
            # shards' checkpoints, or a replacement worker) makes the steps that are left.
            first_step = min(max(0, exchange.clock), steps)
            overlap = overlaps(train, exchange.mode, exchange.data_planes)
            metrics.write(**start_event(exchange, train, data, rank=rank, device_name=device_name, params=spec.size,
                                        steps=steps, first_step=first_step, warmup_s=warmup_s),
                          pull_ahead=pulls_ahead(train, exchange.mode), overlap=overlap)
            bufs = FlatBuffers(spec, xp, exchange, double=overlap)
            ahead = PullAhead(bufs, spec) if overlap and pulls_ahead(train, exchange.mode) else None
            loader = BatchLoader(data.train_x, data.train_y, train.batch_size, xp=xp, seed=train.seed + 1000 * rank)
            delay = Delay(train.stragglers, rank, train.seed)
            step_bytes = bytes_per_step(exchange, spec.size)
            test_x, test_y = xp.asarray(data.test_x), xp.asarray(data.test_y)
            in_flight = None         # (push handle, its step's record): the push of the step before
            samples = 0
            loss_value = float("nan")
            start = time.perf_counter()
            for step in range(first_step, steps):
                timed = pull_and_compute(bufs, loader, model, delay, overlap, ahead, last=step + 1 == steps)
                loss_value = timed["loss"]
                samples += timed["samples"]
                if in_flight is not None:         # the push before (it overlapped this pull and compute) ends first
                    metrics.write(**_finish(*in_flight, step_bytes))
                record = dict(event="step", rank=rank, worker=exchange.worker_id, step=step, clock=exchange.clock,
                              **timed)
                # Pulled ahead, the client's last pull is the next step's: say which weights this gradient is of.
                used = {} if ahead is None else {"versions": ahead.push_versions()}
                in_flight = (exchange.push(bufs.pushed, background=overlap, **used), record)
                if not overlap:
                    metrics.write(**_finish(*in_flight, step_bytes))
                    in_flight = None
                if rank == 0 and train.eval_every and (step + 1) % train.eval_every == 0:
                    acc = accuracy(model, bufs.param_views, test_x, test_y)
                    metrics.write(event="eval", rank=rank, step=step + 1, test_accuracy=acc)
            if in_flight is not None:
                metrics.write(**_finish(*in_flight, step_bytes))
            wall = time.perf_counter() - start
            result = {"rank": rank, "worker": exchange.worker_id, "steps": steps - first_step, "samples": samples,
                      "wall_s": wall, "final_loss": loss_value, "device": device_name, "warmup_s": warmup_s}
        metrics.write(event="done", **result)
        return result
    finally:
        if loader is not None:
            loader.close()
        metrics.close()


def overlaps(train: TrainConfig, mode: str, planes) -> bool:
    """Whether a step's push runs in the background, beside the next step's pull and compute.

    In async and ssp it does unless ``overlap = false``: the next gradient is computed into the
    other of two buffers meanwhile, and the push is waited for before the one after it. In sync
    the next pull is answered only once the round the push closes is applied, so an overlap saves
    one request's latency and costs a thread hand-off: the steps stay in order. With the overlap
    off the next pull waits for this push (a worker alone then sees no staleness). Under
    ``"auto"`` (the default) it is also off where every shard is in the worker's own process (the
    in-process plane, ``planes`` all "local"), unless the worker pulls ahead: the push is the
    shard's update itself, run in this process, and a thread running it beside the next step's
    kernel launches cost the compute more than the overlap saved (docs/performance.md, "The shard
    in the worker's process").
    """
    if mode in ("sync", "allreduce") or train.overlap is False:
        return False
    in_process = bool(planes) and all(plane == "local" for plane in planes)
    return not (train.overlap == "auto" and in_process and not train.pull_ahead)


def pull_and_compute(bufs: FlatBuffers, loader, model, delay: Delay, overlap: bool, ahead: PullAhead | None = None,
                     last: bool = False) -> dict:
    """One step up to its push: pull the weights, compute the gradient into the host buffer, a straggler's delay.

    Returns the step record's timings (``started``, ``pull_s``, ``compute_s``, ``delay_s``), ``loss`` and
    ``samples``, in the record's order. With ``ahead`` the weights are those pulled during the step before
    (``pull_s`` is then what this step still waited for them, before the push of the step before and when it
    started, and ``pull_ahead_s`` what their pull took), and unless ``last`` the next step's pull starts
    before this step computes.
    """
    started = time.time()
    t0 = time.perf_counter()
    if ahead is None:
        bufs.pull()                   # pull_s: from the request to the weights on the device
    else:
        ahead.pull(ahead=not last)
    pull_s = time.perf_counter() - t0 + (ahead.waited_s if ahead is not None else 0.0)
    t1 = time.perf_counter()
    x, y = next(loader)
    if overlap:
        bufs.swap_gradient()          # the other buffer: the push that read it has ended
    loss = model.loss_and_grad(bufs.param_views, x, y, bufs.grad_views)
    if ahead is not None:
        ahead.advance()
    bufs.download_grad()          # compute_s includes this copy to the host, which also synchronizes
    loss_value = float(loss)
    compute_s = time.perf_counter() - t1
    delay_s = delay.seconds(compute_s)
    if delay_s:
        time.sleep(delay_s)
    timed = dict(started=started, loss=loss_value, pull_s=pull_s, compute_s=compute_s, delay_s=delay_s,
                 samples=len(y))
    if ahead is not None and ahead.pulled_s is not None:
        timed["pull_ahead_s"] = ahead.pulled_s
    return timed


def start_event(exchange, train: TrainConfig, data, *, rank: int, device_name: str, params: int, steps: int,
                first_step: int, warmup_s: float) -> dict:
    """A worker's first record: who it is, where it runs, and the steps it makes."""
    return dict(event="start", rank=rank, worker=exchange.worker_id, host=socket.gethostname(),
                device=device_name, mode=exchange.mode, steps=steps, first_step=first_step, params=params,
                shard_rows=len(data.train_y), data_planes=exchange.data_planes,
                stragglers=list(train.stragglers), warmup_s=warmup_s)


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
    if evaluate:    # on the whole test set, as the loop does: CuPy picks other kernels for other sizes
        accuracy(model, spec.views(params), xp.asarray(data.test_x), xp.asarray(data.test_y))
    sync(xp)
    return time.perf_counter() - t0


def _finish(push: Handle, record: dict, step_bytes: int) -> dict:
    """Complete a step's record with its push: outcome, staleness, time and bytes moved."""
    results = push.wait()
    record["push_s"] = push.seconds
    record["staleness"] = max((r.staleness for r in results), default=0)
    outcomes = {r.outcome.name for r in results}
    record["outcome"] = outcomes.pop() if len(outcomes) == 1 else "MIXED"
    record["bytes"] = step_bytes
    return record
