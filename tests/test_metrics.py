"""Each shard serves Prometheus metrics: counters, histograms and gauges that move with the job."""

from __future__ import annotations

import time
import urllib.request

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from psgrid.psserver.spec import ModelSpec

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
def test_metrics_follow_pushes_pulls_and_evictions(cluster):
    c = cluster(1, mode="sync", backup_workers=1, lr=0.1, metrics_port=0, lease_s=0.5)
    server = c.servers[0]
    assert server.metrics.port > 0
    # Nobody heart-beats (once an hour), so all three are evicted after the lease.
    clients = [c.client(SPEC, worker_id=r, init=SPEC.flat(), heartbeat_s=3600).join() for r in range(3)]
    buf, grad = SPEC.flat(), np.ones(SPEC.size, np.float32)
    clients[2].pull(buf).wait()
    for client in clients[:2]:
        client.pull(buf).wait()
        client.push(grad).wait()  # two of three: round 0 closes
    clients[2].push(grad).wait()  # late: dropped
    m = scrape(server)
    assert m[("ps_pushes_total", "")] == 3
    assert m[("ps_pulls_total", "")] == 3
    assert m[("ps_bytes_in_total", "")] == 3 * SPEC.nbytes
    assert m[("ps_applied_updates_total", "")] == 1
    assert m[("ps_dropped_late_pushes_total", "")] == 1
    assert m[("ps_update_staleness_count", "")] == 2
    assert m[("ps_pull_wait_seconds_count", "")] == 3
    assert m[("ps_version", "")] == 1 and m[("ps_members", "")] == 3
    deadline = time.monotonic() + 10
    while scrape(server)[("ps_members", "")] > 0 and time.monotonic() < deadline:
        time.sleep(0.1)
    m = scrape(server)
    assert m[("ps_members", "")] == 0 and m[("ps_evictions_total", "")] == 3
