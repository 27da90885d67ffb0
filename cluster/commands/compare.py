"""psctl compare: several consistency modes, an all-reduce baseline and stragglers on one job, with a report.

With --tune each mode first runs a grid of settings and its repeats run at its own best point; after
-- comes a script of the user's, run by each worker of every run as psctl launch -- runs it.
"""

from __future__ import annotations

import argparse

from psgrid.cluster.commands.common import add_command, add_config_arg, add_set_arg, add_token_arg, add_training_flags

HELP = "compare sync, async, ssp and all-reduce on one job: runs, a report and plots"

EXAMPLES = """
psctl compare --config mnist --modes sync,async,ssp:2,allreduce --out runs/cmp
psctl compare --config mnist --workers 4 --stragglers none --stragglers 3:3 --repeats 3 --out runs/straggler
psctl compare --config examples/synthetic-20m.toml --workers 1,2,4 --modes sync,async,allreduce --device gpu --out runs/scaling
psctl compare --config mnist --stragglers 1:exp:20 --target-accuracy 0.9 --out runs/noisy --resume
psctl compare --modes sync,async,ssp:2 --tune lr=0.01,0.05,0.2 --tune momentum=0,0.9 --tune-steps 200 --out runs/tuned
psctl compare --modes sync,async --mode-set async:lr=0.02 --out runs/lower-lr
psctl compare --config mnist --modes sync,async --workers 4 --repeats 6 --tensorboard runs/tb --out runs/seeds
psctl compare --modes sync,async,ssp:2 --workers 2 --out runs/mine -- python train.py --steps 300
mpiexec -n 7 psctl compare --mpi --config mnist --shards 2 --workers 4 --out runs/cmp-mpi
"""

DEFAULT_MODES = "sync,async,ssp:2,allreduce"
SCRIPT_MODES = "sync,async,ssp:2"  # the default with a script: all-reduce needs the built-in loop
TUNE_REPEATS = 2  # tuning.DEFAULT_REPEATS, kept here so --help loads no experiment code
# Set per run by the experiment, so not offered as job-file overrides here.
_PER_RUN = ("mode", "staleness", "backup_workers", "stragglers")


DESCRIPTION = (
    "Run the same job once per mode, worker count, "
    "straggler setting and repeat, one run after another on this machine, and write OUT/"
    "results.jsonl (every step of every run), OUT/summary.csv (one row per run), OUT/report.md and "
    "OUT/report.html (tables, plots and a reading of the numbers) and OUT/plots/*.png. Each run's "
    "own output is under OUT/runs/. Ctrl-C stops cleanly and keeps the finished runs; --resume "
    "runs only what is missing. The allreduce mode trains with no shards under the mpiexec of "
    "the mpi extra (pip install 'psgrid[mpi]'). "
    "--tune KEY=V1,V2 (repeatable) first runs every mode over the grid of those settings (short "
    f"runs of --tune-steps, {TUNE_REPEATS} of each point unless --tune-repeats says otherwise), picks "
    "each mode's best point (the earliest to the target; where none reaches it, the best final accuracy; a diverged point never wins) and runs the "
    "repeats there; the report shows each mode's chosen settings and how each setting did. "
    "Repeat r runs with seed base+r (the job's seed is the base; --seeds pins them). A setting whose "
    "final accuracies spread more than 0.05 across repeats, or whose loss rose for a stretch, is "
    "marked unstable; a run whose loss grows or turns non-finite (also when the shards refuse its "
    "non-finite gradients), or whose accuracy falls to chance, is marked diverged; the reading "
    "says so first. The target accuracy is --target-accuracy, else 95% of the best setting's median "
    "final accuracy, and time to it is 'k of n reached'. With 6 or more repeats of their own seeds "
    "the tables show medians with distribution-free 95% intervals of the median (order statistics; "
    "else min..max) and the reading calls a "
    "difference settled only where they do not overlap. async and ssp run with async_momentum=auto "
    "unless --mode-set MODE:async_momentum=off (the report says which settings each mode ran with). "
    "After -- comes your own script (-- python train.py ARGS): every worker of every "
    "run runs it as under psctl launch --, with that run's mode and settings on the shards, and "
    "the report is built from what psgrid.init's session logs (loss, log_eval)."
)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers,
        "compare",
        help=HELP,
        description=DESCRIPTION,
        examples=EXAMPLES,
    )
    add_config_arg(p, "mnist", "flags override it")
    experiment = p.add_argument_group("experiment")
    _experiment_arguments(experiment)
    _output_arguments(experiment)
    add_token_arg(p)
    add_set_arg(p)
    add_training_flags(p, keys=_training_keys())
    p.set_defaults(func=run, user_command=None)
    p.usage = p.format_usage().removeprefix("usage: ").rstrip() + " [-- COMMAND ...]"  # split off by cli.main
    return p


