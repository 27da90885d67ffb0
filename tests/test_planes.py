"""A data plane is a plug-in: one module per end, registered by name, and no other module knows it.

The ``mailbox`` plane below exists only here and is no subclass of a built-in plane. Its server end is
a thread that takes requests from a queue and answers them through what the shard's service offers
every plane: a pull lease (``service.pull``: a snapshot to send from, given back when sent) and a push
whose whole gradient the plane hands over as a source of its own (``service.push(source=...)``, which
the intake fills with ``fill(source)``). Its client end puts requests in that queue; its offer is a
key into this module's table of mailboxes, a form of address nothing but its two ends reads, so what
a client does with it went through the registries and nowhere else.
"""

from __future__ import annotations

import queue
import secrets
import threading

import numpy as np
import pytest

from psgrid.psserver import dtypes as wire
from psgrid.psserver.exceptions import InvalidArgument, Unavailable
from psgrid.psserver.intake import GRADIENT_DTYPES, check_dtype
from psgrid.psserver.protocol import CONTROL_PLANE, FLOAT16, ITEMSIZE, PLANES, Reason, Registration
from psgrid.psserver.rpc import ps_pb2
from psgrid.psserver.transports.base import (
    ConnectOptions,
    DataPlane,
    Listening,
    plane_names,
    register_data_plane,
    register_listener,
    unregister_plane,
)
from psgrid.psserver.transports.grpc_client import registration_from_reply
from psgrid.psserver.transports.stream_server import SocketDataServer
from tests.support import REGRESSION, make_problem, regression_grad

MAILBOX = "mailbox"
PREFIX = "mailbox:"  # the plane's own form of address: nothing but its two ends reads it
MAILBOXES: dict[str, queue.SimpleQueue] = {}  # offer -> the requests of a listening shard's mailbox
REPLY_S = 30.0  # a request is answered within its deadline and this


# ----- the server end ------------------------------------------------------------------------------


class Payload:
    """The mailbox plane's gradient: its bytes in a wire dtype, copied into the shard's buffer as they are decoded."""

    def __init__(self, dtype: int, data: bytes):
        self.dtype, self.data = dtype, data

    @property
    def nbytes(self) -> int:
        return len(self.data)

    def check(self, size: int) -> None:
        check_dtype(self.dtype, GRADIENT_DTYPES)
        if len(self.data) != size * ITEMSIZE[self.dtype]:
            raise InvalidArgument(f"{len(self.data)} bytes for a range of {size} elements", Reason.BAD_SIZE)

    def lend(self) -> None:
        return None  # bytes in a message: the shard reads a copy of its own

    def copy_into(self, destination: np.ndarray) -> bool:
        wire.decode_into(destination, self.data, self.dtype)
        return False  # not checked for NaN here: the intake does so as the shard's rule says


class MailboxListener:
    """A shard's mailbox: one thread answers its requests in turn through the shard's service."""

    def __init__(self, service):
        self.service = service
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.address: str | None = None  # offered while started
        self.thread = threading.Thread(target=self._serve, name="mailbox-plane", daemon=True)

    def start(self) -> None:
        self.address = f"{PREFIX}{secrets.token_hex(8)}"
        MAILBOXES[self.address] = self.requests
        self.thread.start()

    def stop(self) -> None:
        MAILBOXES.pop(self.address, None)
        self.requests.put(None)
        self.thread.join(timeout=10)

    def _serve(self) -> None:
        while (request := self.requests.get()) is not None:
            operation, arguments, answer = request
            try:
                answer.put((True, operation(self, **arguments)))
            except Exception as exc:  # noqa: BLE001 - a refusal travels back as data and is raised there
                answer.put((False, exc))

    def pull(self, *, worker_id: int, clock: int, timeout_s: float) -> tuple[int, bytes]:
        with self.service.pull(worker_id=worker_id, clock=clock, timeout_s=timeout_s) as snapshot:
            return snapshot.version, bytes(snapshot.payload())

    def push(self, *, dtype: int, data: bytes, worker_id: int, clock: int, version: int):
        return self.service.push(worker_id=worker_id, clock=clock, version=version, source=Payload(dtype, data))


def mailbox_listener(service, config, context) -> Listening:
    listener = MailboxListener(service)
    return Listening(listener, address=lambda: listener.address)


# ----- the client end ------------------------------------------------------------------------------


class MailboxPlane(DataPlane):
    """Pulls and pushes of one shard's range as requests in its mailbox; counts what it moves."""

    name = MAILBOX
    moved = {"pull": 0, "push": 0}

    def __init__(self, requests: queue.SimpleQueue):
        self.requests = requests

    def _call(self, operation, deadline_s: float, /, **arguments):
        answer: queue.SimpleQueue = queue.SimpleQueue()
        self.requests.put((operation, arguments, answer))
        try:
            ok, value = answer.get(timeout=deadline_s + REPLY_S)
        except queue.Empty:
            raise Unavailable("the shard's mailbox did not answer") from None
        if not ok:
            raise value
        return value

    def pull_into(self, out: np.ndarray, *, begin: int, worker_id: int, clock: int, timeout_s: float) -> int:
        MailboxPlane.moved["pull"] += 1
        version, data = self._call(
            MailboxListener.pull, timeout_s, worker_id=worker_id, clock=clock, timeout_s=timeout_s
        )
        out[:] = np.frombuffer(data, np.float32)
        return version

    def push(self, grad, *, begin: int, wire_dtype: int, worker_id: int, clock: int, version: int, timeout_s: float):
        MailboxPlane.moved["push"] += 1
        data = bytes(wire.encode(np.asarray(grad, np.float32), wire_dtype))
        return self._call(
            MailboxListener.push,
            timeout_s,
            dtype=wire_dtype,
            data=data,
            worker_id=worker_id,
            clock=clock,
            version=version,
        )

    def close(self) -> None:
        """Nothing to release: a request's answer comes in a queue of its own."""


