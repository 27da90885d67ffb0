"""What a peer holding the token can do to a shard through the shared-memory plane (docs/reliability.md).

Usage: python benchmarks/shm_attacks.py [--elements N] [--readers N]

Each attack gets a fresh shard in a subprocess (async unless named, lr 1, weights 100
everywhere) and one legitimate worker that pushes gradients of ones, so version v's weights
are exactly 100 - v. The attacker speaks the plane's frames by hand. Printed per attack, one
markdown row: whether the attack step was refused, whether the shard lived (its exit signal
if not), whether the legitimate worker's pulls afterwards were exact, the ring's buffers (the
shard's mappings of its weight files, from /proc/PID/maps) and the shard's resident memory
before and after. Run it with another checkout installed (``pip install -e``) to measure that one.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np

from psgrid.psserver.client.admin import Admin
from psgrid.psserver.client.client import Client
from psgrid.psserver.protocol import FLOAT32
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.transports.stream_frames import (
    ATTACH,
    FD_BYTE,
    MAGIC,
    MAP,
    MAX_MESSAGE,
    OPEN,
    PULL,
    PUSH,
    REPLY,
    REQUEST,
    recv_exact,
    recv_struct,
)

SERVE = """
import json, sys
from psgrid.psserver.config import ServerConfig
from psgrid.psserver.server import serve
server = serve(ServerConfig(**json.loads(sys.argv[1])))
print(server.address, flush=True)
sys.stdin.read()
server.stop()
"""


class Peer:
    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(path)

    def call(self, op: int, *, dtype=0, worker=0, clock=0, nbytes=0, fd=None) -> tuple:
        """(version, staleness) of the reply; raises RuntimeError with the refusal's text."""
        self.sock.sendall(REQUEST.pack(MAGIC, op, dtype, worker, clock, 0, nbytes, 0.0))
        if fd is not None:
            socket.send_fds(self.sock, [FD_BYTE], [fd])
        _, status, _, _, version, staleness, _, n = recv_struct(self.sock, REPLY)
        if status:
            text = bytearray(min(n, MAX_MESSAGE))
            recv_exact(self.sock, memoryview(text))
            raise RuntimeError(text.decode())
        return version, staleness

    def fd(self) -> int:
        return socket.recv_fds(self.sock, 1, 1)[1][0]


class Shard:
    def __init__(self, elements: int, mode: str):
        config = {"host": "127.0.0.1", "port": 0, "lr": 1.0, "mode": mode}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, json.dumps(config)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.address = self.proc.stdout.readline().strip()
        self.spec = ModelSpec([("w", (elements,))])
        self.worker = Client(
            [self.address], self.spec, init=np.full(elements, 100, np.float32), deadline_s=10, retry_s=2
        ).join()
        self.params = np.zeros(elements, np.float32)
        self.worker.pull(self.params).wait()
        self.path = self.worker._conn.planes[0].path

    def rss_mb(self) -> float:
        with open(f"/proc/{self.proc.pid}/status") as status:
            return next(int(line.split()[1]) for line in status if line.startswith("VmRSS")) / 1024

    def buffers(self) -> int:
        with open(f"/proc/{self.proc.pid}/maps") as maps:
            return sum("psgrid-weights" in line for line in maps)

    def exact(self, steps: int = 5) -> str:
        """Push ones and pull, ``steps`` times: are the weights 100 - version each time?"""
        try:
            grad = self.worker.gradient_buffer()
            for _ in range(steps):
                grad[:] = 1
                self.worker.push(grad).wait()
                version = self.worker.pull(self.params).wait()[0]
                if not (self.params == 100 - version).all():
                    return "no: " + ("non-finite" if not np.isfinite(self.params).all() else "wrong values")
            return "yes"
        except Exception as exc:  # noqa: BLE001 - reported in the table
            return f"no: {type(exc).__name__}"

    def revoked(self) -> str:
        """Reads the shard took back (a counter of Stats since this change; "-" before it)."""
        with Admin([self.address]) as admin:
            return str(admin.stats()[0].get("revoked_reads", "-"))

    def fate(self) -> str:
        time.sleep(0.3)
        code = self.proc.poll()
        if code is None:
            return "alive"
        return f"died ({signal.Signals(-code).name})" if code < 0 else f"exited {code}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.worker.close()
            self.proc.stdin.close()
            self.proc.wait(20)
        else:
            try:
                self.worker.close()
            except Exception:  # noqa: BLE001 - the shard is gone already
                pass


def attempt(step) -> str:
    try:
        step()
    except (OSError, RuntimeError) as exc:
        return f"refused ({exc.__class__.__name__})"
    return "taken"


