"""Workers fit a linear regression through a real in-process cluster, in every mode.

The long convergence runs use one data plane: that every plane trains the same is shown bit for bit
(test_every_data_plane_trains_to_identical_weights), and on gRPC they would add 19 s to the suite.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from psgrid.psserver.protocol import Outcome
from psgrid.psserver.spec import ModelSpec
from tests.support import FEATURES, PLANES, REGRESSION, make_problem, plane_options, regression_grad, run_threads


def worker(cluster, rank, world, steps, *, batch=None, **client_kw):
    """One worker's loop: pull, gradient of its slice of the data, push. Returns final weights and outcomes."""
    x, y, _, _ = make_problem(0)
    x, y = x[rank::world], y[rank::world]
    rng = np.random.default_rng(rank)
    params, grad = REGRESSION.flat(), REGRESSION.flat()
    outcomes = []
    with cluster.client(REGRESSION, worker_id=rank, world=world, init=REGRESSION.flat(), **client_kw) as client:
        for _ in range(steps):
            client.pull(params).wait()
            idx = rng.choice(len(y), size=batch or len(y), replace=False)
            regression_grad(params, x[idx], y[idx], out=grad)
            outcomes += [r.outcome for r in client.push(grad).wait()]
        planes = client.data_planes
    return params.copy(), outcomes, planes


@pytest.mark.timeout(60)
@pytest.mark.parametrize("data_plane", ["tcp"])  # the maths of the modes, not a plane (see the docstring)
@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_workers_fit_linear_regression(cluster, data_plane, mode):
    _, _, w_true, b_true = make_problem()
    c = cluster(3, mode=mode, staleness=2, lr=0.1)
    results = run_threads([lambda r=r: worker(c, r, 4, 150) for r in range(4)], timeout=50)
    assert all(planes == [data_plane] * 3 for _, _, planes in results)
    final = c.weights()
    np.testing.assert_allclose(final[:FEATURES], w_true, atol=1e-3)
    assert abs(final[FEATURES] - b_true) < 1e-3
    stats = [s.shard.stats() for s in c.servers]
    if mode == "sync":
        # One update per round, every round made of all four workers' gradients.
        assert all(st["applied_updates"] == 150 for st in stats)
        assert all(st["dropped_late"] == 0 for st in stats)
        assert all(st["max_staleness"] == 0 for st in stats)
    else:
        assert all(st["applied_updates"] == 600 for st in stats)
    if mode == "ssp":
        # A pull at clock c waits for the slowest to reach c - s (s = 2). While a worker computes at
        # clock c, each of the 3 others may push from clock c - s (the slowest it may be) up to c + s
        # (the furthest it may pull while this one is at c): 2s + 1 updates each, and the worker's own
        # push before (overlapped with this pull) one more. Load decides how much of that is used
        # (12 was exceeded once at load 10), so the bound is the rule's, not a typical value.
        assert all(st["max_staleness"] <= 3 * (2 * 2 + 1) + 1 for st in stats)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_sixteen_workers_no_deadlock(cluster, mode):
    # 60 rounds of sixteen workers whose pulls wait at once on each shard's handlers, on every plane
    # (200 rounds took 19 s per mode on gRPC).
    steps = 60
    c = cluster(2, mode=mode, staleness=1, lr=0.05)
    results = run_threads([lambda r=r: worker(c, r, 16, steps, batch=8) for r in range(16)], timeout=80)
    assert len(results) == 16
    for server in c.servers:
        assert server.shard.stats()["applied_updates"] == (steps if mode == "sync" else 16 * steps)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wire_dtype", ["float16", "bfloat16"])
def test_low_precision_gradients_converge_like_float32(cluster, wire_dtype):
    _, _, w_true, b_true = make_problem()
    finals = {}
    for dtype in ("float32", wire_dtype):
        c = cluster(2, mode="sync", lr=0.1)
        worker(c, 0, 1, 150, wire_dtype=dtype)
        finals[dtype] = c.weights()
    np.testing.assert_allclose(finals["float32"][:FEATURES], w_true, atol=1e-3)
    np.testing.assert_allclose(finals[wire_dtype][:FEATURES], w_true, atol=2e-2)
    assert abs(finals[wire_dtype][FEATURES] - b_true) < 2e-2
    np.testing.assert_allclose(finals[wire_dtype], finals["float32"], atol=2e-2)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("data_plane", ["tcp"])
