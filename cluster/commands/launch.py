"""psctl launch: a whole job (S shards and W workers) on this machine."""

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

HELP = "run a whole job on this machine (S shards + W workers)"

EXAMPLES = """
psctl launch --config examples/mnist.toml
psctl launch --config mnist --mode ssp --staleness 3 --workers 4 --out runs/ssp-4
psctl launch --config examples/synthetic-20m.toml --shards 4 --workers 2 --device gpu --set wire_dtype=float16
psctl launch --config mnist --set checkpoint_dir=ckpt --set checkpoint_every=100 --restart-failed --out runs/a
psctl launch --resume runs/a          # after Ctrl-C: continue from the shards' checkpoints
psctl launch --workers 4 --mode async -- python train.py --epochs 3   # your own script, once per worker
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers,
        "launch",
        help=HELP,
        description="Start S shard processes and W worker processes on this machine, show one progress bar, "
        "evaluate the final weights, and write OUT/summary.json and OUT/metrics.jsonl. "
        "A worker that fails is tolerated while another completes; a shard that fails ends the job "
        "unless --restart-failed. "
        "Exit code 0 when the job completed, 1 when it failed, 128+N when stopped by signal N. "
        "After -- comes your own command (-- python train.py ARGS): each worker runs it instead of the "
        "built-in trainer, with the job in its environment (PSGRID_ADDRESSES, PSGRID_RANK, "
        "PSGRID_WORLD_SIZE, ...; see README, 'Your own training script').",
        examples=EXAMPLES,
    )
    add_config_arg(p, None, "flags override it (default: mnist)")
    g = p.add_argument_group("job")
    g.add_argument(
        "--shards",
        dest="override_shards",
        type=int,
        metavar="S",
        help="number of shard processes (default: [job] shards)",
    )
    g.add_argument("--workers", dest="override_workers", type=int, metavar="W", help="number of worker processes")
    g.add_argument(
        "--out",
        dest="override_out",
        metavar="DIR",
        help="output folder (default: runs/NAME-TIMESTAMP); must not hold an earlier run",
    )
    g.add_argument("--name", dest="override_name", metavar="NAME", help="job name (default: the job file's name)")
    g.add_argument(
        "--timeout",
        dest="override_timeout_s",
        type=float,
        metavar="SECONDS",
        help="stop the job if training takes longer than this (default: no limit)",
    )
    g.add_argument(
        "--restart-failed",
        dest="override_restart_failed",
        action="store_true",
        default=None,
        help="restart a shard that dies, on its address, from its latest checkpoint "
        "(needs checkpoint_dir and checkpoint_every or checkpoint_every_s)",
    )
    g.add_argument(
        "--shard-placement",
        dest="override_shard_placement",
        choices=("process", "worker"),
        default=None,
        help="process (default): every shard a process of its own; worker: shard i in worker i's process, "
        "which calls it (GeePS' placement; a worker's death is then its shard's too)",
    )
    g.add_argument(
        "--mps",
        dest="override_mps",
        action="store_true",
        default=None,
        help="start a CUDA MPS control daemon for this job alone unless one serves it already: its device shards "
        "and GPU workers share one GPU context ([job] mps = true)",
    )
    g.add_argument(
        "--resume",
        metavar="DIR",
        help="continue the stopped job in DIR from its shards' checkpoints, toward its total steps "
        "(its job.toml is the job; flags and --set still override it)",
    )
    g.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show the progress bar (default: when stderr is a terminal)",
    )
    g.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="after the job, write its loss and test accuracy as TensorBoard event files to DIR/NAME "
        "(needs --out, and pip install 'psgrid[tensorboard]')",
    )
    add_overwrite_arg(p)
    add_token_arg(p)
    add_set_arg(p)
    add_training_flags(p)
    p.set_defaults(func=run, user_command=None)
    p.usage = p.format_usage().removeprefix("usage: ").rstrip() + " [-- COMMAND ...]"  # split off by cli.main
    return p


def run(args: argparse.Namespace) -> int:
    from psgrid.cluster.commands.common import flag_names, given_names, load_job_from_args, with_mode_defaults_said
    from psgrid.cluster.run import script
    from psgrid.cluster.run.hosting import check_placement
    from psgrid.cluster.run.launch import launch
    from psgrid.cluster.run.preflight import (
        check_machine,
        check_mps,
        check_shard_device,
        check_stragglers,
        refuse_mpi_rank,
    )

    refuse_mpi_rank("launch")
    command = None if args.user_command is None else script.resolve_command(args.user_command)
    if args.tensorboard is not None:
        _check_tensorboard(args)
    if args.resume:
        job = _resumed_job(args)
        command = _resumed_command(args.resume, command)
        job = script.for_command(job, command)
        check_placement(job)
        check_mps(job)
        check_shard_device(job, given_names(args), sized=command is None)
        return _with_tensorboard(args, job, launch(job, progress=args.progress, resume=True, command=command))
    named = args.config is not None or args.override_name is not None
    args.config = args.config or "mnist"
    job = with_mode_defaults_said(load_job_from_args(args), args, "psctl launch")
    job = script.for_command(job, command, named=named)
    check_placement(job)
    check_stragglers(job)
    check_mps(job)
    if command is None:  # a user's script chooses its own device (it may not use CuPy at all)
        check_machine(job, flag_names(args))
    else:  # and its model is its own: the shards' GPU is checked, not their size
        check_shard_device(job, given_names(args), sized=False)
    return _with_tensorboard(args, job, launch(job, progress=args.progress, command=command))


def _check_tensorboard(args: argparse.Namespace) -> None:
    """--tensorboard: refused before anything runs without its extra, or without a folder to read it from."""
    from psgrid.cluster.errors import UsageError
    from psgrid.cluster.experiments.tensorboard import require

    require()
    if args.resume is None and args.override_out is None:
        raise UsageError("--tensorboard reads the job's folder when it ends: give --out DIR too")


def _with_tensorboard(args: argparse.Namespace, job, code: int) -> int:
    """The job's events as TensorBoard files (psgrid.cluster.experiments.tensorboard), then its exit code."""
    if args.tensorboard is not None and code in (0, 1):
        import sys
        from pathlib import Path

        from psgrid.cluster.experiments.tensorboard import write_job

        folder = write_job(Path(args.tensorboard), job.name, Path(job.out))
        print(f"psctl launch: TensorBoard events in {folder}", file=sys.stderr)
    return code


