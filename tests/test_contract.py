"""One contract, every transport: the same bad input gets the same status and reason, and changes nothing.

Each case is sent by a raw sender of its transport (the generated gRPC stub, as any client
generated from proto/ps.proto would; or the TCP data plane's frames by hand), so the
shard's checks are what is tested, not the client's.
"""

from __future__ import annotations

import socket

import grpc
import numpy as np
import pytest

from psgrid.psserver.protocol import BFLOAT16, FLOAT16, FLOAT32, REASON_KEY, Reason, Status
from psgrid.psserver.rpc import ps_pb2, ps_pb2_grpc
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.transports.stream_frames import MAGIC, PULL, PUSH, REPLY, REQUEST, recv_exact, recv_struct

SPEC = ModelSpec([("w", (64,)), ("b", (8,))])  # shard 0 of 2 owns [0, 36), shard 1 [36, 72)
SIZE = 36


def f32(values) -> bytes:
    return np.asarray(values, "<f4").tobytes()


class Refused(Exception):
    def __init__(self, status: int, reason: Reason, message: str):
        super().__init__(f"{Status(status).name} {reason.name}: {message}")
        self.status, self.reason, self.message = Status(status), reason, message


class GrpcSender:
    """Speaks proto/ps.proto through the generated stub."""

    def __init__(self, address: str):
        self.channel = grpc.insecure_channel(address)
        self.stub = ps_pb2_grpc.ParameterServerStub(self.channel)

    def _call(self, fn):
        try:
            return fn()
        except grpc.RpcError as err:
            reason = dict(err.trailing_metadata() or ()).get(REASON_KEY)
            raise Refused(err.code().value[0], Reason.from_wire_name(reason), err.details()) from None

    def push(self, worker, clock, version, dtype, payload, begin=0):
        request = ps_pb2.PushRequest(
            worker_id=worker,
            clock=clock,
            version=version,
            num_chunks=1,
            chunk=ps_pb2.Chunk(offset=begin, dtype=dtype, data=payload),
        )
        reply = self._call(lambda: self.stub.Push(iter([request]), timeout=5))
        return reply.outcome, reply.version

    def pull(self, worker, clock):
        replies = self._call(lambda: list(self.stub.Pull(ps_pb2.PullRequest(worker_id=worker, clock=clock), timeout=5)))
        return replies[0].version, b"".join(r.chunk.data for r in replies)

    def close(self):
        self.channel.close()


class TcpSender:
    """Speaks the TCP data plane's frames by hand, one connection per call."""

    def __init__(self, host: str, port: int):
        self.where = (host, port)

    def _exchange(self, request: bytes, payload: bytes = b""):
        with socket.create_connection(self.where, timeout=5) as sock:
            sock.sendall(request)
            try:
                sock.sendall(payload)
            except OSError:
                pass  # refused before the payload was read: the reply tells why
            _, status, reason, outcome, version, _, _, nbytes = recv_struct(sock, REPLY)
            body = bytearray(nbytes)
            recv_exact(sock, memoryview(body))
        if status:
            raise Refused(status, Reason.from_code(reason), body.decode())
        return outcome, version, bytes(body)

    def push(self, worker, clock, version, dtype, payload, begin=0):
        outcome, version, _ = self._exchange(
            REQUEST.pack(MAGIC, PUSH, dtype, worker, clock, version, len(payload), 5.0), payload
        )
        return outcome, version

    def pull(self, worker, clock):
        _, version, body = self._exchange(REQUEST.pack(MAGIC, PULL, FLOAT32, worker, clock, 0, 0, 5.0))
        return version, body

    def close(self):
        pass


def sender(cluster, plane: str):
    server = cluster.servers[0]
    return TcpSender("127.0.0.1", server.tcp.port) if plane == "tcp" else GrpcSender(server.address)


