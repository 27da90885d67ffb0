"""Per-host aggregation against a process of the job's user that does not play by its rules (worker/aggregate*.py).

Each attack comes while the host's workers meet; then the real follower joins and the host trains
in sync, and its weights must be the plain mean of the two workers' gradients: nothing the attacker
did reached the leader's sum, stalled the meet or ended the leader.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import struct
import threading
import time

import numpy as np
import pytest

from psgrid.psserver.shared_memory import F_SEAL_FUTURE_WRITE, map_fd
from psgrid.psserver.spec import ModelSpec
from psgrid.worker.aggregate import HostGroup, host_exchange, rendezvous_name
from psgrid.worker.aggregate_wire import MESSAGE_S, encode, receive
from tests.support import run_threads

SPEC = ModelSpec([("w", (40,))])
STEPS = 3
LR = 0.5
TOKEN = "the-job-token"


def gradient(rank: int, step: int) -> np.ndarray:
    return np.random.default_rng(10 * rank + step).standard_normal(SPEC.size).astype(np.float32)


def expected_weights() -> np.ndarray:
    return -LR * sum((gradient(0, s) + gradient(1, s)) / 2 for s in range(STEPS))


class Host:
    """One host of two workers on an in-process sync shard: the leader bound (not yet met), the follower to come."""

    def __init__(self, cluster):
        self.cluster = cluster(1, mode="sync", lr=LR)
        self.name = rendezvous_name(self.cluster.addresses, TOKEN, 0)
        self.joined_after: float | None = None
        init = np.zeros(SPEC.size, np.float32)
        self.connect = lambda wid, hosts: self.cluster.client(SPEC, worker_id=wid, world=hosts, init=init)  # noqa: E731
        self.leader = self.exchange(0)  # bound now: attackers may connect before it meets anyone

    def exchange(self, rank: int):
        return host_exchange(
            HostGroup.of(rank, 2, local_size=2), self.name, SPEC.size, self.connect, timeout_s=20, token=TOKEN
        )

    def train(self, exchange, rank: int) -> None:
        params = np.empty(SPEC.size, np.float32)
        t0 = time.monotonic()
        with exchange:
            if rank:
                self.joined_after = time.monotonic() - t0
            for step in range(STEPS):
                exchange.pull(params)
                exchange.push(gradient(rank, step))

    def run(self, *, follower_after=None) -> np.ndarray:
        """Train both workers (the follower once ``follower_after()`` returned, if given); the shard's weights."""

        def follower():
            if follower_after is not None:
                follower_after()
            self.train(self.exchange(1), 1)

        run_threads([lambda: self.train(self.leader, 0), follower], timeout=60)
        return self.cluster.weights().copy()