def _experiment_arguments(e) -> None:
    e.add_argument(
        "--modes",
        metavar="LIST",
        help=f"modes to compare: sync, async, ssp:S (bound S), allreduce (default: {DEFAULT_MODES}; "
        f"with a script after --, {SCRIPT_MODES})",
    )
    e.add_argument("--workers", metavar="LIST", help="worker counts, e.g. 1,2,4 (default: [job] workers)")
    e.add_argument(
        "--stragglers",
        action="append",
        metavar="SETTING",
        help="a straggler setting: none, K:F (worker K F times slower than its own compute) or "
        "K:exp:MEAN_MS (a random delay per step), several joined by commas; repeat the flag to "
        "compare settings, e.g. --stragglers none --stragglers 3:3 (default: the job's own stragglers, "
        "from its file or --set, as one setting; none where it has none)",
    )
    e.add_argument(
        "--backup-workers",
        type=int,
        metavar="B",
        help="sync: close a round when all but B workers pushed (default: the job's)",
    )
    e.add_argument(
        "--repeats",
        type=int,
        default=1,
        metavar="R",
        help="runs of each setting, repeat r with seed base+r (default 1; 6 or more for 95%% intervals)",
    )
    e.add_argument(
        "--seeds",
        metavar="LIST",
        help="the repeats' seeds: 'same' to run every repeat with the job's seed (only timing then "
        "varies, and no interval is drawn), or one per repeat, e.g. 3,7,11 (default: base+r)",
    )
    e.add_argument(
        "--tune",
        action="append",
        default=[],
        metavar="KEY=V1,V2,...",
        help="tune each mode over these values of a server or train key (values as --set takes them), "
        "e.g. --tune lr=0.01,0.05,0.2 --tune momentum=0,0.9: every combination is a grid point",
    )
    e.add_argument(
        "--tune-steps", type=int, metavar="N", help="steps per worker of each tuning run (default: the job's steps)"
    )
    e.add_argument(
        "--tune-repeats",
        type=int,
        metavar="N",
        help=f"runs of each grid point, repeat r with seed base+r; the point is judged on their medians "
        f"(default {TUNE_REPEATS})",
    )
    e.add_argument(
        "--mode-set",
        action="append",
        default=[],
        metavar="MODE:KEY=VALUE",
        help="a setting for one mode's runs only, e.g. --mode-set async:lr=0.02 (tuning, if any, starts from it)",
    )
    e.add_argument(
        "--classes",
        type=int,
        metavar="K",
        help="classes of the task, for the divergence test (final test accuracy <= 1.5/K is chance; "
        "default: the job's dataset's; with a script after --, no chance test unless given)",
    )
    e.add_argument(
        "--target-accuracy",
        type=float,
        metavar="A",
        help="test accuracy whose time to reach is compared (default: 95%% of the best setting's median final "
        "accuracy)",
    )


