"""An in-process cluster on 127.0.0.1 port 0, in the spirit of dask's gen_cluster.

``in_process_cluster(S, **server_settings)`` starts S shard servers in this
process and yields them; on teardown it checks invariants every shard must
hold after any run, and stops every server.
"""

from __future__ import annotations

import contextlib
import threading

import numpy as np

from psgrid.psserver.config import ServerConfig
from psgrid.psserver.server import serve


def check_invariants(server) -> None:
    stats = server.shard.stats()
    for key in ("pushes", "pulls", "applied_updates", "dropped_late", "duplicates", "evictions", "rejected"):
        assert stats[key] >= 0, key
    assert sum(stats["staleness_counts"]) <= stats["pushes"]
    if server.shard.initialized:
        assert np.isfinite(server.shard.weights).all(), "weights went non-finite"
        assert stats["applied_updates"] == stats["version"]
    assert not server.shard.cond._is_owned(), "shard lock left held"


@contextlib.contextmanager
def in_process_cluster(num_shards: int = 2, **settings):
    servers = []
    try:
        for i in range(num_shards):
            servers.append(serve(ServerConfig(shard_index=i, num_shards=num_shards, host="127.0.0.1", port=0,
                                              **settings)))
        yield servers
        for server in servers:
            check_invariants(server)
    finally:
        for server in servers:
            server.stop(grace=0.5)


def addresses(servers) -> list[str]:
    return [s.address for s in servers]


def run_threads(targets, timeout: float) -> list:
    """Run callables in threads; re-raise the first error; fail if any is still running after timeout."""
    results = [None] * len(targets)
    errors = []

    def wrap(i, fn):
        try:
            results[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(i, fn), daemon=True) for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    alive = [t for t in threads if t.is_alive()]
    if errors:
        raise errors[0]
    assert not alive, f"{len(alive)} threads still running after {timeout}s (deadlock?)"
    return results