def _resumed_command(folder: str, given: list[str] | None) -> list[str] | None:
    """The command a resumed job's workers run: the one given after ``--``, else the one its folder recorded.

    A script job resumed without its command ran the built-in trainer against the script's checkpoints
    (every worker failed on the model's hash). The recorded command is run from the folder it ran in,
    where its relative paths mean what they meant: a resume from elsewhere is refused in one line.
    """
    import os
    import sys

    from psgrid.cluster.errors import UsageError
    from psgrid.cluster.job.records import COMMAND_FILE, read_command_file
    from psgrid.cluster.run import script

    recorded = read_command_file(folder)
    if given is not None or recorded is None:
        if given is not None and recorded is not None and given != recorded[0]:
            shown = " ".join(recorded[0])
            print(f"psctl launch: resuming with the command given after --; the job ran {shown}", file=sys.stderr)
        return given
    command, cwd = recorded
    shown = " ".join(command)
    if os.path.realpath(cwd) != os.path.realpath(os.getcwd()):
        raise UsageError(
            f"--resume {folder}: its job ran `{shown}` in {cwd}: resume from there (cd {cwd}), "
            f"or give the command after --"
        )
    print(
        f"psctl launch: resuming the job's own command ({folder}/{COMMAND_FILE}): {shown}; each worker's "
        "ps.first_step is where the shards left it (a loop from 0 trains those steps again)",
        file=sys.stderr,
    )
    return script.resolve_command(command)


def _resumed_job(args: argparse.Namespace):
    from pathlib import Path

    from psgrid.cluster.commands.common import collect_overrides
    from psgrid.cluster.errors import UsageError
    from psgrid.cluster.job.config import apply_overrides
    from psgrid.cluster.run.resume import job_file_to_resume, job_to_resume

    folder = Path(args.resume)
    if args.config is not None:
        raise UsageError("--resume takes the job from DIR/job.toml: leave out --config (flags and --set still apply)")
    overrides = collect_overrides(args)
    if overrides.get("out", str(folder)) != str(folder):
        raise UsageError("--resume continues in DIR itself: leave out --out")
    job_file = job_file_to_resume(folder)  # DIR/job.toml, or where damaged the latest attempt's copy
    return apply_overrides(job_to_resume(job_file), {**overrides, "out": str(folder)})
