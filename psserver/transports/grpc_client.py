"""gRPC, client side: the control calls of every shard, and the data plane every shard offers.

Pull replies and Push requests are encoded by framing.py (the same bytes as the generated
code, without its copies). A refusal becomes the domain exception the shard raised,
rebuilt from the status code and the ``ps-reason`` trailing metadata.
"""

from __future__ import annotations

import dataclasses

import grpc
import numpy as np

from psgrid.psserver import dtypes as wire
from psgrid.psserver.exceptions import BadReply, PSError, Unavailable, error_from_wire
from psgrid.psserver.protocol import (
    CONTROL_PLANE,
    FLOAT32,
    GRPC_OPTIONS,
    REASON_KEY,
    SERVICE,
    HeartbeatInfo,
    Outcome,
    PushResult,
    Reason,
    Registration,
    Status,
)
from psgrid.psserver.rpc import ps_pb2
from psgrid.psserver.security import bearer, read_pem
from psgrid.psserver.sharding import chunk_ranges
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.transports import grpc_codec as framing
from psgrid.psserver.transports.base import ConnectOptions, Control, DataPlane, register_data_plane

_UNARY = {  # method: its reply message
    "Register": ps_pb2.RegisterReply,
    "Heartbeat": ps_pb2.HeartbeatReply,
    "Stats": ps_pb2.StatsReply,
    "Checkpoint": ps_pb2.CheckpointReply,
    "Shutdown": ps_pb2.ShutdownReply,
    "Describe": ps_pb2.DescribeReply,
}


def domain_error(err: grpc.RpcError, address: str) -> PSError:
    """The domain exception a failed call stands for, with the shard's reason."""
    reason = Reason.NONE
    for key, value in err.trailing_metadata() or ():
        if key == REASON_KEY:
            reason = Reason.from_wire_name(value)
    status = err.code().value[0]
    if reason is Reason.NONE and status in (Status.UNAVAILABLE, Status.DEADLINE_EXCEEDED):
        # gRPC's own, not the shard's: no connection (refused, reset, TLS handshake failed), or a
        # call that ran out of time without an answer. Both are retried like a shard that is down.
        reason = Reason.UNREACHABLE if status == Status.UNAVAILABLE else Reason.TIMED_OUT
        return Unavailable(f"shard at {address}: {err.details()}", reason)
    return error_from_wire(status, reason, f"shard at {address}: {err.details()}")


