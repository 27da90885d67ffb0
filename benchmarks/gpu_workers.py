"""GPU worker figures: samples/s of a ~20M-parameter MLP with and without the servers in the loop,
the pull / compute / push time per step against CuPy's own pinned copy of the same bytes (measured
in the same run), and a two-GPU-worker MNIST run to test accuracy.

Run on a machine with CUDA GPUs (benchmarks/gpu_verify.sh runs it on the lent device):

    python benchmarks/gpu_workers.py --steps 60 --batch 512 --shards 1,4 --planes shm,tcp
    python benchmarks/gpu_workers.py --ab-pull-ahead 5     # pull_ahead off and on, alternating, 4 shards async

Shards run as processes on the same host, as they would on a single GPU box: host shards reached
through shared memory (``shm``, the default there) or, for comparison, the TCP data plane; device
shards (``ipc``: ``shard_device = "gpu"``, weights and update on the worker's GPU) over CUDA IPC, or
(``local``, ``--device-planes``) a device shard in the worker's own process, called by the in-process
plane.
``--workers 2`` also runs two worker processes sharing the GPU against device shards, their total
samples/s against one process with no servers.
Times are medians over the steps after a warm-up; the device is synchronized
inside each timed region (the gradient's copy to the host waits for it).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from psgrid.cluster.bench.transport import ShardProcess
from psgrid.psserver.config import ServerConfig
from psgrid.worker.config import TrainConfig


def big_mlp(args, **overrides) -> TrainConfig:
    """The measured model: the MLP (``--hidden``), or with ``--model cnn`` the digits-shaped CNN of bench train."""
    settings = dict(
        model=args.model,
        hidden=args.hidden,
        dataset="synthetic",
        synthetic_features=784,
        synthetic_samples=args.samples,
        batch_size=args.batch,
        steps=args.steps,
        eval_every=0,
        device=args.device,
        deadline_s=120,
    )
    if args.model == "cnn":
        settings["synthetic_image"] = [1, 28, 28]
    settings.update(overrides)
    return TrainConfig(**settings)


def without_servers(train: TrainConfig, lr: float = 0.01) -> dict:
    """The same model, data loader and buffers, updated on the GPU with plain SGD: no servers at all."""
    from psgrid.cluster.bench.train import no_servers

    alone = no_servers(train, lr)
    return {
        "setting": "no servers (local SGD on the GPU)",
        "device": alone["device"],
        "params": alone["params"],
        "step_s": alone["step_s"],
        "samples_per_s": alone["samples_per_s"],
        "compute_s": alone["step_s"],
        "pull_s": 0.0,
        "push_s": 0.0,
    }


def pinned_copies(params: int, repeat: int = 20) -> dict:
    """CuPy's own copies of ``params`` floats between pinned host memory and the device: the reference."""
    import cupy
    import cupyx

    host = cupyx.empty_pinned(params, np.float32)
    host[:] = 1.0
    device = cupy.empty(params, np.float32)
    times = {"h2d": [], "d2h": []}
    for _ in range(repeat + 2):
        t = time.perf_counter()
        device.set(host)
        cupy.cuda.Device().synchronize()
        times["h2d"].append(time.perf_counter() - t)
        t = time.perf_counter()
        device.get(out=host)
        times["d2h"].append(time.perf_counter() - t)
    h2d, d2h = (statistics.median(times[k][2:]) for k in ("h2d", "d2h"))
    return {
        "setting": "CuPy pinned copy (reference)",
        "h2d_s": h2d,
        "d2h_s": d2h,
        "h2d_gbps": 4 * params / h2d / 1e9,
        "d2h_gbps": 4 * params / d2h / 1e9,
    }


