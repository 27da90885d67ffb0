"""Argument helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import re
import sys
import textwrap


def add_command(subparsers, name: str, help: str, description: str, examples: str) -> argparse.ArgumentParser:
    """A subparser whose ``--help`` ends with worked examples."""
    p = subparsers.add_parser(
        name,
        help=help,
        description=description,
        epilog="examples:\n" + textwrap.indent(textwrap.dedent(examples).strip("\n"), "  "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.set_defaults(parser=p)  # so that an error about a value can name the flag that gave it
    return p


def add_config_arg(p: argparse.ArgumentParser, default: str | None, what: str) -> None:
    p.add_argument(
        "-c",
        "--config",
        default=default,
        metavar="FILE",
        help=f"job file (TOML) or the name of a packaged example such as 'mnist'; {what}"
        + (f" (default: {default})" if default else ""),
    )


def add_token_arg(p: argparse.ArgumentParser, dest: str = "override_token") -> None:
    p.add_argument(
        "--token",
        dest=dest,
        metavar="TOKEN",
        help="the job's bearer token (default: $PSGRID_TOKEN, the job file's, or a new one per job; a "
        "command line is visible to other users of this machine, so prefer $PSGRID_TOKEN)",
    )


def add_overwrite_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--overwrite",
        dest="override_overwrite",
        action="store_true",
        default=None,
        help="replace an earlier run in --out (its files only) instead of refusing to start",
    )


def add_set_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any job-file key, e.g. --set train.hidden=[256,256] --set staleness_compensation=lr "
        "(TOML values; applied before the other flags; repeatable)",
    )


# The keys that psctl launch, mpi, compare, allreduce and worker take as flags (any other through --set).
TRAINING_FLAG_KEYS = (
    "mode",
    "staleness",
    "backup_workers",
    "optimizer",
    "lr",
    "lease_s",
    "model",
    "dataset",
    "batch_size",
    "steps",
    "epochs",
    "eval_every",
    "device",
    "wire_dtype",
    "data_plane",
    "shared_memory",
    "seed",
    "stragglers",
)


def training_flags(keys=None) -> list[tuple]:
    """(flag, job-file key, type or choices, help) of the flags that override a job file, all or ``keys``.

    Each flag's type and help come from its key's schema (psserver/settings.py); a key both sides
    have (``data_plane``) is described as the workers' settings describe it. A function, so that
    only the commands that take them load the worker's settings (``psctl server`` never imports the
    worker package).
    """
    from psgrid.psserver.config import ServerConfig
    from psgrid.psserver.settings import flag_specs
    from psgrid.worker.config import TrainConfig

    wanted = TRAINING_FLAG_KEYS if keys is None else tuple(k for k in TRAINING_FLAG_KEYS if k in keys)
    found = flag_specs(ServerConfig, wanted, defaults=False) + flag_specs(TrainConfig, wanted, defaults=False)
    specs = {spec[1]: spec for spec in found}
    return [specs[key] for key in wanted]


def add_training_flags(p: argparse.ArgumentParser, keys=None) -> None:
    g = p.add_argument_group("job-file overrides")
    for flag, key, kind, help in training_flags(keys):
        if isinstance(kind, tuple):
            g.add_argument(flag, dest=f"override_{key}", choices=kind, default=None, help=help)
        elif kind is bool:
            g.add_argument(flag, dest=f"override_{key}", action=argparse.BooleanOptionalAction, default=None, help=help)
        else:
            g.add_argument(flag, dest=f"override_{key}", type=kind, default=None, metavar=key.upper(), help=help)


def collect_overrides(args: argparse.Namespace, *, sets: bool = True) -> dict:
    """``--set`` assignments (unless ``sets`` is False), then every ``override_KEY`` flag that was given."""
    from psgrid.cluster.job.config import parse_assignment

    overrides = dict(parse_assignment(text) for text in getattr(args, "set", []) or []) if sets else {}
    for name, value in vars(args).items():
        if name.startswith("override_") and value is not None:
            overrides[name[len("override_") :]] = value
    return overrides


# The commands that start the shards of the job they load (so its [server] and [train] tables must agree).
STARTS_SHARDS = ("launch", "mpi", "compare")


def flag_names(args: argparse.Namespace) -> dict[str, str]:
    """``{job-file key: flag}`` of the override flags given on this command line (``{"steps": "--steps"}``)."""
    parser = getattr(args, "parser", None)
    if parser is None:
        return {}
    names = {}
    for action in parser._actions:  # argparse keeps its options there; it has no public accessor
        if (
            action.dest.startswith("override_")
            and action.option_strings
            and getattr(args, action.dest, None) is not None
        ):
            names[action.dest[len("override_") :]] = max(action.option_strings, key=len)
    return names


def given_names(args: argparse.Namespace) -> dict[str, str]:
    """:func:`flag_names` and the keys of ``--set`` (``{"steps": "--set steps=0"}``): what to name in an error."""
    from psgrid.cluster.job.config import parse_assignment

    names = {}
    for text in getattr(args, "set", []) or []:
        key = parse_assignment(text)[0]
        names[key.rpartition(".")[2]] = f"--set {text}"
    return {**names, **flag_names(args)}


def load_job_from_args(args: argparse.Namespace, *, check: bool = True):
    """The job of ``--config``, then ``--set``, then the flags; refused before anything starts if it cannot train.

    An error about a value names what gave it: the flag (``--staleness must be >= 0``), ``--set KEY=VALUE``,
    or the job file's key.
    """
    from psgrid.cluster.job.config import load_job
    from psgrid.cluster.run import preflight

    job = with_overrides(load_job(args.config), args)
    preflight.command_line.clear()
    preflight.command_line.update(given_names(args))
    if check:
        preflight.check_job(job, given_names(args), starts_shards=getattr(args, "command", None) in STARTS_SHARDS)
    return job


def with_mode_defaults_said(job, args: argparse.Namespace, program: str):
    """``job`` with its mode's defaults where the file and the command line chose none (cluster/job/mode_defaults.py).

    Says so in one line on stderr (on rank 0 alone under mpiexec or srun).
    """
    from psgrid.cluster.job.mode_defaults import note, with_mode_defaults
    from psgrid.cluster.run.preflight import quiet_rank

    job, added = with_mode_defaults(job, given_names(args), args.config)
    line = note(job, added, program)
    if line and not quiet_rank():
        print(line, file=sys.stderr, flush=True)
    return job


def with_overrides(job, args: argparse.Namespace):
    """``job`` with ``args``' ``--set`` assignments, then its flags, applied (errors name the flag)."""
    from psgrid.cluster.errors import ConfigError
    from psgrid.cluster.job.config import apply_overrides, parse_assignment

    sets = {text: parse_assignment(text) for text in getattr(args, "set", []) or []}
    try:
        job = apply_overrides(job, dict(sets.values()))
    except ConfigError as e:
        # Name the --set without which the job would be valid (some keys must come together: tls_cert, tls_key).
        for text in sets:
            try:
                apply_overrides(job, dict(v for t, v in sets.items() if t != text))
            except ConfigError:
                continue
            raise ConfigError(f"--set {text}: {_reason(str(e))}") from None
        raise ConfigError(f"{' '.join('--set ' + t for t in sets)}: {_reason(str(e))}") from None
    overrides = collect_overrides(args, sets=False)
    flags = flag_names(args)
    try:
        return apply_overrides(job, overrides)
    except ConfigError as e:
        message = _reason(str(e))
    # Name the flag without which the job would be valid; else every flag the message mentions.
    for key in overrides:
        try:
            apply_overrides(job, {k: v for k, v in overrides.items() if k != key})
        except ConfigError:
            continue
        raise ConfigError(_name_flag(message, key, flags.get(key, key), overrides[key])) from None
    for key, flag in flags.items():
        message = re.sub(rf"\[\w+\] {re.escape(key)}\b", flag, message)
    raise ConfigError(message)


def _reason(message: str) -> str:
    """A ConfigError's text without the file it names (the flags are not in the file)."""
    return re.sub(r"^(?:.*? \(with overrides\)|override): ", "", message)


def _name_flag(reason: str, key: str, flag: str, value) -> str:
    reason = re.sub(r"^\[\w+\] ", "", reason)
    if re.match(rf"{re.escape(key)}\b", reason):
        return flag + reason[len(key) :]
    return f"{flag} {value}: {reason}"


def split_addresses(text: str) -> list[str]:
    """The value of ``--addresses``: ``"h1:p1,h2:p2"`` -> ``["h1:p1", "h2:p2"]``."""
    from psgrid.cluster.errors import UsageError

    addresses = [a.strip() for a in text.split(",") if a.strip()]
    for a in addresses:
        host, sep, port = a.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise UsageError(f"--addresses expects host:port[,host:port...], got {a!r}")
    if not addresses:
        raise UsageError("--addresses expects host:port[,host:port...], got nothing")
    return addresses
