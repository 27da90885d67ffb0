"""The gRPC adapter: one thin method per RPC of proto/ps.proto, over the shard's one data path.

Requests arrive as raw bytes (no deserializer at the gRPC layer) and are decoded inside
the handler, so a malformed message is refused as bad input, with a reason, like any
other (gRPC's own deserializer would answer INTERNAL). Pull replies and Push requests use
the codec of grpc_codec.py: the same bytes as the generated code, at about 2.5x its
throughput (docs/performance.md, "The gRPC codec", has the measurement).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from concurrent import futures

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2

from psgrid.psserver.config import ServerConfig
from psgrid.psserver.exceptions import InvalidArgument, Unauthenticated
from psgrid.psserver.protocol import (
    FLOAT32,
    GRPC_SERVER_OPTIONS,
    MAX_CHUNK_BYTES,
    MIN_CHUNK_BYTES,
    REASON_KEY,
    SERVICE,
    Reason,
    Refusal,
    Registration,
)
from psgrid.psserver.rpc import ps_pb2
from psgrid.psserver.security import bearer, read_pem, token_matches
from psgrid.psserver.service import ShardService
from psgrid.psserver.sharding import chunk_ranges
from psgrid.psserver.transports import grpc_codec as framing
from psgrid.psserver.transports.grpc_health import health_handlers

_CODES = {code.value[0]: code for code in grpc.StatusCode}
HEALTH_PREFIX = "/grpc.health.v1.Health/"


def _decode(message_cls, raw: bytes):
    try:
        return message_cls.FromString(raw)
    except DecodeError as exc:
        raise InvalidArgument(f"malformed {message_cls.__name__}: {exc}", Reason.MALFORMED) from None


def _carries_chunk(chunk) -> bool:
    """Whether a message carries a chunk: one with no type and no bytes is none (a header alone).

    Such a message adds no elements, so a Push or Init of headers alone is refused as a stream that
    ended before its range (``bad_size``, as the proto lists it), not for the type of a chunk it never sent.
    """
    return bool(chunk.dtype or len(chunk.data))


def _abort(context: grpc.ServicerContext, refusal: Refusal):
    context.set_trailing_metadata(((REASON_KEY, refusal.reason.wire_name),))
    context.abort(_CODES[refusal.status.value], refusal.message)


class GrpcAdapter:
    """Each method decodes a request, calls the service and encodes the reply; nothing else."""

    def __init__(self, service: ShardService, chunk_bytes: int):
        self.service = service
        self.chunk_bytes = chunk_bytes

    def _check_chunk(self, data) -> None:
        """A chunk of Init or Push is at most ``chunk_bytes`` (RegisterReply.max_chunk_bytes)."""
        if len(data) > self.chunk_bytes:
            raise InvalidArgument(
                f"a chunk of {len(data)} bytes is more than this shard takes (max_chunk_bytes {self.chunk_bytes})",
                Reason.CHUNK_TOO_LARGE,
            )

    def Register(self, raw, context):
        r = _decode(ps_pb2.RegisterRequest, raw)
        joined = self.service.register(
            spec_hash=r.spec_hash, worker_id=r.worker_id, start_clock=r.start_clock, host=r.host, observer=r.observer
        )
        return register_reply(joined)

    def Init(self, raw_stream, context):
        messages = (_decode(ps_pb2.InitRequest, raw) for raw in raw_stream)
        first = next(messages, None)
        if first is None or not first.HasField("spec"):
            raise InvalidArgument("an Init stream must start with the model spec", Reason.BAD_SPEC)
        params = [(p.name, tuple(p.shape), p.dtype or "float32") for p in first.spec.params]
        intake = self.service.open_init(params, first.spec.hash)
        for message in itertools.chain([first], messages):
            if _carries_chunk(message.chunk):
                self._check_chunk(message.chunk.data)
                intake.add_chunk(message.chunk.offset, message.chunk.dtype, message.chunk.data)
        applied, version = intake.commit(first.num_chunks)
        return ps_pb2.InitReply(applied=applied, version=version)

    def Pull(self, raw, context):
        r = _decode(ps_pb2.PullRequest, raw)
        chunk_elems = min(max(r.chunk_bytes or self.chunk_bytes, MIN_CHUNK_BYTES), MAX_CHUNK_BYTES) // 4
        with self.service.pull(
            worker_id=r.worker_id,
            clock=r.clock,
            timeout_s=context.time_remaining(),
            cancelled=lambda: not context.is_active(),
        ) as snap:
            payload = snap.payload()
            pieces = chunk_ranges(0, len(snap.values), chunk_elems)
            for i, (a, b) in enumerate(pieces):
                chunk = framing.ChunkView(offset=snap.begin + a, dtype=FLOAT32, data=payload[4 * a : 4 * b])
                yield framing.PullFrame(
                    version=snap.version if i == 0 else 0, num_chunks=len(pieces) if i == 0 else 0, chunk=chunk
                )

    def Push(self, raw_stream, context):
        frames = (framing.decode_push_request(raw) for raw in raw_stream)
        first = next(frames, None)
        if first is None:
            raise InvalidArgument("an empty Push stream", Reason.BAD_SIZE)
        with self.service.open_push(worker_id=first.worker_id, clock=first.clock, version=first.version) as intake:
            for frame in itertools.chain([first], frames):
                if _carries_chunk(frame.chunk):
                    self._check_chunk(frame.chunk.data)
                    intake.add_chunk(frame.chunk.offset, frame.chunk.dtype, frame.chunk.data)
            result = intake.commit(first.num_chunks)
        return ps_pb2.PushReply(
            outcome=int(result.outcome),
            version=result.version,
            staleness=result.staleness,
            next_clock=result.next_clock,
        )

    def Heartbeat(self, raw, context):
        r = _decode(ps_pb2.HeartbeatRequest, raw)
        return ps_pb2.HeartbeatReply(
            **dataclasses.asdict(self.service.heartbeat(worker_id=r.worker_id, leaving=r.leaving))
        )

    def Stats(self, raw, context):
        _decode(ps_pb2.StatsRequest, raw)
        stats = self.service.stats()
        members = [ps_pb2.MemberInfo(**m) for m in stats.pop("members")]
        waits = [ps_pb2.WorkerWait(**w) for w in stats.pop("waits")]
        return ps_pb2.StatsReply(members=members, waits=waits, **stats)

    def Checkpoint(self, raw, context):
        _decode(ps_pb2.CheckpointRequest, raw)
        path, version = self.service.checkpoint()
        return ps_pb2.CheckpointReply(path=path, version=version)

    def Shutdown(self, raw, context):
        r = _decode(ps_pb2.ShutdownRequest, raw)
        self.service.shutdown(r.job_id)
        return ps_pb2.ShutdownReply()

    def Describe(self, raw, context):
        _decode(ps_pb2.DescribeRequest, raw)
        return describe_reply(self.service.describe())


def register_reply(joined: Registration) -> ps_pb2.RegisterReply:
    """A :class:`Registration` as a RegisterReply: every plane in ``planes``, and the TCP and shared-memory
    offers in the per-plane fields too, for the clients of the release before ``planes``."""
    fields = dataclasses.asdict(joined)
    planes = fields.pop("planes")
    offered = dict(planes)
    return ps_pb2.RegisterReply(
        planes=[ps_pb2.PlaneOffer(name=name, address=address) for name, address in planes],
        tcp_port=int(offered.get("tcp") or 0),
        shm_socket=offered.get("shm", ""),
        **fields,
    )


def describe_reply(described: dict) -> ps_pb2.DescribeReply:
    """``ShardService.describe``'s answer as a DescribeReply."""
    fields = dict(described)
    spec = fields.pop("spec")
    planes = fields.pop("planes")
    reply = ps_pb2.DescribeReply(
        optimizer=ps_pb2.OptimizerInfo(**fields.pop("optimizer")),
        planes=[ps_pb2.PlaneOffer(name=name, address=address) for name, address in planes],
        **fields,
    )
    if spec is not None:
        params, digest = spec
        reply.spec.CopyFrom(
            ps_pb2.ModelSpecMsg(
                params=[ps_pb2.ParamInfo(name=name, shape=list(shape), dtype=dtype) for name, shape, dtype in params],
                hash=digest,
            )
        )
    return reply