def _output_arguments(e) -> None:
    """Where the experiment goes, how it resumes, and how it runs (mpi, timeout, progress, TensorBoard)."""
    e.add_argument("--out", required=True, metavar="DIR", help="output folder of the experiment")
    e.add_argument("--resume", action="store_true", help="finish an experiment in OUT: skip the runs already done")
    e.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier experiment in OUT (its runs, results and report) instead of refusing",
    )
    e.add_argument(
        "--report-only",
        action="store_true",
        help="run nothing: write summary.csv and the report of the experiment in OUT again from its runs "
        "(with --target-accuracy, for another target; with --classes, another chance level)",
    )
    e.add_argument(
        "--mpi",
        action="store_true",
        help="run under mpiexec or srun (every rank runs this same command): each run takes the first "
        "1+S+W ranks as psctl mpi does (W for allreduce); needs 1+S+max(workers) ranks",
    )
    e.add_argument(
        "--shards",
        dest="override_shards",
        type=int,
        metavar="S",
        help="shard processes of the parameter-server runs (default: [job] shards)",
    )
    e.add_argument(
        "--timeout",
        dest="override_timeout_s",
        type=float,
        metavar="SECONDS",
        help="stop a run that trains longer than this (default: no limit)",
    )
    e.add_argument(
        "--tensorboard",
        metavar="DIR",
        help="also write each run's loss and test accuracy as TensorBoard event files under DIR/NAME, NAME "
        "the name of OUT (so experiments may share DIR), one folder per run named after its mode, workers and "
        "repeat (tensorboard --logdir DIR overlays them; needs pip install 'psgrid[tensorboard]')",
    )
    e.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="show the progress bar (default: when stderr is a terminal)",
    )


def _training_keys() -> list[str]:
    from psgrid.cluster.commands.common import training_flags

    return [key for _, key, _, _ in training_flags() if key not in _PER_RUN]


def _seeds(args: argparse.Namespace, base: int, tune_repeats: int) -> list[int]:
    """Each repeat's seed: as many as the most of --repeats and (tuning) --tune-repeats, whose count a refusal names."""
    from psgrid.cluster.experiments.experiment import repeat_seeds

    why = "one per repeat"
    if tune_repeats > args.repeats:
        why += f": the most of --repeats {args.repeats} and --tune-repeats {tune_repeats}"
    return repeat_seeds(base, max(args.repeats, tune_repeats, 1), args.seeds, why)


