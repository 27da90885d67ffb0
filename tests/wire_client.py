"""A worker written from proto/ps.proto and docs/ (contract.md, wire.md) alone, as a client in another language would be.

It imports gRPC, the modules generated from the proto and the standard library: no other psgrid
code (tests/test_wire_client.py checks its imports). Every rule it follows is one the proto's
comments state: the spec hash, who assigns worker ids, the split of the flat vector, the largest
chunk, chunks in order, the wait for the whole job before the first push, the ``ps-reason`` names.
With ``data_plane="tcp"`` its pulls and pushes go over the shards' TCP data plane, in frames
written from docs/wire.md section 2 (the header layouts, the hello, the reason numbers, the close
rules), not from the shard's code.
"""

from __future__ import annotations

import hashlib
import socket
import struct
import time

import grpc

from psgrid.psserver.rpc import ps_pb2, ps_pb2_grpc

FLOAT32_BYTES = 4


# ----- the model-spec hash, as the proto's comment on ModelSpecMsg.hash spells it -------------------

_SHORT_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _json_string(text: str) -> str:
    """A JSON string, every character outside U+0020..U+007E escaped as \\uXXXX (UTF-16 units, lowercase hex)."""
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch in _SHORT_ESCAPES:
            out.append(_SHORT_ESCAPES[ch])
        elif 0x20 <= code <= 0x7E:
            out.append(ch)
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:  # a surrogate pair
            code -= 0x10000
            out.append(f"\\u{0xD800 + (code >> 10):04x}\\u{0xDC00 + (code & 0x3FF):04x}")
    out.append('"')
    return "".join(out)


def canonical_spec(params: list[tuple[str, list[int]]]) -> str:
    """``[["name",[d0,d1],"float32"],...]`` in layout order, no whitespace."""
    items = (f'[{_json_string(name)},[{",".join(str(int(d)) for d in shape)}],"float32"]' for name, shape in params)
    return "[" + ",".join(items) + "]"


def spec_hash(params: list[tuple[str, list[int]]]) -> str:
    """The first 32 lowercase hex digits of SHA-256 over the canonical text's bytes."""
    return hashlib.sha256(canonical_spec(params).encode("ascii")).hexdigest()[:32]


def shard_range(total: int, index: int, num_shards: int) -> tuple[int, int]:
    """Shard ``index`` of ``num_shards`` owns elements ``[N*i//S, N*(i+1)//S)``."""
    return total * index // num_shards, total * (index + 1) // num_shards


def pack(values) -> bytes:
    return struct.pack(f"<{len(values)}f", *values)


def unpack(data: bytes) -> list[float]:
    return list(struct.unpack(f"<{len(data) // FLOAT32_BYTES}f", data))


# ----- the TCP data plane, as docs/wire.md section 2 spells its frames ------------------------------

MAGIC = b"PST2"
OP_HELLO, OP_PULL, OP_PUSH = 1, 2, 3
DTYPE_FLOAT32 = 1
REQUEST = struct.Struct("<4sBBqqQQd")  # magic, op, dtype, worker, clock, version, nbytes, timeout: 46 bytes
REPLY = struct.Struct("<4sBBBQqqQ")  # magic, status, reason, outcome, version, staleness, next_clock, nbytes: 39
STATUS_UNAVAILABLE, STATUS_UNAUTHENTICATED = 14, 16
# Reason numbers, in order from 0 (docs/wire.md 2.5).
REASONS = (
    "none",
    "malformed",
    "bad_size",
    "bad_offset",
    "bad_dtype",
    "non_finite",
    "bad_chunk_count",
    "bad_value",
    "bad_spec",
    "spec_mismatch",
    "unknown_worker",
    "not_initialized",
    "unauthenticated",
    "shutting_down",
    "wait_timeout",
    "no_checkpoint_dir",
    "unreachable",
    "bad_reply",
    "timed_out",
    "checkpoint_failed",
    "restoring",
    "wrong_job",
    "too_many_connections",
    "chunk_too_large",
    "future_version",
    "future_clock",
)


