"""Where a GPU worker's step goes against 4 host shards (async, shared memory), its compute cut in three.

A step's ``compute_s`` is the model's kernels launched from Python, then the wait for them to run,
then the gradient's copy to the host. With the shards' pushes (and, pulled ahead, the next pull)
running on the client's threads beside it, this tells which of the three grows: the launches (the
interpreter lock, held by those threads), the wait (the GPU shared with the pull's copy), or the
copy (PCIe, the host's memory). It wraps the loop's gradient copy to synchronize first and time
both, so each part is measured on the step it belongs to: for ``pull_ahead`` off and on, each with
the calls posted (Client.posts: no client thread; the default) and on the client's threads (the
pull-ahead's pull shard after shard on one thread, as it was before calls were posted), for each
``--apply-threads`` (the shards' update threads: the cores they take from the worker), and for each
``--switch-intervals`` (``sys.setswitchinterval``: how long a thread that wants the interpreter
lock waits before the holder is asked to give it up; 5 ms by default), and for each ``--checks``
(the shards' check of a gradient for NaN: NumPy's min and max, theirs, or BLAS's dot product, the
one before; shard_variants.py), and for each ``--parts`` (parts of the range an update's thread
takes in turn; 1: one fixed chunk a thread, as before).

    python benchmarks/host_step_parts.py --repeats 3 --apply-threads 0,3 --switch-intervals 0.005,0.0005
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_workers  # noqa: E402  (this directory's script, for its runs and models)
import shard_probe  # noqa: E402  (this directory's: the shards' own times for a push)
import shard_variants  # noqa: E402  (this directory's: the shards' update as it was before)

from psgrid.psserver.client.client import Client  # noqa: E402
from psgrid.worker import flat, loop  # noqa: E402
from psgrid.worker.prefetch import PullAhead  # noqa: E402

PARTS: list[tuple[float, float]] = []  # (wait for the kernels, copy) of each step, in order
# (pull_ahead, calls posted, a posted pull-ahead's copies started after the launches)
VARIANTS = {
    "threads": (False, False, True),
    "posted": (False, True, True),
    "ahead-threads": (True, False, True),
    "ahead-at-once": (True, True, False),
    "ahead-posted": (True, True, True),
}
WAITS: dict[str, list[float]] = {"post": [], "push_wait": []}  # in Client.post_pull; for the push before
AT: dict[str, list[float]] = {"push_wait": [], "push": []}  # when each ended (push_wait), began (push)

shard_variants.install_if_asked()  # in a shard process spawned from here, as its parent asked
shard_probe.install_if_asked()
_POSTS = Client.posts


def _never_posts(self) -> bool:
    """The calls on the client's threads, as before they were posted (Client.posts says no plane posts)."""
    return False


def _timed(name: str, original):
    def timed(*args, **kw):
        t0 = time.perf_counter()
        try:
            return original(*args, **kw)
        finally:
            t1 = time.perf_counter()
            if name in WAITS:
                WAITS[name].append(t1 - t0)
            if name in AT:
                AT[name].append(t1 if name in WAITS else t0)

    return timed


def _timed_download(original):
    def download_grad(self) -> None:
        if self.xp is flat.np:
            return original(self)
        t0 = time.perf_counter()
        self.xp.cuda.get_current_stream().synchronize()
        t1 = time.perf_counter()
        original(self)
        PARTS.append((t1 - t0, time.perf_counter() - t1))

    return download_grad


_PULL = PullAhead.pull


def _pull_copying_at_once(self, ahead: bool = True) -> None:
    """The variant compared: a posted pull's copies start at once, before the step's kernels are launched."""
    _PULL(self, ahead)
    if ahead:
        self.advance()


