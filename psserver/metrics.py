"""Prometheus metrics for one shard, fed by the shard's events; served over HTTP."""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily


class ShardMetrics:
    """Counters and histograms updated on every shard event, plus gauges read on scrape."""

    def __init__(self, shard, registry: CollectorRegistry):
        labels = {"shard": str(shard.config.shard_index)}
        self.shard = shard

        def counter(name, doc):
            return Counter(name, doc, list(labels), registry=registry).labels(**labels)

        self.pushes = counter("ps_pushes", "Push streams received")
        self.pulls = counter("ps_pulls", "Pull streams served")
        self.bytes_in = counter("ps_bytes_in", "Payload bytes received")
        self.bytes_out = counter("ps_bytes_out", "Payload bytes sent")
        self.applied = counter("ps_applied_updates", "Optimizer steps applied")
        self.dropped = counter("ps_dropped_late_pushes", "Sync pushes dropped because their round had closed")
        self.evictions = counter("ps_evictions", "Workers evicted for an expired lease")
        self.staleness = Histogram(
            "ps_update_staleness",
            "Staleness of applied updates (versions)",
            list(labels),
            buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64),
            registry=registry,
        ).labels(**labels)
        self.wait = Histogram(
            "ps_pull_wait_seconds",
            "Seconds pulls spent in consistency waits",
            list(labels),
            buckets=(0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 30),
            registry=registry,
        ).labels(**labels)
        registry.register(self)
        shard.listeners.append(self.on_event)

    def on_event(self, event: str, **fields) -> None:
        if event == "push":
            self.pushes.inc()
            self.bytes_in.inc(fields["nbytes"])
        elif event == "pull":
            self.pulls.inc()
            self.bytes_out.inc(fields["nbytes"])
        elif event == "applied":
            self.applied.inc()
        elif event == "dropped_late":
            self.dropped.inc()
        elif event == "eviction":
            self.evictions.inc()
        elif event == "staleness":
            self.staleness.observe(fields["value"])
        elif event == "wait":
            self.wait.observe(fields["seconds"])

    def collect(self):
        # Read on scrape, not on every event. Avoid the shard lock's re-entrance: this runs
        # on the HTTP thread, never inside a shard method.
        stats = self.shard.stats()
        label = [str(stats["shard_index"])]
        for name, doc, value in (
            ("ps_version", "Updates applied to this shard's weights", stats["version"]),
            ("ps_members", "Live workers", len(stats["members"])),
            ("ps_min_clock", "Slowest live worker clock", stats["min_clock"]),
            ("ps_max_clock", "Fastest live worker clock", stats["max_clock"]),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=["shard"])
            gauge.add_metric(label, value)
            yield gauge

    def describe(self):
        return []


class Exporter:
    def __init__(self, server: WSGIServer, thread, port: int):
        self.server, self.thread, self.port = server, thread, port

    def shutdown(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_exporter(shard, host: str, port: int) -> Exporter:
    """Serve this shard's metrics on http://host:port/metrics (port 0: any free port)."""
    registry = CollectorRegistry()
    ShardMetrics(shard, registry)
    server, thread = start_http_server(port, addr=host, registry=registry)
    return Exporter(server, thread, server.server_address[1])
