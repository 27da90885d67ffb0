"""The built-in trainer's job through whichever psgrid tree is installed: samples/s over its steady steps.

Run in turn under two trees (benchmarks/gpu_tree_ab.sh installs each before its run) to ask whether
a change, or the months between two commits, made the built-in trainer slower: the same job, the
same estimator (written out here, since an older tree may lack cluster/bench/steady.py), one line
of JSON per run. ``--reference`` runs the model with no servers instead (this tree's
``cluster/bench/train.py`` ``no_servers``), for the ratio the issue speaks of.

    python benchmarks/tree_ab_train.py --mode async        # {"tree": ..., "samples_per_s": ...}
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path


def steady_rate(metrics_files: list[Path], skip: int) -> float:
    """Each worker's samples over its steps after the first ``skip``, per second, summed (cluster/bench/steady.py)."""
    total = 0.0
    for path in metrics_files:
        steps = [r for r in map(json.loads, path.read_text().splitlines()) if r.get("event") == "step"][skip:]
        total += sum(r["samples"] for r in steps) / (steps[-1]["time"] - steps[0]["started"])
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="async")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--reference", action="store_true", help="the model with no servers")
    parser.add_argument("--tree", default="this", help="the name the JSON gives the installed tree")
    parser.add_argument("--device", default="gpu")
    args = parser.parse_args()
    from psgrid.cluster.bench.train import base_job
    from psgrid.cluster.job.config import apply_overrides

    job = base_job("mlp", args.device, [4096, 4096], 512, args.steps, args.device)
    tree = args.tree
    if args.reference:
        from psgrid.cluster.bench.train import no_servers

        print(json.dumps({"tree": tree, "reference": True, "samples_per_s": no_servers(job.train)["samples_per_s"]}))
        return
    from psgrid.cluster.run.launch import Launcher, prepare_out

    with tempfile.TemporaryDirectory(prefix="psgrid-tree-ab-") as tmp:
        job = apply_overrides(job, {"mode": args.mode, "workers": 1, "shards": 1, "out": str(Path(tmp) / "run")})
        summary = Launcher(job, prepare_out(job), progress=False, quiet=True).run()
        rate = steady_rate(sorted((Path(job.out) / "metrics").glob("worker-*.jsonl")), args.steps // 10)
    print(json.dumps({"tree": tree, "mode": args.mode, "samples_per_s": rate, "status": summary["status"]}))


if __name__ == "__main__":
    main()
