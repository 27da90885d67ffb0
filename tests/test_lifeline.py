"""A child's lifeline to its launcher (psserver/lifeline.py): no child outlives it, none is stopped while it lives.

Each "launcher" here is a small process that starts one child through cluster/run/procs.py and
dies at a chosen moment; the child is found by the pid its launcher printed and ended by it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from psgrid.cluster.run.procs import Child, child_env, stop_children
from psgrid.psserver import lifeline
from tests.support import ROOT, alive, wait_for

# The child: sleeps SLEEP_S before its first line of psgrid (a slow start), watches, then says so.
CHILD = (
    "import sys, time\n"
    "time.sleep(float(sys.argv[1]))\n"
    "from psgrid.psserver.lifeline import watch\n"
    "print('watching' if watch() else 'not watching', flush=True)\n"
    "time.sleep(60)\n"
)

# The launcher: starts the child with a launcher's environment, prints its pid, dies by SIGKILL.
LAUNCHER = (
    "import os, signal, sys, time\n"
    "from psgrid.cluster.run.procs import Child, child_env\n"
    "child = Child('child', [sys.executable, '-c', sys.argv[1], sys.argv[2]], sys.argv[3], child_env())\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(float(sys.argv[4]))\n"
    "os.kill(os.getpid(), signal.SIGKILL)\n"
)


def launch_and_die(tmp_path, child_sleep_s: float, launcher_lives_s: float) -> tuple[int, str]:
    """Run LAUNCHER; returns its child's pid and the child's log once the child is gone (or 10 s passed)."""
    log = tmp_path / "child.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PSCTL_")}
    launcher = subprocess.run(
        [sys.executable, "-c", LAUNCHER, CHILD, str(child_sleep_s), str(log), str(launcher_lives_s)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    pid = int(launcher.stdout.split()[0])
    try:
        wait_for(lambda: not alive(pid), 10, "the child to stop", poll=0.05)
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    return pid, log.read_text()


@pytest.mark.slow
def test_a_child_whose_launcher_died_before_its_first_line_never_starts(tmp_path):
    _, log = launch_and_die(tmp_path, child_sleep_s=1.0, launcher_lives_s=0.0)
    assert "watching" not in log
    assert "that started this process is gone: stopping" in log


@pytest.mark.slow
def test_a_running_child_stops_when_its_launcher_is_killed(tmp_path):
    t = time.monotonic()
    _, log = launch_and_die(tmp_path, child_sleep_s=0.0, launcher_lives_s=2.0)
    assert log.splitlines()[0] == "watching"
    assert "is gone: stopping" in log
    assert time.monotonic() - t < 8  # seen at once, not after a poll of the parent pid


@pytest.mark.slow
def test_a_child_started_from_a_thread_that_ended_lives_while_its_launcher_does(tmp_path):
    # PR_SET_PDEATHSIG would kill it here: it fires when the thread that forked the child ends.
    started: list[Child] = []
    spawner = threading.Thread(
        target=lambda: started.append(
            Child("child", [sys.executable, "-c", CHILD, "0"], tmp_path / "child.log", child_env())
        )
    )
    spawner.start()
    spawner.join(30)
    child = started[0]
    try:
        wait_for(lambda: "watching" in (tmp_path / "child.log").read_text(), 30, "the child to watch")
        time.sleep(1.5)
        assert child.poll() is None, (tmp_path / "child.log").read_text()
        assert (tmp_path / "child.log").read_text().splitlines() == ["watching"]
    finally:
        stop_children([child], 5.0)


def test_only_a_child_of_this_process_gets_its_lifeline():
    env = child_env()
    given, fds = lifeline.hand_to(env)
    assert len(fds) == 1 and given[lifeline.LIFELINE_ENV].startswith(f"{fds[0]}:")
    assert lifeline.hand_to({**env, lifeline.PARENT_ENV: "1"}) == ({**env, lifeline.PARENT_ENV: "1"}, ())
    assert lifeline.hand_to({}) == ({}, ())


def test_a_copied_variable_names_no_lifeline(monkeypatch):
    read, write = os.pipe()
    other, other_write = os.pipe()
    try:
        info = os.fstat(read)
        monkeypatch.setenv(lifeline.LIFELINE_ENV, f"{read}:{info.st_dev}:{info.st_ino}")
        assert lifeline.inherited() == read
        assert not lifeline.cut(read)
        os.close(write)
        write = None
        assert lifeline.cut(read)  # the far end closed: the launcher is gone
        monkeypatch.setenv(lifeline.LIFELINE_ENV, f"{other}:{info.st_dev}:{info.st_ino}")  # another pipe there
        assert lifeline.inherited() is None
        monkeypatch.setenv(lifeline.LIFELINE_ENV, "9999:1:2")  # no such descriptor here
        assert lifeline.inherited() is None
        monkeypatch.setenv(lifeline.LIFELINE_ENV, "garbage")
        assert lifeline.inherited() is None
    finally:
        for fd in (read, write, other, other_write):
            if fd is not None:
                os.close(fd)


def test_a_process_no_launcher_started_watches_nothing(monkeypatch):
    monkeypatch.setenv(lifeline.PARENT_ENV, str(os.getppid() + 1 if os.getppid() != 1 else 2))
    monkeypatch.delenv(lifeline.LIFELINE_ENV, raising=False)
    assert lifeline.watch() is False
    monkeypatch.delenv(lifeline.PARENT_ENV)
    assert lifeline.watch() is False
