"""The host's memory bandwidth for the passes a shard makes, by thread count: what bounds an update.

A shard's update of P floats reads the gradient and the weights and writes the next version
(plain SGD; three streams of 4P bytes, plus the check for NaN and infinity where it is a pass of
its own). This measures, on this machine, ``numpy.copyto`` (two streams) and that update
(psserver's own optimizer, out of place, as a shard runs it) over P floats cut among T threads,
in one process (NumPy releases the interpreter lock inside a pass): GB/s counting every byte
read and written, median of repeats. With S shards of P/S each running T threads, the host does
S*T of these at once. The last two columns check the gradient for NaN as the update reads it, as a
shard in async does: with NumPy's min and max (a shard's check) and with a dot product through
BLAS (the check before; shard_variants.py).

    python benchmarks/host_bandwidth.py --params 20M --threads 1,2,4,8,16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import shard_variants  # this directory's: the shards' update as it was before

from psgrid.psserver.kernels.optim import make_optimizer
from psgrid.psserver.kernels.parallel import Chunks


def median_time(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--params", default="20M", help="floats (K/M suffixes), default 20M (80 MB)")
    parser.add_argument("--threads", default="1,2,4,8,16")
    parser.add_argument("--repeat", type=int, default=9)
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args()
    units = {"k": 10**3, "m": 10**6}
    text = args.params.lower()
    params = int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)
    rng = np.random.default_rng(0)
    weights = rng.standard_normal(params).astype(np.float32)
    grad = (rng.standard_normal(params) * 1e-6).astype(np.float32)
    target = np.empty_like(weights)
    rows = []
    print(f"{params / 1e6:g}M floats ({4 * params / 1e6:.0f} MB); GB/s count every byte read and written")
    print(
        f"{'threads':>7} {'copy ms':>8} {'copy GB/s':>9} {'update ms':>9} {'update GB/s':>11} {'checked ms':>10} {'blas-checked ms':>15}"
    )
    for threads in (int(t) for t in args.threads.split(",")):
        chunks = Chunks(threads)
        try:
            copy_s = median_time(
                lambda: chunks.map(lambda lo, hi, _: np.copyto(target[lo:hi], weights[lo:hi]), params), args.repeat
            )
            opt = make_optimizer("sgd", params, lr=1e-9, chunks=chunks)
            update_s = median_time(lambda: opt.step(weights, grad, out=target), args.repeat)
            checked_s = median_time(lambda: opt.step(weights, grad, out=target, check_finite=True), args.repeat)
            shard_variants.use("blas")
            try:
                blas_checked_s = median_time(
                    lambda: opt.step(weights, grad, out=target, check_finite=True), args.repeat
                )
            finally:
                shard_variants.use("numpy")
        finally:
            chunks.close()
        row = {
            "params": params,
            "threads": threads,
            "copy_s": copy_s,
            "copy_gbps": 8 * params / copy_s / 1e9,
            "update_s": update_s,
            "update_gbps": 12 * params / update_s / 1e9,
            "checked_update_s": checked_s,
            "blas_checked_update_s": blas_checked_s,
        }
        rows.append(row)
        print(
            f"{threads:7d} {1e3 * copy_s:8.2f} {row['copy_gbps']:9.1f} {1e3 * update_s:9.2f} "
            f"{row['update_gbps']:11.1f} {1e3 * checked_s:10.2f} {1e3 * blas_checked_s:15.2f}",
            flush=True,
        )
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
