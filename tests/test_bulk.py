"""The raw-TCP bulk data plane (psserver/bulk.py) keeps every rule of the gRPC Pull and Push.

Same weights as the gRPC path after the same pushes, the same refusals with the
same status codes and no state change, the same consistency waits, and a
connection that dies mid-payload changes nothing.
"""

from __future__ import annotations

import socket
import threading
import time

import grpc
import numpy as np
import pytest

from psgrid.psserver import bulk as bulk_mod
from psgrid.psserver.bulk import MAGIC, PUSH, REQUEST, BulkClient, BulkError
from psgrid.psserver.client import ShardedClient
from psgrid.psserver.rpc import ps_pb2
from psgrid.psserver.spec import ModelSpec
from tests.cluster_utils import addresses, in_process_cluster, run_threads
from tests.test_integration import FEATURES, SPEC, make_problem

INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
BIG = ModelSpec([("w", (3000,)), ("b", (5,))])    # two shards of 1502 and 1503 elements


def regression_grad(params, x, y):
    residual = x @ params[:FEATURES] + params[FEATURES] - y
    grad = np.empty(SPEC.size, np.float32)
    grad[:FEATURES] = x.T @ residual / len(y)
    grad[FEATURES] = residual.mean()
    return grad


def train(addrs, clients_n, steps, *, bulk, mode, wire_dtype="float32"):
    """Deterministic training: ``clients_n`` clients, each on its slice of the problem.

    sync runs the clients in threads (the rounds make it deterministic); async
    interleaves them in one thread in a fixed order.
    """
    x, y, _, _ = make_problem(0)
    clients = [ShardedClient(addrs, bulk=bulk, wire_dtype=wire_dtype, deadline_s=20, retry_s=5)
               for _ in range(clients_n)]
    try:
        for c in clients:
            c.register(SPEC)
            c.start_heartbeats()
        clients[0].init(np.zeros(SPEC.size, np.float32))

        def step(rank):
            c = clients[rank]
            params = SPEC.flat()
            c.pull(params)
            return c.push(regression_grad(params, x[rank::clients_n], y[rank::clients_n]))

        if mode == "sync":
            run_threads([lambda r=r: [step(r) for _ in range(steps)] for r in range(clients_n)], timeout=40)
        else:
            for _ in range(steps):
                for rank in range(clients_n):
                    step(rank)
        final = SPEC.flat()
        clients[0].pull(final, clock=0)
        return final, [c.bulk[:] for c in clients]
    finally:
        for c in clients:
            c.close()


@pytest.fixture
def bulk_calls(monkeypatch):
    """Counts of pulls and pushes the shards served over the bulk plane."""
    calls = {"pull": 0, "push": 0}
    lock = threading.Lock()
    real_pull, real_push = bulk_mod.BulkServer._pull, bulk_mod.BulkServer._push

    def pull(self, *args):
        with lock:
            calls["pull"] += 1
        return real_pull(self, *args)

    def push(self, *args):
        with lock:
            calls["push"] += 1
        return real_push(self, *args)

    monkeypatch.setattr(bulk_mod.BulkServer, "_pull", pull)
    monkeypatch.setattr(bulk_mod.BulkServer, "_push", push)
    return calls


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_bulk_and_grpc_paths_give_identical_weights(mode, bulk_calls):
    results = {}
    for use_bulk in (True, False):
        before = dict(bulk_calls)
        with in_process_cluster(2, mode=mode, optimizer="adam", lr=0.05) as servers:
            final, used = train(addresses(servers), 2, 12, bulk=use_bulk, mode=mode)
            versions = [s.shard.version for s in servers]
        served = {k: bulk_calls[k] - before[k] for k in bulk_calls}
        if use_bulk:
            assert all(b is not None for per_client in used for b in per_client)
            # every pull and push of both clients went over the bulk plane (2 shards each)
            assert served == {"pull": 2 * (2 * 12 + 1), "push": 2 * 2 * 12}
        else:
            assert all(b is None for per_client in used for b in per_client)
            assert served == {"pull": 0, "push": 0}
        results[use_bulk] = final, versions
    np.testing.assert_array_equal(results[True][0], results[False][0])
    assert results[True][1] == results[False][1] == ([12, 12] if mode == "sync" else [24, 24])
    assert np.abs(results[True][0]).sum() > 0     # something was learned


