"""What slows a GPU worker's step when host shards update beside it: the host's memory, PCIe, or the GIL.

With 4 host shards in async (benchmarks/gpu_workers.py --ab-pull-ahead), a step of the 20M MLP
computes for about twice as long as with no servers, and the pull-ahead stretches it further.
This separates the causes, on the worker's real model and buffers: the step's compute plus the
gradient's copy to pinned host memory (what a step's ``compute_s`` measures), timed

* alone, and without the copy;
* beside a thread of the same process copying 80 MB host to device in a loop on a stream of its
  own (the pull-ahead's shape: the copy, and that thread's share of the interpreter lock);
* beside another process doing the same copy (no lock shared);
* beside S shard-like processes of T threads each running psserver's update over 20M/S floats in
  a loop (the host's memory, no PCIe), for each S x T of ``--updates`` and each check of the
  gradient for NaN of ``--checks`` (none; numpy, a shard's own in async; blas, the one before:
  shard_variants.py);
* beside both (the update processes and the copying thread): the pull-ahead's whole contention.

Each row gives the step's median and, where something ran beside it, that thing's median time per
pass: how much each side slowed the other.

    python benchmarks/host_contention.py --updates 4x4,4x2,4x1
    python benchmarks/host_contention.py --updates 4x4 --checks none,numpy,blas --no-uploads
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import shard_variants  # this directory's: the shards' update as it was before


def _updating(params: int, threads: int, check: str, ready, stop, out) -> None:
    """A shard's update of ``params`` floats on ``threads`` threads, in a loop until ``stop``: its median pass.

    ``check``: the gradient checked for NaN as the update reads it, as a shard in async does
    ("numpy"; "blas", the check before), or not ("none").
    """
    from psgrid.psserver.kernels.optim import make_optimizer
    from psgrid.psserver.kernels.parallel import Chunks

    if check != "none":
        shard_variants.use(check)

    rng = np.random.default_rng(0)
    weights = rng.standard_normal(params).astype(np.float32)
    grad = (rng.standard_normal(params) * 1e-6).astype(np.float32)
    target = np.empty_like(weights)
    chunks = Chunks(threads)
    opt = make_optimizer("sgd", params, lr=1e-9, chunks=chunks)
    checked = check != "none"
    opt.step(weights, grad, out=target, check_finite=checked)
    ready.set()
    times = []
    while not stop.is_set():
        t = time.perf_counter()
        opt.step(weights, grad, out=target, check_finite=checked)
        times.append(time.perf_counter() - t)
        weights, target = target, weights
    chunks.close()
    out.put(statistics.median(times[1:] or times))


def _uploading_process(params: int, ready, stop, out) -> None:
    """80 MB host to device in a loop, in a process of its own: the copy without a shared interpreter lock."""
    uploader = Uploader(params)
    uploader.once()
    ready.set()
    uploader.run(stop)
    out.put(uploader.median())


class Uploader:
    """Copies ``params`` floats from pinned host memory to the device on a non-blocking stream, in a loop."""

    def __init__(self, params: int):
        import cupy
        import cupyx

        self.cupy = cupy
        self.host = cupyx.empty_pinned(params, np.float32)
        self.host[:] = np.random.default_rng(1).standard_normal(params, dtype=np.float32)
        self.device = cupy.empty(params, np.float32)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.times: list[float] = []

    def once(self) -> None:
        t = time.perf_counter()
        self.device.set(self.host, stream=self.stream)
        self.stream.synchronize()
        self.times.append(time.perf_counter() - t)

    def run(self, stop) -> None:
        while not stop.is_set():
            self.once()

    def median(self) -> float:
        return statistics.median(self.times[1:] or self.times)


class Step:
    """The worker's step up to its push: the model's loss and gradient, then the gradient's copy to pinned host memory."""

    def __init__(self, hidden: list[int], batch: int):
        import cupy

        from psgrid.worker.backend import pinned_empty
        from psgrid.worker.models import build_model

        self.cupy = cupy
        self.model = build_model("mlp", (784,), 10, hidden=tuple(hidden), activation="relu")
        spec = self.model.spec
        self.params = cupy.asarray(spec.pack(self.model.init_params(0, 1.0)))
        self.views = spec.views(self.params)
        self.grad = spec.flat(cupy)
        self.grad_views = spec.views(self.grad)
        self.host_grad = pinned_empty(spec.size, np.float32, cupy)
        rng = np.random.default_rng(2)
        self.x = cupy.asarray(rng.standard_normal((batch, 784), dtype=np.float32))
        self.y = cupy.asarray(rng.integers(0, 10, batch))
        self.size = spec.size

    def time(self, steps: int, copy: bool = True) -> float:
        times = []
        for _ in range(steps + 3):
            t = time.perf_counter()
            loss = self.model.loss_and_grad(self.views, self.x, self.y, self.grad_views)
            if copy:
                self.grad.get(out=self.host_grad)
            float(loss)
            self.cupy.cuda.get_current_stream().synchronize()
            times.append(time.perf_counter() - t)
        return statistics.median(times[3:])