@pytest.fixture
def job(cluster, data_plane):
    """A 2-shard async adam job, initialised, one worker with one push done; a raw sender to shard 0."""
    c = cluster(2, mode="async", optimizer="adam", lr=0.1)
    client = c.client(SPEC, init=np.linspace(-1, 1, SPEC.size, dtype=np.float32)).join()
    client.push(np.full(SPEC.size, 0.5, np.float32)).wait()  # some optimizer state to compare
    raw = sender(c, data_plane)
    yield c, raw, client.worker_id
    raw.close()


def state(server):
    shard = server.shard
    with shard.cond:
        opt = {k: np.copy(v) for k, v in shard.optimizer.state_dict().items()}
        return (
            shard.weights.copy(),
            shard.version,
            dict(shard.policy.clocks),
            opt,
            shard.counters.pushes,
            shard.counters.applied_updates,
        )


def assert_unchanged(before, after):
    np.testing.assert_array_equal(before[0], after[0])
    assert before[1:3] == after[1:3]
    assert before[3].keys() == after[3].keys()
    for k in before[3]:
        np.testing.assert_array_equal(before[3][k], after[3][k])
    assert before[4:] == after[4:]


GOOD = f32(np.ones(SIZE))
BAD_PUSHES = {  # name: ((worker or None for the job's, clock, version, dtype, payload), status, reason)
    "too few elements": ((None, 1, 1, FLOAT32, f32(np.ones(20))), Status.INVALID_ARGUMENT, Reason.BAD_SIZE),
    "empty payload": ((None, 1, 1, FLOAT32, b""), Status.INVALID_ARGUMENT, Reason.BAD_SIZE),
    "too many elements": ((None, 1, 1, FLOAT32, f32(np.ones(40))), Status.INVALID_ARGUMENT, Reason.BAD_SIZE),
    "not whole elements": ((None, 1, 1, FLOAT32, b"\0" * 143), Status.INVALID_ARGUMENT, Reason.BAD_SIZE),
    "unspecified dtype": ((None, 1, 1, 0, GOOD), Status.INVALID_ARGUMENT, Reason.BAD_DTYPE),
    "unknown dtype": ((None, 1, 1, 7, GOOD), Status.INVALID_ARGUMENT, Reason.BAD_DTYPE),
    "NaN": ((None, 1, 1, FLOAT32, f32(np.r_[np.ones(35), np.nan])), Status.INVALID_ARGUMENT, Reason.NON_FINITE),
    "infinity": ((None, 1, 1, FLOAT32, f32(np.r_[np.inf, np.ones(35)])), Status.INVALID_ARGUMENT, Reason.NON_FINITE),
    "float16 infinity": (
        (None, 1, 1, FLOAT16, np.r_[np.ones(35), np.inf].astype("<f2").tobytes()),
        Status.INVALID_ARGUMENT,
        Reason.NON_FINITE,
    ),
    "bfloat16 NaN": (
        (None, 1, 1, BFLOAT16, np.full(SIZE, 0x7FC0, "<u2").tobytes()),
        Status.INVALID_ARGUMENT,
        Reason.NON_FINITE,
    ),
    "unknown worker": ((999, 1, 1, FLOAT32, GOOD), Status.FAILED_PRECONDITION, Reason.UNKNOWN_WORKER),
    "negative worker": ((-5, 1, 1, FLOAT32, GOOD), Status.INVALID_ARGUMENT, Reason.BAD_VALUE),
    "observer pushing": ((-1, 1, 1, FLOAT32, GOOD), Status.INVALID_ARGUMENT, Reason.BAD_VALUE),
    "negative clock": ((None, -1, 1, FLOAT32, GOOD), Status.INVALID_ARGUMENT, Reason.BAD_VALUE),
    "clock past the bound": ((None, 2**62, 1, FLOAT32, GOOD), Status.INVALID_ARGUMENT, Reason.BAD_VALUE),
    "version past the bound": ((None, 1, 2**62, FLOAT32, GOOD), Status.INVALID_ARGUMENT, Reason.BAD_VALUE),
    "a version never published": ((None, 1, 2, FLOAT32, GOOD), Status.INVALID_ARGUMENT, Reason.FUTURE_VERSION),
    "five clocks never taken": ((None, 6, 1, FLOAT32, GOOD), Status.INVALID_ARGUMENT, Reason.FUTURE_CLOCK),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(BAD_PUSHES))
