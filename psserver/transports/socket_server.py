"""What every stream data plane of a shard shares: accepting, idle connections, a bounded pool, the hello.

The TCP data plane (tcp_server.py) and the shared-memory plane (shm_server.py) speak the same
frames (tcp_frames.py) over different sockets, and differ only in their operations. This base
class owns the rest:

Connections are many and mostly idle, requests few at a time: one thread waits on every idle
connection (``selectors``) and hands a connection whose request has arrived to a bounded pool of
handlers, which serves that request and gives the connection back. So an idle connection costs
a file descriptor, not a thread, and a flood of them costs no threads at all. A new connection
has ``HANDSHAKE_S`` for its TLS handshake and hello, then is closed; past ``max_connections`` a
new one is refused at once (UNAVAILABLE, reason ``too_many_connections``: the client retries).
The loop survives anything one connection does (a failed accept, a thread that cannot start);
if it ever ends while the shard serves, ``on_failure`` is called (the shard's health turns
NOT_SERVING).

What a request means, and whether it is valid, is the service's: a subclass only moves bytes.
"""

from __future__ import annotations

import logging
import math
import queue
import resource
import select
import selectors
import socket
import ssl
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from psgrid.psserver.exceptions import InvalidArgument, Unauthenticated
from psgrid.psserver.protocol import Reason, Refusal, Status
from psgrid.psserver.security import token_matches
from psgrid.psserver.service import ShardService
from psgrid.psserver.transports.tcp_frames import (HANDSHAKE_S, HELLO, MAGIC, MAX_MESSAGE, REPLY, REQUEST, recv_exact,
                                                   recv_struct)

log = logging.getLogger("psgrid.tcp")

MAX_DISCARD = 1 << 30     # most bytes of a refused push read and dropped before closing
DISCARD_IDLE_S = 5.0      # give up dropping a refused payload after this long without data
HEADER_S = 10.0           # a request header that has started must be complete within this
PAYLOAD_IDLE_S = 60.0     # a payload may pause this long between bytes
MAX_WAIT_S = 86400.0      # longest deadline a socket honours (a longer one from the wire is cut to this)
LINGER_S = 1.0            # a handler waits this long for an active connection's next request
# Connections at once: far more than any job's workers, and half of what this process may open.
DEFAULT_MAX_CONNECTIONS = min(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 2)


class Connection:
    """One client connection: its socket, whether it has said its hello, and what its plane keeps for it."""

    __slots__ = ("sock", "raw", "authenticated", "handshaken", "deadline", "state")

    def __init__(self, sock: socket.socket, authenticated: bool, handshaken: bool):
        self.sock = self.raw = sock
        self.authenticated, self.handshaken = authenticated, handshaken
        self.deadline = time.monotonic() + HANDSHAKE_S     # to finish its TLS handshake and hello
        self.state = None


