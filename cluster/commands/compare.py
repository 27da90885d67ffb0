"""psctl compare: reserved for experiments over several modes of one job (not written yet)."""

from __future__ import annotations

import argparse

from cluster.commands._common import add_command


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "compare", help="(not available yet) run one job in several modes and report",
        description="Reserved: run the same job in several consistency modes and write a report with plots.",
        examples="psctl compare --config examples/mnist.toml --modes sync,async,ssp",
    )
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from cluster.errors import UsageError

    raise UsageError("psctl compare is not available yet; run psctl launch once per --mode meanwhile")
