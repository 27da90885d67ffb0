"""The TCP data plane, server side: Pull and Push payloads over plain TCP, zero-copy, beside gRPC.

A shard also listens on a second port (its ``tcp_port``, sent in RegisterReply) where a
request is a fixed header and a reply a fixed header and the raw little-endian payload
(stream_frames.py). A pushed gradient is received with ``recv_into`` straight into the pooled
buffer the service lends, and a pull is sent with ``sendall`` straight from the version the
shard lends: on loopback a single gRPC-Python stream tops out well under raw TCP, this path
near all of it (``psctl bench transport``). ps-lite and BytePS split control and data the same way.

Accepting, idle connections, the bounded pool of handlers and the hello are every stream
plane's (stream_server.py, stream_admission.py); what a request means, and whether it is valid, is the service's:
this adapter only moves bytes.
"""

from __future__ import annotations

import socket
import ssl
from collections.abc import Callable

from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.protocol import Reason
from psgrid.psserver.service import ShardService
from psgrid.psserver.transports.base import ListenContext, Listening, register_listener
from psgrid.psserver.transports.stream_frames import HANDSHAKE_S, MAX_MESSAGE, PULL, PUSH, Request, recv_exact
from psgrid.psserver.transports.stream_server import DEFAULT_MAX_CONNECTIONS, Connection, SocketDataServer, wait_timeout

DRAIN_SLACK = 1 << 20  # a refused push is dropped up to the range in float32 and this much more, then cut


class TcpDataServer(SocketDataServer):
    """Serves one shard's Pull and Push payloads on a TCP port of ``host`` (``port``: the one bound)."""

    name = "TCP data plane"

    def __init__(
        self,
        service: ShardService,
        host: str,
        token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        *,
        handlers: int = 128,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
        handshake_s: float = HANDSHAKE_S,
        on_failure: Callable[[], None] | None = None,
    ):
        listener = socket.create_server((host, 0), backlog=1024)  # a burst of connects is not dropped
        self.port = listener.getsockname()[1]
        super().__init__(
            service,
            listener,
            token,
            ssl_context,
            handlers=handlers,
            max_connections=max_connections,
            handshake_s=handshake_s,
            on_failure=on_failure,
        )

    def _accepted(self, sock: socket.socket) -> str | None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # a reply's header and payload go at once
        return None

    def _operation(self, conn: Connection, request: Request) -> bool:
        if request.op == PULL:
            if request.nbytes:  # read as the next request, its bytes would put the connection out of step
                self._refuse_unread(
                    conn,
                    InvalidArgument("a PULL carries no payload (nbytes 0)", Reason.MALFORMED),
                    request.nbytes,
                    MAX_MESSAGE,
                )
                return False
            self._answer(conn.sock, self._pull, conn.sock, request)
            return True
        if request.op == PUSH:
            return self._push(conn, request)
        return super()._operation(conn, request)

    # ----- operations ---------------------------------------------------------------------------

    def _pull(self, sock: socket.socket, request: Request) -> None:
        timeout_s = wait_timeout(sock, request.timeout)
        with self.service.pull(worker_id=request.worker, clock=request.clock, timeout_s=timeout_s) as snap:
            self._reply(sock, version=snap.version, payload=snap.payload())

    def _push(self, conn: Connection, request: Request) -> bool:
        """Take one push; False if the connection cannot be trusted to stay in step and must close.

        A push is refused before its payload is read (a worker that is not live, a size that is
        not the range's); the payload is then dropped, no more of it than a push of the range
        could be.
        """
        sock, nbytes = conn.sock, request.nbytes
        try:
            intake = self.service.open_push(worker_id=request.worker, clock=request.clock, version=request.version)
        except Exception as exc:  # noqa: BLE001 - refused before the payload: drop it, then close
            self._refuse_unread(conn, exc, nbytes, self._most_a_push_sends())
            return False
        with intake:
            try:
                landing = intake.landing(request.dtype, nbytes)
            except Exception as exc:  # noqa: BLE001
                self._refuse_unread(conn, exc, nbytes, self._most_a_push_sends())
                return False
            intake.receive(landing, lambda view: recv_exact(sock, view, conn.read_by))
            try:
                intake.landed()
                result = intake.commit()
            except Exception as exc:  # noqa: BLE001 - the payload was read: the connection stays in step
                self._refuse(sock, exc)
                return True
        self._reply_push(sock, result)
        return True

    def _most_a_push_sends(self) -> int:
        return 4 * self.service.shard.size + DRAIN_SLACK


# ----- the plane's server end, registered (transports/base.py) ---------------------------------------


def _listen(service: ShardService, config, context: ListenContext) -> Listening | None:
    """The TCP data plane, where the shard's ``data_plane`` asks for it ("grpc": gRPC only); its offer is the port."""
    if config.data_plane != "tcp":
        return None
    server = TcpDataServer(
        service,
        config.host,
        config.token,
        context.ssl_context,
        handlers=config.threads,
        max_connections=config.tcp_max_connections,
        handshake_s=config.tcp_handshake_s,
        on_failure=context.on_failure,
    )
    return Listening(server, address=lambda: str(server.port))


register_listener("tcp", _listen)
