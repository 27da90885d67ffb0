"""psctl bench: reserved for performance figures (not written yet)."""

from __future__ import annotations

import argparse

from cluster.commands._common import add_command


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "bench", help="(not available yet) performance figures",
        description="Reserved: performance figures (push and pull throughput, step times).",
        examples="psctl bench --config examples/synthetic-20m.toml",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from cluster.errors import UsageError

    raise UsageError("psctl bench is not available yet; psctl launch reports samples/s in its summary meanwhile")
