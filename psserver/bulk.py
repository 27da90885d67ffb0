"""The bulk data plane: Pull and Push payloads over one plain TCP connection, zero-copy.

gRPC stays the control plane and the wire contract (proto/ps.proto). For the
two calls that move whole ranges, a shard also listens on a raw TCP port (its
``bulk_port``, sent in RegisterReply) where a request is a fixed header and a
reply is a fixed header followed by the raw little-endian payload. A pull is
received with ``recv_into`` straight into the caller's buffer and a push is sent
with ``sendall`` straight from it: on loopback a single gRPC-Python stream tops
out near half of raw TCP, this path near all of it (``psctl bench transport``).
ps-lite and BytePS split control and data the same way.

The rules are those of the gRPC calls: the same consistency waits, the same
validation (and no state change on bad input), the same status codes, the same
bearer token (sent once per connection) and, when the shard uses TLS, the same
certificates.
"""

from __future__ import annotations

import hmac
import logging
import socket
import ssl
import struct
import threading


from psgrid.psserver import wire
from psgrid.psserver.exceptions import InvalidArgument, NotInitialized, PSError, Unauthenticated
from psgrid.psserver.rpc import ps_pb2

log = logging.getLogger("psserver.bulk")

MAGIC = b"PSB1"
HELLO, PULL, PUSH = 1, 2, 3
# magic, op, dtype, worker_id, clock, version, nbytes, timeout_s
REQUEST = struct.Struct("<4sBBqqQQd")
# magic, status (a grpc.StatusCode value; 0 is OK), outcome, version, staleness, next_clock, nbytes
REPLY = struct.Struct("<4sBBQqqQ")
MAX_MESSAGE = 1 << 16     # longest error text or token
HANDSHAKE_S = 30.0        # time a new connection has for its TLS handshake and hello
MAX_DISCARD = 1 << 30     # most bytes of a refused push read and dropped before closing
DISCARD_IDLE_S = 5.0      # give up dropping a refused payload after this long without data


class BulkError(Exception):
    """A refused bulk call; shaped like grpc.RpcError (``code()``, ``details()``) so callers treat both alike."""

    def __init__(self, code, details: str):
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self) -> str:
        return self._details


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view.nbytes:
        n = sock.recv_into(view)
        if n == 0:
            raise ConnectionError("bulk peer closed the connection")
        view = view[n:]


def _recv_struct(sock, layout: struct.Struct) -> tuple:
    buf = bytearray(layout.size)
    recv_exact(sock, memoryview(buf))
    fields = layout.unpack(buf)
    if fields[0] != MAGIC:
        raise ConnectionError("bulk peer spoke another protocol")
    return fields


# ----- server side --------------------------------------------------------------------------------

