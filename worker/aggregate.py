"""Per-host aggregation (``aggregate = "host"``): the workers of one host push once, as BytePS and ps-lite do.

The workers of a host (local ranks 0..L-1; under ``psctl launch`` and on emulated hosts they have
consecutive global ranks, host h holding ranks hL..hL+L-1; ``psctl mpi`` groups them by node) share one anonymous shared-memory file made by local rank 0, the host's *leader*:
a slot for the weights and one for each other worker's gradient. Each step

1. the leader pulls from the shards into the weights slot and tells the others; each copies them;
2. every worker computes its gradient; the others write theirs into their slots and say so;
3. the leader sums the L gradients in local-rank order, multiplies by 1/L and pushes that mean
   as one update of worker ``h`` (the shards see H workers, one per host); it tells the others the
   shards' answers, and the next step begins. (In sync, with hosts of different sizes, it multiplies
   by H/W instead, so that the shards' mean of the H pushes is the mean of all W gradients.)

Only the leader talks to the shards, so a host's link carries one pull and one push per step
instead of L. In sync the shards average H host means of L gradients each: the mean of all W, as
without aggregation (up to the order of float32 additions). In async and ssp a host's push is one
update carrying the mean of its workers' gradients, its staleness and clock are the host's, and the
workers of one host stay in step with each other (docs/architecture.md, "Per-host aggregation").

The signals travel on an abstract Unix socket (per network namespace, like the shards' own
shared-memory plane) whose peers must be this user (``SO_PEERCRED``); the shared memory is a
``memfd`` passed over it, so nothing is left in ``/dev/shm`` whatever ends the job.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import socket
import struct
import time
from dataclasses import dataclass

import numpy as np

from psgrid.psserver import dtypes as wire
from psgrid.psserver.protocol import Outcome, PushResult

AGGREGATES = ("none", "host")
LOCAL_SIZE_VARS = ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")
LENGTH = struct.Struct("<I")
PEERCRED = struct.Struct("3i")     # pid, uid, gid
CONNECT_POLL_S = 0.05


class AggregationError(RuntimeError):
    """The host's workers could not meet, or one of them went away."""


@dataclass(frozen=True)
class HostGroup:
    """Where a worker stands among the job's hosts: host ``host`` of ``hosts``, local rank ``local`` of ``size``,
    ``world`` workers in all (``psctl mpi`` may put more workers on one node than on another)."""

    host: int
    hosts: int
    local: int
    size: int
    world: int = 0          # 0: hosts x size (every host the same size)

    def scale(self, mode: str) -> float:
        """What the leader multiplies its host's sum by: 1/size, the mean of its workers' gradients. In sync,
        hosts/world, so that the shards' mean over the hosts' pushes is the mean over all workers even where
        hosts differ in size (the same number where they do not)."""
        world = self.world or self.hosts * self.size
        return self.hosts / world if mode == "sync" else 1.0 / self.size

    @classmethod
    def of(cls, rank: int, world: int, local_rank: int | None = None, local_size: int | None = None) -> "HostGroup":
        """The group of worker ``rank``; the local size comes from the environment (all on one host if unset).

        Raises ValueError where the workers are not in equal blocks of consecutive ranks per host.
        """
        size = local_size if local_size is not None else _local_size_from_env(world)
        if size < 1 or world % size:
            raise ValueError(f"aggregate = 'host' needs the same number of workers on every host: {world} workers "
                             f"do not split into hosts of {size}")
        local = rank % size
        if local_rank is not None and local_rank != local:
            raise ValueError(f"aggregate = 'host' needs the workers of one host to have consecutive ranks: rank "
                             f"{rank} of hosts of {size} should have local rank {local}, it has {local_rank}")
        return cls(rank // size, world // size, local, size, world)


def _local_size_from_env(world: int) -> int:
    for var in LOCAL_SIZE_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return world


def rendezvous_name(addresses: list[str], token: str | None, host: int) -> str:
    """The abstract socket of one host's group in one job: its shards' addresses and token name the job."""
    digest = hashlib.sha256("\n".join([*addresses, token or "", str(host)]).encode()).hexdigest()[:32]
    return f"psgrid-agg-{digest}"


def host_exchange(group: HostGroup, name: str, size: int, connect, *, wire_dtype: str = "float32",
                  timeout_s: float = 120.0):
    """The leader's exchange (``connect(worker_id, world)`` makes its Client) or a follower's, by local rank."""
    if group.local == 0:
        return HostLeader(connect(group.host, group.hosts), group, name, size, timeout_s)
    return HostFollower(group, name, size, wire_dtype, timeout_s)


class Completed:
    """A finished pull or push, with the handle surface the training loop reads."""

    def __init__(self, result, seconds: float):
        self._result, self.seconds = result, seconds

    def wait(self, timeout: float | None = None):
        return self._result


def _send(sock: socket.socket, message: dict, fds=()) -> None:
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [LENGTH.pack(len(data)) + data], list(fds))
    else:
        sock.sendall(LENGTH.pack(len(data)) + data)


