"""Stop ``psctl launch`` at random moments, N times, and check that every output folder stays resumable.

Usage: python scripts/probe_interrupts.py [--n 200] [--per-out 5] [--seed 0] [--slow-write S] [--keep]
(with psgrid installed: pip install -e .; not a test: about 3.5 s a launch on two cores, 200 in 12-15 min)

A tiny job (mnist, 2 shards, 2 workers, STEPS steps, each slowed by 10 ms on average, a checkpoint
every 10 steps) runs in folders OUT-1, OUT-2, ...: in each, a first ``psctl launch`` and then
``psctl launch --resume OUT`` until PER_OUT signals landed or one finished the job first, every one
sent SIGINT or SIGKILL (one of the two at random) at a moment drawn uniformly from 0 to --window
seconds after its start (only signals that landed count toward N): importing,
checking the checkpoints, archiving the earlier attempt, rewriting job.toml and the token, starting
the shards, training, checkpointing, writing the summary. After each, every process it left behind is
ended by its pid (this probe adopts them: it is a child subreaper) and the folder is checked as
``--resume`` checks it before anything starts: the job file it takes (cluster/run/resume.py's
``job_file_to_resume``) and the shards' checkpoints (``check_resumable``, ``align``). A first launch
stopped before it wrote its job (its folder has none and no checkpoint) counts as never begun and is
launched again. Last, each folder is resumed without a signal and must finish the job: exit 0, status
ok, every shard at the last step.

``--slow-write S`` makes every open of a job.toml for writing take S seconds more (as strace delaying
its openat would), so that signals land inside the rewrite far more often than by chance.

Prints the counts and exits 1 if any folder was not resumable or a last resume did not finish.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from psgrid.cluster.errors import UsageError
from psgrid.cluster.job.config import apply_overrides, load_job
from psgrid.cluster.run.resume import align, check_resumable, job_file_to_resume

ROOT = Path(__file__).resolve().parent.parent
STEPS = 200
PR_SET_CHILD_SUBREAPER = 36
ORPHAN_GRACE_S = 3.0  # how long a launcher's children get to end on their own once it is gone
EXIT_TIMEOUT_S = 60.0

SLOW_JOB_WRITE = """
import os, sys, time
real_open = os.open
def slow_open(path, flags, *args, **kwargs):
    fd = real_open(path, flags, *args, **kwargs)
    if "job.toml" in os.path.basename(os.fsdecode(path)) and flags & (os.O_WRONLY | os.O_RDWR):
        time.sleep(float(sys.argv[1]))
    return fd
