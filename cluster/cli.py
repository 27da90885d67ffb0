"""psctl: the command line of psgrid (``psctl --help``); subcommands live in cluster/commands/."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import time

from psgrid.cluster.commands import COMMANDS
from psgrid.cluster.run.interrupts import hear_early, heard_early

QUIET_RANK_GRACE_S = 1.0  # how long an MPI rank other than 0 waits before exiting on an error rank 0 reports

EXAMPLES = """\
examples:
  psctl launch --config examples/mnist.toml            # the default job: 2 shards, 2 workers, sync
  psctl launch --config mnist --mode ssp --staleness 2  # 'mnist' is the packaged copy of that file
  mpiexec -n 6 psctl mpi --config mnist --shards 2      # 1 coordinator, 2 shards, 3 workers
  psctl status --address-dir runs/mnist-20250101-120000/addr

Run 'psctl COMMAND --help' for a command's options and examples."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line that points at --help (exit code 2)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """psctl's parser; with ``command``, only that command's options are built (the rest are listed).

    Building only what is run keeps each command's imports its own: ``psctl server`` never
    loads the worker package, whose settings the job-running commands' flags describe.
    """
    parser = Parser(
        prog="psctl",
        description="Sharded parameter servers for data-parallel training: start shards and workers, "
        "launch whole jobs locally or under mpiexec/srun, and inspect running shards.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name in COMMANDS:
        module = importlib.import_module(f"psgrid.cluster.commands.{name}")
        if command in (None, name):
            module.add_parser(sub)
        else:
            sub.add_parser(name, help=module.HELP)
    return parser


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("psgrid")
    except PackageNotFoundError:
        return "(not installed)"


def main(argv: list[str] | None = None) -> int:
    """Run psctl with ``argv`` (default: ``sys.argv[1:]``); returns the exit code."""
    before = None
    try:
        before = hear_early()
        return _main(argv)
    except KeyboardInterrupt:  # a Ctrl-C while the command still loads its modules
        print("psctl: interrupted", file=sys.stderr)
        return 130
    except Exception:
        # A Ctrl-C that lands inside an extension module's import comes out as that import's
        # ImportError (numpy's "PyCapsule_Import could not import module"): it was the Ctrl-C.
        if heard_early() is None:
            raise
        print("psctl: interrupted", file=sys.stderr)
        return 130
    finally:
        if before is not None:
            signal.signal(signal.SIGINT, before)


def _main(argv: list[str] | None) -> int:
    from psgrid.cluster.errors import JobFailed, UsageError, out_of_memory
    from psgrid.psserver.exceptions import PSError, Unavailable

    argv = sys.argv[1:] if argv is None else list(argv)
    # Everything after the first `--` is the user's own command (psctl launch -- python train.py ARGS):
    # it is never parsed as psctl's options.
    user_command = argv[argv.index("--") + 1 :] if "--" in argv else None
    argv = argv[: argv.index("--")] if "--" in argv else argv
    command = next((a for a in argv if not a.startswith("-")), None)
    parser = build_parser(command if command in COMMANDS else None)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if user_command is not None:
        if not hasattr(args, "user_command"):
            parser.error(f"only launch, mpi and compare run a command of yours after --, not {args.command}")
        args.user_command = user_command
    try:
        return int(args.func(args) or 0)
    except UsageError as e:
        from psgrid.cluster.run.preflight import quiet_rank

        if not quiet_rank():  # every MPI rank meets the same error: rank 0 says it once
            print(f"psctl {args.command}: error: {e}", file=sys.stderr)
        elif not _wired_mpi():
            # ... and the others let it: a launcher that ends every task at the first bad exit (srun's
            # KillOnBadExit) could otherwise end rank 0 before its line is out (seen once in CI). MPI is
            # finished first, so a rank ended while it waits leaves none of MPI's shared memory. (Ranks
            # that MPI wired together exit at once: their MPI finishes with all of them.)
            _finish_lone_mpi()
            time.sleep(QUIET_RANK_GRACE_S)
        return 2
    except JobFailed as e:
        print(f"psctl {args.command}: {e}", file=sys.stderr)
        return 1
    except PSError as e:
        # A shard refused, or could not be reached: the domain error says which and why.
        hint = " (are the shards running, at those addresses?)" if isinstance(e, Unavailable) else ""
        print(f"psctl {args.command}: {e}{hint}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"psctl {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        # A GPU that ran out of memory is the job's size, not a bug: one line naming what to change.
        line = out_of_memory(e)
        if line is None:
            raise
        print(f"psctl {args.command}: {line}", file=sys.stderr)
        return 1


def _wired_mpi() -> bool:
    """Whether this process started MPI with other ranks."""
    mpi = sys.modules.get("mpi4py.MPI")
    return mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized() and mpi.COMM_WORLD.Get_size() > 1


def _finish_lone_mpi() -> None:
    """Finish an MPI this process started alone (a world of one: nobody to wait for), releasing what it holds."""
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()


if __name__ == "__main__":
    sys.exit(main())