class Refused(Exception):
    """A shard's refusal on the TCP plane: its gRPC status code, its reason's name and its text."""

    def __init__(self, status: int, reason: int, text: str):
        self.status, self.text = status, text
        self.reason = REASONS[reason] if reason < len(REASONS) else "none"
        super().__init__(f"status {status} ({self.reason}): {text}")


def _receive(sock: socket.socket, nbytes: int) -> bytearray:
    data = bytearray(nbytes)
    view = memoryview(data)
    while view.nbytes:
        got = sock.recv_into(view)
        if not got:
            raise ConnectionError("the shard closed the data-plane connection")
        view = view[got:]
    return data


class TcpPlane:
    """One connection to one shard's TCP data port: a hello with the token, then PULL and PUSH in turn."""

    def __init__(self, host: str, port: int, token: str, timeout_s: float):
        self.address, self.token, self.timeout_s = (host, port), token, timeout_s
        self.sock: socket.socket | None = None

    def _connection(self) -> socket.socket:
        if self.sock is None:
            sock = socket.create_connection(self.address, timeout=self.timeout_s)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            token = self.token.encode()
            sock.sendall(REQUEST.pack(MAGIC, OP_HELLO, 0, 0, 0, 0, len(token), 0.0) + token)
            self.sock = sock
            self._reply()  # a refused hello: the shard closes, and so do we
        return self.sock

    def _reply(self) -> tuple[int, int, int, int, int]:
        """(outcome, version, staleness, next_clock, nbytes) of an OK reply; a refusal, its text read, raised."""
        try:
            magic, status, reason, outcome, version, staleness, next_clock, nbytes = REPLY.unpack(
                _receive(self.sock, REPLY.size)
            )
            if magic != MAGIC:
                raise ConnectionError(f"not a psgrid data-plane reply: {magic!r}")
            if status:
                refused = Refused(status, reason, _receive(self.sock, nbytes).decode(errors="replace"))
                if status in (STATUS_UNAVAILABLE, STATUS_UNAUTHENTICATED) or refused.reason == "malformed":
                    self.close()  # the shard closes these connections
                raise refused
        except (OSError, ConnectionError):
            self.close()  # out of step: never reused
            raise
        return outcome, version, staleness, next_clock, nbytes

    def pull(self, worker_id: int, clock: int, nbytes: int) -> tuple[int, bytearray]:
        """(version, this shard's range of the weights as float32 bytes)."""
        sock = self._connection()
        sock.sendall(REQUEST.pack(MAGIC, OP_PULL, DTYPE_FLOAT32, worker_id, clock, 0, 0, self.timeout_s))
        _, version, _, _, size = self._reply()
        if size != nbytes:
            self.close()
            raise ConnectionError(f"the shard sent {size} bytes for a range of {nbytes}")
        return version, _receive(sock, size)

    def push(self, worker_id: int, clock: int, version: int, payload) -> tuple[int, int, int, int]:
        """(outcome, version, staleness, next_clock) of one push of this shard's range, float32 bytes."""
        sock = self._connection()
        sock.sendall(
            REQUEST.pack(MAGIC, OP_PUSH, DTYPE_FLOAT32, worker_id, clock, version, len(payload), self.timeout_s)
        )
        sock.sendall(payload)
        try:
            return self._reply()[:4]
        except Refused:
            self.close()  # after any refused push (docs/wire.md 2.8)
            raise

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def ps_reason(err: grpc.RpcError) -> str:
    """The refusal's reason name (trailing metadata ``ps-reason``), "" when gRPC itself refused."""
    return dict(err.trailing_metadata() or ()).get("ps-reason", "")