def run(args: argparse.Namespace) -> int:
    import dataclasses
    import sys
    from pathlib import Path

    from psgrid.cluster.commands.common import load_job_from_args
    from psgrid.cluster.errors import UsageError
    from psgrid.cluster.experiments.compare import Compare, experiment_from
    from psgrid.cluster.experiments.experiment import mode_defaults, parse_counts, parse_modes, plan
    from psgrid.cluster.experiments.settings import settings_for
    from psgrid.cluster.job.config import apply_overrides

    if args.tensorboard is not None:
        from psgrid.cluster.experiments.tensorboard import require

        require()
    _check_flag_values(args)
    if args.report_only:
        from psgrid.cluster.experiments.compare import rewrite_report, table_text

        rows = rewrite_report(
            Path(args.out), args.target_accuracy, args.classes, args.tensorboard, command=_report_command(args)
        )
        print(table_text(rows, rows[-1]["target_accuracy"] if rows else None))  # a repeat's: they come last
        return 0
    from psgrid.cluster.commands.common import flag_names, given_names
    from psgrid.cluster.run import script
    from psgrid.cluster.run.preflight import check_device, check_mps, check_shard_device, refuse_mpi_rank

    if not args.mpi:
        refuse_mpi_rank("compare", "psctl compare --mpi")
    command = None if args.user_command is None else script.resolve_command(args.user_command)
    if command and args.mpi:
        raise UsageError("psctl compare --mpi runs the built-in trainer: leave out --mpi to compare a script")
    _refuse_a_scripts_length(args, command)
    job = load_job_from_args(args)
    check_mps(job, launcher="psctl compare --mpi" if args.mpi else "psctl launch")
    if command is None:  # a user's script chooses its own device
        check_device(job.train, flag_names(args))
    else:
        named = args.config is not None or getattr(args, "override_name", None) is not None
        job = script.for_command(job, command, named=named)
    modes = parse_modes(args.modes or (SCRIPT_MODES if command else DEFAULT_MODES))
    if command and any(not m.uses_shards for m in modes):
        raise UsageError(
            "--modes allreduce needs the built-in trainer; with a script after -- compare sync, async and ssp:S"
        )
    tune = _tuning(args, job, command)
    mode_settings = _mode_settings(args.mode_set, modes, job, server_only=command is not None)
    defaults = mode_defaults(modes, job, given=given_names(args), spec=args.config)
    workers = parse_counts(args.workers, "--workers") if args.workers else [job.workers]
    _check_backup_workers(args, job, modes, workers, tune)
    if not args.mpi and any(m.uses_shards for m in modes):  # --mpi: each shard rank checks its own node
        # the most workers any run has: the most gradient slots on a GPU
        check_shard_device(apply_overrides(job, {"workers": max(workers)}), given_names(args), sized=command is None)
    stragglers = _straggler_settings(args.stragglers, job, workers, say=not args.mpi)
    overrides = {"stragglers": []}
    if args.backup_workers is not None:
        overrides["backup_workers"] = args.backup_workers
    job = dataclasses.replace(apply_overrides(job, overrides), out=None)  # every run has its own folder
    plan(modes, workers, stragglers, args.repeats)  # refuses a straggler that does not exist
    tune_repeats = args.tune_repeats if args.tune_repeats is not None else TUNE_REPEATS
    seeds = _seeds(args, job.train.seed, tune_repeats if tune else 0)
    settings = settings_for(
        job,
        command=sys.argv[2:] if sys.argv[1:2] == ["compare"] else [],
        modes=modes,
        workers=workers,
        stragglers=stragglers,
        repeats=args.repeats,
        target=args.target_accuracy,
        backup_workers=args.backup_workers,
        tune=tune,
        tune_steps=args.tune_steps,
        mode_settings=mode_settings,
        script=command,
        classes=args.classes,
        seeds=seeds,
        tune_repeats=tune_repeats,
        mode_defaults=defaults,
        tensorboard=None if args.tensorboard is None else str(Path(args.tensorboard).resolve()),
        script_given=args.user_command,
        seeds_pinned=args.seeds is not None,
    )
    experiment = experiment_from(job, settings, Path(args.out))
    if args.overwrite:
        _clear_for_overwrite(args)
    if args.mpi:
        return _run_mpi(experiment, args)
    return Compare(experiment, resume=args.resume, progress=args.progress).run()


def _check_flag_values(args: argparse.Namespace) -> None:
    """The values a flag refuses whatever else is given: checked first, so --report-only saves none of them."""
    from psgrid.cluster.errors import UsageError
    from psgrid.cluster.experiments.experiment import parse_counts, parse_modes

    if args.out:  # a file there was a NotADirectoryError from the first read of the folder
        from pathlib import Path

        from psgrid.cluster.job.outdir import check_usable

        check_usable(Path(args.out).resolve())
    if args.modes:  # empty: the default modes
        parse_modes(args.modes)
    if args.workers:
        parse_counts(args.workers, "--workers")
    if args.classes is not None and args.classes < 2:
        raise UsageError(f"--classes must be at least 2, got {args.classes}")
    if args.repeats < 1:
        raise UsageError(f"--repeats must be at least 1, got {args.repeats}")
    if args.target_accuracy is not None and not 0.0 < args.target_accuracy <= 1.0:
        raise UsageError(f"--target-accuracy must be in (0, 1], got {args.target_accuracy}")


def _refuse_a_scripts_length(args: argparse.Namespace, command: list[str] | None) -> None:
    """--steps or --epochs with a script: it decides its own length (they were recorded, and ignored)."""
    from psgrid.cluster.commands.common import flag_names
    from psgrid.cluster.errors import UsageError

    if command and (length := [f for k, f in flag_names(args).items() if k in ("steps", "epochs")]):
        raise UsageError(f"{length[0]}: a script decides its own length; pass it the steps after -- instead")


