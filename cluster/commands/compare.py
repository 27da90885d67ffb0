"""psctl compare: several consistency modes, an all-reduce baseline and stragglers on one job, with a report."""

from __future__ import annotations

import argparse

from psgrid.cluster.commands._common import (add_command, add_config_arg, add_set_arg, add_token_arg,
                                             add_training_flags)

HELP = "compare sync, async, ssp and all-reduce on one job: runs, a report and plots"

EXAMPLES = """
psctl compare --config mnist --modes sync,async,ssp:2,allreduce --out runs/cmp
psctl compare --config mnist --workers 4 --stragglers none --stragglers 3:3 --repeats 3 --out runs/straggler
psctl compare --config examples/synthetic-20m.toml --workers 1,2,4 --modes sync,async,allreduce --device gpu --out runs/scaling
psctl compare --config mnist --stragglers 1:exp:20 --target-accuracy 0.9 --out runs/noisy --resume
mpiexec -n 7 psctl compare --mpi --config mnist --shards 2 --workers 4 --out runs/cmp-mpi
"""

DEFAULT_MODES = "sync,async,ssp:2,allreduce"
# Set per run by the experiment, so not offered as job-file overrides here.
_PER_RUN = ("mode", "staleness", "backup_workers", "stragglers")


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "compare", help=HELP,
        description="Run the same job (same seed, data order and initial weights) once per mode, worker count, "
                    "straggler setting and repeat, one run after another on this machine, and write OUT/"
                    "results.jsonl (every step of every run), OUT/summary.csv (one row per run), OUT/report.md and "
                    "OUT/report.html (tables, plots and a reading of the numbers) and OUT/plots/*.png. Each run's "
                    "own output is under OUT/runs/. Ctrl-C stops cleanly and keeps the finished runs; --resume "
                    "runs only what is missing. The allreduce mode trains with no shards under the mpiexec of "
                    "the mpi extra (pip install 'psgrid[mpi]').",
        examples=EXAMPLES,
    )
    add_config_arg(p, "mnist", "flags override it")
    e = p.add_argument_group("experiment")
    e.add_argument("--modes", default=DEFAULT_MODES, metavar="LIST",
                   help=f"modes to compare: sync, async, ssp:S (bound S), allreduce (default: {DEFAULT_MODES})")
    e.add_argument("--workers", metavar="LIST", help="worker counts, e.g. 1,2,4 (default: [job] workers)")
    e.add_argument("--stragglers", action="append", metavar="SETTING",
                   help="a straggler setting: none, K:F (worker K F times slower than its own compute) or "
                        "K:exp:MEAN_MS (a random delay per step), several joined by commas; repeat the flag to "
                        "compare settings, e.g. --stragglers none --stragglers 3:3 (default: none)")
    e.add_argument("--backup-workers", type=int, metavar="B",
                   help="sync: close a round when all but B workers pushed (default: the job's)")
    e.add_argument("--repeats", type=int, default=1, metavar="R", help="runs of each setting (default 1)")
    e.add_argument("--target-accuracy", type=float, metavar="A",
                   help="test accuracy whose time to reach is compared (default: the highest every run reached)")
    e.add_argument("--out", required=True, metavar="DIR", help="output folder of the experiment")
    e.add_argument("--resume", action="store_true", help="finish an experiment in OUT: skip the runs already done")
    e.add_argument("--overwrite", action="store_true",
                   help="replace an earlier experiment in OUT (its runs, results and report) instead of refusing")
    e.add_argument("--report-only", action="store_true",
                   help="run nothing: write summary.csv and the report of the experiment in OUT again from its runs "
                        "(with --target-accuracy, for another target)")
    e.add_argument("--mpi", action="store_true",
                   help="run under mpiexec or srun (every rank runs this same command): each run takes the first "
                        "1+S+W ranks as psctl mpi does (W for allreduce); needs 1+S+max(workers) ranks")
    e.add_argument("--shards", dest="override_shards", type=int, metavar="S",
                   help="shard processes of the parameter-server runs (default: [job] shards)")
    e.add_argument("--timeout", dest="override_timeout_s", type=float, metavar="SECONDS",
                   help="stop a run that trains longer than this (default: no limit)")
    e.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="show the progress bar (default: when stderr is a terminal)")
    add_token_arg(p)
    add_set_arg(p)
    add_training_flags(p, keys=_training_keys())
    p.set_defaults(func=run)
    return p


