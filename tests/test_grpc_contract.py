"""What only the gRPC transport has: chunked streams, Init and Register, and messages that do not decode."""

from __future__ import annotations

from pathlib import Path

import grpc
import numpy as np
import pytest

from psgrid.psserver.protocol import FLOAT32, REASON_KEY, SERVICE, Reason
from psgrid.psserver.rpc import ps_pb2, ps_pb2_grpc
from psgrid.psserver.sharding import chunk_ranges
from psgrid.psserver.spec import ModelSpec

pytestmark = pytest.mark.parametrize("data_plane", ["grpc"])

ROOT = Path(__file__).resolve().parent.parent

SPEC = ModelSpec([("w", (64,)), ("b", (8,))])  # shard 0 of 2 owns [0, 36), shard 1 [36, 72)
INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def chunk(offset, values, dtype=FLOAT32):
    return ps_pb2.Chunk(offset=offset, dtype=dtype, data=np.asarray(values, "<f4").tobytes())


def reason(err: grpc.RpcError) -> Reason:
    return Reason.from_wire_name(dict(err.trailing_metadata() or ()).get(REASON_KEY))


@pytest.fixture
def job(cluster):
    c = cluster(2, mode="async", lr=0.5)
    client = c.client(SPEC, init=np.arange(SPEC.size, dtype=np.float32) / 10).join()
    channel = grpc.insecure_channel(c.addresses[0])
    yield c, ps_pb2_grpc.ParameterServerStub(channel), client.worker_id, channel
    channel.close()


def state(server):
    shard = server.shard
    return shard.weights.copy(), shard.version, dict(shard.policy.clocks)


def push_stream(worker, chunks, num_chunks=None, clock=0, version=0):
    first, *rest = chunks
    yield ps_pb2.PushRequest(
        worker_id=worker,
        clock=clock,
        version=version,
        num_chunks=len(chunks) if num_chunks is None else num_chunks,
        chunk=first,
    )
    for c in rest:
        yield ps_pb2.PushRequest(chunk=c)


BAD_STREAMS = {  # name: (chunks, declared chunk count or None, reason)
    "offset outside the shard": ([chunk(36, np.ones(36))], None, Reason.BAD_OFFSET),
    "offset not at the range start": ([chunk(1, np.ones(35))], None, Reason.BAD_OFFSET),
    "gap between chunks": ([chunk(0, np.ones(10)), chunk(12, np.ones(24))], None, Reason.BAD_OFFSET),
    "overlap between chunks": ([chunk(0, np.ones(10)), chunk(8, np.ones(28))], None, Reason.BAD_OFFSET),
    "stream ends early": ([chunk(0, np.ones(20))], None, Reason.BAD_SIZE),
    "more chunks than declared": ([chunk(0, np.ones(18)), chunk(18, np.ones(18))], 1, Reason.BAD_CHUNK_COUNT),
    "fewer chunks than declared": ([chunk(0, np.ones(36))], 2, Reason.BAD_CHUNK_COUNT),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(BAD_STREAMS))
def test_a_push_stream_that_does_not_tile_the_range_is_refused(job, case):
    c, stub, worker, _ = job
    chunks, declared, expected = BAD_STREAMS[case]
    before, checksum = state(c.servers[0]), c.checksum()
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(push_stream(worker, chunks, declared), timeout=5)
    assert err.value.code() == INVALID and reason(err.value) is expected, err.value.details()
    np.testing.assert_array_equal(before[0], state(c.servers[0])[0])
    assert before[1:] == state(c.servers[0])[1:] and c.checksum() == checksum
    assert c.shard().stats()["pushes"] == 0


@pytest.mark.timeout(30)
def test_an_empty_push_stream_is_refused(job):
    c, stub, _, _ = job
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(iter([]), timeout=5)
    assert err.value.code() == INVALID and reason(err.value) is Reason.BAD_SIZE