def test_a_bad_push_gets_the_same_refusal_on_every_transport_and_changes_nothing(job, case):
    c, raw, worker = job
    (who, clock, version, dtype, payload), status, reason = BAD_PUSHES[case]
    before, checksum, rejected = state(c.servers[0]), c.checksum(), c.shard().stats()["rejected"]
    with pytest.raises(Refused) as refused:
        raw.push(worker if who is None else who, clock, version, dtype, payload)
    assert (refused.value.status, refused.value.reason) == (status, reason), refused.value.message
    assert_unchanged(before, state(c.servers[0]))
    assert c.checksum() == checksum
    assert c.shard().stats()["rejected"] == rejected + (status == Status.INVALID_ARGUMENT)
    # and a good push is taken afterwards, once
    assert raw.push(worker, 1, 1, FLOAT32, GOOD) == (0, before[1] + 1)


BAD_PULLS = {
    "unknown worker": ((999, 1), Status.FAILED_PRECONDITION, Reason.UNKNOWN_WORKER),
    "negative worker": ((-5, 1), Status.INVALID_ARGUMENT, Reason.BAD_VALUE),
    "negative clock": ((None, -3), Status.INVALID_ARGUMENT, Reason.BAD_VALUE),
    "clock past the bound": ((None, 2**62), Status.INVALID_ARGUMENT, Reason.BAD_VALUE),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(BAD_PULLS))
def test_a_bad_pull_gets_the_same_refusal_on_every_transport(job, case):
    c, raw, worker = job
    (who, clock), status, reason = BAD_PULLS[case]
    before = state(c.servers[0])
    with pytest.raises(Refused) as refused:
        raw.pull(worker if who is None else who, clock)
    assert (refused.value.status, refused.value.reason) == (status, reason), refused.value.message
    assert_unchanged(before, state(c.servers[0]))
    version, payload = raw.pull(-1, 0)  # an observer's pull is served, and never waits
    assert version == before[1] and payload == before[0].astype("<f4").tobytes()


@pytest.mark.timeout(30)
def test_an_evicted_worker_is_refused_on_every_transport(job):
    c, raw, worker = job
    c.shard().leave(worker)
    before = state(c.servers[0])
    for attempt in (lambda: raw.push(worker, 1, 1, FLOAT32, GOOD), lambda: raw.pull(worker, 5)):
        with pytest.raises(Refused) as refused:  # a pull must not wait as if it were still a member
            attempt()
        assert (refused.value.status, refused.value.reason) == (Status.FAILED_PRECONDITION, Reason.UNKNOWN_WORKER)
    assert_unchanged(before, state(c.servers[0]))


@pytest.mark.timeout(30)
def test_a_shard_without_weights_is_a_precondition_error_on_every_transport(cluster, data_plane):
    c = cluster(1, mode="async")
    client = c.client(SPEC)
    worker = c.shard().register(SPEC.hash(), 3, -1, "test")["worker_id"]
    raw = sender(c, data_plane)
    try:
        for payload in (f32(np.ones(SPEC.size)), b"\0" * 400_000):  # small and large payloads alike
            with pytest.raises(Refused) as refused:
                raw.push(worker, 0, 0, FLOAT32, payload)
            assert (refused.value.status, refused.value.reason) == (Status.FAILED_PRECONDITION, Reason.NOT_INITIALIZED)
        with pytest.raises(Refused) as refused:
            raw.pull(worker, 0)
        assert refused.value.reason is Reason.NOT_INITIALIZED and "Init" in refused.value.message
        assert not c.shard().initialized and c.shard().counters.pushes == 0
    finally:
        raw.close()
        client.close()


