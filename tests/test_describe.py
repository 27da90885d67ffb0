"""Describe: a running job's model spec, its hash and the settings a worker needs, for holders of the token.

A worker that has not read the job's model code (another language, another team) learns here the
parameters whose hash the shards check at Register, and joins with it; a wrong hash is still refused.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from psgrid.psserver.exceptions import NotInitialized, SpecMismatch
from psgrid.psserver.rpc import ps_pb2, ps_pb2_grpc
from psgrid.psserver.sharding import shard_range
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.transports.base import ConnectOptions
from psgrid.psserver.transports.grpc_client import open_control

pytestmark = pytest.mark.parametrize("data_plane", ["tcp"])

TOKEN = "describe-token"
SPEC = ModelSpec([("encoder.weight", (6, 5)), ("encoder.bias", (6,)), ("poids_\u00e9", ()), ("head", (2, 3))])


def stub(address: str) -> tuple[grpc.Channel, ps_pb2_grpc.ParameterServerStub]:
    channel = grpc.insecure_channel(address)
    return channel, ps_pb2_grpc.ParameterServerStub(channel)


def bearer(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


@pytest.mark.timeout(30)
def test_describe_answers_the_spec_whose_hash_the_shards_check(cluster):
    c = cluster(2, mode="ssp", staleness=3, optimizer="sgd", lr=0.25, momentum=0.5, nesterov=True, token=TOKEN)
    with c.client(SPEC, init=np.ones(SPEC.size, np.float32), token=TOKEN):
        described = c.admin(token=TOKEN).describe()
    for i, d in enumerate(described):
        params = [(p["name"], tuple(p["shape"]), p["dtype"]) for p in d["spec"]["params"]]
        assert params == [(p.name, p.shape, "float32") for p in SPEC.params]
        assert d["spec"]["hash"] == SPEC.hash() == c.shard(i).spec.hash()
        assert (d["initialized"], d["mode"], d["staleness"], d["shard_index"], d["num_shards"]) == (
            True,
            "ssp",
            3,
            i,
            2,
        )
        assert (d["begin"], d["end"], d["total_size"]) == (c.shard(i).begin, c.shard(i).end, SPEC.size)
        assert d["optimizer"]["name"] == "sgd" and d["optimizer"]["lr"] == 0.25
        assert d["optimizer"]["momentum"] == 0.5 and d["optimizer"]["nesterov"]
        assert d["optimizer"]["staleness_compensation"] == "none" and d["update_device"] == "cpu"
        offers = {p["name"]: p["address"] for p in d["planes"]}
        assert offers["grpc"] == "" and offers["tcp"] == str(c.servers[i].tcp.port)
    assert c.admin(token=TOKEN).model_spec() == SPEC

    # The described hash is what Register takes; any other is refused as the shards' spec check says.
    channel, shard0 = stub(c.addresses[0])
    with channel:
        hashed = described[0]["spec"]["hash"]
        joined = shard0.Register(
            ps_pb2.RegisterRequest(spec_hash=hashed, worker_id=-1, start_clock=-1, host="x"),
            timeout=10,
            metadata=bearer(TOKEN),
        )
        assert joined.worker_id >= 0
        other = ModelSpec([("encoder.weight", (5, 6)), *((p.name, p.shape) for p in SPEC.params[1:])]).hash()
        with pytest.raises(grpc.RpcError) as refused:
            shard0.Register(
                ps_pb2.RegisterRequest(spec_hash=other, worker_id=-1, start_clock=-1, host="x"),
                timeout=10,
                metadata=bearer(TOKEN),
            )
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert dict(refused.value.trailing_metadata())["ps-reason"] == "spec_mismatch"


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "metadata", [(), bearer("not-the-token"), (("authorization", TOKEN),)], ids=["missing", "wrong", "not-bearer"]
)
def test_describe_without_the_token_is_unauthenticated(cluster, metadata):
    c = cluster(1, token=TOKEN)
    channel, shard = stub(c.addresses[0])
    with channel:
        with pytest.raises(grpc.RpcError) as refused:
            shard.Describe(ps_pb2.DescribeRequest(), timeout=10, metadata=metadata)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert dict(refused.value.trailing_metadata())["ps-reason"] == "unauthenticated"
        # ... and with it, the same shard answers
        reply = shard.Describe(ps_pb2.DescribeRequest(), timeout=10, metadata=bearer(TOKEN))
    assert reply.num_shards == 1 and reply.mode == "async"


@pytest.mark.timeout(30)
def test_describe_before_init_says_so_and_the_admin_refuses_a_spec(cluster):
    c = cluster(1, optimizer="adam", lr=0.001, beta2=0.99)
    channel, shard = stub(c.addresses[0])
    with channel:
        reply = shard.Describe(ps_pb2.DescribeRequest(), timeout=10)
    assert not reply.initialized and not reply.HasField("spec") and reply.total_size == 0
    assert (reply.optimizer.name, reply.optimizer.lr, reply.optimizer.beta2) == ("adam", 0.001, 0.99)
    admin = c.admin()
    assert admin.describe()[0]["spec"] is None
    with pytest.raises(NotInitialized, match="no model yet"):
        admin.model_spec()
    assert c.shard().version == 0 and not c.shard().initialized  # asking changed nothing


@pytest.mark.timeout(30)
def test_shards_holding_different_specs_are_named(cluster):
    c = cluster(2)
    other = ModelSpec([("w", (SPEC.size,))])
    for i, spec in enumerate((SPEC, other)):  # each shard's first Init, each with its own model
        begin, end = shard_range(spec.size, i, 2)
        control = open_control(c.addresses[i], ConnectOptions())
        try:
            assert control.init(spec, np.zeros(end - begin, np.float32), begin) == (True, 0)
        finally:
            control.close()
    with pytest.raises(SpecMismatch, match="2 different model specs"):
        c.admin().model_spec()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "raw, malformed",
    [
        (b"\xff", True),  # a key cut short
        (b"\x0a\x05ab", True),  # a field that runs past the end
        (b"\x08" + b"\xff" * 11, True),  # an overlong varint
        (b"\x12\x00" * 3, False),  # unknown fields: skipped, as protobuf does
    ],
)
def test_a_describe_request_that_does_not_decode_is_malformed(cluster, raw, malformed):
    c = cluster(1)
    channel = grpc.insecure_channel(c.addresses[0])
    try:
        call = channel.unary_unary("/ps.ParameterServer/Describe")  # bytes in, bytes out
        if malformed:
            with pytest.raises(grpc.RpcError) as refused:
                call(raw, timeout=10)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
            assert dict(refused.value.trailing_metadata())["ps-reason"] == "malformed"
        else:
            reply = ps_pb2.DescribeReply.FromString(call(raw, timeout=10))
            assert reply.num_shards == 1 and not reply.initialized
    finally:
        channel.close()
    assert c.shard().stats()["rejected"] == int(malformed)
