"""Where a small model's sync step goes, in this tree and in another revision: cProfile of the shard (every
thread) and of each worker over the same number of steps, side by side.

One shard and W workers, each a process of its own, run STEPS pulls and pushes of a P-float model on one
plane; each process writes its profile, and the table lists the functions whose own time per step
differs most between the two trees (profiled times are inflated by the profiler, so read them against
each other, not as latencies). The wall time per step, unprofiled, is in ``psctl bench ps --against``.

    python benchmarks/sync_step_profile.py --against 3928c08 --plane shm --steps 400
"""

from __future__ import annotations

import argparse
import json
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from psgrid.cluster.bench.ps import Code, checkout, remove_checkout

# The shard, in-process, every thread profiled; the profiles are dumped when it stops (SIGTERM).
SERVER = r"""
import atexit, cProfile, signal, sys, threading
profiles = []
def start(*_):  # a new thread's first event: this thread's own profiler from now on
    sys.setprofile(None)
    p = cProfile.Profile(); profiles.append(p); p.enable()
threading.setprofile(start)
main_profile = cProfile.Profile(); profiles.append(main_profile); main_profile.enable()
def dump():
    import pstats
    for p in profiles:
        p.disable()
    stats = pstats.Stats(profiles[0])
    for p in profiles[1:]:
        try:
            stats.add(p)
        except TypeError:
            pass  # a thread's profile with nothing in it
    stats.dump_stats(sys.argv[1])
atexit.register(dump)
from psgrid.cluster.cli import main
sys.exit(main(sys.argv[2:]))
"""

WORKER = r"""
import cProfile, json, resource, sys, time
import numpy as np
from psgrid import Client, ModelSpec
cfg = json.loads(sys.argv[1])
spec = ModelSpec([("x", (cfg["params"],))])
options = {"data_plane": "tcp"}
if cfg["plane"] != "shm":
    options["shared_memory"] = False
init = (lambda: np.zeros(spec.size, np.float32)) if cfg["rank"] == 0 else None
with Client(cfg["addresses"], spec, worker_id=cfg["rank"], world=cfg["workers"], init=init, deadline_s=600,
            **options) as client:
    out = np.empty(spec.size, np.float32)
    grad = client.gradient_buffer()
    grad[:] = np.random.default_rng(cfg["rank"]).standard_normal(spec.size).astype(np.float32) * 1e-6
    for _ in range(20):
        client.pull(out).wait(); client.push(grad).wait()
    print(json.dumps({"ready": True}), flush=True)
    sys.stdin.readline()
    profile = cProfile.Profile() if cfg["profile"] else None
    before = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    if profile:
        profile.enable()
    for _ in range(cfg["steps"]):
        client.pull(out).wait()
        client.push(grad).wait()
    if profile:
        profile.disable()
        profile.dump_stats(cfg["profile"])
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    switches = after.ru_nvcsw + after.ru_nivcsw - before.ru_nvcsw - before.ru_nivcsw
    print(json.dumps({"wall_s": wall, "cpu_s": cpu, "switches": switches, "planes": client.data_planes}), flush=True)
"""


def process_cpu(pid: int) -> tuple[float, int]:
    """CPU seconds (user and system, every thread) and context switches of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    switches = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            for line in (task / "status").read_text().splitlines():
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    switches += int(line.split()[1])
        except OSError:
            pass  # a thread that ended meanwhile
    return cpu, switches


def traced(server: subprocess.Popen, workers: list[subprocess.Popen]) -> list[tuple[int, str]]:
    return [(server.pid, "shard")] + [(p.pid, f"worker-{r}") for r, p in enumerate(workers)]


def trace(pid: int, out: Path) -> subprocess.Popen:
    """``strace -c`` on every thread of ``pid`` until SIGINT: the system calls of the measured steps, counted."""
    tracer = subprocess.Popen(["strace", "-c", "-f", "-p", str(pid), "-o", str(out)], stderr=subprocess.DEVNULL)
    time.sleep(1.0)  # attached to every thread before the steps start
    return tracer


def syscalls(path: Path, steps: int) -> dict[str, float]:
    """``strace -c``'s table: system call -> calls per step."""
    found = {}
    for line in path.read_text().splitlines():
        fields = line.split()
        if len(fields) >= 5 and fields[0][0].isdigit() and fields[-1] != "total":
            found[fields[-1]] = int(fields[3]) / steps
    return found


