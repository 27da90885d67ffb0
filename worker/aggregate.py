"""Per-host aggregation (``aggregate = "host"``): the workers of one host push once, as BytePS and ps-lite do.

The workers of a host (local ranks 0..L-1; under ``psctl launch`` and on emulated hosts they have
consecutive global ranks, host h holding ranks hL..hL+L-1; ``psctl mpi`` groups them by node) meet
local rank 0, the host's *leader*, which owns the memory they share: the weights, which the others
only read, and one gradient slot per other worker, which only that worker writes. Each step

1. the leader pulls from the shards into the weights and tells the others; each copies them;
2. every worker computes its gradient; the others write theirs into their slots and say so;
3. the leader sums the L gradients in local-rank order, multiplies by 1/L and pushes that mean
   as one update of worker ``h`` (the shards see H workers, one per host); it tells the others the
   shards' answers, and the next step begins. (In sync, with hosts of different sizes, it multiplies
   by H/W instead, so that the shards' mean of the H pushes is the mean of all W gradients.)

Only the leader talks to the shards, so a host's link carries one pull and one push per step
instead of L. In sync the shards average H host means of L gradients each: the mean of all W, as
without aggregation (up to the order of float32 additions). In async and ssp a host's push is one
update carrying the mean of its workers' gradients, its staleness and clock are the host's, and the
workers of one host stay in step with each other (docs/architecture.md, "Per-host aggregation").

They meet on the shared-memory plane's machinery, not a transport of their own: an abstract Unix
socket (psserver/transports/unix_peers.py: per network namespace, for this user's processes only, as
the kernel says) named from the job's shards and token, each follower showing the job's token; the
memory is sealed ``memfd`` files (psserver/shared_memory.py) whose descriptors cross that socket, so
nothing is left in ``/dev/shm`` whatever ends the job. A worker's death costs its host what it
costs a job: a follower's gradient is left out from then on, and when the leader goes the others
push on their own. The leader's side is aggregate_leader.py, a follower's aggregate_follower.py, the words they
say and how they are read (bounded in size and time) aggregate_wire.py.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

from psgrid.psserver.protocol import mode_rules
from psgrid.psserver.security import job_token
from psgrid.worker.aggregate_follower import HostFollower
from psgrid.worker.aggregate_leader import HostLeader
from psgrid.worker.aggregate_wire import AggregationError  # noqa: F401 - what the exchanges raise, named here for callers

AGGREGATES = ("none", "host")
LOCAL_SIZE_VARS = ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS")


@dataclass(frozen=True)
class HostGroup:
    """Where a worker stands among the job's hosts: host ``host`` of ``hosts``, local rank ``local`` of ``size``,
    ``world`` workers in all (``psctl mpi`` may put more workers on one node than on another)."""

    host: int
    hosts: int
    local: int
    size: int
    world: int = 0  # 0: hosts x size (every host the same size)

    def scale(self, mode: str) -> float:
        """What the leader multiplies its host's sum by: 1/size, the mean of its workers' gradients. In sync,
        hosts/world, so that the shards' mean over the hosts' pushes is the mean over all workers even where
        hosts differ in size (the same number where they do not)."""
        world = self.world or self.hosts * self.size
        return self.hosts / world if mode_rules(mode).accumulates else 1.0 / self.size

    @classmethod
    def of(cls, rank: int, world: int, local_rank: int | None = None, local_size: int | None = None) -> HostGroup:
        """The group of worker ``rank``; the local size comes from the environment (all on one host if unset).

        Raises ValueError where the workers are not in equal blocks of consecutive ranks per host.
        """
        size = local_size if local_size is not None else _local_size_from_env(world)
        if size < 1 or world % size:
            raise ValueError(
                f"aggregate = 'host' needs the same number of workers on every host: {world} workers "
                f"do not split into hosts of {size}"
            )
        local = rank % size
        if local_rank is not None and local_rank != local:
            raise ValueError(
                f"aggregate = 'host' needs the workers of one host to have consecutive ranks: rank "
                f"{rank} of hosts of {size} should have local rank {local}, it has {local_rank}"
            )
        return cls(rank // size, world // size, local, size, world)


def _local_size_from_env(world: int) -> int:
    for var in LOCAL_SIZE_VARS:
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return world


def rendezvous_name(addresses: list[str], token: str | None, host: int) -> str:
    """The abstract socket of one host's group in one job: its shards' addresses and token (``token``, else
    ``$PSGRID_TOKEN``) name the job, so that nobody without the token can find it before the leader binds it."""
    digest = hashlib.sha256("\n".join([*addresses, job_token(token) or "", str(host)]).encode()).hexdigest()[:32]
    return f"psgrid-agg-{digest}"


def host_exchange(
    group: HostGroup,
    name: str,
    size: int,
    connect,
    *,
    wire_dtype: str = "float32",
    timeout_s: float = 120.0,
    token: str | None = None,
):
    """The leader's exchange or a follower's, by local rank.

    ``connect(worker_id, world)`` makes a client of the shards: the leader's (as worker ``host`` of
    ``hosts``), or a follower's own once its leader is gone (``connect(None, None)``: a new id, no
    wait for others). ``token`` is the job's (by default ``$PSGRID_TOKEN``): followers show it.
    """
    token = job_token(token)
    if group.local == 0:
        return HostLeader(connect(group.host, group.hosts), group, name, size, timeout_s, token)
    return HostFollower(group, name, size, connect, wire_dtype, timeout_s, token)
