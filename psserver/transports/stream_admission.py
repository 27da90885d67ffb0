"""Who a stream plane serves: handshakes, hellos and the bounds on connections, read by the loop.

A stranger never holds a handler. Until a connection is authenticated it is the loop's: its TLS
handshake and its hello (the job's token) are read without blocking, as their bytes come, and must
be complete within ``handshake_s``; a request sent before the hello is refused and what it declared
is read and dropped by the loop too (at most ``DRAIN_STRANGER`` bytes, within the same deadline).
Unauthenticated connections are bounded apart from the authenticated ones: past
``max_handshakes`` a new one closes the oldest, so strangers only ever take each other's places,
while a worker, who sends its hello with its connect, is through within a turn of the loop. Past
``max_connections`` authenticated connections a new one is refused (UNAVAILABLE, reason
``too_many_connections``: the client retries). A shard with neither token nor TLS has nothing to
ask: its connections are authenticated as they come, and ``max_connections`` is its only bound.

:class:`Admission` is the half of stream_server.SocketDataServer that does this; the loop, the
handlers and the replies are the other half.
"""

from __future__ import annotations

import math
import selectors
import socket
import ssl
import time
from collections.abc import Callable

from psgrid.psserver.exceptions import Unauthenticated, Unavailable
from psgrid.psserver.protocol import Reason, Status
from psgrid.psserver.security import token_matches
from psgrid.psserver.transports.stream_frames import HELLO, MAGIC, MAX_MESSAGE, REQUEST, refusal_frame, reply_header

DRAIN_STRANGER = 1 << 20  # most bytes dropped of a request sent before the hello
DRAIN_STEP = 1 << 20  # most bytes the loop drops from one connection per turn (the others go on)
WOULD_BLOCK = (BlockingIOError, ssl.SSLWantReadError, ssl.SSLWantWriteError)


class Connection:
    """One client connection: its socket, how far its handshake is, and what its plane keeps for it."""

    __slots__ = (
        "sock",
        "raw",
        "authenticated",
        "handshaken",
        "deadline",
        "read_by",
        "hello",
        "drain",
        "closed",
        "state",
    )

    def __init__(
        self, sock: socket.socket, raw: socket.socket, authenticated: bool, handshaken: bool, deadline: float = math.inf
    ):
        self.sock, self.raw = sock, raw
        self.authenticated, self.handshaken = authenticated, handshaken
        self.deadline = deadline  # to finish its handshake, or to send what the loop drops
        self.read_by = math.inf  # the current request's payload must have come by then
        self.hello = bytearray()  # the hello's bytes as they come
        self.drain = 0  # bytes of a refused request the loop still reads and drops
        self.closed = False
        self.state = None


