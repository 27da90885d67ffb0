"""psctl server: one shard of the parameter server."""

from __future__ import annotations

import argparse

from psgrid.cluster.commands.common import add_command, add_config_arg
from psgrid.psserver.config import ServerConfig
from psgrid.psserver.settings import flag_specs

HELP = "run one parameter-server shard"

# (flag, ServerConfig field, type or choices, help): one flag per key of the shard's schema (psserver/config.py).
SERVER_FLAGS = flag_specs(ServerConfig)

EXAMPLES = """
psctl server --port 0 --address-file /tmp/shard-0 --mode ssp --staleness 2
psctl server --config examples/mnist.toml --shard 1 --num-shards 2 --host 0.0.0.0 --port 50051 --job-id j1
psctl server --mode sync --metrics-port 9100 --checkpoint-dir ckpt --checkpoint-every-s 30
psctl server --port 50051 --data-plane grpc       # no TCP data plane: gRPC only
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers,
        "server",
        help=HELP,
        description="Run shard I of S of the parameter server until SIGTERM, SIGINT or a Shutdown RPC. "
        "Settings come from the [server] table of --config, then from these flags.",
        examples=EXAMPLES,
    )
    add_config_arg(p, None, "its [server] table is the base that --set and the flags override")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a [server] key of the job file, e.g. --set lr=0.1 --set server.momentum=0.9 "
        "(TOML values; applied before the other flags; repeatable)",
    )
    p.add_argument(
        "--address-file",
        metavar="FILE",
        help="write the bound host:port (first line) and the job id (second line, 'job ID') here, "
        "atomically, once listening",
    )
    g = p.add_argument_group("shard settings (ServerConfig fields)")
    for flag, name, kind, help in SERVER_FLAGS:
        if kind is bool:
            g.add_argument(flag, dest=f"cfg_{name}", action=argparse.BooleanOptionalAction, default=None, help=help)
        elif isinstance(kind, tuple):
            g.add_argument(flag, dest=f"cfg_{name}", choices=kind, default=None, help=help)
        else:
            g.add_argument(flag, dest=f"cfg_{name}", type=kind, default=None, metavar=name.upper(), help=help)
    p.set_defaults(func=run)
    return p


def server_config_from_args(args: argparse.Namespace):
    """The shard's settings: the job file's [server] table, its mode's table, then ``--set``, then the flags.

    Errors name what gave the value. The mode's table ([async] for async) is the one of the mode the
    shard ends up in, flags included; a key that ``--set`` or a flag gives keeps their value.
    """
    import dataclasses

    from psgrid.cluster.errors import ConfigError
    from psgrid.cluster.job.config import file_choices, load_shard_settings, parse_assignment, route
    from psgrid.cluster.job.rate_schedule import changes_rate, updates_in_file
    from psgrid.psserver.config import ServerConfig
    from psgrid.psserver.security import job_token

    if args.config:
        base, shards = load_shard_settings(args.config)
        base = dataclasses.replace(base, num_shards=shards)
    else:
        base = ServerConfig()
    given = set()
    for text in args.set:
        key, value = parse_assignment(text)
        places = [name for section, name in route(key, ("job", "server")) if section == "server"]
        if not places:
            raise ConfigError(f"--set {text}: psctl server takes [server] keys only (the shards' settings)")
        base = _replaced(base, {places[0]: value}, f"--set {text}")
        given.add(places[0])
    flags = {
        a.dest[len("cfg_") :]: max(a.option_strings, key=len) for a in args.parser._actions if a.dest.startswith("cfg_")
    }
    changes = {k[len("cfg_") :]: v for k, v in vars(args).items() if k.startswith("cfg_") and v is not None}
    try:
        config = dataclasses.replace(base, **changes)
    except ValueError as e:
        # Name the flag without which the settings would be valid (else all of them).
        blamed = [k for k in changes if _valid(base, {o: v for o, v in changes.items() if o != k})] or list(changes)
        raise ConfigError(f"{' '.join(f'{flags[k]} {changes[k]}' for k in blamed)}: {e}") from None
    if args.config:
        table = file_choices(args.config)[1].get(config.mode, {})
        table = {k: v for k, v in table.items() if k not in given | set(changes)}
        config = _replaced(config, table, f"{args.config}: [{config.mode}]")
    check_files(config, ("tls_cert", "tls_key", "tls_ca"))
    if changes_rate(config):
        if not config.lr_updates and args.config:  # the job file says how many updates its shards apply
            config = dataclasses.replace(config, lr_updates=updates_in_file(args.config, config))
        if not config.lr_updates:
            raise ConfigError(
                f"lr_schedule {config.lr_schedule} (lr_warmup {config.lr_warmup:g}) needs --lr-updates, the "
                "updates this shard will apply (psctl launch and mpi derive it from the job's steps)"
            )
    # With no token given (flag, --set or job file), the environment's: a shard started by hand with
    # PSGRID_TOKEN set must not take calls without it.
    return dataclasses.replace(config, token=job_token(config.token))


def _valid(config, changes: dict) -> bool:
    import dataclasses

    try:
        dataclasses.replace(config, **changes)
    except ValueError:
        return False
    return True


def _replaced(config, changes: dict, given: str):
    import dataclasses

    from psgrid.cluster.errors import ConfigError

    try:
        return dataclasses.replace(config, **changes)
    except ValueError as e:
        raise ConfigError(f"{given}: {e}") from None


def check_files(config, names) -> None:
    """Name a missing certificate or key here, before a library fails on it without the path."""
    import os

    from psgrid.cluster.errors import ConfigError

    for name in names:
        path = getattr(config, name)
        if path and not os.path.isfile(path):
            raise ConfigError(f"{name} {path!r}: no such file")


def run(args: argparse.Namespace) -> int:
    from psgrid.cluster.run.preflight import check_port_free
    from psgrid.cluster.run.procs import limit_blas_threads
    from psgrid.psserver.lifeline import watch

    config = server_config_from_args(args)
    check_port_free(config.host, config.port, "--port")
    if config.metrics_port:
        check_port_free(config.host, config.metrics_port, "--metrics-port")
    watch()  # a second call when psctl's bootstrap watches already: it covers a start through `psctl`
    limit_blas_threads(1)  # as psctl launch starts its shards: a shard's arithmetic is elementwise
    from psgrid.psserver.server import run_server

    return run_server(config, address_file=args.address_file)