os.open = slow_open
from psgrid.cluster.cli import main
sys.exit(main(sys.argv[2:]))
"""


def job_args(work: Path, n: int) -> list[str]:
    return [
        "--config",
        "mnist",
        "--steps",
        str(STEPS),
        "--eval-every",
        "0",
        "--no-progress",
        "--lease-s",
        "2",
        "--set",
        "checkpoint_every=10",
        "--set",
        f"checkpoint_dir={work / f'ckpt-{n}'}",
        "--set",
        'stragglers=["0:exp:10", "1:exp:10"]',
        "--out",
        str(work / f"OUT-{n}"),
    ]


def psctl(args: list[str], slow_write: float) -> list[str]:
    if slow_write:
        return [sys.executable, "-c", SLOW_JOB_WRITE, str(slow_write), "launch", *args]
    return [sys.executable, "-m", "psgrid.cluster.cli", "launch", *args]


def adopted() -> list[int]:
    """The processes whose parent is this probe (a dead launcher's children, adopted by the subreaper)."""
    me, found = os.getpid(), []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                stat = Path(entry.path, "stat").read_text()
            except OSError:
                continue
            state, ppid = stat.rpartition(")")[2].split()[:2]
            if int(ppid) == me and state != "Z":
                found.append(int(entry.name))
    return found


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_leftovers() -> int:
    """End what the stopped launcher left running, by pid; returns how many outlived it by ORPHAN_GRACE_S."""
    deadline = time.monotonic() + ORPHAN_GRACE_S
    while adopted() and time.monotonic() < deadline:
        reap()
        time.sleep(0.1)
    left = adopted()
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 10
    while adopted() and time.monotonic() < deadline:
        reap()
        time.sleep(0.05)
    reap()
    return len(left)


def interrupt(argv: list[str], log: Path, sig: int, delay: float) -> str:
    """Run ``argv``, send ``sig`` after ``delay`` s; returns how it ended ("stopped", "killed", "finished", ...)."""
    with open(log, "ab") as f:
        f.write(f"\n$ {' '.join(argv)}   # {signal.Signals(sig).name} after {delay:.3f} s\n".encode())
        f.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT)
    try:
        proc.wait(delay)
    except subprocess.TimeoutExpired:
        proc.send_signal(sig)
    try:
        code = proc.wait(EXIT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        code = proc.wait(10)
        return "hung after the signal"
    return {
        0: "finished before the signal",
        128 + signal.SIGINT: "stopped (SIGINT)",
        -signal.SIGINT: "stopped (SIGINT)",
        -signal.SIGKILL: "killed",
    }.get(code, f"exit {code}")


def resumable(out: Path, checkpoints: Path) -> tuple[str, str]:
    """("resumable" | "never begun" | "NOT RESUMABLE", why): what ``psctl launch --resume out`` finds before it starts.

    Never begun: stopped before it wrote its job, so with no checkpoint either (the folder may not exist).
    """
    if not (out / "job.toml").exists() and not any(checkpoints.rglob("*.npz")):
        try:
            job_file_to_resume(out)
        except UsageError as e:
            return "never begun", str(e)
    try:
        job = apply_overrides(load_job(str(job_file_to_resume(out)), redacted_ok=True), {"out": str(out)})
        align(job, check_resumable(job, out))
    except UsageError as e:
        return "NOT RESUMABLE", str(e)
    except Exception as e:  # noqa: BLE001 - the probe reports whatever a resume would have died of
        return "NOT RESUMABLE", f"{type(e).__name__}: {e}"
    return "resumable", ""


def finish(out: Path, log: Path) -> tuple[bool, str]:
    """Resume ``out`` without a signal (and without the slowed steps): it must complete the job."""
    argv = psctl(["--resume", str(out), "--no-progress", "--set", "stragglers=[]"], 0)
    with open(log, "ab") as f:
        f.write(f"\n$ {' '.join(argv)}   # to the end\n".encode())
        f.flush()
        code = subprocess.run(argv, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, timeout=300).returncode
    end_leftovers()
    if code != 0:
        return False, f"exit {code}"
    summary = json.loads((out / "summary.json").read_text())
    clocks = [s["min_clock"] for s in summary["shard_stats"]]
    return summary["status"] == "ok" and clocks == [STEPS] * len(clocks), f"status {summary['status']}, clocks {clocks}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200, help="interruptions in all (default 200)")
    parser.add_argument("--per-out", type=int, default=5, help="interruptions per output folder (default 5)")
    parser.add_argument("--window", type=float, default=6.0, help="signals land 0 to this many s after a start")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--slow-write", type=float, default=0.0, metavar="S", help="every open of a job.toml for writing takes S s more"
    )
    parser.add_argument("--keep", action="store_true", help="keep the folders (their logs say what happened)")
    args = parser.parse_args()

    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="probe-interrupts-"))
    ended = collections.Counter()  # (phase, signal, how the launcher ended) -> count
    outcomes = collections.Counter()  # resumable / never begun / NOT RESUMABLE
    problems: list[str] = []
    odd: list[str] = []  # launches that ended otherwise than by the signal or by finishing
    orphans = killed_mid_write = temp_files = empty_job_files = finished = 0
    folders = 0
    started = time.monotonic()
    try:
        done = 0
        while done < args.n:
            folders += 1
            out, log = work / f"OUT-{folders}", work / f"OUT-{folders}.log"
            begun, sent = False, 0
            while sent < args.per_out and done < args.n:
                phase = "resume" if begun else "first"
                argv = psctl(
                    ["--resume", str(out), "--no-progress"] if begun else [*job_args(work, folders), "--overwrite"],
                    args.slow_write,
                )
                sig = rng.choice((signal.SIGINT, signal.SIGKILL))
                how = interrupt(argv, log, sig, rng.uniform(0.0, args.window))
                landed = how != "finished before the signal"
                if how.startswith(("exit", "hung")):
                    odd.append(f"{out} {phase} launch: {how} (log {log})")
                done, sent = done + landed, sent + landed
                ended[(phase, signal.Signals(sig).name, how)] += 1
                orphans += end_leftovers()
                outcome, why = resumable(out, work / f"ckpt-{folders}")
                outcomes[outcome] += 1
                if outcome == "NOT RESUMABLE":
                    problems.append(f"{out} after a {phase} launch {how}: {why}")
                begun = begun or outcome == "resumable"
                killed_mid_write += sum(1 for p in out.glob(".*.tmp")) if out.is_dir() else 0
                empty_job_files += (out / "job.toml").is_file() and (out / "job.toml").stat().st_size == 0
                print(
                    f"{done}/{args.n} {out.name} {phase}: {signal.Signals(sig).name}, {how}; {outcome}",
                    file=sys.stderr,
                    flush=True,
                )
                if outcome == "NOT RESUMABLE" or not landed:
                    break  # (a job finished: the folder's last resume follows)
            if begun:
                ok, why = finish(out, log)
                finished += ok
                if not ok:
                    problems.append(f"{out}: the last resume did not finish the job ({why}; log {log})")
            temp_files += sum(1 for p in out.glob(".*.tmp")) if out.is_dir() else 0
    finally:
        end_leftovers()
        elapsed = time.monotonic() - started
        print(
            f"\n{done} interruptions ({sum(ended.values())} launches) in {folders} folders in {elapsed:.0f} s "
            f"(slow write: {args.slow_write:g} s, window {args.window:g} s, seed {args.seed})"
        )
        for (phase, sig, how), count in sorted(ended.items()):
            print(f"  {phase:6s} {sig:7s} {how:28s} {count}")
        print("after each: " + ", ".join(f"{k} {v}" for k, v in sorted(outcomes.items())))
        print(
            f"last resumes that finished the job: {finished}; processes that outlived their launcher by "
            f"{ORPHAN_GRACE_S:g} s (ended here): {orphans}; temporary files of a killed rewrite seen: "
            f"{killed_mid_write}, left at the end: {temp_files}; empty job.toml seen: {empty_job_files}"
        )
        for p in problems:
            print(f"PROBLEM: {p}")
        for o in odd:
            print(f"ended otherwise: {o}")
        if args.keep or problems or odd:
            print(f"folders and logs in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