def shard_processes(shards: int, mode: str, plane: str, apply_threads: int = 0) -> list:
    """The shards of one run (one job: clients check), on the GPU for the ``ipc`` plane; ``apply_threads`` 0: their default."""
    job = f"gpu-workers-{os.getpid()}-{time.monotonic_ns()}"
    from psgrid.worker.backend import gpu_unavailable

    # ipc means device shards; a dry run on a machine without a GPU runs host shards in their place
    device = "gpu" if plane == "ipc" and gpu_unavailable() is None else "cpu"
    return [
        ShardProcess(
            ServerConfig(
                shard_index=i,
                num_shards=shards,
                mode=mode,
                lr=0.01,
                threads=16,
                job_id=job,
                shard_device=device,
                apply_threads=apply_threads,
            )
        )
        for i in range(shards)
    ]


class HostedShard:
    """A device shard in this process, served to it by calls (the in-process plane): GeePS' placement."""

    def __init__(self, config: ServerConfig):
        from psgrid.psserver.server import serve

        self.server = serve(config, in_process_clients=True)
        self.address = self.server.address

    def close(self) -> None:
        self.server.stop(grace=0.5)


def hosted_shards(shards: int, mode: str) -> list[HostedShard]:
    """The shards of one run in this process, on its GPU, for the ``local`` plane."""
    job = f"gpu-workers-{os.getpid()}-{time.monotonic_ns()}"
    from psgrid.worker.backend import gpu_unavailable

    device = "gpu" if gpu_unavailable() is None else "cpu"
    return [
        HostedShard(
            ServerConfig(
                shard_index=i, num_shards=shards, mode=mode, lr=0.01, threads=16, job_id=job, shard_device=device
            )
        )
        for i in range(shards)
    ]


def with_servers(train: TrainConfig, shards: int, mode: str, plane: str = "shm", apply_threads: int = 0) -> dict:
    from psgrid.worker.loop import run_worker

    procs = hosted_shards(shards, mode) if plane == "local" else shard_processes(shards, mode, plane, apply_threads)
    train.shared_memory = plane in ("shm", "ipc", "local")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            metrics = Path(tmp) / "worker.jsonl"
            result = run_worker(train, [p.address for p in procs], rank=0, world=1, metrics_path=str(metrics))
            steps = [json.loads(line) for line in metrics.read_text().splitlines()]
    finally:
        for p in procs:
            p.close()
    start = next((s for s in steps if s.get("event") == "start"), {})
    planes, ahead = start.get("data_planes"), bool(start.get("pull_ahead"))
    steps = [s for s in steps if s.get("event") == "step"][5:]
    # The steady step: the median time from one step's start to the next's (one-time costs left out, as
    # the no-servers reference leaves out its warm-up).
    steady = statistics.median(b["started"] - a["started"] for a, b in zip(steps, steps[1:]))
    med = {k: statistics.median(s[k] for s in steps) for k in ("pull_s", "compute_s", "push_s")}
    # Pulled ahead, pull_s is what a step still waited for its weights; their pull's own time is pull_ahead_s.
    med["pull_ahead_s"] = statistics.median(s.get("pull_ahead_s", float("nan")) for s in steps)
    step_s = med["pull_s"] + med["compute_s"] + med["push_s"]
    overlap = "" if start.get("overlap", True) or mode == "sync" else ", no overlap"  # as the loop decided
    setting = f"{shards} shard(s), {mode}, {plane}{overlap}{', pull-ahead' if ahead else ''}"
    return {
        "setting": setting,
        "device": result["device"],
        "planes": planes,
        "pull_ahead": ahead,
        "steady_step_s": steady,
        "steady_samples_per_s": train.batch_size / steady,
        "warmup_s": result.get("warmup_s"),
        "params": None,
        "samples_per_s": result["samples"] / result["wall_s"],
        "step_s": result["wall_s"] / result["steps"],
        **med,
        "sum_of_medians_s": step_s,
    }


def _sharing_worker(rank: int, world: int, train: TrainConfig, addresses, queue) -> None:
    from psgrid.worker.loop import run_worker

    os.environ["LOCAL_RANK"] = "0"  # every worker on GPU 0: they share it
    queue.put(run_worker(train, addresses, rank=rank, world=world))


