"""Joining a job: wait until its workers have registered, see that every shard has weights, heartbeat.

The waits ask the shards again after 5 ms, then less and less often: a job whose workers start
together sees the last one join (or the weights land) at once, and a long wait does not flood the
shards. Initial weights are sent by one worker (the lowest id); the others wait for them, bounded,
then offer their own (the first writer wins on each shard).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping

import numpy as np

from psgrid.psserver.client.connections import ShardConnections
from psgrid.psserver.exceptions import InvalidArgument, NotInitialized, PSError
from psgrid.psserver.protocol import Registration
from psgrid.psserver.spec import ModelSpec

log = logging.getLogger("psgrid.client")
POLL_S = (0.005, 0.1)  # the first and the longest pause of a wait that polls the shards


def start_heartbeats(controls, worker_id: int, interval: float, stop: threading.Event) -> threading.Thread:
    """A daemon thread that heartbeats ``worker_id`` to every shard each ``interval`` until ``stop`` is set."""
    timeout = min(max(interval, 1.0), 5.0)

    def beat():
        while not stop.wait(interval):
            for control in controls:
                if stop.is_set():
                    return
                try:
                    control.heartbeat(worker_id, timeout_s=timeout)
                except PSError:
                    pass  # the next data call reports (and retries) a shard that is down

    thread = threading.Thread(target=beat, name="psgrid-heartbeat", daemon=True)
    thread.start()
    return thread


def polls(first: float, longest: float):
    """Sleep lengths for a wait that polls: ``first``, growing by half each time up to ``longest``."""
    interval = first
    while True:
        yield interval
        interval = min(longest, interval * 1.5)


def check_flat(buf: np.ndarray, spec: ModelSpec, what: str) -> np.ndarray:
    """``buf`` if it is a contiguous flat float32 array of the model's size; InvalidArgument otherwise."""
    if not isinstance(buf, np.ndarray) or buf.dtype != np.float32 or buf.shape != (spec.size,):
        raise InvalidArgument(
            f"{what} must be a float32 NumPy array of shape ({spec.size},), got "
            f"{getattr(buf, 'dtype', type(buf).__name__)} {getattr(buf, 'shape', '')}"
        )
    if not buf.flags.c_contiguous:
        raise InvalidArgument(f"{what} must be contiguous")
    return buf


def check_flat_device(buf, spec: ModelSpec, what: str):
    """``buf`` if it is a contiguous flat float32 device array (CUDA array interface) of the model's size."""
    if (
        not hasattr(buf, "__cuda_array_interface__")
        or buf.dtype != np.float32
        or buf.shape != (spec.size,)
        or not buf.flags.c_contiguous
    ):
        raise InvalidArgument(
            f"{what} must be a contiguous float32 NumPy or CuPy array of shape ({spec.size},), got "
            f"{type(buf).__name__} {getattr(buf, 'dtype', '')} {getattr(buf, 'shape', '')}"
        )
    return buf


def wait_for_workers(conn: ShardConnections, world: int | None, timeout_s: float, worker_id: int) -> list[dict] | None:
    """Until every shard has seen each of ``world`` workers join or go (or ``timeout_s`` passed).

    A worker that is gone (left, evicted, or reported dead by its launcher before it joined)
    is not waited for. Returns the shards' stats (None without ``world``: nothing to wait for).
    """
    if not world:
        return None
    deadline = time.monotonic() + timeout_s
    for pause in polls(*POLL_S):
        stats = conn.each("stats")
        joined = min(len(s["members"]) for s in stats)
        accounted = min(len({m["worker_id"] for m in s["members"]} | set(s["departed"])) for s in stats)
        if accounted >= world:
            return stats
        if time.monotonic() >= deadline:
            log.warning(
                "worker %d starting with %d of %d workers registered after %.0f s", worker_id, joined, world, timeout_s
            )
            return stats
        time.sleep(pause)


class Initializer:
    """Sees that every shard of a job has weights: sends the client's own, or waits for another worker's.

    ``init`` is what the client was given (a flat float32 array, arrays by name, a callable returning
    either, or None: this client has none to offer).
    """

    def __init__(self, conn: ShardConnections, spec: ModelSpec, ranges: list[tuple[int, int]], init, timeout_s: float):
        self.conn, self.spec, self.ranges, self.init, self.timeout_s = conn, spec, ranges, init, timeout_s

    def values(self) -> np.ndarray:
        values = self.init() if callable(self.init) else self.init
        if isinstance(values, Mapping):
            values = self.spec.pack({k: np.asarray(v, dtype=np.float32) for k, v in values.items()})
        return check_flat(np.ascontiguousarray(values, dtype=np.float32), self.spec, "init")

    def run(self, registrations: list[Registration], stats: list[dict] | None, worker_id: int) -> None:
        """Initialise the shards that have no weights yet, as their registrations and ``stats`` say."""
        conn = self.conn
        pending = [
            i for i, r in enumerate(registrations) if not r.initialized and not (stats and stats[i]["initialized"])
        ]
        if not pending:
            return
        members = [m["worker_id"] for m in stats[0]["members"]] if stats else []
        if self.init is not None and (not members or worker_id == min(members)):
            self.send(self.values(), pending)
            return
        # Another worker sends them (first writer wins on each shard): wait, bounded, then offer ours.
        deadline = time.monotonic() + self.timeout_s
        for pause in polls(*POLL_S):
            if not pending:
                return
            time.sleep(pause)
            stats = conn.each("stats", pending)
            pending = [i for i, s in zip(pending, stats) if not s["initialized"]]
            if pending and time.monotonic() >= deadline:
                if self.init is None:
                    raise NotInitialized(
                        f"shards {pending} still have no weights after {self.timeout_s:.0f} s, "
                        f"and this client has none to offer: pass init="
                    )
                log.warning("worker %d: shards %s still have no weights; offering its own", worker_id, pending)
                self.send(self.values(), pending)
                return

    def send(self, values: np.ndarray, shards: list[int]) -> None:
        conn = self.conn

        def one(i):
            begin, end = self.ranges[i]
            return conn.retrying(i, lambda: conn.controls[i].init(self.spec, values[begin:end], begin))

        conn.map(one, shards)
