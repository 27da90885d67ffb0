"""What only the TCP data plane has: a framed connection that must stay in step, or close."""

from __future__ import annotations

import socket

import numpy as np
import pytest

from psgrid.psserver.protocol import FLOAT32, Reason, Status
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.transports.stream_frames import MAGIC, PULL, PUSH, REPLY, REQUEST, recv_exact, recv_struct
from tests.support import wait_for

pytestmark = pytest.mark.parametrize("data_plane", ["tcp"])

BIG = ModelSpec([("w", (1 << 20,))])


def f32(values) -> bytes:
    return np.asarray(values, "<f4").tobytes()


def read_reply(sock) -> tuple:
    fields = recv_struct(sock, REPLY)
    body = bytearray(fields[-1])
    recv_exact(sock, memoryview(body))
    return fields, bytes(body)


@pytest.mark.timeout(30)
def test_a_large_refused_push_still_gets_its_refusal_not_a_reset(cluster):
    """A push refused before its payload is read must still deliver the refusal, however big the payload."""
    c = cluster(1, mode="async")
    client = c.client(BIG, init=BIG.flat()).join()
    for _ in range(5):  # one element too many: 4 MiB + 4 bytes
        payload = b"\0" * (4 * BIG.size + 4)
        with socket.create_connection(("127.0.0.1", c.servers[0].tcp.port), timeout=10) as sock:
            sock.sendall(REQUEST.pack(MAGIC, PUSH, FLOAT32, client.worker_id, 0, 0, len(payload), 10.0))
            sock.sendall(payload)
            fields, text = read_reply(sock)
        assert (fields[1], fields[2]) == (Status.INVALID_ARGUMENT, Reason.BAD_SIZE), text
    assert c.shard().version == 0


@pytest.mark.timeout(30)
def test_a_connection_closed_mid_payload_changes_nothing(cluster):
    c = cluster(2, mode="async", optimizer="adam", lr=0.1)
    client = c.client(BIG, init=np.linspace(-1, 1, BIG.size, dtype=np.float32)).join()
    size = c.shard().size
    before, pushes = c.shard().weights.copy(), c.shard().counters.pushes
    payload = f32(np.full(size, 3.0))
    port = c.servers[0].tcp.port
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(REQUEST.pack(MAGIC, PUSH, FLOAT32, client.worker_id, 0, 0, len(payload), 5.0))
        sock.sendall(payload[: len(payload) // 2])
        # closed only once a handler is receiving the payload (it has taken the buffer it lands in): closed
        # sooner, under the full suite's load, the checks below could run before the shard accepted at all
        wait_for(lambda: c.shard().pool.on_loan == 1, 5, "a handler receiving the push", poll=0.02)
    # until the shard has seen the connection go and given back that buffer
    wait_for(lambda: not (c.servers[0].tcp.connections or c.shard().pool.on_loan), 5, "the closed push", poll=0.02)
    np.testing.assert_array_equal(c.shard().weights, before)
    assert c.shard().counters.pushes == pushes and c.shard().pool.on_loan == 0
    # the same push, complete this time, is applied: the half one did not take the clock
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(REQUEST.pack(MAGIC, PUSH, FLOAT32, client.worker_id, 0, 0, len(payload), 5.0) + payload)
        fields, _ = read_reply(sock)
    assert fields[1] == Status.OK and fields[6] == 1  # next_clock


@pytest.mark.timeout(30)
def test_an_unknown_operation_or_another_protocol_closes_the_connection(cluster):
    c = cluster(1, mode="async")
    c.client(BIG, init=BIG.flat()).join()
    port = c.servers[0].tcp.port
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(REQUEST.pack(MAGIC, 99, FLOAT32, 0, 0, 0, 0, 5.0))
        fields, text = read_reply(sock)
        assert (fields[1], fields[2]) == (Status.INVALID_ARGUMENT, Reason.MALFORMED) and "operation" in text.decode()
        assert sock.recv(1) == b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 40)
        try:
            closed = sock.recv(1) == b""  # not our magic: closed without a reply ...
        except ConnectionResetError:
            closed = True  # ... reset, since the rest of the request was never read
        assert closed
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:
        # a PULL that says a payload follows: those bytes, read as the next request, would answer it
        sock.sendall(REQUEST.pack(MAGIC, PULL, FLOAT32, -1, 0, 0, REQUEST.size, 5.0))
        sock.sendall(REQUEST.pack(MAGIC, PULL, FLOAT32, -1, 0, 0, 0, 5.0))
        fields, text = read_reply(sock)
        assert (fields[1], fields[2]) == (Status.INVALID_ARGUMENT, Reason.MALFORMED) and "no payload" in text.decode()
        assert sock.recv(1) == b""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as sock:  # the plane still serves
        sock.sendall(REQUEST.pack(MAGIC, PULL, FLOAT32, -1, 0, 0, 0, 5.0))
        fields, body = read_reply(sock)
    assert fields[1] == Status.OK and len(body) == 4 * BIG.size
