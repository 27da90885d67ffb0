"""A data plane is a plug-in: one module per end, registered by name, and no other module knows it.

The ``relay`` plane below exists only here. It wraps the TCP plane on both ends (its listener is a
TCP data server, its client a TCP data plane that counts what it moves) and offers its port in a
form of its own, so what a client does with it went through the registries and nowhere else.
"""

from __future__ import annotations

import numpy as np
import pytest

from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.protocol import CONTROL_PLANE, PLANES, Registration
from psgrid.psserver.rpc import ps_pb2
from psgrid.psserver.transports.base import (
    ConnectOptions,
    Listening,
    plane_names,
    register_data_plane,
    register_listener,
    unregister_plane,
)
from psgrid.psserver.transports.grpc_client import registration_from_reply
from psgrid.psserver.transports.tcp_client import TcpDataPlane
from psgrid.psserver.transports.tcp_server import TcpDataServer
from tests.support import REGRESSION, make_problem, regression_grad

RELAY = "relay"
PREFIX = "relay-port:"  # the relay's own form of address: nothing but its two ends reads it


class CountingPlane(TcpDataPlane):
    name = RELAY
    moved = {"pull": 0, "push": 0}

    def pull_into(self, out, **kw):
        CountingPlane.moved["pull"] += 1
        return super().pull_into(out, **kw)

    def push(self, grad, **kw):
        CountingPlane.moved["push"] += 1
        return super().push(grad, **kw)


def relay_client(control, address: str, options: ConnectOptions):
    assert address.startswith(PREFIX), address
    return CountingPlane(control.address.rsplit(":", 1)[0], int(address[len(PREFIX) :]), options)


def relay_listener(service, config, context) -> Listening:
    server = TcpDataServer(
        service, config.host, config.token, context.ssl_context, handlers=4, on_failure=context.on_failure
    )
    return Listening(server, address=lambda: f"{PREFIX}{server.port}")


@pytest.fixture
def relay():
    """The relay plane registered on both ends for one test."""
    CountingPlane.moved = {"pull": 0, "push": 0}
    register_data_plane(RELAY, relay_client)
    register_listener(RELAY, relay_listener)
    yield CountingPlane.moved
    unregister_plane(RELAY)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("data_plane", ["grpc"])  # the shards serve no TCP plane: only the relay and gRPC
def test_a_plane_defined_only_by_a_test_trains_pulls_and_pushes(cluster, relay):
    c = cluster(2, mode="sync", data_plane="grpc", lr=0.1)
    assert all(s.tcp is None and isinstance(s.relay, TcpDataServer) for s in c.servers)
    x, y, _, _ = make_problem()
    params, grad = np.zeros(REGRESSION.size, np.float32), np.empty(REGRESSION.size, np.float32)
    with c.client(REGRESSION, world=1, init=params.copy(), data_plane=RELAY, shared_memory=False) as client:
        for _ in range(40):
            client.pull(params)
            client.push(regression_grad(params, x, y, grad))
        client.pull(params)
        assert client.data_planes == [RELAY, RELAY]
    assert relay == {"pull": 2 * 41, "push": 2 * 40}  # every payload of both shards went over the relay
    assert all(s.shard.version == 40 for s in c.servers)
    loss = lambda p: float(np.mean((x @ p[:-1] + p[-1] - y) ** 2))  # noqa: E731
    assert loss(params) < 0.5 * loss(np.zeros_like(params))  # it learned, from the relay's weights
    with c.admin(data_plane=RELAY, shared_memory=False) as admin:  # an observer takes it too
        handle = admin.pull()
        handle.wait()
        np.testing.assert_array_equal(handle.out, c.weights())
    assert relay["pull"] == 2 * 42


@pytest.mark.timeout(60)
@pytest.mark.parametrize("data_plane", ["grpc"])
def test_registration_lists_every_listeners_offer_and_a_client_skips_planes_it_does_not_know(cluster, relay):
    unregister_plane(RELAY)
    before = cluster(1, data_plane="tcp", shared_memory=False)
    register_listener(RELAY, relay_listener)  # the shard end only: clients here do not know the relay
    c = cluster(1, data_plane="tcp", shared_memory=False)
    server = c.servers[0]
    assert dict(server.service.offers()) == {
        CONTROL_PLANE: "",
        "tcp": str(server.tcp.port),
        RELAY: f"{PREFIX}{server.relay.port}",
    }
    assert RELAY not in dict(before.servers[0].service.offers())  # a listener serves the shards started after
    with c.client(REGRESSION, init=np.zeros(REGRESSION.size, np.float32), data_plane="tcp") as client:
        client.pull(np.empty(REGRESSION.size, np.float32))
        assert client.data_planes == ["tcp"]
    with pytest.raises(InvalidArgument, match="data_plane must be one of"):
        c.client(REGRESSION, data_plane=RELAY)  # not a plane this client knows: its end is not registered


def test_the_plane_names_have_one_source():
    assert plane_names()[: len(PLANES)] == PLANES == ("local", "ipc", "shm", "tcp", "grpc")
    with pytest.raises(ValueError, match="built-in"):
        unregister_plane("tcp")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("data_plane", ["shm"])
def test_an_old_client_reads_the_per_plane_fields_and_a_new_one_reads_an_old_shards(cluster):
    import grpc

    c = cluster(1)
    server = c.servers[0]
    with grpc.insecure_channel(server.address) as channel:
        raw = channel.unary_unary(
            "/ps.ParameterServer/Register",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=ps_pb2.RegisterReply.FromString,
        )(ps_pb2.RegisterRequest(worker_id=-1, start_clock=-1, host="old", observer=True), timeout=10)
    offered = {p.name: p.address for p in raw.planes}
    assert offered == {"grpc": "", "tcp": str(server.tcp.port), "shm": server.shm.address}
    assert (raw.tcp_port, raw.shm_socket) == (server.tcp.port, server.shm.address)  # what an old client reads
    # A shard of the release before `planes` fills only the per-plane fields: a new client reads those.
    old = ps_pb2.RegisterReply(num_shards=1, tcp_port=raw.tcp_port, shm_socket=raw.shm_socket)
    assert registration_from_reply(old).planes == (("grpc", ""), ("tcp", str(raw.tcp_port)), ("shm", raw.shm_socket))
    assert registration_from_reply(ps_pb2.RegisterReply(num_shards=1)).planes == (("grpc", ""),)
    reg = registration_from_reply(raw)
    assert isinstance(reg, Registration) and reg.address("tcp") == str(server.tcp.port) and reg.address("x") is None
    assert reg.without("shm", server.shm.address).address("shm") is None
