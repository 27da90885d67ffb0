"""psctl certs: a CA and the shard and client certificates of a job's mutual TLS."""

from __future__ import annotations

import argparse

from psgrid.cluster.commands.common import add_command

HELP = "make a CA and the shard and client certificates for mutual TLS"

EXAMPLES = """
psctl certs pki                                    # shards on localhost / 127.0.0.1
psctl certs pki --host node1 --host node2 --host 10.0.0.7 --days 30
"""


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers,
        "certs",
        help=HELP,
        description="Write DIR/ca.pem, shard.pem and client.pem with their keys (mode 0600), and print the "
        "job-file lines that turn mutual TLS on: shards then accept only clients holding a "
        "certificate of this CA, on the gRPC calls and the TCP data plane alike.",
        examples=EXAMPLES,
    )
    p.add_argument("dir", metavar="DIR", help="folder to write the certificates and keys into")
    p.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="HOST",
        help="a name or address clients use to reach the shards (repeatable; default: localhost and 127.0.0.1)",
    )
    p.add_argument("--days", type=int, default=365, help="validity in days (default 365)")
    p.add_argument("--force", action="store_true", help="overwrite certificates already in DIR")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import sys

    from psgrid.cluster.errors import UsageError

    try:
        import cryptography  # noqa: F401  (an extra: shards and workers only read the PEM files)
    except ImportError:
        raise UsageError("making certificates needs the cryptography package: pip install 'psgrid[tls]'") from None
    from psgrid.cluster.job.pki import job_lines, make_certs

    paths = make_certs(args.dir, args.host or ["localhost", "127.0.0.1"], days=args.days, force=args.force)
    print(
        f"psctl certs: wrote a CA, a shard and a client certificate to {args.dir} (keys readable by you "
        f"alone); add these lines to the job file's [server] and [train] tables:",
        file=sys.stderr,
    )
    print(job_lines({k: v.resolve() for k, v in paths.items()}), end="")
    return 0
