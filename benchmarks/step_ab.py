"""A small model's step in this tree against another revision, repeat by repeat: ``psctl bench ps --against``'s
runs, each printed with the paired ratio of its repeat, and the medians.

``psctl bench ps`` reports medians only; on a shared machine of two cores one repeat may land on a busy
moment, and the ratio of the two runs of one repeat (made back to back, who goes first alternating)
is what says whether a change cost time. Each line: the repeat, each code's updates/s, pull and push
medians, and this tree's updates/s over the other's.

    python benchmarks/step_ab.py --against 3928c08 --mode sync --planes shm,tcp --repeats 9
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path

from psgrid.cluster.bench.ps import Code, Shards, checkout, measure, remove_checkout
from psgrid.psserver import files


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def paired(code: Code, other: Code, *, plane: str, mode: str, params: int, workers: int, seconds: float, repeats: int):
    """Yield one dict per repeat: each code's figures and the ratio of this tree's updates/s to the other's."""
    codes = (code, other)
    with tempfile.TemporaryDirectory(prefix="psgrid-step-ab-") as tmp:
        for r in range(repeats):
            found = {}
            for c in codes if r % 2 == 0 else codes[::-1]:  # alternate who goes first
                folder = Path(tmp) / f"{c.label}-{plane}-{r}"
                files.make_dirs(folder)
                shards = Shards(c, 1, mode, folder)
                try:
                    found[c.label] = measure(
                        c,
                        shards,
                        params=params,
                        workers=workers,
                        plane=plane,
                        mode=mode,
                        seconds=seconds,
                        folder=folder,
                    )
                finally:
                    shards.close()
            a, b = found[code.label], found[other.label]
            yield {
                "plane": plane,
                "mode": mode,
                "repeat": r,
                "load": load(),
                "this": a["updates_per_s"],
                other.label: b["updates_per_s"],
                "ratio": a["updates_per_s"] / b["updates_per_s"],
                "this_pull_ms": 1e3 * a["pull_s"],
                "this_push_ms": 1e3 * a["push_s"],
                "other_pull_ms": 1e3 * b["pull_s"],
                "other_push_ms": 1e3 * b["push_s"],
            }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--this", help="a revision to measure instead of the working tree (others may be mid-edit)")
    parser.add_argument("--against", required=True)
    parser.add_argument("--mode", default="sync", choices=("sync", "async", "ssp"))
    parser.add_argument("--planes", default="shm,tcp")
    parser.add_argument("--params", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=2.0)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", action="store_true", help="one JSON object per repeat and per summary")
    args = parser.parse_args()
    other = checkout(args.against)
    this = Code("this", checkout(args.this).root if args.this else None)
    try:
        for plane in args.planes.split(","):
            rows = []
            for row in paired(
                this,
                other,
                plane=plane,
                mode=args.mode,
                params=args.params,
                workers=args.workers,
                seconds=args.seconds,
                repeats=args.repeats,
            ):
                rows.append(row)
                if args.json:
                    print(json.dumps(row), flush=True)
                else:
                    print(
                        f"{plane} {args.mode} r{row['repeat']}: this {row['this']:7.1f}/s  {other.label} "
                        f"{row[other.label]:7.1f}/s  ratio {row['ratio']:.3f}  (pull/push ms this "
                        f"{row['this_pull_ms']:.3f}/{row['this_push_ms']:.3f}, {other.label} "
                        f"{row['other_pull_ms']:.3f}/{row['other_push_ms']:.3f}; load {row['load']})",
                        flush=True,
                    )
            summary = {
                "plane": plane,
                "mode": args.mode,
                "summary": True,
                "this_median": statistics.median(r["this"] for r in rows),
                "other_median": statistics.median(r[other.label] for r in rows),
                "ratio_median": statistics.median(r["ratio"] for r in rows),
                "ratios": [round(r["ratio"], 3) for r in rows],
            }
            if args.json:
                print(json.dumps(summary), flush=True)
            else:
                print(
                    f"{plane} {args.mode} median: this {summary['this_median']:.1f}/s, {other.label} "
                    f"{summary['other_median']:.1f}/s, median ratio {summary['ratio_median']:.3f} "
                    f"(ratios {summary['ratios']})",
                    flush=True,
                )
    finally:
        remove_checkout(other)
        if this.root is not None:
            remove_checkout(this)


if __name__ == "__main__":
    main()