@pytest.mark.timeout(30)
def test_a_sync_pull_waits_for_its_round_and_times_out_with_the_callers_deadline(cluster, data_plane):
    import threading
    import time

    c = cluster(1, mode="sync", lr=1.0)
    c.client(SPEC, worker_id=0, init=SPEC.flat()).join()  # worker 0, with the weights
    b = c.client(SPEC, worker_id=1).join()
    raw = sender(c, data_plane)
    try:
        assert raw.push(0, 0, 0, FLOAT32, f32(np.ones(SPEC.size)))[0] == 1  # ACCUMULATED: b is missing
        # Round 0 is open: a pull at clock 1 waits; with a short deadline the shard says so itself.
        if data_plane == "tcp":
            t0 = time.monotonic()
            with socket.create_connection(("127.0.0.1", c.servers[0].tcp.port), timeout=5) as sock:
                sock.sendall(REQUEST.pack(MAGIC, PULL, FLOAT32, 0, 1, 0, 0, 0.3))
                fields = recv_struct(sock, REPLY)
            assert fields[1] == Status.DEADLINE_EXCEEDED and fields[2] == Reason.WAIT_TIMEOUT
            assert time.monotonic() - t0 >= 0.2
        else:
            t0 = time.monotonic()
            with pytest.raises(grpc.RpcError) as err:
                list(raw.stub.Pull(ps_pb2.PullRequest(worker_id=0, clock=1), timeout=0.3))
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 >= 0.2
        assert raw.pull(0, 0)[0] == 0  # a pull at clock 0 does not wait
        result = {}
        waiter = threading.Thread(target=lambda: result.update(version=raw.pull(0, 1)[0]), daemon=True)
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive(), "a pull at clock 1 returned before round 0 closed"
        b.push(np.ones(SPEC.size, np.float32)).wait()  # b's push closes round 0
        waiter.join(10)
        assert result == {"version": 1}
        np.testing.assert_array_equal(c.shard().weights, -1.0)
    finally:
        raw.close()


@pytest.mark.timeout(30)
def test_a_bug_in_the_shard_is_answered_internal_on_every_transport_and_the_shard_goes_on(job, monkeypatch):
    from psgrid.psserver.service import ShardService

    c, raw, worker = job
    real = ShardService.pull

    def broken(self, **kw):
        raise RuntimeError("a bug")

    monkeypatch.setattr(ShardService, "pull", broken)
    with pytest.raises(Refused) as refused:
        raw.pull(worker, 1)
    assert refused.value.status == Status.INTERNAL and "RuntimeError" in refused.value.message
    monkeypatch.setattr(ShardService, "pull", real)
    assert raw.pull(-1, 0)[0] == c.shard().version  # still serving


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_a_non_finite_gradient_in_any_wire_dtype_is_refused_on_every_transport(job, bad, dtype):
    from psgrid.psserver import dtypes as wire

    c, raw, worker = job
    grad = np.ones(SIZE, np.float32)
    grad[17] = bad
    code = wire.wire_dtype(dtype)
    before, checksum = state(c.servers[0]), c.checksum()
    with pytest.raises(Refused) as refused:
        raw.push(worker, 1, 1, code, wire.encode(grad, code))
    assert (refused.value.status, refused.value.reason) == (Status.INVALID_ARGUMENT, Reason.NON_FINITE)
    assert_unchanged(before, state(c.servers[0]))
    assert c.checksum() == checksum


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [0, 7, 255])
def test_an_unknown_dtype_is_refused_on_every_transport(job, dtype):
    c, raw, worker = job
    before = state(c.servers[0])
    with pytest.raises(Refused) as refused:
        raw.push(worker, 1, 1, dtype, GOOD)
    assert (refused.value.status, refused.value.reason) == (Status.INVALID_ARGUMENT, Reason.BAD_DTYPE)
    assert_unchanged(before, state(c.servers[0]))
