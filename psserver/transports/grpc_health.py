"""The standard gRPC health service (``grpc.health.v1.Health``), served the way the psgrid service is: bytes in.

Health checks need no token (a cluster's probes carry none), so anyone who reaches the port can
send one. grpcio's generated registration decodes a request before the handler runs; a request
that does not parse is then answered INTERNAL, logged with a traceback and leaks memory (about
38 MB and 790 KB of log per 2,000 here). So requests arrive as raw bytes and are decoded inside
the handler: a malformed one is refused INVALID_ARGUMENT with reason ``malformed``, changes
nothing, and refusals are logged at most once a minute, counted. What a probe is told is the
reference servicer's (``grpc_health.v1.health.HealthServicer``): Check of a name set with
``set`` (the server, ``""``, and the psgrid service), NOT_FOUND for another, and Watch.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2

from psgrid.psserver.protocol import REASON_KEY, Reason

log = logging.getLogger("psgrid.health")

LOG_EVERY_S = 60.0  # at most one line this often about refused health checks


class RefusalLog:
    """Counts refused requests and says so in one line at most every ``every_s`` seconds."""

    def __init__(self, what: str, every_s: float = LOG_EVERY_S):
        self.what, self.every_s = what, every_s
        self.lock = threading.Lock()
        self.count = 0
        self.next_at = 0.0

    def note(self, reason: str) -> None:
        with self.lock:
            self.count += 1
            now = time.monotonic()
            if now < self.next_at:
                return
            count, self.count, self.next_at = self.count, 0, now + self.every_s
        log.warning(
            "refused %d %s (the last: %s); next report in %gs at the earliest", count, self.what, reason, self.every_s
        )


def health_handlers(servicer: health.HealthServicer, refusals: RefusalLog | None = None) -> grpc.GenericRpcHandler:
    """``grpc.health.v1.Health``'s Check and Watch over ``servicer``, decoding requests inside the handlers."""
    refusals = refusals or RefusalLog("malformed health checks")

    def decode(raw: bytes, context: grpc.ServicerContext) -> health_pb2.HealthCheckRequest:
        try:
            return health_pb2.HealthCheckRequest.FromString(raw)
        except DecodeError as exc:
            refusals.note(str(exc))
            context.set_trailing_metadata(((REASON_KEY, Reason.MALFORMED.wire_name),))
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed HealthCheckRequest: {exc}")

    def check(raw, context):
        return servicer.Check(decode(raw, context), context)

    def watch(raw, context, send_response_callback):
        # Non-blocking, as the reference servicer's own: a watcher holds no thread while it waits.
        servicer.Watch(decode(raw, context), context, send_response_callback)

    watch.experimental_non_blocking = True
    serialize = health_pb2.HealthCheckResponse.SerializeToString
    return grpc.method_handlers_generic_handler(
        health.SERVICE_NAME,
        {
            "Check": grpc.unary_unary_rpc_method_handler(check, response_serializer=serialize),
            "Watch": grpc.unary_stream_rpc_method_handler(watch, response_serializer=serialize),
        },
    )