@pytest.mark.timeout(30)
def test_client_uses_grpc_when_the_server_offers_no_bulk_plane(bulk_calls):
    with in_process_cluster(2, mode="async", bulk=False) as servers:
        assert all(s.bulk is None for s in servers)
        with ShardedClient(addresses(servers)) as client:     # bulk=True by default: it would use one
            client.register(SPEC)
            assert client.bulk == [None, None]
            client.init(np.zeros(SPEC.size, np.float32))
            params = SPEC.flat()
            client.pull(params)
            client.push(np.ones(SPEC.size, np.float32))
            client.pull(params)
            np.testing.assert_allclose(params, -0.01)
    assert bulk_calls == {"pull": 0, "push": 0}


# ----- bad input on the bulk plane -----------------------------------------------------------------

@pytest.fixture
def job():
    """A 2-shard async job with one registered, initialized worker; tests talk to shard 0's bulk port."""
    with in_process_cluster(2, mode="async", optimizer="adam", lr=0.1) as servers:
        with ShardedClient(addresses(servers), bulk=False) as client:
            client.register(BIG)
            client.init(np.linspace(-1, 1, BIG.size, dtype=np.float32))
            client.push(np.full(BIG.size, 0.5, np.float32))     # some optimizer state to compare
            server = servers[0]
            bulk = BulkClient("127.0.0.1", server.bulk.port)
            try:
                yield server, bulk, client.worker_id
            finally:
                bulk.close()


def state(server):
    shard = server.shard
    with shard.cond:
        opt = shard.optimizer.state_dict()
        return (shard.weights.copy(), shard.version, dict(shard.policy.clocks),
                {k: np.copy(v) for k, v in opt.items()}, shard.counters.pushes, shard.counters.applied_updates)


def assert_unchanged(before, after):
    np.testing.assert_array_equal(before[0], after[0])
    assert before[1:3] == after[1:3]
    assert before[3].keys() == after[3].keys()
    for k in before[3]:
        np.testing.assert_array_equal(before[3][k], after[3][k])
    assert before[4:] == after[4:]


def f32(values) -> bytes:
    return np.asarray(values, "<f4").tobytes()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("delta", [-4, 4, -4 * 1502, 4 * 100000])
def test_wrong_payload_size_is_refused(job, delta):
    server, bulk, worker = job
    size = server.shard.size
    before = state(server)
    payload = b"\0" * (4 * size + delta)
    with pytest.raises(BulkError) as err:
        bulk.push(payload, ps_pb2.FLOAT32, worker, 1, 1, 5)
    assert err.value.code() == INVALID and "bytes" in err.value.details()
    assert_unchanged(before, state(server))
    assert server.shard.stats()["rejected"] >= 1
    # the plane still serves this client afterwards
    out = np.empty(size, np.float32)
    assert bulk.pull_into(memoryview(out).cast("B"), worker, 1, 5) == before[1]
    np.testing.assert_array_equal(out, before[0])


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_non_finite_gradient_is_refused(job, bad, dtype):
    from psgrid.psserver import wire

    server, bulk, worker = job
    grad = np.ones(server.shard.size, np.float32)
    grad[777] = bad
    before = state(server)
    with pytest.raises(BulkError) as err:
        bulk.push(wire.encode(grad, wire.wire_dtype(dtype)), wire.wire_dtype(dtype), worker, 1, 1, 5)
    assert err.value.code() == INVALID and "NaN" in err.value.details()
    assert_unchanged(before, state(server))
    # a good push afterwards is applied (once)
    result = bulk.push(f32(np.ones(server.shard.size)), ps_pb2.FLOAT32, worker, 1, 1, 5)
    assert result["outcome"] == "APPLIED" and result["version"] == before[1] + 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", ["unknown", "evicted"])