class WireWorker:
    """One worker of a job: ``join``, then ``pull`` and ``push`` in turn, then ``leave``.

    Parameters
    ----------
    addresses : list of str
        ``host:port`` of shard 0, 1, ... in shard order.
    params : list of (name, shape)
        The model's float32 parameters in layout order.
    token : str
        The job's bearer token.
    world : int
        The job's number of workers (sync and ssp wait for all of them before the first push).
    data_plane : str
        "grpc" (Pull and Push streams of chunks) or "tcp" (the TCP data plane every shard must then offer).
    """

    def __init__(
        self,
        addresses: list[str],
        params: list[tuple[str, list[int]]],
        token: str,
        world: int,
        timeout_s: float = 10.0,
        data_plane: str = "grpc",
    ):
        self.params, self.world, self.timeout_s, self.data_plane = params, world, timeout_s, data_plane
        self.token, self.addresses = token, addresses
        self.tcp: list[TcpPlane] = []
        self.total = sum(_product(shape) for _, shape in params)
        self.hash = spec_hash(params)
        self.metadata = (("authorization", f"Bearer {token}"),)
        self.channels = [grpc.insecure_channel(a) for a in addresses]
        self.stubs = [ps_pb2_grpc.ParameterServerStub(ch) for ch in self.channels]
        self.ranges = [shard_range(self.total, i, len(addresses)) for i in range(len(addresses))]
        self.worker_id = -1
        self.clock = 0
        self.versions = [0] * len(addresses)
        self.max_chunk_bytes = [0] * len(addresses)
        self.mode = ""

    def _call(self, method, request):
        return method(request, timeout=self.timeout_s, metadata=self.metadata)

    def join(self, init_values: list[float] | None = None) -> WireWorker:
        """Register (shard 0 assigns the id, every other shard takes it), wait for the job, Init if needed."""
        replies = [
            self._call(
                self.stubs[0].Register,
                ps_pb2.RegisterRequest(spec_hash=self.hash, worker_id=-1, start_clock=-1, host="wire-client"),
            )
        ]
        self.worker_id = replies[0].worker_id
        for stub in self.stubs[1:]:
            replies.append(
                self._call(
                    stub.Register,
                    ps_pb2.RegisterRequest(
                        spec_hash=self.hash, worker_id=self.worker_id, start_clock=-1, host="wire-client"
                    ),
                )
            )
        for i, reply in enumerate(replies):
            assert reply.shard_index == i and reply.num_shards == len(self.stubs)
        self.mode = replies[0].mode
        self.clock = min(r.start_clock for r in replies)
        self.versions = [r.version for r in replies]
        self.max_chunk_bytes = [r.max_chunk_bytes for r in replies]
        if self.data_plane == "tcp":
            self.tcp = [self._tcp_plane(i, reply) for i, reply in enumerate(replies)]
        members = self.wait_for_job()
        uninitialized = [i for i, s in enumerate(members) if not s.initialized]
        # The first writer wins on each shard: the live member with the lowest id sends, the others wait.
        if uninitialized and init_values is not None and self.worker_id == min(m.worker_id for m in members[0].members):
            for i in uninitialized:
                self.init(i, init_values)
        deadline = time.monotonic() + self.timeout_s
        while not all(self._call(stub.Stats, ps_pb2.StatsRequest()).initialized for stub in self.stubs):
            assert time.monotonic() < deadline, "no worker sent Init"
            time.sleep(0.01)
        return self

    def _tcp_plane(self, shard: int, reply) -> TcpPlane:
        """The shard's TCP data port, offered in RegisterReply.planes, on the host its gRPC address names."""
        ports = [offer.address for offer in reply.planes if offer.name == "tcp"]
        assert ports, f"shard {shard} offers no TCP data plane: {[offer.name for offer in reply.planes]}"
        host = self.addresses[shard].rsplit(":", 1)[0].strip("[]")
        return TcpPlane(host, int(ports[0]), self.token, self.timeout_s)

    def wait_for_job(self) -> list:
        """Until every shard counts ``world`` workers, live (``members``) or gone (``departed``)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            stats = [self._call(stub.Stats, ps_pb2.StatsRequest()) for stub in self.stubs]
            if all(len({m.worker_id for m in s.members} | set(s.departed)) >= self.world for s in stats):
                return stats
            assert time.monotonic() < deadline, "the job's workers did not all join"
            time.sleep(0.01)

    def _chunks(self, shard: int, values) -> list[tuple[int, bytes]]:
        """This shard's range as chunks of at most its ``max_chunk_bytes``, in order: (offset, bytes).

        ``values``: the whole flat vector, as float32 bytes or as a list of floats.
        """
        data = _as_bytes(values)
        begin, end = self.ranges[shard]
        step = self.max_chunk_bytes[shard] // FLOAT32_BYTES
        return [
            (begin + a, bytes(data[FLOAT32_BYTES * (begin + a) : FLOAT32_BYTES * min(begin + a + step, end)]))
            for a in range(0, end - begin, step)
        ]

    def init(self, shard: int, values) -> None:
        spec = ps_pb2.ModelSpecMsg(
            params=[ps_pb2.ParamInfo(name=n, shape=list(s), dtype="float32") for n, s in self.params], hash=self.hash
        )
        chunks = self._chunks(shard, values)

        def messages():
            for k, (offset, data) in enumerate(chunks):
                chunk = ps_pb2.Chunk(offset=offset, dtype=ps_pb2.FLOAT32, data=data)
                yield (
                    ps_pb2.InitRequest(spec=spec, num_chunks=len(chunks), chunk=chunk)
                    if k == 0
                    else ps_pb2.InitRequest(chunk=chunk)
                )

        self.stubs[shard].Init(messages(), timeout=self.timeout_s, metadata=self.metadata)

    def pull(self) -> list[float]:
        """The whole flat vector, each shard's range after its consistency wait for this clock."""
        return unpack(self.pull_bytes())

    def pull_bytes(self) -> bytearray:
        """The whole flat vector as float32 bytes, through the worker's data plane."""
        out = bytearray()
        for i, stub in enumerate(self.stubs):
            begin, end = self.ranges[i]
            if self.tcp:
                self.versions[i], data = self.tcp[i].pull(self.worker_id, self.clock, FLOAT32_BYTES * (end - begin))
                out += data
                continue
            replies = list(
                stub.Pull(
                    ps_pb2.PullRequest(worker_id=self.worker_id, clock=self.clock),
                    timeout=self.timeout_s,
                    metadata=self.metadata,
                )
            )
            assert replies[0].num_chunks == len(replies)
            self.versions[i] = replies[0].version
            for reply in replies:  # in order, tiling [begin, end)
                assert reply.chunk.offset == len(out) // FLOAT32_BYTES and reply.chunk.dtype == ps_pb2.FLOAT32
                out += reply.chunk.data
            assert len(out) == FLOAT32_BYTES * end
        return out

    def push(self, grad) -> list:
        """One gradient (the whole flat vector: float32 bytes or a list of floats) at this worker's clock, the
        versions of the last pull; returns each shard's answer (PushReply, or on TCP (outcome, version,
        staleness, next_clock))."""
        data = _as_bytes(grad)
        replies = []
        for i, stub in enumerate(self.stubs):
            if self.tcp:
                begin, end = self.ranges[i]
                replies.append(
                    self.tcp[i].push(
                        self.worker_id,
                        self.clock,
                        self.versions[i],
                        memoryview(data)[FLOAT32_BYTES * begin : FLOAT32_BYTES * end],
                    )
                )
                continue
            chunks = self._chunks(i, data)

            def requests(i=i, chunks=chunks):
                for k, (offset, piece) in enumerate(chunks):
                    chunk = ps_pb2.Chunk(offset=offset, dtype=ps_pb2.FLOAT32, data=piece)
                    yield (
                        ps_pb2.PushRequest(
                            worker_id=self.worker_id,
                            clock=self.clock,
                            version=self.versions[i],
                            num_chunks=len(chunks),
                            chunk=chunk,
                        )
                        if k == 0
                        else ps_pb2.PushRequest(chunk=chunk)
                    )

            replies.append(stub.Push(requests(), timeout=self.timeout_s, metadata=self.metadata))
        self.clock = max(r[3] if self.tcp else r.next_clock for r in replies)
        return replies

    def leave(self) -> None:
        for stub in self.stubs:
            self._call(stub.Heartbeat, ps_pb2.HeartbeatRequest(worker_id=self.worker_id, leaving=True))

    def close(self) -> None:
        for plane in self.tcp:
            plane.close()
        for channel in self.channels:
            channel.close()


def _as_bytes(values) -> bytes:
    """Float32 bytes as they are, or a list of floats packed little-endian."""
    return values if isinstance(values, (bytes, bytearray, memoryview)) else pack(values)


def _product(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
