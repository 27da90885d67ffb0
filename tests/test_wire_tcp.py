"""The TCP data plane from docs/wire.md alone: tests/wire_client.py pulls and pushes 1M floats, exactly.

The wire client imports no psgrid code (tests/test_wire_client.py checks it); its TCP frames, hello,
reason numbers and close rules are written from docs/wire.md section 2. Here it joins two shards
with a token over gRPC, then trains over their TCP ports, and every weight it pulls is compared bit
for bit with a float32 simulation of the shards' SGD (docs/wire.md section 5).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.wire_client import Refused, TcpPlane, WireWorker

pytestmark = pytest.mark.parametrize("data_plane", ["tcp"])

TOKEN = "wire-tcp-token"
PARAMS = [("embedding", [1024, 1000]), ("bias", [576])]  # 1,024,576 floats
SIZE = 1024 * 1000 + 576
LR = 0.1
STEPS = 3


def gradient(w: np.ndarray, step: int) -> np.ndarray:
    """A gradient that depends on the weights pulled (so a wrong pull shows), in float32."""
    return (w * np.float32(0.5) + np.float32(step) * np.float32(0.001)).astype(np.float32)


@pytest.mark.timeout(60)
def test_a_tcp_pull_and_push_of_a_million_floats_from_the_doc_alone_is_exact(cluster, tcp_calls):
    c = cluster(2, mode="async", lr=LR, token=TOKEN)
    init = np.random.default_rng(7).standard_normal(SIZE).astype(np.float32)
    wire = WireWorker(c.addresses, PARAMS, TOKEN, world=1, data_plane="tcp")
    try:
        wire.join(init.tobytes())
        assert [plane.address[1] for plane in wire.tcp] == [s.tcp.port for s in c.servers]
        expected = init
        for step in range(STEPS):
            pulled = np.frombuffer(wire.pull_bytes(), np.float32)
            np.testing.assert_array_equal(pulled.view(np.uint32), expected.view(np.uint32))
            grad = gradient(pulled, step)
            replies = wire.push(grad.tobytes())
            assert [r[:2] for r in replies] == [(0, step + 1)] * 2  # APPLIED, the shard's version after it
            assert wire.clock == step + 1
            expected = expected - np.float32(LR) * grad  # w - fl32(lr) * g, in float32
        np.testing.assert_array_equal(c.weights().view(np.uint32), expected.view(np.uint32))
        assert tcp_calls == {"pull": 2 * STEPS, "push": 2 * STEPS}  # every payload went over TCP
        wire.leave()
    finally:
        wire.close()


@pytest.mark.timeout(30)
def test_the_doc_alone_handles_the_tcp_planes_refusals(cluster):
    c = cluster(1, mode="async", token=TOKEN)
    wire = WireWorker(c.addresses, [("w", [8])], TOKEN, world=1, data_plane="tcp")
    try:
        wire.join([1.0] * 8)
        port = c.servers[0].tcp.port
        stranger = TcpPlane("127.0.0.1", port, "not-the-token", timeout_s=5)
        with pytest.raises(Refused) as refused:
            stranger.pull(wire.worker_id, 0, 32)
        assert (refused.value.status, refused.value.reason, stranger.sock) == (16, "unauthenticated", None)
        plane = wire.tcp[0]
        with pytest.raises(Refused) as refused:  # one element short: refused, then closed
            plane.push(wire.worker_id, 0, 0, np.ones(7, np.float32).tobytes())
        assert (refused.value.status, refused.value.reason, plane.sock) == (3, "bad_size", None)
        with pytest.raises(Refused) as refused:  # a refused pull: read whole, connection kept
            plane.pull(wire.worker_id + 1, 0, 32)
        assert (refused.value.status, refused.value.reason) == (9, "unknown_worker") and plane.sock is not None
        version, data = plane.pull(wire.worker_id, 0, 32)  # ... and it serves the next request
        assert version == 0 and np.frombuffer(data, np.float32).tolist() == [1.0] * 8
        assert c.shard().version == 0
        wire.leave()
    finally:
        wire.close()
