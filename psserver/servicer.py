"""The gRPC adapter: one thin method per RPC, domain errors mapped to status codes.

Decoding and validating a stream happens here (it is wire format); what a push
means happens in shard.py. An unexpected exception is logged and answered with
INTERNAL, and the server keeps serving.
"""

from __future__ import annotations

import functools
import itertools
import logging

import grpc
import numpy as np

from psgrid.psserver import framing, wire
from psgrid.psserver.exceptions import (InvalidArgument, NotInitialized, PSError, Restoring, SpecMismatch,
                                 Unauthenticated, UnknownWorker, WaitTimeout)
from psgrid.psserver.rpc import ps_pb2, ps_pb2_grpc
from psgrid.psserver.shard import Shard
from psgrid.psserver.sharding import chunk_ranges
from psgrid.psserver.spec import ModelSpec

log = logging.getLogger("psserver")

STATUS_CODES = {
    InvalidArgument: grpc.StatusCode.INVALID_ARGUMENT,
    SpecMismatch: grpc.StatusCode.FAILED_PRECONDITION,
    UnknownWorker: grpc.StatusCode.FAILED_PRECONDITION,
    NotInitialized: grpc.StatusCode.FAILED_PRECONDITION,
    Unauthenticated: grpc.StatusCode.UNAUTHENTICATED,
    Restoring: grpc.StatusCode.UNAVAILABLE,
    WaitTimeout: grpc.StatusCode.DEADLINE_EXCEEDED,
}
MAX_CHUNK_BYTES = 4 * 1024 * 1024 - 64 * 1024   # stay under gRPC's 4 MiB default message limit
_OUTCOMES = {"apply": ps_pb2.PushReply.APPLIED, "accumulate": ps_pb2.PushReply.ACCUMULATED,
             "drop_late": ps_pb2.PushReply.DROPPED_LATE, "duplicate": ps_pb2.PushReply.DUPLICATE}


def status_code(exc: PSError) -> grpc.StatusCode:
    for cls, code in STATUS_CODES.items():
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