METHODS = {  # method: (request streams?, reply streams?)
    "Register": (False, False),
    "Init": (True, False),
    "Pull": (False, True),
    "Push": (True, False),
    "Heartbeat": (False, False),
    "Stats": (False, False),
    "Checkpoint": (False, False),
    "Shutdown": (False, False),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_message_that_does_not_decode_is_bad_input_on_every_rpc(job, method):
    c, _, _, channel = job
    garbage = b"\xff\xff\xff\xff"  # a field key whose varint never ends
    streams_in, streams_out = METHODS[method]
    identity = dict(request_serializer=None, response_deserializer=None)
    if streams_in:
        call = channel.stream_unary(f"/{SERVICE}/{method}", **identity)
        invoke = lambda: call(iter([garbage]), timeout=5)  # noqa: E731
    elif streams_out:
        call = channel.unary_stream(f"/{SERVICE}/{method}", **identity)
        invoke = lambda: list(call(garbage, timeout=5))  # noqa: E731
    else:
        call = channel.unary_unary(f"/{SERVICE}/{method}", **identity)
        invoke = lambda: call(garbage, timeout=5)  # noqa: E731
    checksum, rejected = c.checksum(), c.shard().stats()["rejected"]
    with pytest.raises(grpc.RpcError) as err:
        invoke()
    assert err.value.code() == INVALID and reason(err.value) is Reason.MALFORMED, err.value.details()
    assert c.checksum() == checksum and c.shard().stats()["rejected"] == rejected + 1
    assert not c.servers[0].shutdown_requested.is_set()


@pytest.mark.timeout(30)
def test_a_spec_mismatch_is_refused_at_registration_and_init(job):
    c, stub, _, _ = job
    other = ModelSpec([("w", (64,)), ("b", (9,))])
    before = state(c.servers[0])
    with pytest.raises(grpc.RpcError) as err:
        stub.Register(ps_pb2.RegisterRequest(spec_hash=other.hash(), worker_id=-1, start_clock=-1), timeout=5)
    assert err.value.code() == PRECONDITION and reason(err.value) is Reason.SPEC_MISMATCH
    spec_msg = ps_pb2.ModelSpecMsg(
        params=[ps_pb2.ParamInfo(name=p.name, shape=list(p.shape), dtype=p.dtype) for p in other.params],
        hash=other.hash(),
    )
    with pytest.raises(grpc.RpcError) as err:
        stub.Init(iter([ps_pb2.InitRequest(spec=spec_msg, num_chunks=1, chunk=chunk(0, np.zeros(36)))]), timeout=5)
    assert err.value.code() == PRECONDITION and reason(err.value) is Reason.SPEC_MISMATCH
    np.testing.assert_array_equal(before[0], state(c.servers[0])[0])
    assert len(c.shard().policy.clocks) == 1


@pytest.mark.timeout(30)
def test_the_same_spec_again_at_init_is_a_noop(job):
    c, stub, _, _ = job
    before = state(c.servers[0])
    spec_msg = ps_pb2.ModelSpecMsg(
        params=[ps_pb2.ParamInfo(name=p.name, shape=list(p.shape), dtype=p.dtype) for p in SPEC.params],
        hash=SPEC.hash(),
    )
    reply = stub.Init(iter([ps_pb2.InitRequest(spec=spec_msg, num_chunks=1, chunk=chunk(0, np.zeros(36)))]), timeout=5)
    assert reply.applied is False
    np.testing.assert_array_equal(before[0], state(c.servers[0])[0])


BAD_INITS = {  # name: (params, hash, values, dtype, reason)
    "tampered hash": (SPEC.params, "0" * 32, np.zeros(72), FLOAT32, Reason.BAD_SPEC),
    "NaN in weights": (SPEC.params, SPEC.hash(), np.r_[np.zeros(71), np.nan], FLOAT32, Reason.NON_FINITE),
    "half-precision weights": (SPEC.params, SPEC.hash(), np.zeros(72), 2, Reason.BAD_DTYPE),
    "absurd shape": ([("w", (2**41,))], ModelSpec([("w", (2**41,))]).hash(), np.zeros(4), FLOAT32, Reason.BAD_SPEC),
    "negative dimension": ([("w", (-4,))], "x", np.zeros(4), FLOAT32, Reason.BAD_SPEC),
    "no parameters": ([], "x", np.zeros(4), FLOAT32, Reason.BAD_SPEC),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(BAD_INITS))
def test_a_bad_init_is_refused_and_leaves_the_shard_empty(cluster, case):
    params, spec_hash, values, dtype, expected = BAD_INITS[case]
    c = cluster(1)
    with grpc.insecure_channel(c.addresses[0]) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        infos = [
            ps_pb2.ParamInfo(
                name=p[0] if isinstance(p, tuple) else p.name, shape=list(p[1] if isinstance(p, tuple) else p.shape)
            )
            for p in params
        ]
        msg = ps_pb2.InitRequest(
            spec=ps_pb2.ModelSpecMsg(params=infos, hash=spec_hash),
            num_chunks=1,
            chunk=ps_pb2.Chunk(
                offset=0,
                dtype=dtype,
                data=np.asarray(values, "<f4").tobytes() if dtype == FLOAT32 else np.asarray(values, "<f2").tobytes(),
            ),
        )
        with pytest.raises(grpc.RpcError) as err:
            stub.Init(iter([msg]), timeout=5)
    assert err.value.code() == INVALID and reason(err.value) is expected, err.value.details()
    assert not c.shard().initialized


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "fields",
    [dict(worker_id=-5), dict(worker_id=2**40), dict(start_clock=-7), dict(start_clock=2**60), dict(host="x" * 1000)],
)
def test_a_registration_with_numbers_out_of_range_is_refused_and_stores_nothing(job, fields):
    c, stub, _, _ = job
    before = dict(c.shard().policy.clocks), c.shard().members.leases.next_id
    request = ps_pb2.RegisterRequest(spec_hash=SPEC.hash(), **{"worker_id": -1, "start_clock": -1, **fields})
    with pytest.raises(grpc.RpcError) as err:
        stub.Register(request, timeout=5)
    assert err.value.code() == INVALID and reason(err.value) is Reason.BAD_VALUE
    assert (dict(c.shard().policy.clocks), c.shard().members.leases.next_id) == before
    # and registrations asking for a new id still work
    assert (
        stub.Register(ps_pb2.RegisterRequest(spec_hash=SPEC.hash(), worker_id=-1, start_clock=-1), timeout=5).worker_id
        == before[1]
    )