def _receive(sock: socket.socket, *, with_fd: bool = False) -> tuple[dict, int | None]:
    fd = None
    if with_fd:
        head, fds, _, _ = socket.recv_fds(sock, LENGTH.size, 1)
        fd = fds[0] if fds else None
    else:
        head = b""
    head += _exactly(sock, LENGTH.size - len(head))
    (length,) = LENGTH.unpack(head)
    return json.loads(_exactly(sock, length)), fd


def _exactly(sock: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        try:
            chunk = sock.recv(count - len(data))
        except socket.timeout:
            raise AggregationError(f"no word from the other workers of this host in {sock.gettimeout():g} s") from None
        if not chunk:
            raise AggregationError("a worker of this host went away (its socket closed)")
        data += chunk
    return data


def _same_user(sock: socket.socket) -> bool:
    _, uid, _ = PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
    return uid in (os.geteuid(), 0)


def _results(message: dict) -> list[PushResult]:
    return [PushResult(Outcome(o), v, s, c) for o, v, s, c in message["results"]]


class HostLeader:
    """Local rank 0: the host's one client of the shards, summing the host's gradients before each push."""

    def __init__(self, client, group: HostGroup, name: str, size: int, timeout_s: float):
        self.client, self.group, self.size, self.timeout_s = client, group, size, timeout_s
        self.peers: list[socket.socket] = []
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.fd = -1
        self.memory = None
        try:
            self.listener.bind("\0" + name)
            self.listener.listen(group.size)
            self.fd = os.memfd_create("psgrid-host-aggregate", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, 4 * size * group.size)
            self.memory = mmap.mmap(self.fd, 4 * size * group.size)
        except BaseException:
            self.close()
            raise
        slots = np.frombuffer(self.memory, np.float32).reshape(group.size, size)
        self.weights, self.slots = slots[0], slots[1:]      # slot 0: the weights; k: local rank k's gradient

    # what the training loop reads of an exchange: the host's client's
    mode = property(lambda self: self.client.mode)
    worker_id = property(lambda self: self.client.worker_id)
    clock = property(lambda self: self.client.clock)
    data_planes = property(lambda self: self.client.data_planes)
    wire_dtype = property(lambda self: self.client.wire_dtype)

    def __enter__(self) -> "HostLeader":
        try:
            self.client.__enter__()
            self._meet()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _meet(self) -> None:
        """Take every other worker of this host, in any order, then tell each the job's state."""
        deadline = time.monotonic() + self.timeout_s
        by_rank: dict[int, socket.socket] = {}
        while len(by_rank) < self.group.size - 1:
            self.listener.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                sock, _ = self.listener.accept()
            except socket.timeout:
                raise AggregationError(f"host {self.group.host}: {self.group.size - 1 - len(by_rank)} of its workers "
                                       f"did not come within {self.timeout_s:g} s") from None
            sock.settimeout(self.timeout_s)
            if not _same_user(sock):
                sock.close()
                continue
            try:
                local = _receive(sock)[0]["local"]
            except (OSError, ValueError, KeyError, AggregationError):
                sock.close()
                continue
            if not 0 < local < self.group.size or local in by_rank:
                sock.close()
                continue
            by_rank[local] = sock
        self.peers = [by_rank[k] for k in sorted(by_rank)]
        hello = {"mode": self.mode, "worker_id": self.worker_id, "clock": self.clock,
                 "data_planes": self.data_planes}
        for sock in self.peers:
            _send(sock, hello, [self.fd])

    def bytes_per_step(self, params: int) -> int:
        """The host's one pull (float32) and one push."""
        from psgrid.psserver.protocol import ITEMSIZE

        return params * (4 + ITEMSIZE[self.client.wire_dtype])

    def pull(self, out: np.ndarray, *, background: bool = False) -> Completed:
        t0 = time.perf_counter()
        versions = self.client.pull(out).wait()
        np.copyto(self.weights, out)
        for sock in self.peers:
            _send(sock, {"op": "weights", "clock": self.clock})
        return Completed(versions, time.perf_counter() - t0)

    def push(self, grad: np.ndarray, *, background: bool = False) -> Completed:
        t0 = time.perf_counter()
        for sock in self.peers:        # every gradient of this step is in its slot
            if _receive(sock)[0].get("op") != "gradient":
                raise AggregationError("a worker of this host is out of step")
        total = self.client.gradient_buffer(0)      # shards on this host read it in place
        np.copyto(total, grad)
        for slot in self.slots:                     # in local-rank order: the same sum every run
            np.add(total, slot, out=total)
        np.multiply(total, np.float32(self.group.scale(self.mode)), out=total)
        results = self.client.push(total).wait()
        answer = {"op": "pushed", "clock": self.clock,
                  "results": [[int(r.outcome), r.version, r.staleness, r.next_clock] for r in results]}
        for sock in self.peers:
            _send(sock, answer)
        return Completed(results, time.perf_counter() - t0)

    def close(self) -> None:
        for sock in self.peers:
            sock.close()
        self.peers = []
        self.listener.close()
        self.weights = self.slots = None
        if self.memory is not None:
            try:
                self.memory.close()
            except BufferError:        # a view still held by a caller: the mapping goes with it
                pass
            self.memory = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        self.client.close()


class HostFollower:
    """Local rank k > 0: gives its gradient to the host's leader and takes the weights it pulled."""

    def __init__(self, group: HostGroup, name: str, size: int, wire_dtype: str, timeout_s: float):
        self.group, self.name, self.size, self.timeout_s = group, name, size, timeout_s
        self.wire_dtype = wire.wire_dtype(wire_dtype)
        self.sock: socket.socket | None = None
        self.memory = None
        self.mode, self.worker_id, self.clock, self.data_planes = "", group.host, 0, []

    def __enter__(self) -> "HostFollower":
        try:
            self._meet()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _meet(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect("\0" + self.name)
                break
            except (ConnectionRefusedError, FileNotFoundError):
                sock.close()
                if time.monotonic() > deadline:
                    raise AggregationError(f"host {self.group.host}: its leader (local rank 0) did not listen within "
                                           f"{self.timeout_s:g} s") from None
                time.sleep(CONNECT_POLL_S)
        self.sock = sock
        if not _same_user(sock):
            raise AggregationError("the host's rendezvous socket belongs to another user")
        sock.settimeout(max(1.0, deadline - time.monotonic()))
        _send(sock, {"local": self.group.local})
        hello, fd = _receive(sock, with_fd=True)
        if fd is None:
            raise AggregationError("the host's leader sent no shared memory")
        try:
            self.memory = mmap.mmap(fd, 4 * self.size * self.group.size)
        finally:
            os.close(fd)
        sock.settimeout(self.timeout_s)
        slots = np.frombuffer(self.memory, np.float32).reshape(self.group.size, self.size)
        self.weights, self.slot = slots[0], slots[self.group.local]
        self.mode, self.worker_id, self.clock = hello["mode"], hello["worker_id"], hello["clock"]
        self.data_planes = ["host"] * len(hello["data_planes"])

    def bytes_per_step(self, params: int) -> int:
        return 0        # nothing of this worker's crosses the network: the leader's step carries it

    def pull(self, out: np.ndarray, *, background: bool = False) -> Completed:
        t0 = time.perf_counter()
        message, _ = _receive(self.sock)
        if message.get("op") != "weights":
            raise AggregationError("the host's leader is out of step")
        np.copyto(out, self.weights)
        return Completed([message["clock"]], time.perf_counter() - t0)

    def push(self, grad: np.ndarray, *, background: bool = False) -> Completed:
        t0 = time.perf_counter()
        np.copyto(self.slot, grad)
        _send(self.sock, {"op": "gradient"})
        message, _ = _receive(self.sock)
        if message.get("op") != "pushed":
            raise AggregationError("the host's leader is out of step")
        self.clock = message["clock"]
        return Completed(_results(message), time.perf_counter() - t0)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        self.weights = self.slot = None
        if self.memory is not None:
            try:
                self.memory.close()
            except BufferError:
                pass
            self.memory = None
