"""Where a push and a pull over CUDA IPC spend their time: the same calls on a tiny model (the fixed
cost: frames, threads, stream waits) and on the 20M one, beside CuPy's own device-to-device copy of
the same bytes. One device shard in a process of its own, one GPU client here; medians of repeats.

    python benchmarks/ipc_latency.py --mode sync --repeat 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from psgrid.cluster.bench.transport import ShardProcess
from psgrid.psserver.client.client import Client
from psgrid.psserver.config import ServerConfig
from psgrid.psserver.spec import ModelSpec


def median_s(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times[repeat // 10 :])


def measure(elements: int, mode: str, repeat: int) -> dict:
    import cupy

    spec = ModelSpec([("w", (elements,))])
    shard = ShardProcess(ServerConfig(mode=mode, lr=1e-6, shard_device="gpu", job_id=f"ipc-latency-{elements}"))
    try:
        with Client([shard.address], spec, init=np.zeros(elements, np.float32), gpu=0, deadline_s=60) as client:
            params = cupy.zeros(elements, cupy.float32)
            grad = cupy.ones(elements, cupy.float32)
            stream = cupy.cuda.Stream(non_blocking=True)

            def into(begin, end, values):
                params[begin:end].data.copy_from_device_async(values.data, values.nbytes, stream)
                stream.synchronize()

            client.pull(into=into)
            client.push(grad)
            planes = client.data_planes
            plane = client._conn.plane(0)  # noqa: SLF001 - a benchmark looks inside
            pull = median_s(lambda: client.pull(into=into), repeat)
            push = median_s(lambda: client.push(grad), repeat)
            after = []  # a pull right after a push: the GPU comes back from the shard's context first
            for _ in range(repeat):
                client.push(grad)
                t = time.perf_counter()
                client.pull(into=into)
                after.append(time.perf_counter() - t)
            slot = plane._slot(plane.pool.take(1.0), 0x01, elements)  # noqa: SLF001
            fill = median_s(lambda: plane._fill(slot, grad, 1), repeat)  # noqa: SLF001
            copy = median_s(
                lambda: (params.data.copy_from_device_async(grad.data, grad.nbytes, stream), stream.synchronize()),
                repeat,
            )
    finally:
        shard.close()
    return {
        "elements": elements,
        "mode": mode,
        "planes": planes,
        "pull_ms": 1e3 * pull,
        "push_ms": 1e3 * push,
        "pull_after_push_ms": 1e3 * statistics.median(after[repeat // 10 :]),
        "fill_ms": 1e3 * fill,
        "d2d_copy_ms": 1e3 * copy,
    }


def server_side(elements: int, mode: str, repeat: int) -> dict:
    """The shard's part of a push, in this process: the whole intake, and its copy-and-check and update alone."""
    from psgrid.psserver.service import ShardService
    from psgrid.psserver.state.shard import Shard
    from psgrid.psserver.transports.ipc_server import DeviceSlot

    spec = ModelSpec([("w", (elements,))])
    shard = Shard(ServerConfig(mode=mode, lr=1e-6, shard_device="gpu"))
    service = ShardService(shard)
    shard.init(spec, np.zeros(elements, np.float32))
    shard.register(spec.hash(), 0, -1, "bench")
    arrays = shard.arrays
    slot, copy, out = arrays.empty(elements), arrays.empty(elements), arrays.empty(elements)
    with arrays.use():
        slot.fill(1.0)
    clock = iter(range(10**9))

    def push():
        service.push(worker_id=0, clock=next(clock), version=shard.version, source=DeviceSlot(slot, arrays))

    def step():
        with arrays.use():
            shard.optimizer.step(shard.weights, copy, out=out)
            arrays.finished()

    return {
        "elements": elements,
        "mode": mode,
        "server_push_ms": 1e3 * median_s(push, repeat),
        "copy_checked_ms": 1e3 * median_s(lambda: arrays.copy_checked(copy, slot), repeat),
        "update_ms": 1e3 * median_s(step, repeat),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mode", default="sync", choices=["sync", "async"])
    parser.add_argument("--repeat", type=int, default=200)
    args = parser.parse_args()
    for elements in (1024, 20_000_000):
        print(json.dumps(measure(elements, args.mode, args.repeat)), flush=True)
        print(json.dumps(server_side(elements, args.mode, args.repeat)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