@pytest.mark.timeout(30)
def test_a_generated_client_trains_over_grpc_alone(job):
    """Any client generated from proto/ps.proto can train: register, pull, push with the stub only."""
    c, stub, _, _ = job
    reply = stub.Register(ps_pb2.RegisterRequest(spec_hash=SPEC.hash(), worker_id=-1, start_clock=-1), timeout=5)
    assert reply.tcp_port == c.servers[0].tcp.port and reply.begin == 0 and reply.end == 36
    version = list(stub.Pull(ps_pb2.PullRequest(worker_id=reply.worker_id, clock=reply.start_clock), timeout=5))[0]
    pushed = stub.Push(
        push_stream(reply.worker_id, [chunk(0, np.ones(36))], clock=reply.start_clock, version=version.version),
        timeout=5,
    )
    assert pushed.outcome == ps_pb2.PushReply.APPLIED and pushed.version == version.version + 1
    np.testing.assert_allclose(c.shard().weights, np.arange(36, dtype=np.float32) / 10 - 0.5)


# ----- issue 25: what a client written from the proto alone needs the shard to say -----------------


def wire_reason(err: grpc.RpcError) -> str:
    return dict(err.trailing_metadata() or ()).get(REASON_KEY, "")


def spec_message(spec: ModelSpec) -> ps_pb2.ModelSpecMsg:
    return ps_pb2.ModelSpecMsg(
        params=[ps_pb2.ParamInfo(name=p.name, shape=list(p.shape), dtype=p.dtype) for p in spec.params],
        hash=spec.hash(),
    )


BIG = ModelSpec([("w", (3 << 20,))])  # 12 MiB of float32: room for chunks up to 12 MiB


@pytest.mark.timeout(30)
def test_registration_reports_the_largest_chunk_a_shard_takes(cluster):
    c = cluster(1, chunk_bytes=65536)
    with grpc.insecure_channel(c.addresses[0]) as channel:
        reply = ps_pb2_grpc.ParameterServerStub(channel).Register(
            ps_pb2.RegisterRequest(spec_hash=SPEC.hash(), worker_id=-1, start_clock=-1), timeout=5
        )
    assert reply.max_chunk_bytes == 65536