def beside(
    step: Step,
    steps: int,
    *,
    updates: tuple[int, int] | None = None,
    thread_upload: bool = False,
    process_upload: bool = False,
    run_step: bool = True,
    check: str = "none",
) -> dict:
    """The step's median with the named load running beside it, and the load's own medians."""
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    out = ctx.Queue()
    procs, readies = [], []
    if updates:
        shards, threads = updates
        for _ in range(shards):
            ready = ctx.Event()
            procs.append(ctx.Process(target=_updating, args=(step.size // shards, threads, check, ready, stop, out)))
            readies.append(ready)
    if process_upload:
        ready = ctx.Event()
        procs.append(ctx.Process(target=_uploading_process, args=(step.size, ready, stop, out)))
        readies.append(ready)
    for p in procs:
        p.start()
    uploader = thread_stop = worker = None
    try:
        for ready in readies:
            if not ready.wait(120):
                raise RuntimeError("a load process did not start in 120 s")
        if thread_upload:
            uploader, thread_stop = Uploader(step.size), threading.Event()
            uploader.once()
            worker = threading.Thread(target=uploader.run, args=(thread_stop,), daemon=True)
            worker.start()
        time.sleep(0.3)
        step_s = step.time(steps) if run_step else float("nan")
        if not run_step:
            time.sleep(1.0)
    finally:
        stop.set()
        if thread_stop is not None:
            thread_stop.set()
            worker.join(30)
        loads = [out.get(timeout=60) for _ in procs]
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    row = {"step_ms": 1e3 * step_s}
    if updates:
        row["update_ms"] = 1e3 * statistics.median(loads[: updates[0]])
    if process_upload:
        row["upload_ms"] = 1e3 * loads[-1]
    if uploader is not None:
        row["upload_ms"] = 1e3 * uploader.median()
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 4096])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--updates", default="4x4,4x2,4x1", help="SxT: S processes of T update threads each")
    parser.add_argument(
        "--checks", default="none", help="the update loads' check for NaN, each its own rows: none, numpy, blas"
    )
    parser.add_argument("--no-uploads", action="store_true", help="leave out the rows with a copy to the GPU")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    step = Step(args.hidden, args.batch)
    step.time(5)
    loads = [tuple(int(v) for v in s.split("x")) for s in args.updates.split(",")]
    checks = args.checks.split(",")
    rows = [
        ("compute only", {"step_ms": 1e3 * step.time(args.steps, copy=False)}),
        ("compute + gradient copy (alone)", {"step_ms": 1e3 * step.time(args.steps)}),
    ]
    if not args.no_uploads:
        rows += [
            ("beside an upload thread (same process)", beside(step, args.steps, thread_upload=True)),
            ("beside an upload process", beside(step, args.steps, process_upload=True)),
        ]
    named = lambda load, check: f"{load[0]}x{load[1]} update{'' if check == 'none' else ', ' + check + ' check'}"  # noqa: E731
    for load in loads:
        for check in checks:
            rows.append((f"beside {named(load, check)}", beside(step, args.steps, updates=load, check=check)))
            if not args.no_uploads:
                rows.append(
                    (
                        f"beside {named(load, check)} + upload thread",
                        beside(step, args.steps, updates=load, thread_upload=True, check=check),
                    )
                )
    for load in loads:
        for check in checks:
            rows.append(
                (
                    f"{named(load, check)} alone (no step)",
                    beside(step, args.steps, updates=load, run_step=False, check=check),
                )
            )
    alone_upload = Uploader(step.size)
    for _ in range(10):
        alone_upload.once()
    rows.append(("an upload alone (no step)", {"upload_ms": 1e3 * alone_upload.median()}))
    print(f"\nMLP 784-{'-'.join(map(str, args.hidden))}-10 ({step.size / 1e6:.1f}M), batch {args.batch}; medians")
    print(f"{'setting':<44} {'step ms':>8} {'upload ms':>9} {'update ms':>9}")
    for name, row in rows:
        print(
            f"{name:<44} {row.get('step_ms', float('nan')):8.2f} {row.get('upload_ms', float('nan')):9.2f} "
            f"{row.get('update_ms', float('nan')):9.2f}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps({"setting": n, **r}) for n, r in rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
