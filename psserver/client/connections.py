"""Connections to every shard of a job, shared by the Client and Admin.

One control connection and one data plane per shard. Calls to several shards run
concurrently; each is retried with backoff while its shard is unavailable, for up to
``retry_s``; a data plane that lost its connection is dropped, and the next attempt chooses
one again from a fresh registration (a restarted shard listens on another data port). A
local plane (shared memory) that refuses a client for too many connections is passed over for that
shard (its network plane serves), so a process holding them all cannot stop the others on its host.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from psgrid.psserver.exceptions import BadReply, InvalidArgument, ShardUnavailable, Unavailable
from psgrid.psserver.protocol import LOCAL_PLANES, MAX_CHUNK_BYTES, MIN_CHUNK_BYTES, Reason, Registration
from psgrid.psserver.transports.base import ConnectOptions, Control, DataPlane, network_planes, open_data_plane
from psgrid.psserver.transports.grpc_client import open_control

log = logging.getLogger("psgrid.client")
T = TypeVar("T")
BACKOFF_S = (0.05, 1.0)  # first and longest sleep between retries


class ShardConnections:
    """Every shard of one job, by index.

    Parameters
    ----------
    addresses : list of str
        ``host:port`` of shard 0, 1, ... in shard order.
    data_plane : {"tcp", "grpc"}
        Where Pull and Push payloads go when the shard offers it; gRPC otherwise (any plane registered
        on both ends may be named: transports/base.py).
    options : ConnectOptions
    retry_s : float
        How long an unavailable shard is retried before :class:`ShardUnavailable`.
    register : callable
        ``register(shard) -> Registration``: how the owner registers (a worker joins, an observer
        looks); a data plane is chosen from what the registration offers.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        data_plane: str,
        options: ConnectOptions,
        retry_s: float,
        register: Callable[[int], Registration],
    ):
        if not addresses:
            raise InvalidArgument("at least one shard address is needed")
        if data_plane not in network_planes():
            raise InvalidArgument(f"data_plane must be one of {network_planes()}, got {data_plane!r}")
        if not MIN_CHUNK_BYTES <= options.chunk_bytes <= MAX_CHUNK_BYTES:
            raise InvalidArgument(
                f"chunk_bytes must be in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {options.chunk_bytes}"
            )
        self.addresses = list(addresses)
        self.preference, self.options, self.retry_s, self.register = data_plane, options, retry_s, register
        self.controls = [open_control(a, options) for a in self.addresses]
        self.planes: list[DataPlane | None] = [None] * len(self.addresses)
        # The local plane's (plane, address) of each shard that refused us for too many connections: that
        # offer is passed over (a restarted shard offers another address, tried again).
        self.refused: list[tuple[str, str] | None] = [None] * len(self.addresses)
        self.in_use: list[tuple[str, str] | None] = [None] * len(self.addresses)  # each plane's offer
        self.plane_lock = threading.Lock()
        # Two calls per shard may run at once: a push and the pull that overlaps it.
        self.executor = ThreadPoolExecutor(max_workers=2 * len(self.addresses) + 2, thread_name_prefix="psgrid-client")
        # Called before a plane is closed: waits for device copies still reading memory it mapped (a posted
        # pull's, Client.post_pull), which closing unregisters and unmaps.
        self.before_close: Callable[[], None] = lambda: None
        self.job_tags: dict[int, str] = {}  # each shard's job, as its registration says (protocol.job_tag)
        self.mixed_jobs: str | None = None  # the line that said the shards belong to different jobs

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    def check_registration(self, shard: int, reply: Registration) -> Registration:
        if reply.num_shards != self.num_shards or reply.shard_index != shard:
            raise BadReply(
                f"address {self.addresses[shard]} is shard {reply.shard_index} of {reply.num_shards}, "
                f"but was given as shard {shard} of {self.num_shards}",
                shard=shard,
            )
        if reply.job_tag:
            self.note_job(shard, reply.job_tag)
        return reply

    def note_job(self, shard: int, tag: str) -> None:
        """Say once, in one line, that the shards belong to different jobs: shards started by hand
        without a common ``--job-id`` each make their own, and ``Admin.shutdown(job_id)`` then stops
        only some of them. They still serve the model together, so this warns and goes on."""
        self.job_tags[shard] = tag
        other = next((i for i, t in sorted(self.job_tags.items()) if t != tag), None)
        if other is None or self.mixed_jobs is not None:
            return
        first, second = sorted((other, shard))
        self.mixed_jobs = (
            f"shards {first} ({self.addresses[first]}) and {second} ({self.addresses[second]}) belong "
            f"to different jobs: start every shard of one job with the same --job-id "
            f"(ServerConfig.job_id), or Admin.shutdown(job_id) stops only some of them"
        )
        log.warning("%s", self.mixed_jobs)

    # ----- running calls ------------------------------------------------------------------------

    def map(self, fn: Callable[[int], T], shards: Sequence[int] | None = None) -> list[T]:
        """``fn(i)`` for every shard, concurrently; the caller's thread runs one of them itself."""
        shards = list(range(self.num_shards) if shards is None else shards)
        if not shards:
            return []
        if len(shards) == 1:
            return [fn(shards[0])]
        futures = [self.executor.submit(fn, i) for i in shards[1:]]
        results, error = [], None
        try:
            results.append(fn(shards[0]))  # no thread hop for the first: it is most of a small call's latency
        except BaseException as exc:  # noqa: BLE001 - raised once every call has ended
            error = exc
        for future in futures:  # none outlives a failure of another: callers reuse their buffers
            try:
                results.append(future.result())
            except BaseException as exc:  # noqa: BLE001
                error = error or exc
        if error is not None:
            raise error
        return results

    def each(self, method: str, shards: Sequence[int] | None = None) -> list:
        """A control call (``"stats"``, ``"checkpoint"``, ...) on every shard, concurrently, each retried."""
        return self.map(lambda i: self.retrying(i, getattr(self.controls[i], method)), shards)

    def each_call(self, call: Callable[[Control], T], shards: Sequence[int] | None = None) -> list[T]:
        """``call(control)`` on every shard's control connection, concurrently, each retried."""
        return self.map(lambda i: self.retrying(i, lambda: call(self.controls[i])), shards)

    def retrying(self, shard: int, call: Callable[[], T], *, data: bool = False) -> T:
        """``call()``, retried with backoff while the shard is unavailable, for up to ``retry_s``.

        With ``data``, a failure drops the shard's data plane, so the next attempt learns it anew.
        """
        start = time.monotonic()
        backoff = BACKOFF_S[0]
        while True:
            try:
                return call()
            except Unavailable as exc:
                if data and self.drop_plane(shard, exc):
                    continue  # passed over a full shared-memory plane: the network plane is there now
                if time.monotonic() - start >= self.retry_s:
                    # exc names the address already
                    raise ShardUnavailable(
                        f"shard {shard} unavailable for {self.retry_s:g} s: {exc}", Reason.UNREACHABLE, shard=shard
                    ) from exc
                time.sleep(backoff)
                backoff = min(backoff * 2, BACKOFF_S[1])

    # ----- data planes --------------------------------------------------------------------------

    def plane(self, shard: int) -> DataPlane:
        """The shard's data plane, chosen from a fresh registration when there is none yet."""
        plane = self.planes[shard]
        if plane is not None:
            return plane
        return self.use_plane_of(shard, self.check_registration(shard, self.register(shard)))

    def use_plane_of(self, shard: int, reply: Registration) -> DataPlane:
        """The shard's data plane: the one in use, else one chosen from what ``reply`` offers."""
        with self.plane_lock:  # a pull and a push may both be choosing one
            if self.planes[shard] is None:
                if self.refused[shard] is not None:
                    reply = reply.without(*self.refused[shard])
                plane = open_data_plane(self.preference, self.controls[shard], reply, self.options)
                self.planes[shard], self.in_use[shard] = plane, (plane.name, reply.address(plane.name))
            return self.planes[shard]

    def drop_plane(self, shard: int, cause: Unavailable | None = None) -> bool:
        """Close the shard's data plane after ``cause``; the next call chooses one again.

        A local plane that refused us for too many connections (another process of this host holds
        them all) is not chosen again for this shard: its network plane serves instead.
        Returns whether that happened now (the first time that plane refused us).
        """
        with self.plane_lock:
            plane, self.planes[shard] = self.planes[shard], None
            offer, self.in_use[shard] = self.in_use[shard], None
            full = (
                plane is not None
                and plane.name in LOCAL_PLANES
                and cause is not None
                and cause.reason is Reason.TOO_MANY_CONNECTIONS
                and self.refused[shard] != offer
            )
            if full:
                self.refused[shard] = offer
                log.warning(
                    "shard %d's %s refused this client (too many connections: %s); its "
                    "network plane (%s where offered) serves this client instead",
                    shard,
                    plane.title,
                    cause,
                    self.preference,
                )
        if plane is not None:
            self.before_close()
            plane.close()
        return full

    @property
    def data_planes(self) -> list[str | None]:
        """The data plane in use per shard (None: not chosen yet, or dropped after a failure)."""
        return [None if p is None else p.name for p in self.planes]

    def close_connections(self) -> None:
        self.executor.shutdown(wait=True)
        for shard in range(self.num_shards):
            self.drop_plane(shard)
        for control in self.controls:
            control.close()