def mailbox_client(control, address: str, options: ConnectOptions) -> MailboxPlane | None:
    assert address.startswith(PREFIX), address
    requests = MAILBOXES.get(address)  # a shard of another process has no mailbox here: take the next plane
    return None if requests is None else MailboxPlane(requests)


@pytest.fixture
def mailbox():
    """The mailbox plane registered on both ends for one test."""
    MailboxPlane.moved = {"pull": 0, "push": 0}
    register_data_plane(MAILBOX, mailbox_client)
    register_listener(MAILBOX, mailbox_listener)
    yield MailboxPlane.moved
    unregister_plane(MAILBOX)


# ----- the tests -----------------------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("data_plane", ["grpc"])  # the shards serve no TCP plane: only the mailbox and gRPC
def test_a_plane_defined_only_by_a_test_trains_pulls_and_pushes(cluster, mailbox):
    c = cluster(2, mode="sync", data_plane="grpc", lr=0.1)
    assert all(s.tcp is None and isinstance(s.mailbox, MailboxListener) for s in c.servers)
    assert not isinstance(c.servers[0].mailbox, SocketDataServer)  # no built-in plane's server underneath
    x, y, _, _ = make_problem()
    params, grad = np.zeros(REGRESSION.size, np.float32), np.empty(REGRESSION.size, np.float32)
    with c.client(REGRESSION, world=1, init=params.copy(), data_plane=MAILBOX, shared_memory=False) as client:
        for _ in range(40):
            client.pull(params)
            client.push(regression_grad(params, x, y, grad))
        client.pull(params)
        assert client.data_planes == [MAILBOX, MAILBOX]
    assert mailbox == {"pull": 2 * 41, "push": 2 * 40}  # every payload of both shards went over the mailbox
    assert all(s.shard.version == 40 for s in c.servers)
    loss = lambda p: float(np.mean((x @ p[:-1] + p[-1] - y) ** 2))  # noqa: E731
    assert loss(params) < 0.5 * loss(np.zeros_like(params))  # it learned, from the mailbox's weights
    with c.admin(data_plane=MAILBOX, shared_memory=False) as admin:  # an observer takes it too
        handle = admin.pull()
        handle.wait()
        np.testing.assert_array_equal(handle.out, c.weights())
    assert mailbox["pull"] == 2 * 42


@pytest.mark.timeout(60)
@pytest.mark.parametrize("data_plane", ["grpc"])
@pytest.mark.parametrize("mode", ["sync", "async"])  # checked as it lands, or by the update as it reads it
def test_a_plug_in_planes_gradient_meets_every_planes_checks(cluster, mailbox, mode):
    c = cluster(1, mode=mode, data_plane="grpc")
    server = c.servers[0]
    with c.client(REGRESSION, world=1, init=np.zeros(REGRESSION.size, np.float32), data_plane=MAILBOX) as client:
        client.pull(np.empty(REGRESSION.size, np.float32))
        plane = MailboxPlane(MAILBOXES[server.mailbox.address])
        bad = np.ones(REGRESSION.size, np.float32)
        bad[3] = np.nan
        push = lambda grad: plane.push(grad, begin=0, wire_dtype=FLOAT16, worker_id=0, clock=0, version=0, timeout_s=10)  # noqa: E731
        for grad, reason in ((bad, Reason.NON_FINITE), (np.ones(REGRESSION.size - 1, np.float32), Reason.BAD_SIZE)):
            with pytest.raises(InvalidArgument) as refused:
                push(grad)
            assert refused.value.reason is reason
        assert server.shard.version == 0 and server.shard.pool.on_loan == 0  # nothing taken, nothing kept
        assert push(np.ones(REGRESSION.size, np.float32)).version == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("data_plane", ["grpc"])
def test_registration_lists_every_listeners_offer_and_a_client_skips_planes_it_does_not_know(cluster, mailbox):
    unregister_plane(MAILBOX)
    before = cluster(1, data_plane="tcp", shared_memory=False)
    register_listener(MAILBOX, mailbox_listener)  # the shard end only: clients here do not know the mailbox
    c = cluster(1, data_plane="tcp", shared_memory=False)
    server = c.servers[0]
    assert dict(server.service.offers()) == {
        CONTROL_PLANE: "",
        "tcp": str(server.tcp.port),
        MAILBOX: server.mailbox.address,
    }
    assert server.mailbox.address.startswith(PREFIX)
    assert MAILBOX not in dict(before.servers[0].service.offers())  # a listener serves the shards started after
    with c.client(REGRESSION, init=np.zeros(REGRESSION.size, np.float32), data_plane="tcp") as client:
        client.pull(np.empty(REGRESSION.size, np.float32))
        assert client.data_planes == ["tcp"]
    with pytest.raises(InvalidArgument, match="data_plane must be one of"):
        c.client(REGRESSION, data_plane=MAILBOX)  # not a plane this client knows: its end is not registered


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