def sharing_the_gpu(train: TrainConfig, workers: int, shards: int, mode: str, plane: str) -> dict:
    """``workers`` worker processes on one GPU against the same shards: their samples/s added up."""
    procs = shard_processes(shards, mode, plane)
    train.shared_memory = plane in ("shm", "ipc")
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    try:
        children = [
            ctx.Process(target=_sharing_worker, args=(r, workers, train, [p.address for p in procs], queue))
            for r in range(workers)
        ]
        for c in children:
            c.start()
        results = [queue.get(timeout=600) for _ in children]
        for c in children:
            c.join(timeout=60)
    finally:
        for p in procs:
            p.close()
    total = sum(r["samples"] / r["wall_s"] for r in results)
    return {
        "setting": f"{workers} workers on 1 GPU, {shards} shard(s), {mode}, {plane}",
        "samples_per_s": total,
        "per_worker": [r["samples"] / r["wall_s"] for r in results],
        "device": results[0]["device"],
    }


def pull_ahead_ab(args, shards: int = 4, mode: str = "async", plane: str = "shm") -> list[dict]:
    """pull_ahead off and on in turn, ``args.ab_pull_ahead`` times each, with no servers measured beside every pair.

    Alternating in one run keeps the machine's drift out of the ratio (the no-server figure moved by 27%
    between two calls on the H100); each row is the median over the repeats. With several
    ``--apply-threads`` the pair runs for each (the shards' update threads: the host's memory is what
    they share with the pull).
    """
    counts = args.apply_threads

    def named(on, t):
        return f"pull_ahead = {str(on).lower()}" + (f", apply_threads {t or 'default'}" if len(counts) > 1 else "")

    runs: dict[str, list[dict]] = {"no servers": [], **{named(on, t): [] for t in counts for on in (False, True)}}
    for repeat in range(args.ab_pull_ahead):
        runs["no servers"].append(without_servers(big_mlp(args)))
        for threads in counts:
            for on in (False, True):
                row = with_servers(big_mlp(args, pull_ahead=on), shards, mode, plane, apply_threads=threads)
                runs[named(on, threads)].append({**row, "apply_threads": threads})
                print(json.dumps({"repeat": repeat, "apply_threads": threads, **row}), flush=True)
    alone = statistics.median(r["samples_per_s"] for r in runs["no servers"])
    rows = []
    for name, found in runs.items():
        med = {k: statistics.median(r[k] for r in found) for k in ("samples_per_s", "pull_s", "compute_s", "push_s")}
        med["pull_ahead_s"] = statistics.median(r.get("pull_ahead_s", float("nan")) for r in found)
        # The steady step's samples/s (the median step, as the no-servers reference is), beside the whole run's.
        med["steady_samples_per_s"] = statistics.median(
            r.get("steady_samples_per_s", r["samples_per_s"]) for r in found
        )
        setting = name if name == "no servers" else f"{name} ({shards} shards, {mode}, {plane})"
        rows.append(
            {
                "setting": setting,
                "ab": "pull_ahead",
                "repeats": len(found),
                "device": found[0]["device"],
                **med,
                "ratio_vs_no_servers": med["samples_per_s"] / alone,
                "steady_ratio_vs_no_servers": med["steady_samples_per_s"] / alone,
                "samples_per_s_each": [r["samples_per_s"] for r in found],
            }
        )
    params = runs["no servers"][0]["params"]
    print(
        f"\npull-ahead A/B: MLP 784-{'-'.join(map(str, args.hidden))}-10 ({params / 1e6:.1f}M), batch {args.batch}, "
        f"{args.steps} steps, {args.ab_pull_ahead} repeats alternating; medians ({rows[0]['device']})"
    )
    print(
        f"{'setting':<66} {'samples/s':>10} {'x no servers':>12} {'steady x':>8} {'pull ms':>8} {'ahead ms':>8} "
        f"{'compute ms':>10} {'push ms':>8}"
    )
    for r in rows:
        print(
            f"{r['setting']:<66} {r['samples_per_s']:10.0f} {r['ratio_vs_no_servers']:12.3f} "
            f"{r['steady_ratio_vs_no_servers']:8.3f} {1e3 * r['pull_s']:8.2f} {1e3 * r['pull_ahead_s']:8.2f} "
            f"{1e3 * r['compute_s']:10.2f} {1e3 * r['push_s']:8.2f}"
        )
    for off, on in zip(rows[1::2], rows[2::2]):
        each = zip(off["samples_per_s_each"], on["samples_per_s_each"])
        print(
            f"{on['setting'].split(' (')[0]} against off: {on['samples_per_s'] / off['samples_per_s']:.3f} "
            f"(per repeat: {', '.join(f'{b / a:.3f}' for a, b in each)})",
            flush=True,
        )
    return rows


