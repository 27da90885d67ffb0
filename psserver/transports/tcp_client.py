"""The TCP data plane, client side: connections to one shard's data port, pooled.

A pull is received with ``recv_into`` straight into the caller's buffer and a float32
push is sent with ``sendall`` straight from it: no user-space copy. Two connections may be
in use at once (a push and the pull that overlaps it). A connection that breaks is never
reused, and the failure is :class:`Unavailable`: the client retries, choosing the shard's
data plane again from a fresh registration (a restarted shard listens on another port).
"""

from __future__ import annotations

import socket
import ssl
import threading

import numpy as np

from psgrid.psserver import dtypes as wire
from psgrid.psserver.exceptions import BadReply, PSError, Unavailable
from psgrid.psserver.protocol import FLOAT32, Outcome, PushResult, Reason, Status
from psgrid.psserver.security import client_ssl_context
from psgrid.psserver.transports.base import ConnectOptions, Control, DataPlane, register_data_plane
from psgrid.psserver.transports.stream_frames import HELLO, MAGIC, PULL, PUSH, REQUEST, read_reply, recv_exact

# How much longer than the call's deadline a socket waits: the shard answers a timed-out
# consistency wait itself, just before the deadline.
SOCKET_SLACK_S = 5.0


class TcpDataPlane(DataPlane):
    """Pulls and pushes of one shard's range over its TCP data port."""

    name = "tcp"

    def __init__(self, host: str, port: int, options: ConnectOptions):
        self.host, self.port = host, port
        self.token = options.token
        self.ssl_context = client_ssl_context(options.tls_ca, options.tls_cert, options.tls_key) if options.tls else None
        self.idle: list[socket.socket] = []
        self.lock = threading.Lock()
        self.closed = False

    @property
    def where(self) -> str:
        return f"{self.host}:{self.port}"

    # ----- connections --------------------------------------------------------------------------

    def _connect(self, timeout: float) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:
                sock = self.ssl_context.wrap_socket(sock, server_hostname=self.host)
            if self.token:
                token = self.token.encode()
                sock.sendall(REQUEST.pack(MAGIC, HELLO, 0, 0, 0, 0, len(token), 0.0) + token)
                self._read_reply(sock)
        except BaseException:
            sock.close()      # a refused handshake or hello must not leak the socket
            raise
        return sock

    def _take(self, timeout: float) -> socket.socket:
        with self.lock:
            sock = self.idle.pop() if self.idle else None
        return sock or self._connect(timeout)

    def _give(self, sock: socket.socket) -> None:
        with self.lock:
            if not self.closed:
                self.idle.append(sock)
                return
        sock.close()      # this plane was closed while the call was in flight

    def _read_reply(self, sock) -> tuple:
        return read_reply(sock, f"shard data plane at {self.where}")

    def _round_trip(self, timeout_s: float, send, receive):
        try:
            sock = self._take(timeout_s)
        except (OSError, ssl.SSLError) as exc:
            raise Unavailable(f"cannot connect to the data plane at {self.where}: {exc}", Reason.UNREACHABLE) from exc
        try:
            sock.settimeout(timeout_s + SOCKET_SLACK_S if timeout_s else None)
            send(sock)
            result = receive(sock)
        except PSError as err:
            # Only a consistency wait that outlived its deadline surely leaves the connection in step
            # (it is re-issued at once); after any other refusal the shard may have closed it.
            if err.status == Status.DEADLINE_EXCEEDED:
                self._give(sock)
            else:
                sock.close()
            raise
        except (OSError, ssl.SSLError) as exc:      # ConnectionError, timeouts: never reuse the connection
            sock.close()
            raise Unavailable(f"data plane connection to {self.where} lost: {exc}", Reason.UNREACHABLE) from exc
        except BaseException:
            sock.close()
            raise
        self._give(sock)
        return result

    # ----- calls --------------------------------------------------------------------------------

    def pull_into(self, out: np.ndarray, *, begin: int, worker_id: int, clock: int, timeout_s: float) -> int:
        view = memoryview(out).cast("B")

        def send(sock):
            sock.sendall(REQUEST.pack(MAGIC, PULL, FLOAT32, worker_id, clock, 0, 0, timeout_s))

        def receive(sock):
            _, version, _, _, nbytes = self._read_reply(sock)
            if nbytes != view.nbytes:
                raise BadReply(f"shard data plane at {self.where} sent {nbytes} bytes for a range of {view.nbytes}")
            recv_exact(sock, view)
            return version

        return self._round_trip(timeout_s, send, receive)

    def push(self, grad: np.ndarray, *, begin: int, wire_dtype: int, worker_id: int, clock: int, version: int,
             timeout_s: float) -> PushResult:
        payload = memoryview(grad).cast("B") if wire_dtype == FLOAT32 else wire.encode(grad, wire_dtype)
        nbytes = memoryview(payload).nbytes

        def send(sock):
            sock.sendall(REQUEST.pack(MAGIC, PUSH, wire_dtype, worker_id, clock, version, nbytes, timeout_s))
            sock.sendall(payload)

        def receive(sock):
            outcome, new_version, staleness, next_clock, _ = self._read_reply(sock)
            return PushResult(Outcome(outcome), new_version, staleness, next_clock)

        return self._round_trip(timeout_s, send, receive)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            idle, self.idle = self.idle, []
        for sock in idle:
            sock.close()


def _offered(control: Control, address: str, options: ConnectOptions) -> TcpDataPlane | None:
    """The shard's TCP data port (its offer is the port; the host is the one its control address names)."""
    if not (address.isdigit() and 0 < int(address) < 65536):
        return None
    host = control.address.rsplit(":", 1)[0].strip("[]")
    return TcpDataPlane(host, int(address), options)


register_data_plane("tcp", _offered)