def _check_backup_workers(args: argparse.Namespace, job, modes, workers: list[int], tune: dict) -> None:
    """Backup workers fewer than every sync run's workers, checked before the first run (not at its turn):
    the flag's, the job's, and the most a tuning grid tries."""
    from psgrid.cluster.errors import UsageError

    backup = job.server.backup_workers if args.backup_workers is None else args.backup_workers
    tried = max(
        (v for key, values in tune.items() if key.rpartition(".")[2] == "backup_workers" for v in values), default=-1
    )
    if max(backup, tried) < min(workers) or all(m.stale for m in modes):  # async and ssp hold no rounds: no backups
        return
    if tried >= min(workers) and tried > backup:
        raise UsageError(
            f"--tune backup_workers tries {tried}, not less than the fewest --workers ({min(workers)}): a sync "
            f"round needs at least one push; try {min(workers) - 1} or fewer, or more --workers"
        )
    given = "--backup-workers" if args.backup_workers is not None else "the job's backup_workers"
    fewest = "the fewest --workers" if args.workers else "the job's workers"
    raise UsageError(
        f"{given} ({backup}) must be less than {fewest} ({min(workers)}): a sync round needs at least one "
        f"push; give --backup-workers {min(workers) - 1} or fewer, or more --workers"
    )


def _report_command(args: argparse.Namespace) -> str:
    """The ``--report-only`` command line as given, for the report and experiment.json (else what it set)."""
    import shlex
    import sys

    if sys.argv[1:2] == ["compare"]:
        return "psctl compare " + shlex.join(sys.argv[2:])
    parts = ["psctl", "compare", "--out", args.out, "--report-only"]
    for flag, value in (("--target-accuracy", args.target_accuracy), ("--classes", args.classes)):
        if value is not None:
            parts += [flag, str(value)]
    return shlex.join(parts)


def _straggler_settings(given: list[str] | None, job, workers: list[int], *, say: bool) -> list[str]:
    """--stragglers' settings; without the flag, the job's own stragglers as one setting (or none).

    A job file's stragglers are part of its job (examples/mnist-ssp.toml is about one): compare runs them
    unless told otherwise, says so in one line, and refuses a worker count they do not fit.
    """
    import sys

    from psgrid.cluster.errors import UsageError
    from psgrid.cluster.experiments.experiment import NO_STRAGGLERS, parse_straggler_setting
    from psgrid.worker.straggler import parse_stragglers

    if given:
        settings = [parse_straggler_setting(s) for s in given]
        if len(set(settings)) != len(settings):
            raise UsageError("--stragglers: a setting is given twice")
        return settings
    own = parse_straggler_setting(",".join(job.train.stragglers))
    if own == NO_STRAGGLERS:
        return [own]
    rank = max(s.rank for s in parse_stragglers(job.train.stragglers))
    if too_few := [w for w in workers if rank >= w]:
        raise UsageError(
            f"the job's stragglers ({own}) slow worker {rank}, which a run of "
            f"{too_few[0]} worker{'s' if too_few[0] != 1 else ''} does not have: give --stragglers none to "
            f"compare without them, or --stragglers with ranks below {min(workers)}"
        )
    if say:
        print(
            f"psctl compare: every run has the job's stragglers {own} (--stragglers none compares without them)",
            file=sys.stderr,
            flush=True,
        )
    return [own]


