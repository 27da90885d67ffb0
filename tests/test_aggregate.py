"""Per-host aggregation (worker/aggregate.py) in one process: no root, no namespaces."""

from __future__ import annotations

import re
import socket
import threading

import numpy as np
import pytest

from psgrid.cluster.mpi.placement import COORDINATOR, SERVER, WORKER, host_group, place
from psgrid.psserver.protocol import Outcome
from psgrid.psserver.spec import ModelSpec
from psgrid.worker.aggregate import HostGroup, host_exchange, rendezvous_name

SPEC = ModelSpec([("w", (50,))])
STEPS = 3


def gradient(rank: int, step: int) -> np.ndarray:
    return np.random.default_rng(100 * rank + step).standard_normal(SPEC.size).astype(np.float32)


def run_threads(targets) -> None:
    errors = []

    def guarded(target):
        try:
            target()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=guarded, args=(t,)) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a worker thread hung"
    if errors:
        raise errors[0]


def test_group_of_a_rank():
    assert HostGroup.of(5, 8, local_size=4) == HostGroup(host=1, hosts=2, local=1, size=4, world=8)
    with pytest.raises(ValueError, match="same number of workers"):
        HostGroup.of(0, 6, local_size=4)
    with pytest.raises(ValueError, match="consecutive ranks"):
        HostGroup.of(5, 8, local_size=4, local_rank=2)


