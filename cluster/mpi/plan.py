"""``psctl mpi --plan``: the rank layout of an allocation, printed before anything starts.

A user checks which rank coordinates, serves a shard or trains, on which node and GPU, before a
job waits in a queue. The allocation comes from Slurm's variables (inside ``salloc`` or a batch
script: ``SLURM_JOB_NODELIST``, ``SLURM_TASKS_PER_NODE``, ``SLURM_NTASKS`` and the GPU variables the
site sets) or from flags (``--np``, ``--nodes``, ``--gpus-per-node``) that say what one would ask
for. The roles come from :func:`psgrid.cluster.mpi.placement.place`, the function every rank of a real
job calls, so the plan is the job's layout as long as each rank of a node sees all its GPUs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from psgrid.cluster.errors import UsageError
from psgrid.cluster.mpi.placement import COORDINATOR, SERVER, Placement, place


@dataclass(frozen=True)
class Allocation:
    """Where each rank runs and how many GPUs each node has."""

    hosts: tuple[str, ...]  # each rank's node, by rank
    gpus_per_node: int
    source: str  # where the numbers came from, for the plan's first line


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list, expanded: ``gpu[01-02,05],login`` -> gpu01, gpu02, gpu05, login."""
    hosts: list[str] = []
    for item in re.findall(r"(?:[^,\[]|\[[^\]]*\])+", text):
        hosts.extend(_expand_one(item))
    return hosts


def _expand_one(item: str) -> list[str]:
    match = re.search(r"\[([^\]]*)\]", item)
    if not match:
        return [item]
    head, tail = item[: match.start()], item[match.end() :]
    out = []
    for part in match.group(1).split(","):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()):
            raise UsageError(f"cannot read the node list {item!r}")
        for n in range(int(lo), int(hi or lo) + 1):
            out.extend(_expand_one(f"{head}{n:0{len(lo)}d}{tail}"))
    return out


def expand_tasks_per_node(text: str) -> list[int]:
    """``SLURM_TASKS_PER_NODE`` expanded: ``2(x3),1`` -> [2, 2, 2, 1]."""
    counts = []
    for part in text.split(","):
        match = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not match:
            raise UsageError(f"cannot read SLURM_TASKS_PER_NODE={text!r}")
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def gpus_from_environment(env: Mapping[str, str]) -> int | None:
    """GPUs per node, from whichever variable the site sets (as examples/slurm/*.sbatch read them)."""
    for name in ("SLURM_GPUS_ON_NODE", "SLURM_GPUS_PER_NODE"):
        count = env.get(name, "").rpartition(":")[2]  # "a100:4" where GPUs are asked for by type
        if count.isdigit():
            return int(count)
    for name in ("SLURM_JOB_GPUS", "CUDA_VISIBLE_DEVICES"):
        ids = env.get(name, "")
        if ids and ids != "NoDevFiles":
            return len(ids.split(","))
    match = re.search(r"(?:^|,)gpu(?::[^:,]+)?:(\d+)", env.get("SLURM_GRES", env.get("SBATCH_GRES", "")))
    return int(match.group(1)) if match else None


def allocation(
    env: Mapping[str, str], *, np: int | None = None, nodes: int | None = None, gpus_per_node: int | None = None
) -> Allocation:
    """The allocation to plan for: the flags where given, else the Slurm job this runs in.

    Ranks go to nodes as Slurm's default block distribution puts them: ``SLURM_TASKS_PER_NODE``
    where it is set, else ``np`` over ``nodes`` with the first nodes taking one more.

    Raises
    ------
    UsageError
        Neither ``np`` nor ``SLURM_NTASKS`` says how many ranks there are, or the numbers disagree.
    """
    in_slurm = "SLURM_JOB_ID" in env
    if np is None and not env.get("SLURM_NTASKS", "").isdigit():
        raise UsageError(
            "psctl mpi --plan needs the number of ranks: run it inside the allocation (salloc or "
            "the batch script, where SLURM_NTASKS is set) or give --np N (and --nodes M, "
            "--gpus-per-node G)"
        )
    size = np if np is not None else int(env["SLURM_NTASKS"])
    names = expand_nodelist(env["SLURM_JOB_NODELIST"]) if in_slurm and env.get("SLURM_JOB_NODELIST") else []
    if nodes is None:
        nodes = len(names) or int(env.get("SLURM_NNODES", "1") if env.get("SLURM_NNODES", "").isdigit() else 1)
    if nodes < 1 or size < 1:
        raise UsageError(f"--np and --nodes must be positive, got {size} ranks on {nodes} nodes")
    if nodes > size:
        raise UsageError(f"{size} ranks cannot fill {nodes} nodes (srun needs a task on every node)")
    if len(names) != nodes:
        names = [f"node{i}" for i in range(nodes)]
    per_node = None
    if np is None and env.get("SLURM_TASKS_PER_NODE"):
        per_node = expand_tasks_per_node(env["SLURM_TASKS_PER_NODE"])
        if len(per_node) != nodes or sum(per_node) != size:
            per_node = None  # a flag changed the node count: spread as srun would
    if per_node is None:
        per_node = [size // nodes + (i < size % nodes) for i in range(nodes)]
    hosts = tuple(name for name, count in zip(names, per_node) for _ in range(count))
    if gpus_per_node is None:
        gpus_per_node = gpus_from_environment(env) or 0
    source = (
        f"Slurm job {env['SLURM_JOB_ID']}" if in_slurm and np is None else "--np"
    ) + f": {size} ranks on {nodes} node{'s' * (nodes != 1)}, {gpus_per_node} GPU{'s' * (gpus_per_node != 1)} each"
    return Allocation(hosts, gpus_per_node, source)


def plan(alloc: Allocation, shards: int, *, device: str = "auto", oversubscribe: bool = False) -> Placement:
    """Every rank's role on ``alloc``: what :func:`place` decides when each rank sees its node's GPUs.

    Raises PlacementError (a UsageError) or ValueError as :func:`place` does.
    """
    gpus = [[f"{host}/{g}" for g in range(alloc.gpus_per_node)] for host in alloc.hosts]
    return place(alloc.hosts, gpus, shards, device=device, oversubscribe=oversubscribe)


def describe(alloc: Allocation, placement: Placement) -> list[str]:
    """The plan as lines: a heading, then one line per rank (rank, node, role, GPU)."""
    workers = sum(1 for role in placement.roles if role.kind not in (COORDINATOR, SERVER))
    shards = len(placement.ranks(SERVER))
    lines = [
        f"psctl mpi --plan ({alloc.source}): 1 coordinator, {shards} shard{'s' * (shards != 1)}, "
        f"{workers} worker{'s' * (workers != 1)}; nothing started",
        f"{'rank':>4}  {'node':<16}  {'role':<12}  gpu",
    ]
    for rank, role in enumerate(placement.roles):
        name = role.kind if role.kind == COORDINATOR else f"{'shard' if role.kind == SERVER else 'worker'} {role.index}"
        gpu = "-" if role.gpu is None else str(role.gpu)
        lines.append(f"{rank:>4}  {alloc.hosts[rank]:<16}  {name:<12}  {gpu}")
    lines.extend(f"warning: {note}" for note in placement.notes)
    return lines
