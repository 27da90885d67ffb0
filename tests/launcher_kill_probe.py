"""Kill -9 a launcher a given time after its first child appears; say which of its processes outlive it.

Run as ``python -m tests.launcher_kill_probe DELAY_S OUT COMMAND [args...]`` (``psctl COMMAND --out OUT
args``, e.g. ``launch`` or ``compare``); prints one JSON line:
``{"children": N, "survivors": [...], "gone_after_s": T}``.

This process makes itself a child subreaper (Linux ``PR_SET_CHILD_SUBREAPER``), so every process
the launcher started, and theirs, is handed to it when the launcher dies: the survivors are found
by parent pid, never by name, and none escapes the count. Whatever is still alive after the wait is
killed here by pid before the line is printed, so the probe leaves nothing behind.
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
FIRST_CHILD_TIMEOUT_S = 60.0
POLL_S = 0.002


def children_of(pid: int) -> set[int]:
    found: set[int] = set()
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            found |= {int(p) for p in Path(f"/proc/{pid}/task/{task}/children").read_text().split()}
        except OSError:
            continue
    return found


def living(pids: set[int]) -> set[int]:
    """Those of ``pids`` not yet exited (a zombie waiting to be reaped has)."""
    found = set()
    for pid in pids:
        try:
            if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
                found.add(pid)
        except OSError:
            continue
    return found


def reap() -> None:
    """Collect every exited child (the orphans handed to us end as our zombies)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_all(deadline: float) -> None:
    """SIGKILL every process handed to us (and theirs, handed on in turn) by pid, until none is left."""
    while True:
        reap()
        left = children_of(os.getpid())
        if not left or time.monotonic() > deadline:
            return
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.05)


def main(argv: list[str]) -> int:
    delay, out, command, args = float(argv[0]), argv[1], argv[2], argv[3:]
    wait_s = float(os.environ.get("PROBE_WAIT_S", "5"))
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(json.dumps({"error": f"prctl: errno {ctypes.get_errno()}"}))
        return 2
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSCTL_")}  # we are nobody's child here
    with open(Path(out).parent / "launch.log", "wb") as log:
        launcher = subprocess.Popen(
            [sys.executable, "-m", "psgrid.cluster.cli", command, "--out", out, *args],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + FIRST_CHILD_TIMEOUT_S
    while not children_of(launcher.pid) and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(POLL_S)
    time.sleep(delay)
    seen = children_of(launcher.pid)
    os.kill(launcher.pid, signal.SIGKILL)
    launcher.wait()
    killed = time.monotonic()
    survivors = living(children_of(os.getpid()))
    while survivors and time.monotonic() - killed < wait_s:
        time.sleep(0.05)
        reap()
        survivors = living(children_of(os.getpid()))
    gone_after = time.monotonic() - killed
    described = []
    for pid in sorted(survivors):
        try:
            described.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[-120:])
        except OSError:
            described.append(str(pid))
    end_all(killed + wait_s + 10)
    print(json.dumps({"children": len(seen), "survivors": described, "gone_after_s": round(gone_after, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
