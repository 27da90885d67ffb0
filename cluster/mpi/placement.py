"""Which rank does what under ``psctl mpi``: node-aware roles, one worker per GPU.

Every rank reports its host and the GPUs it sees (their PCI bus ids); :func:`place` turns the
reports into one role per rank. It is pure (no MPI, no CUDA) and every rank calls it on the same
reports, so every rank reaches the same answer: a layout that cannot give each worker a GPU of
its own fails on every rank at once, with one line that says which numbers to run instead.

- Rank 0 coordinates (progress, final evaluation, summary); it evaluates on the CPU and takes no GPU.
- A GPU job: on each node, workers map one-to-one onto the node's GPUs; every other rank of the
  node (rank 0 aside) serves a shard, in rank order. Workers are the node's highest ranks, so on
  one node the roles are those of the CPU layout below.
- A CPU job (``device = "cpu"``, or no rank sees a GPU): ranks 1..S serve shards and the rest are
  workers, whatever the layout.

``srun -N 2 --ntasks-per-node=5 --gpus-per-node=4 psctl mpi --shards 1``, for example, puts the
coordinator and 4 workers on the first node and a shard and 4 workers on the second; by rank alone
the second node had 5 workers for its 4 GPUs while a GPU of the first sat idle.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from psgrid.cluster.errors import UsageError

COORDINATOR, SERVER, WORKER = "coordinator", "server", "worker"


class PlacementError(UsageError):
    """The ranks cannot be placed one worker per GPU; the message names the numbers that can."""


@dataclass(frozen=True)
class Role:
    """One rank's part of the job."""

    kind: str  # coordinator | server | worker
    index: int  # the shard's index, the worker's rank; 0 for the coordinator
    node: int  # its node, numbered in the order of the nodes' first ranks
    local_rank: int | None = None  # a worker's index among the workers of its node
    gpu: int | None = None  # a GPU worker's device: an index into the GPUs its rank sees


@dataclass(frozen=True)
class Placement:
    """Every rank's role, and what rank 0 should tell the user about the layout."""

    roles: tuple[Role, ...]
    hosts: tuple[str, ...]  # one per node, in node order
    gpus: int  # distinct GPUs over all nodes (0: a CPU job)
    notes: tuple[str, ...] = ()  # idle or shared GPUs: a line each, for rank 0 to print

    def ranks(self, kind: str) -> list[int]:
        """The ranks of one kind, ordered by their index (shard i is ``ranks(SERVER)[i]``)."""
        return sorted((r for r, role in enumerate(self.roles) if role.kind == kind), key=lambda r: self.roles[r].index)

    def workers_on(self, node: int) -> int:
        return sum(1 for role in self.roles if role.kind == WORKER and role.node == node)


def place(
    hosts: Sequence[str],
    gpus: Sequence[Sequence[str]],
    shards: int,
    *,
    device: str = "auto",
    oversubscribe: bool = False,
) -> Placement:
    """Give each rank a role from where it runs and which GPUs it sees.

    Parameters
    ----------
    hosts : sequence of str
        Each rank's host name, by rank.
    gpus : sequence of sequences of str
        Each rank's visible GPUs, by rank, in device order, as ids that are the same for one GPU on
        every rank of a node (PCI bus ids); empty for a rank that sees none.
    shards : int
        Shard ranks wanted (S); the job has ``len(hosts) - 1 - S`` workers.
    device : {"auto", "cpu", "gpu"}
        The workers' device: ``"cpu"`` places by rank and ignores GPUs; ``"gpu"`` needs GPUs.
    oversubscribe : bool
        Let workers share GPUs when there are more workers than GPUs (a note says so) instead of
        failing.

    Returns
    -------
    Placement

    Raises
    ------
    PlacementError
        Some worker would have no GPU of its own (and ``oversubscribe`` is off), or ``device`` is
        ``"gpu"`` and no rank sees one.
    ValueError
        Fewer than ``shards + 2`` ranks, or ``hosts`` and ``gpus`` differ in length.
    """
    size = len(hosts)
    if len(gpus) != size:
        raise ValueError(f"{size} hosts but {len(gpus)} GPU lists")
    if size < shards + 2:
        raise ValueError(f"{size} ranks cannot hold 1 coordinator, {shards} shards and a worker")
    node_of, host_list = _nodes(hosts)
    if device == "cpu" or not any(gpus):
        if device == "gpu":
            raise PlacementError(
                "device = gpu, but no rank sees a CUDA GPU: install psgrid[gpu] (CuPy) where "
                "the workers run, or use --device cpu"
            )
        return _by_rank(node_of, host_list, shards)
    return _by_gpu(node_of, host_list, [list(g) for g in gpus], shards, oversubscribe)