class BulkServer:
    """Accepts bulk connections for one shard; one thread per connection, like the gRPC handlers."""

    def __init__(self, shard, host: str, token: str | None = None, ssl_context: ssl.SSLContext | None = None):
        from psgrid.psserver.servicer import status_code      # the one mapping of domain errors to codes

        self.shard, self.token, self.ssl_context = shard, token, ssl_context
        self.status_code = status_code
        self.listener = socket.create_server((host, 0))
        self.port = self.listener.getsockname()[1]
        self.stopped = threading.Event()
        self.connections: set[socket.socket] = set()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._accept, name="bulk-accept", daemon=True)

    def start(self) -> "BulkServer":
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.listener.close()
        with self.lock:
            for conn in list(self.connections):
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                conn.close()

    def _accept(self) -> None:
        while not self.stopped.is_set():
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), name="bulk-conn", daemon=True).start()

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
            if not self.token:
                conn.settimeout(None)
            authenticated = not self.token
            scratch = bytearray()    # this connection's landing buffer for float16/bfloat16 payloads
            while not self.stopped.is_set():
                _, op, dtype, worker, clock, version, nbytes, timeout = _recv_struct(conn, REQUEST)
                if op == HELLO:
                    given = self._read_small(conn, nbytes)
                    authenticated = not self.token or hmac.compare_digest(given, self.token.encode())
                    if not authenticated:
                        self._reply_error(conn, Unauthenticated("missing or wrong bearer token"))
                        return
                    conn.settimeout(None)    # an authenticated idle connection may wait for its next call
                    self._reply(conn)
                elif not authenticated:
                    self._reply_error(conn, Unauthenticated("missing or wrong bearer token"))
                    return
                elif op == PULL:
                    self._pull(conn, worker, clock, timeout)
                elif op == PUSH:
                    if not self._push(conn, dtype, worker, clock, version, nbytes, scratch):
                        return
                else:
                    self._reply_error(conn, InvalidArgument(f"unknown bulk operation {op}"))
                    return
        except (ConnectionError, OSError, ssl.SSLError):
            pass      # the client went away; nothing half-applied: a push applies only once complete
        except Exception:  # noqa: BLE001 - one bad connection must not take the shard down
            log.exception("bulk connection failed")
        finally:
            with self.lock:
                self.connections.discard(raw_conn)
                self.connections.discard(conn)
            conn.close()
            raw_conn.close()

    def _read_small(self, conn, nbytes: int) -> bytes:
        if nbytes > MAX_MESSAGE:
            raise ConnectionError("oversized bulk hello")
        buf = bytearray(nbytes)
        recv_exact(conn, memoryview(buf))
        return bytes(buf)

    def _discard(self, conn, nbytes: int) -> None:
        """Read and drop the refused payload the client is still sending (bounded in bytes and time).

        Closing a socket with unread data resets the connection, and a reset can destroy the
        error reply before the client reads it: the client would see a broken pipe instead.
        """
        conn.settimeout(DISCARD_IDLE_S)
        scratch = bytearray(1 << 16)
        left = min(nbytes, MAX_DISCARD)
        while left > 0:
            n = conn.recv_into(scratch, min(left, len(scratch)))
            if n == 0:
                return
            left -= n

    def _reply(self, conn, status=0, outcome=0, version=0, staleness=0, next_clock=0, payload=None, nbytes=0):
        conn.sendall(REPLY.pack(MAGIC, status, outcome, version, staleness, next_clock, nbytes))
        if payload is not None:
            conn.sendall(payload)

    def _reply_error(self, conn, exc: PSError) -> None:
        if isinstance(exc, InvalidArgument):
            self.shard.reject()
        text = str(exc).encode()[:MAX_MESSAGE]
        self._reply(conn, status=self.status_code(exc).value[0], payload=text, nbytes=len(text))

    def _pull(self, conn, worker: int, clock: int, timeout: float) -> None:
        try:
            self.shard.wait_for_pull(worker, clock, timeout if timeout > 0 else None)
            version, snapshot = self.shard.snapshot()
        except PSError as exc:
            self._reply_error(conn, exc)
            return
        try:
            self._reply(conn, version=version, payload=memoryview(snapshot).cast("B"), nbytes=snapshot.nbytes)
        finally:
            self.shard.release_snapshot(snapshot)

    def _push(self, conn, dtype: int, worker: int, clock: int, version: int, nbytes: int,
              scratch: bytearray) -> bool:
        """Take one push; False if the connection cannot be trusted to stay in step and must close."""
        shard = self.shard
        itemsize = wire.ITEMSIZE.get(dtype)
        expected = shard.size * itemsize if itemsize and shard.initialized else None
        if expected is None or nbytes != expected:
            # The payload length is not one we can read into place: refuse and drop the connection
            # rather than read it as a gradient. The same codes as the gRPC Push: a shard with no
            # weights is a precondition error, not bad input.
            exc = (InvalidArgument(f"unknown gradient dtype {dtype}") if not itemsize else
                   NotInitialized("shard has no weights yet: a worker must call Init first")
                   if not shard.initialized else
                   InvalidArgument(f"push of {nbytes} bytes, this shard's range needs {expected}"))
            self._reply_error(conn, exc)
            self._discard(conn, nbytes)
            return False
        grad = shard.pool.take()
        kept = False
        try:
            if dtype == ps_pb2.FLOAT32:
                recv_exact(conn, memoryview(grad).cast("B"))
            else:
                if len(scratch) != nbytes:
                    scratch[:] = bytes(nbytes)    # sized once per connection, then reused
                raw = memoryview(scratch)
                recv_exact(conn, raw)
                wire.decode_into(grad, raw, dtype)
            try:
                if not wire.all_finite(grad):
                    raise InvalidArgument("gradient contains NaN or infinity")
                result = shard.push(worker, clock, version, grad, nbytes)
                kept = result.kept
            except PSError as exc:
                self._reply_error(conn, exc)
                return True
            outcome = ps_pb2.PushReply.Outcome.Value(
                {"apply": "APPLIED", "accumulate": "ACCUMULATED", "drop_late": "DROPPED_LATE",
                 "duplicate": "DUPLICATE"}[result.outcome.value])
            self._reply(conn, outcome=outcome, version=result.version, staleness=result.staleness,
                        next_clock=result.next_clock)
            return True
        finally:
            if not kept:
                shard.pool.give(grad)


