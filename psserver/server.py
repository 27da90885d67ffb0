"""Build, start and stop one shard's gRPC server: ``serve()`` and the blocking ``run_server()``."""

from __future__ import annotations

import hmac
import logging
import os
import signal
import sys
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc

from psgrid.psserver.config import ServerConfig
from psgrid.psserver import framing
from psgrid.psserver.rpc import ps_pb2, ps_pb2_grpc
from psgrid.psserver.servicer import MAX_CHUNK_BYTES, ParameterServerServicer
from psgrid.psserver.shard import Shard

log = logging.getLogger("psserver")
SERVICE = "ps.ParameterServer"

GRPC_OPTIONS = [
    ("grpc.so_reuseport", 0),    # two servers must never share a port silently
    ("grpc.max_receive_message_length", MAX_CHUNK_BYTES + (1 << 16)),
    ("grpc.max_send_message_length", MAX_CHUNK_BYTES + (1 << 16)),
]


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuse every call whose ``authorization`` metadata is not ``Bearer <token>``."""

    def __init__(self, token: str):
        self.expected = f"Bearer {token}".encode()

        def deny(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")

        self.deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self.deny_stream_in = grpc.stream_unary_rpc_method_handler(deny)
        self.deny_stream_out = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation, handler_call_details):
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if hmac.compare_digest(given.encode(), self.expected):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        if handler.request_streaming:
            return self.deny_stream_in
        if handler.response_streaming:
            return self.deny_stream_out
        return self.deny_unary


class _HandlerCapture:
    """Stands in for a grpc.Server to collect the generated method handlers."""

    def add_generic_rpc_handlers(self, handlers):
        pass

    def add_registered_method_handlers(self, service, handlers):
        self.handlers = dict(handlers)


def add_servicer(servicer, server) -> None:
    """Register the servicer, with the zero-copy framing (psserver/framing.py) for Pull and Push.

    The generated handlers are reused for every other method; only the
    (de)serializers of the two bulk methods change, not the bytes on the wire.
    """
    capture = _HandlerCapture()
    ps_pb2_grpc.add_ParameterServerServicer_to_server(servicer, capture)
    handlers = capture.handlers
    handlers["Pull"] = grpc.unary_stream_rpc_method_handler(
        servicer.Pull, request_deserializer=ps_pb2.PullRequest.FromString,
        response_serializer=framing.encode_pull_reply)

    def push(request_iterator, context):
        # Frames are decoded inside the handler, so a malformed one is refused as bad input
        # (INVALID_ARGUMENT, counted) rather than as gRPC's INTERNAL "Exception deserializing request!".
        return servicer.Push(map(framing.decode_push_request, request_iterator), context)

    handlers["Push"] = grpc.stream_unary_rpc_method_handler(
        push, request_deserializer=None, response_serializer=ps_pb2.PushReply.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def _read(path: str | None) -> bytes | None:
    return Path(path).read_bytes() if path else None


class RunningServer:
    """A started shard: its address, its state, and how to stop it."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.shard = Shard(config)
        self.stopped = threading.Event()
        self.shutdown_requested = threading.Event()
        interceptors = [BearerTokenInterceptor(config.token)] if config.token else []
        self.grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=config.threads),
                                       options=GRPC_OPTIONS, interceptors=interceptors)
        self.bulk = None
        if config.bulk:
            from psgrid.psserver.bulk import BulkServer, server_ssl_context

            ssl_context = server_ssl_context(config.tls_cert, config.tls_key, config.tls_ca) if config.tls_cert else None
            self.bulk = BulkServer(self.shard, config.host, config.token, ssl_context)
        add_servicer(ParameterServerServicer(self.shard, on_shutdown=self.shutdown_requested.set,
                                             bulk_port=self.bulk.port if self.bulk else 0), self.grpc_server)
        target = f"{config.host}:{config.port}"
        if config.tls_cert:
            creds = grpc.ssl_server_credentials([(_read(config.tls_key), _read(config.tls_cert))],
                                                root_certificates=_read(config.tls_ca),
                                                require_client_auth=bool(config.tls_ca))
            self.port = self.grpc_server.add_secure_port(target, creds)
        else:
            self.port = self.grpc_server.add_insecure_port(target)
        if self.port == 0:
            raise OSError(f"could not bind {target}: address in use or not available")
        self.address = f"{config.host}:{self.port}"
        self.metrics = None
        if config.metrics_port is not None:
            from psgrid.psserver.metrics import start_exporter
            self.metrics = start_exporter(self.shard, config.host, config.metrics_port)
        self.reaper = threading.Thread(target=self._reap, name="lease-reaper", daemon=True)

    def start(self) -> "RunningServer":
        if self.bulk is not None:
            self.bulk.start()
        self.grpc_server.start()
        self.reaper.start()
        return self

    def _reap(self) -> None:
        # Evicts expired workers often enough that a wait is released within a fraction of a lease.
        interval = min(0.5, self.config.lease_s / 4)
        while not self.stopped.wait(interval):
            try:
                for worker in self.shard.evict_expired():
                    log.warning("shard %d evicted worker %d: no heartbeat for %.1fs",
                                self.config.shard_index, worker, self.config.lease_s)
                self.shard.checkpoint_if_due()
            except Exception:  # noqa: BLE001 - the reaper must keep running
                log.exception("lease reaper failed")

    def stop(self, grace: float | None = 1.0) -> None:
        if self.stopped.is_set():
            return
        self.stopped.set()
        self.shard.close()        # release waiting pulls first, or stop() waits out their deadlines
        if self.bulk is not None:
            self.bulk.stop()
        self.grpc_server.stop(grace).wait(timeout=(grace or 0) + 5)
        if self.config.checkpoint_dir and self.shard.initialized:
            try:
                self.shard.checkpoint()
            except Exception:  # noqa: BLE001 - stopping must finish; the last good checkpoint stays
                log.exception("shard %d: final checkpoint failed", self.config.shard_index)
        if self.metrics is not None:
            self.metrics.shutdown()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the server is stopped or a Shutdown RPC asked it to stop; True if so."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not (self.stopped.is_set() or self.shutdown_requested.is_set()):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            self.shutdown_requested.wait(0.2 if remaining is None else min(0.2, remaining))
        return True


def serve(config: ServerConfig) -> RunningServer:
    """Build and start a shard server; the caller stops it with ``.stop()``."""
    return RunningServer(config).start()


def write_address(path: str | os.PathLike, address: str) -> None:
    """Publish the bound address atomically so a reader never sees half of it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(address + "\n")
    os.replace(tmp, path)


def run_server(config: ServerConfig, address_file: str | None = None) -> int:
    """Serve until SIGTERM, SIGINT or a Shutdown RPC; returns the process exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    server = serve(config)
    done = threading.Event()

    def on_signal(signum, frame):
        done.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if address_file:
        write_address(address_file, server.address)
    extra = f", metrics on :{server.metrics.port}" if server.metrics else ""
    print(f"psserver shard {config.shard_index}/{config.num_shards} listening on {server.address} "
          f"(mode {config.mode}){extra}", flush=True)
    while not done.is_set() and not server.shutdown_requested.is_set():
        done.wait(0.2)
    server.stop(grace=1.0)
    print(f"psserver shard {config.shard_index} stopped", file=sys.stderr, flush=True)
    return 0