def _nodes(hosts: Sequence[str]) -> tuple[list[int], tuple[str, ...]]:
    order: dict[str, int] = {}
    node_of = [order.setdefault(h, len(order)) for h in hosts]
    return node_of, tuple(order)


def _by_rank(node_of: list[int], host_list: tuple[str, ...], shards: int) -> Placement:
    roles, seen = [Role(COORDINATOR, 0, node_of[0])], [0] * len(host_list)
    for rank in range(1, len(node_of)):
        node = node_of[rank]
        if rank <= shards:
            roles.append(Role(SERVER, rank - 1, node))
        else:
            roles.append(Role(WORKER, rank - 1 - shards, node, local_rank=seen[node]))
            seen[node] += 1
    return Placement(tuple(roles), host_list, 0)


def _by_gpu(node_of, host_list, gpus, shards, oversubscribe) -> Placement:
    size, nodes = len(node_of), len(host_list)
    workers = size - 1 - shards
    # Rank 0 coordinates, so it is never a candidate; later ranks are tried first, so a node's spare
    # (shard) ranks are its lowest.
    candidates = [[r for r in range(size - 1, 0, -1) if node_of[r] == n and gpus[r]] for n in range(nodes)]
    node_gpus = [sorted({g for r in range(size) if node_of[r] == n for g in gpus[r]}) for n in range(nodes)]
    total_gpus = sum(len(g) for g in node_gpus)
    matched = [sorted(_match(c, gpus)) for c in candidates]  # each node's ranks that get a GPU of their own
    capacity = [len(m) for m in matched]
    notes = []
    if sum(capacity) >= workers:
        counts = _spread(workers, capacity)
        chosen = [m[len(m) - k :] for m, k in zip(matched, counts)]
        if total_gpus > workers:
            notes.append(
                f"{total_gpus - workers} of the {total_gpus} GPUs idle: {size} ranks leave "
                f"{_plural(workers, 'worker')} beside the coordinator and {_plural(shards, 'shard')}; "
                f"{_advice(host_list, node_gpus, shards)} give every GPU a worker"
            )
    elif not oversubscribe:
        raise PlacementError(_shortage(size, workers, shards, host_list, node_gpus, capacity, candidates))
    else:
        spare = [[r for r in c if r not in m] for c, m in zip(candidates, matched)]
        extra = _spread(workers - sum(capacity), [len(s) for s in spare])
        if sum(extra) < workers - sum(capacity):
            raise PlacementError(
                f"{size} ranks leave {workers} workers but only "
                f"{sum(len(c) for c in candidates)} ranks besides the coordinator see a GPU: "
                f"run fewer ranks or raise --shards"
            )
        chosen = [sorted(m + s[:k]) for m, s, k in zip(matched, spare, extra)]
        notes.append(f"{workers} workers share {_plural(total_gpus, 'GPU')} (--oversubscribe)")

    worker_ranks = sorted(r for c in chosen for r in c)
    device = {}
    for node_ranks in chosen:
        device.update(_assign(node_ranks, gpus))
    roles: list[Role | None] = [None] * size
    roles[0] = Role(COORDINATOR, 0, node_of[0])
    seen = [0] * nodes
    for index, rank in enumerate(worker_ranks):
        node = node_of[rank]
        roles[rank] = Role(WORKER, index, node, local_rank=seen[node], gpu=device[rank])
        seen[node] += 1
    shard_ranks = [r for r in range(1, size) if roles[r] is None]
    for index, rank in enumerate(shard_ranks):
        roles[rank] = Role(SERVER, index, node_of[rank])
    return Placement(tuple(roles), host_list, total_gpus, tuple(notes))


def _match(ranks: list[int], gpus: list[list[str]]) -> dict[int, str]:
    """A largest one-to-one matching of ``ranks`` to GPUs they see (Kuhn's augmenting paths).

    Ranks earlier in ``ranks`` are matched first and stay matched, so they are preferred.
    """
    owner: dict[str, int] = {}

    def augment(rank: int, visited: set[str]) -> bool:
        free = [g for g in gpus[rank] if g not in owner]
        if free:  # a free GPU first, so ranks that see the same GPUs take them in order
            owner[free[0]] = rank
            return True
        for g in gpus[rank]:
            if g not in visited:
                visited.add(g)
                if augment(owner[g], visited):
                    owner[g] = rank
                    return True
        return False

    for rank in ranks:
        augment(rank, set())
    return {rank: g for g, rank in owner.items()}