def _refusing(service: ShardService, name: str, method, streaming_reply: bool):
    """Wrap a handler so that any failure goes on the wire as a status code with a reason."""

    def refuse(exc, context):
        if isinstance(exc, grpc.RpcError) or not context.is_active():
            raise exc  # the caller went away: nobody to answer
        _abort(context, service.refuse(exc, name))

    if streaming_reply:

        @functools.wraps(method)
        def stream_handler(request, context):
            try:
                yield from method(request, context)
            except Exception as exc:  # noqa: BLE001 - every failure is answered, and the server goes on
                refuse(exc, context)

        return stream_handler

    @functools.wraps(method)
    def handler(request, context):
        try:
            return method(request, context)
        except Exception as exc:  # noqa: BLE001 - every failure is answered, and the server goes on
            refuse(exc, context)

    return handler


def method_handlers(service: ShardService, chunk_bytes: int) -> grpc.GenericRpcHandler:
    """The service's nine methods; requests stay raw bytes until the handler decodes them."""
    adapter = GrpcAdapter(service, chunk_bytes)
    kinds = {  # name: (handler factory, reply serializer, reply streams)
        "Register": (grpc.unary_unary_rpc_method_handler, ps_pb2.RegisterReply.SerializeToString, False),
        "Init": (grpc.stream_unary_rpc_method_handler, ps_pb2.InitReply.SerializeToString, False),
        "Pull": (grpc.unary_stream_rpc_method_handler, framing.encode_pull_reply, True),
        "Push": (grpc.stream_unary_rpc_method_handler, ps_pb2.PushReply.SerializeToString, False),
        "Heartbeat": (grpc.unary_unary_rpc_method_handler, ps_pb2.HeartbeatReply.SerializeToString, False),
        "Stats": (grpc.unary_unary_rpc_method_handler, ps_pb2.StatsReply.SerializeToString, False),
        "Checkpoint": (grpc.unary_unary_rpc_method_handler, ps_pb2.CheckpointReply.SerializeToString, False),
        "Shutdown": (grpc.unary_unary_rpc_method_handler, ps_pb2.ShutdownReply.SerializeToString, False),
        "Describe": (grpc.unary_unary_rpc_method_handler, ps_pb2.DescribeReply.SerializeToString, False),
    }
    handlers = {
        name: factory(
            _refusing(service, name, getattr(adapter, name), streams),
            request_deserializer=None,
            response_serializer=serialize,
        )
        for name, (factory, serialize, streams) in kinds.items()
    }
    return grpc.method_handlers_generic_handler(SERVICE, handlers)