def unsealed_gradient(shard: Shard, _) -> str:
    nbytes = shard.spec.size * 4
    fd = os.memfd_create("attacker")
    os.ftruncate(fd, nbytes)
    peer = Peer(shard.path)
    answer = attempt(lambda: peer.call(ATTACH, dtype=FLOAT32, nbytes=nbytes, fd=fd))
    os.ftruncate(fd, 0)
    try:
        peer.call(PUSH, dtype=FLOAT32, worker=shard.worker.worker_id, clock=shard.worker._next_clock)
    except (OSError, RuntimeError):
        pass
    return answer


def own_gradient(shard: Shard, _) -> str:
    _, fd = shard.worker._memory.segment(FLOAT32)
    answer = attempt(lambda: os.ftruncate(fd, 0))
    try:  # pushed as it lies (writing it here would fault this process, if it was truncated)
        shard.worker.push(shard.worker.gradient_buffer()).wait()
    except Exception:  # noqa: BLE001 - the shard's fate is what is reported
        pass
    return answer


def mapped_weights(action):
    def attack(shard: Shard, _) -> str:
        peer = Peer(shard.path)
        peer.call(OPEN)
        peer.fd()
        _, index = peer.call(PULL, worker=shard.worker.worker_id)
        peer.call(MAP, clock=index)
        fd = peer.fd()
        return attempt(lambda: action(fd, shard.spec.size * 4))

    return attack


def write_nan(fd: int, nbytes: int) -> None:
    weights = np.frombuffer(mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), np.float32)
    weights[:] = np.nan


def write_nan_reopened(fd: int, nbytes: int) -> None:
    write_nan(os.open(f"/proc/self/fd/{fd}", os.O_RDWR), nbytes)


def truncate_marks(shard: Shard, _) -> str:
    peer = Peer(shard.path)
    peer.call(OPEN)
    return attempt(lambda: os.ftruncate(peer.fd(), 0))


def hold_marks(shard: Shard, readers: int) -> str:
    """``readers`` connections, each marks a new version and never lets go."""
    grad = shard.worker.gradient_buffer()
    grad[:] = 1
    held = 0
    for _ in range(readers):
        peer = Peer(shard.path)
        try:
            peer.call(OPEN)
        except RuntimeError:
            break  # every slot is taken
        peer.fd()
        shard.worker.push(grad).wait()
        peer.call(PULL, worker=shard.worker.worker_id)
        held += 1
        hold_marks.peers.append(peer)
    return f"{held} marks held"


hold_marks.peers = []


def garbage_marks(shard: Shard, _) -> str:
    peer = Peer(shard.path)
    peer.call(OPEN)
    marks = np.frombuffer(mmap.mmap(peer.fd(), 256 * 8, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), np.int64)
    rng = np.random.default_rng(0)
    grad = shard.worker.gradient_buffer()
    for _ in range(200):
        marks[:] = rng.integers(-(1 << 63), (1 << 63) - 1, 256, dtype=np.int64)
        marks[::2] = rng.integers(-2, 300, 128)
        grad[:] = 1
        shard.worker.push(grad).wait()
    return "200 updates"


ATTACKS = [
    ("ATTACH an unsealed gradient file, truncate it, PUSH (async)", "async", unsealed_gradient),
    ("the same, sync", "sync", unsealed_gradient),
    ("truncate the worker's own attached gradient file", "async", own_gradient),
    ("truncate a weight buffer received by MAP", "async", mapped_weights(lambda fd, n: os.ftruncate(fd, 0))),
    ("write NaN through a weight buffer received by MAP", "async", mapped_weights(write_nan)),
    ("the same through /proc/self/fd reopened read-write", "async", mapped_weights(write_nan_reopened)),
    ("truncate the marks table", "async", truncate_marks),
    ("readers that hold their marks for ever", "async", hold_marks),
    ("random garbage in every slot of the marks table", "async", garbage_marks),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--elements", type=int, default=250_000, help="model size (float32 elements)")
    parser.add_argument("--readers", type=int, default=250, help="connections that hold marks")
    args = parser.parse_args()
    print(
        "| attack | attack step | shard | later pulls exact | ring buffers | shard RSS MB before -> after "
        "| revoked reads |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, mode, attack in ATTACKS:
        shard = Shard(args.elements, mode)
        try:
            shard.exact(3)
            before_rss, before_buffers = shard.rss_mb(), shard.buffers()
            answer = attack(shard, args.readers)
            exact = shard.exact() if shard.fate() == "alive" else "-"
            fate = shard.fate()  # the later pulls may be what kills it
            after = (
                ("-", "-", "-")
                if fate != "alive"
                else (
                    f"{before_buffers} -> {shard.buffers()}",
                    f"{before_rss:.0f} -> {shard.rss_mb():.0f}",
                    shard.revoked(),
                )
            )
            exact = exact if fate == "alive" else "-"
            print(f"| {name} | {answer} | {fate} | {exact} | {' | '.join(after)} |", flush=True)
        finally:
            for peer in hold_marks.peers:
                peer.sock.close()
            hold_marks.peers.clear()
            shard.close()


if __name__ == "__main__":
    main()
