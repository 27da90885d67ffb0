"""A shard's shared-memory plane holds a bounded number of readers: a client it refuses takes the network plane.

A token holder keeping every reader slot (weight_ring.MAX_SHARED_READERS) open must not stop other
clients on the host: the one refused for too many connections falls back to its network plane for
that shard, says so in one line, and trains.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from psgrid.psserver.exceptions import Unavailable
from psgrid.psserver.protocol import Reason
from psgrid.psserver.state.weight_ring import MAX_SHARED_READERS
from psgrid.psserver.transports.base import ConnectOptions
from psgrid.psserver.transports.shm_client import ShmDataPlane
from tests.support import REGRESSION

TOKEN = "s3cret"


def hold_every_reader_slot(address: str) -> tuple[ShmDataPlane, list]:
    """Connections of the shared-memory plane that OPEN a reader slot each, until the shard refuses one."""
    holder = ShmDataPlane(address, ConnectOptions(token=TOKEN))
    held = []
    for _ in range(MAX_SHARED_READERS):
        conn = holder.connect(5.0)
        held.append(conn)
        holder.open_slot(conn)
    extra = holder.connect(5.0)
    held.append(extra)
    with pytest.raises(Unavailable) as refused:
        holder.open_slot(extra)
    assert refused.value.reason is Reason.TOO_MANY_CONNECTIONS
    return holder, held


@pytest.mark.parametrize("data_plane", ["shm"])
@pytest.mark.timeout(60)
def test_a_client_refused_by_a_full_shared_memory_plane_trains_over_tcp(cluster, data_plane, caplog):
    c = cluster(1, mode="async", lr=0.5, token=TOKEN)
    with c.client(REGRESSION, init=REGRESSION.flat(), token=TOKEN):  # initialised, then gone
        pass
    holder, held = hold_every_reader_slot(c.servers[0].shm.address)
    try:
        caplog.set_level(logging.INFO, logger="psgrid.client")
        params = REGRESSION.flat()
        with c.client(REGRESSION, token=TOKEN, retry_s=3) as client:
            for _ in range(3):
                client.pull(params).wait()
                client.push(np.ones(REGRESSION.size, np.float32)).wait()
            client.pull(params).wait()
            assert client.data_planes == ["tcp"] and client.versions == [3]
        np.testing.assert_allclose(params, -1.5)
        said = [r.getMessage() for r in caplog.records if "shared-memory plane" in r.getMessage()]
        assert len(said) == 1 and "too many connections" in said[0] and "tcp" in said[0], said
    finally:
        for conn in held:
            conn.sock.close()
        holder.close()
