"""Processes of this host and user meeting on an abstract Unix socket, and handing each other file descriptors.

The one piece of machinery under the shared-memory plane (shm_server.py, shm_client.py) and a host's
aggregation (worker/aggregate*.py): what crosses it is theirs, how it crosses is here.

* An abstract socket (Linux's ``"\\0"`` namespace, written ``"@name"`` in an address) has no file to
  leave behind whatever ends the process, and is reachable only from this network namespace: a
  worker on another host cannot connect, and falls back to its network plane.
* Anyone in the namespace can connect to an abstract name, so each end asks the kernel who the
  other is (``SO_PEERCRED``, as it was at ``connect``) and deals only with this user or root.
* Memory crosses as a descriptor sent with a message (``SCM_RIGHTS``); a receiver takes at most the
  descriptors it expects, so a peer cannot fill its descriptor table.
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Sequence

ABSTRACT = "@"  # how an address names an abstract socket: "@name"
PEERCRED = struct.Struct("3i")  # pid, uid, gid


def abstract_address(name: str) -> str:
    """The address of the abstract socket ``name``, as planes offer it and :func:`unix_connection` takes it."""
    return ABSTRACT + name


def sockaddr(address: str) -> str:
    """What ``bind`` and ``connect`` take for ``address``: ``"@name"`` is ``"\\0name"``, a path is itself."""
    return "\0" + address[len(ABSTRACT) :] if address.startswith(ABSTRACT) else address


def abstract_listener(name: str, backlog: int) -> socket.socket:
    """A stream socket listening on the abstract socket ``name`` (OSError when the name is taken)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(sockaddr(abstract_address(name)))
        listener.listen(backlog)
    except BaseException:
        listener.close()
        raise
    return listener


def unix_connection(address: str, timeout: float) -> socket.socket:
    """A stream socket connected to ``address`` (``"@name"``: abstract; else a path), with ``timeout`` set."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        sock.connect(sockaddr(address))
    except BaseException:
        sock.close()
        raise
    return sock


def peer_uid(sock: socket.socket) -> int:
    """The user the peer of a connected Unix socket ran as when it connected (or listened), as the kernel says."""
    _, uid, _ = PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size))
    return uid


def peer_refusal(sock: socket.socket, what: str) -> str | None:
    """None when the peer of ``sock`` is this user or root; else why it may not use ``what`` (who may)."""
    if peer_uid(sock) in (os.geteuid(), 0):
        return None
    return f"{what} is for processes of user {os.geteuid()} only"


def send_with_fds(sock: socket.socket, data: bytes, fds: Sequence[int]) -> None:
    """Send ``data`` with descriptors ``fds`` (the receiver gets copies; the caller still owns its own)."""
    socket.send_fds(sock, [data], list(fds))


def receive_with_fds(sock: socket.socket, nbytes: int, most: int) -> tuple[bytes, list[int]]:
    """Up to ``nbytes`` and the descriptors that came with them, at most ``most`` (any more are closed).

    The caller owns (and closes) the descriptors returned; ``b""`` means the peer closed.
    """
    data, fds, _, _ = socket.recv_fds(sock, nbytes, most)
    for fd in fds[most:]:
        os.close(fd)
    return data, fds[:most]


def receive_one_fd(sock: socket.socket, nbytes: int) -> int | None:
    """The one descriptor sent with the next ``nbytes`` (the caller closes it); None when none came."""
    _, fds = receive_with_fds(sock, nbytes, 1)
    return fds[0] if fds else None