def _assign(ranks: list[int], gpus: list[list[str]]) -> dict[int, int]:
    """Each rank's device index: one GPU each in rank order where possible, then the least shared one.

    Matching in rank order gives worker i of a node GPU i when its ranks all see the same GPUs.
    """
    one_each = _match(ranks, gpus)
    load = {g: 1 for g in one_each.values()}
    device = {}
    for rank in ranks:
        g = one_each.get(rank)
        if g is None:  # oversubscribed: the GPU it sees with the fewest workers so far
            g = min(gpus[rank], key=lambda x: load.get(x, 0))
            load[g] = load.get(g, 0) + 1
        device[rank] = gpus[rank].index(g)
    return device


def _spread(total: int, capacity: list[int]) -> list[int]:
    """``total`` split over the nodes as evenly as their capacities allow (round-robin)."""
    counts = [0] * len(capacity)
    while sum(counts) < total and any(c < cap for c, cap in zip(counts, capacity)):
        for n, cap in enumerate(capacity):
            if counts[n] < cap and sum(counts) < total:
                counts[n] += 1
    return counts


def _advice(host_list: tuple[str, ...], node_gpus: list[list[str]], shards: int) -> str:
    """How many ranks give every GPU a worker, and the srun line for it: Slurm's block distribution
    of ``-n`` over ``-N`` puts the odd ranks on the first nodes, so the first has room for rank 0."""
    nodes, total = len(host_list), sum(len(g) for g in node_gpus)
    ranks = 1 + shards + total
    if nodes == 1:
        return f"{ranks} ranks (-n {ranks})"
    per_node = {len(g) for g in node_gpus}
    gpus_flag = f" --gpus-per-node={per_node.pop()}" if len(per_node) == 1 else ""
    return f"{ranks} ranks (srun -N {nodes} -n {ranks}{gpus_flag})"


def _shortage(size, workers, shards, host_list, node_gpus, capacity, candidates) -> str:
    total = sum(len(g) for g in node_gpus)
    fix = f"run {_advice(host_list, node_gpus, shards)}"
    if size - 1 - sum(capacity) >= 1:
        fix += f", or keep {size} ranks with --shards {size - 1 - sum(capacity)}"
    if workers > total:
        why = (
            f"{size} ranks leave {workers} workers beside the coordinator and {_plural(shards, 'shard')}, "
            f"for {_plural(total, 'GPU')} on {_plural(len(host_list), 'node')}"
        )
    else:
        short = [
            f"{host} has {_plural(len(candidates[n]), 'rank')}{' besides the coordinator' if n == 0 else ''} "
            f"for {_plural(len(node_gpus[n]), 'GPU')}"
            for n, host in enumerate(host_list)
            if capacity[n] < len(node_gpus[n])
        ]
        why = f"{workers} workers do not fit one per GPU: {', '.join(short[:3])}{', ...' if len(short) > 3 else ''}"
    return f"{why}; {fix} for one worker per GPU, or let workers share GPUs with --oversubscribe"


def _plural(n: int, word: str) -> str:
    return f"{n} {word}{'s' * (n != 1)}"


def worker_hosts(placement: Placement) -> int:
    """The nodes that have workers: one aggregator each under ``aggregate = "host"``."""
    return len({role.node for role in placement.roles if role.kind == WORKER})


def host_group(placement: Placement, rank: int) -> tuple[int, int, int, int, int]:
    """``(host, hosts, local, size, world)`` of worker rank ``rank`` for ``aggregate = "host"``: its node among
    the nodes that have workers, its local rank there (0: the node's aggregator), the node's workers, all."""
    nodes = sorted({role.node for role in placement.roles if role.kind == WORKER})
    me = placement.roles[rank]
    if me.kind != WORKER:
        raise ValueError(f"rank {rank} is a {me.kind}, not a worker")
    return (
        nodes.index(me.node),
        len(nodes),
        me.local_rank,
        placement.workers_on(me.node),
        len(placement.ranks(WORKER)),
    )
