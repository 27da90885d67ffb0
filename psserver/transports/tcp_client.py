"""The TCP data plane, client side: connections to one shard's data port, pooled.

A pull is received with ``recv_into`` straight into the caller's buffer and a float32
push is sent with ``sendall`` straight from it: no user-space copy. Two connections may be
in use at once (a push and the pull that overlaps it). The pool and the round trip, and when a
connection is reused, are every stream plane's (stream_client.py).
"""

from __future__ import annotations

import socket

import numpy as np

from psgrid.psserver import dtypes as wire
from psgrid.psserver.exceptions import BadReply
from psgrid.psserver.protocol import FLOAT32, Outcome, PushResult
from psgrid.psserver.security import client_ssl_context
from psgrid.psserver.transports.base import ConnectOptions, Control, DataPlane, register_data_plane
from psgrid.psserver.transports.stream_client import ConnectionPool, StreamConnection, say_hello
from psgrid.psserver.transports.stream_frames import pull_request, push_request, read_reply, recv_exact


class TcpDataPlane(DataPlane):
    """Pulls and pushes of one shard's range over its TCP data port."""

    name = "tcp"

    def __init__(self, host: str, port: int, options: ConnectOptions):
        self.host, self.port = host, port
        self.token = options.token
        self.ssl_context = (
            client_ssl_context(options.tls_ca, options.tls_cert, options.tls_key) if options.tls else None
        )
        self.replier = f"shard data plane at {self.where}"  # who a refusal came from, in its message
        self.pool: ConnectionPool[StreamConnection] = ConnectionPool(self._connect, "data plane", self.where)

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    def _connect(self, timeout: float) -> StreamConnection:
        sock = socket.create_connection((self.host, self.port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:
                sock = self.ssl_context.wrap_socket(sock, server_hostname=self.host)
            if self.token:
                say_hello(sock, self.token, self.replier)
        except BaseException:
            sock.close()  # a refused handshake or hello must not leak the socket
            raise
        return StreamConnection(sock)

    # ----- calls --------------------------------------------------------------------------------

    def pull_into(self, out: np.ndarray, *, begin: int, worker_id: int, clock: int, timeout_s: float) -> int:
        view = memoryview(out).cast("B")

        def call(conn: StreamConnection) -> int:
            sock = conn.sock
            sock.sendall(pull_request(FLOAT32, worker_id, clock, timeout_s))
            reply = read_reply(sock, self.replier)
            if reply.nbytes != view.nbytes:
                raise BadReply(
                    f"shard data plane at {self.where} sent {reply.nbytes} bytes for a range of {view.nbytes}"
                )
            recv_exact(sock, view)
            return reply.version

        return self.pool.round_trip(timeout_s, call)

    def push(
        self,
        grad: np.ndarray,
        *,
        begin: int,
        wire_dtype: int,
        worker_id: int,
        clock: int,
        version: int,
        timeout_s: float,
    ) -> PushResult:
        payload = memoryview(grad).cast("B") if wire_dtype == FLOAT32 else wire.encode(grad, wire_dtype)
        nbytes = memoryview(payload).nbytes

        def call(conn: StreamConnection) -> PushResult:
            sock = conn.sock
            sock.sendall(push_request(wire_dtype, worker_id, clock, version, nbytes, timeout_s))
            sock.sendall(payload)
            reply = read_reply(sock, self.replier)
            return PushResult(Outcome(reply.outcome), reply.version, reply.staleness, reply.next_clock)

        return self.pool.round_trip(timeout_s, call, sends_payload=True)

    def close(self) -> None:
        self.pool.close()


def _offered(control: Control, address: str, options: ConnectOptions) -> TcpDataPlane | None:
    """The shard's TCP data port (its offer is the port; the host is the one its control address names)."""
    if not (address.isdigit() and 0 < int(address) < 65536):
        return None
    host = control.address.rsplit(":", 1)[0].strip("[]")
    return TcpDataPlane(host, int(address), options)


register_data_plane("tcp", _offered)
