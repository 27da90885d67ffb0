"""The shared-memory data plane, server side: workers on this host read the weights where they lie.

A worker on the shard's host reaches it on an abstract Unix socket (unix_peers.py; its name travels in
RegisterReply's ``shm_socket``; a worker elsewhere cannot connect, and falls back to TCP). Only
small frames (stream_frames.py, which names each field this plane gives a meaning of its own) cross the socket; memory crosses by file descriptor:

* ``OPEN`` gives the connection a slot in the shard's table of reader marks and the table itself;
* ``PULL`` waits for the consistency rule, then answers the index of the ring buffer that holds the
  current version (weight_ring.py), marked as read by this connection's slot; the worker copies it
  (or DMAs it to its GPU) in place and clears the mark;
* ``MAP`` hands over a ring buffer's file (once per buffer), read-only and sealed so that no
  reader can write, resize or punch it; ``ATTACH`` takes the worker's gradient file (the whole
  model, in one wire dtype), refused unless sealed against resizing, and maps this shard's range
  of it read-only here;
* ``PUSH`` says the gradient is in the attached file: the shard checks it and applies it from there.

So a pull costs the worker one copy (none in the shard), and a push none at all when the worker
computes its gradient into the shared file. Files are anonymous (shared_memory.py): nothing is
ever left in ``/dev/shm``. Only processes of the shard's own user may connect (the kernel says
who: unix_peers.py), and they must show what the TCP plane asks for: the job's token in a hello, and under TLS a
handshake (with a certificate of the job's CA under mutual TLS), after which the connection goes
back to plain frames (``unwrap``) so descriptors can cross it. What a connected peer can and cannot
do to the shard is in docs/reliability.md ("The shared-memory plane's threat model").
"""

from __future__ import annotations

import logging
import os
import secrets
import selectors
import socket
import ssl
from collections.abc import Callable

import numpy as np

from psgrid.psserver import dtypes as wire
from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.intake import GRADIENT_DTYPES, check_dtype
from psgrid.psserver.protocol import BFLOAT16, FLOAT16, FLOAT32, ITEMSIZE, Reason
from psgrid.psserver.service import ShardService
from psgrid.psserver.shared_memory import available, can_share_read_only, map_fd, unsafe_to_map
from psgrid.psserver.transports.base import ListenContext, Listening, register_listener
from psgrid.psserver.transports.ring_readers import RingReaders, require_shared
from psgrid.psserver.transports.stream_frames import (
    ATTACH,
    FD_BYTE,
    MAP,
    OPEN,
    PULL,
    PUSH,
    Request,
    map_reply,
    open_reply,
    shared_pull_reply,
)
from psgrid.psserver.transports.stream_server import DEFAULT_MAX_CONNECTIONS, Connection, SocketDataServer, wait_timeout
from psgrid.psserver.transports.unix_peers import (
    abstract_address,
    abstract_listener,
    peer_refusal,
    receive_one_fd,
    send_with_fds,
)

SEGMENT_DTYPES = {FLOAT32: np.dtype("<f4"), FLOAT16: np.dtype("<u2"), BFLOAT16: np.dtype("<u2")}


class SharedSegment:
    """A push's gradient in a worker's shared memory: this shard's range of its attached file, in wire ``dtype``.

    Handed to the intake (intake.py ``GradientSource``): float32 is read where it lies, during the
    push only; half precision is converted into a pooled buffer of the shard's.
    """

    __slots__ = ("dtype", "segment")

    def __init__(self, dtype: int, segment: np.ndarray):
        self.dtype, self.segment = dtype, segment

    @property
    def nbytes(self) -> int:
        return self.segment.nbytes

    def check(self, size: int) -> None:
        check_dtype(self.dtype, GRADIENT_DTYPES)
        if len(self.segment) != size:
            raise InvalidArgument(
                f"the shared gradient maps {len(self.segment)} elements; this shard's range has {size}",
                Reason.BAD_SIZE,
            )

    def lend(self) -> np.ndarray | None:
        return self.segment if self.dtype == FLOAT32 else None

    def copy_into(self, destination: np.ndarray) -> bool:
        wire.decode_into(destination, memoryview(self.segment).cast("B"), self.dtype)
        return False  # checked as it lands, where the rule says so


