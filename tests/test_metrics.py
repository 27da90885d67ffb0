"""Each shard serves Prometheus metrics: counters, histograms and gauges that move with the job."""

from __future__ import annotations

import time
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from psgrid.psserver.client import ShardedClient
from psgrid.psserver.spec import ModelSpec
from tests.cluster_utils import addresses, in_process_cluster

SPEC = ModelSpec([("w", (100,))])


def scrape(server) -> dict:
    url = f"http://127.0.0.1:{server.metrics.port}/metrics"
    text = urllib.request.urlopen(url, timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, sample.labels.get("le", ""))] = sample.value
    return samples


@pytest.mark.timeout(60)
def test_metrics_follow_pushes_pulls_and_evictions():
    with in_process_cluster(1, mode="sync", backup_workers=1, lr=0.1, metrics_port=0, lease_s=0.5) as servers:
        server = servers[0]
        assert server.metrics.port > 0
        clients = [ShardedClient(addresses(servers)) for _ in range(3)]
        try:
            for c in clients:
                c.register(SPEC)
            clients[0].init(np.zeros(SPEC.size, np.float32))
            buf, grad = SPEC.flat(), np.ones(SPEC.size, np.float32)
            for c in clients[:2]:
                c.pull(buf)
                c.push(grad)                  # two of three: round 0 closes
            clients[2].pull(buf, clock=0)
            clients[2].push(grad)             # late: dropped
            m = scrape(server)
            assert m[("ps_pushes_total", "")] == 3
            assert m[("ps_pulls_total", "")] == 3
            assert m[("ps_bytes_in_total", "")] == 3 * SPEC.nbytes
            assert m[("ps_applied_updates_total", "")] == 1
            assert m[("ps_dropped_late_pushes_total", "")] == 1
            assert m[("ps_update_staleness_count", "")] == 2
            assert m[("ps_pull_wait_seconds_count", "")] == 3
            assert m[("ps_version", "")] == 1 and m[("ps_members", "")] == 3
            # Nobody heart-beats: after the lease every member is evicted, and the metrics say so.
            deadline = time.monotonic() + 10
            while scrape(server)[("ps_members", "")] > 0 and time.monotonic() < deadline:
                time.sleep(0.1)
            m = scrape(server)
            assert m[("ps_members", "")] == 0 and m[("ps_evictions_total", "")] == 3
        finally:
            for c in clients:
                c.close()
