"""A child's lifeline to the launcher that started it: a pipe whose writing end only the launcher holds.

A launcher makes one pipe (:func:`hand_to` makes it on first use, one per process), keeps its
writing end to itself (close-on-exec, never passed on) and gives every child the reading end
(``pass_fds``), named in ``PSCTL_LIFELINE`` as ``FD:DEVICE:INODE``. The launcher never writes to
it. When the launcher ends, however it ends (SIGKILL, an OOM kill, a crash), the kernel closes the
writing end and the reading end reads end-of-file from then on, for good: a child that only looks
once it has started (the launcher killed between fork and the child's first line) still sees it, so
the watch holds from the child's first instruction and no child outlives its launcher.

Why a pipe rather than ``PR_SET_PDEATHSIG``: the death signal fires when the *thread* that forked
the child ends (``LocalCluster`` restarts a shard from its follow thread, which ends with the job),
setting it between fork and exec needs ``preexec_fn`` (unsafe in a launcher with threads), and it is
Linux only; a pipe is none of these. A launcher's own fork without exec (``multiprocessing`` with
"fork") would keep a copy of the writing end open, so a child of the launcher itself also stops
when its parent pid changes.

:func:`watch` is the child's side: ``psctl``'s children call it from their first line
(``cluster/run/procs.py``'s bootstrap) and a script calls it through ``psgrid.init``.
"""

from __future__ import annotations

import os
import select
import signal
import sys
import threading
import time

PARENT_ENV = "PSCTL_PARENT_PID"
LIFELINE_ENV = "PSCTL_LIFELINE"
GRACE_S = 5.0  # after SIGTERM, as long as a launcher gives its children before it sends SIGKILL
POLL_S = 1.0  # how often the parent pid is looked at; the pipe's end is seen at once

_lock = threading.Lock()
_ends: dict[str, int] = {}  # this process's pipe: "pid" that made it, "read", "write"
_watching = threading.Event()


def hand_to(env: dict[str, str]) -> tuple[dict[str, str], tuple[int, ...]]:
    """``env`` naming this process's lifeline for a child, and the descriptors the child must inherit.

    Only an environment made for a child that watches us (``PSCTL_PARENT_PID`` of this process) gets
    one; any other is returned as it is, with no descriptor.
    """
    if env.get(PARENT_ENV) != str(os.getpid()):
        return env, ()
    read = _read_end()
    info = os.fstat(read)
    return dict(env, **{LIFELINE_ENV: f"{read}:{info.st_dev}:{info.st_ino}"}), (read,)


def _read_end() -> int:
    with _lock:
        if _ends.get("pid") != os.getpid():  # none yet, or a forked copy of another process's
            read, write = os.pipe()  # both close-on-exec: only pass_fds hands the reading end on
            _ends.update(pid=os.getpid(), read=read, write=write)
        return _ends["read"]


def inherited() -> int | None:
    """The lifeline's descriptor, when ``PSCTL_LIFELINE`` names one this process really holds."""
    fd, _, identity = os.environ.get(LIFELINE_ENV, "").partition(":")
    if not fd.isdigit():
        return None
    try:
        info = os.fstat(int(fd))
    except OSError:  # the variable was copied into a process that was not handed the pipe
        return None
    return int(fd) if f"{info.st_dev}:{info.st_ino}" == identity else None


def cut(fd: int) -> bool:
    """Whether the lifeline reads end-of-file: its launcher is gone (the launcher never writes to it)."""
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def watch() -> bool:
    """Stop this process (SIGTERM, then SIGKILL after :data:`GRACE_S`) when the launcher that started it is gone.

    Started with a lifeline, the process stops at once if the launcher is already gone and as soon as
    it goes; started without one but by the launcher itself, when its parent pid changes. Returns
    whether anything is watched (nothing when no launcher started us, e.g. a shell between); a second
    call does nothing.
    """
    want = os.environ.get(PARENT_ENV, "")
    parent = int(want) if want.isdigit() else None
    fd = inherited()
    follow_parent = parent is not None and os.getppid() == parent
    if fd is None and not follow_parent:
        return False
    with _lock:
        if _watching.is_set():
            return True
        _watching.set()
    if fd is not None and cut(fd):
        _stop(parent)  # orphaned before it started: it must not start
        return True
    threading.Thread(
        target=_follow, args=(fd, parent if follow_parent else None), name="psctl-launcher-watch", daemon=True
    ).start()
    return True


def _follow(fd: int | None, parent: int | None) -> None:
    poller = None
    if fd is not None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
    while True:
        if poller is not None:
            if poller.poll(POLL_S * 1000):
                break
        else:
            time.sleep(POLL_S)
        if parent is not None and os.getppid() != parent:
            break
    _stop(parent)


def _stop(parent: int | None) -> None:
    who = f"(pid {parent}) " if parent is not None else ""
    print(f"psctl: the launcher {who}that started this process is gone: stopping", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    # A stop that hangs (a handler stuck behind a lock) must not keep the process: SIGKILL after the grace.
    threading.Thread(target=_kill_after_grace, name="psctl-launcher-gone", daemon=True).start()


def _kill_after_grace() -> None:
    time.sleep(GRACE_S)
    os.kill(os.getpid(), signal.SIGKILL)
