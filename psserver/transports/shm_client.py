"""The shared-memory data plane, client side: read a shard's weights in place, push from shared memory.

Offered when a shard on this host answers on the Unix socket its registration names (a shard
on another host cannot be reached there, so the client falls back to its network plane). A pull
asks the shard for the buffer that holds the version this worker may read, maps it (once per
buffer, read-only), hands it to the caller (a copy into ``out``, or a device copy through
``write``), checks that the shard did not take the buffer back meanwhile (else it reads again:
the copy may be torn) and clears this connection's mark, so the shard may write that buffer
again. A push puts the gradient into the client's shared gradient file (sealed against
resizing: shared_memory.py; nothing to do when the caller computed it there), attaches that
file once per connection, and sends a header. See shm_server.py.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable

import numpy as np

from psgrid.psserver import dtypes as wire
from psgrid.psserver.exceptions import BadReply, PSError, Unavailable
from psgrid.psserver.protocol import FLOAT32, ITEMSIZE, Outcome, PushResult, Reason
from psgrid.psserver.security import client_ssl_context
from psgrid.psserver.shared_memory import map_fd
from psgrid.psserver.transports.base import ConnectOptions, Control, DataPlane, register_data_plane
from psgrid.psserver.transports.shm_posted import PostedPull, PostedPush
from psgrid.psserver.transports.stream_client import ConnectionPool, StreamConnection, say_hello
from psgrid.psserver.transports.stream_frames import (
    FD_BYTE,
    MARK_BYTES,
    NO_MARK,
    attach_request,
    dtype_byte,
    map_request,
    open_request,
    pull_request,
    push_request,
    read_reply,
)
from psgrid.psserver.transports.unix_peers import receive_one_fd, send_with_fds, sockaddr, unix_connection

CONNECT_S = 5.0
REREAD_S = 60.0  # how long a pull with no deadline reads again while the shard takes its buffers back


class ShmConnection(StreamConnection):
    __slots__ = ("slot", "attached")

    def __init__(self, sock: socket.socket):
        super().__init__(sock)
        self.slot = -1  # this connection's slot in the shard's marks, once OPENed
        self.attached: set[int] = set()  # gradient files (dtype byte: dtype and index) the shard mapped for it


class ShmDataPlane(DataPlane):
    """Pulls and pushes of one shard's range through shared memory on this host."""

    name = "shm"
    title = "shared-memory plane"
    reads_in_place = True
    posts = True
    connection_class = ShmConnection

    def __init__(self, address: str, options: ConnectOptions, host: str = "localhost"):
        self.address = address
        self.path = sockaddr(address)  # what a raw socket connects to (the tests' stand-in peers)
        self.token = options.token
        # Under TLS the shard asks for a handshake here too (its certificate names ``host``, the one our
        # control connection verified); then the connection carries plain frames again.
        self.host = host
        self.ssl_context = (
            client_ssl_context(options.tls_ca, options.tls_cert, options.tls_key) if options.tls else None
        )
        self.memory = options.memory
        self.replier = f"shard shared memory at {address}"  # who a refusal came from, in its message
        self.pool: ConnectionPool[ShmConnection] = ConnectionPool(self._connect_within, "shared-memory plane", address)
        self.buffers: dict[int, np.ndarray] = {}  # the shard's ring buffers mapped here (read only)
        self.marks: np.ndarray | None = None  # the shard's table of reader marks
        self.map_lock = threading.Lock()

    # ----- connections --------------------------------------------------------------------------

    def connect(self, timeout: float) -> ShmConnection:
        sock = unix_connection(self.address, timeout)
        try:
            if self.ssl_context is not None:
                sock = self._handshake(sock, timeout)
            if self.token:
                say_hello(sock, self.token, self.replier)
        except BaseException:
            sock.close()
            raise
        return self.connection_class(sock)

    def _handshake(self, sock: socket.socket, timeout: float) -> socket.socket:
        """Show our certificate in a TLS handshake, then return to plain frames (descriptors cannot cross TLS)."""
        tls = self.ssl_context.wrap_socket(sock, server_hostname=self.host)
        try:
            plain = socket.socket(fileno=tls.unwrap().detach())
        except BaseException:
            tls.close()
            raise
        plain.settimeout(timeout)
        return plain

    def _connect_within(self, timeout: float) -> ShmConnection:
        return self.connect(min(timeout, CONNECT_S) if timeout else CONNECT_S)

    def _receive_fd(self, sock) -> int:
        fd = receive_one_fd(sock, len(FD_BYTE))
        if fd is None:
            raise BadReply(f"shard shared memory at {self.address} sent no file descriptor")
        return fd

    # ----- mapping the shard's memory -----------------------------------------------------------

    def open_slot(self, conn: ShmConnection) -> None:
        conn.sock.sendall(open_request())
        slot = read_reply(conn.sock, self.replier).slot
        fd = self._receive_fd(conn.sock)
        try:
            with self.map_lock:
                if self.marks is None:
                    self.marks = map_fd(fd, os.fstat(fd).st_size // MARK_BYTES, np.int64)
        finally:
            os.close(fd)
        conn.slot = slot

    def mapped(self, conn: ShmConnection, index: int, size: int) -> np.ndarray:
        buffer = self.buffers.get(index)
        if buffer is not None and len(buffer) == size:
            return buffer
        conn.sock.sendall(map_request(index))
        nbytes = read_reply(conn.sock, self.replier).buffer_bytes
        fd = self._receive_fd(conn.sock)
        try:
            if nbytes != size * ITEMSIZE[FLOAT32]:
                raise BadReply(
                    f"shard shared memory at {self.address} offers a buffer of {nbytes} bytes for a "
                    f"range of {size} elements"
                )
            buffer = map_fd(fd, size, np.float32, writable=False)
        finally:
            os.close(fd)
        with self.map_lock:
            old = self.buffers.get(index)
            self.buffers[index] = buffer
        if self.memory is not None:
            if old is not None:
                self.memory.unpin(old)
            self.memory.pin(buffer, read_only=True)
        return buffer

    # ----- calls --------------------------------------------------------------------------------

    def pull_into(self, out: np.ndarray, *, begin: int, worker_id: int, clock: int, timeout_s: float) -> int:
        return self._pull(lambda values: np.copyto(out, values), len(out), worker_id, clock, timeout_s)

    def pull_with(self, write, *, begin: int, end: int, staging, worker_id: int, clock: int, timeout_s: float) -> int:
        return self._pull(lambda values: write(begin, end, values), end - begin, worker_id, clock, timeout_s)

    def _pull(
        self, consume: Callable[[np.ndarray], object], size: int, worker_id: int, clock: int, timeout_s: float
    ) -> int:
        def call(conn: ShmConnection) -> int:
            if conn.slot < 0:
                self.open_slot(conn)
            give_up = time.monotonic() + (timeout_s or REREAD_S)
            while True:
                conn.sock.sendall(pull_request(FLOAT32, worker_id, clock, timeout_s))
                reply = read_reply(conn.sock, self.replier)
                version, index = reply.version, reply.buffer_index
                try:
                    consume(self.mapped(conn, index, size))
                    intact = self.still_marked(conn, index)
                finally:
                    self.unmark(conn)
                if intact:
                    return version
                if time.monotonic() > give_up:
                    raise Unavailable(
                        f"shard shared memory at {self.address} took back every buffer this worker "
                        f"read before its copy was done, for {timeout_s or REREAD_S:g} s: its copies "
                        f"are slower than the shard's updates",
                        Reason.TIMED_OUT,
                    )

        return self.pool.round_trip(timeout_s, call)

    def still_marked(self, conn: ShmConnection, index: int) -> bool:
        """Once a copy of buffer ``index`` is done (a device copy synchronized): whether it is whole.

        A slot that no longer names the buffer means the shard took it back meanwhile
        (weight_ring.py), and the copy may be torn: the caller reads again.
        """
        return self.marks[conn.slot] == index

    def unmark(self, conn: ShmConnection) -> None:
        """Clear this connection's mark: the shard may write the buffer it named again."""
        self.marks[conn.slot] = NO_MARK

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
        kind, segment, fd = self.stage(grad, begin, wire_dtype)

        def call(conn: ShmConnection) -> PushResult:
            self.send_push(
                conn, kind, segment, fd, worker_id=worker_id, clock=clock, version=version, timeout_s=timeout_s
            )
            return self.push_answer(conn)

        return self.pool.round_trip(timeout_s, call)

    def stage(self, grad: np.ndarray, begin: int, wire_dtype: int) -> tuple[int, np.ndarray, int]:
        """Put ``grad`` (this shard's range, from ``begin``) in a shared gradient file: its dtype byte, the file, its fd."""
        if self.memory is None:
            raise BadReply("this connection has no gradient memory to push from (an observer's)")
        end = begin + len(grad)
        index = self.memory.gradient_index(grad, begin) if wire_dtype == FLOAT32 else None
        segment, fd = self.memory.segment(wire_dtype, index or 0)
        if fd < 0:  # this buffer could not be shared after all: the next choice of plane takes the network's
            raise Unavailable(f"no shared file for this gradient to push through {self.address}")
        if wire_dtype != FLOAT32:
            segment[begin:end] = np.frombuffer(wire.encode(grad, wire_dtype), np.uint16)
        elif index is None:  # not computed in one of our gradient buffers: copied into the first
            np.copyto(segment[begin:end], grad)
        return dtype_byte(wire_dtype, index or 0), segment, fd

    def send_push(
        self,
        conn: ShmConnection,
        kind: int,
        segment: np.ndarray,
        fd: int,
        *,
        worker_id: int,
        clock: int,
        version: int,
        timeout_s: float,
    ) -> None:
        """Send a push's header on ``conn`` (attaching the gradient file first, once per connection)."""
        if kind not in conn.attached:
            conn.sock.sendall(attach_request(kind, segment.nbytes))
            send_with_fds(conn.sock, FD_BYTE, [fd])
            read_reply(conn.sock, self.replier)
            conn.attached.add(kind)
        conn.sock.sendall(push_request(kind, worker_id, clock, version, 0, timeout_s))

    def push_answer(self, conn: ShmConnection) -> PushResult:
        reply = read_reply(conn.sock, self.replier)
        return PushResult(Outcome(reply.outcome), reply.version, reply.staleness, reply.next_clock)

    def post_pull(self, *, size: int, worker_id: int, clock: int, timeout_s: float) -> PostedPull:
        """A pull made in steps on the caller's thread (shm_posted.py); its request is sent."""
        return PostedPull(self, size=size, worker_id=worker_id, clock=clock, timeout_s=timeout_s)

    def post_push(
        self,
        grad: np.ndarray,
        *,
        begin: int,
        wire_dtype: int,
        worker_id: int,
        clock: int,
        version: int,
        timeout_s: float,
    ) -> PostedPush:
        """A push made in steps on the caller's thread (shm_posted.py); its header is sent."""
        return PostedPush(
            self,
            grad,
            begin=begin,
            wire_dtype=wire_dtype,
            worker_id=worker_id,
            clock=clock,
            version=version,
            timeout_s=timeout_s,
        )

    def close(self) -> None:
        self.pool.close()
        with self.map_lock:
            buffers, self.buffers = list(self.buffers.values()), {}
        if self.memory is not None:
            for buffer in buffers:
                self.memory.unpin(buffer)


def _offered(control: Control, address: str, options: ConnectOptions) -> ShmDataPlane | None:
    """The shard's shared memory (its offer is its Unix socket), when it is on this host (the socket answers here)."""
    if not (options.shared_memory and address):
        return None
    if options.memory is not None and not options.memory.shares():
        return None  # our gradients could not be put in shared memory (said once, by ClientMemory)
    return answering(ShmDataPlane(address, options, host=control.address.rsplit(":", 1)[0].strip("[]")))


def answering(plane: ShmDataPlane) -> ShmDataPlane | None:
    """``plane`` with its first connection made, or None (closed) when its socket does not answer from here."""
    try:
        plane.pool.give(plane.connect(CONNECT_S))
    except (OSError, PSError):
        plane.close()
        return None
    return plane


register_data_plane("shm", _offered)
