"""The shard in the worker's process against no servers, in alternating blocks of steps of one process.

benchmarks/gpu_workers.py measures each setting in a run of its own beside a no-servers run, and
on the lent H100s single repeats of one setting spread from 0.49 to 1.21 of no servers: the
machine's speed drifts between runs by more than the servers cost. Here both trainers live in one
process on one GPU, as GeePS' placement has them: the same model, data loader and device, a device
shard started in this process (the in-process plane) and a worker's loop around it (the loop's own
``pull_and_compute``; in async the push of each step in flight during the next, as the loop does),
and plain SGD on the GPU with no servers. They take turns in blocks of ``--block`` steps, ordered
ABBA so a drift within a pair cancels; each pair gives a ratio (no servers' time per step over the
shard's), and the median of the pairs is reported for each setting.

The shard's threads (its server, the client's heartbeat) live in the process during the no-servers
blocks too; they sleep there ("before" is the no-servers step timed before the shard started, to
show whether they cost it anything), and each block ends by waiting for its last push (counted
against the servers).

    python benchmarks/placement_interleaved.py --model mlp --pairs 10 --block 40
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_workers import HostedShard, big_mlp  # noqa: E402

from psgrid.psserver.config import ServerConfig  # noqa: E402
from psgrid.worker.backend import sync  # noqa: E402
from psgrid.worker.data import BatchLoader  # noqa: E402
from psgrid.worker.flat import FlatBuffers  # noqa: E402
from psgrid.worker.loop import build, make_client, pull_and_compute, warm_up  # noqa: E402
from psgrid.worker.straggler import Delay  # noqa: E402

LR = 0.01


class NoServers:
    """Plain SGD where the weights live, as cluster/bench/train.py's reference."""

    def __init__(self, model, xp, loader):
        self.model, self.xp, self.loader = model, xp, loader
        self.bufs = FlatBuffers(model.spec, xp)
        self.bufs.params[...] = xp.asarray(model.spec.pack(model.init_params(0)))

    def steps(self, count: int) -> float:
        """Seconds for ``count`` steps, the device synchronized at the end."""
        t0 = time.perf_counter()
        for _ in range(count):
            x, y = next(self.loader)
            loss = self.model.loss_and_grad(self.bufs.param_views, x, y, self.bufs.grad_views)
            self.bufs.params -= LR * self.bufs.grad
            float(loss)
        sync(self.xp)
        return time.perf_counter() - t0


class ShardInProcess:
    """A device shard in this process and one worker's steps against it, as worker/loop.py makes them."""

    def __init__(self, train, model, xp, loader, mode: str):
        device = "cpu" if train.device == "cpu" else "gpu"  # cpu: a dry run of this script
        self.shard = HostedShard(
            ServerConfig(
                shard_index=0,
                num_shards=1,
                mode=mode,
                lr=LR,
                threads=16,
                job_id=f"interleaved-{os.getpid()}-{mode}",
                shard_device=device,
            )
        )
        spec = model.spec
        self.client = make_client(
            train, [self.shard.address], spec, worker_id=0, world=1, init=lambda: spec.pack(model.init_params(0)), xp=xp
        )
        self.client.__enter__()
        self.model, self.loader = model, loader
        self.overlap = mode != "sync" and train.overlap
        self.bufs = FlatBuffers(spec, xp, self.client, double=self.overlap)
        self.delay = Delay([], 0, 0)
        self.planes = self.client.data_planes

    def steps(self, count: int) -> float:
        t0 = time.perf_counter()
        in_flight = None
        for _ in range(count):
            pull_and_compute(self.bufs, self.loader, self.model, self.delay, self.overlap)
            if in_flight is not None:
                in_flight.wait()
            in_flight = self.client.push(self.bufs.pushed, background=self.overlap)
        in_flight.wait()
        return time.perf_counter() - t0

    def close(self) -> None:
        try:
            self.client.__exit__(None, None, None)
        finally:
            self.shard.close()


def interleave(args, setting: str, mode: str, overlap: bool) -> dict:
    train = big_mlp(args, overlap=overlap, shared_memory=True)
    xp, device, data, model = build(train, rank=0, world=1)
    warm_up(model, data, train, xp, evaluate=False)
    loader = BatchLoader(data.train_x, data.train_y, train.batch_size, xp=xp, seed=1)
    alone = NoServers(model, xp, loader)
    # The reference before the shard exists in the process: whether its threads slow the no-servers blocks.
    before = statistics.median(alone.steps(args.block) / args.block for _ in range(max(3, args.pairs // 2)))
    served = ShardInProcess(train, model, xp, loader, mode)
    ratios, times = [], {"no servers": [], setting: []}
    try:
        alone.steps(args.block)  # one block each first: caches, the first pull, the first push
        served.steps(args.block)
        for pair in range(args.pairs):
            order = (alone, served) if pair % 2 == 0 else (served, alone)
            took = {id(t): t.steps(args.block) / args.block for t in order}
            times["no servers"].append(took[id(alone)])
            times[setting].append(took[id(served)])
            ratios.append(took[id(alone)] / took[id(served)])
        planes = served.planes
    finally:
        served.close()
        loader.close()
    row = {
        "setting": setting,
        "model": args.model,
        "device": device,
        "planes": planes,
        "pairs": args.pairs,
        "block": args.block,
        "ratio_vs_no_servers": statistics.median(ratios),
        "ratios": ratios,
        "step_ms": 1e3 * statistics.median(times[setting]),
        "no_servers_step_ms": 1e3 * statistics.median(times["no servers"]),
        "no_servers_before_shard_step_ms": 1e3 * before,
    }
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="mlp", choices=["mlp", "cnn"])
    parser.add_argument("--hidden", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 4096])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--samples", type=int, default=65536)
    parser.add_argument("--pairs", type=int, default=10)
    parser.add_argument("--block", type=int, default=40)
    parser.add_argument("--device", default="gpu", choices=["gpu", "cpu"], help="cpu: a dry run of this script")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.steps = args.block  # big_mlp's steps: unused here, each block counts its own
    if args.device == "gpu":
        import cupy

        print(f"GPU: {cupy.cuda.runtime.getDeviceProperties(0)['name'].decode()}, CuPy {cupy.__version__}", flush=True)
    rows = [
        interleave(args, "async, shard in the worker's process", "async", True),
        interleave(args, "async without overlap, shard in the worker's process", "async", False),
        interleave(args, "sync, shard in the worker's process", "sync", True),
    ]
    print(
        f"\n{args.model}, batch {args.batch}: {args.pairs} pairs of {args.block}-step blocks, ABBA; median of the "
        f"pairs' ratios"
    )
    print(f"{'setting':<56} {'x no servers':>12} {'step ms':>8} {'alone ms':>8} {'before':>7}  pairs")
    for r in rows:
        print(
            f"{r['setting']:<56} {r['ratio_vs_no_servers']:12.3f} {r['step_ms']:8.2f} {r['no_servers_step_ms']:8.2f}"
            f" {r['no_servers_before_shard_step_ms']:7.2f}  {min(r['ratios']):.3f}-{max(r['ratios']):.3f}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