def run_one(
    code: Code, plane: str, params: int, workers: int, steps: int, folder: Path, profile: bool, strace: bool = False
) -> dict:
    """One shard and ``workers`` workers of ``code`` making ``steps`` steps each: CPU and switches per step,
    and with ``profile`` the paths of the profiles (the shard's, every thread, and each worker's)."""
    folder.mkdir(parents=True)
    address = folder / "address"
    server_profile = folder / "server.prof"
    head = (
        [sys.executable, "-c", SERVER, str(server_profile)] if profile else [sys.executable, "-m", "psgrid.cluster.cli"]
    )
    argv = head + ["server", "--shard", "0", "--num-shards", "1", "--port", "0", "--address-file", str(address)]
    argv += ["--mode", "sync", "--lr", "1e-9", "--threads", "32", "--lease-s", "60", "--job-id", "profile"]
    with open(folder / "server.log", "w") as log:
        server = subprocess.Popen(argv, env=code.env(), stdout=subprocess.DEVNULL, stderr=log, cwd=folder)
    procs = []
    try:
        deadline = time.monotonic() + 60
        while not address.exists():
            if server.poll() is not None or time.monotonic() > deadline:
                log = (folder / "server.log").read_text()[-2000:]
                raise RuntimeError(f"the shard of {code.label} did not start:\n{log}")
            time.sleep(0.05)
        addresses = [address.read_text().splitlines()[0]]
        for rank in range(workers):
            cfg = {"params": params, "rank": rank, "workers": workers, "addresses": addresses, "plane": plane}
            cfg.update(steps=steps, profile=str(folder / f"worker-{rank}.prof") if profile else "")
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", WORKER, json.dumps(cfg)],
                    env=code.env(),
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    cwd=folder,
                )
            )
        for p in procs:
            json.loads(p.stdout.readline())  # warm
        tracers = [trace(pid, folder / f"strace-{name}.txt") for pid, name in traced(server, procs)] if strace else []
        shard_before = process_cpu(server.pid)
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        answers = [json.loads(p.stdout.readline()) for p in procs]
        shard_after = process_cpu(server.pid)
        for tracer in tracers:
            tracer.send_signal(signal.SIGINT)
            tracer.wait(timeout=30)
        for p in procs:
            p.wait(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=5)
        server.terminate()
        server.wait(timeout=30)
    return {
        "server": server_profile,
        "workers": [folder / f"worker-{r}.prof" for r in range(workers)],
        "wall_us": 1e6 * max(a["wall_s"] for a in answers) / steps,
        "shard_cpu_us": 1e6 * (shard_after[0] - shard_before[0]) / steps,
        "shard_switches": (shard_after[1] - shard_before[1]) / steps,
        "worker_cpu_us": 1e6 * sum(a["cpu_s"] for a in answers) / steps,
        "worker_switches": sum(a["switches"] for a in answers) / steps,
        "planes": answers[0]["planes"],
        "syscalls": {name: syscalls(folder / f"strace-{name}.txt", steps) for _, name in traced(server, procs)}
        if strace
        else {},
    }


def own_times(paths: list[Path], steps: int) -> dict[str, tuple[float, float]]:
    """function -> (own microseconds per step, calls per step), summed over ``paths``' profiles."""
    stats = pstats.Stats(*map(str, paths))
    found: dict[str, tuple[float, float]] = {}
    for (filename, _line, name), (_, calls, tottime, _, _) in stats.stats.items():
        key = f"{Path(filename).name}:{name}"
        t, c = found.get(key, (0.0, 0.0))
        found[key] = (t + 1e6 * tottime / steps, c + calls / steps)
    return found


# Calls whose own time is mostly waiting (for a peer, a lock, the selector): left out of the busy sums.
WAITS = (
    "acquire",
    "poll",
    "get' of '_queue",
    "select",
    "recv_into",
    "recvmsg",
    "wait",
    "sleep",
    "_serve",
    "compile",
    "marshal",
    "importlib",
    "_parser",
    "posix.stat",
)


PER_STEP = 0.2  # calls per step below which a function is taken for start-up's (imports, building classes)


