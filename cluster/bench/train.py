"""``psctl bench train``: samples/s of real training per mode, beside the same model trained with no servers.

Each configuration is a whole job as ``psctl launch`` runs it (shards and workers as processes,
an MLP or a CNN on the synthetic task, on the CPU or a GPU), and every step's record gives where
the time went: pull (its consistency wait apart), compute (the gradient's copy to the host
included), push. Beside it the same model, data and batch train in one process with no servers at
all (plain SGD where the weights live): the ratio of the two is what the parameter server costs.

The reference runs in turn with the configurations (no servers, a repeat, no servers, the next,
..., no servers), and each repeat's ratio is to the mean of the two reference runs beside it: on a
GPU host the reference moved by a fifth between runs minutes apart, and one taken at the start
moved every ratio with it. Both count samples/s over their steady steps (after the first tenth),
the estimator ``psctl bench script`` uses (steady.py).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from itertools import product
from pathlib import Path

from psgrid.cluster.bench.steady import beside, steady_samples_per_s
from psgrid.cluster.job.config import JobConfig, apply_overrides, load_job
from psgrid.psserver.protocol import mode_rules


def base_job(
    model: str, device: str, hidden: list[int], batch_size: int, steps: int, shard_device: str = "auto"
) -> JobConfig:
    """The synthetic job every mode of ``model`` runs: no evaluation during training, plain SGD.

    ``shard_device``: where the shards keep their state ("auto": on a GPU for GPU workers, as a job does).
    """
    settings = {
        "name": f"bench-{model}",
        "model": model,
        "dataset": "synthetic",
        "hidden": hidden,
        "batch_size": batch_size,
        "steps": steps,
        "eval_every": 0,
        "device": device,
        "lr": 0.01,
        "momentum": 0.0,
        "optimizer": "sgd",
        "train.synthetic_samples": max(4096, 4 * batch_size),
        "shard_device": shard_device,
    }
    if model == "cnn":
        settings["train.synthetic_image"] = [1, 28, 28]
    return apply_overrides(load_job("mnist"), settings)


def steady_skip(steps: int) -> int:
    """The first steps a run's samples/s leaves out: a tenth (connections, mappings, caches)."""
    return steps // 10


def no_servers(train, lr: float = 0.01) -> dict:
    """The same model, data loader and buffers updated where they live, with no servers: samples/s over the
    steady steps (:func:`steady_skip`) and the median step time.

    ``train`` is a TrainConfig (plain SGD at ``lr`` on the worker's device; benchmarks/gpu_workers.py
    measures its reference with it too).
    """
    from psgrid.worker.backend import sync
    from psgrid.worker.data import BatchLoader
    from psgrid.worker.flat import FlatBuffers
    from psgrid.worker.loop import build, warm_up

    xp, device, data, model = build(train, rank=0, world=1)
    warmup_s = warm_up(model, data, train, xp, evaluate=False)
    bufs = FlatBuffers(model.spec, xp)
    bufs.params[...] = xp.asarray(model.spec.pack(model.init_params(train.seed)))
    loader = BatchLoader(data.train_x, data.train_y, train.batch_size, xp=xp, seed=1)
    times = []
    try:
        for _ in range(train.steps):
            t = time.perf_counter()
            x, y = next(loader)
            loss = model.loss_and_grad(bufs.param_views, x, y, bufs.grad_views)
            bufs.params -= lr * bufs.grad
            float(loss)
            sync(xp)
            times.append(time.perf_counter() - t)
    finally:
        loader.close()
    steady = times[min(steady_skip(len(times)), len(times) - 1) :]
    return {
        "params": model.spec.size,
        "device": device,
        "step_s": statistics.median(steady),
        "samples_per_s": train.batch_size * len(steady) / sum(steady),
        "warmup_s": warmup_s,
    }