class GrpcControl(Control):
    """One channel to one shard; every call has the options' deadline."""

    def __init__(self, address: str, options: ConnectOptions):
        self.address = address
        self.options = options
        self.metadata = (("authorization", bearer(options.token)),) if options.token else None
        if options.tls:
            creds = grpc.ssl_channel_credentials(
                read_pem(options.tls_ca), read_pem(options.tls_key), read_pem(options.tls_cert)
            )
            self.channel = grpc.secure_channel(address, creds, options=list(GRPC_OPTIONS))
        else:
            self.channel = grpc.insecure_channel(address, options=list(GRPC_OPTIONS))
        self.unary = {
            name: self.channel.unary_unary(
                f"/{SERVICE}/{name}", request_serializer=_serialize, response_deserializer=reply.FromString
            )
            for name, reply in _UNARY.items()
        }
        self.init_call = self.channel.stream_unary(
            f"/{SERVICE}/Init", request_serializer=_serialize, response_deserializer=ps_pb2.InitReply.FromString
        )
        self.pull_call = self.channel.unary_stream(
            f"/{SERVICE}/Pull", request_serializer=_serialize, response_deserializer=framing.decode_pull_reply
        )
        self.push_call = self.channel.stream_unary(
            f"/{SERVICE}/Push",
            request_serializer=framing.encode_push_request,
            response_deserializer=ps_pb2.PushReply.FromString,
        )
        self.chunk_bytes = options.chunk_bytes  # what Init and Push send: never more than the shard takes

    def call(self, method: str, request, timeout_s: float | None = None):
        try:
            return self.unary[method](request, timeout=timeout_s or self.options.deadline_s, metadata=self.metadata)
        except grpc.RpcError as err:
            raise domain_error(err, self.address) from None

    def register(
        self, *, spec_hash: str, worker_id: int, start_clock: int, host: str, observer: bool = False
    ) -> Registration:
        reply = self.call(
            "Register",
            ps_pb2.RegisterRequest(
                spec_hash=spec_hash, worker_id=worker_id, start_clock=start_clock, host=host, observer=observer
            ),
        )
        if reply.max_chunk_bytes:  # 0: a shard that does not say
            self.chunk_bytes = min(self.options.chunk_bytes, reply.max_chunk_bytes)
        return registration_from_reply(reply)

    def init(self, spec: ModelSpec, values: np.ndarray, begin: int) -> tuple[bool, int]:
        spec_msg = ps_pb2.ModelSpecMsg(
            params=[ps_pb2.ParamInfo(name=p.name, shape=list(p.shape), dtype=p.dtype) for p in spec.params],
            hash=spec.hash(),
        )
        pieces = chunk_ranges(0, len(values), self.chunk_bytes // 4)

        def messages():
            for i, (a, b) in enumerate(pieces):
                chunk = ps_pb2.Chunk(offset=begin + a, dtype=FLOAT32, data=wire.encode(values[a:b], FLOAT32))
                if i == 0:
                    yield ps_pb2.InitRequest(spec=spec_msg, num_chunks=len(pieces), chunk=chunk)
                else:
                    yield ps_pb2.InitRequest(chunk=chunk)

        try:
            reply = self.init_call(messages(), timeout=self.options.deadline_s, metadata=self.metadata)
        except grpc.RpcError as err:
            raise domain_error(err, self.address) from None
        return reply.applied, reply.version

    def heartbeat(self, worker_id: int, *, leaving: bool = False, timeout_s: float | None = None) -> HeartbeatInfo:
        reply = self.call("Heartbeat", ps_pb2.HeartbeatRequest(worker_id=worker_id, leaving=leaving), timeout_s)
        return HeartbeatInfo(known=reply.known, lease_s=reply.lease_s, min_clock=reply.min_clock, version=reply.version)

    def stats(self) -> dict:
        reply = self.call("Stats", ps_pb2.StatsRequest())
        return _as_dict(reply)

    def checkpoint(self) -> tuple[str, int]:
        reply = self.call("Checkpoint", ps_pb2.CheckpointRequest())
        return reply.path, reply.version

    def shutdown(self, job_id: str) -> None:
        self.call("Shutdown", ps_pb2.ShutdownRequest(job_id=job_id))

    def describe(self) -> dict:
        """The shard's DescribeReply as plain values (``spec``: None before Init)."""
        reply = self.call("Describe", ps_pb2.DescribeRequest())
        described = _as_dict(reply)
        if not reply.HasField("spec"):
            described["spec"] = None
        return described

    def close(self) -> None:
        self.channel.close()


def open_control(address: str, options: ConnectOptions) -> GrpcControl:
    """The control connection to the shard at ``address`` (gRPC: the complete contract)."""
    return GrpcControl(address, options)


def registration_from_reply(reply: ps_pb2.RegisterReply) -> Registration:
    """A RegisterReply as a :class:`Registration`; the planes of a shard older than ``planes`` from its
    per-plane fields (``tcp_port``, ``shm_socket``)."""
    fields = {f.name: getattr(reply, f.name) for f in dataclasses.fields(Registration) if f.name != "planes"}
    planes = tuple((offer.name, offer.address) for offer in reply.planes)
    if not planes:
        planes = (
            ((CONTROL_PLANE, ""),)
            + ((("tcp", str(reply.tcp_port)),) if reply.tcp_port else ())
            + ((("shm", reply.shm_socket),) if reply.shm_socket else ())
        )
    return Registration(planes=planes, **fields)


def _serialize(message) -> bytes:
    return message.SerializeToString()


def _as_dict(message) -> dict:
    """Every field of a reply (defaults included) as plain Python values; nested messages as dicts."""
    out = {}
    for field in message.DESCRIPTOR.fields:
        value = getattr(message, field.name)
        if field.message_type is not None:
            value = [_as_dict(m) for m in value] if hasattr(value, "__len__") else _as_dict(value)
        elif not isinstance(value, (int, float, str, bool, bytes)):
            value = list(value)  # a repeated scalar
        out[field.name] = value
    return out


class GrpcDataPlane(DataPlane):
    """Pull and Push as gRPC streams of chunks of at most ``chunk_bytes``, on the control's channel."""

    name = "grpc"

    def __init__(self, control: GrpcControl):
        self.control = control

    def pull_into(self, out: np.ndarray, *, begin: int, worker_id: int, clock: int, timeout_s: float) -> int:
        c = self.control
        request = ps_pb2.PullRequest(worker_id=worker_id, clock=clock, chunk_bytes=c.options.chunk_bytes)
        version, covered, size = None, 0, len(out)
        call = c.pull_call(request, timeout=timeout_s, metadata=c.metadata)
        try:
            for frame in call:
                chunk = frame.chunk
                n = len(chunk.data) // 4
                if version is None:
                    version = frame.version
                if (
                    chunk.offset != begin + covered
                    or covered + n > size
                    or chunk.dtype != FLOAT32
                    or len(chunk.data) % 4
                ):
                    call.cancel()
                    raise BadReply(f"shard at {c.address} sent a chunk at {chunk.offset} that breaks its range")
                out[covered : covered + n] = np.frombuffer(chunk.data, dtype="<f4")
                covered += n
        except grpc.RpcError as err:
            raise domain_error(err, c.address) from None
        if covered != size:
            raise Unavailable(f"shard at {c.address}: pull stream ended early ({covered} of {size})")
        return version

    def push(
        self,
        grad: np.ndarray,
        *,
        begin: int,
        wire_dtype: int,
        worker_id: int,
        clock: int,
        version: int,
        timeout_s: float,
    ) -> PushResult:
        c = self.control
        pieces = chunk_ranges(0, len(grad), c.chunk_bytes // wire.ITEMSIZE[wire_dtype])

        def frames():
            for i, (a, b) in enumerate(pieces):
                data = (
                    memoryview(grad[a:b]).cast("B")
                    if wire_dtype == FLOAT32  # no copy: the codec joins it
                    else wire.encode(grad[a:b], wire_dtype)
                )
                chunk = framing.ChunkView(offset=begin + a, dtype=wire_dtype, data=data)
                if i == 0:
                    yield framing.PushFrame(
                        worker_id=worker_id, clock=clock, version=version, num_chunks=len(pieces), chunk=chunk
                    )
                else:
                    yield framing.PushFrame(chunk=chunk)

        try:
            reply = c.push_call(frames(), timeout=timeout_s, metadata=c.metadata)
        except grpc.RpcError as err:
            raise domain_error(err, c.address) from None
        return PushResult(Outcome(reply.outcome), reply.version, reply.staleness, reply.next_clock)

    def close(self) -> None:
        pass  # the channel is the control's


register_data_plane("grpc", lambda control, address, options: GrpcDataPlane(control))
