"""Time one optimizer step on a 64 MiB range against ``numpy.copyto`` of the same array.

Run from the repository root: ``python -m benchmarks.bench_apply [--mib 64] [--repeats 21]
[--block 262144 65536 ...]``. Each repeat times a copy and then a step back to back, so load
from other processes on a shared machine hits both alike; the ratio is median copy time / median
step time (1.0: the step runs as fast as a copy). Interleaved, the copy also pays for writing back
the step's dirty lines, so the ratio against copies timed alone, at the start, is printed too: the
stricter figure on a quiet machine.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from psgrid.psserver.kernels import optim
from psgrid.psserver.kernels.compensation import DelayCompensation

CASES = {
    "sgd": ("sgd", dict(lr=0.01)),
    "sgd+momentum": ("sgd", dict(lr=0.01, momentum=0.9)),
    "sgd+nesterov+wd": ("sgd", dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4)),
    "adam": ("adam", dict(lr=1e-3)),
    "adam+wd": ("adam", dict(lr=1e-3, weight_decay=1e-4)),
    "sgd+dc": ("sgd", dict(lr=0.01)),  # staleness_compensation = "dc" (compensation.py)
    "sgd+momentum+dc": ("sgd", dict(lr=0.01, momentum=0.9)),
}


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument(
        "--block",
        type=int,
        nargs="*",
        default=[optim.BLOCK],
        help="block sizes in elements to compare (default: optim.BLOCK)",
    )
    args = parser.parse_args()

    n = args.mib * (1 << 20) // 4
    rng = np.random.default_rng(0)
    w = rng.standard_normal(n, dtype=np.float32)
    g = rng.standard_normal(n, dtype=np.float32) * 1e-3
    pulled = w + rng.standard_normal(n, dtype=np.float32) * 1e-3  # dc: the version a stale gradient came from
    dst = np.empty_like(w)
    np.copyto(dst, w)  # fault the pages in before timing
    alone = statistics.median(timed(lambda: np.copyto(dst, w)) for _ in range(args.repeats))
    print(f"{args.mib} MiB, {n} float32 elements, median of {args.repeats}; copyto alone {alone * 1e3:.2f} ms")

    default_block = optim.BLOCK
    try:
        for block in args.block:
            optim.BLOCK = block  # an optimizer takes its block size when built
            for label, (name, hp) in CASES.items():
                opt = optim.make_optimizer(name, n, **hp)
                dc = dict(delay=DelayCompensation(n), pulled=pulled) if label.endswith("+dc") else {}
                opt.step(w, g, **dc)  # warm up: state pages and caches
                copy, step = [], []
                for _ in range(args.repeats):
                    copy.append(timed(lambda: np.copyto(dst, w)))
                    step.append(timed(lambda: opt.step(w, g, **dc)))
                tc, ts = statistics.median(copy), statistics.median(step)
                print(
                    f"block {block:>8}  {label:<16} step {ts * 1e3:6.2f} ms  "
                    f"copyto {tc * 1e3:5.2f} ms  ratio {tc / ts:.2f} (vs copyto alone {alone / ts:.2f})"
                )
    finally:
        optim.BLOCK = default_block


if __name__ == "__main__":
    main()