@pytest.mark.parametrize("data_plane", ["tcp"])
def test_one_host_push_carries_the_mean_of_its_workers(cluster):
    """Sync, 2 workers: plain (2 clients) and aggregated (1 client, 1 follower) end on the same weights."""
    init = np.zeros(SPEC.size, np.float32)
    weights, outcomes = {}, {}
    for aggregate in ("none", "host"):
        c = cluster(1, mode="sync", lr=0.5)
        seen = []

        def worker(rank, c=c, aggregate=aggregate, seen=seen):
            if aggregate == "none":
                exchange = c.client(SPEC, worker_id=rank, world=2, init=init)
            else:
                group = HostGroup.of(rank, 2, local_size=2)
                exchange = host_exchange(
                    group,
                    rendezvous_name(c.addresses, f"test-{id(c)}", 0),
                    SPEC.size,
                    lambda wid, hosts: c.client(SPEC, worker_id=wid, world=hosts, init=init),
                    timeout_s=30,
                )
            params = np.empty(SPEC.size, np.float32)
            with exchange:
                for step in range(STEPS):
                    exchange.pull(params)
                    results = exchange.push(gradient(rank, step)).wait()
                    seen.append({r.outcome for r in results})

        run_threads([lambda r=r: worker(r) for r in range(2)])
        weights[aggregate], outcomes[aggregate] = c.weights().copy(), seen
    expected = -0.5 * sum((gradient(0, s) + gradient(1, s)) / 2 for s in range(STEPS))
    np.testing.assert_allclose(weights["none"], expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(weights["host"], weights["none"], rtol=1e-5, atol=1e-6)
    # Aggregated, the one push of the host closes each round: both workers hear it was applied.
    assert all(o == {Outcome.APPLIED} for o in outcomes["host"]) and len(outcomes["host"]) == 2 * STEPS


def test_sync_weights_hosts_of_different_sizes_by_their_workers():
    """Hosts of 1 and 3 workers: in sync each host's push is scaled so that the shards' mean of the 2 pushes is
    the mean of the 4 gradients; in async a push carries its host's mean."""
    small, large = HostGroup(0, 2, 0, 1, world=4), HostGroup(1, 2, 0, 3, world=4)
    grads = [np.float32(g) for g in (1.0, 2.0, 3.0, 6.0)]
    pushes = [small.scale("sync") * grads[0], large.scale("sync") * sum(grads[1:])]
    assert np.mean(pushes) == pytest.approx(np.mean(grads))
    assert large.scale("async") == pytest.approx(1 / 3) and small.scale("async") == 1.0
    assert HostGroup.of(2, 4, local_size=2).scale("sync") == HostGroup.of(2, 4, local_size=2).scale("async") == 0.5


def test_psctl_mpi_gives_each_node_one_aggregator_by_local_rank():
    # 7 ranks on 2 nodes: rank 0 coordinates, rank 1 serves a shard, ranks 2-3 and 4-6 are the workers.
    placement = place(["a"] * 4 + ["b"] * 3, [[]] * 7, 1, device="cpu")
    kinds = [role.kind for role in placement.roles]
    assert kinds == [COORDINATOR, SERVER] + [WORKER] * 5
    groups = {rank: HostGroup(*host_group(placement, rank)) for rank in range(2, 7)}
    assert [g.host for g in groups.values()] == [0, 0, 1, 1, 1]
    assert [rank for rank, g in groups.items() if g.local == 0] == [2, 4]  # one aggregator per node
    assert {(g.hosts, g.size, g.world) for r, g in groups.items() if r < 4} == {(2, 2, 5)}
    assert {(g.hosts, g.size, g.world) for r, g in groups.items() if r >= 4} == {(2, 3, 5)}
    with pytest.raises(ValueError, match="not a worker"):
        host_group(placement, 1)


@pytest.mark.mpi
@pytest.mark.slow
def test_psctl_mpi_with_host_aggregation_trains_through_one_aggregator(tmp_path):
    """5 ranks on this node: 3 workers, one aggregator (the sync weights' equality is tested above and on
    emulated hosts; a plain run of this job reaches the same accuracy, 0.827, by hand)."""
    import json

    from tests.support import run_mpiexec

    out = tmp_path / "run"
    code, _, err, _ = run_mpiexec(
        5,
        [
            "-m",
            "psgrid.cluster.cli",
            "mpi",
            "--config",
            "mnist",
            "--shards",
            "1",
            "--steps",
            "30",
            "--set",
            "train.dataset=digits",
            "--set",
            "train.model=softmax",
            "--set",
            "train.aggregate=host",
            "--out",
            str(out),
        ],
        timeout=200,
    )
    assert code == 0, err
    summary = json.loads((out / "summary.json").read_text())
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    starts = {e["rank"]: e for e in events if e.get("event") == "start"}
    assert summary["steps"] == 90 and summary["test_accuracy"] > 0.7
    assert {r: s["worker"] for r, s in starts.items()} == {0: 0, 1: 0, 2: 0}  # one client of the shards
    assert [starts[r]["data_planes"] for r in (1, 2)] == [["host"], ["host"]]


@pytest.mark.parametrize("data_plane", ["tcp"])
def test_a_follower_that_goes_away_is_left_out_and_its_host_goes_on(cluster, caplog):
    """Sync: the follower's socket closes after its first step (as at a kill -9): the leader's later pushes carry
    its own gradient alone, at the weight of its host, and the host makes all its steps."""
    c = cluster(1, mode="sync", lr=0.5)
    name = rendezvous_name(c.addresses, "test-gone", 0)
    connect = lambda wid, hosts: c.client(SPEC, worker_id=wid, world=hosts, init=np.zeros(SPEC.size, np.float32))  # noqa: E731
    outcomes = []

    def leader():
        params = np.empty(SPEC.size, np.float32)
        with host_exchange(HostGroup.of(0, 2, local_size=2), name, SPEC.size, connect, timeout_s=30) as ex:
            for step in range(STEPS):
                ex.pull(params)
                outcomes.append({r.outcome for r in ex.push(gradient(0, step)).wait()})

    def follower():
        params = np.empty(SPEC.size, np.float32)
        ex = host_exchange(HostGroup.of(1, 2, local_size=2), name, SPEC.size, connect, timeout_s=30)
        with ex:
            ex.pull(params)
            ex.push(gradient(1, 0))
            ex.sock.shutdown(socket.SHUT_RDWR)  # gone, without a word

    run_threads([leader, follower])
    expected = -0.5 * ((gradient(0, 0) + gradient(1, 0)) / 2 + sum(gradient(0, s) for s in range(1, STEPS)))
    np.testing.assert_allclose(c.weights(), expected, rtol=1e-5, atol=1e-6)
    assert outcomes == [{Outcome.APPLIED}] * STEPS
    # Seen as it is told the next weights (a broken pipe) or as its gradient is awaited (the socket closed).
    assert re.search(
        r"host 0: the worker of local rank 1 (cannot be told|went away).*the host goes on without it", caplog.text
    ), caplog.text


@pytest.mark.parametrize("data_plane", ["tcp"])
def test_when_the_leader_goes_the_follower_pushes_on_its_own(cluster, caplog):
    """Async: the leader leaves after two steps; the follower, waiting for its next weights, becomes a worker of
    its own (a new id) and makes the rest of its steps, the step in flight none (the leader had answered it)."""
    c = cluster(1, mode="async", lr=0.5)
    name = rendezvous_name(c.addresses, "test-leader-gone", 0)
    connect = lambda wid, hosts: c.client(SPEC, worker_id=wid, world=hosts, init=np.zeros(SPEC.size, np.float32))  # noqa: E731
    seen = []

    def leader():
        params = np.empty(SPEC.size, np.float32)
        with host_exchange(HostGroup.of(0, 2, local_size=2), name, SPEC.size, connect, timeout_s=30) as ex:
            for step in range(2):
                ex.pull(params)
                ex.push(gradient(0, step))

    def follower():
        params = np.empty(SPEC.size, np.float32)
        with host_exchange(HostGroup.of(1, 2, local_size=2), name, SPEC.size, connect, timeout_s=30) as ex:
            for step in range(STEPS + 1):
                ex.pull(params)
                results = ex.push(gradient(1, step)).wait()
                seen.append((ex.worker_id, ex.data_planes, {r.outcome for r in results}))

    run_threads([leader, follower])
    assert seen[:2] == [(0, ["host"], {Outcome.APPLIED})] * 2
    assert [(w != 0, planes, o) for w, planes, o in seen[2:]] == [(True, ["tcp"], {Outcome.APPLIED})] * (STEPS - 1)
    expected = -0.5 * (
        sum((gradient(0, s) + gradient(1, s)) / 2 for s in range(2)) + sum(gradient(1, s) for s in range(2, STEPS + 1))
    )
    np.testing.assert_allclose(c.weights(), expected, rtol=1e-5, atol=1e-6)
    assert "it pushes to the shards on its own from now on" in caplog.text
