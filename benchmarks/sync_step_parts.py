"""The parts of a small model's sync step, each timed alone in this tree and in another revision.

What ``sync_step_profile.py`` points at, without sockets between processes, threads or a profiler:
each part is run many times in one process, and its time is the median of the fastest half of its
runs (on a shared machine of two cores the slow ones are someone else's). Each tree's parts run in a
process of their own, the trees alternating, and the table gives the medians over those processes.

* ``round``: a sync round of two workers on the shard's state alone (Shard.push of each worker's
  gradient from memory it lends, the second closing the round; then each worker's wait and mark);
* ``policy``: the same round on the pure policy (on_push twice, rounds_to_close, may_pull twice);
* ``finite``: the check for NaN and infinity of one pushed gradient;
* ``copy``: one copy of the range (what a held shared-memory gradient costs, and a pull's copy);
* ``read_reply``: a client reading one reply header off a socket that has it waiting;
* ``settimeout``: one ``socket.settimeout`` (the client sets it on every call; each is a system call).

    python benchmarks/sync_step_parts.py --against 3928c08 --repeats 5
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time

import numpy as np

PARTS = ("round", "policy", "finite", "copy", "read_reply", "settimeout")


def fastest_half_us(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    times.sort()
    return 1e6 * statistics.median(times[: max(1, runs // 2)])


def shard_round(params: int, runs: int) -> float:
    """A sync round of two workers on the Shard alone, gradients lent from the workers' memory."""
    from psgrid.psserver.config import ServerConfig
    from psgrid.psserver.spec import ModelSpec

    try:
        from psgrid.psserver.state.shard import Shard
    except ImportError:  # before the state/ package
        from psgrid.psserver.shard import Shard

    spec = ModelSpec([("x", (params,))])
    shard = Shard(ServerConfig(mode="sync", lr=1e-9))
    for w in (0, 1):
        shard.register(spec.hash(), w, 0, "here")
    shard.init(spec, np.zeros(params, np.float32))
    slot = shard.take_reader_slot()
    grads = [np.full(params, 1e-6, np.float32) for _ in range(2)]
    clock = [0]

    def one() -> None:
        c = clock[0]
        for w in (0, 1):
            shard.push(w, c, shard.version, grads[w], 4 * params, borrowed=True)
        for _ in (0, 1):
            shard.wait_for_pull(0, c + 1, 10.0)
            shard.mark_current(slot)
            shard.ring.marks[slot] = -1  # the reader's copy is done
        clock[0] = c + 1

    return fastest_half_us(one, runs)


def policy_round(runs: int) -> float:
    try:
        from psgrid.psserver.state.policy import ConsistencyPolicy
    except ImportError:
        from psgrid.psserver.policy import ConsistencyPolicy

    policy = ConsistencyPolicy("sync")
    policy.join(0, 0)
    policy.join(1, 0)
    clock = [0]

    def one() -> None:
        c = clock[0]
        policy.on_push(0, c)
        policy.on_push(1, c)
        policy.rounds_to_close()
        policy.may_pull(0, c + 1)
        policy.may_pull(1, c + 1)
        clock[0] = c + 1

    return fastest_half_us(one, runs)


def finite(params: int, runs: int) -> float:
    try:
        from psgrid.psserver.dtypes import all_finite
    except ImportError:
        from psgrid.psserver.wire import all_finite
    grad = np.full(params, 1e-6, np.float32)
    return fastest_half_us(lambda: all_finite(grad), runs)


def copy(params: int, runs: int) -> float:
    src, dst = np.full(params, 1e-6, np.float32), np.empty(params, np.float32)
    return fastest_half_us(lambda: np.copyto(dst, src), runs)


def read_reply(runs: int) -> float:
    try:
        from psgrid.psserver.transports.stream_frames import REPLY, read_reply
    except ImportError:
        from psgrid.psserver.transports.tcp_frames import REPLY, read_reply
    a, b = socket.socketpair()
    frame = REPLY.pack(b"PST2", 0, 0, 1, 5, 0, 6, 0)
    times = []
    for _ in range(runs):
        a.sendall(frame)
        t = time.perf_counter()
        read_reply(b, "here")
        times.append(time.perf_counter() - t)
    a.close()
    b.close()
    times.sort()
    return 1e6 * statistics.median(times[: max(1, runs // 2)])


def settimeout(runs: int) -> float:
    a, b = socket.socketpair()
    value = [1.0]

    def one() -> None:
        value[0] = 2.0 if value[0] == 1.0 else 1.0
        a.settimeout(value[0])

    try:
        return fastest_half_us(one, runs)
    finally:
        a.close()
        b.close()


def measure(params: int, runs: int) -> dict[str, float]:
    return {
        "round": shard_round(params, runs),
        "policy": policy_round(runs * 10),
        "finite": finite(params, runs),
        "copy": copy(params, runs),
        "read_reply": read_reply(runs * 10),
        "settimeout": settimeout(runs * 10),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--this", help="a revision to measure instead of the working tree (others may be mid-edit)")
    parser.add_argument("--against", help="the revision to compare with")
    parser.add_argument("--params", type=int, default=100_000)
    parser.add_argument("--runs", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=5, help="processes of each tree, alternating")
    parser.add_argument("--inner", action="store_true", help=argparse.SUPPRESS)  # one process's figures
    args = parser.parse_args()
    if args.inner:
        print(json.dumps(measure(args.params, args.runs)))
        return
    from psgrid.cluster.bench.ps import Code, checkout, remove_checkout

    other = checkout(args.against)
    this = Code("this", checkout(args.this).root if args.this else None)
    try:
        found: dict[str, list[dict]] = {this.label: [], other.label: []}
        argv = [sys.executable, __file__, "--inner", "--params", str(args.params), "--runs", str(args.runs)]
        for r in range(args.repeats):
            for code in (this, other) if r % 2 == 0 else (other, this):
                out = subprocess.run(argv, env=code.env(), capture_output=True, text=True, check=True, cwd="/")
                found[code.label].append(json.loads(out.stdout))
        print(f"{args.params} floats, microseconds, medians of {args.repeats} processes each")
        print(f"{'part':>12} {'this':>9} {other.label:>9} {'diff':>8}")
        for part in PARTS:
            a = statistics.median(x[part] for x in found[this.label])
            b = statistics.median(x[part] for x in found[other.label])
            print(f"{part:>12} {a:9.2f} {b:9.2f} {a - b:8.2f}")
    finally:
        remove_checkout(other)
        if this.root is not None:
            remove_checkout(this)


if __name__ == "__main__":
    main()
