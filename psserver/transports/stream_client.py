"""What every stream data plane's client shares: a pool of connections to one shard, and the round trip.

The TCP plane (tcp_client.py) and the shared-memory plane (shm_client.py) speak the same frames
(stream_frames.py) over different sockets; each adds only how it connects and its operations.
Two connections may be in use at once (a push and the pull that overlaps it).

A connection goes back to the pool only while it is surely in step with the shard
(:func:`in_step_after`): after a reply, and after a refusal the shard answered in a whole frame
on a connection it keeps. A connection that broke, timed out or stopped mid-frame is closed, and
the failure is :class:`Unavailable`: the client retries, choosing the shard's data plane again from
a fresh registration (a restarted shard listens elsewhere).
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

from psgrid.psserver.exceptions import PSError, Unavailable
from psgrid.psserver.protocol import Reason, Status
from psgrid.psserver.transports.stream_frames import hello_request, read_reply

# How much longer than the call's deadline a socket waits: the shard answers a timed-out
# consistency wait itself, just before the deadline.
SOCKET_SLACK_S = 5.0
# Refusals after which a stream shard closes the connection: of the connection itself (a hello, the
# connection limit), and of a frame it could not follow.
CLOSING_STATUSES = frozenset({Status.UNAUTHENTICATED, Status.UNAVAILABLE})
NOT_SET = -1.0  # a connection's limit before the pool sets one (no timeout is negative)


class StreamConnection:
    """One connection of a stream plane; a plane subclasses it to keep what it learnt on it."""

    __slots__ = ("sock", "limit")

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.limit: float | None = NOT_SET  # the socket's timeout as the pool last set it (ConnectionPool.borrow)

    def close(self) -> None:
        self.sock.close()


Conn = TypeVar("Conn", bound=StreamConnection)


def in_step_after(err: PSError, *, sent_payload: bool) -> bool:
    """Whether a connection may serve another call after ``err`` ended this one.

    Only a refusal read whole off the wire (``read_reply``) leaves the connection in step: not the
    client's own objection to a reply (BadReply, with the rest of the frame unread). And not one
    after which the shard closes: refusals of the connection itself, a frame it could not follow
    (``MALFORMED``), and a request it refused before reading its payload (the shard drops the
    payload, then closes; the client cannot tell that refusal from one after the payload was read).
    """
    if not getattr(err, "whole_frame", False) or sent_payload:
        return False
    return err.status not in CLOSING_STATUSES and err.reason != Reason.MALFORMED


def say_hello(sock: socket.socket, token: str, where: str) -> None:
    """Show the job's token on a new connection; a refusal raised as its domain exception."""
    sock.sendall(hello_request(token.encode()))
    read_reply(sock, where)


class ConnectionPool(Generic[Conn]):
    """Idle connections to one shard's stream plane, and the round trip that borrows one.

    Parameters
    ----------
    connect : callable
        ``connect(timeout_s)``: a new, authenticated connection (an OSError if none can be made).
    label : str
        The plane, for messages: ``"data plane"``, ``"shared-memory plane"``.
    where : str
        The shard's address on that plane, for messages.
    """

    def __init__(self, connect: Callable[[float], Conn], label: str, where: str):
        self.connect, self.label, self.where = connect, label, where
        self.idle: list[Conn] = []
        self.lock = threading.Lock()
        self.closed = False

    def take(self, timeout_s: float) -> Conn:
        with self.lock:
            conn = self.idle.pop() if self.idle else None
        return conn or self.connect(timeout_s)

    def give(self, conn: Conn) -> None:
        with self.lock:
            if not self.closed:
                self.idle.append(conn)
                return
        conn.close()  # the plane was closed while the call was in flight

    def borrow(self, timeout_s: float) -> Conn:
        """A pooled connection for one call, its socket's limit ``timeout_s`` (0: none) and the slack.

        The caller gives it back when the call leaves it in step, and closes it otherwise.
        """
        try:
            conn = self.take(timeout_s)
        except OSError as exc:  # ssl.SSLError included
            raise Unavailable(f"cannot connect to the {self.label} at {self.where}: {exc}", Reason.UNREACHABLE) from exc
        limit = timeout_s + SOCKET_SLACK_S if timeout_s else None
        try:
            if limit != conn.limit:  # each settimeout is a system call; a worker's calls mostly keep one deadline
                conn.sock.settimeout(limit)
                conn.limit = limit
        except OSError as exc:
            conn.close()
            raise Unavailable(f"{self.label} connection to {self.where} lost: {exc}", Reason.UNREACHABLE) from exc
        return conn

    def round_trip(self, timeout_s: float, call: Callable[[Conn], object], *, sends_payload: bool = False):
        """``call(conn)`` on a pooled connection, within ``timeout_s`` (0: none) and the slack.

        ``sends_payload``: the request carries a payload the shard may refuse unread.
        """
        conn = self.borrow(timeout_s)
        try:
            result = call(conn)
        except PSError as err:
            if in_step_after(err, sent_payload=sends_payload):
                self.give(conn)
            else:
                conn.close()
            raise
        except OSError as exc:  # ConnectionError, timeouts: never reuse the connection
            conn.close()
            raise Unavailable(f"{self.label} connection to {self.where} lost: {exc}", Reason.UNREACHABLE) from exc
        except BaseException:
            conn.close()
            raise
        self.give(conn)
        return result

    def close(self) -> None:
        with self.lock:
            self.closed = True
            idle, self.idle = self.idle, []
        for conn in idle:
            conn.close()
