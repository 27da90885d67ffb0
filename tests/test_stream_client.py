"""The stream planes' client pool: a connection is reused exactly while it is in step with the shard.

A shard's replies are written ahead into one end of a socket pair, byte for byte as a shard
would send them; the pool's connection is the other end.
"""

from __future__ import annotations

import socket

import numpy as np
import pytest

from psgrid.psserver.exceptions import BadReply, FailedPrecondition, PSError, Unavailable, WaitTimeout
from psgrid.psserver.protocol import FLOAT32, Reason, Status
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.transports import stream_client
from psgrid.psserver.transports.base import ConnectOptions
from psgrid.psserver.transports.stream_client import ConnectionPool, StreamConnection
from psgrid.psserver.transports.stream_frames import MAX_MESSAGE, pull_request, read_reply, refusal_frame, reply_header
from psgrid.psserver.transports.tcp_client import TcpDataPlane

SPEC = ModelSpec([("w", (64,))])


class FakeShard:
    """One connection's far end: what the shard says is written before the client asks."""

    def __init__(self):
        self.client_end, self.shard_end = socket.socketpair()
        self.connects = 0

    def connect(self, timeout_s: float) -> StreamConnection:
        self.connects += 1
        assert self.connects == 1, "the pool opened a second connection"
        return StreamConnection(self.client_end)

    def says(self, frame: bytes) -> None:
        self.shard_end.sendall(frame)

    def close(self) -> None:
        self.client_end.close()
        self.shard_end.close()


@pytest.fixture
def shard():
    fake = FakeShard()
    yield fake
    fake.close()


def pull(pool: ConnectionPool, timeout_s: float = 5.0, sends_payload: bool = False):
    def call(conn):
        conn.sock.sendall(pull_request(FLOAT32, 1, 0, timeout_s))
        return read_reply(conn.sock, "fake shard").version

    return pool.round_trip(timeout_s, call, sends_payload=sends_payload)


def reused(pool: ConnectionPool, shard: FakeShard) -> bool:
    if pool.idle == [] and shard.client_end.fileno() == -1:
        return False
    assert pool.idle and pool.idle[0].sock is shard.client_end, "neither reused nor closed"
    return True


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "status, reason, raised",
    [
        (Status.DEADLINE_EXCEEDED, Reason.WAIT_TIMEOUT, WaitTimeout),
        (Status.INVALID_ARGUMENT, Reason.BAD_VALUE, PSError),
        (Status.FAILED_PRECONDITION, Reason.UNKNOWN_WORKER, FailedPrecondition),
        (Status.INTERNAL, Reason.NONE, PSError),
    ],
)
def test_a_connection_is_reused_after_a_whole_refusal_the_shard_keeps_it_for(shard, status, reason, raised):
    pool = ConnectionPool(shard.connect, "data plane", "fake")
    shard.says(refusal_frame(status, reason, b"no"))
    with pytest.raises(raised):
        pull(pool)
    assert reused(pool, shard)
    shard.says(reply_header(version=7))  # and it serves the next call
    assert pull(pool) == 7 and reused(pool, shard)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "status, reason",
    [
        (Status.UNAUTHENTICATED, Reason.UNAUTHENTICATED),  # the shard closes after these
        (Status.UNAVAILABLE, Reason.TOO_MANY_CONNECTIONS),
        (Status.INVALID_ARGUMENT, Reason.MALFORMED),
    ],
)
def test_a_connection_is_closed_after_a_refusal_the_shard_closes_it_after(shard, status, reason):
    pool = ConnectionPool(shard.connect, "data plane", "fake")
    shard.says(refusal_frame(status, reason, b"no"))
    with pytest.raises(PSError):
        pull(pool)
    assert not reused(pool, shard)


@pytest.mark.timeout(10)
def test_a_refused_request_that_carried_a_payload_closes_the_connection(shard):
    """The shard may have refused it before reading the payload: it drops the payload, then closes."""
    pool = ConnectionPool(shard.connect, "data plane", "fake")
    shard.says(refusal_frame(Status.INVALID_ARGUMENT, Reason.BAD_SIZE, b"not the range"))
    with pytest.raises(PSError):
        pull(pool, sends_payload=True)
    assert not reused(pool, shard)


@pytest.mark.timeout(10)
def test_a_refusal_longer_than_read_closes_the_connection(shard):
    pool = ConnectionPool(shard.connect, "data plane", "fake")
    text = b"x" * (MAX_MESSAGE + 1)
    shard.says(reply_header(Status.FAILED_PRECONDITION, Reason.UNKNOWN_WORKER, nbytes=len(text)) + text)
    with pytest.raises(FailedPrecondition):
        pull(pool)
    assert not reused(pool, shard)


