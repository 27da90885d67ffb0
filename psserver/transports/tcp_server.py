"""The TCP data plane, server side: Pull and Push payloads over plain TCP, zero-copy, beside gRPC.

A shard also listens on a second port (its ``tcp_port``, sent in RegisterReply) where a
request is a fixed header and a reply a fixed header and the raw little-endian payload
(tcp_frames.py). A pushed gradient is received with ``recv_into`` straight into the pooled
buffer the service lends, and a pull is sent with ``sendall`` straight from its snapshot:
on loopback a single gRPC-Python stream tops out well under raw TCP, this path near all of
it (``psctl bench transport``). ps-lite and BytePS split control and data the same way.

Connections are many and mostly idle, requests few at a time: one thread waits on every idle
connection (``selectors``) and a bounded pool of handlers serves the requests that arrive
(:class:`TcpDataServer`), so neither idle connections nor a flood of them costs threads.

What a request means, and whether it is valid, is the service's: this adapter only moves
bytes, checks the bearer token (sent once per connection in a hello), and speaks TLS when
the shard does.
"""

from __future__ import annotations

import logging
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

from psgrid.psserver.exceptions import InvalidArgument, PSError, Unauthenticated
from psgrid.psserver.protocol import Reason, Refusal, Status
from psgrid.psserver.security import token_matches
from psgrid.psserver.service import ShardService
from psgrid.psserver.transports.tcp_frames import (HANDSHAKE_S, HELLO, MAGIC, MAX_MESSAGE, PULL, PUSH, REPLY, REQUEST,
                                                   recv_exact, recv_struct)

log = logging.getLogger("psgrid.tcp")