def connect(name: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect("\0" + name)
    return sock


def refusal(sock: socket.socket) -> tuple[str, list[int]]:
    """The reason the leader gave, and the descriptors it sent (none, for a refusal)."""
    message, fds = receive(sock, 10, fds=2)
    for fd in fds:
        os.close(fd)
    assert message["op"] == "refused", message
    return message["reason"], fds


# ----- malformed hellos ----------------------------------------------------------------------------

GARBAGE = [
    # what was sent, what the refusal must say
    (encode({"local": "1"}), "not an object with an op"),  # the 9 bytes, framed
    (encode({"op": "hello", "local": "1", "token": TOKEN}), "'local' as int, got str"),
    (encode({"op": "hello", "local": True, "token": TOKEN}), "'local' as int, got bool"),
    (encode({"op": "hello", "local": 7, "token": TOKEN}), "not a follower of this host"),
    (encode({"op": "weights", "clock": 0}), "'weights' where 'hello' was due"),
    (encode([1, 2, 3]), "not an object with an op"),
    (struct.pack("<I", 5) + b"{nope", "not JSON"),
    (struct.pack("<I", 0xFFFFFFFF), "at most 65536"),
    (b'{"local": 1}', "at most 65536"),  # no length: its first bytes read as one
]


@pytest.mark.parametrize("data_plane", ["tcp"])
def test_malformed_hellos_are_refused_with_a_reason_and_the_host_trains_on(cluster):
    host = Host(cluster)
    attackers = [connect(host.name) for _ in GARBAGE]
    try:
        for sock, (data, _) in zip(attackers, GARBAGE):
            sock.sendall(data)
        weights = host.run()
        for sock, (_, why) in zip(attackers, GARBAGE):
            reason, fds = refusal(sock)
            assert why in reason and not fds
    finally:
        for sock in attackers:
            sock.close()
    np.testing.assert_allclose(weights, expected_weights(), rtol=1e-5, atol=1e-6)


# ----- stalls ----------------------------------------------------------------------------------------


def cut_after(sock: socket.socket, t0: float, cut: dict, name: str, trickle: bytes = b"") -> threading.Thread:
    """Send ``trickle`` a byte every 0.4 s, then read until the leader closes; ``cut[name]``: when, from ``t0``."""

    def run():
        try:
            for byte in trickle:
                sock.send(bytes([byte]))
                time.sleep(0.4)
            while sock.recv(1 << 16):  # the refusal, then the close
                pass
        except OSError:
            pass
        cut[name] = time.monotonic() - t0

    thread = threading.Thread(target=run)
    thread.start()
    return thread


@pytest.mark.parametrize("data_plane", ["tcp"])
def test_a_silent_and_a_trickling_connection_hold_up_nobody(cluster):
    """One connection says nothing, another sends its length a byte every 0.4 s: each is cut MESSAGE_S after it
    connected, while the meet goes on, and the follower who comes later joins at once (the leader that read its
    connections in turn, without a deadline on each read, held the meet for its whole timeout on the silent one,
    and for ever on a trickle)."""
    host = Host(cluster)
    cut = {}
    t0 = time.monotonic()
    silent, trickler = connect(host.name), connect(host.name)
    watchers = [cut_after(silent, t0, cut, "silent"), cut_after(trickler, t0, cut, "trickler", struct.pack("<I", 40))]
    try:
        weights = host.run(follower_after=lambda: time.sleep(MESSAGE_S + 0.5))
        for watcher in watchers:
            watcher.join(timeout=20)
    finally:
        silent.close()
        trickler.close()
    assert not any(w.is_alive() for w in watchers)
    # Cut MESSAGE_S after the leader took them (its shards' join first, and a loaded machine, add some), not
    # after the meet's 20 s.
    assert all(MESSAGE_S - 0.5 < cut[name] < MESSAGE_S + 3 for name in ("silent", "trickler")), cut
    assert host.joined_after < 3, f"the follower waited {host.joined_after:.1f} s to join"
    np.testing.assert_allclose(weights, expected_weights(), rtol=1e-5, atol=1e-6)


# ----- impostors and what a follower is given ---------------------------------------------------------


@pytest.mark.parametrize("data_plane", ["tcp"])
def test_an_impostor_claiming_a_rank_first_without_the_token_gets_nothing(cluster):
    host = Host(cluster)
    wrong, missing = connect(host.name), connect(host.name)
    try:
        wrong.sendall(encode({"op": "hello", "local": 1, "token": "a-guess"}))
        missing.sendall(encode({"op": "hello", "local": 1}))
        weights = host.run(follower_after=lambda: time.sleep(0.3))
        for sock in (wrong, missing):
            reason, fds = refusal(sock)
            assert "missing or wrong token" in reason and not fds
    finally:
        wrong.close()
        missing.close()
    # The real follower got rank 1 after them, and its gradients (not an impostor's) are in the sum.
    np.testing.assert_allclose(weights, expected_weights(), rtol=1e-5, atol=1e-6)


def rogue_follower(name: str, seen: dict) -> None:
    """A follower with the token that tries to resize and write what it was given, then plays its part."""
    sock = connect(name)
    try:
        sock.sendall(encode({"op": "hello", "local": 1, "token": TOKEN}))
        welcome, (weights_fd, slot_fd) = receive(sock, 10, fds=2)
        try:
            seen["weights seals"] = fcntl.fcntl(weights_fd, fcntl.F_GET_SEALS)
            seen["slot seals"] = fcntl.fcntl(slot_fd, fcntl.F_GET_SEALS)
            resize = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
            # Checked before trying: an unsealed file truncated here would kill this test process (SIGBUS).
            assert seen["weights seals"] & (resize | F_SEAL_FUTURE_WRITE) == resize | F_SEAL_FUTURE_WRITE
            assert seen["slot seals"] & resize == resize
            reopened = os.open(f"/proc/self/fd/{weights_fd}", os.O_RDWR)
            try:
                for what, attempt in [
                    ("truncate the slot", lambda: os.ftruncate(slot_fd, 0)),
                    ("grow the slot", lambda: os.ftruncate(slot_fd, 1 << 20)),
                    ("truncate the weights", lambda: os.ftruncate(reopened, 0)),
                    ("write the weights", lambda: os.pwrite(reopened, b"\xff" * 8, 0)),
                    (
                        "map the weights writable",
                        lambda: mmap.mmap(reopened, 4 * SPEC.size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE),
                    ),
                    (
                        "seal the weights against the leader",
                        lambda: fcntl.fcntl(weights_fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE),
                    ),
                ]:
                    try:
                        attempt()
                        seen[what] = "done"
                    except OSError as exc:
                        seen[what] = exc.errno
            finally:
                os.close(reopened)
            slot = map_fd(slot_fd, SPEC.size)
            weights = map_fd(weights_fd, SPEC.size, writable=False)
        finally:
            os.close(weights_fd)
            os.close(slot_fd)
        clock = welcome["clock"]
        for step in range(STEPS):
            assert receive(sock, 10)[0] == {"op": "weights", "clock": clock}
            seen.setdefault("pulled", []).append(weights.copy())
            slot[:] = gradient(1, step)
            sock.sendall(encode({"op": "gradient", "clock": clock}))
            pushed = receive(sock, 10)[0]
            assert pushed["op"] == "pushed"
            clock = pushed["clock"]
    finally:
        sock.close()


@pytest.mark.parametrize("data_plane", ["tcp"])
def test_a_follower_can_neither_resize_nor_write_beyond_its_own_slot(cluster):
    host = Host(cluster)
    seen = {}
    run_threads([lambda: host.train(host.leader, 0), lambda: rogue_follower(host.name, seen)], timeout=60)
    weights = host.cluster.weights().copy()
    refused = {what: errno for what, errno in seen.items() if what not in ("weights seals", "slot seals", "pulled")}
    assert "done" not in refused.values(), refused
    assert len(refused) == 6
    # Its own slot it may write: its gradients are the host's, and the leader (which read it) lives on.
    np.testing.assert_allclose(weights, expected_weights(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(
        seen["pulled"][-1],
        -LR * sum((gradient(0, s) + gradient(1, s)) / 2 for s in range(STEPS - 1)),
        rtol=1e-5,
        atol=1e-6,
    )
