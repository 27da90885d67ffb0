"""psctl status: what every shard of a running job is doing."""

from __future__ import annotations

import argparse

from psgrid.cluster.commands.common import add_command

HELP = "show every shard's clocks, members and counters"

EXAMPLES = """
psctl status                                                 # the newest job in ./runs
psctl status --addresses 127.0.0.1:41234,127.0.0.1:41235
psctl status --address-dir runs/mnist-20250101-120000        # the shards of a psctl launch job
psctl status --address-dir runs/mnist-20250101-120000 --json | jq '.[].mean_staleness'
psctl status --addresses node1:50051 --watch 2
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers,
        "status",
        help=HELP,
        description="Ask every shard for its stats and print them as a table that fits 80 columns (--wide: every "
        "counter; --json: the raw stats). For a finished job's folder (--address-dir DIR with "
        "DIR/summary.json), show its shards' final counters from the summary.",
        examples=EXAMPLES,
    )
    where = p.add_mutually_exclusive_group()  # neither: the newest job in ./runs
    where.add_argument("--addresses", metavar="HOST:PORT,...", help="the shards' addresses, in shard order")
    where.add_argument(
        "--address-dir",
        metavar="DIR",
        help="a psctl launch output folder (or its addr/ folder) holding shard-I address files",
    )
    p.add_argument("--json", action="store_true", help="print the raw stats as JSON, one object per shard")
    p.add_argument(
        "--wide",
        action="store_true",
        help="every counter (pushes, pulls, duplicates, evictions, rejected, waits, MB); the default "
        "table fits 80 columns",
    )
    p.add_argument("--config", metavar="FILE", help="take the bearer token and TLS files from this job's [train] table")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key of --config's job, e.g. --set train.tls_ca=pki/ca.pem (repeatable)",
    )
    p.add_argument(
        "--token",
        help="bearer token, if the shards require one (default: --config's, else the job's "
        "OUT/token with --address-dir, else $PSGRID_TOKEN; a command line is visible to "
        "other users)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="give up on an unreachable shard after this long (default 5)",
    )
    p.add_argument(
        "--watch", type=float, default=None, metavar="SECONDS", help="refresh every this many seconds until Ctrl-C"
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import os
    import sys
    import time

    from psgrid.cluster.commands.common import split_addresses
    from psgrid.cluster.errors import JobFailed, UsageError
    from psgrid.cluster.job.credentials import TOKEN_ENV, token_file_of
    from psgrid.cluster.run.preflight import probe_shards
    from psgrid.cluster.run.status import addresses_from_dir, finished_job, newest_run, status, summary_status
    from psgrid.psserver.exceptions import PSError
    from psgrid.psserver.security import job_token

    if not args.addresses and not args.address_dir:
        args.address_dir = str(newest_run())
        print(f"psctl status: the newest job here, {args.address_dir}", file=sys.stderr, flush=True)
    summary = finished_job(args.address_dir) if args.address_dir and not args.watch else None
    if summary is not None:  # the job is over and its shards are gone: its summary has their last counters
        print(summary_status(summary, as_json=args.json, wide=args.wide), flush=True)
        return 0
    addresses = split_addresses(args.addresses) if args.addresses else addresses_from_dir(args.address_dir)
    train = _job(args).train
    # The job's token: given (--token, --config's), else the one psctl launch keeps in OUT/token (mode 0600),
    # else $PSGRID_TOKEN: the folder's own job comes before whatever job this shell's variable is for.
    # (A job file without a token took the environment's when it was loaded: that one comes last.)
    own = train.token if train.token != os.environ.get(TOKEN_ENV) else None
    token = job_token(args.token or own, token_file=token_file_of(args.address_dir) if args.address_dir else None)
    security = {"token": token, "tls_ca": train.tls_ca, "tls_cert": train.tls_cert, "tls_key": train.tls_key}
    try:  # unreachable, or a TLS handshake that fails: say which shard and why
        probe_shards(addresses, train, args.timeout)
    except UsageError as e:
        raise JobFailed(f"cannot read stats from {','.join(addresses)}: {e}") from None
    while True:
        try:
            text = status(addresses, as_json=args.json, timeout_s=args.timeout, wide=args.wide, **security)
        except (PSError, ConnectionError, TimeoutError) as e:
            raise JobFailed(f"cannot read stats from {','.join(addresses)}: {e}") from None
        if args.watch:
            print("\033[2J\033[H" + time.strftime("%H:%M:%S"), flush=True)
        print(text, flush=True)
        if not args.watch:
            return 0
        time.sleep(args.watch)


def _job(args: argparse.Namespace):
    """The job whose [train] table says how to reach the shards (TLS files, token): --config, then --set."""
    from psgrid.cluster.commands.common import with_overrides
    from psgrid.cluster.job.config import JobConfig, load_job

    job = load_job(args.config, redacted_ok=True) if args.config else JobConfig()
    return with_overrides(job, args)