# ----- client side --------------------------------------------------------------------------------

class BulkClient:
    """Bulk connections to one shard, pooled so that a pull and a push can run at once."""

    def __init__(self, host: str, port: int, token: str | None = None, ssl_context: ssl.SSLContext | None = None):
        self.host, self.port, self.token, self.ssl_context = host, port, token, ssl_context
        self.idle: list[socket.socket] = []
        self.lock = threading.Lock()
        self.closed = False

    def _connect(self, timeout: float) -> socket.socket:
        sock = socket.create_connection((self.host, self.port), timeout=timeout)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if self.ssl_context is not None:
                sock = self.ssl_context.wrap_socket(sock, server_hostname=self.host)
            if self.token:
                token = self.token.encode()
                sock.sendall(REQUEST.pack(MAGIC, HELLO, 0, 0, 0, 0, len(token), 0.0) + token)
                self._read_reply(sock)
        except BaseException:
            sock.close()      # a refused handshake or hello must not leak the socket
            raise
        return sock

    def _take(self, timeout: float) -> socket.socket:
        with self.lock:
            sock = self.idle.pop() if self.idle else None
        return sock or self._connect(timeout)

    def _give(self, sock: socket.socket) -> None:
        with self.lock:
            if not self.closed:
                self.idle.append(sock)
                return
        sock.close()      # this client was dropped while the call was in flight

    def _read_reply(self, sock) -> tuple:
        _, status, outcome, version, staleness, next_clock, nbytes = _recv_struct(sock, REPLY)
        if status:
            text = bytearray(min(nbytes, MAX_MESSAGE))
            recv_exact(sock, memoryview(text))
            raise BulkError(_code(status), text.decode(errors="replace"))
        return outcome, version, staleness, next_clock, nbytes

    def _round_trip(self, timeout: float, send, receive):
        sock = self._take(timeout)
        try:
            sock.settimeout(timeout + 5 if timeout else None)
            send(sock)
            result = receive(sock)
        except BulkError as err:
            # Only a consistency wait that outlived its deadline surely leaves the connection in step
            # (it is re-issued at once); after any other refusal the shard may have closed it.
            if err.code().name == "DEADLINE_EXCEEDED":
                self._give(sock)
            else:
                sock.close()
            raise
        except BaseException:
            sock.close()           # a broken or timed-out connection is never reused
            raise
        self._give(sock)
        return result

    def pull_into(self, out: memoryview, worker: int, clock: int, timeout: float) -> int:
        """Receive this shard's range straight into ``out`` (a byte view); returns the version."""
        def send(sock):
            sock.sendall(REQUEST.pack(MAGIC, PULL, ps_pb2.FLOAT32, worker, clock, 0, 0, timeout))

        def receive(sock):
            _, version, _, _, nbytes = self._read_reply(sock)
            if nbytes != out.nbytes:
                raise ConnectionError(f"shard sent {nbytes} bytes for a range of {out.nbytes}")
            recv_exact(sock, out)
            return version

        return self._round_trip(timeout, send, receive)

    def push(self, payload, dtype: int, worker: int, clock: int, version: int, timeout: float) -> dict:
        """Send one gradient of this shard's range from ``payload`` (a byte view or bytes)."""
        nbytes = memoryview(payload).nbytes

        def send(sock):
            sock.sendall(REQUEST.pack(MAGIC, PUSH, dtype, worker, clock, version, nbytes, timeout))
            sock.sendall(payload)

        def receive(sock):
            outcome, new_version, staleness, next_clock, _ = self._read_reply(sock)
            return {"outcome": ps_pb2.PushReply.Outcome.Name(outcome), "version": new_version,
                    "staleness": staleness, "next_clock": next_clock}

        return self._round_trip(timeout, send, receive)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            for sock in self.idle:
                sock.close()
            self.idle.clear()


def _code(status: int):
    import grpc   # only for the status names; the bulk plane itself speaks plain TCP

    for code in grpc.StatusCode:
        if code.value[0] == status:
            return code
    return grpc.StatusCode.UNKNOWN



def server_ssl_context(cert: str, key: str, ca: str | None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    if ca:
        context.load_verify_locations(ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_ssl_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    context = ssl.create_default_context(cafile=ca)
    if cert:
        context.load_cert_chain(cert, key)
    return context