def _rpc(method):
    """Map domain errors to status codes; log anything unexpected and keep serving."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            return method(self, request, context)
        except PSError as exc:
            if isinstance(exc, InvalidArgument):
                self.shard.reject()
            context.abort(status_code(exc), str(exc))
        except grpc.RpcError:
            raise
        except Exception as exc:  # noqa: BLE001 - the server must outlive a bug in one request
            if context.is_active():
                log.exception("unexpected error in %s", method.__name__)
                context.abort(grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
            raise

    return wrapper


def _stream_rpc(method):
    """The same mapping for server-streaming methods (generators)."""

    @functools.wraps(method)
    def wrapper(self, request, context):
        try:
            yield from method(self, request, context)
        except PSError as exc:
            if isinstance(exc, InvalidArgument):
                self.shard.reject()
            context.abort(status_code(exc), str(exc))

    return wrapper


def read_range(messages, begin: int, size: int, out: np.ndarray, float32_only: bool) -> tuple[int, int]:
    """Decode a stream of chunks that must tile ``[begin, begin+size)`` in order into ``out``.

    Returns (chunks read, payload bytes). Raises InvalidArgument on a gap, an
    overlap, a range outside the shard, a bad dtype, a non-finite value or a
    short stream. Each chunk is checked as it lands, while the next is still
    on the wire, so validation adds no pass over the whole range at the end.
    """
    covered = count = nbytes = 0
    for msg in messages:
        chunk = msg.chunk
        if float32_only and chunk.dtype != ps_pb2.FLOAT32:
            raise InvalidArgument("weights travel as FLOAT32 only")
        n = wire.element_count(chunk.data, chunk.dtype)
        if chunk.offset != begin + covered:
            raise InvalidArgument(f"chunk {count} starts at offset {chunk.offset}, expected {begin + covered}: "
                                  f"chunks must tile this shard's range [{begin}, {begin + size}) in order")
        if covered + n > size:
            raise InvalidArgument(f"chunk {count} runs past the end of this shard's range [{begin}, {begin + size})")
        piece = out[covered:covered + n]
        wire.decode_into(piece, chunk.data, chunk.dtype)
        if not wire.all_finite(piece):
            raise InvalidArgument(f"chunk {count} (offset {chunk.offset}) contains NaN or infinity")
        covered += n
        count += 1
        nbytes += len(chunk.data)
    if covered != size:
        raise InvalidArgument(f"stream ended early: chunks covered {covered} of {size} elements")
    return count, nbytes


class ParameterServerServicer(ps_pb2_grpc.ParameterServerServicer):
    def __init__(self, shard: Shard, on_shutdown=None, bulk_port: int = 0):
        self.shard = shard
        self.on_shutdown = on_shutdown
        self.bulk_port = bulk_port

    @_rpc
    def Register(self, request, context):
        joined = self.shard.register(request.spec_hash, request.worker_id, request.start_clock, request.host)
        s, c = self.shard, self.shard.config
        return ps_pb2.RegisterReply(
            worker_id=joined["worker_id"], start_clock=joined["start_clock"], mode=c.mode, staleness=c.staleness,
            backup_workers=c.backup_workers, lease_s=c.lease_s, begin=s.begin, end=s.end,
            total_size=s.spec.size if s.spec else 0, shard_index=c.shard_index, num_shards=c.num_shards,
            initialized=s.initialized, version=joined["version"], bulk_port=self.bulk_port)

    @_rpc
    def Init(self, request_iterator, context):
        messages = iter(request_iterator)
        first = next(messages, None)
        if first is None or not first.HasField("spec"):
            raise InvalidArgument("Init stream must start with a message carrying the model spec")
        spec = ModelSpec((p.name, tuple(p.shape), p.dtype or "float32") for p in first.spec.params)
        if first.spec.hash != spec.hash():
            raise InvalidArgument("Init spec hash does not match its parameters")
        begin, end = self.shard.layout(spec)
        values = np.empty(end - begin, dtype=np.float32)
        count, _ = read_range(itertools.chain([first], messages), begin, end - begin, values, float32_only=True)
        if count != first.num_chunks:
            raise InvalidArgument(f"Init declared {first.num_chunks} chunks but sent {count}")
        applied = self.shard.init(spec, values)
        return ps_pb2.InitReply(applied=applied, version=self.shard.version)

    @_stream_rpc
    def Pull(self, request, context):
        remaining = context.time_remaining()
        self.shard.wait_for_pull(request.worker_id, request.clock,
                                 None if remaining is None else max(0.0, remaining - 0.05),
                                 cancelled=lambda: not context.is_active())
        chunk_bytes = request.chunk_bytes or self.shard.config.chunk_bytes
        chunk_bytes = min(max(chunk_bytes, 4096), MAX_CHUNK_BYTES)
        version, snapshot = self.shard.snapshot()
        try:
            pieces = chunk_ranges(0, len(snapshot), chunk_bytes // 4)
            payload = memoryview(snapshot).cast("B")
            for i, (a, b) in enumerate(pieces):
                chunk = framing.ChunkView(offset=self.shard.begin + a, dtype=ps_pb2.FLOAT32,
                                          data=payload[4 * a:4 * b])
                # framing.encode_pull_reply (the registered serializer) copies the slice once.
                yield framing.PullFrame(version=version if i == 0 else 0,
                                        num_chunks=len(pieces) if i == 0 else 0, chunk=chunk)
        finally:
            self.shard.release_snapshot(snapshot)

    @_rpc
    def Push(self, request_iterator, context):
        messages = iter(request_iterator)
        first = next(messages, None)
        if first is None:
            raise InvalidArgument("empty Push stream")
        shard = self.shard
        shard.check_pusher(first.worker_id)
        grad = shard.pool.take()
        kept = False
        try:
            count, nbytes = read_range(itertools.chain([first], messages), shard.begin, shard.size, grad,
                                       float32_only=False)
            if count != first.num_chunks:
                raise InvalidArgument(f"Push declared {first.num_chunks} chunks but sent {count}")
            result = shard.push(first.worker_id, first.clock, first.version, grad, nbytes)
            kept = result.kept
        finally:
            if not kept:
                shard.pool.give(grad)
        return ps_pb2.PushReply(outcome=_OUTCOMES[result.outcome.value], version=result.version,
                                staleness=result.staleness, next_clock=result.next_clock)

    @_rpc
    def Heartbeat(self, request, context):
        known = self.shard.heartbeat(request.worker_id)
        if request.leaving and known:
            self.shard.leave(request.worker_id)
        return ps_pb2.HeartbeatReply(known=known, lease_s=self.shard.config.lease_s,
                                     min_clock=self.shard.policy.slowest_clock(), version=self.shard.version)

    @_rpc
    def Stats(self, request, context):
        stats = self.shard.stats()
        members = [ps_pb2.MemberInfo(**m) for m in stats.pop("members")]
        return ps_pb2.StatsReply(members=members, **stats)

    @_rpc
    def Checkpoint(self, request, context):
        path, version = self.shard.checkpoint()
        return ps_pb2.CheckpointReply(path=path, version=version)

    @_rpc
    def Shutdown(self, request, context):
        if self.on_shutdown is not None:
            self.on_shutdown()
        return ps_pb2.ShutdownReply()