def run(
    args,
    pull_ahead: bool,
    posting: bool,
    apply_threads: int = 0,
    after_launch: bool = True,
    check: str = "numpy",
    parts: int | None = None,
) -> dict:
    PARTS.clear()
    shard_variants.use(check, parts)
    probe = tempfile.mkdtemp(prefix="shard-times-")
    shard_probe.use(probe)
    for times in (*WAITS.values(), *AT.values()):
        times.clear()
    Client.posts = _POSTS if posting else _never_posts
    PullAhead.pull = _PULL if after_launch else _pull_copying_at_once
    try:
        row = gpu_workers.with_servers(
            gpu_workers.big_mlp(args, pull_ahead=pull_ahead), 4, "async", "shm", apply_threads=apply_threads
        )
        row.update(shard_probe.summary(probe, AT["push"], AT["push_wait"]))
    finally:
        shard_probe.use(None)
        shutil.rmtree(probe, ignore_errors=True)
    row["setting"] += ", posted" if posting else ", on the client's threads"
    if pull_ahead and posting:
        row["setting"] += ", copies after the launches" if after_launch else ", copies at once"
    if apply_threads:
        row["setting"] += f", apply_threads {apply_threads}"
    row["setting"] += shard_variants.describe(check, parts)
    parts = PARTS[5:] or PARTS or [(float("nan"), float("nan"))]  # none on the CPU: no copy to time
    wait = statistics.median(p[0] for p in parts)
    copy = statistics.median(p[1] for p in parts)
    waits = {
        f"{name}_s": statistics.median(times[5:] or times) if times else float("nan") for name, times in WAITS.items()
    }
    return {**row, "wait_s": wait, "copy_s": copy, "launch_s": row["compute_s"] - wait - copy, **waits}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 4096])
    parser.add_argument("--batch", type=int, default=512)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--samples", type=int, default=65536)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--apply-threads",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[0],
        help="the shards' update threads, each value its own runs (0: their default)",
    )
    parser.add_argument("--switch-intervals", type=lambda s: [float(x) for x in s.split(",")], default=[0.005])
    parser.add_argument(
        "--variants",
        type=lambda s: [VARIANTS[v] for v in s.split(",")],
        default=[VARIANTS[v] for v in ("threads", "posted", "ahead-threads", "ahead-at-once", "ahead-posted")],
        help=f"which settings each repeat runs, of {', '.join(VARIANTS)}",
    )
    parser.add_argument(
        "--checks",
        type=lambda s: s.split(","),
        default=["numpy"],
        help="the shards' check for NaN, each its own runs: numpy (theirs), blas (the one before)",
    )
    parser.add_argument(
        "--parts",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[None],
        help="parts of the range an update thread takes in turn, each value its own runs (1: as before)",
    )
    parser.add_argument("--device", default="gpu", choices=["gpu", "cpu"])
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.model = "mlp"
    flat.FlatBuffers.download_grad = _timed_download(flat.FlatBuffers.download_grad)
    Client.post_pull = _timed("post", Client.post_pull)
    loop._finish = _timed("push_wait", loop._finish)
    Client.push = _timed("push", Client.push)
    rows = []
    for repeat in range(args.repeats):
        alone = gpu_workers.without_servers(gpu_workers.big_mlp(args))["step_s"]
        rows.append({"repeat": repeat, "setting": "no servers", "steady_step_s": alone, "ratio": 1.0})
        for interval in args.switch_intervals:
            sys.setswitchinterval(interval)
            for ahead, posting, after in args.variants:
                for threads in args.apply_threads:
                    for check, parts in itertools.product(args.checks, args.parts):
                        row = run(args, ahead, posting, threads, after, check, parts)
                        rows.append(
                            {
                                "repeat": repeat,
                                "switch_interval": interval,
                                **row,
                                "ratio": alone / row["steady_step_s"],
                            }
                        )
                        print(json.dumps(rows[-1]), flush=True)
        sys.setswitchinterval(0.005)
    keys = (
        "steady_step_s",
        "pull_s",
        "post_s",
        "launch_s",
        "wait_s",
        "copy_s",
        "push_wait_s",
        "push_s",
        "pull_ahead_s",
        "shard_push_s",
        "slowest_push_s",
        "shard_update_s",
        "shard_period_s",
        "to_shard_s",
        "to_worker_s",
    )
    print(
        f"\nMLP 784-{'-'.join(map(str, args.hidden))}-10, 4 host shards over shared memory, async; medians of "
        f"{args.repeats} repeats (ms)"
    )
    print(f"{'setting':<72} {'x none':>6} " + " ".join(f"{k[:-2]:>8}" for k in keys))
    groups: dict[str, list[dict]] = {}
    for r in rows:
        switch = len(args.switch_intervals) > 1 and "switch_interval" in r
        name = r["setting"] + (f", switch {1e3 * r['switch_interval']:g} ms" if switch else "")
        groups.setdefault(name, []).append(r)
    for name, found in groups.items():
        med = {k: statistics.median(r.get(k, float("nan")) for r in found) for k in keys}
        ratio = statistics.median(r.get("ratio", 1.0) for r in found)
        print(f"{name:<72} {ratio:6.3f} " + " ".join(f"{1e3 * med[k]:8.2f}" for k in keys), flush=True)
    if args.json:
        Path(args.json).write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