def alternating(args) -> list[dict]:
    """Device shards over CUDA IPC beside no servers, in turn, ``args.repeats`` times: each repeat's ratio is
    taken against the no-servers run just before it (that reference moved by up to 30% between calls on the
    H100), and the median of the ratios is reported. One worker's ratio is of steady steps (the median
    start to start, as the reference's median step); workers sharing the GPU count every step of their run."""
    # In the worker's process async does not overlap by default (overlap = "auto", worker/loop.py): there the
    # overlapped row asks for it, so that --no-overlap has something to be compared with.
    asked = lambda mode, plane: {"overlap": True} if plane == "local" and mode != "sync" else {}  # noqa: E731
    settings = {
        f"1 shard, {mode}, {plane}{', overlap' if asked(mode, plane) else ''}": (
            lambda mode=mode, plane=plane: with_servers(big_mlp(args, **asked(mode, plane)), 1, mode, plane)
        )
        for mode in args.modes
        for plane in args.device_planes
    }
    if args.no_overlap:  # async and ssp with each push waited for before the next pull, beside the overlapped
        settings.update(
            {
                f"1 shard, {mode}, {plane}, no overlap": (
                    lambda mode=mode, plane=plane: with_servers(big_mlp(args, overlap=False), 1, mode, plane)
                )
                for mode in args.modes
                if mode != "sync"
                for plane in args.device_planes
            }
        )
    if args.workers > 1:
        settings.update(
            {
                f"{args.workers} workers on 1 GPU, {mode}, ipc": (
                    lambda mode=mode: sharing_the_gpu(big_mlp(args), args.workers, 1, mode, "ipc")
                )
                for mode in args.modes
            }
        )
    ratios: dict[str, list[float]] = {name: [] for name in settings}
    speeds: dict[str, list[float]] = {name: [] for name in ["no servers", *settings]}
    for repeat in range(args.repeats):
        reference = without_servers(big_mlp(args))
        alone = reference["samples_per_s"]
        speeds["no servers"].append(alone)
        print(json.dumps({"repeat": repeat, "setting": "no servers", "step_ms": 1e3 * reference["step_s"]}), flush=True)
        for name, run in settings.items():
            row = run()
            speed = row.get("steady_samples_per_s", row["samples_per_s"])
            speeds[name].append(speed)
            ratios[name].append(speed / alone)
            parts = {
                f"{k[:-2]}_ms": 1e3 * row[k] for k in ("steady_step_s", "pull_s", "compute_s", "push_s") if k in row
            }
            print(
                json.dumps({"repeat": repeat, "setting": name, "samples_per_s": speed, "no_servers": alone, **parts}),
                flush=True,
            )
    print(
        f"\n{args.model} ({args.steps} steps, batch {args.batch}), {args.repeats} repeats alternating with no servers"
    )
    print(f"{'setting':<34} {'samples/s':>10} {'x no servers':>12}  per repeat")
    rows = []
    for name, found in speeds.items():
        ratio = statistics.median(ratios[name]) if name in ratios else 1.0
        each = ", ".join(f"{r:.3f}" for r in ratios.get(name, []))
        print(f"{name:<34} {statistics.median(found):10.0f} {ratio:12.3f}  {each}", flush=True)
        rows.append(
            {
                "setting": name,
                "model": args.model,
                "samples_per_s": statistics.median(found),
                "ratio_vs_no_servers": ratio,
                "ratios": ratios.get(name, []),
                "repeats": args.repeats,
            }
        )
    return rows


