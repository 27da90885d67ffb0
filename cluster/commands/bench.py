"""psctl bench: performance figures measured against a reference in the same run."""

from __future__ import annotations

import argparse

from psgrid.cluster.commands._common import add_command

HELP = "performance figures: transport vs raw TCP, apply vs memcpy"

TARGETS = ("transport", "apply")


def _size(text: str) -> int:
    units = {"k": 1024, "m": 1024 ** 2, "g": 1024 ** 3}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    factor = units.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in units else text
    value = int(float(number) * factor)
    if value < 4096 or value % 4:
        raise argparse.ArgumentTypeError(f"size must be at least 4 KiB and a multiple of 4 bytes, got {text!r}")
    return value


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = add_command(
        subparsers, "bench", help=HELP,
        description="Measure, in one run on loopback, pull+push of one shard's range against a raw TCP "
                    "echo of the same bytes, and the shard's optimizer apply against numpy.copyto of the "
                    "same array. Medians of repeated runs; ratios are what to compare across machines.",
        examples="""
            psctl bench transport                     # table: 4 KiB .. 256 MiB
            psctl bench transport --json > bench.jsonl
            psctl bench transport --sizes 1M,64M --repeat 9
            psctl bench apply --sizes 64M
        """,
    )
    p.add_argument("target", choices=TARGETS, help="transport (includes the apply rows) or apply only")
    p.add_argument("--json", action="store_true", help="one JSON object per line instead of a table")
    p.add_argument("--sizes", type=lambda s: [_size(x) for x in s.split(",")], default=None,
                   help="comma-separated sizes such as 4K,1M,64M (default 4K..256M)")
    p.add_argument("--repeat", type=int, default=5, help="timed repeats per size (median reported; default 5)")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    from psgrid.cluster.bench_transport import run as bench

    what = ("transport", "apply") if args.target == "transport" else ("apply",)
    bench(sizes=args.sizes, repeat=max(1, args.repeat), as_json=args.json, what=what)
    return 0