def with_servers(job: JobConfig) -> dict:
    """One job as psctl launch runs it: samples/s over its workers' steady steps, and the medians of each step's parts."""
    from psgrid.cluster.run.launch import Launcher, prepare_out

    with tempfile.TemporaryDirectory(prefix="psgrid-bench-train-") as tmp:
        job = apply_overrides(job, {"out": str(Path(tmp) / "run")})
        summary = Launcher(job, prepare_out(job), progress=False, quiet=True).run()
        events = [json.loads(line) for line in (Path(job.out) / "metrics.jsonl").read_text().splitlines()]
        steady_rate = steady_samples_per_s(
            sorted((Path(job.out) / "metrics").glob("worker-*.jsonl")), steady_skip(job.train.steps)
        )
    steps = [e for e in events if e.get("event") == "step"]
    steps = steps[len(steps) // 10 :] or steps  # the first steps connect, map and warm caches
    starts = [e for e in events if e.get("event") == "start"]
    planes = sorted({p for e in starts for p in e.get("data_planes") or []})
    # A pull waits on every shard at once: the longest of a worker's per-shard waits is its wait.
    per_worker: dict[int, float] = {}
    for shard in summary["shard_stats"]:
        for w in shard.get("waits", []):
            per_worker[w["worker_id"]] = max(per_worker.get(w["worker_id"], 0.0), w["seconds"])
    worker_steps = sum(w["steps"] for w in summary["worker_results"]) or 1
    wait_s = sum(per_worker.values()) / worker_steps
    med = {k: statistics.median(e[k] for e in steps) for k in ("pull_s", "compute_s", "push_s")}
    return {
        "samples_per_s": steady_rate or summary["samples_per_s"],
        "job_samples_per_s": summary["samples_per_s"],  # the whole job's, its first steps too
        "shard_device": summary["shard_device"],
        "pull_s": max(0.0, med["pull_s"] - wait_s),
        "wait_s": wait_s,
        "compute_s": med["compute_s"],
        "push_s": med["push_s"],
        "steps": summary["steps"],
        "warmup_s": summary.get("warmup_s", 0.0),
        "planes_used": planes,
        "status": summary["status"],
        "pulled_ahead": bool(starts) and all(e.get("pull_ahead") for e in starts),
    }


FLAGS = {"shard_device": "--shard-device", "device": "--device"}  # how a refusal names the settings


def check(models, device, shards, workers, hidden, batch_size, steps, shard_device) -> None:
    """Refuse, before anything runs, device shards that a configuration could not fit in this host's GPUs."""
    from psgrid.cluster.run.preflight import check_shard_device

    for model in models:
        base = base_job(model, device, hidden, batch_size, steps, shard_device)
        for s in shards:
            for w in workers:
                check_shard_device(apply_overrides(base, {"shards": s, "workers": w}), FLAGS)


def rows(
    models,
    modes,
    device,
    shards,
    workers,
    planes,
    hidden,
    batch_size,
    steps,
    repeats,
    shard_device="auto",
    pull_ahead=False,
    placements=("process",),
):
    """Each configuration's row as its repeats end, then each model's no-servers row (every reference run's median)."""
    for model in models:
        base = base_job(model, device, hidden, batch_size, steps, shard_device)
        references: list[dict] = []

        def reference() -> dict:
            references.append(no_servers(base.train))
            return references[-1]

        before = reference()
        for s, w, plane, mode, placement in product(shards, workers, planes, modes, placements):
            if placement == "worker" and w < s:
                continue  # shard i lives in worker i: there must be a worker per shard
            ahead = pull_ahead and not mode_rules(mode).accumulates  # sync has nothing to pull ahead
            job = apply_overrides(
                base,
                {
                    "shards": s,
                    "workers": w,
                    "mode": mode,
                    "shared_memory": plane == "shm",
                    "pull_ahead": ahead,
                    "data_plane": "grpc" if plane == "grpc" else "tcp",
                    "shard_placement": placement,
                },
            )
            runs = []
            for _ in range(repeats):
                found = with_servers(job)
                after = reference()
                found["no_servers_samples_per_s"] = beside(before["samples_per_s"], after["samples_per_s"])
                runs.append(found)
                before = after
            best = {
                k: statistics.median(r[k] for r in runs)
                for k in ("samples_per_s", "job_samples_per_s", "pull_s", "wait_s", "compute_s", "push_s", "warmup_s")
            }
            # The row's reference is the median of its repeats' own, so that its samples/s over it is its ratio.
            alone_s = statistics.median(r["no_servers_samples_per_s"] for r in runs)
            yield {
                "suite": "train",
                "params": before["params"],
                "shards": s,
                "workers": w,
                "mode": mode,
                "model": model,
                "data_plane": plane,
                "planes_used": runs[0]["planes_used"],
                "device": before["device"],
                "shard_device": runs[0]["shard_device"],
                "shard_placement": placement,
                "batch_size": batch_size,
                "pull_ahead": runs[0]["pulled_ahead"],
                **best,
                "no_servers_samples_per_s": alone_s,
                "ratio_vs_no_servers": best["samples_per_s"] / alone_s,
                "ratios": [r["samples_per_s"] / r["no_servers_samples_per_s"] for r in runs],
                "repeats": repeats,
            }
        yield {
            "suite": "train",
            "params": before["params"],
            "shards": 0,
            "workers": 1,
            "mode": "none",
            "model": model,
            "data_plane": None,
            "device": before["device"],
            "shard_device": None,
            "batch_size": batch_size,
            "samples_per_s": statistics.median(r["samples_per_s"] for r in references),
            "no_servers_samples_per_s": statistics.median(r["samples_per_s"] for r in references),
            "compute_s": statistics.median(r["step_s"] for r in references),
            "pull_s": 0.0,
            "push_s": 0.0,
            "wait_s": 0.0,
            "warmup_s": statistics.median(r["warmup_s"] for r in references),
            "ratio_vs_no_servers": 1.0,
            "samples_per_s_each": [r["samples_per_s"] for r in references],
            "repeats": len(references),
        }


def run(
    *,
    models,
    modes,
    device,
    shards,
    workers,
    planes,
    hidden,
    batch_size,
    steps,
    repeats,
    as_json,
    shard_device="auto",
    out=sys.stdout,
    pull_ahead: bool = False,
    placements=("process",),
) -> list[dict]:
    """Every configuration's row, printed as it comes (a table, or JSON lines); ``shard_device`` and
    ``placements`` (``shard_placement``) as the job keys."""
    check(models, device, shards, workers, hidden, batch_size, steps, shard_device)
    found = []
    if not as_json and pull_ahead:
        print(
            "async and ssp pull ahead (pull_ahead = true): pull ms is what a step still waited for its weights",
            file=out,
            flush=True,
        )
    if not as_json:
        print(
            "samples/s over each run's steady steps; alone: the mean of the no-servers runs beside each repeat "
            "(their median over repeats), and x alone the row's samples/s over it; mode none: every no-servers run",
            file=out,
        )
        print(
            f"{'model':>5} {'params':>8} {'S':>2} {'W':>2} {'shard':>5} {'in':>7} {'plane':>5} {'mode':>6} {'samples/s':>10} "
            f"{'alone':>10} {'x alone':>7} {'pull ms':>8} {'wait ms':>8} {'compute ms':>10} {'push ms':>8}  each repeat's x alone",
            file=out,
            flush=True,
        )
    for row in rows(
        models,
        modes,
        device,
        shards,
        workers,
        planes,
        hidden,
        batch_size,
        steps,
        repeats,
        shard_device,
        pull_ahead,
        placements,
    ):
        found.append(row)
        if as_json:
            print(json.dumps(row), file=out, flush=True)
        else:
            print(
                f"{row['model']:>5} {row['params'] / 1e6:7.2f}M {row['shards']:>2} {row['workers']:>2} "
                f"{row['shard_device'] or '-':>5} {row.get('shard_placement') or '-':>7} {used_planes(row):>5} "
                f"{row['mode']:>6} "
                f"{row['samples_per_s']:10.0f} {row['no_servers_samples_per_s']:10.0f} {row['ratio_vs_no_servers']:7.2f} "
                f"{1e3 * row['pull_s']:8.2f} {1e3 * row['wait_s']:8.2f} {1e3 * row['compute_s']:10.2f} "
                f"{1e3 * row['push_s']:8.2f}  {_each(row)}",
                file=out,
                flush=True,
            )
    return found


def _each(row: dict) -> str:
    """Each repeat's ratio; for the no-servers row, each of its runs' samples/s."""
    if "samples_per_s_each" in row:
        return " ".join(f"{v:.0f}" for v in row["samples_per_s_each"])
    return " ".join(f"{r:.2f}" for r in row["ratios"])


def used_planes(row: dict) -> str:
    """The data planes a run's workers used (``ipc`` to device shards, ``local`` in the process), not the one asked for."""
    used = row.get("planes_used")
    return "+".join(used) if used else (row["data_plane"] or "-")
