"""What it costs the GPU to move between two processes' contexts, the fixed cost of every CUDA IPC call.

Two processes (this one and a child) pass a token back and forth over a pipe, as a worker and its
device shard pass frames. Before it passes the token on, each side either does nothing on the GPU or
runs one small kernel and waits for it. Four round trips: no GPU work, work on one side only (each
side), and work on both sides, so that the GPU alternates between the two contexts twice per round
trip. The same alternation between two threads of one process (one context) is the reference:

    switch = (both - parent only - child only + neither) / 2        (per move between contexts)

    python benchmarks/gpu_context_switch.py --repeat 400 --json out.jsonl
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import threading
import time


def _kernel(size: int):
    import cupy

    x = cupy.zeros(size, cupy.float32)
    stream = cupy.cuda.Stream(non_blocking=True)

    def run() -> None:
        with stream:
            x.__iadd__(1.0)
        stream.synchronize()

    run()
    return run


def _answer(conn, size: int) -> None:
    """The other side: on b"g" run the kernel, on b"n" do nothing, then hand the token back."""
    run = _kernel(size)
    conn.send_bytes(b"r")
    while (message := conn.recv_bytes()) != b"q":
        if message == b"g":
            run()
        conn.send_bytes(b"k")


def _round_trips(conn, run, mine: bool, theirs: bool, repeat: int) -> tuple[float, float]:
    """The median round trip, and the median of this side's own work in it (0 without)."""
    times, work = [], []
    ask = b"g" if theirs else b"n"
    for _ in range(repeat):
        t = time.perf_counter()
        if mine:
            run()
        w = time.perf_counter()
        conn.send_bytes(ask)
        conn.recv_bytes()
        times.append(time.perf_counter() - t)
        work.append(w - t)
    return statistics.median(times[repeat // 10 :]), statistics.median(work[repeat // 10 :])


def _mlp_step(size: int):
    """This side's work as a worker's step: the 20M MLP's matrix products, forward and backward (batch 512)."""
    import cupy

    stream = cupy.cuda.Stream(non_blocking=True)
    shapes = [(784, 4096), (4096, 4096), (4096, 10)]
    with stream:
        weights = [cupy.random.standard_normal(s, dtype=cupy.float32) * 0.01 for s in shapes]
        x = cupy.random.standard_normal((512, 784), dtype=cupy.float32)

    def run() -> None:
        with stream:
            acts = [x]
            for w in weights:
                acts.append(cupy.maximum(acts[-1] @ w, 0))
            grad = cupy.ones_like(acts[-1])
            for w, a in zip(reversed(weights), reversed(acts[:-1])):
                _ = a.T @ grad
                grad = grad @ w.T
        stream.synchronize()

    run()
    return run


def measure(size: int, repeat: int, other: str, work: str = "add") -> dict:
    run = _mlp_step(size) if work == "mlp" else _kernel(size)
    ours, theirs = mp.get_context("spawn").Pipe() if other == "process" else mp.Pipe()
    if other == "process":
        peer = mp.get_context("spawn").Process(target=_answer, args=(theirs, size), daemon=True)
    else:
        peer = threading.Thread(target=_answer, args=(theirs, size), daemon=True)
    peer.start()
    try:
        if not ours.poll(120):
            raise SystemExit(f"the {other} on the other side did not start in 120 s")
        ours.recv_bytes()
        trips, own = {}, {}
        for _ in range(2):  # the second pass is kept: the first warms both sides up
            for name, mine, their in (
                ("neither", False, False),
                ("this side", True, False),
                ("other side", False, True),
                ("both", True, True),
            ):
                trips[name], own[name] = _round_trips(ours, run, mine, their, repeat)
        ours.send_bytes(b"q")
    finally:
        peer.join(timeout=30)
        if other == "process" and peer.is_alive():
            peer.kill()
    switch = (trips["both"] - trips["this side"] - trips["other side"] + trips["neither"]) / 2
    # Does this side's own work run slower right after the other side's (a cold cache or TLB, say)?
    return {
        "size": size,
        "other": other,
        "work": work,
        **{f"{k}_ms": 1e3 * v for k, v in trips.items()},
        "switch_ms": 1e3 * switch,
        "own_work_alone_ms": 1e3 * own["this side"],
        "own_work_after_other_ms": 1e3 * own["both"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=400)
    parser.add_argument("--sizes", default="1024,20000000", help="float32 elements the kernel adds 1 to")
    parser.add_argument("--json", help="append one line per measurement to this file")
    parser.add_argument(
        "--mlp",
        action="store_true",
        help="also: this side runs the 20M MLP's products (a worker's step), the other the add",
    )
    args = parser.parse_args()
    cases = [(size, "add") for size in map(int, args.sizes.split(","))]
    if args.mlp:
        cases.append((20_000_000, "mlp"))
    for size, work in cases:
        for other in ("thread", "process"):
            row = measure(size, args.repeat, other, work)
            print(
                f"{size:>9} floats, {work}, other side a {other:<7}: round trip neither {row['neither_ms']:.3f} ms, "
                f"this side {row['this side_ms']:.3f}, other side {row['other side_ms']:.3f}, "
                f"both {row['both_ms']:.3f}; a move between contexts {row['switch_ms']:.3f} ms; this side's "
                f"work {row['own_work_alone_ms']:.3f} ms alone, {row['own_work_after_other_ms']:.3f} after the "
                f"other's"
            )
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