def _training_keys() -> list[str]:
    from psgrid.cluster.commands._common import training_flags

    return [key for _, key, _, _ in training_flags() if key not in _PER_RUN]


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import sys
    from pathlib import Path

    from psgrid.cluster.commands._common import load_job_from_args
    from psgrid.cluster.compare import Compare, Experiment, settings_for
    from psgrid.cluster.config import apply_overrides
    from psgrid.cluster.errors import UsageError
    from psgrid.cluster.experiment import parse_counts, parse_modes, parse_straggler_setting, plan

    if args.report_only:
        from psgrid.cluster.compare import rewrite_report, table_text

        rows = rewrite_report(Path(args.out), args.target_accuracy)
        print(table_text(rows, rows[0]["target_accuracy"] if rows else None))
        return 0
    from psgrid.cluster.commands._common import flag_names
    from psgrid.cluster.preflight import check_device, refuse_mpi_rank

    if not args.mpi:
        refuse_mpi_rank("compare", "psctl compare --mpi")
    job = load_job_from_args(args)
    check_device(job.train, flag_names(args))
    modes = parse_modes(args.modes)
    workers = parse_counts(args.workers, "--workers") if args.workers else [job.workers]
    stragglers = [parse_straggler_setting(s) for s in (args.stragglers or ["none"])]
    if len(set(stragglers)) != len(stragglers):
        raise UsageError("--stragglers: a setting is given twice")
    if args.repeats < 1:
        raise UsageError(f"--repeats must be at least 1, got {args.repeats}")
    if args.target_accuracy is not None and not 0.0 < args.target_accuracy <= 1.0:
        raise UsageError(f"--target-accuracy must be in (0, 1], got {args.target_accuracy}")
    overrides = {"stragglers": []}
    if args.backup_workers is not None:
        overrides["backup_workers"] = args.backup_workers
    job = dataclasses.replace(apply_overrides(job, overrides), out=None)    # every run has its own folder
    runs = plan(modes, workers, stragglers, args.repeats)
    settings = settings_for(job, command=sys.argv[2:] if sys.argv[1:2] == ["compare"] else [],
                            modes=modes, workers=workers, stragglers=stragglers, repeats=args.repeats,
                            target=args.target_accuracy, backup_workers=args.backup_workers)
    experiment = Experiment(job, runs, Path(args.out), args.target_accuracy, settings)
    if args.overwrite:
        from psgrid.cluster.outdir import EXPERIMENT_FILES, clear_run, lock
        from psgrid.cluster.preflight import launcher_rank

        if args.resume:
            raise UsageError("--overwrite starts the experiment again and --resume finishes it: give one of them")
        if (launcher_rank() or (0, 1))[0] == 0:      # under --mpi, world rank 0 alone prepares the folder
            lock(Path(args.out))        # never an experiment that runs now: it holds the lock (cluster/outdir.py)
            clear_run(Path(args.out), EXPERIMENT_FILES)
    if args.mpi:
        return _run_mpi(experiment, args)
    return Compare(experiment, resume=args.resume, progress=args.progress).run()


def _run_mpi(experiment, args: argparse.Namespace) -> int:
    import socket
    import sys
    import traceback

    from psgrid.cluster.errors import UsageError

    try:
        from mpi4py import MPI
    except ImportError:
        raise UsageError("psctl compare --mpi needs mpi4py: pip install 'psgrid[mpi]'") from None
    from psgrid.cluster.compare_mpi import MPICompare
    from psgrid.cluster.mpi import _abort
    from psgrid.cluster.mpich_shm import unlink_init_shm

    comm = MPI.COMM_WORLD
    try:
        unlink_init_shm(comm)   # leave no MPICH file in /dev/shm, however the job ends
        return MPICompare(experiment, comm=comm, resume=args.resume, progress=args.progress).run()
    except BaseException:
        print(f"psctl compare: rank {comm.Get_rank()} on {socket.gethostname()} failed; aborting the job:\n"
              f"{traceback.format_exc()}", file=sys.stderr, flush=True)
        _abort(comm)
        raise