def per_step(found: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """``found`` without the waits and without what the process did once, starting."""
    return {k: v for k, v in found.items() if v[1] >= PER_STEP and not any(w in k for w in WAITS)}


def busy(found: dict[str, tuple[float, float]]) -> tuple[float, float]:
    """Own microseconds and calls per step of the functions kept."""
    return sum(t for t, _ in found.values()), sum(c for _, c in found.values())


def table(title: str, this: dict, other: dict, top: int) -> None:
    print(f"\n{title}: own us/step (calls/step), largest differences first (waits and start-up left out)")
    this, other = per_step(this), per_step(other)
    keys = sorted(set(this) | set(other), key=lambda k: -abs(this.get(k, (0, 0))[0] - other.get(k, (0, 0))[0]))
    print(f"{'this':>16} {'against':>16} {'diff us':>8}  function")
    for k in keys[:top]:
        a, b = this.get(k, (0.0, 0.0)), other.get(k, (0.0, 0.0))
        print(f"{a[0]:8.1f} ({a[1]:5.2f}) {b[0]:8.1f} ({b[1]:5.2f}) {a[0] - b[0]:8.1f}  {k}")
    (ta, ca), (tb, cb) = busy(this), busy(other)
    print(f"{ta:8.1f} ({ca:5.1f}) {tb:8.1f} ({cb:5.1f}) {ta - tb:8.1f}  in all")


def syscall_table(this: dict, other: dict, label: str) -> None:
    for process in this:
        a, b = this[process], other.get(process, {})
        print(f"\n{process}: system calls per step, this / {label}")
        for name in sorted(set(a) | set(b), key=lambda n: -max(a.get(n, 0), b.get(n, 0))):
            print(f"  {a.get(name, 0):7.2f} {b.get(name, 0):7.2f}  {name}")


FIGURES = ("wall_us", "shard_cpu_us", "worker_cpu_us", "shard_switches", "worker_switches")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--this", help="a revision to measure instead of the working tree (others may be mid-edit)")
    parser.add_argument("--against", required=True, help="the revision to compare with")
    parser.add_argument("--plane", default="shm", choices=("shm", "tcp"))
    parser.add_argument("--params", type=int, default=100_000)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--repeats", type=int, default=1, help="runs of each tree, alternating (CPU figures only)")
    parser.add_argument("--profile", action="store_true", help="cProfile every process (one run of each tree)")
    parser.add_argument("--strace", action="store_true", help="count each process's system calls per step")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    other = checkout(args.against)
    this = Code("this", checkout(args.this).root if args.this else None)
    try:
        with tempfile.TemporaryDirectory(prefix="psgrid-sync-profile-") as tmp:
            runs: dict[str, list[dict]] = {this.label: [], other.label: []}
            for r in range(1 if args.profile else args.repeats):
                for code in (this, other) if r % 2 == 0 else (other, this):
                    folder = Path(tmp) / f"{code.label}-{r}"
                    run = run_one(
                        code, args.plane, args.params, args.workers, args.steps, folder, args.profile, args.strace
                    )
                    runs[code.label].append(run)
                    print(f"r{r} {code.label:>8}: " + "  ".join(f"{k} {run[k]:.1f}" for k in FIGURES), flush=True)
            print(
                f"{args.plane}, {args.workers} workers, {args.params} floats, medians per step (load {os.getloadavg()[0]:.2f}):"
            )
            for k in FIGURES:
                a = statistics.median(x[k] for x in runs[this.label])
                b = statistics.median(x[k] for x in runs[other.label])
                print(f"  {k:>16}: this {a:8.1f}  {other.label} {b:8.1f}  ratio {a / b:.3f}")
            if args.strace:
                syscall_table(runs[this.label][0]["syscalls"], runs[other.label][0]["syscalls"], other.label)
            if args.profile:
                a, b = runs[this.label][0], runs[other.label][0]
                total = args.steps * args.workers  # the shard serves every worker's steps
                table("shard", own_times([a["server"]], total), own_times([b["server"]], total), args.top)
                table("worker", own_times(a["workers"], total), own_times(b["workers"], total), args.top)
    finally:
        remove_checkout(other)
        if this.root is not None:
            remove_checkout(this)


if __name__ == "__main__":
    main()
