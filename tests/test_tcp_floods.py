"""Strangers flooding the TCP data plane cannot starve the job's workers.

Each test starts a flood on 127.0.0.1 that needs no token (or, where it says so, a token
holder's), lets it take hold, then has a new worker join and train through it: the worker must
finish its rounds within a few seconds over the TCP plane. The floods are scaled down with the
shard's handler threads (8, not 128) so that each test is short and each starved the plane before
the handshake moved into the accept loop (the attackers of issue 18 used 200 trickled connections,
150 trickled 1 GiB pushes and 1,100 idle connections against 128 handlers).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from psgrid.psserver.protocol import FLOAT32, Reason, Status
from psgrid.psserver.transports import stream_server as socket_server
from psgrid.psserver.transports.stream_frames import HELLO, MAGIC, PULL, PUSH, REPLY, REQUEST, recv_exact, recv_struct
from tests.support import REGRESSION, make_problem, regression_grad

pytestmark = pytest.mark.parametrize("data_plane", ["tcp"])

TOKEN = "s3cret"
HANDLERS = 8  # the shard's threads: the floods below are sized against these
MIN_ROUNDS = 30  # pull+push rounds a worker makes in 2.5 s at least (hundreds, here, alone)
GIB = 1 << 30
TRICKLE = 100_000  # bytes of a payload a flood ever sends (never all of the GiB it declares)


class Flood:
    """``n`` connections to ``port`` from one thread: each is opened by ``opening`` (bytes to send at once),
    then sent one byte of ``trickle`` every ``tick`` seconds; one the shard drops is opened again."""

    def __init__(self, port: int, n: int, opening=lambda: b"", trickle: bytes = b"", tick: float = 0.1):
        self.port, self.n, self.opening, self.trickle, self.tick = port, n, opening, trickle, tick
        self.socks: list[tuple[socket.socket, int]] = []
        self.opened = self.dropped = 0
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name="flood", daemon=True)

    def __enter__(self) -> Flood:
        self.thread.start()
        deadline = time.monotonic() + 10
        while self.opened < self.n and time.monotonic() < deadline:
            time.sleep(0.02)
        assert self.opened >= self.n, "the flood could not open its connections"
        time.sleep(0.5)  # let it take hold of what it can
        return self

    def __exit__(self, *exc) -> None:
        self.stopped.set()
        self.thread.join(10)
        for sock, _ in self.socks:
            sock.close()

    def _open(self) -> tuple[socket.socket, int] | None:
        try:
            sock = socket.create_connection(("127.0.0.1", self.port), timeout=1)
            sock.sendall(self.opening())
        except OSError:
            return None
        sock.setblocking(False)
        self.opened += 1
        return sock, 0

    def _run(self) -> None:
        while not self.stopped.is_set():
            kept = []
            for sock, sent in self.socks:
                try:
                    if sock.recv(1 << 16) == b"":  # closed by the shard (replies are read and dropped)
                        raise ConnectionError
                except BlockingIOError:
                    pass
                except OSError:
                    sock.close()
                    self.dropped += 1
                    continue
                if sent < len(self.trickle):
                    try:
                        sock.send(self.trickle[sent : sent + 1])
                        sent += 1
                    except BlockingIOError:
                        pass
                    except OSError:
                        sock.close()
                        self.dropped += 1
                        continue
                kept.append((sock, sent))
            while len(kept) < self.n and not self.stopped.is_set():
                opened = self._open()
                if opened is None:
                    break
                kept.append(opened)
            self.socks = kept
            self.stopped.wait(self.tick)


def hello(token: str = TOKEN) -> bytes:
    return REQUEST.pack(MAGIC, HELLO, 0, 0, 0, 0, len(token), 0.0) + token.encode()


def push_header(nbytes: int, worker: int = 0) -> bytes:
    return REQUEST.pack(MAGIC, PUSH, FLOAT32, worker, 0, 0, nbytes, 5.0)


def train_through(c, seconds: float = 2.5) -> tuple[int, float]:
    """A new worker joins and trains on the TCP plane for ``seconds``: (rounds made, the slowest round's seconds)."""
    x, y, _, _ = make_problem(0)
    params, grad = REGRESSION.flat(), REGRESSION.flat()
    rounds, slowest = 0, 0.0
    t0 = time.monotonic()
    with c.client(REGRESSION, init=REGRESSION.flat(), token=TOKEN, deadline_s=3, retry_s=3) as client:
        joined = time.monotonic() - t0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            t = time.monotonic()
            client.pull(params).wait()
            client.push(regression_grad(params, x, y, out=grad)).wait()
            slowest = max(slowest, time.monotonic() - t)
            rounds += 1
        assert client.data_planes == ["tcp"]
    assert joined < 2 and rounds >= MIN_ROUNDS and slowest < 1, (joined, rounds, slowest)
    return rounds, slowest


def job(cluster, **settings):
    # A handshake deadline of 1 s, so that the shard cuts each flood at least once while the worker trains.
    return cluster(1, mode="async", lr=0.05, token=TOKEN, threads=HANDLERS, tcp_handshake_s=1.0, **settings)


@pytest.mark.timeout(60)
def test_a_worker_trains_through_strangers_trickling_their_hello_one_byte_at_a_time(cluster):
    c = job(cluster)
    header = REQUEST.pack(MAGIC, HELLO, 0, 0, 0, 0, 60_000, 0.0)  # a long token, never finished
    with Flood(c.servers[0].tcp.port, 3 * HANDLERS, trickle=header + b"t" * 60_000) as flood:
        rounds, slowest = train_through(c)
    print(
        f"{rounds} rounds (slowest {slowest:.3f}s) beside {flood.n} trickling strangers, "
        f"{flood.dropped} of their connections cut by the shard"
    )
    assert flood.dropped >= flood.n  # each cut at its handshake deadline, and opened again


@pytest.mark.timeout(60)
def test_a_worker_trains_through_strangers_trickling_refused_one_gib_pushes(cluster):
    c = job(cluster)
    with Flood(c.servers[0].tcp.port, 3 * HANDLERS, opening=lambda: push_header(GIB), trickle=b"\0" * TRICKLE) as flood:
        rounds, slowest = train_through(c)
    print(
        f"{rounds} rounds (slowest {slowest:.3f}s) beside {flood.n} strangers trickling refused pushes, "
        f"{flood.dropped} of their connections cut by the shard"
    )
    assert flood.dropped >= flood.n


@pytest.mark.timeout(60)
def test_a_worker_trains_through_a_token_holder_trickling_oversized_pushes(cluster):
    c = job(cluster)
    pusher = c.client(REGRESSION, init=REGRESSION.flat(), token=TOKEN).join()  # a live worker id: its push
    with Flood(
        c.servers[0].tcp.port,
        3 * HANDLERS,  # is refused for its size
        opening=lambda: hello() + push_header(GIB, pusher.worker_id),
        trickle=b"\0" * TRICKLE,
    ) as flood:
        rounds, slowest = train_through(c)
    print(
        f"{rounds} rounds (slowest {slowest:.3f}s) beside {flood.n} trickled oversized pushes of a token holder, "
        f"{flood.dropped} of their connections cut by the shard"
    )  # each after 3 s (the next test)


@pytest.mark.timeout(60)
def test_a_worker_trains_through_a_token_holder_trickling_request_headers(cluster):
    """A header begun is the loop's until whole: a handler that read it as it came was held up to 10 s by each."""
    c = job(cluster)
    header = REQUEST.pack(MAGIC, PULL, FLOAT32, 0, 0, 0, 0, 5.0)
    with Flood(c.servers[0].tcp.port, 3 * HANDLERS, opening=hello, trickle=header[:-1]) as flood:
        rounds, slowest = train_through(c)
        held = c.servers[0].tcp.partial
        assert held and all(conn.authenticated for conn in held)  # the loop holds them, no handler
    print(f"{rounds} rounds (slowest {slowest:.3f}s) beside {flood.n} trickled headers of a token holder")


@pytest.mark.timeout(60)
def test_an_oversized_push_is_refused_before_its_payload_and_the_connection_closed_soon(cluster):
    c = job(cluster)
    pusher = c.client(REGRESSION, init=REGRESSION.flat(), token=TOKEN).join()
    with socket.create_connection(("127.0.0.1", c.servers[0].tcp.port), timeout=5) as sock:
        sock.sendall(hello())
        assert recv_struct(sock, REPLY)[1] == 0
        t0 = time.monotonic()
        sock.sendall(push_header(GIB, pusher.worker_id))  # no payload sent at all
        fields = recv_struct(sock, REPLY)
        assert (fields[1], fields[2]) == (Status.INVALID_ARGUMENT, Reason.BAD_SIZE)
        recv_exact(sock, memoryview(bytearray(fields[-1])))  # the refusal's text
        closed = False
        while time.monotonic() - t0 < 10:  # trickled: the shard cuts it
            try:
                sock.send(b"\0")
            except OSError:
                closed = True
                break
            time.sleep(0.05)
        assert closed and time.monotonic() - t0 < 10


@pytest.mark.timeout(60)
def test_a_worker_joins_and_trains_beside_more_idle_strangers_than_the_plane_takes(cluster, monkeypatch):
    monkeypatch.setattr(socket_server, "MAX_HANDSHAKES", 16)
    c = job(cluster, tcp_max_connections=32)
    with Flood(c.servers[0].tcp.port, 64) as flood:  # idle: they never send a byte
        rounds, slowest = train_through(c)
        assert c.servers[0].tcp.open_connections <= 32 + 16
    print(
        f"{rounds} rounds (slowest {slowest:.3f}s) beside {flood.n} idle strangers, "
        f"{flood.dropped} of their connections cut by the shard"
    )
    assert flood.dropped >= flood.n
