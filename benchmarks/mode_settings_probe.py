"""Which settings let a job train in a mode: a grid of `psctl launch` runs, several at a time, one table.

`psctl compare --tune` picks settings one grid point at a time; on a lent GPU with minutes to spend,
this runs the grid's jobs N at a time instead (each job's workers and shards are its own, so two
jobs on one GPU only slow each other: the accuracy after a fixed number of steps does not depend on
it, and a job's staleness comes from its own workers). For each setting, mode and worker count it
prints the final test accuracy of every seed and their median, and writes every run's figures to
OUT/probe.csv::

    python3 benchmarks/mode_settings_probe.py --config examples/synthetic-20m.toml --modes async,ssp:2 \\
        --workers 2,4,8 --seeds 0,1 --setting plain: --setting mom0:momentum=0,lr=0.1 --parallel 2 --out OUT

A setting is NAME:KEY=VALUE,KEY=VALUE (TOML values, as `--set` takes them; NAME: alone is the job's own).
NAME@W:... runs only at W workers, so a setting that depends on the worker count is one row of the
table (--setting b1@2:beta1=0.4 --setting b1@8:beta1=0.025).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def parse_setting(text: str) -> tuple[str, int | None, list[str]]:
    """NAME[@W]:KEY=VALUE,... as (name, the one worker count it runs at or None, the --set values)."""
    label, _, pairs = text.partition(":")
    name, _, only = label.partition("@")
    # a comma starts the next KEY=VALUE only where one follows: train.hidden=[512,512] stays whole
    return name, int(only) if only else None, [p for p in re.split(r",(?=[A-Za-z_.]+=)", pairs) if p.strip()]


def launch(config: str, mode: str, workers: int, seed: int, sets: list[str], out: Path, extra: list[str]) -> dict:
    mode_name, _, staleness = mode.partition(":")
    cmd = [sys.executable, "-m", "psgrid.cluster.cli", "launch", "--config", config, "--mode", mode_name]
    cmd += ["--staleness", staleness] if staleness else []
    cmd += ["--workers", str(workers), "--seed", str(seed), "--out", str(out), "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    cmd += extra
    started = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    wall = time.monotonic() - started
    row = {"mode": mode, "workers": workers, "seed": seed, "rc": done.returncode, "wall_s": round(wall, 1)}
    try:
        s = json.loads((out / "summary.json").read_text())
    except (OSError, ValueError):
        row["status"] = "no summary: " + (done.stderr.strip().splitlines() or ["?"])[-1]
        return row
    stats = s.get("shard_stats") or []
    staleness = [st["mean_staleness"] for st in stats if st.get("mean_staleness") is not None]
    row.update(
        status=s.get("status"),
        test_accuracy=s.get("test_accuracy"),
        test_loss=s.get("test_loss"),
        samples_per_s=round(s.get("samples_per_s") or 0),
        mean_staleness=round(statistics.mean(staleness), 2) if staleness else None,
        momentum=stats[0].get("momentum") if stats else None,
        curve=eval_curve(out / "metrics.jsonl"),
        **task_of(s),
        **failures_of(s),
    )
    return row


def task_of(summary: dict) -> dict:
    """A synthetic run's task and test-set size, as its job ran them: a row says what its accuracy is of."""
    train = (summary.get("config") or {}).get("train") or {}
    if train.get("dataset") != "synthetic":
        return {}
    return {"synthetic_seed": train.get("synthetic_seed"), "test_samples": train.get("synthetic_test_samples")}


def failures_of(summary: dict) -> dict:
    """What went wrong in a run, for its row: the job's message, the workers it lost, and the first failure's last line.

    A worker's failure is tolerated (the job goes on with the others), so a run can end with an accuracy
    and fewer workers than it was given: such a run is not the setting's, and the table says so. A shard
    restarted from its checkpoint is named in ``failure`` but loses the run no worker.
    """
    failures = [f for f in summary.get("failures") or [] if isinstance(f, dict)]
    row = {"lost": sum(1 for f in failures if f.get("role") == "worker")}
    if summary.get("status") != "ok" and summary.get("message"):
        row["message"] = summary["message"]
    if failures:
        first = failures[0]
        tail = [line for line in (first.get("tail") or "").splitlines() if line.strip()]
        row["failure"] = (
            f"{first.get('name')} ({first.get('role')}) exit {first.get('exit_code')}: "
            f"{tail[-1] if tail else '(no output)'}"
        )
    return row


