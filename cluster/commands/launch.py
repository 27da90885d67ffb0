"""psctl launch: a whole job (S shards and W workers) on this machine."""

from __future__ import annotations

import argparse

from psgrid.cluster.commands._common import add_command, add_config_arg, add_set_arg, add_training_flags

HELP = "run a whole job on this machine (S shards + W workers)"

EXAMPLES = """
psctl launch --config examples/mnist.toml
psctl launch --config mnist --mode ssp --staleness 3 --workers 4 --out runs/ssp-4
psctl launch --config examples/synthetic-20m.toml --shards 4 --workers 2 --device gpu --set wire_dtype=float16
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "launch", help=HELP,
        description="Start S shard processes and W worker processes on this machine, show one progress bar, "
                    "evaluate the final weights, and write OUT/summary.json and OUT/metrics.jsonl. "
                    "A worker that fails is tolerated while another completes; a shard that fails ends the job. "
                    "Exit code 0 when the job completed, 1 when it failed, 128+N when stopped by signal N.",
        examples=EXAMPLES,
    )
    add_config_arg(p, "mnist", "flags override it")
    g = p.add_argument_group("job")
    g.add_argument("--shards", dest="override_shards", type=int, metavar="S",
                   help="number of shard processes (default: [job] shards)")
    g.add_argument("--workers", dest="override_workers", type=int, metavar="W", help="number of worker processes")
    g.add_argument("--out", dest="override_out", metavar="DIR",
                   help="output folder (default: runs/NAME-TIMESTAMP); must not hold an earlier run")
    g.add_argument("--name", dest="override_name", metavar="NAME", help="job name (default: the job file's name)")
    g.add_argument("--timeout", dest="override_timeout_s", type=float, metavar="SECONDS",
                   help="stop the job if training takes longer than this (default: no limit)")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show the progress bar (default: when stderr is a terminal)")
    add_set_arg(p)
    add_training_flags(p)
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from psgrid.cluster.commands._common import load_job_from_args
    from psgrid.cluster.launch import launch

    return launch(load_job_from_args(args), progress=args.progress)