def _two_gpu_worker(rank: int, addresses, metrics: str, queue, device: str) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    from psgrid.worker.loop import run_worker

    train = TrainConfig(
        model="mlp", hidden=[128], dataset="mnist5k", batch_size=32, epochs=20, eval_every=0, device=device, seed=0
    )
    queue.put(run_worker(train, addresses, rank=rank, world=2, metrics_path=metrics))


def two_gpu_mnist(mode: str = "sync", device: str = "gpu") -> dict:
    """MLP 784-128-10 on mnist5k with two worker processes, one per GPU, and two CPU shards."""
    from psgrid.worker.evaluate import evaluate

    job = f"gpu-workers-{os.getpid()}"
    procs = [ShardProcess(ServerConfig(shard_index=i, num_shards=2, mode=mode, lr=0.1, job_id=job)) for i in range(2)]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    try:
        addresses = [p.address for p in procs]
        with tempfile.TemporaryDirectory() as tmp:
            workers = [
                ctx.Process(target=_two_gpu_worker, args=(r, addresses, f"{tmp}/w{r}.jsonl", queue, device))
                for r in range(2)
            ]
            start = time.perf_counter()
            for w in workers:
                w.start()
            results = [queue.get(timeout=600) for _ in workers]
            for w in workers:
                w.join(timeout=60)
            wall = time.perf_counter() - start
        scores = evaluate(TrainConfig(model="mlp", hidden=[128], dataset="mnist5k"), addresses)
    finally:
        for p in procs:
            p.close()
    return {
        "mode": mode,
        "workers": sorted(r["device"] for r in results),
        "wall_s": wall,
        "steps": [r["steps"] for r in results],
        **scores,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 4096])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--samples", type=int, default=65536)
    parser.add_argument("--shards", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4])
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["async", "sync"])
    parser.add_argument(
        "--planes",
        type=lambda s: s.split(","),
        default=["shm", "tcp"],
        help="data planes to measure (shm: shared memory to host shards, the default on one host; tcp; "
        "ipc: CUDA IPC to device shards)",
    )
    parser.add_argument("--skip-two-gpu", action="store_true")
    parser.add_argument(
        "--no-overlap",
        action="store_true",
        help="also measure async over ipc (with --repeats: on each of --device-planes) with a step's "
        "push waited for before the next pull",
    )
    parser.add_argument("--workers", type=int, default=1, help="also run this many workers sharing the GPU (ipc)")
    parser.add_argument(
        "--ab-pull-ahead",
        type=int,
        default=0,
        metavar="REPEATS",
        help="instead of the grid: 4 shards over shared memory, async, pull_ahead off and on in turn "
        "REPEATS times each beside no servers; medians and their ratios",
    )
    parser.add_argument(
        "--apply-threads",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[0],
        help="with --ab-pull-ahead: the shards' update threads, each value its own pair (0: the default)",
    )
    parser.add_argument("--json", default=None, help="also write all rows to this file")
    parser.add_argument("--model", default="mlp", choices=["mlp", "cnn"])
    parser.add_argument(
        "--repeats",
        type=int,
        default=0,
        help="instead of the grid: device shards over ipc (--modes, --workers) and no servers in "
        "turn, this many times; the median of each repeat's ratio",
    )
    parser.add_argument(
        "--device-planes",
        type=lambda s: s.split(","),
        default=["ipc"],
        help="with --repeats: how the worker reaches its device shard: ipc (a shard process of its "
        "own, CUDA IPC) and/or local (the shard in the worker's process, called: GeePS' placement)",
    )
    parser.add_argument("--device", default="gpu", choices=["gpu", "cpu"], help="cpu: a dry run of this script")
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="LINES",
        help="instead of the grid: one device shard over ipc in the first of --modes, the worker "
        "under cProfile; its step's parts and the LINES functions of most time of their own",
    )
    args = parser.parse_args()
    if args.profile:
        import cProfile
        import pstats

        profile = cProfile.Profile()
        row = profile.runcall(with_servers, big_mlp(args), 1, args.modes[0], "ipc")
        print({k: round(1e3 * row[k], 3) for k in ("steady_step_s", "pull_s", "compute_s", "push_s")})
        pstats.Stats(profile).sort_stats("tottime").print_stats(args.profile)
        return 0

    gpus = 0
    if args.device == "gpu":
        import cupy

        props = cupy.cuda.runtime.getDeviceProperties(0)
        gpus = cupy.cuda.runtime.getDeviceCount()
        print(f"GPU: {props['name'].decode()} x{gpus}, CuPy {cupy.__version__}", flush=True)
    if args.ab_pull_ahead or args.repeats:
        rows = pull_ahead_ab(args) if args.ab_pull_ahead else alternating(args)
        if args.json:
            Path(args.json).write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        return 0
    rows = [without_servers(big_mlp(args))]
    params = rows[0]["params"]
    reference = pinned_copies(params) if args.device == "gpu" else None
    print(
        f"MLP 784-{'-'.join(map(str, args.hidden))}-10: {params / 1e6:.1f}M parameters, "
        f"batch {args.batch}, {args.steps} steps",
        flush=True,
    )
    if reference:
        print(json.dumps(reference), flush=True)
    for plane in args.planes:
        for mode in args.modes:
            for shards in args.shards:
                rows.append(with_servers(big_mlp(args), shards, mode, plane))
                print(json.dumps(rows[-1]), flush=True)
                if plane == "ipc" and mode != "sync" and args.no_overlap:
                    rows.append(with_servers(big_mlp(args, overlap=False), shards, mode, plane))
                    print(json.dumps(rows[-1]), flush=True)
    alone = rows[0]["samples_per_s"]
    h2d = reference["h2d_s"] if reference else float("nan")
    d2h = reference["d2h_s"] if reference else float("nan")
    if reference:
        print(
            f"\nCuPy pinned copy of {4 * params / 1e6:.0f} MB: host to device {1e3 * h2d:.2f} ms "
            f"({reference['h2d_gbps']:.1f} GB/s), device to host {1e3 * d2h:.2f} ms ({reference['d2h_gbps']:.1f} GB/s)"
        )
    print(
        f"\n{'setting':<42} {'samples/s':>10} {'x alone':>7} {'steady':>7} {'step ms':>8} {'pull ms':>8} {'x copy':>6} "
        f"{'compute ms':>11} {'push ms':>8} {'x copy':>6}"
    )
    for r in rows:
        steady = r.get("steady_samples_per_s", r["samples_per_s"]) / alone
        print(
            f"{r['setting']:<42} {r['samples_per_s']:10.0f} {r['samples_per_s'] / alone:7.3f} {steady:7.3f} "
            f"{1e3 * r['step_s']:8.2f} {1e3 * r['pull_s']:8.2f} {r['pull_s'] / h2d:6.2f} "
            f"{1e3 * r['compute_s']:11.2f} {1e3 * r['push_s']:8.2f} {r['push_s'] / d2h:6.2f}",
            flush=True,
        )
    if args.workers > 1:
        for mode in args.modes:
            shared = sharing_the_gpu(big_mlp(args), args.workers, 1, mode, "ipc")
            print(json.dumps(shared), flush=True)
            print(
                f"{shared['setting']}: {shared['samples_per_s']:.0f} samples/s in all, "
                f"{shared['samples_per_s'] / alone:.3f}x one process with no servers",
                flush=True,
            )
            rows.append(shared)
    if reference:
        rows.append(reference)
    if (gpus >= 2 or args.device == "cpu") and not args.skip_two_gpu:
        two = two_gpu_mnist(device=args.device)
        rows.append(two)
        print(
            f"\n2 GPU workers, MLP 784-128-10 on mnist5k ({two['mode']}): test accuracy "
            f"{two['test_accuracy']:.4f}, train accuracy {two['train_accuracy']:.4f}, workers {two['workers']}, "
            f"{two['wall_s']:.1f}s",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
