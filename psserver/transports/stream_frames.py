"""The stream planes' frames, shared by both ends: a fixed header, then raw little-endian payload.

A request is ``REQUEST`` (magic, op, dtype, worker, clock, version, payload bytes, timeout)
and, for a push or a hello, the payload. A reply is ``REPLY`` (magic, status, reason,
outcome, version, staleness, next_clock, payload bytes) and the payload: a pull's weights,
or the text of a refusal. Status and reason numbers are those of protocol.py.

The shared-memory plane (shm_server.py, shm_client.py) speaks the same frames over a Unix socket,
with three more operations that hand memory across by file descriptor, and gives some fields
other meanings. They are named here, once, by the constructors and views below: every other
module builds and reads frames through them, so the bytes on the wire (a contract other-language
clients rely on: docs/wire.md spells every frame, and tests/test_wire_doc.py checks its vectors
against these constructors) are spelled in one place.

========  =================================================  ==================================
op        request                                            reply
========  =================================================  ==================================
OPEN      (nothing)                                          ``version``: the connection's slot
                                                             in the marks table; then its fd
MAP       ``clock``: the ring buffer's index                 ``version``: the buffer's bytes;
                                                             then its fd
ATTACH    dtype byte (below); ``nbytes``: the file's size;   (nothing)
          then the gradient file's fd
PULL      as on TCP (no payload comes back)                  ``staleness``: the index of the
                                                             buffer that holds ``version``
PUSH      dtype byte (below); no payload (it is in the file) as on TCP
========  =================================================  ==================================

The dtype byte of an ATTACH or a shared PUSH carries the wire dtype in its low four bits and
which of the client's two gradient files it means in its high four.

The CUDA IPC plane (ipc_server.py, ipc_client.py), which serves a shard whose weights are on a
GPU, speaks the shared-memory plane's frames on an abstract Unix socket of its own, with the same
checks. It hands GPU memory across as a CUDA IPC handle of 64 bytes (``cudaIpcMemHandle_t``) sent
as the reply's payload (``nbytes`` 64), where the shared-memory plane sends a descriptor; no
request of this plane carries a payload or a descriptor (one with ``nbytes`` set is refused as
``malformed`` and its connection closed):

========  =================================================  ==================================
op        request                                            reply
========  =================================================  ==================================
OPEN      as on shared memory                                as on shared memory: the marks
                                                             table (still shared memory) by fd
MAP       ``clock``: the ring buffer's index                 ``version``: the buffer's bytes;
                                                             payload: its IPC handle
ATTACH    dtype byte: float32 and gradient slot 0 or 1;      ``version``: the slot's bytes;
          ``nbytes`` 0, no fd                                payload: the slot's IPC handle
PULL      as on shared memory                                as on shared memory
PUSH      dtype byte: which slot holds the gradient          as on TCP
========  =================================================  ==================================

An IPC ATTACH asks the shard to allocate the slot on its GPU (once per connection and slot; the
slot is freed when the connection closes), so its dtype byte names float32 and the slot (0 or 1)
as a shared ATTACH names a file, and a PUSH's dtype byte names the slot the same way.

The marks table (the shared-memory plane's, written by the shard's weight ring and by readers)
is a file of little-endian int64, one per reader slot: the index of the buffer the shard handed
that slot, or :data:`NO_MARK` or :data:`REVOKED`.
"""

from __future__ import annotations

import socket
import struct
import time
from typing import NamedTuple

from psgrid.psserver.exceptions import error_from_wire

# The marks table's layout and values are the contract's (protocol.py): the shard's weight ring writes them too.
from psgrid.psserver.protocol import MARK_BYTES, NO_MARK, REVOKED, Reason, Status  # noqa: F401

MAGIC = b"PST2"
HELLO, PULL, PUSH = 1, 2, 3
OPEN, MAP, ATTACH = 4, 5, 6  # the shared-memory plane's own operations
DTYPE_BITS = 0x0F  # the dtype byte's wire dtype; the bits above name the gradient file
FILE_SHIFT = 4
FD_BYTE = b"F"  # the one byte that carries a file descriptor (SCM_RIGHTS) after a header
REQUEST = struct.Struct("<4sBBqqQQd")  # magic, op, dtype, worker_id, clock, version, nbytes, timeout_s
REPLY = struct.Struct("<4sBBBQqqQ")  # magic, status, reason, outcome, version, staleness, next_clock, nbytes
MAX_MESSAGE = 1 << 16  # longest refusal text or token
HANDSHAKE_S = 3.0  # time a new connection has for its TLS handshake and hello

# A header's fields as its named view: the layout fixed their number, so NamedTuple's check is skipped
# (this is on every request's path).
_named = tuple.__new__


# ----- requests ----------------------------------------------------------------------------------


def hello_request(token: bytes) -> bytes:
    """The hello that shows the job's token, with the token."""
    return REQUEST.pack(MAGIC, HELLO, 0, 0, 0, 0, len(token), 0.0) + token


def pull_request(dtype: int, worker: int, clock: int, timeout_s: float) -> bytes:
    return REQUEST.pack(MAGIC, PULL, dtype, worker, clock, 0, 0, timeout_s)


def push_request(dtype: int, worker: int, clock: int, version: int, nbytes: int, timeout_s: float) -> bytes:
    """A push's header; on TCP its ``nbytes`` of payload follow, on shared memory none (``dtype_byte``)."""
    return REQUEST.pack(MAGIC, PUSH, dtype, worker, clock, version, nbytes, timeout_s)