def test_unknown_or_evicted_worker_is_refused(job, case):
    server, bulk, worker = job
    if case == "evicted":
        server.shard.leave(worker)
    target = 999 if case == "unknown" else worker
    before = state(server)
    with pytest.raises(BulkError) as err:
        bulk.push(f32(np.ones(server.shard.size)), ps_pb2.FLOAT32, target, 1, 1, 5)
    assert err.value.code() == PRECONDITION and "register again" in err.value.details()
    assert_unchanged(before, state(server))
    # a pull by that worker is refused the same way (it must not wait as if it were a member)
    out = np.empty(server.shard.size, np.float32)
    with pytest.raises(BulkError) as err:
        bulk.pull_into(memoryview(out).cast("B"), target, 5, 5)
    assert err.value.code() == PRECONDITION


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", [ps_pb2.DTYPE_UNSPECIFIED, 7, 255])
def test_unknown_dtype_is_refused(job, dtype):
    server, bulk, worker = job
    before = state(server)
    with pytest.raises(BulkError) as err:
        bulk.push(b"\0" * (4 * server.shard.size), dtype, worker, 1, 1, 5)
    assert err.value.code() == INVALID and "dtype" in err.value.details()
    assert_unchanged(before, state(server))


@pytest.mark.timeout(30)
def test_shard_not_initialized_is_a_precondition_error_as_over_grpc():
    with in_process_cluster(1, mode="async") as servers:
        server = servers[0]
        with ShardedClient(addresses(servers), bulk=False) as client:
            worker = client.register(BIG)
            bulk = BulkClient("127.0.0.1", server.bulk.port)
            try:
                # Over gRPC: FAILED_PRECONDITION ("call Init first"), as the proto promises.
                with pytest.raises(grpc.RpcError) as grpc_err:
                    client.push(np.ones(BIG.size, np.float32))
                assert grpc_err.value.code() == PRECONDITION
                for nbytes in (4 * BIG.size, 4 * 100000):    # small and large payloads alike
                    with pytest.raises(BulkError) as err:
                        bulk.push(b"\0" * nbytes, ps_pb2.FLOAT32, worker, 0, 0, 5)
                    assert err.value.code() == PRECONDITION and "Init" in err.value.details()
                out = np.empty(BIG.size, np.float32)
                with pytest.raises(BulkError) as err:
                    bulk.pull_into(memoryview(out).cast("B"), worker, 0, 5)
                assert err.value.code() == PRECONDITION
                assert not server.shard.initialized and server.shard.counters.pushes == 0
            finally:
                bulk.close()


@pytest.mark.timeout(30)
def test_large_refused_push_still_gets_its_error_not_a_reset():
    """A push refused before its payload is read must still deliver the error, however big the payload."""
    with in_process_cluster(1, mode="async") as servers:
        server = servers[0]
        spec = ModelSpec([("w", (1 << 20,))])
        with ShardedClient(addresses(servers), bulk=False) as client:
            worker = client.register(spec)
            client.init(np.zeros(spec.size, np.float32))
            bulk = BulkClient("127.0.0.1", server.bulk.port)
            try:
                for _ in range(5):
                    with pytest.raises(BulkError) as err:      # one element too many: 4 MiB + 4 bytes
                        bulk.push(b"\0" * (4 * spec.size + 4), ps_pb2.FLOAT32, worker, 0, 0, 10)
                    assert err.value.code() == INVALID
                assert server.shard.version == 0
            finally:
                bulk.close()


