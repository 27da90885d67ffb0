"""The TCP data plane's frames, shared by both ends: a fixed header, then raw little-endian payload.

A request is ``REQUEST`` (magic, op, dtype, worker, clock, version, payload bytes, timeout)
and, for a push or a hello, the payload. A reply is ``REPLY`` (magic, status, reason,
outcome, version, staleness, next_clock, payload bytes) and the payload: a pull's weights,
or the text of a refusal. Status and reason numbers are those of protocol.py.
"""

from __future__ import annotations

import socket
import struct
import time

MAGIC = b"PST2"
HELLO, PULL, PUSH = 1, 2, 3
# The shared-memory plane (shm_server.py) speaks these frames over a Unix socket, with three more
# operations that hand memory across by file descriptor; there a PULL's reply carries the index of
# the buffer to read in its ``staleness`` field, and a PUSH carries no payload (it is in shared memory).
OPEN, MAP, ATTACH = 4, 5, 6
# On that plane an ATTACH's and a PUSH's dtype byte also names which of the client's two gradient
# files it means: wire dtype in the low four bits, the file's index in the high four.
DTYPE_BITS = 0x0F
FD_BYTE = b"F"       # the one byte that carries a file descriptor (SCM_RIGHTS) after a header
REQUEST = struct.Struct("<4sBBqqQQd")      # magic, op, dtype, worker_id, clock, version, nbytes, timeout_s
REPLY = struct.Struct("<4sBBBQqqQ")        # magic, status, reason, outcome, version, staleness, next_clock, nbytes
MAX_MESSAGE = 1 << 16                      # longest refusal text or token
HANDSHAKE_S = 3.0                          # time a new connection has for its TLS handshake and hello


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
    recv_exact(sock, memoryview(buf), deadline)
    fields = layout.unpack(buf)
    if fields[0] != MAGIC:
        raise ConnectionError("peer does not speak the psgrid TCP data plane")
    return fields


def read_reply(sock: socket.socket, where: str) -> tuple:
    """A reply's (outcome, version, staleness, next_clock, payload bytes); a refusal raised as its domain exception."""
    from psgrid.psserver.exceptions import error_from_wire
    from psgrid.psserver.protocol import Reason, Status

    _, status, reason, outcome, version, staleness, next_clock, nbytes = recv_struct(sock, REPLY)
    if status != Status.OK:
        text = bytearray(min(nbytes, MAX_MESSAGE))
        recv_exact(sock, memoryview(text))
        raise error_from_wire(status, Reason.from_code(reason), f"{where}: {text.decode(errors='replace')}")
    return outcome, version, staleness, next_clock, nbytes
