"""Clients fit a linear regression through a real in-process cluster, in every mode."""

from __future__ import annotations

import numpy as np
import pytest

from psgrid.psserver.client import ShardedClient
from psgrid.psserver.spec import ModelSpec
from tests.cluster_utils import addresses, in_process_cluster, run_threads

FEATURES = 12
SPEC = ModelSpec([("w", (FEATURES,)), ("b", (1,))])


def make_problem(seed=0, n=400):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    w_true = rng.normal(size=FEATURES).astype(np.float32)
    b_true = np.float32(0.7)
    return x, x @ w_true + b_true, w_true, b_true


def worker(addrs, rank, world, steps, *, wire_dtype="float32", batch=None, seed=0):
    x, y, _, _ = make_problem(seed)
    x, y = x[rank::world], y[rank::world]
    rng = np.random.default_rng(rank)
    params = SPEC.flat()
    grad = SPEC.flat()
    with ShardedClient(addrs, wire_dtype=wire_dtype, deadline_s=30) as client:
        client.register(SPEC)
        client.start_heartbeats()
        init = np.zeros(SPEC.size, np.float32)
        client.init(init)
        outcomes = []
        for _ in range(steps):
            client.pull(params)
            idx = rng.choice(len(y), size=batch or len(y), replace=False)
            xb, yb = x[idx], y[idx]
            residual = xb @ params[:FEATURES] + params[FEATURES] - yb
            grad[:FEATURES] = xb.T @ residual / len(yb)
            grad[FEATURES] = residual.mean()
            outcomes += [r["outcome"] for r in client.push(grad)]
        client.pull(params, clock=0)   # the final weights, whatever the others are doing
        return params.copy(), outcomes


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_clients_fit_linear_regression(mode):
    _, _, w_true, b_true = make_problem()
    with in_process_cluster(3, mode=mode, staleness=2, lr=0.1) as servers:
        results = run_threads([lambda r=r: worker(addresses(servers), r, 4, 150) for r in range(4)], timeout=50)
        final = results[0][0]
        np.testing.assert_allclose(final[:FEATURES], w_true, atol=1e-3)
        assert abs(final[FEATURES] - b_true) < 1e-3
        stats = [s.shard.stats() for s in servers]
        if mode == "sync":
            # One update per round, every round made of all four workers' gradients.
            assert all(st["applied_updates"] == 150 for st in stats)
            assert all(st["dropped_late"] == 0 for st in stats)
            assert all(st["max_staleness"] == 0 for st in stats)
        else:
            assert all(st["applied_updates"] == 600 for st in stats)
        if mode == "ssp":
            # A pull at clock c waited for the slowest to reach c - 2: clocks never drift further.
            assert all(st["max_staleness"] <= 3 * 3 + 3 for st in stats)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_sixteen_clients_no_deadlock(mode):
    with in_process_cluster(2, mode=mode, staleness=1, lr=0.05) as servers:
        results = run_threads([lambda r=r: worker(addresses(servers), r, 16, 200, batch=8) for r in range(16)],
                              timeout=80)
        assert len(results) == 16
        for server in servers:
            assert server.shard.stats()["min_clock"] == 200 or not server.shard.policy.clocks


@pytest.mark.timeout(60)
@pytest.mark.parametrize("wire_dtype", ["float16", "bfloat16"])
def test_low_precision_gradients_still_converge(wire_dtype):
    _, _, w_true, _ = make_problem()
    with in_process_cluster(2, mode="sync", lr=0.1) as servers:
        final, _ = worker(addresses(servers), 0, 1, 200, wire_dtype=wire_dtype)
        np.testing.assert_allclose(final[:FEATURES], w_true, atol=2e-2)


@pytest.mark.timeout(60)
def test_backup_workers_drop_late_pushes_and_count_them():
    with in_process_cluster(1, mode="sync", backup_workers=1, lr=0.05) as servers:
        addrs = addresses(servers)
        fast = [ShardedClient(addrs) for _ in range(2)]
        slow = ShardedClient(addrs)
        try:
            for c in (*fast, slow):
                c.register(SPEC)
            fast[0].init(np.zeros(SPEC.size, np.float32))
            grad = np.ones(SPEC.size, np.float32)
            params = SPEC.flat()
            for c in fast:                 # two of three pushed round 0: it closes without the slow one
                c.pull(params)
                c.push(grad)
            slow.pull(params, clock=0)
            [result] = slow.push(grad)
            assert result["outcome"] == "DROPPED_LATE"
            assert result["next_clock"] == 1 and slow.clock == 1
            stats = servers[0].shard.stats()
            assert stats["dropped_late"] == 1 and stats["applied_updates"] == 1
            np.testing.assert_allclose(servers[0].shard.weights, -0.05)
        finally:
            for c in (*fast, slow):
                c.close()


@pytest.mark.timeout(60)
def test_retried_push_is_applied_once():
    with in_process_cluster(2, mode="async", lr=1.0) as servers:
        with ShardedClient(addresses(servers)) as client:
            client.register(SPEC)
            client.init(np.zeros(SPEC.size, np.float32))
            grad = np.ones(SPEC.size, np.float32)
            client.push(grad)
            client.clock = 0               # as if the reply was lost and the push sent again
            results = client.push(grad)
            assert {r["outcome"] for r in results} == {"DUPLICATE"}
            assert client.clock == 1
            for server in servers:
                np.testing.assert_array_equal(server.shard.weights, -1.0)
                assert server.shard.stats()["duplicates"] == 1