@pytest.mark.timeout(30)
def test_connection_closed_mid_payload_changes_nothing(job):
    server, bulk, worker = job
    size = server.shard.size
    before = state(server)
    pushes_before = server.shard.counters.pushes
    payload = f32(np.full(size, 3.0))
    sock = socket.create_connection(("127.0.0.1", server.bulk.port), timeout=5)
    try:
        sock.sendall(REQUEST.pack(MAGIC, PUSH, ps_pb2.FLOAT32, worker, 1, 1, len(payload), 5.0))
        sock.sendall(payload[: len(payload) // 2])
    finally:
        sock.close()
    # wait (bounded) until the shard has seen the connection go
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with server.bulk.lock:
            if not server.bulk.connections:
                break
        time.sleep(0.02)
    time.sleep(0.1)
    assert_unchanged(before, state(server))
    assert server.shard.counters.pushes == pushes_before
    # and the same push, complete this time, is applied (the half one did not take the clock)
    result = bulk.push(payload, ps_pb2.FLOAT32, worker, 1, 1, 5)
    assert result["outcome"] == "APPLIED" and result["next_clock"] == 2


@pytest.mark.timeout(30)
def test_bulk_pull_honours_the_sync_wait():
    with in_process_cluster(1, mode="sync", lr=1.0) as servers:
        server = servers[0]
        a, b = (ShardedClient(addresses(servers), bulk=False) for _ in range(2))
        bulk = BulkClient("127.0.0.1", server.bulk.port)
        try:
            wa, wb = a.register(SPEC), b.register(SPEC)
            a.init(np.zeros(SPEC.size, np.float32))
            grad = np.ones(SPEC.size, np.float32)
            assert bulk.push(f32(grad), ps_pb2.FLOAT32, wa, 0, 0, 5)["outcome"] == "ACCUMULATED"
            # round 0 is open (b has not pushed): a pull at clock 1 waits, and times out with a short deadline
            out = np.empty(SPEC.size, np.float32)
            t0 = time.monotonic()
            with pytest.raises(BulkError) as err:
                bulk.pull_into(memoryview(out).cast("B"), wa, 1, 0.3)
            assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            assert time.monotonic() - t0 >= 0.25
            # a pull at clock 0 does not wait
            assert bulk.pull_into(memoryview(out).cast("B"), wa, 0, 5) == 0
            result = {}

            def pull():
                result["version"] = bulk.pull_into(memoryview(out).cast("B"), wa, 1, 10)

            waiter = threading.Thread(target=pull, daemon=True)
            waiter.start()
            waiter.join(0.5)
            assert waiter.is_alive(), "bulk pull at clock 1 returned before round 0 closed"
            assert "version" not in result
            reply = b.push(grad)        # b's push (over gRPC) closes round 0
            assert reply[0]["outcome"] == "APPLIED"
            waiter.join(10)
            assert not waiter.is_alive()
            assert result["version"] == 1
            np.testing.assert_array_equal(out, -1.0)
            assert wb >= 0
        finally:
            bulk.close()
            a.close()
            b.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wire_dtype", ["float16", "bfloat16"])
def test_low_precision_pushes_over_bulk_converge_like_float32(wire_dtype, bulk_calls):
    _, _, w_true, b_true = make_problem(0)
    finals = {}
    for dtype in ("float32", wire_dtype):
        with in_process_cluster(2, mode="sync", lr=0.1) as servers:
            finals[dtype], used = train(addresses(servers), 1, 150, bulk=True, mode="sync", wire_dtype=dtype)
            assert all(b is not None for b in used[0])
    assert bulk_calls["push"] == 2 * 2 * 150
    np.testing.assert_allclose(finals["float32"][:FEATURES], w_true, atol=1e-3)
    np.testing.assert_allclose(finals[wire_dtype][:FEATURES], w_true, atol=2e-2)
    assert abs(finals[wire_dtype][FEATURES] - b_true) < 2e-2
    np.testing.assert_allclose(finals[wire_dtype], finals["float32"], atol=2e-2)
