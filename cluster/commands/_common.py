"""Argument helpers shared by the subcommands."""

from __future__ import annotations

import argparse
import textwrap

from psgrid.psserver.protocol import DATA_PLANES, MODES, OPTIMIZERS, WIRE_DTYPES


def add_command(subparsers, name: str, help: str, description: str, examples: str) -> argparse.ArgumentParser:
    """A subparser whose ``--help`` ends with worked examples."""
    return subparsers.add_parser(
        name, help=help, description=description,
        epilog="examples:\n" + textwrap.indent(textwrap.dedent(examples).strip("\n"), "  "),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def add_config_arg(p: argparse.ArgumentParser, default: str | None, what: str) -> None:
    p.add_argument("-c", "--config", default=default, metavar="FILE",
                   help=f"job file (TOML) or the name of a packaged example such as 'mnist'; {what}"
                        + (f" (default: {default})" if default else ""))


def add_set_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any job-file key, e.g. --set train.hidden=[256,256] --set lr_staleness=true "
                        "(TOML values; applied before the other flags; repeatable)")


def training_flags(keys=None) -> list[tuple]:
    """(flag, job-file key, type or choices, help) of the flags that override a job file, all or ``keys``.

    A function, so that only the commands that take them load the worker's settings
    (``psctl server`` never imports the worker package).
    """
    from psgrid.worker.config import DEVICES

    flags = _training_flags(DEVICES)
    return flags if keys is None else [f for f in flags if f[1] in keys]


def _training_flags(devices: tuple) -> list[tuple]:
    return [
    ("--mode", "mode", MODES, "consistency: sync (BSP), async (ASP) or ssp (stale-synchronous)"),
    ("--staleness", "staleness", int, "ssp bound s: a worker at clock c waits for the slowest to reach c-s"),
    ("--backup-workers", "backup_workers", int, "sync: close a round when all but this many workers pushed"),
    ("--optimizer", "optimizer", OPTIMIZERS, "server-side optimizer"),
    ("--lr", "lr", float, "learning rate"),
    ("--lease-s", "lease_s", float, "drop a worker that has not heart-beaten for this long"),
    ("--model", "model", str, "softmax, mlp or cnn"),
    ("--dataset", "dataset", str, "mnist5k, digits or synthetic"),
    ("--batch-size", "batch_size", int, "batch size per worker (0: the worker's whole shard)"),
    ("--steps", "steps", int, "steps per worker (ignored when epochs > 0)"),
    ("--epochs", "epochs", int, "passes over each worker's shard of the training set"),
    ("--eval-every", "eval_every", int, "evaluate test accuracy every this many steps on worker 0 (0: at the end)"),
    ("--device", "device", devices, "where workers compute"),
    ("--wire-dtype", "wire_dtype", tuple(WIRE_DTYPES), "dtype of gradients on the wire"),
    ("--data-plane", "data_plane", DATA_PLANES,
     "where Pull/Push payloads travel: tcp (the shards' TCP data plane, gRPC where a shard has none) or grpc"),
    ("--shared-memory", "shared_memory", bool, "use the shards' shared memory where they run on this host "
                                               "(default: on; --no-shared-memory moves payloads over the network plane)"),
    ("--seed", "seed", int, "random seed"),
    ("--stragglers", "stragglers", split_list,
     "slow workers down: K:F (worker K F times slower than its own compute) or K:exp:MEAN_MS "
     "(a random delay per step), comma-separated, e.g. 3:3,1:exp:20"),
    ]


def split_list(text: str) -> list[str]:
    """A comma-separated flag value as a list: ``"3:3,1:exp:20"`` -> ``["3:3", "1:exp:20"]``."""
    return [item.strip() for item in text.split(",") if item.strip()]


def add_training_flags(p: argparse.ArgumentParser, keys=None) -> None:
    g = p.add_argument_group("job-file overrides")
    for flag, key, kind, help in training_flags(keys):
        if isinstance(kind, tuple):
            g.add_argument(flag, dest=f"override_{key}", choices=kind, default=None, help=help)
        elif kind is bool:
            g.add_argument(flag, dest=f"override_{key}", action=argparse.BooleanOptionalAction, default=None,
                           help=help)
        else:
            g.add_argument(flag, dest=f"override_{key}", type=kind, default=None,
                           metavar=key.upper(), help=help)


def collect_overrides(args: argparse.Namespace) -> dict:
    """``--set`` assignments, then every ``override_KEY`` flag that was given."""
    from psgrid.cluster.config import parse_assignment

    overrides = dict(parse_assignment(text) for text in getattr(args, "set", []) or [])
    for name, value in vars(args).items():
        if name.startswith("override_") and value is not None:
            overrides[name[len("override_"):]] = value
    return overrides


def load_job_from_args(args: argparse.Namespace):
    from psgrid.cluster.config import apply_overrides, load_job

    return apply_overrides(load_job(args.config), collect_overrides(args))


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
