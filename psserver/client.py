"""ShardedClient: one channel per shard; pulls into and pushes from caller-owned flat buffers.

All shards are pulled and pushed concurrently. Every call has a deadline;
UNAVAILABLE is retried with exponential backoff for up to ``retry_s``; a shard
that forgot this worker (restarted from a checkpoint older than its join) is
re-registered and the call retried. A retried push carries the same
(worker, clock), so the shard applies it once.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np

from psgrid.psserver import framing, wire
from psgrid.psserver.exceptions import InvalidArgument, RemoteError, ShardUnavailable
from psgrid.psserver.bulk import BulkClient, BulkError, client_ssl_context
from psgrid.psserver.config import DEFAULT_CHUNK_BYTES
from psgrid.psserver.rpc import ps_pb2, ps_pb2_grpc
from psgrid.psserver.servicer import MAX_CHUNK_BYTES
from psgrid.psserver.sharding import chunk_ranges, shard_ranges
from psgrid.psserver.spec import ModelSpec

log = logging.getLogger("psserver.client")

CHANNEL_OPTIONS = [
    ("grpc.max_receive_message_length", MAX_CHUNK_BYTES + (1 << 16)),
    ("grpc.max_send_message_length", MAX_CHUNK_BYTES + (1 << 16)),
]
_OUTCOME_NAMES = {v: k for k, v in ps_pb2.PushReply.Outcome.items()}


def _read(path):
    if not path:
        return None
    with open(path, "rb") as f:     # closed at once: a leaked handle is a ResourceWarning (an error in tests)
        return f.read()


class ShardedClient:
    """A worker's (or an observer's) connection to every shard of a job.

    Parameters
    ----------
    addresses : list of str
        ``host:port`` of shard 0, 1, ... in shard order.
    chunk_bytes : int
        Largest chunk on the wire (default 1 MiB).
    wire_dtype : {"float32", "float16", "bfloat16"}
        Element type of pushed gradients.
    deadline_s : float
        Deadline of every call; a consistency wait that outlives it is re-issued
        for up to ``max_wait_s`` in all.
    retry_s : float
        How long UNAVAILABLE is retried with backoff before ShardUnavailable.
    token, tls_ca, tls_cert, tls_key
        Bearer token and (mutual) TLS material; all off by default.
    bulk : bool
        Move Pull and Push payloads over each shard's raw TCP data plane when it
        offers one (psserver/bulk.py); gRPC otherwise.
    """

    def __init__(self, addresses: list[str], *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 wire_dtype: str = "float32", deadline_s: float = 60.0, retry_s: float = 30.0,
                 max_wait_s: float = 3600.0, token: str | None = None, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None, host: str | None = None,
                 bulk: bool = True):
        if not addresses:
            raise InvalidArgument("ShardedClient needs at least one shard address")
        if not 4096 <= chunk_bytes <= MAX_CHUNK_BYTES:
            raise InvalidArgument(f"chunk_bytes must be in [4096, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
        self.addresses = list(addresses)
        self.chunk_elems = chunk_bytes // 4
        self.chunk_bytes = chunk_bytes
        self.wire_dtype = wire.wire_dtype(wire_dtype)
        self.deadline_s, self.retry_s, self.max_wait_s = deadline_s, retry_s, max_wait_s
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        self.host = host or socket.gethostname()
        self.token = token
        self.use_bulk = bulk
        self.bulk: list[BulkClient | None] = [None] * len(self.addresses)
        self._bulk_lock = threading.Lock()
        self.bulk_ssl = client_ssl_context(tls_ca, tls_cert, tls_key) if (tls_ca or tls_cert) else None
        if tls_ca or tls_cert:
            creds = grpc.ssl_channel_credentials(_read(tls_ca), _read(tls_key), _read(tls_cert))
            self.channels = [grpc.secure_channel(a, creds, options=CHANNEL_OPTIONS) for a in self.addresses]
        else:
            self.channels = [grpc.insecure_channel(a, options=CHANNEL_OPTIONS) for a in self.addresses]
        self.stubs = [ps_pb2_grpc.ParameterServerStub(c) for c in self.channels]
        # The bulk methods use the zero-copy framing (same bytes on the wire as the generated code).
        self.pull_calls = [c.unary_stream("/ps.ParameterServer/Pull",
                                          request_serializer=ps_pb2.PullRequest.SerializeToString,
                                          response_deserializer=framing.decode_pull_reply)
                           for c in self.channels]
        self.push_calls = [c.stream_unary("/ps.ParameterServer/Push",
                                          request_serializer=framing.encode_push_request,
                                          response_deserializer=ps_pb2.PushReply.FromString)
                           for c in self.channels]
        # Two calls per shard may run at once: a push and the pull that overlaps it.
        self.executor = ThreadPoolExecutor(max_workers=2 * len(self.addresses) + 2,
                                           thread_name_prefix="ps-client")
        self.spec: ModelSpec | None = None
        self.ranges: list[tuple[int, int]] = []
        self.worker_id = -1
        self.clock = 0
        self.versions = [0] * len(self.addresses)
        self.mode = ""
        self.lease_s = 0.0
        self._heartbeat_stop = threading.Event()
        self._heartbeat_thread: threading.Thread | None = None

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    # ----- plumbing ---------------------------------------------------------------------------

    def _call(self, shard: int, fn, *, reregister: bool = True):
        """Run ``fn(stub)`` with retries on UNAVAILABLE and re-registration on a forgotten worker."""
        start = time.monotonic()
        backoff = 0.05
        relearn_bulk = False
        while True:
            try:
                result = fn(self.stubs[shard])
                if relearn_bulk:
                    self._relearn_bulk(shard)
                return result
            except (ConnectionError, TimeoutError, OSError) as exc:
                if isinstance(exc, BulkError):
                    raise
                # A broken bulk connection is a shard that is down or restarting: like UNAVAILABLE.
                # A restarted shard listens on another bulk port: retry over gRPC, and once the
                # shard answers again, learn its bulk port anew.
                self._drop_bulk(shard)
                relearn_bulk = True
                if time.monotonic() - start < self.retry_s:
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 1.0)
                    continue
                raise ShardUnavailable(f"shard {shard} at {self.addresses[shard]} unreachable for "
                                       f"{self.retry_s:.0f}s: {exc}") from exc
            except (grpc.RpcError, BulkError) as err:
                code = err.code()
                if code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - start < self.retry_s:
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 1.0)
                    continue
                if code == grpc.StatusCode.UNAVAILABLE:
                    raise ShardUnavailable(f"shard {shard} at {self.addresses[shard]} unavailable for "
                                           f"{self.retry_s:.0f}s: {err.details()}") from err
                if (reregister and code == grpc.StatusCode.FAILED_PRECONDITION and self.worker_id >= 0
                        and "register again" in (err.details() or "")):
                    log.warning("shard %d forgot worker %d; registering again", shard, self.worker_id)
                    self._register_one(shard, self.worker_id, self.clock)
                    reregister = False
                    continue
                raise

    def _drop_bulk(self, shard: int) -> None:
        with self._bulk_lock:
            bulk, self.bulk[shard] = self.bulk[shard], None
        if bulk is not None:
            bulk.close()

    def _relearn_bulk(self, shard: int) -> None:
        """Register again (a no-op for a live worker) to learn a restarted shard's bulk port."""
        if self.use_bulk and self.worker_id >= 0 and self.bulk[shard] is None:
            try:
                self._register_one(shard, self.worker_id, self.clock)
            except grpc.RpcError as err:
                log.warning("shard %d: staying on gRPC, could not learn its bulk port: %s", shard, err.details())

    def _map(self, fn, shards=None):
        shards = range(self.num_shards) if shards is None else shards
        if len(shards) == 1:
            return [fn(shards[0])]      # no thread hop: it is most of a small call's latency
        futures = [self.executor.submit(fn, i) for i in shards]
        return [f.result() for f in futures]

    # ----- membership -------------------------------------------------------------------------

    def _register_one(self, shard: int, worker_id: int, start_clock: int):
        request = ps_pb2.RegisterRequest(spec_hash=self.spec.hash() if self.spec else "", worker_id=worker_id,
                                         start_clock=start_clock, host=self.host)
        reply = self.stubs[shard].Register(request, timeout=self.deadline_s, metadata=self.metadata)
        if reply.num_shards != self.num_shards or reply.shard_index != shard:
            raise InvalidArgument(f"address {self.addresses[shard]} is shard {reply.shard_index} of "
                                  f"{reply.num_shards}, but was given as shard {shard} of {self.num_shards}")
        if self.use_bulk and reply.bulk_port:
            host = self.addresses[shard].rsplit(":", 1)[0].strip("[]")
            with self._bulk_lock:    # a pull and a push may both relearn the port at once
                if self.bulk[shard] is None:
                    self.bulk[shard] = BulkClient(host, reply.bulk_port, self.token, self.bulk_ssl)
        return reply

    def register(self, spec: ModelSpec, worker_id: int = -1) -> int:
        """Join every shard under one worker id, all at the same starting clock; returns the id."""
        self.spec = spec
        self.ranges = shard_ranges(spec.size, self.num_shards)
        first = self._call(0, lambda stub: self._register_one(0, worker_id, -1), reregister=False)
        self.worker_id, self.clock = first.worker_id, first.start_clock
        self.mode, self.lease_s = first.mode, first.lease_s
        replies = self._map(lambda i: self._call(i, lambda stub: self._register_one(i, self.worker_id, self.clock),
                                                 reregister=False), range(1, self.num_shards))
        for reply in [first, *replies]:
            self.versions[reply.shard_index] = reply.version
        return self.worker_id

    def start_heartbeats(self, interval_s: float | None = None) -> None:
        """Renew the lease from a background thread every ``interval_s`` (default lease/4)."""
        interval = interval_s or max(0.05, self.lease_s / 4)

        def beat():
            while not self._heartbeat_stop.wait(interval):
                for i, stub in enumerate(self.stubs):
                    try:
                        stub.Heartbeat(ps_pb2.HeartbeatRequest(worker_id=self.worker_id),
                                       timeout=max(interval, 1.0), metadata=self.metadata)
                    except grpc.RpcError:
                        pass    # the next data call reports (and retries) a dead shard

        self._heartbeat_thread = threading.Thread(target=beat, name="ps-heartbeat", daemon=True)
        self._heartbeat_thread.start()

    def leave(self) -> None:
        """Tell every shard this worker has finished, so sync and ssp stop waiting for it."""
        self.stop_heartbeats()
        if self.worker_id < 0:
            return

        def one(i):
            try:
                self.stubs[i].Heartbeat(ps_pb2.HeartbeatRequest(worker_id=self.worker_id, leaving=True),
                                        timeout=self.deadline_s, metadata=self.metadata)
            except grpc.RpcError as err:
                log.warning("shard %d did not take worker %d's leave: %s", i, self.worker_id, err.details())
        self._map(one)

    def stop_heartbeats(self) -> None:
        self._heartbeat_stop.set()
        if self._heartbeat_thread is not None:
            self._heartbeat_thread.join(timeout=5)

    # ----- init -------------------------------------------------------------------------------

    def init(self, flat: np.ndarray, spec: ModelSpec | None = None) -> bool:
        """Offer initial weights to every shard; True if this call set them (first writer wins)."""
        spec = spec or self.spec
        if spec is None:
            raise InvalidArgument("init needs a model spec: call register(spec) first or pass spec=")
        self._check_flat(flat, spec)
        ranges = shard_ranges(spec.size, self.num_shards)
        spec_msg = ps_pb2.ModelSpecMsg(
            params=[ps_pb2.ParamInfo(name=p.name, shape=list(p.shape), dtype=p.dtype) for p in spec.params],
            hash=spec.hash())

        def messages(begin, end):
            pieces = chunk_ranges(begin, end, self.chunk_elems)
            for i, (a, b) in enumerate(pieces):
                chunk = ps_pb2.Chunk(offset=a, dtype=ps_pb2.FLOAT32, data=flat[a:b].tobytes())
                if i == 0:
                    yield ps_pb2.InitRequest(spec=spec_msg, num_chunks=len(pieces), chunk=chunk)
                else:
                    yield ps_pb2.InitRequest(chunk=chunk)

        def one(i):
            begin, end = ranges[i]
            return self._call(i, lambda stub: stub.Init(messages(begin, end), timeout=self.deadline_s,
                                                        metadata=self.metadata)).applied

        return any(self._map(one))

    def _check_flat(self, flat: np.ndarray, spec: ModelSpec) -> None:
        if not isinstance(flat, np.ndarray) or flat.dtype != np.float32 or flat.shape != (spec.size,):
            raise InvalidArgument(f"flat buffer must be a float32 numpy array of shape ({spec.size},)")
        if not flat.flags.c_contiguous:
            raise InvalidArgument("flat buffer must be contiguous")

    # ----- pull and push ----------------------------------------------------------------------

    def pull(self, out: np.ndarray, clock: int | None = None) -> list[int]:
        """Fill ``out`` with every shard's weights once the consistency rule allows; returns versions."""
        if self.spec is None:
            raise InvalidArgument("pull before register(): the client does not know the model layout")
        self._check_flat(out, self.spec)
        clock = self.clock if clock is None else clock
        versions = self._map(lambda i: self._pull_one(i, out, clock))
        self.versions = list(versions)
        return versions

    def _pull_one(self, shard: int, out: np.ndarray, clock: int) -> int:
        begin, end = self.ranges[shard]
        request = ps_pb2.PullRequest(worker_id=self.worker_id, clock=clock, chunk_bytes=self.chunk_bytes)
        waited_since = time.monotonic()

        def attempt(stub):
            version = None
            covered = 0
            for reply in self.pull_calls[shard](request, timeout=self.deadline_s, metadata=self.metadata):
                if version is None:
                    version = reply.version
                chunk = reply.chunk
                n = len(chunk.data) // 4
                if chunk.offset != begin + covered or covered + n > end - begin or chunk.dtype != ps_pb2.FLOAT32:
                    raise InvalidArgument(f"shard {shard} sent a chunk at {chunk.offset} outside its range")
                out[chunk.offset:chunk.offset + n] = np.frombuffer(chunk.data, dtype="<f4")
                covered += n
            if covered != end - begin:
                raise InvalidArgument(f"shard {shard} pull stream ended early ({covered} of {end - begin})")
            return version

        def bulk_or_grpc_attempt(stub):
            bulk = self.bulk[shard]     # looked up per attempt: a retry after a bulk failure goes over gRPC
            if bulk is None:
                return attempt(stub)
            view = memoryview(out[begin:end]).cast("B")
            return bulk.pull_into(view, self.worker_id, clock, self.deadline_s)

        while True:
            try:
                return self._call(shard, bulk_or_grpc_attempt)
            except (grpc.RpcError, BulkError) as err:
                # A consistency wait may legitimately outlast one deadline (slow peers); keep waiting.
                if (err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                        and time.monotonic() - waited_since < self.max_wait_s):
                    continue
                raise

    def push(self, grad: np.ndarray, versions: list[int] | None = None) -> list[dict]:
        """Push one gradient (flat float32) to every shard at the current clock; advances the clock.

        ``versions`` are the shard versions the gradient was computed from (default: those of
        the last pull); pass them explicitly when a pull overlaps this push.
        """
        if self.spec is None or self.worker_id < 0:
            raise InvalidArgument("push before register(): call register(spec) first")
        self._check_flat(grad, self.spec)
        clock = self.clock
        versions = list(self.versions if versions is None else versions)
        results = self._map(lambda i: self._push_one(i, grad, clock, versions[i]))
        self.clock = max(r["next_clock"] for r in results)
        return results

    def _push_one(self, shard: int, grad: np.ndarray, clock: int, version: int) -> dict:
        begin, end = self.ranges[shard]
        pieces = chunk_ranges(begin, end, self.chunk_bytes // (4 if self.wire_dtype == ps_pb2.FLOAT32 else 2))

        def messages():
            for i, (a, b) in enumerate(pieces):
                if self.wire_dtype == ps_pb2.FLOAT32:
                    data = memoryview(grad[a:b]).cast("B")    # no copy: the serializer joins it once
                else:
                    data = wire.encode(grad[a:b], self.wire_dtype)
                chunk = framing.ChunkView(offset=a, dtype=self.wire_dtype, data=data)
                if i == 0:
                    yield framing.PushFrame(worker_id=self.worker_id, clock=clock, version=version,
                                            num_chunks=len(pieces), chunk=chunk)
                else:
                    yield framing.PushFrame(chunk=chunk)

        def attempt(stub):
            bulk = self.bulk[shard]     # looked up per attempt: a retry after a bulk failure goes over gRPC
            if bulk is not None:
                if self.wire_dtype == ps_pb2.FLOAT32:
                    payload = memoryview(grad[begin:end]).cast("B")
                else:
                    payload = wire.encode(grad[begin:end], self.wire_dtype)
                return bulk.push(payload, self.wire_dtype, self.worker_id, clock, version, self.deadline_s)
            reply = self.push_calls[shard](messages(), timeout=self.deadline_s, metadata=self.metadata)
            return {"outcome": _OUTCOME_NAMES[reply.outcome], "version": reply.version,
                    "staleness": reply.staleness, "next_clock": reply.next_clock}

        return {"shard": shard, **self._call(shard, attempt)}

    # ----- observers and control --------------------------------------------------------------

    def stats(self) -> list[dict]:
        """Every shard's clocks, members and counters (see StatsReply in proto/ps.proto)."""
        from google.protobuf.json_format import MessageToDict

        def one(i):
            reply = self._control(i, lambda stub: stub.Stats(ps_pb2.StatsRequest(), timeout=self.deadline_s,
                                                             metadata=self.metadata))
            d = MessageToDict(reply, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
            for key in ("version", "begin", "end", "min_clock", "max_clock", "pushes", "pulls", "bytes_in",
                        "bytes_out", "applied_updates", "dropped_late", "duplicates", "evictions", "rejected",
                        "max_staleness", "total_size"):
                d[key] = int(d[key])
            d["staleness_counts"] = [int(x) for x in d["staleness_counts"]]
            for m in d["members"]:
                m["worker_id"], m["clock"] = int(m["worker_id"]), int(m["clock"])
            return d

        return self._map(one)

    def _control(self, shard: int, fn):
        """A control call: retried while the shard is unavailable; a refusal becomes RemoteError."""
        try:
            return self._call(shard, fn, reregister=False)
        except grpc.RpcError as err:
            raise RemoteError(err.code().name, f"shard {shard} at {self.addresses[shard]}: {err.details()}") from err

    def checkpoint(self) -> list[str]:
        """Ask every shard to write a checkpoint now; returns their paths."""
        return self._map(lambda i: self._control(i, lambda stub: stub.Checkpoint(
            ps_pb2.CheckpointRequest(), timeout=self.deadline_s, metadata=self.metadata)).path)

    def wait_for_members(self, count: int, timeout_s: float) -> int:
        """Block until shard 0 has at least ``count`` live members, or ``timeout_s`` passed; returns the count.

        Sync and ssp count the members they have: a worker that starts seconds before the
        others would otherwise close its first rounds alone.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._control(0, lambda stub: stub.Stats(ps_pb2.StatsRequest(), timeout=self.deadline_s,
                                                             metadata=self.metadata))
            if len(reply.members) >= count or time.monotonic() >= deadline:
                return len(reply.members)
            time.sleep(0.05)

    def shutdown(self) -> None:
        """Ask every shard to stop (each writes a final checkpoint where it has a directory)."""
        def one(i):
            try:
                self.stubs[i].Shutdown(ps_pb2.ShutdownRequest(), timeout=self.deadline_s, metadata=self.metadata)
            except grpc.RpcError as err:
                if err.code() != grpc.StatusCode.UNAVAILABLE:    # already gone is what we asked for
                    raise RemoteError(err.code().name, f"shard {i} at {self.addresses[i]}: {err.details()}") from err
        self._map(one)

    def observe(self, spec: ModelSpec) -> None:
        """Use this client as an observer: pulls never wait and never count as a worker's."""
        self.spec = spec
        self.ranges = shard_ranges(spec.size, self.num_shards)
        self.worker_id = -1

    def close(self) -> None:
        self.stop_heartbeats()
        self.executor.shutdown(wait=True)
        for bulk in self.bulk:
            if bulk is not None:
                bulk.close()
        for channel in self.channels:
            channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
