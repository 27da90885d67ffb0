"""What each failure of docs/reliability.md costs a running job, measured through ``psctl launch``.

Usage: python benchmarks/failure_costs.py [--repeats N] [--out DIR]

Each scenario runs the MNIST job (sync, 2 shards, 3 workers, loopback) and injects one
failure by pid: a worker killed, a worker hung with a live heartbeat, a worker killed
before it joins, a shard killed under --restart-failed, a Ctrl-C then --resume. The cost
is read from the survivors' own step records: the longest gap between two steps of
worker 0 (the stall), next to the same job's longest gap without a failure, plus what the
summary counts (lost updates, restored version). Prints one markdown table, medians of
``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = [
    "--config",
    "mnist",
    "--mode",
    "sync",
    "--shards",
    "2",
    "--workers",
    "3",
    "--steps",
    "600",
    "--eval-every",
    "0",
    "--no-progress",
    "--set",
    'stragglers=["0:exp:5", "1:exp:5", "2:exp:5"]',
]


def launch(out: Path, *args: str) -> subprocess.Popen:
    log = open(out.parent / f"{out.name}.log", "ab")
    return subprocess.Popen(
        [sys.executable, "-m", "psgrid.cluster.cli", "launch", *args, "--out", str(out)],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )


def events(out: Path, rank: int, kind: str = "step") -> list[dict]:
    path = out / "metrics" / f"worker-{rank}.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]
    return [e for e in lines if e.get("event") == kind]


def pids(out: Path, key: str) -> list[int]:
    path = out / "metrics" / "coordinator.jsonl"
    if not path.exists():
        return []
    for line in path.read_text().splitlines():
        e = json.loads(line)
        if e["event"] == {"shards": "shards_ready", "workers": "workers_started"}[key]:
            return e["pids"]
    return []


def wait_until(predicate, timeout: float = 120, poll: float = 0.02):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise TimeoutError("scenario did not reach its trigger")
        time.sleep(poll)
    return value


def longest_gap(out: Path, rank: int = 0) -> float:
    times = [e["time"] for e in events(out, rank)]
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def finish(proc: subprocess.Popen, timeout: float = 300) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        raise


def run(tmp: Path, name: str, *extra: str, inject=None) -> dict:
    out = tmp / name
    proc = launch(out, *JOB, *extra)
    started = time.time()
    try:
        if inject is not None:
            inject(out)
        code = finish(proc)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    summary = json.loads((out / "summary.json").read_text())
    first = events(out, 0, "start")
    return {
        "code": code,
        "stall_s": longest_gap(out),
        "summary": summary,
        "to_first_step_s": first[0]["time"] - started if first else None,
    }


def kill_worker(out: Path) -> None:
    wait_until(lambda: len(events(out, 2)) >= 50)
    os.kill(pids(out, "workers")[2], signal.SIGKILL)


def kill_before_join(out: Path) -> None:
    os.kill(wait_until(lambda: pids(out, "workers"), 60, poll=0.005)[2], signal.SIGKILL)


def kill_shard(out: Path) -> None:
    wait_until(lambda: len(events(out, 0)) >= 100)
    os.kill(pids(out, "shards")[1], signal.SIGKILL)


def scenarios(tmp: Path) -> list[tuple[str, str, dict]]:
    ckpt = ["--set", f"checkpoint_dir={tmp / 'ckpt'}", "--set", "checkpoint_every=20"]
    rows = []
    base = run(tmp, "baseline", "--lease-s", "3")
    rows.append(("no failure", "lease_s = 3", base))
    rows.append(
        ("worker killed (kill -9)", "lease_s = 3", run(tmp, "worker-kill", "--lease-s", "3", inject=kill_worker))
    )
    rows.append(
        (
            "worker hung, heartbeat alive",
            "progress_timeout_s = 5",
            run(
                tmp,
                "worker-hang",
                "--lease-s",
                "3",
                "--set",
                "progress_timeout_s=5",
                "--set",
                'stragglers=["0:exp:5", "1:exp:5", "2:1000000"]',
            ),
        )
    )
    rows.append(
        (
            "worker killed before it joins",
            "join_timeout_s = 120",
            run(tmp, "worker-early", "--lease-s", "3", inject=kill_before_join),
        )
    )
    rows.append(
        (
            "shard killed (kill -9), restarted",
            "checkpoint_every = 20",
            run(tmp, "shard-kill", "--lease-s", "3", "--restart-failed", *ckpt, inject=kill_shard),
        )
    )
    return rows


def median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="keep the runs here (default: a temporary folder)")
    args = p.parse_args()
    results: dict[str, list] = {}
    for r in range(args.repeats):
        tmp = Path(args.out or tempfile.mkdtemp(prefix="psgrid-failures-")) / f"repeat-{r}"
        tmp.mkdir(parents=True)
        for name, setting, res in scenarios(tmp):
            results.setdefault((name, setting), []).append(res)
            print(f"repeat {r}: {name}: exit {res['code']}, stall {res['stall_s']:.2f} s", file=sys.stderr)
    print(f"load average before the table: {os.getloadavg()[0]:.2f}; {args.repeats} repeats, medians\n")
    print(
        "| failure | setting | exit | longest stall of worker 0 (s) | launch to worker 0's first step (s) "
        "| lost updates | test accuracy |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for (name, setting), runs in results.items():
        codes = sorted({r["code"] for r in runs})
        lost = median([r["summary"].get("lost_updates") for r in runs])
        acc = median([r["summary"].get("test_accuracy") for r in runs])
        first = median([r["to_first_step_s"] for r in runs])
        print(
            f"| {name} | {setting} | {','.join(map(str, codes))} | {median([r['stall_s'] for r in runs]):.2f} "
            f"| {first:.2f} | {lost} | {acc:.3f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