@pytest.mark.timeout(60)
@pytest.mark.parametrize("nbytes", [65536 + 4, 1 << 20, 8 << 20])
def test_a_chunk_past_the_shards_limit_is_refused_with_a_reason(cluster, nbytes):
    """Just past the shard's 64 KiB, 1 MiB, and 8 MiB (which gRPC itself refused, without a reason)."""
    c = cluster(1, mode="async", chunk_bytes=65536)
    values = np.zeros(BIG.size, np.float32)
    with grpc.insecure_channel(c.addresses[0]) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        big_init = ps_pb2.InitRequest(spec=spec_message(BIG), num_chunks=1, chunk=chunk(0, values[: nbytes // 4]))
        with pytest.raises(grpc.RpcError) as err:
            stub.Init(iter([big_init]), timeout=10)
        assert err.value.code() == INVALID and wire_reason(err.value) == "chunk_too_large", err.value.details()
        assert not c.shard().initialized
        at_limit = chunk_ranges(0, BIG.size, 65536 // 4)
        stub.Init(
            (
                ps_pb2.InitRequest(
                    spec=spec_message(BIG) if i == 0 else None, num_chunks=len(at_limit), chunk=chunk(a, values[a:b])
                )
                for i, (a, b) in enumerate(at_limit)
            ),
            timeout=30,
        )
        worker = stub.Register(
            ps_pb2.RegisterRequest(spec_hash=BIG.hash(), worker_id=-1, start_clock=-1), timeout=5
        ).worker_id
        with pytest.raises(grpc.RpcError) as err:
            stub.Push(push_stream(worker, [chunk(0, np.ones(nbytes // 4))], num_chunks=1), timeout=10)
        assert err.value.code() == INVALID and wire_reason(err.value) == "chunk_too_large", err.value.details()
    shard = c.shard()
    assert shard.version == 0 and shard.policy.clocks == {worker: 0} and not shard.weights.any()


@pytest.mark.timeout(30)
def test_a_message_past_the_hard_cap_is_grpcs_resource_exhausted_as_the_proto_says(cluster):
    from psgrid.psserver.protocol import MAX_RECEIVE_BYTES

    c = cluster(1, mode="async")
    assert f"{MAX_RECEIVE_BYTES} bytes" in (ROOT / "proto" / "ps.proto").read_text()
    with grpc.insecure_channel(c.addresses[0]) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Push(push_stream(0, [chunk(0, np.ones(MAX_RECEIVE_BYTES // 4 + 1))]), timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


@pytest.mark.timeout(30)
def test_a_client_sends_chunks_no_larger_than_the_shard_takes(cluster):
    c = cluster(2, mode="async", chunk_bytes=4096)
    spec = ModelSpec([("w", (5000,))])  # 10 KB a shard: three 4 KiB chunks, not one
    with c.client(spec, init=np.ones(spec.size, np.float32)) as client:  # its own chunk_bytes: 1 MiB
        client.push(np.ones(spec.size, np.float32)).wait()
    np.testing.assert_array_equal(c.weights(), np.ones(spec.size, np.float32) - 0.01)


@pytest.mark.timeout(30)
def test_a_wrong_hash_that_never_initialised_does_not_keep_the_right_one_out(cluster):
    c = cluster(1, mode="async", lr=0.5)
    with grpc.insecure_channel(c.addresses[0]) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        wrong = stub.Register(ps_pb2.RegisterRequest(spec_hash="0" * 32, worker_id=-1, start_clock=-1), timeout=5)
        with c.client(SPEC, init=SPEC.flat()) as client:  # registers, sends Init and trains
            client.push(np.ones(SPEC.size, np.float32)).wait()
        np.testing.assert_array_equal(c.weights(), np.full(SPEC.size, -0.5, np.float32))
        # The one with the wrong hash was dropped when the weights were set: told so, and kept out
        assert not stub.Heartbeat(ps_pb2.HeartbeatRequest(worker_id=wrong.worker_id), timeout=5).known
        with pytest.raises(grpc.RpcError) as err:
            stub.Register(
                ps_pb2.RegisterRequest(spec_hash="0" * 32, worker_id=wrong.worker_id, start_clock=-1), timeout=5
            )
        assert err.value.code() == PRECONDITION and wire_reason(err.value) == "spec_mismatch"


FUTURE = {  # name: (mode, clock ahead of the worker's, version ahead of the shard's)
    "async: a version never published": ("async", 0, 1),
    "ssp: a version never published": ("ssp", 0, 1),
    "sync: a version never published": ("sync", 0, 1),
    "async: five clocks ahead": ("async", 5, 0),
    "ssp: five clocks ahead": ("ssp", 5, 0),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(FUTURE))
def test_a_push_that_claims_what_never_happened_is_refused(cluster, case):
    mode, clock_ahead, version_ahead = FUTURE[case]
    c = cluster(1, mode=mode, lr=0.5)
    client = c.client(SPEC, worker_id=0, init=SPEC.flat()).join()
    client.push(np.ones(SPEC.size, np.float32)).wait()  # version 1, the worker's clock 1
    shard = c.shard()
    before = state(c.servers[0]), dict(shard.stats())
    with grpc.insecure_channel(c.addresses[0]) as channel:
        with pytest.raises(grpc.RpcError) as err:
            ps_pb2_grpc.ParameterServerStub(channel).Push(
                push_stream(0, [chunk(0, np.ones(SPEC.size))], clock=1 + clock_ahead, version=1 + version_ahead),
                timeout=5,
            )
    expected = "future_clock" if clock_ahead else "future_version"
    assert err.value.code() == INVALID and wire_reason(err.value) == expected, err.value.details()
    after = state(c.servers[0]), shard.stats()
    np.testing.assert_array_equal(before[0][0], after[0][0])
    assert before[0][1:] == after[0][1:]
    assert after[1]["lost_updates"] == 0 and after[1]["applied_updates"] == before[1]["applied_updates"]
    assert after[1]["rejected"] == before[1]["rejected"] + 1
    client.push(np.ones(SPEC.size, np.float32)).wait()  # the worker goes on at its own clock
    assert shard.version == 2


# ----- issue 35: a refused Init leaves no half-built shard ---------------------------------------------


def init_stream(spec: ModelSpec, values: np.ndarray):
    return iter([ps_pb2.InitRequest(spec=spec_message(spec), num_chunks=1, chunk=chunk(0, values))])


@pytest.mark.timeout(30)
def test_an_init_the_optimizer_refuses_leaves_the_shard_empty_and_a_later_init_trains(cluster):
    """Init builds the optimizer before it publishes the weights: one it cannot build refuses the Init whole."""
    c = cluster(1, mode="async", lr=0.5)
    shard = c.shard()
    # The job check refuses lr = inf before a shard starts (kernels/optim.py's bounds); a shard's Init still
    # checks what it builds. Set here past the check, as only a bug could.
    shard.config.lr = float("inf")
    with grpc.insecure_channel(c.addresses[0]) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        worker = stub.Register(
            ps_pb2.RegisterRequest(spec_hash=SPEC.hash(), worker_id=-1, start_clock=-1), timeout=5
        ).worker_id
        with pytest.raises(grpc.RpcError) as err:
            stub.Init(init_stream(SPEC, SPEC.flat()), timeout=5)
        assert err.value.code() == INVALID and reason(err.value) is Reason.BAD_VALUE, err.value.details()
        assert "lr must be finite and > 0" in err.value.details()
        assert not shard.initialized and shard.spec is None and shard.optimizer is None and shard.pool is None
        # A push meanwhile is told the shard has no weights yet, not INTERNAL (a shard with weights and no optimizer)
        with pytest.raises(grpc.RpcError) as err:
            stub.Push(push_stream(worker, [chunk(0, np.ones(SPEC.size))]), timeout=5)
        assert err.value.code() == PRECONDITION and reason(err.value) is Reason.NOT_INITIALIZED, err.value.details()
        shard.config.lr = 0.5
        assert stub.Init(init_stream(SPEC, SPEC.flat()), timeout=5).applied
        pushed = stub.Push(push_stream(worker, [chunk(0, np.ones(SPEC.size))]), timeout=5)
        assert pushed.outcome == ps_pb2.PushReply.APPLIED and pushed.version == 1
    np.testing.assert_array_equal(c.weights(), SPEC.flat() - np.float32(0.5))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_push_of_headers_alone_to_an_empty_range_is_refused_and_moves_no_clock(cluster, mode):
    """Shard 0 of 2 owns nothing of a one-element model: its real pushes carry one empty chunk, headers alone are bad_size."""
    tiny = ModelSpec([("w", (1,))])
    c = cluster(2, mode=mode)
    client = c.client(tiny, init=np.ones(1, np.float32)).join()
    server = c.servers[0]
    assert server.shard.size == 0
    with grpc.insecure_channel(c.addresses[0]) as channel:
        stub = ps_pb2_grpc.ParameterServerStub(channel)
        before = state(server)
        with pytest.raises(grpc.RpcError) as err:
            stub.Push(
                iter([ps_pb2.PushRequest(worker_id=client.worker_id, clock=0, version=0, num_chunks=0)]), timeout=5
            )
        assert err.value.code() == INVALID and reason(err.value) is Reason.BAD_SIZE, err.value.details()
        assert state(server)[1:] == before[1:] and server.shard.stats()["pushes"] == 0
        reply = stub.Push(push_stream(client.worker_id, [chunk(0, [])]), timeout=5)  # as a client sends it
        assert reply.next_clock == 1 and state(server)[2][client.worker_id] == 1
