"""The TCP data plane, server side: Pull and Push payloads over plain TCP, zero-copy, beside gRPC.

A shard also listens on a second port (its ``tcp_port``, sent in RegisterReply) where a
request is a fixed header and a reply a fixed header and the raw little-endian payload
(tcp_frames.py). A pushed gradient is received with ``recv_into`` straight into the pooled
buffer the service lends, and a pull is sent with ``sendall`` straight from its snapshot:
on loopback a single gRPC-Python stream tops out well under raw TCP, this path near all of
it (``psctl bench transport``). ps-lite and BytePS split control and data the same way.

What a request means, and whether it is valid, is the service's: this adapter only moves
bytes, checks the bearer token (sent once per connection in a hello), and speaks TLS when
the shard does.
"""

from __future__ import annotations

import logging
import socket
import ssl
import threading

from psgrid.psserver.exceptions import InvalidArgument, PSError, Unauthenticated
from psgrid.psserver.protocol import Reason, Refusal, Status
from psgrid.psserver.security import token_matches
from psgrid.psserver.service import ShardService
from psgrid.psserver.transports.tcp_frames import (HANDSHAKE_S, HELLO, MAGIC, MAX_MESSAGE, PULL, PUSH, REPLY, REQUEST,
                                                   recv_exact, recv_struct)

log = logging.getLogger("psgrid.tcp")

MAX_DISCARD = 1 << 30     # most bytes of a refused push read and dropped before closing
DISCARD_IDLE_S = 5.0      # give up dropping a refused payload after this long without data


class TcpDataServer:
    """Accepts data-plane connections for one shard; one thread per connection, like the gRPC handlers."""

    def __init__(self, service: ShardService, host: str, token: str | None = None,
                 ssl_context: ssl.SSLContext | None = None):
        self.service, self.token, self.ssl_context = service, token, ssl_context
        self.listener = socket.create_server((host, 0))
        self.port = self.listener.getsockname()[1]
        self.stopped = threading.Event()
        self.connections: set[socket.socket] = set()
        self.handlers: set[threading.Thread] = set()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._accept, name="tcp-accept", daemon=True)

    def start(self) -> "TcpDataServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        try:
            self.listener.shutdown(socket.SHUT_RDWR)   # wakes the accept() below; close() alone does not
        except OSError:
            pass
        self.listener.close()
        with self.lock:
            for conn in list(self.connections):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                conn.close()
        self.thread.join(timeout=5)
        with self.lock:
            handlers = list(self.handlers)
        for handler in handlers:     # each gives back what it holds (pooled buffers) as it ends
            handler.join(timeout=5)

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            handler = threading.Thread(target=self._serve, args=(conn,), name="tcp-conn", daemon=True)
            with self.lock:
                self.handlers.add(handler)
            handler.start()

    def _serve(self, conn: socket.socket) -> None:
        raw_conn = conn
        with self.lock:
            if self.stopped.is_set():
                conn.close()
                return
            self.connections.add(raw_conn)   # before the handshake, so stop() can always cut it
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # A peer gets HANDSHAKE_S for TLS and its hello; a silent one does not hold a thread forever.
            conn.settimeout(HANDSHAKE_S)
            if self.ssl_context is not None:
                conn = self.ssl_context.wrap_socket(conn, server_side=True)   # detaches raw_conn
                with self.lock:
                    self.connections.discard(raw_conn)
                    self.connections.add(conn)
            authenticated = not self.token
            if authenticated:
                conn.settimeout(None)
            while not self.stopped.is_set():
                _, op, dtype, worker, clock, version, nbytes, timeout = recv_struct(conn, REQUEST)
                if op == HELLO:
                    authenticated = self._hello(conn, nbytes)
                    if not authenticated:
                        return
                    conn.settimeout(None)    # an authenticated idle connection may wait for its next call
                elif not authenticated:
                    self._refuse_unread(conn, Unauthenticated("missing or wrong bearer token"), nbytes)
                    return
                elif op == PULL:
                    self._pull(conn, worker, clock, timeout)
                elif op == PUSH:
                    if not self._push(conn, dtype, worker, clock, version, nbytes):
                        return
                else:
                    self._refuse_unread(conn, InvalidArgument(f"unknown data-plane operation {op}", Reason.MALFORMED),
                                        nbytes)
                    return
        except (ConnectionError, OSError, ssl.SSLError):
            pass      # the client went away; nothing half-applied: a push reaches the shard only once complete
        except Exception:  # noqa: BLE001 - one bad connection must not take the shard down
            log.exception("data-plane connection failed")
        finally:
            with self.lock:
                self.connections.discard(raw_conn)
                self.connections.discard(conn)
                self.handlers.discard(threading.current_thread())
            conn.close()
            raw_conn.close()

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
