"""psctl allreduce: the all-reduce baseline, a job trained with no shards under mpiexec or srun."""

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

HELP = "train a job with no shards, gradients averaged by MPI Allreduce (the baseline; under mpiexec)"

EXAMPLES = """
mpiexec -n 4 psctl allreduce --config examples/mnist.toml          # 4 workers, each rank one
HYDRA_IFACE=lo mpiexec -n 2 psctl allreduce --config mnist --out runs/ar-2
"""

_FLAGS = (
    "optimizer",
    "lr",
    "model",
    "dataset",
    "batch_size",
    "steps",
    "epochs",
    "eval_every",
    "device",
    "seed",
    "stragglers",
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers,
        "allreduce",
        help=HELP,
        description="Synchronous data parallelism without parameter servers, as Horovod does it: every rank is "
        "a worker with the whole model; each step's gradients are summed with MPI Allreduce, divided "
        "by the number of ranks, and every rank applies the job's optimizer. With the same seed it "
        "computes what a sync job of the parameter server computes. Rank 0 writes OUT/summary.json "
        "and OUT/metrics.jsonl as psctl launch does. Needs mpi4py (pip install 'psgrid[mpi]').",
        examples=EXAMPLES,
    )
    add_config_arg(p, "mnist", "flags override it; [job] workers and shards are ignored (every rank is a worker)")
    g = p.add_argument_group("job")
    g.add_argument("--out", dest="override_out", metavar="DIR", help="output folder (default: runs/NAME-TIMESTAMP)")
    g.add_argument("--name", dest="override_name", metavar="NAME", help="job name (default: the job file's name)")
    g.add_argument(
        "--ranks",
        type=int,
        metavar="N",
        help="fail unless the job has N ranks (catches an mpiexec of another MPI, which starts N "
        "separate one-rank jobs)",
    )
    g.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show the progress bar on rank 0 (default: when stderr is a terminal)",
    )
    add_overwrite_arg(p)
    add_token_arg(p)
    add_set_arg(p)
    add_training_flags(p, _FLAGS)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from psgrid.cluster.commands.common import load_job_from_args
    from psgrid.cluster.errors import UsageError
    from psgrid.cluster.mpi.allreduce import run_allreduce

    job = load_job_from_args(args)
    try:
        from mpi4py import MPI  # noqa: F401
    except ImportError:
        raise UsageError("psctl allreduce needs mpi4py: pip install 'psgrid[mpi]', then run it under mpiexec") from None
    return run_allreduce(job, progress=args.progress, ranks=args.ranks)
