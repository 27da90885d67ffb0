"""What every stream data plane of a shard shares: accepting, the handshake, idle connections, a bounded pool.

The TCP data plane (tcp_server.py) and the shared-memory plane (shm_server.py) speak the same
frames (stream_frames.py) over different sockets, and differ only in their operations. This base
class owns the rest:

Connections are many and mostly idle, requests few at a time: one thread (the loop) waits on every
idle connection (``selectors``) and hands a connection whose request has arrived to a bounded pool
of handlers, which serves that request and gives the connection back. So an idle connection costs
a file descriptor, not a thread, and a flood of them costs no threads at all.

Who is served, and how many at once (the handshake, the hello, the bounds on connections), is
stream_admission.py's, the loop's other half.

An authenticated connection's reads have deadlines: a request header ``HEADER_S`` once it has
begun (the loop holds it, without a handler, until it is whole: :meth:`SocketDataServer._when_whole`),
a payload ``PAYLOAD_GRACE_S`` plus a second per ``MIN_RATE`` bytes, so a trickle is cut. A
refused request's payload (a push the shard will not take) is read and dropped by the loop, not a
handler, up to a bound the plane sets and at the same minimum rate, before the connection closes.

The loop survives anything one connection does (a failed accept, a thread that cannot start);
if it ever ends while the shard serves, ``on_failure`` is called (the shard's health turns
NOT_SERVING).

What a request means, and whether it is valid, is the service's: a subclass only moves bytes.
How a refusal is answered, and the wire's "timeout 0 means none", are here once
(:meth:`SocketDataServer._answer`, :func:`wait_timeout`).
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
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from psgrid.psserver.exceptions import InvalidArgument, PSError, Unauthenticated
from psgrid.psserver.protocol import Reason, Refusal, Status
from psgrid.psserver.security import token_matches
from psgrid.psserver.service import ShardService
from psgrid.psserver.transports.stream_admission import Admission, Connection, shutdown_quietly
from psgrid.psserver.transports.stream_frames import (
    HANDSHAKE_S,
    HELLO,
    MAX_MESSAGE,
    REQUEST,
    Request,
    read_request,
    recv_exact,
    reply_header,
)

log = logging.getLogger("psgrid.tcp")

__all__ = ["Connection", "SocketDataServer", "DEFAULT_MAX_CONNECTIONS", "reply_timeout", "wait_timeout"]

MAX_HANDSHAKES = 256  # unauthenticated connections at once; one more closes the oldest
ACCEPT_BATCH = 64  # connections accepted per turn of the loop: handshakes under way are read in between
HEADER_S = 10.0  # a request header that has started must be complete within this
PAYLOAD_GRACE_S = 10.0  # a payload has this long, plus a second per MIN_RATE bytes ...
MIN_RATE = 1 << 20  # ... so it must come at 1 MiB/s on average at least, or be cut
PAYLOAD_IDLE_S = 60.0  # longest pause between a payload's bytes (within its deadline)
DRAIN_GRACE_S = 2.0  # a refused payload is dropped within this, plus a second per MIN_RATE bytes
MAX_WAIT_S = 86400.0  # longest deadline a socket honours (a longer one from the wire is cut to this)
LINGER_S = 1.0  # a handler waits this long for an active connection's next request
PARTIAL_POLL_S = 0.02  # how often the loop looks again at headers begun and not whole
# Connections at once: far more than any job's workers, and half of what this process may open.
DEFAULT_MAX_CONNECTIONS = min(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 2)


class SocketDataServer(Admission):
    """Accepts data-plane connections on ``listener`` and serves their requests from a bounded pool.

    Subclasses implement :meth:`_operation` (every request but the hello) and may override
    :meth:`_accepted` (a new socket: set options, or refuse it) and :meth:`_released` (a
    connection is gone: free what it held).
    """

    name = "data plane"

    def __init__(
        self,
        service: ShardService,
        listener: socket.socket,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        *,
        handlers: int = 128,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        handshake_s: float = HANDSHAKE_S,
        max_handshakes: int | None = None,
        on_failure: Callable[[], None] | None = None,
    ):
        self.service, self.token, self.ssl_context = service, token, ssl_context
        self.max_connections, self.on_failure = max_connections, on_failure
        self.handshake_s = handshake_s
        self.max_handshakes = max(1, MAX_HANDSHAKES if max_handshakes is None else max_handshakes)
        self.listener = listener
        self.listener.setblocking(False)
        self.stopped = threading.Event()
        self.failed = False
        self.connections: set[Connection] = set()
        self.waiting: dict[Connection, None] = {}  # unauthenticated, oldest first (the loop's)
        self.draining: set[Connection] = set()  # authenticated, their refused payload dropped (the loop's)
        self.partial: dict[Connection, None] = {}  # authenticated, a request header begun and not whole (the loop's)
        self.admitted = 0  # authenticated connections
        self.lock = threading.Lock()
        self.selector = selectors.DefaultSelector()
        self.scratch = bytearray(1 << 16)  # where the loop drops bytes
        self.wake_r, self.wake_w = socket.socketpair()  # tells the loop a connection came back
        self.wake_r.setblocking(False)
        self.returned: queue.SimpleQueue[Connection] = queue.SimpleQueue()
        self.handlers, self.busy = max(1, handlers), 0
        self.pool = ThreadPoolExecutor(max_workers=self.handlers, thread_name_prefix=f"{self.name}-handler")
        self.thread = threading.Thread(target=self._run, name=f"{self.name}-accept", daemon=True)

    def start(self) -> SocketDataServer:
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
        for conn in connections:  # a handler blocked on one of them wakes with an error
            shutdown_quietly(conn.raw)
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

    def _operation(self, conn: Connection, request: Request) -> bool:
        """Serve one request other than the hello; False if the connection must close."""
        self._refuse_unread(
            conn,
            InvalidArgument(f"unknown data-plane operation {request.op}", Reason.MALFORMED),
            request.nbytes,
            MAX_MESSAGE,
        )
        return False

    def _released(self, conn: Connection) -> None:
        """``conn`` is closed: free what the plane kept for it."""

    # ----- the loop: accept, handshakes, idle connections, handing ready ones to the pool ---------

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
        accept = False
        for key, _ in self.selector.select(timeout=PARTIAL_POLL_S if self.partial else 0.5):
            if key.data == "accept":
                accept = True  # last: the handshakes already under way are read first
            elif key.data == "wake":
                _drain(self.wake_r)
            elif not key.data.closed:
                conn = key.data
                if conn.authenticated and not conn.drain:
                    self.selector.unregister(conn.sock)
                    self._when_whole(conn)
                else:
                    self._advance(conn)
        for conn in list(self.partial):
            self._when_whole(conn)
        while True:
            try:
                conn = self.returned.get_nowait()
            except queue.Empty:
                break
            self._watch(conn)
        self._expire()
        if accept:
            self._accept()

    def _accept(self) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, _ = self.listener.accept()
            except BlockingIOError:
                return
            except OSError as exc:  # out of file descriptors, say: the others go on being served
                log.warning("%s cannot accept a connection now: %s", self.name, exc)
                time.sleep(0.05)
                return
            try:
                refused = self._accepted(sock)
            except Exception:
                sock.close()
                raise
            if refused is not None:
                self._refuse_connection(sock, Status.UNAUTHENTICATED, Reason.NONE, refused)
            elif self.token or self.ssl_context is not None:
                self._greet(sock)
            else:
                self._admit_at_once(sock)

    def _watch(self, conn: Connection) -> None:
        if self.stopped.is_set():
            self._close(conn)
            return
        if conn.drain:
            conn.sock.setblocking(False)
            with self.lock:
                self.draining.add(conn)
        try:
            self.selector.register(conn.sock, selectors.EVENT_READ, conn)
        except (ValueError, OSError):  # closed meanwhile
            self._close(conn)

    def _dispatch(self, conn: Connection) -> None:
        try:
            self.pool.submit(self._serve, conn)
        except RuntimeError as exc:  # no thread can start, or the pool is shutting down
            log.warning("%s cannot serve a connection now: %s", self.name, exc)
            self._close(conn)

    def _when_whole(self, conn: Connection) -> None:
        """Hand ``conn`` to a handler once its request's header is all here; until then the loop keeps it.

        A handler that read a header as its bytes came was held by a token holder trickling them (for
        HEADER_S each): twice ``threads`` such connections stalled every worker. So a header begun is
        the loop's, as a hello is, until whole or HEADER_S old (then the connection is cut). TLS hides
        how much of a header came: a handler reads it, HEADER_S bounding each.
        """
        state = _header_state(conn.sock)
        if state is _IDLE:  # woken with nothing to read (a peer that half-sent nothing yet)
            self.partial.pop(conn, None)
            self._watch(conn)
        elif state is _WHOLE or state is _GONE:  # a handler reads it, or meets the closed connection
            self.partial.pop(conn, None)
            self._dispatch(conn)
        elif conn not in self.partial:
            conn.deadline = time.monotonic() + HEADER_S
            self.partial[conn] = None

    def _expire(self) -> None:
        now = time.monotonic()
        with self.lock:
            late = []
            for conn in self.waiting:  # oldest first, and so soonest deadline first
                if conn.deadline > now:
                    break
                late.append(conn)
            late += [conn for conn in self.draining if conn.deadline <= now]
            late += [conn for conn in self.partial if conn.deadline <= now]
        for conn in late:
            self._drop(conn)

    def _drop(self, conn: Connection) -> None:
        """Close a connection the loop watches (the loop's thread only)."""
        try:
            self.selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        self._close(conn)

    def _wake(self) -> None:
        try:
            self.wake_w.send(b"x")
        except OSError:
            pass

    def _close(self, conn: Connection) -> None:
        with self.lock:
            if conn.closed:
                return
            conn.closed = True
            self.connections.discard(conn)
            self.waiting.pop(conn, None)
            self.draining.discard(conn)
            self.partial.pop(conn, None)
            if conn.authenticated:
                self.admitted -= 1
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
            keep = self._request(conn)
            # A worker's next request follows soon (its pull after its push): while handlers are to
            # spare, wait for it here, as a thread per connection would, instead of paying a hand-off
            # to the selector and back on every request. TLS may also hold decrypted bytes the
            # selector cannot see.
            while keep and not conn.drain and not self.stopped.is_set() and self._next_request_soon(conn):
                keep = self._request(conn)
        except (ConnectionError, OSError, ssl.SSLError):
            pass  # the client went away; nothing half-applied: a push reaches the shard only once complete
        except Exception:  # noqa: BLE001 - one bad connection must not take the shard down
            log.exception("%s connection failed", self.name)
        finally:
            with self.lock:
                self.busy -= 1
        if (keep or conn.drain) and not self.stopped.is_set():
            self.returned.put(conn)  # idle again, or a refused payload for the loop to drop
            self._wake()
        else:
            self._close(conn)

    def _next_request_soon(self, conn: Connection) -> bool:
        """Whether this handler serves ``conn``'s next request too: one whose header is whole within LINGER_S."""
        sock = conn.sock
        if isinstance(sock, ssl.SSLSocket) and sock.pending():
            return True
        with self.lock:
            spare = self.busy <= self.handlers // 2
        if not spare:
            return False
        try:
            ready = bool(select.select([sock], [], [], LINGER_S)[0])
        except (OSError, ValueError):
            return False
        return ready and _header_state(sock) is not _PARTIAL  # a header begun goes back to the loop

    def _request(self, conn: Connection) -> bool:
        """Read and answer one request; False if the connection must close."""
        sock = conn.sock
        # The header is on its way (the selector saw data): a peer that stalls or trickles in it
        # holds a handler for HEADER_S at most.
        sock.settimeout(HEADER_S)
        request = read_request(sock, time.monotonic() + HEADER_S)
        # A payload must come at MIN_RATE on average, after a grace: a trickle is cut, a stall too.
        budget = PAYLOAD_GRACE_S + request.nbytes / MIN_RATE
        conn.read_by = time.monotonic() + budget
        sock.settimeout(min(PAYLOAD_IDLE_S, budget))
        if request.op == HELLO:
            return self._hello(conn, request.nbytes)
        return self._operation(conn, request)

    # ----- replies ------------------------------------------------------------------------------

    def _reply(
        self,
        conn,
        *,
        status=Status.OK,
        reason=Reason.NONE,
        outcome=0,
        version=0,
        staleness=0,
        next_clock=0,
        payload=None,
    ) -> None:
        nbytes = 0 if payload is None else memoryview(payload).nbytes
        conn.sendall(reply_header(status, reason, outcome, version, staleness, next_clock, nbytes))
        if payload is not None:
            conn.sendall(payload)

    def _reply_push(self, conn, result) -> None:
        """A push's answer: its outcome, the shard's version, the staleness and the worker's next clock."""
        self._reply(
            conn,
            outcome=result.outcome,
            version=result.version,
            staleness=result.staleness,
            next_clock=result.next_clock,
        )

    def _refuse(self, conn, exc: BaseException) -> Refusal:
        refusal = self.service.refuse(exc, f"a {self.name} call")
        self._reply(conn, status=refusal.status, reason=refusal.reason, payload=refusal.message.encode()[:MAX_MESSAGE])
        return refusal

    def _answer(self, sock, serve: Callable, *args):
        """``serve(*args)``, which replies on ``sock``; a refusal, or a bug of ours (INTERNAL), answered instead.

        Returns what ``serve`` returned (None if it was refused). A connection that broke while
        answering is raised: there is nobody to answer.
        """
        try:
            return serve(*args)
        except PSError as exc:  # first: a WaitTimeout is also an OSError
            self._refuse(sock, exc)
        except OSError:
            raise
        except Exception as exc:  # noqa: BLE001 - a bug of ours: answered INTERNAL, never silence
            self._refuse(sock, exc)

    def _hello(self, conn: Connection, nbytes: int) -> bool:
        """A hello on a connection already authenticated (a client that has a token, of a shard that asks none)."""
        sock = conn.sock
        if nbytes > MAX_MESSAGE:
            raise ConnectionError("oversized hello")
        given = bytearray(nbytes)
        recv_exact(sock, memoryview(given), conn.read_by)
        if self.token and not token_matches(bytes(given), self.token):
            self._refuse(sock, Unauthenticated("missing or wrong bearer token"))
            return False
        self._reply(sock)
        return True

    def _refuse_unread(self, conn: Connection, exc: BaseException, nbytes: int, limit: int) -> None:
        """Refuse a request whose payload is still on its way; the loop then reads and drops it, then closes.

        Closing a socket with unread data resets the connection, and a reset can destroy the
        refusal before the client reads it: the client would see a broken pipe instead. So up to
        ``limit`` bytes are dropped first (a worker's push of the right size is never cut),
        by the loop, without a handler, at ``MIN_RATE`` at least.
        """
        self._refuse(conn.sock, exc)
        conn.drain = min(nbytes, limit)
        conn.deadline = time.monotonic() + DRAIN_GRACE_S + conn.drain / MIN_RATE


def wait_timeout(sock: socket.socket, timeout: float) -> float | None:
    """The deadline of a consistency wait that a request gave as ``timeout``, ``sock`` set to answer after it.

    On the stream planes a timeout of 0 means "no deadline"; the service checks any other value.
    """
    sock.settimeout(reply_timeout(timeout))
    return timeout or None


def reply_timeout(timeout: float) -> float | None:
    """How long a socket may wait to send the answer to a request with ``timeout`` (0: no deadline).

    The consistency wait is the service's, which also refuses a deadline that is not a finite
    number; a number from the wire must never make ``settimeout`` itself fail.
    """
    if not timeout or not math.isfinite(timeout) or timeout < 0:
        return None if not timeout else PAYLOAD_IDLE_S
    return min(timeout, MAX_WAIT_S) + PAYLOAD_IDLE_S


_IDLE, _PARTIAL, _WHOLE, _GONE = "idle", "partial", "whole", "gone"


def _header_state(sock) -> str:
    """How much of a request header ``sock`` holds, without reading it: none, part, all, or a closed peer.

    TLS records hide it: a TLS connection counts as whole (its handler reads the header, HEADER_S bounding it).
    """
    if isinstance(sock, ssl.SSLSocket):
        return _WHOLE
    try:
        got = sock.recv(REQUEST.size, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return _IDLE
    except OSError:
        return _GONE
    if not got:
        return _GONE
    if len(got) >= REQUEST.size:
        return _WHOLE
    # Part of one, from a peer that has shut its side (a truncated request): the rest never comes.
    hung_up = select.poll()
    hung_up.register(sock, select.POLLRDHUP)
    return _GONE if hung_up.poll(0) else _PARTIAL


def _drain(sock: socket.socket) -> None:
    try:
        while sock.recv(4096):
            pass
    except (BlockingIOError, OSError):
        pass