class Admission:
    """The loop's part that admits connections (mixed into stream_server.SocketDataServer, whose state it uses).

    A plane whose frames must go back to plain after TLS (descriptors cannot cross it) overrides
    :meth:`_finish_tls`.
    """

    def _admit_at_once(self, sock: socket.socket) -> None:
        """A shard that asks nothing (no token, no TLS): the connection is authenticated as it comes."""
        sock.setblocking(True)
        with self.lock:
            full = self.admitted >= self.max_connections
            if not full:
                conn = Connection(sock, sock, authenticated=True, handshaken=True)
                self.connections.add(conn)
                self.admitted += 1
        if full:
            self._refuse_connection(sock, Status.UNAVAILABLE, Reason.TOO_MANY_CONNECTIONS, self._full_text())
        else:
            self._watch(conn)

    def _greet(self, sock: socket.socket) -> None:
        """A connection that must authenticate: the loop reads its handshake, without blocking, until its deadline."""
        sock.setblocking(False)
        try:
            wrapped = (
                sock
                if self.ssl_context is None
                else self.ssl_context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False)
            )
        except (OSError, ValueError):
            sock.close()
            return
        conn = Connection(
            wrapped,
            sock,
            authenticated=False,
            handshaken=self.ssl_context is None,
            deadline=time.monotonic() + self.handshake_s,
        )
        with self.lock:
            self.connections.add(conn)
            self.waiting[conn] = None
            oldest = next(iter(self.waiting)) if len(self.waiting) > self.max_handshakes else None
        if oldest is not None:
            self._drop(oldest)  # a stranger's, almost surely: a worker says its hello at once
        try:
            self.selector.register(conn.sock, selectors.EVENT_READ, conn)
        except (ValueError, OSError):
            self._close(conn)
            return
        self._advance(conn)  # a worker's hello is often here already

    def _full_text(self) -> str:
        return (
            f"this shard serves at most {self.max_connections} data-plane connections (tcp_max_connections); "
            f"try again later"
        )

    def _refuse_connection(self, sock: socket.socket, status: int, reason: int, text: str) -> None:
        """Tell a connection we will not serve why, without reading it (the client reads its reply), and close."""
        message = text.encode()
        try:
            sock.settimeout(0.5)
            sock.sendall(reply_header(status, reason, nbytes=len(message)) + message)
        except OSError:
            pass
        shutdown_quietly(sock, socket.SHUT_WR)
        sock.close()

    def _advance(self, conn: Connection) -> None:
        try:
            keep = self._drop_some(conn) if conn.drain else self._handshake(conn)
        except (OSError, ssl.SSLError, ValueError):  # the peer went, broke TLS, or sent no frame of ours
            keep = False
        if not keep:
            self._drop(conn)

    def _handshake(self, conn: Connection) -> bool:
        """Read what has come of the TLS handshake and the hello; False if the connection must close."""
        if not conn.handshaken:
            if not self._finish_tls(conn):
                return True
            conn.handshaken = True
            if not self.token:
                return self._authenticate(conn, hello=False)  # the certificate was what it had to show
        sock = conn.sock
        hello = conn.hello
        need = REQUEST.size
        while True:
            if len(hello) >= REQUEST.size:
                magic, op, _, _, _, _, nbytes, _ = REQUEST.unpack_from(hello)
                if magic != MAGIC:
                    return False
                if op != HELLO:  # a request before the hello: refused, what it declared dropped here
                    self._send_now(sock, self._refusal_frame(Unauthenticated("missing or wrong bearer token")))
                    conn.drain = min(nbytes, DRAIN_STRANGER)
                    return bool(conn.drain) and self._drop_some(conn)
                if nbytes > MAX_MESSAGE:
                    return False
                need = REQUEST.size + nbytes
                if len(hello) == need:
                    break
            try:
                data = sock.recv(need - len(hello))
            except WOULD_BLOCK:
                return True
            if not data:
                return False
            hello += data
        if not token_matches(bytes(hello[REQUEST.size :]), self.token):
            self._send_now(sock, self._refusal_frame(Unauthenticated("missing or wrong bearer token")))
            return False
        return self._authenticate(conn, hello=True)

    def _finish_tls(self, conn: Connection) -> bool:
        """Advance the TLS handshake as its bytes come; True once it is done."""
        return self._tls_step(conn, conn.sock.do_handshake)

    def _tls_step(self, conn: Connection, step: Callable[[], object]) -> bool:
        """Run one TLS step (a handshake, a close) without blocking; False while it waits for the peer."""
        try:
            step()
        except ssl.SSLWantReadError:
            return False
        except ssl.SSLWantWriteError:
            self.selector.modify(conn.sock, selectors.EVENT_READ | selectors.EVENT_WRITE, conn)
            return False
        if self.selector.get_key(conn.sock).events != selectors.EVENT_READ:
            self.selector.modify(conn.sock, selectors.EVENT_READ, conn)
        return True

    def _authenticate(self, conn: Connection, hello: bool) -> bool:
        """The connection showed what it had to: it is a worker's now, if there is room for one more."""
        with self.lock:
            self.waiting.pop(conn, None)
            full = self.admitted >= self.max_connections
            if not full:
                conn.authenticated = True
                self.admitted += 1
        if full:
            self._send_now(conn.sock, self._refusal_frame(Unavailable(self._full_text(), Reason.TOO_MANY_CONNECTIONS)))
            return False
        if hello and not self._send_now(conn.sock, reply_header()):
            return False
        conn.hello = bytearray()
        conn.sock.setblocking(True)
        if isinstance(conn.sock, ssl.SSLSocket) and conn.sock.pending():  # a request the selector cannot see
            self.selector.unregister(conn.sock)
            self._dispatch(conn)
        return True

    def _drop_some(self, conn: Connection) -> bool:
        """Read and drop some of a refused request's payload; False once it is all read (then close)."""
        for _ in range(DRAIN_STEP // len(self.scratch)):
            try:
                n = conn.sock.recv_into(self.scratch, min(conn.drain, len(self.scratch)))
            except WOULD_BLOCK:
                return True
            if n == 0:
                return False
            conn.drain -= n
            if not conn.drain:
                return False
        return True

    def _send_now(self, sock, frame: bytes) -> bool:
        """Send a short frame from the loop without waiting; False if it did not all go at once."""
        try:
            return sock.send(frame) == len(frame)
        except (OSError, ssl.SSLError):
            return False

    def _refusal_frame(self, exc: BaseException) -> bytes:
        refusal = self.service.refuse(exc, f"a {self.name} handshake")
        return refusal_frame(refusal.status, refusal.reason, refusal.message.encode())


def shutdown_quietly(sock: socket.socket, how: int = socket.SHUT_RDWR) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass
