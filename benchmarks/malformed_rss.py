"""A shard's resident memory under malformed 5 MiB gRPC messages: a high-water mark, not a leak.

Usage: python benchmarks/malformed_rss.py [--mib 5] [--batches 100,100,200,600,1000] [NAME=VALUE ...]

Starts ``psctl server`` (async) in a process of its own, gives it weights, then sends it Push
messages of MIB MiB of bytes that do not decode, one after another, and prints its VmRSS before
and after each batch. NAME=VALUE pairs go into the shard's environment (``MALLOC_ARENA_MAX=1``,
``MALLOC_MMAP_THRESHOLD_=131072``), to see whose memory it is (docs/reliability.md, "Bad input
and strangers").
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import numpy as np

from psgrid.psserver.client.client import Client
from psgrid.psserver.protocol import SERVICE, parse_address_file
from psgrid.psserver.spec import ModelSpec


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def start_shard(folder: Path, env: dict) -> tuple[subprocess.Popen, str]:
    address_file = folder / "addr"
    with open(folder / "shard.log", "wb") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "psgrid.cluster.cli",
                "server",
                "--port",
                "0",
                "--mode",
                "async",
                "--address-file",
                str(address_file),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 30
    while not address_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the shard did not start: {(folder / 'shard.log').read_text()}")
        time.sleep(0.05)
    return proc, parse_address_file(address_file.read_text())[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=5)
    parser.add_argument("--batches", default="100,100,200,600,1000")
    parser.add_argument("env", nargs="*", help="NAME=VALUE for the shard's environment")
    args = parser.parse_args()
    extra = dict(pair.split("=", 1) for pair in args.env)
    env = {k: v for k, v in os.environ.items() if k not in ("PSCTL_PARENT_PID", "PSGRID_TOKEN")} | extra
    with tempfile.TemporaryDirectory() as folder:
        proc, address = start_shard(Path(folder), env)
        try:
            spec = ModelSpec([("w", (1000,))])
            with Client([address], spec, init=np.zeros(spec.size, np.float32)) as client:
                client.push(np.ones(spec.size, np.float32)).wait()
            garbage = b"\xff" * (args.mib << 20)  # a field key whose varint never ends
            with grpc.insecure_channel(address) as channel:
                push = channel.stream_unary(f"/{SERVICE}/Push", request_serializer=None, response_deserializer=None)
                start, sent, codes = rss_kib(proc.pid), 0, {}
                print(f"shard environment {extra or 'as this one'}; resident {start / 1024:.1f} MB before")
                for batch in (int(n) for n in args.batches.split(",")):
                    for _ in range(batch):
                        try:
                            push(iter([garbage]), timeout=10)
                            code = "OK"
                        except grpc.RpcError as exc:
                            code = exc.code().name
                        codes[code] = codes.get(code, 0) + 1
                    sent += batch
                    now = rss_kib(proc.pid)
                    print(
                        f"{sent:6d} messages of {args.mib} MiB: resident {now / 1024:.1f} MB "
                        f"({(now - start) / 1024:+.1f}), answers {codes}",
                        flush=True,
                    )
        finally:
            proc.kill()
            proc.wait(10)


if __name__ == "__main__":
    main()
