"""Transport and apply figures: pull+push through one shard against raw TCP (the network planes) and
against ``numpy.copyto`` (shared memory), SGD apply against memcpy.

Both sides of each comparison run in the same invocation on the same machine,
so the ratios hold up on a noisy, shared host where absolute numbers do not.
The shard and the TCP echo server each run in a process of their own, as they
would in a job, so neither shares the client's interpreter lock.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import socket
import statistics
import struct
import sys
import time

import numpy as np

from psgrid.psserver.client.client import Client
from psgrid.psserver.config import ServerConfig
from psgrid.psserver.kernels.optim import make_optimizer
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.transports.stream_frames import recv_exact

KIB, MIB = 1024, 1024 * 1024
DEFAULT_SIZES = [4 * KIB, 64 * KIB, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]


# ----- raw TCP echo on loopback: the reference ---------------------------------------------------


def _echo_server(port_queue) -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    port_queue.put(listener.getsockname()[1])
    conn, _ = listener.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    buf = bytearray()
    header = bytearray(8)
    while True:
        try:
            recv_exact(conn, memoryview(header))
        except ConnectionError:
            return
        (size,) = struct.unpack("<Q", header)
        if len(buf) < size:
            buf = bytearray(size)
        view = memoryview(buf)[:size]
        recv_exact(conn, view)  # take the whole payload (like a push) ...
        conn.sendall(view)  # ... then send it all back (like a pull)


class TcpEcho:
    def __init__(self):
        ctx = mp.get_context("spawn")
        ports = ctx.Queue()
        self.process = ctx.Process(target=_echo_server, args=(ports,), daemon=True)
        self.process.start()
        self.sock = socket.create_connection(("127.0.0.1", ports.get(timeout=30)))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def round_trip(self, payload: memoryview, into: memoryview) -> None:
        self.sock.sendall(struct.pack("<Q", len(payload)))
        self.sock.sendall(payload)
        recv_exact(self.sock, into)

    def close(self) -> None:
        self.sock.close()
        self.process.join(timeout=5)
        if self.process.is_alive():
            self.process.kill()


# ----- one shard in its own process ------------------------------------------------------------


def _shard_server(config: ServerConfig, address_queue, stop_event) -> None:
    from psgrid.psserver.server import serve

    server = serve(config)
    address_queue.put(server.address)
    stop_event.wait()
    server.stop(grace=0.5)


class ShardProcess:
    def __init__(self, config: ServerConfig):
        ctx = mp.get_context("spawn")
        addresses, self.stop_event = ctx.Queue(), ctx.Event()
        self.process = ctx.Process(target=_shard_server, args=(config, addresses, self.stop_event), daemon=True)
        self.process.start()
        self.address = addresses.get(timeout=60)

    def close(self) -> None:
        self.stop_event.set()
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()


# ----- measurements ----------------------------------------------------------------------------


def _repeats(size: int, repeat: int) -> int:
    return max(repeat, min(200, (64 * MIB) // max(size, 1)))  # small sizes: more samples for a stable median


def _interleaved_medians(fns: dict, n: int) -> dict:
    """Median time of each callable, run in turn round after round so load drifts hit all alike."""
    for fn in fns.values():
        fn()  # warm-up
    times = {name: [] for name in fns}
    for _ in range(n):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def median_time(fn, n: int) -> float:
    fn()  # warm-up: connections, buffers, caches
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def transport_rows(sizes, repeat: int = 5, chunk_bytes: int = 1 * MIB):
    """Yield one dict per size: pull+push through a shard vs the TCP echo of the same bytes.

    ``gbps`` is the TCP data plane; ``grpc_gbps`` the same calls with the payload in gRPC
    streams of ``chunk_bytes`` chunks. ``shm_*`` is the shared-memory plane, beside
    ``numpy.copyto`` of the same bytes: its pull is one copy out of the shard's memory, its push
    moves nothing (the shard reads the worker's gradient buffer in place) and costs the shard's
    update, which ``shm_push_s`` holds and ``apply_s`` (the optimizer alone) shows apart.
    """
    echo = TcpEcho()
    try:
        for size in sizes:
            elems = size // 4
            spec = ModelSpec([("x", (elems,))])
            shard = ShardProcess(ServerConfig(mode="async", lr=1e-9, threads=16, chunk_bytes=chunk_bytes))
            try:
                values = np.random.default_rng(0).standard_normal(elems).astype(np.float32)
                out = np.empty(elems, np.float32)
                n = _repeats(size, repeat)
                options = dict(init=values, chunk_bytes=chunk_bytes, deadline_s=600)
                copied = np.empty_like(values)
                opt = make_optimizer("sgd", elems, lr=1e-9)
                with (
                    Client([shard.address], spec, data_plane="tcp", shared_memory=False, **options) as tcp,
                    Client([shard.address], spec, data_plane="grpc", shared_memory=False, **options) as grpc_only,
                    Client([shard.address], spec, **options) as shm,
                ):
                    payload, into = memoryview(values).cast("B"), memoryview(out).cast("B")
                    gradient = shm.gradient_buffer()
                    gradient[...] = values
                    times = _interleaved_medians(
                        {
                            "ps": lambda: (tcp.pull(out).wait(), tcp.push(values).wait()),
                            "grpc": lambda: (grpc_only.pull(out).wait(), grpc_only.push(values).wait()),
                            "tcp": lambda: echo.round_trip(payload, into),
                            "shm_pull": lambda: shm.pull(out).wait(),
                            "shm_push": lambda: shm.push(gradient).wait(),
                            "copyto": lambda: np.copyto(copied, values),
                            "apply": lambda: opt.step(values, gradient, out=copied),
                        },
                        n,
                    )
                    planes = shm.data_planes
                ps_s, grpc_s, tcp_s = times["ps"], times["grpc"], times["tcp"]
            finally:
                shard.close()
            shm_s, copy_s = times["shm_pull"] + times["shm_push"], times["copyto"]
            yield {
                "bench": "transport",
                "size_bytes": size,
                "repeats": n,
                "ps_s": ps_s,
                "tcp_s": tcp_s,
                "grpc_s": grpc_s,
                "gbps": 2 * size / ps_s / 1e9,
                "tcp_gbps": 2 * size / tcp_s / 1e9,
                "ratio_vs_tcp": tcp_s / ps_s,
                "grpc_gbps": 2 * size / grpc_s / 1e9,
                "grpc_ratio_vs_tcp": tcp_s / grpc_s,
                "shm_planes": planes,
                "shm_pull_s": times["shm_pull"],
                "shm_push_s": times["shm_push"],
                "copyto_s": copy_s,
                "apply_s": times["apply"],
                "shm_gbps": 2 * size / shm_s / 1e9,
                "shm_ratio_vs_copyto": 2 * copy_s / shm_s,
                "shm_pull_ratio_vs_copyto": copy_s / times["shm_pull"],
            }
    finally:
        echo.close()


def apply_rows(sizes, repeat: int = 5, optimizers=("sgd", "momentum", "adam")):
    """Yield one dict per (optimizer, size): the shard's in-place apply vs ``numpy.copyto``."""
    settings = {"sgd": ("sgd", {}), "momentum": ("sgd", {"momentum": 0.9}), "adam": ("adam", {})}
    for size in sizes:
        elems = size // 4
        rng = np.random.default_rng(1)
        weights = rng.standard_normal(elems).astype(np.float32)
        grad = rng.standard_normal(elems).astype(np.float32)
        target = np.empty_like(weights)
        n = _repeats(size, repeat)
        memcpy_s = median_time(lambda: np.copyto(target, grad), n)
        for label in optimizers:
            name, hparams = settings[label]
            opt = make_optimizer(name, elems, lr=1e-6, **hparams)
            apply_s = median_time(lambda: opt.step(weights, grad), n)
            yield {
                "bench": "apply",
                "optimizer": label,
                "size_bytes": size,
                "repeats": n,
                "apply_s": apply_s,
                "memcpy_s": memcpy_s,
                "apply_gbps": size / apply_s / 1e9,
                "memcpy_gbps": size / memcpy_s / 1e9,
                "ratio_vs_memcpy": memcpy_s / apply_s,
            }


def _human(size: int) -> str:
    return f"{size // MIB} MiB" if size >= MIB else f"{size // KIB} KiB"


def run(sizes=None, repeat: int = 5, as_json: bool = False, what=("transport", "apply"), out=sys.stdout) -> list:
    sizes = sizes or DEFAULT_SIZES
    rows = []
    if "transport" in what:
        if not as_json:
            print(
                f"{'pull+push':>10} {'TCP plane':>9} {'raw TCP':>8} {'ratio':>6} {'gRPC':>6} {'ratio':>6} "
                f"{'shm':>6} {'x copy':>6} | {'shm pull':>8} {'x copy':>6} {'shm push':>8} {'apply':>6}   "
                f"(GB/s; ms)",
                file=out,
            )
        for row in transport_rows(sizes, repeat):
            rows.append(row)
            if as_json:
                print(json.dumps(row), file=out, flush=True)
            else:
                print(
                    f"{_human(row['size_bytes']):>10} {row['gbps']:9.2f} {row['tcp_gbps']:8.2f} "
                    f"{row['ratio_vs_tcp']:6.2f} {row['grpc_gbps']:6.2f} {row['grpc_ratio_vs_tcp']:6.2f} "
                    f"{row['shm_gbps']:6.2f} {row['shm_ratio_vs_copyto']:6.2f} | {1e3 * row['shm_pull_s']:8.3f} "
                    f"{row['shm_pull_ratio_vs_copyto']:6.2f} {1e3 * row['shm_push_s']:8.3f} "
                    f"{1e3 * row['apply_s']:6.3f}",
                    file=out,
                    flush=True,
                )
    if "apply" in what:
        if not as_json:
            print(f"\n{'apply':>10} {'optimizer':>9} {'apply GB/s':>11} {'memcpy GB/s':>12} {'ratio':>6}", file=out)
        for row in apply_rows(sizes, repeat):
            rows.append(row)
            if as_json:
                print(json.dumps(row), file=out, flush=True)
            else:
                print(
                    f"{_human(row['size_bytes']):>10} {row['optimizer']:>9} {row['apply_gbps']:11.2f} "
                    f"{row['memcpy_gbps']:12.2f} {row['ratio_vs_memcpy']:6.2f}",
                    file=out,
                    flush=True,
                )
    return rows