@pytest.mark.parametrize(
    "mode, wire_dtype", [("sync", "float32"), ("async", "float32"), ("sync", "bfloat16"), ("async", "float16")]
)
def test_every_data_plane_trains_to_identical_weights(cluster, tcp_calls, mode, wire_dtype):
    """The same deterministic run over shared memory, the TCP plane and gRPC: bit for bit the same weights."""
    finals, versions = {}, {}
    for plane in PLANES:
        before = dict(tcp_calls)
        c = cluster(2, mode=mode, optimizer="adam", lr=0.05)
        x, y, _, _ = make_problem(0)
        clients = [
            c.client(
                REGRESSION,
                worker_id=r,
                init=REGRESSION.flat() if r == 0 else None,
                wire_dtype=wire_dtype,
                **plane_options(plane),
            ).join()
            for r in range(2)
        ]

        def step(rank):
            params = REGRESSION.flat()
            clients[rank].pull(params).wait()
            clients[rank].push(regression_grad(params, x[rank::2], y[rank::2])).wait()

        if mode == "sync":  # the rounds make threads deterministic
            run_threads([lambda r=r: [step(r) for _ in range(12)] for r in range(2)], timeout=40)
        else:  # async: a fixed interleaving in one thread
            for _ in range(12):
                for rank in range(2):
                    step(rank)
        assert all(cl.data_planes == [plane, plane] for cl in clients)
        served = {k: tcp_calls[k] - before[k] for k in tcp_calls}
        assert served == ({"pull": 2 * 2 * 12, "push": 2 * 2 * 12} if plane == "tcp" else {"pull": 0, "push": 0})
        finals[plane], versions[plane] = c.weights(), [s.shard.version for s in c.servers]
    np.testing.assert_array_equal(finals["tcp"], finals["grpc"])
    np.testing.assert_array_equal(finals["shm"], finals["grpc"])
    assert versions["shm"] == versions["tcp"] == versions["grpc"] == ([12, 12] if mode == "sync" else [24, 24])
    assert np.abs(finals["tcp"]).sum() > 0  # something was learned


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["tcp"])
def test_client_uses_grpc_when_the_shards_offer_no_tcp_plane(cluster, tcp_calls):
    c = cluster(2, mode="async", data_plane="grpc")
    assert all(s.tcp is None for s in c.servers)
    with c.client(REGRESSION, init=REGRESSION.flat()) as client:  # it prefers tcp
        params = REGRESSION.flat()
        client.pull(params).wait()
        client.push(np.ones(REGRESSION.size, np.float32)).wait()
        client.pull(params).wait()
        assert client.data_planes == ["grpc", "grpc"]
    np.testing.assert_allclose(params, -0.01)
    assert tcp_calls == {"pull": 0, "push": 0}


@pytest.mark.timeout(60)
def test_backup_workers_drop_late_pushes_and_count_them(cluster):
    c = cluster(1, mode="sync", backup_workers=1, lr=0.05)
    fast = [c.client(REGRESSION, worker_id=r, init=REGRESSION.flat()).join() for r in range(2)]
    slow = c.client(REGRESSION, worker_id=2).join()
    grad, params = np.ones(REGRESSION.size, np.float32), REGRESSION.flat()
    slow.pull(params).wait()
    for client in fast:  # two of three pushed round 0: it closes without the slow one
        client.pull(params).wait()
        client.push(grad).wait()
    [result] = slow.push(grad).wait()
    assert result.outcome is Outcome.DROPPED_LATE
    assert result.next_clock == 1 and slow.clock == 1
    stats = c.shard().stats()
    assert stats["dropped_late"] == 1 and stats["applied_updates"] == 1
    np.testing.assert_allclose(c.shard().weights, -0.05)


@pytest.mark.timeout(90)
def test_async_updates_lose_nothing_and_no_pull_sees_a_version_half_written(cluster, data_plane):
    """Two workers push while a third pulls without pause, on a shard whose updates run outside its lock on
    three threads: every pull holds one version whole (all elements equal, the negated version), and every
    push is applied once."""
    from psgrid.psserver.kernels.parallel import MIN_CHUNK

    spec = ModelSpec([("x", (3 * MIN_CHUNK + 5,))])
    c = cluster(1, mode="async", lr=1.0, apply_threads=3)
    ones = np.ones(spec.size, np.float32)
    pushers = [
        c.client(spec, worker_id=r, init=np.zeros(spec.size, np.float32) if r == 0 else None, world=3) for r in range(2)
    ]
    reader = c.client(spec, worker_id=2, world=3)
    seen, stop = [], threading.Event()

    def push(client):
        for _ in range(25):
            client.push(ones).wait()

    def pull():
        out = np.empty(spec.size, np.float32)
        while not stop.is_set():
            [version] = reader.pull(out).wait()
            seen.append((version, float(out.min()), float(out.max())))

    run_threads([lambda: pushers[0].join(), lambda: pushers[1].join(), lambda: reader.join()], timeout=30)
    puller = threading.Thread(target=pull)
    puller.start()
    try:
        run_threads([lambda: push(pushers[0]), lambda: push(pushers[1])], timeout=60)
    finally:
        stop.set()
        puller.join(timeout=30)
    assert len(seen) > 5
    for version, low, high in seen:
        assert low == high == -version, (version, low, high)
    assert c.shard().version == 50
    np.testing.assert_array_equal(c.weights(), -50.0)