def eval_curve(metrics: Path) -> str:
    """Rank 0's test accuracy at each evaluation, in order ("step:accuracy ..."): how a run got where it ended."""
    points = []
    try:
        for line in metrics.read_text().splitlines():
            record = json.loads(line)
            if record.get("event") == "eval" and record.get("rank", 0) == 0:
                points.append(f"{record['step']}:{record['test_accuracy']:.3f}")
    except (OSError, ValueError, KeyError):
        pass
    return " ".join(points)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--modes", default="async")
    p.add_argument("--workers", default="2,4,8")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--setting", action="append", required=True, help="NAME:KEY=VALUE,... (repeatable)")
    p.add_argument("--parallel", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("extra", nargs="*", help="more psctl launch arguments, after --")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    settings = [parse_setting(s) for s in a.setting]
    # seeds outermost and settings innermost: the settings of one point run side by side, under the same
    # load from the jobs around them, so a difference between settings is not one of the machine's moments
    grid = [
        (name, sets, mode, int(w), int(seed))
        for seed in a.seeds.split(",")
        for mode in a.modes.split(",")
        for w in a.workers.split(",")
        for name, only, sets in settings
        if only in (None, int(w))
    ]

    def one(point):
        name, sets, mode, w, seed = point
        folder = out / "runs" / f"{name}-{mode.replace(':', '')}-w{w}-s{seed}"
        row = launch(a.config, mode, w, seed, sets, folder, a.extra)
        row = {"setting": name, "sets": " ".join(sets), **row}
        print(json.dumps(row), flush=True)
        return row

    with ThreadPoolExecutor(a.parallel) as pool:
        rows = list(pool.map(one, grid))
    fields = sorted({k for r in rows for k in r}, key=lambda k: list(rows[0]).index(k) if k in rows[0] else 99)
    with open(out / "probe.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fields)
        w.writeheader()
        w.writerows(rows)
    print(f"\n{'setting':<12} {'mode':<6} {'W':>2}  {'median':>6}  each seed's final test accuracy (staleness)")
    for name in dict.fromkeys(name for name, _, _ in settings):
        for mode in a.modes.split(","):
            for w in a.workers.split(","):
                these = [r for r in rows if r["setting"] == name and r["mode"] == mode and r["workers"] == int(w)]
                if not these:
                    continue  # a setting of another worker count
                whole = [r for r in these if r.get("test_accuracy") is not None and not r.get("lost")]
                accs = [r["test_accuracy"] for r in whole]
                each = " ".join(describe(r) for r in these)
                med = f"{statistics.median(accs):.3f}" if accs else "-"
                print(f"{name:<12} {mode:<6} {w:>2}  {med:>6}  {each}")
    broken = [r for r in rows if r.get("lost") or r.get("failure") or r.get("test_accuracy") is None]
    if broken:
        print("\nfailures (a run that lost a worker, or has no accuracy, is left out of the medians):")
        for r in broken:
            print(
                f"  {r['setting']} {r['mode']} W={r['workers']} seed {r['seed']}: {r.get('failure') or r.get('message') or r.get('status')}"
            )


def describe(row: dict) -> str:
    """One run in the table: accuracy (staleness), with the processes it lost; or its status."""
    if row.get("test_accuracy") is None:
        return str(row.get("status"))
    lost = f", lost {row['lost']} worker{'s' if row['lost'] != 1 else ''}" if row.get("lost") else ""
    return f"{row['test_accuracy']:.3f}({row.get('mean_staleness')}{lost})"


if __name__ == "__main__":
    main()