class SocketDataServer:
    """Accepts data-plane connections on ``listener`` and serves their requests from a bounded pool.

    Subclasses implement :meth:`_operation` (every request but the hello) and may override
    :meth:`_accepted` (a new socket: set options, or refuse it) and :meth:`_released` (a
    connection is gone: free what it held).
    """

    name = "data plane"

    def __init__(self, service: ShardService, listener: socket.socket, token: str | None = None,
                 ssl_context: ssl.SSLContext | None = None, *, handlers: int = 128,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, on_failure: Callable[[], None] | None = None):
        self.service, self.token, self.ssl_context = service, token, ssl_context
        self.max_connections, self.on_failure = max_connections, on_failure
        self.listener = listener
        self.listener.setblocking(False)
        self.stopped = threading.Event()
        self.failed = False
        self.connections: set[Connection] = set()
        self.lock = threading.Lock()
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = socket.socketpair()     # tells the loop a connection came back
        self.wake_r.setblocking(False)
        self.returned: queue.SimpleQueue[Connection] = queue.SimpleQueue()
        self.handlers, self.busy = max(1, handlers), 0
        self.pool = ThreadPoolExecutor(max_workers=self.handlers, thread_name_prefix=f"{self.name}-handler")
        self.thread = threading.Thread(target=self._run, name=f"{self.name}-accept", daemon=True)

    def start(self) -> "SocketDataServer":
        self.selector.register(self.listener, selectors.EVENT_READ, "accept")
        self.selector.register(self.wake_r, selectors.EVENT_READ, "wake")
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self._wake()
        if self.thread.is_alive():
            self.thread.join(timeout=5)
        with self.lock:
            connections = list(self.connections)
        for conn in connections:       # a handler blocked on one of them wakes with an error
            _shutdown(conn.raw)
        self.pool.shutdown(wait=True)  # each handler gives back what it holds (pooled buffers) as it ends
        for conn in connections:
            self._close(conn)
        self.listener.close()
        self.selector.close()
        self.wake_r.close()
        self.wake_w.close()

    @property
    def open_connections(self) -> int:
        with self.lock:
            return len(self.connections)

    # ----- what subclasses provide ----------------------------------------------------------------

    def _accepted(self, sock: socket.socket) -> str | None:
        """Prepare a new connection's socket; a text refuses it (the reason, said to the peer)."""
        return None

    def _operation(self, conn: Connection, op: int, dtype: int, worker: int, clock: int, version: int, nbytes: int,
                   timeout: float) -> bool:
        """Serve one request other than the hello; False if the connection must close."""
        self._refuse_unread(conn.sock, InvalidArgument(f"unknown data-plane operation {op}", Reason.MALFORMED), nbytes)
        return False

    def _released(self, conn: Connection) -> None:
        """``conn`` is closed: free what the plane kept for it."""

    def _handshake(self, conn: Connection) -> None:
        """The TLS handshake of a new connection (a client certificate is checked here under mutual TLS)."""
        conn.sock = self.ssl_context.wrap_socket(conn.raw, server_side=True)

    # ----- the loop: accept, wait on idle connections, hand ready ones to the pool --------------

    def _run(self) -> None:
        try:
            while not self.stopped.is_set():
                try:
                    self._turn()
                except Exception:  # noqa: BLE001 - a bad turn must not end the loop: the shard would look alive
                    log.exception("%s loop: one turn failed; going on", self.name)
                    time.sleep(0.05)
        except BaseException:  # noqa: BLE001 - ended: said below, and by the shard's health
            log.exception("%s loop ended", self.name)
        finally:
            if not self.stopped.is_set():
                self.failed = True
                log.error("the %s stopped serving; clients fall back to retrying", self.name)
                if self.on_failure is not None:
                    self.on_failure()

    def _turn(self) -> None:
        for key, _ in self.selector.select(timeout=0.5):
            if key.data == "accept":
                self._accept()
            elif key.data == "wake":
                _drain(self.wake_r)
            else:
                self.selector.unregister(key.fileobj)
                self._dispatch(key.data)
        while True:
            try:
                conn = self.returned.get_nowait()
            except queue.Empty:
                break
            self._watch(conn)
        self._expire_handshakes()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:     # out of file descriptors, say: the others go on being served
                log.warning("%s cannot accept a connection now: %s", self.name, exc)
                time.sleep(0.05)
                return
            sock.setblocking(True)
            refused = self._accepted(sock)
            if refused is not None:
                self._refuse_connection(sock, Status.UNAUTHENTICATED, Reason.NONE, refused)
                continue
            with self.lock:
                full = len(self.connections) >= self.max_connections
                conn = None if full else Connection(sock, authenticated=not self.token,
                                                    handshaken=self.ssl_context is None)
                if conn is not None:
                    self.connections.add(conn)
            if full:
                self._refuse_connection(sock, Status.UNAVAILABLE, Reason.TOO_MANY_CONNECTIONS,
                                        f"this shard serves at most {self.max_connections} data-plane connections "
                                        f"(tcp_max_connections); try again later")
            elif conn.handshaken:
                self._watch(conn)
            else:
                self._dispatch(conn)      # the TLS handshake blocks: a handler does it

    def _watch(self, conn: Connection) -> None:
        if self.stopped.is_set():
            self._close(conn)
            return
        try:
            self.selector.register(conn.sock, selectors.EVENT_READ, conn)
        except (ValueError, OSError):     # closed meanwhile
            self._close(conn)

    def _dispatch(self, conn: Connection) -> None:
        try:
            self.pool.submit(self._serve, conn)
        except RuntimeError as exc:       # no thread can start, or the pool is shutting down
            log.warning("%s cannot serve a connection now: %s", self.name, exc)
            self._close(conn)

    def _expire_handshakes(self) -> None:
        now = time.monotonic()
        with self.lock:
            late = [c for c in self.connections if not c.authenticated and c.deadline < now]
        for conn in late:
            try:
                self.selector.unregister(conn.sock)
            except (KeyError, ValueError):
                continue       # a handler has it: its own timeouts end it
            self._close(conn)

    def _wake(self) -> None:
        try:
            self.wake_w.send(b"x")
        except OSError:
            pass

    def _refuse_connection(self, sock: socket.socket, status: int, reason: int, text: str) -> None:
        """Tell a connection we will not serve why, without reading it (the client reads its reply), and close."""
        message = text.encode()
        try:
            sock.settimeout(0.5)
            sock.sendall(REPLY.pack(MAGIC, status, reason, 0, 0, 0, 0, len(message)) + message)
        except OSError:
            pass
        _shutdown(sock, socket.SHUT_WR)
        sock.close()

    def _close(self, conn: Connection) -> None:
        with self.lock:
            if conn not in self.connections:
                return
            self.connections.discard(conn)
        try:
            self._released(conn)
        except Exception:  # noqa: BLE001 - closing must finish
            log.exception("%s: releasing a connection failed", self.name)
        for sock in {conn.sock, conn.raw}:
            try:
                sock.close()
            except OSError:
                pass

    # ----- one request, in a handler thread -------------------------------------------------------

    def _serve(self, conn: Connection) -> None:
        keep = False
        with self.lock:
            self.busy += 1
        try:
            if not conn.handshaken:
                conn.raw.settimeout(max(0.1, conn.deadline - time.monotonic()))
                self._handshake(conn)
                conn.handshaken = True
                keep = True
            else:
                keep = self._request(conn)
                # A worker's next request follows soon (its pull after its push): while handlers are to
                # spare, wait for it here, as a thread per connection would, instead of paying a hand-off
                # to the selector and back on every request. TLS may also hold decrypted bytes the
                # selector cannot see.
                while keep and not self.stopped.is_set() and self._next_request_soon(conn.sock):
                    keep = self._request(conn)
        except (ConnectionError, OSError, ssl.SSLError):
            pass      # the client went away; nothing half-applied: a push reaches the shard only once complete
        except Exception:  # noqa: BLE001 - one bad connection must not take the shard down
            log.exception("%s connection failed", self.name)
        finally:
            with self.lock:
                self.busy -= 1
        if keep and not self.stopped.is_set():
            self.returned.put(conn)
            self._wake()
        else:
            self._close(conn)

    def _next_request_soon(self, sock) -> bool:
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return True
        with self.lock:
            spare = self.busy <= self.handlers // 2
        if not spare:
            return False
        try:
            return bool(select.select([sock], [], [], LINGER_S)[0])
        except (OSError, ValueError):
            return False

    def _request(self, conn: Connection) -> bool:
        """Read and answer one request; False if the connection must close."""
        sock = conn.sock
        # The header is on its way (the selector saw data): a peer that stalls in it holds a
        # handler for HEADER_S at most.
        sock.settimeout(HEADER_S if conn.authenticated else max(0.1, conn.deadline - time.monotonic()))
        _, op, dtype, worker, clock, version, nbytes, timeout = recv_struct(sock, REQUEST)
        sock.settimeout(PAYLOAD_IDLE_S)
        if op == HELLO:
            conn.authenticated = self._hello(sock, nbytes)
            return conn.authenticated
        if not conn.authenticated:
            self._refuse_unread(sock, Unauthenticated("missing or wrong bearer token"), nbytes)
            return False
        return self._operation(conn, op, dtype, worker, clock, version, nbytes, timeout)

    # ----- replies ------------------------------------------------------------------------------

    def _reply(self, conn, *, status=Status.OK, reason=Reason.NONE, outcome=0, version=0, staleness=0, next_clock=0,
               payload=None) -> None:
        nbytes = 0 if payload is None else memoryview(payload).nbytes
        conn.sendall(REPLY.pack(MAGIC, status, reason, outcome, version, staleness, next_clock, nbytes))
        if payload is not None:
            conn.sendall(payload)

    def _refuse(self, conn, exc: BaseException) -> Refusal:
        refusal = self.service.refuse(exc, f"a {self.name} call")
        self._reply(conn, status=refusal.status, reason=refusal.reason,
                    payload=refusal.message.encode()[:MAX_MESSAGE])
        return refusal

    def _hello(self, conn, nbytes: int) -> bool:
        if nbytes > MAX_MESSAGE:
            raise ConnectionError("oversized hello")
        given = bytearray(nbytes)
        recv_exact(conn, memoryview(given))
        if self.token and not token_matches(bytes(given), self.token):
            self._refuse(conn, Unauthenticated("missing or wrong bearer token"))
            return False
        self._reply(conn)
        return True

    def _refuse_unread(self, conn, exc: BaseException, nbytes: int) -> None:
        """Refuse a request whose payload is still on its way, then read and drop it (bounded).

        Closing a socket with unread data resets the connection, and a reset can destroy the
        refusal before the client reads it: the client would see a broken pipe instead.
        """
        self._refuse(conn, exc)
        conn.settimeout(DISCARD_IDLE_S)
        scratch = bytearray(1 << 16)
        left = min(nbytes, MAX_DISCARD)
        while left > 0:
            n = conn.recv_into(scratch, min(left, len(scratch)))
            if n == 0:
                return
            left -= n


def reply_timeout(timeout: float) -> float | None:
    """How long a socket may wait to send the answer to a request with ``timeout`` (0: no deadline).

    The consistency wait is the service's, which also refuses a deadline that is not a finite
    number; a number from the wire must never make ``settimeout`` itself fail.
    """
    if not timeout or not math.isfinite(timeout) or timeout < 0:
        return None if not timeout else PAYLOAD_IDLE_S
    return min(timeout, MAX_WAIT_S) + PAYLOAD_IDLE_S


def _shutdown(sock: socket.socket, how: int = socket.SHUT_RDWR) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except (BlockingIOError, OSError):
        pass
