"""A worker's speed on the TCP data plane beside the floods of issue 18, at their full size.

Usage: python benchmarks/tcp_floods.py [--seconds S]    (with psgrid installed: pip install -e .)

One shard in this process (async, a token, the default 128 handlers, 127.0.0.1). A worker that
holds the token joins and makes pull+push rounds of a 13-element model for S seconds, alone, then
beside each flood in turn: 200 strangers trickling a hello at 10 bytes/s, 150 strangers trickling
refused 1 GiB pushes, 150 oversized 1 GiB pushes of a token holder trickled, 1,100 idle strangers.
Every flood runs in a process of its own and opens its connections again as soon as the shard
cuts them. Prints one markdown table:
rounds/s, the slowest round, the time to join (or the worker's failure), the connections the shard
held, the ones it cut.
The shard's files-open limit must allow the floods (``ulimit -n 4096``).
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import time

import numpy as np

from psgrid.psserver.client.client import Client
from psgrid.psserver.config import ServerConfig
from psgrid.psserver.exceptions import PSError
from psgrid.psserver.protocol import FLOAT32
from psgrid.psserver.server import serve
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.transports.stream_frames import HELLO, MAGIC, PUSH, REQUEST

TOKEN = "bench-token"
SPEC = ModelSpec([("w", (12,)), ("b", (1,))])
GIB = 1 << 30


def flood(port: int, n: int, opening: bytes, trickle: bytes, tick: float, stop, opened, cut) -> None:
    """Keep ``n`` connections, each opened with ``opening`` then sent one byte of ``trickle`` per ``tick``;
    open one again as soon as the shard cuts it (counted in ``opened`` and ``cut``). Runs in its own process."""
    socks: list[list] = []
    while not stop.is_set():
        kept = []
        for entry in socks:
            sock, sent = entry
            try:
                try:
                    if sock.recv(1 << 16) == b"":  # the shard's replies are read and dropped
                        raise ConnectionError
                except BlockingIOError:
                    pass
                if sent < len(trickle):
                    entry[1] += sock.send(trickle[sent : sent + 1])
            except BlockingIOError:
                pass
            except OSError:
                sock.close()
                cut.value += 1
                continue
            kept.append(entry)
        while len(kept) < n and not stop.is_set():
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=1)
                sock.sendall(opening)
            except OSError:
                break
            sock.setblocking(False)
            kept.append([sock, 0])
            opened.value += 1
        socks = kept
        stop.wait(tick)
    for sock, _ in socks:
        sock.close()


def train(address: str, seconds: float) -> tuple[float, float, float]:
    """(rounds/s, slowest round s, seconds to join) of a new worker on the TCP plane."""
    params, grad = SPEC.flat(), np.full(SPEC.size, 0.01, np.float32)
    t0 = time.monotonic()
    with Client([address], SPEC, init=SPEC.flat(), token=TOKEN, shared_memory=False, deadline_s=5, retry_s=5) as client:
        joined = time.monotonic() - t0
        rounds, slowest, end = 0, 0.0, time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.monotonic()
            client.pull(params).wait()
            client.push(grad).wait()
            slowest = max(slowest, time.monotonic() - t)
            rounds += 1
    return rounds / seconds, slowest, joined


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="seconds of training per row")
    args = parser.parse_args()
    mp = multiprocessing.get_context("spawn")  # the floods run in their own process: not on the shard's GIL
    server = serve(ServerConfig(mode="async", lr=0.05, token=TOKEN))
    try:
        port = server.tcp.port
        holder = Client([server.address], SPEC, init=SPEC.flat(), token=TOKEN, shared_memory=False).join()
        hello = REQUEST.pack(MAGIC, HELLO, 0, 0, 0, 0, len(TOKEN), 0.0) + TOKEN.encode()
        long_hello = REQUEST.pack(MAGIC, HELLO, 0, 0, 0, 0, 60_000, 0.0) + b"t" * 60_000

        def push(worker: int) -> bytes:
            return REQUEST.pack(MAGIC, PUSH, FLOAT32, worker, 0, 0, GIB, 5.0)

        floods = [
            ("none", None),
            ("200 strangers trickling a hello (10 bytes/s)", dict(n=200, trickle=long_hello)),
            ("150 strangers trickling refused 1 GiB pushes", dict(n=150, opening=push(0), trickle=b"\0" * 100_000)),
            (
                "150 oversized 1 GiB pushes of a token holder, trickled",
                dict(n=150, opening=hello + push(holder.worker_id), trickle=b"\0" * 100_000),
            ),
            ("1,100 idle strangers", dict(n=1100)),
        ]
        print("| flood | rounds/s | slowest round (s) | join (s) | connections held | connections cut |")
        print("| --- | --- | --- | --- | --- | --- |")
        for name, flood_args in floods:
            stop, opened, cut, attacker = mp.Event(), mp.Value("l", 0), mp.Value("l", 0), None
            if flood_args is not None:
                flood_args = {"opening": b"", "trickle": b"", "tick": 0.1, **flood_args}
                attacker = mp.Process(
                    target=flood, args=(port,), kwargs=dict(flood_args, stop=stop, opened=opened, cut=cut)
                )
                attacker.start()
                deadline = time.monotonic() + 60
                while opened.value < flood_args["n"] and time.monotonic() < deadline:
                    time.sleep(0.05)
                time.sleep(0.5)  # let it take hold
            try:
                rate, slowest, joined = train(server.address, args.seconds)
                row = f"{rate:.0f} | {slowest:.3f} | {joined:.3f}"
            except PSError as exc:
                row = f"failed: {type(exc).__name__} | | "
            finally:
                held = server.tcp.open_connections
                stop.set()
                if attacker is not None:
                    attacker.join(20)
            print(f"| {name} | {row} | {held} | {cut.value} |", flush=True)
        holder.close()
    finally:
        server.stop()


if __name__ == "__main__":
    main()