class BearerTokenInterceptor(grpc.ServerInterceptor):
    """Refuse every call whose ``authorization`` metadata is not ``Bearer <token>``."""

    def __init__(self, token: str):
        self.expected = bearer(token)
        refusal = Unauthenticated("missing or wrong bearer token").refusal()

        def deny(request, context):
            _abort(context, refusal)

        self.deny = {
            (False, False): grpc.unary_unary_rpc_method_handler(deny),
            (True, False): grpc.stream_unary_rpc_method_handler(deny),
            (False, True): grpc.unary_stream_rpc_method_handler(deny),
        }

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        # Health checks need no token, as a cluster's probes (Kubernetes, Slurm prologs) carry none:
        # they say whether the shard serves, nothing of the job.
        if handler is None or handler_call_details.method.startswith(HEALTH_PREFIX):
            return handler
        given = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        if token_matches(given, self.expected):
            return handler
        return self.deny[(handler.request_streaming, handler.response_streaming)]


class GrpcServer:
    """The shard's gRPC server, bound and ready to start; ``port`` is the real port (never 0).

    It also serves the standard health service (``grpc.health.v1.Health``, grpc_health.py), for
    the overall server ("") and for the psgrid service: NOT_SERVING until :meth:`set_serving` says
    otherwise.
    """

    def __init__(self, service: ShardService, config: ServerConfig):
        interceptors = [BearerTokenInterceptor(config.token)] if config.token else []
        self.executor = futures.ThreadPoolExecutor(max_workers=config.threads, thread_name_prefix="grpc-handler")
        self.server = grpc.server(self.executor, options=list(GRPC_SERVER_OPTIONS), interceptors=interceptors)
        self.server.add_generic_rpc_handlers((method_handlers(service, config.chunk_bytes),))
        self.health = health.HealthServicer()
        self.server.add_generic_rpc_handlers((health_handlers(self.health),))
        self.set_serving(False)
        target = f"{config.host}:{config.port}"
        if config.tls_cert:
            creds = grpc.ssl_server_credentials(
                [(read_pem(config.tls_key), read_pem(config.tls_cert))],
                root_certificates=read_pem(config.tls_ca),
                require_client_auth=bool(config.tls_ca),
            )
            self.port = self.server.add_secure_port(target, creds)
        else:
            self.port = self.server.add_insecure_port(target)
        if self.port == 0:
            self.executor.shutdown(wait=False)
            raise OSError(f"could not bind {target}: address in use or not available")

    def start(self) -> None:
        self.server.start()

    def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE):
            self.health.set(name, status)

    def stop(self, grace: float | None) -> None:
        self.health.enter_graceful_shutdown()  # NOT_SERVING to every probe from now on
        self.server.stop(grace).wait(timeout=(grace or 0) + 5)
        self.executor.shutdown(wait=True)  # grpc leaves its handler threads to their owner
