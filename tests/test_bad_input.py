"""Every kind of bad input is refused with the right status code and changes no state."""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from psgrid.psserver.client import ShardedClient
from psgrid.psserver.rpc import ps_pb2, ps_pb2_grpc
from psgrid.psserver.spec import ModelSpec
from tests.cluster_utils import addresses, in_process_cluster

SPEC = ModelSpec([("w", (64,)), ("b", (8,))])    # shard 0 of 2 owns [0, 36), shard 1 [36, 72)
INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def chunk(offset, values, dtype=ps_pb2.FLOAT32):
    return ps_pb2.Chunk(offset=offset, dtype=dtype, data=np.asarray(values, "<f4").tobytes())


@pytest.fixture
def job():
    with in_process_cluster(2, mode="async", lr=0.5) as servers:
        with ShardedClient(addresses(servers)) as client:
            client.register(SPEC)
            client.init(np.arange(SPEC.size, dtype=np.float32) / 10)
            stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(servers[0].address))
            yield servers[0], stub, client.worker_id


def state(server):
    shard = server.shard
    return shard.weights.copy(), shard.version, dict(shard.policy.clocks), shard.optimizer.state_dict()


def push_stream(worker, messages_chunks, num_chunks=None, clock=0, version=0):
    first, *rest = messages_chunks
    yield ps_pb2.PushRequest(worker_id=worker, clock=clock, version=version,
                             num_chunks=len(messages_chunks) if num_chunks is None else num_chunks, chunk=first)
    for c in rest:
        yield ps_pb2.PushRequest(chunk=c)


BAD_PUSHES = {
    "offset outside the shard": lambda w: [chunk(36, np.ones(36))],
    "offset not at the range start": lambda w: [chunk(1, np.ones(35))],
    "size past the end": lambda w: [chunk(0, np.ones(40))],
    "stream ends early": lambda w: [chunk(0, np.ones(20))],
    "gap between chunks": lambda w: [chunk(0, np.ones(10)), chunk(12, np.ones(24))],
    "unknown dtype": lambda w: [ps_pb2.Chunk(offset=0, dtype=ps_pb2.DTYPE_UNSPECIFIED, data=b"\0" * 144)],
    "odd byte count": lambda w: [ps_pb2.Chunk(offset=0, dtype=ps_pb2.FLOAT32, data=b"\0" * 143)],
    "NaN in gradient": lambda w: [chunk(0, np.r_[np.ones(35), np.nan])],
    "infinity in gradient": lambda w: [chunk(0, np.r_[np.inf, np.ones(35)])],
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", sorted(BAD_PUSHES))
def test_bad_push_is_refused_and_changes_nothing(job, case):
    server, stub, worker = job
    before = state(server)
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(push_stream(worker, BAD_PUSHES[case](worker)), timeout=5)
    assert err.value.code() == INVALID, err.value.details()
    after = state(server)
    np.testing.assert_array_equal(before[0], after[0])
    assert before[1:3] == after[1:3]
    assert server.shard.stats()["rejected"] >= 1
    assert server.shard.stats()["pushes"] == 0


@pytest.mark.timeout(30)
def test_wrong_chunk_count_is_refused(job):
    server, stub, worker = job
    before = state(server)
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(push_stream(worker, [chunk(0, np.ones(36))], num_chunks=2), timeout=5)
    assert err.value.code() == INVALID and "declared 2 chunks" in err.value.details()
    np.testing.assert_array_equal(before[0], state(server)[0])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("worker_id", [999, -1])
def test_unknown_worker_push_is_refused(job, worker_id):
    server, stub, _ = job
    before = state(server)
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(push_stream(worker_id, [chunk(0, np.ones(36))]), timeout=5)
    assert err.value.code() == PRECONDITION and "register again" in err.value.details()
    np.testing.assert_array_equal(before[0], state(server)[0])


@pytest.mark.timeout(30)
def test_evicted_worker_push_is_refused(job):
    server, stub, worker = job
    server.shard.leave(worker)
    with pytest.raises(grpc.RpcError) as err:
        stub.Push(push_stream(worker, [chunk(0, np.ones(36))]), timeout=5)
    assert err.value.code() == PRECONDITION


@pytest.mark.timeout(30)
def test_spec_mismatch_is_refused_at_registration_and_init(job):
    server, stub, _ = job
    other = ModelSpec([("w", (64,)), ("b", (9,))])
    before = state(server)
    with pytest.raises(grpc.RpcError) as err:
        stub.Register(ps_pb2.RegisterRequest(spec_hash=other.hash(), worker_id=-1, start_clock=-1), timeout=5)
    assert err.value.code() == PRECONDITION and "spec" in err.value.details()
    with ShardedClient([server.address, server.address]) as client:
        with pytest.raises(grpc.RpcError) as err:
            client.init(np.zeros(other.size, np.float32), spec=other)
    assert err.value.code() == PRECONDITION
    np.testing.assert_array_equal(before[0], state(server)[0])
    assert len(server.shard.policy.clocks) == 1


@pytest.mark.timeout(30)
def test_same_spec_init_again_is_a_noop(job):
    server, _, _ = job
    before = state(server)
    stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(server.address))
    spec_msg = ps_pb2.ModelSpecMsg(params=[ps_pb2.ParamInfo(name=p.name, shape=list(p.shape), dtype=p.dtype)
                                           for p in SPEC.params], hash=SPEC.hash())
    reply = stub.Init(iter([ps_pb2.InitRequest(spec=spec_msg, num_chunks=1, chunk=chunk(0, np.zeros(36)))]),
                      timeout=5)
    assert reply.applied is False
    np.testing.assert_array_equal(before[0], state(server)[0])


@pytest.mark.timeout(30)
def test_init_with_tampered_hash_or_nan_is_refused():
    with in_process_cluster(1) as servers:
        stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(servers[0].address))
        params = [ps_pb2.ParamInfo(name=p.name, shape=list(p.shape), dtype=p.dtype) for p in SPEC.params]
        for spec_hash, values in (("0" * 32, np.zeros(72)), (SPEC.hash(), np.r_[np.zeros(71), np.nan])):
            msg = ps_pb2.InitRequest(spec=ps_pb2.ModelSpecMsg(params=params, hash=spec_hash), num_chunks=1,
                                     chunk=chunk(0, values))
            with pytest.raises(grpc.RpcError) as err:
                stub.Init(iter([msg]), timeout=5)
            assert err.value.code() == INVALID
        assert not servers[0].shard.initialized


@pytest.mark.timeout(30)
def test_pull_before_init_is_a_precondition_error():
    with in_process_cluster(1) as servers:
        stub = ps_pb2_grpc.ParameterServerStub(grpc.insecure_channel(servers[0].address))
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Pull(ps_pb2.PullRequest(worker_id=-1, clock=0), timeout=5))
        assert err.value.code() == PRECONDITION and "Init" in err.value.details()


@pytest.mark.timeout(30)
def test_checksum_unchanged_after_every_bad_input(job):
    server, stub, worker = job
    checksum = server.shard.checksum()
    for case in BAD_PUSHES.values():
        with pytest.raises(grpc.RpcError):
            stub.Push(push_stream(worker, case(worker)), timeout=5)
    assert server.shard.checksum() == checksum
    assert server.shard.stats()["rejected"] == len(BAD_PUSHES)