class Reader:
    """What the plane keeps for one connection: its slot in the marks table and the gradients it attached
    (by the dtype byte that names them: wire dtype and the index of the client's file)."""

    __slots__ = ("slot", "segments")

    def __init__(self):
        self.slot = -1
        self.segments: dict[int, np.ndarray] = {}


class ShmDataServer(SocketDataServer):
    """Serves one shard's Pull and Push through shared memory to processes of this host and user."""

    name = "shared-memory plane"

    def __init__(
        self,
        service: ShardService,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        *,
        handlers: int = 128,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        on_failure: Callable[[], None] | None = None,
    ):
        name = f"psgrid-{secrets.token_hex(16)}"
        listener = abstract_listener(name, 256)  # abstract: no file to leave behind, unreachable from other hosts
        self.address = abstract_address(name)
        super().__init__(
            service,
            listener,
            token,
            ssl_context,
            handlers=handlers,
            max_connections=max_connections,
            on_failure=on_failure,
        )
        self.readers = RingReaders(service)
        self.operations = {OPEN: self._open, MAP: self._map, PULL: self._pull, PUSH: self._push}

    def _accepted(self, sock: socket.socket) -> str | None:
        return peer_refusal(sock, "this shard's shared memory")

    def _finish_tls(self, conn: Connection) -> bool:
        # Under TLS the client proves what the network planes ask for (its certificate, under mutual TLS),
        # then the connection goes back to plain frames: descriptors cannot cross TLS, and nothing here
        # needs hiding from a kernel that already vouched for the peer's user. Read without blocking, as
        # the rest of the handshake: the TLS handshake, its close (``unwrap``), then the hello in plain.
        # (A handshake already done returns at once when its close is still waiting for the peer.)
        sock: ssl.SSLSocket = conn.sock
        if not (self._tls_step(conn, sock.do_handshake) and self._tls_step(conn, sock.unwrap)):
            return False
        self.selector.unregister(sock)  # before detach: the selector knows it by descriptor
        conn.sock = conn.raw = socket.socket(fileno=sock.detach())
        conn.sock.setblocking(False)
        self.selector.register(conn.sock, selectors.EVENT_READ, conn)
        return True

    def _released(self, conn) -> None:
        reader = conn.state
        if reader is not None and reader.slot >= 0:
            self.readers.close(reader.slot)
            reader.slot = -1
        conn.state = None

    def _operation(self, conn: Connection, request: Request) -> bool:
        op = request.op
        if op not in (OPEN, MAP, ATTACH, PULL, PUSH) or request.nbytes and op != ATTACH:
            return super()._operation(conn, request)
        if conn.state is None:
            conn.state = Reader()
        sock, reader = conn.sock, conn.state
        if op == ATTACH:  # refused on its own unless its descriptor is missing (then it closes)
            return self._answer(sock, self._attach, sock, reader, request) is not False
        self._answer(sock, self.operations[op], sock, reader, request)
        return True

    def _open(self, sock, reader: Reader, request: Request) -> None:
        if reader.slot < 0:
            reader.slot, marks_fd = self.readers.open()
        else:
            marks_fd = self.readers.marks_fd()
        sock.sendall(open_reply(reader.slot))
        send_with_fds(sock, FD_BYTE, [marks_fd])

    def _map(self, sock, reader: Reader, request: Request) -> None:
        fd, size = self._buffer_fd(request.buffer_index)
        sock.sendall(map_reply(size))
        send_with_fds(sock, FD_BYTE, [fd])

    def _buffer_fd(self, index: int) -> tuple[int, int]:
        """A read-only descriptor of the ring's buffer ``index`` and its size in bytes."""
        shard = self.service.shard
        require_shared(shard)
        ring = shard.ring
        if ring is None or not 0 <= index < len(ring.arrays):
            raise InvalidArgument(f"no weight buffer {index}", Reason.BAD_VALUE)
        return ring.reader_fd(index), ring.size * ITEMSIZE[FLOAT32]

    def _pull(self, sock, reader: Reader, request: Request) -> None:
        if reader.slot < 0:
            raise InvalidArgument("OPEN before the first PULL on a shared-memory connection", Reason.MALFORMED)
        pulled, index = self.readers.pull(
            worker_id=request.worker,
            clock=request.clock,
            timeout_s=wait_timeout(sock, request.timeout),
            slot=reader.slot,
        )
        sock.sendall(shared_pull_reply(pulled, index))

    def _push(self, sock, reader: Reader, request: Request) -> None:
        segment = reader.segments.get(request.dtype)
        if segment is None:
            raise InvalidArgument(
                f"no gradient file {request.file_index} of dtype {request.wire_dtype} attached to "
                f"this connection: ATTACH it first",
                Reason.BAD_DTYPE,
            )
        result = self.service.push(
            worker_id=request.worker,
            clock=request.clock,
            version=request.version,
            source=SharedSegment(request.wire_dtype, segment),
        )
        self._reply_push(sock, result)

    def _attach(self, sock, reader: Reader, request: Request) -> bool:
        """Take the worker's gradient file; False (close) when the descriptor did not come with it."""
        fd = receive_one_fd(sock, len(FD_BYTE))
        if fd is None:
            self._refuse(sock, InvalidArgument("ATTACH must carry one file descriptor", Reason.MALFORMED))
            return False
        try:
            reader.segments[request.dtype] = self._map_gradient(fd, request)  # a refusal: _answer's
        finally:
            os.close(fd)
        self._reply(sock)
        return True

    def _map_gradient(self, fd: int, request: Request) -> np.ndarray:
        """This shard's range of a worker's gradient file (the whole model in one dtype), mapped read-only."""
        nbytes = request.nbytes
        kind = SEGMENT_DTYPES.get(request.wire_dtype) if request.file_index in (0, 1) else None
        if kind is None:
            raise InvalidArgument(
                f"dtype byte {request.dtype} names no gradient file (a gradient dtype, file 0 or 1)", Reason.BAD_DTYPE
            )
        model, begin, size = self.service.shard.served_layout()  # refused before Init: the model is unknown
        model_bytes = model * ITEMSIZE[request.wire_dtype]
        if nbytes != model_bytes:
            raise InvalidArgument(
                f"a shared gradient holds the whole model, {model_bytes} bytes in this dtype, not {nbytes}",
                Reason.BAD_SIZE,
            )
        check_gradient_file(fd)
        try:
            return map_fd(fd, size, kind, writable=False, offset=begin * kind.itemsize)
        except (ValueError, OSError) as exc:
            raise InvalidArgument(f"cannot map the shared gradient: {exc}", Reason.BAD_SIZE) from None


