"""psctl mpi: a whole job under mpiexec or srun, roles by rank."""

from __future__ import annotations

import argparse

from psgrid.cluster.commands.common import (
    add_command,
    add_config_arg,
    add_overwrite_arg,
    add_set_arg,
    add_token_arg,
    add_training_flags,
)

HELP = "run a whole job under mpiexec or srun (roles by rank)"

EXAMPLES = """
mpiexec -n 4 psctl mpi --config examples/mnist.toml --shards 1       # 1 coordinator, 1 shard, 2 workers
mpiexec -n 6 psctl mpi --config mnist --shards 2 --mode ssp          # 2 shards, 3 workers
HYDRA_IFACE=lo mpiexec -n 4 psctl mpi --config mnist                 # a laptop without a network
srun --mpi=pmi2 -N 2 --ntasks-per-node=5 --gpus-per-node=4 psctl mpi --config job.toml --shards 1 --iface ib0  # 8 GPUs
srun --mpi=pmi2 -N 2 -n 11 --gpus-per-node=4 psctl mpi --config job.toml --shards 2 --iface ib0  # 2 shards
mpiexec -n 6 psctl mpi --shards 1 -- python train.py --epochs 3     # your own script on each worker rank
psctl mpi --plan --np 10 --nodes 2 --gpus-per-node 4 --shards 1     # the layout of such a job, nothing started
psctl mpi --plan --config job.toml                                   # inside salloc or sbatch: this allocation's
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers,
        "mpi",
        help=HELP,
        description="Run under mpiexec or srun with N ranks: rank 0 coordinates (progress, final evaluation, "
        "OUT/summary.json), S ranks serve one shard each, and the other N-1-S ranks are workers. "
        "On GPUs each node's workers get one GPU each (N-1-S must not exceed the GPUs; the other "
        "ranks of a node serve the shards); on CPUs ranks 1..S are the shards. Needs N >= S+2. "
        "An exception on any rank aborts the whole job. OUT should be on a shared file system for "
        "the progress bar to see the workers. "
        "After -- comes your own command (-- python train.py ARGS): each worker rank runs it instead of "
        "the built-in trainer, with the job in its environment (see README, 'Your own training script').",
        examples=EXAMPLES,
    )
    add_config_arg(p, "mnist", "flags override it; [job] workers is ignored (N-1-S)")
    g = p.add_argument_group("job")
    g.add_argument(
        "--shards", dest="override_shards", type=int, metavar="S", help="number of shard ranks (default: [job] shards)"
    )
    g.add_argument("--out", dest="override_out", metavar="DIR", help="output folder (default: runs/NAME-TIMESTAMP)")
    g.add_argument("--name", dest="override_name", metavar="NAME", help="job name (default: the job file's name)")
    g.add_argument(
        "--timeout",
        dest="override_timeout_s",
        type=float,
        metavar="SECONDS",
        help="abort the job if training takes longer than this (default: no limit)",
    )
    g.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show the progress bar on rank 0 (default: when stderr is a terminal)",
    )
    g.add_argument(
        "--oversubscribe",
        action="store_true",
        help="let workers share GPUs when there are more workers than GPUs (default: an error "
        "that names the numbers giving one worker per GPU)",
    )
    pl = p.add_argument_group("plan (print the rank layout and exit; no MPI, nothing started)")
    pl.add_argument(
        "--plan",
        action="store_true",
        help="print which rank coordinates, serves a shard or trains, on which node and GPU, for the "
        "Slurm allocation this runs in (SLURM_NTASKS, SLURM_JOB_NODELIST, SLURM_TASKS_PER_NODE, "
        "the GPU variables) or the numbers below, and exit",
    )
    pl.add_argument("--np", type=int, metavar="N", help="with --plan: ranks in the job (default: SLURM_NTASKS)")
    pl.add_argument("--nodes", type=int, metavar="M", help="with --plan: nodes (default: the allocation's, else 1)")
    pl.add_argument(
        "--gpus-per-node",
        type=int,
        metavar="G",
        help="with --plan: GPUs on each node (default: the allocation's, else none)",
    )
    n = p.add_argument_group("network (where shards bind and how workers reach them)")
    n.add_argument(
        "--host",
        help="bind shards to this address and advertise it (0.0.0.0: every interface, "
        "advertised by host name); default: 127.0.0.1 when all ranks share one node, "
        "else 0.0.0.0",
    )
    n.add_argument("--iface", help="bind shards to the IPv4 address of this interface and advertise it (e.g. ib0)")
    add_overwrite_arg(p)
    add_token_arg(p)
    add_set_arg(p)
    add_training_flags(p)
    p.set_defaults(func=run, user_command=None)
    p.usage = p.format_usage().removeprefix("usage: ").rstrip() + " [-- COMMAND ...]"  # split off by cli.main
    return p


def run(args: argparse.Namespace) -> int:
    from psgrid.cluster.commands.common import load_job_from_args, with_mode_defaults_said
    from psgrid.cluster.errors import UsageError
    from psgrid.cluster.run import script
    from psgrid.cluster.run.hosting import check_placement
    from psgrid.cluster.run.preflight import check_mps, require_mpi

    if args.plan:
        return print_plan(args, load_job_from_args(args))
    given = [
        flag
        for flag, value in (("--np", args.np), ("--nodes", args.nodes), ("--gpus-per-node", args.gpus_per_node))
        if value is not None
    ]
    if given:
        raise UsageError(
            f"{', '.join(given)} only describe{'s' * (len(given) == 1)} a job for --plan; "
            f"under mpiexec or srun the launcher gives the ranks, nodes and GPUs"
        )
    command = None if args.user_command is None else script.resolve_command(args.user_command)
    named = args.config != "mnist" or args.override_name is not None
    job = with_mode_defaults_said(load_job_from_args(args), args, "psctl mpi")
    job = script.for_command(job, command, named=named, local_gpus=False)
    check_placement(job, launcher="psctl mpi")
    check_mps(job, launcher="psctl mpi")
    require_mpi("mpi")
    from psgrid.cluster.mpi.job import run_mpi

    return run_mpi(
        job, host=args.host, iface=args.iface, progress=args.progress, command=command, oversubscribe=args.oversubscribe
    )


def print_plan(args: argparse.Namespace, job) -> int:
    import os

    from psgrid.cluster.mpi import plan

    alloc = plan.allocation(os.environ, np=args.np, nodes=args.nodes, gpus_per_node=args.gpus_per_node)
    try:
        placement = plan.plan(alloc, job.shards, device=job.train.device, oversubscribe=args.oversubscribe)
    except ValueError as e:  # too few ranks: as the job itself would say it
        from psgrid.cluster.errors import UsageError
        from psgrid.cluster.mpi.job import too_few_ranks_message

        raise UsageError(too_few_ranks_message(job.shards, len(alloc.hosts))) from e
    print("\n".join(plan.describe(alloc, placement)))
    return 0