MAX_DISCARD = 1 << 30     # most bytes of a refused push read and dropped before closing
DISCARD_IDLE_S = 5.0      # give up dropping a refused payload after this long without data
HEADER_S = 10.0           # a request header that has started must be complete within this
PAYLOAD_IDLE_S = 60.0     # a payload may pause this long between bytes
LINGER_S = 1.0            # a handler waits this long for an active connection's next request
# Connections at once: far more than any job's workers, and half of what this process may open.
DEFAULT_MAX_CONNECTIONS = min(4096, resource.getrlimit(resource.RLIMIT_NOFILE)[0] // 2)


class Connection:
    """One client connection: its socket, and whether it has said its hello."""

    __slots__ = ("sock", "raw", "authenticated", "handshaken", "deadline")

    def __init__(self, sock: socket.socket, authenticated: bool, handshaken: bool):
        self.sock = self.raw = sock
        self.authenticated, self.handshaken = authenticated, handshaken
        self.deadline = time.monotonic() + HANDSHAKE_S     # to finish its TLS handshake and hello


class TcpDataServer:
    """Accepts data-plane connections for one shard and serves their requests from a bounded pool.

    An idle connection costs a file descriptor, not a thread: one thread waits on every idle
    connection at once (``selectors``), and hands a connection whose request has arrived to a
    pool of ``handlers`` threads, which serves that one request and gives it back. So 2,000 idle
    connections hold no thread, and a valid client is served beside them at normal speed. A new
    connection has ``HANDSHAKE_S`` for its TLS handshake and hello, then is closed; past
    ``max_connections`` a new one is refused at once (UNAVAILABLE, reason
    ``too_many_connections``: the client retries). The loop survives anything one connection
    does (a failed accept, a thread that cannot start); if it ever ends while the shard serves,
    ``on_failure`` is called (the shard's health turns NOT_SERVING).
    """

    def __init__(self, service: ShardService, host: str, token: str | None = None,
                 ssl_context: ssl.SSLContext | None = None, *, handlers: int = 128,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS, on_failure: Callable[[], None] | None = None):
        self.service, self.token, self.ssl_context = service, token, ssl_context
        self.max_connections, self.on_failure = max_connections, on_failure
        self.listener = socket.create_server((host, 0), backlog=1024)     # a burst of connects is not dropped
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]
        self.stopped = threading.Event()
        self.failed = False
        self.connections: set[Connection] = set()
        self.lock = threading.Lock()
        self.selector = selectors.DefaultSelector()
        self.wake_r, self.wake_w = socket.socketpair()     # tells the loop a connection came back
        self.wake_r.setblocking(False)
        self.returned: queue.SimpleQueue[Connection] = queue.SimpleQueue()
        self.handlers, self.busy = max(1, handlers), 0
        self.pool = ThreadPoolExecutor(max_workers=self.handlers, thread_name_prefix="tcp-handler")
        self.thread = threading.Thread(target=self._run, name="tcp-accept", daemon=True)

    def start(self) -> "TcpDataServer":
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

    # ----- the loop: accept, wait on idle connections, hand ready ones to the pool --------------

    def _run(self) -> None:
        try:
            while not self.stopped.is_set():
                try:
                    self._turn()
                except Exception:  # noqa: BLE001 - a bad turn must not end the loop: the shard would look alive
                    log.exception("data-plane loop: one turn failed; going on")
                    time.sleep(0.05)
        except BaseException:  # noqa: BLE001 - ended: said below, and by the shard's health
            log.exception("data-plane loop ended")
        finally:
            if not self.stopped.is_set():
                self.failed = True
                log.error("the TCP data plane stopped serving; clients fall back to retrying")
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
                log.warning("data plane cannot accept a connection now: %s", exc)
                time.sleep(0.05)
                return
            sock.setblocking(True)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)    # a reply's header and payload go at once
            with self.lock:
                full = len(self.connections) >= self.max_connections
                conn = None if full else Connection(sock, authenticated=not self.token,
                                                    handshaken=self.ssl_context is None)
                if conn is not None:
                    self.connections.add(conn)
            if full:
                self._refuse_full(sock)
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
            log.warning("data plane cannot serve a connection now: %s", exc)
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

    def _refuse_full(self, sock: socket.socket) -> None:
        """Tell a connection past the limit why, without reading it (the client reads its reply), and close."""
        message = (f"this shard serves at most {self.max_connections} data-plane connections "
                   f"(tcp_max_connections); try again later").encode()
        try:
            sock.settimeout(0.5)
            sock.sendall(REPLY.pack(MAGIC, Status.UNAVAILABLE, Reason.TOO_MANY_CONNECTIONS, 0, 0, 0, 0, len(message))
                         + message)
        except OSError:
            pass
        _shutdown(sock, socket.SHUT_WR)
        sock.close()

    def _close(self, conn: Connection) -> None:
        with self.lock:
            self.connections.discard(conn)
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
                conn.sock = self.ssl_context.wrap_socket(conn.raw, server_side=True)
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
            log.exception("data-plane connection failed")
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
        if op == PULL:
            sock.settimeout(None if not timeout else timeout + PAYLOAD_IDLE_S)   # the wait is the service's
            self._pull(sock, worker, clock, timeout)
            return True
        if op == PUSH:
            return self._push(sock, dtype, worker, clock, version, nbytes)
        self._refuse_unread(sock, InvalidArgument(f"unknown data-plane operation {op}", Reason.MALFORMED), nbytes)
        return False

    # ----- replies ------------------------------------------------------------------------------

    def _reply(self, conn, *, status=Status.OK, reason=Reason.NONE, outcome=0, version=0, staleness=0, next_clock=0,
               payload=None) -> None:
        nbytes = 0 if payload is None else memoryview(payload).nbytes
        conn.sendall(REPLY.pack(MAGIC, status, reason, outcome, version, staleness, next_clock, nbytes))
        if payload is not None:
            conn.sendall(payload)

    def _refuse(self, conn, exc: BaseException) -> Refusal:
        refusal = self.service.refuse(exc, "a data-plane call")
        self._reply(conn, status=refusal.status, reason=refusal.reason,
                    payload=refusal.message.encode()[:MAX_MESSAGE])
        return refusal

    # ----- operations ---------------------------------------------------------------------------

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

    def _pull(self, conn, worker: int, clock: int, timeout: float) -> None:
        try:
            # On this plane a timeout of 0 means "no deadline"; the service checks any other value.
            with self.service.pull(worker_id=worker, clock=clock, timeout_s=timeout or None) as snap:
                self._reply(conn, version=snap.version, payload=snap.payload())
        except PSError as exc:       # first: a WaitTimeout is also an OSError
            self._refuse(conn, exc)
        except OSError:
            raise                    # the connection broke while sending: nobody to answer
        except Exception as exc:  # noqa: BLE001 - a bug of ours: answered INTERNAL, never silence
            self._refuse(conn, exc)

    def _push(self, conn, dtype: int, worker: int, clock: int, version: int, nbytes: int) -> bool:
        """Take one push; False if the connection cannot be trusted to stay in step and must close."""
        try:
            intake = self.service.open_push(worker_id=worker, clock=clock, version=version)
        except Exception as exc:  # noqa: BLE001 - refused before the payload: drop it, then close
            self._refuse_unread(conn, exc, nbytes)
            return False
        with intake:
            try:
                landing = intake.landing(dtype, nbytes)
            except Exception as exc:  # noqa: BLE001
                self._refuse_unread(conn, exc, nbytes)
                return False
            recv_exact(conn, landing)
            try:
                intake.landed()
                result = intake.commit()
            except Exception as exc:  # noqa: BLE001 - the payload was read: the connection stays in step
                self._refuse(conn, exc)
                return True
        self._reply(conn, outcome=result.outcome, version=result.version, staleness=result.staleness,
                    next_clock=result.next_clock)
        return True

    def _refuse_unread(self, conn, exc: BaseException, nbytes: int) -> None:
        """Refuse a push whose payload is still on its way, then read and drop it (bounded).

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