def _tuning(args: argparse.Namespace, job, command: list[str] | None) -> dict:
    """``--tune`` (values to try per key) with ``--tune-steps`` checked against it."""
    from psgrid.cluster.errors import UsageError
    from psgrid.cluster.experiments.tuning import parse_tune

    tune = parse_tune(args.tune, job, server_only=command is not None)
    if tune and args.mpi:
        raise UsageError("--tune runs on this machine: leave out --mpi (psctl compare --mpi does not tune yet)")
    if args.tune_repeats is not None:
        if not tune:
            raise UsageError("--tune-repeats sets the runs of each grid point: give --tune KEY=V1,V2 too")
        if args.tune_repeats < 1:
            raise UsageError(f"--tune-repeats must be at least 1, got {args.tune_repeats}")
    if args.tune_steps is not None:
        if not tune:
            raise UsageError("--tune-steps sets the length of the tuning runs: give --tune KEY=V1,V2 too")
        if command:
            raise UsageError("--tune-steps: a script decides its own length; pass it the steps after -- instead")
        if args.tune_steps < 1:
            raise UsageError(f"--tune-steps must be at least 1, got {args.tune_steps}")
    return tune


def _clear_for_overwrite(args: argparse.Namespace) -> None:
    """``--overwrite``: the experiment's folder emptied of a previous experiment's files (never one running)."""
    from pathlib import Path

    from psgrid.cluster.errors import UsageError
    from psgrid.cluster.job.outdir import EXPERIMENT_FILES, clear_run, lock
    from psgrid.cluster.run.preflight import launcher_rank

    if args.resume:
        raise UsageError("--overwrite starts the experiment again and --resume finishes it: give one of them")
    if (launcher_rank() or (0, 1))[0] == 0:  # under --mpi, world rank 0 alone prepares the folder
        lock(Path(args.out))  # never an experiment that runs now: it holds the lock (cluster/job/outdir.py)
        clear_run(Path(args.out), EXPERIMENT_FILES)


def _mode_settings(texts: list[str], modes, job, *, server_only: bool) -> dict:
    """``["async:lr=0.02"]`` -> ``{"async": (("lr", 0.02),)}``, each checked as --tune checks its values."""
    from psgrid.cluster.errors import UsageError
    from psgrid.cluster.experiments.tuning import parse_tune

    found: dict[str, tuple] = {}
    labels = [m.label for m in modes]
    for text in texts:
        label, _, assignment = (
            text.partition(":")
            if not text.startswith("ssp:")
            else ("ssp:" + text[4:].partition(":")[0], ":", text[4:].partition(":")[2])
        )
        if label not in labels or "=" not in assignment:
            raise UsageError(
                f"--mode-set expects MODE:KEY=VALUE with MODE one of {', '.join(labels)} "
                f"(e.g. --mode-set async:lr=0.02), got {text!r}"
            )
        ((key, values),) = parse_tune([assignment], job, flag="--mode-set", server_only=server_only).items()
        if len(values) != 1:
            raise UsageError(f"--mode-set {text}: one value; to try several, use --tune")
        found[label] = found.get(label, ()) + ((key, values[0]),)
    return found


def _run_mpi(experiment, args: argparse.Namespace) -> int:
    import signal
    import socket
    import sys
    import traceback

    from psgrid.cluster.errors import UsageError

    try:
        from mpi4py import MPI
    except ImportError:
        raise UsageError("psctl compare --mpi needs mpi4py: pip install 'psgrid[mpi]'") from None
    from psgrid.cluster.experiments.compare_mpi import MPICompare
    from psgrid.cluster.mpi.comm import abort
    from psgrid.cluster.mpi.mpich_shm import unlink_init_shm
    from psgrid.cluster.run.interrupts import stop_on_signals

    comm = MPI.COMM_WORLD
    old = stop_on_signals()  # Ctrl-C and SIGTERM stop the run under way on every rank (compare_mpi.py)
    try:
        unlink_init_shm(comm)  # leave no MPICH file in /dev/shm, however the job ends
        return MPICompare(experiment, comm=comm, resume=args.resume, progress=args.progress).run()
    except BaseException:
        print(
            f"psctl compare: rank {comm.Get_rank()} on {socket.gethostname()} failed; aborting the job:\n"
            f"{traceback.format_exc()}",
            file=sys.stderr,
            flush=True,
        )
        abort(comm)
        raise
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