@pytest.mark.timeout(10)
def test_a_torn_frame_closes_the_connection_and_is_unavailable(shard):
    pool = ConnectionPool(shard.connect, "data plane", "fake")
    shard.says(reply_header(Status.FAILED_PRECONDITION, Reason.UNKNOWN_WORKER, nbytes=100) + b"unknown")
    shard.shard_end.shutdown(socket.SHUT_WR)
    with pytest.raises(Unavailable) as lost:
        pull(pool)
    assert lost.value.reason is Reason.UNREACHABLE and not reused(pool, shard)


@pytest.mark.timeout(10)
def test_a_timeout_mid_frame_closes_the_connection(shard, monkeypatch):
    monkeypatch.setattr(stream_client, "SOCKET_SLACK_S", 0.0)
    pool = ConnectionPool(shard.connect, "data plane", "fake")
    shard.says(reply_header(version=3)[:10])  # the rest never comes
    with pytest.raises(Unavailable):
        pull(pool, timeout_s=0.2)
    assert not reused(pool, shard)


@pytest.mark.timeout(10)
def test_the_clients_own_objection_to_a_reply_closes_the_connection(shard):
    """A BadReply leaves the rest of the frame unread."""
    pool = ConnectionPool(shard.connect, "data plane", "fake")
    shard.says(reply_header(nbytes=4))

    def call(conn):
        read_reply(conn.sock, "fake shard")
        raise BadReply("4 bytes for a range of 8")

    with pytest.raises(BadReply):
        pool.round_trip(5.0, call)
    assert not reused(pool, shard)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["tcp"])
def test_the_tcp_plane_keeps_its_connection_after_a_refused_pull(cluster, monkeypatch):
    """A pull refused by the service leaves the connection in step: the next call does not reconnect."""
    c = cluster(1, mode="async")
    c.client(SPEC, init=SPEC.flat()).join()
    connects = []
    create_connection = socket.create_connection
    monkeypatch.setattr(socket, "create_connection", lambda *a, **kw: connects.append(a) or create_connection(*a, **kw))
    plane = TcpDataPlane("127.0.0.1", c.servers[0].tcp.port, ConnectOptions())
    try:
        out = np.zeros(SPEC.size, np.float32)
        with pytest.raises(FailedPrecondition):
            plane.pull_into(out, begin=0, worker_id=12345, clock=0, timeout_s=5.0)  # never registered
        assert plane.pull_into(out, begin=0, worker_id=-1, clock=0, timeout_s=5.0) == 0
        assert len(connects) == 1
    finally:
        plane.close()


def test_the_named_frames_are_the_documented_bytes():
    """Each constructor and view against the layout spelled out by hand (docs/wire.md, stream_frames.py)."""
    import struct

    from psgrid.psserver.transports import stream_frames as f

    request, reply = struct.Struct("<4sBBqqQQd"), struct.Struct("<4sBBBQqqQ")
    assert f.hello_request(b"tok") == request.pack(b"PST2", 1, 0, 0, 0, 0, 3, 0.0) + b"tok"
    assert f.pull_request(1, 7, 9, 2.5) == request.pack(b"PST2", 2, 1, 7, 9, 0, 0, 2.5)
    assert f.push_request(2, 7, 9, 4, 100, 2.5) == request.pack(b"PST2", 3, 2, 7, 9, 4, 100, 2.5)
    assert f.open_request() == request.pack(b"PST2", 4, 0, 0, 0, 0, 0, 0.0)
    assert f.map_request(5) == request.pack(b"PST2", 5, 0, 0, 5, 0, 0, 0.0)  # the index in ``clock``
    assert f.attach_request(0x13, 4096) == request.pack(b"PST2", 6, 0x13, 0, 0, 0, 4096, 0.0)
    assert f.dtype_byte(3, 1) == 0x13  # dtype low, file high
    parsed = f.Request._make(request.unpack(request.pack(b"PST2", 6, 0x13, 7, 5, 0, 4096, 0.0)))
    assert (parsed.buffer_index, parsed.wire_dtype, parsed.file_index) == (5, 3, 1)
    assert f.open_reply(12) == reply.pack(b"PST2", 0, 0, 0, 12, 0, 0, 0)  # the slot in ``version``
    assert f.map_reply(4096) == reply.pack(b"PST2", 0, 0, 0, 4096, 0, 0, 0)  # the bytes in ``version``
    assert f.shared_pull_reply(8, 2) == reply.pack(b"PST2", 0, 0, 0, 8, 2, 0, 0)  # the index in ``staleness``
    assert (
        f.refusal_frame(3, 2, b"x" * (f.MAX_MESSAGE + 1))
        == reply.pack(b"PST2", 3, 2, 0, 0, 0, 0, f.MAX_MESSAGE) + b"x" * f.MAX_MESSAGE
    )
    shown = f.Reply._make(reply.unpack(f.shared_pull_reply(8, 2)))
    assert (shown.version, shown.buffer_index, shown.slot, shown.buffer_bytes) == (8, 2, 8, 8)