def check_gradient_file(fd: int) -> None:
    """Refuse a gradient file whose owner could make this shard fault as it reads it (shared_memory.unsafe_to_map).

    Checked once per ATTACH: the seals cannot be taken off, so no push checks again.
    """
    problem = unsafe_to_map(fd)
    if problem is not None:
        raise InvalidArgument(
            f"the shared gradient file is refused: {problem}. Make it with memfd_create(MFD_ALLOW_SEALING) and "
            f"seal it with fcntl(F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW) once it has its size, as psgrid's "
            f"client does: a file its owner may shrink would kill this shard (SIGBUS) as it reads it",
            Reason.BAD_VALUE,
        )


# ----- the plane's server end, registered (transports/base.py) ---------------------------------------


def _listen(service: ShardService, config, context: ListenContext) -> Listening | None:
    """The shared-memory plane, where the shard's ``shared_memory`` asks for it and this kernel can seal the
    weights; its offer is the Unix socket, withdrawn once the shard could not put its weights in shared memory.
    A device shard's weights are on its GPU: the CUDA IPC plane (ipc_server.py) serves this host instead."""
    if not config.shared_memory or service.shard.arrays.on_gpu:
        return None
    if not can_share_read_only():
        if available():
            logging.getLogger("psgrid.server").warning(
                "shard %d offers no shared-memory plane: this kernel cannot seal its weights against readers' "
                "writes (F_SEAL_FUTURE_WRITE, Linux 5.1); workers here use TCP",
                config.shard_index,
            )
        return None
    server = ShmDataServer(
        service,
        config.token,
        context.ssl_context,
        handlers=config.threads,
        max_connections=config.tcp_max_connections,
        on_failure=context.on_failure,
    )
    return Listening(server, address=lambda: server.address if service.shard.shares_memory else None)


register_listener("shm", _listen)
