"""Per-host aggregation (worker/aggregate.py) in one process: no root, no namespaces."""

from __future__ import annotations

import threading

import numpy as np
import pytest

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
    assert HostGroup.of(5, 8, local_size=4) == HostGroup(host=1, hosts=2, local=1, size=4)
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
                exchange = host_exchange(group, rendezvous_name(c.addresses, f"test-{id(c)}", 0), SPEC.size,
                                         lambda wid, hosts: c.client(SPEC, worker_id=wid, world=hosts, init=init),
                                         timeout_s=30)
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
