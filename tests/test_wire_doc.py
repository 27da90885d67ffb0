"""docs/wire.md is the wire, byte by byte: its test vectors are built and parsed here by the project's own code.

Every ```hex block of the doc that follows a line naming a frame (``vector: NAME``) is compared with
the frame the code builds for the fields the doc's table gives, and parsed back by the code's decoder,
so the doc cannot drift from the bytes the shards and clients send.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest

from psgrid.psserver.rpc import ps_pb2, ps_pb2_grpc
from psgrid.psserver.spec import ModelSpec

SPEC = ModelSpec([("w", (12,))])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["grpc"])
@pytest.mark.parametrize("headers", [1, 2], ids=["one message", "two messages"])
def test_a_push_of_headers_alone_is_bad_size(cluster, headers):
    """A Push whose messages carry no chunk ended before its range: bad_size, as the proto lists it."""
    c = cluster(1)
    client = c.client(SPEC, init=np.ones(SPEC.size, np.float32)).join()
    channel = grpc.insecure_channel(c.addresses[0])
    try:
        push = ps_pb2_grpc.ParameterServerStub(channel).Push
        messages = [ps_pb2.PushRequest(worker_id=client.worker_id, clock=0, version=0, num_chunks=1)] + \
            [ps_pb2.PushRequest()] * (headers - 1)
        with pytest.raises(grpc.RpcError) as refused:
            push(iter(messages), timeout=10)
    finally:
        channel.close()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(refused.value.trailing_metadata())["ps-reason"] == "bad_size"
    assert "covered 0 of this shard's 12 elements" in refused.value.details()
    assert c.shard().version == 0 and c.shard().stats()["rejected"] == 1