def open_request() -> bytes:
    return REQUEST.pack(MAGIC, OPEN, 0, 0, 0, 0, 0, 0.0)


def map_request(buffer_index: int) -> bytes:
    return REQUEST.pack(MAGIC, MAP, 0, 0, buffer_index, 0, 0, 0.0)


def attach_request(dtype_byte: int, file_bytes: int) -> bytes:
    """An ATTACH's header; the file's descriptor follows it (``FD_BYTE``)."""
    return REQUEST.pack(MAGIC, ATTACH, dtype_byte, 0, 0, 0, file_bytes, 0.0)


def dtype_byte(wire_dtype: int, file_index: int) -> int:
    """The dtype byte that names one of a client's gradient files: its wire dtype and its index."""
    return wire_dtype | file_index << FILE_SHIFT


class Request(NamedTuple):
    """A request header, as the shard reads it; the shared-memory plane's fields named."""

    magic: bytes
    op: int
    dtype: int
    worker: int
    clock: int
    version: int
    nbytes: int
    timeout: float

    @property
    def buffer_index(self) -> int:
        """MAP: which ring buffer."""
        return self.clock

    @property
    def wire_dtype(self) -> int:
        """ATTACH and a shared PUSH: the gradient file's wire dtype."""
        return self.dtype & DTYPE_BITS

    @property
    def file_index(self) -> int:
        """ATTACH and a shared PUSH: which of the client's gradient files."""
        return self.dtype >> FILE_SHIFT


def read_request(sock: socket.socket, deadline: float | None = None) -> Request:
    return _named(Request, recv_struct(sock, REQUEST, deadline))


# ----- replies -----------------------------------------------------------------------------------


def reply_header(
    status: int = 0,
    reason: int = 0,
    outcome: int = 0,
    version: int = 0,
    staleness: int = 0,
    next_clock: int = 0,
    nbytes: int = 0,
) -> bytes:
    return REPLY.pack(MAGIC, status, reason, outcome, version, staleness, next_clock, nbytes)


def refusal_frame(status: int, reason: int, text: bytes) -> bytes:
    text = text[:MAX_MESSAGE]
    return REPLY.pack(MAGIC, status, reason, 0, 0, 0, 0, len(text)) + text


def open_reply(slot: int) -> bytes:
    """OPEN's answer; the marks table's descriptor follows it."""
    return reply_header(version=slot)


def map_reply(buffer_bytes: int) -> bytes:
    """MAP's answer; the buffer's descriptor follows it."""
    return reply_header(version=buffer_bytes)


def shared_pull_reply(version: int, buffer_index: int) -> bytes:
    return reply_header(version=version, staleness=buffer_index)


class Reply(NamedTuple):
    """A reply header that said OK, as the client reads it; the shared-memory plane's fields named."""

    magic: bytes
    status: int
    reason: int
    outcome: int
    version: int
    staleness: int
    next_clock: int
    nbytes: int

    @property
    def slot(self) -> int:
        """OPEN: this connection's slot in the marks table."""
        return self.version

    @property
    def buffer_bytes(self) -> int:
        """MAP: the size of the buffer whose descriptor (or, on the CUDA IPC plane, handle) follows;
        an IPC ATTACH: the size of the gradient slot whose handle follows."""
        return self.version

    @property
    def buffer_index(self) -> int:
        """A shared PULL: the ring buffer that holds ``version``."""
        return self.staleness


# ----- reading ------------------------------------------------------------------------------------


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``; ConnectionError if the peer closes first.

    With ``deadline`` (``time.monotonic()``), TimeoutError once it has passed with bytes still to
    come: the socket's own timeout bounds each wait, this bounds a peer that trickles them.
    """
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed the connection")
        view = view[n:]
        if deadline is not None and view.nbytes and time.monotonic() > deadline:
            raise TimeoutError("peer too slow: the read's deadline passed")


def recv_struct(sock: socket.socket, layout: struct.Struct, deadline: float | None = None) -> tuple:
    buf = bytearray(layout.size)
    # A header nearly always comes whole: one read, and the general loop only for the rest of one that did not.
    got = sock.recv_into(buf)
    if got < layout.size:
        if got == 0:
            raise ConnectionError("peer closed the connection")
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError("peer too slow: the read's deadline passed")
        recv_exact(sock, memoryview(buf)[got:], deadline)
    fields = layout.unpack(buf)
    if fields[0] != MAGIC:
        raise ConnectionError("peer does not speak the psgrid TCP data plane")
    return fields


def read_reply(sock: socket.socket, where: str) -> Reply:
    """A reply's header; a refusal raised as its domain exception.

    The exception's ``whole_frame`` says whether all of the refusal was read, so that the
    connection is still in step (stream_client.in_step_after). Its names are imported with the
    module, not here: an import in a function costs microseconds on every reply.
    """
    reply = _named(Reply, recv_struct(sock, REPLY))
    if reply.status != Status.OK:
        text = bytearray(min(reply.nbytes, MAX_MESSAGE))
        recv_exact(sock, memoryview(text))
        err = error_from_wire(reply.status, Reason.from_code(reply.reason), f"{where}: {text.decode(errors='replace')}")
        err.whole_frame = len(text) == reply.nbytes
        raise err
    return reply
