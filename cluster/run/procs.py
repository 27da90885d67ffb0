"""Child processes of a launcher: each in its own process group, logged to a file, stopped for sure.

Every child runs in a new session (its own process group) so that a Ctrl-C in the
terminal reaches the launcher only, and the launcher decides how children stop:
SIGTERM to the group, then SIGKILL after a grace period.  Children started with
:func:`child_env` also hold the launcher's lifeline (psserver/lifeline.py) from their first
line and stop themselves when the launcher vanishes without cleaning up (``kill -9``), even
one killed while they were still starting.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterable, Sequence
from pathlib import Path

from psgrid.psserver import files, lifeline

PARENT_ENV = lifeline.PARENT_ENV
# Children start with this instead of ``python -m``, which would put the current folder first on their
# path: a user's own worker.py (or psgrid.py) there must never shadow an import of ours. The launcher's
# lifeline is watched before anything else: a child whose launcher is already gone never starts.
CHILD_BOOTSTRAP = (
    "import sys\n"
    "if sys.path and sys.path[0] == '':\n"
    "    del sys.path[0]\n"
    "from psgrid.psserver.lifeline import watch\n"
    "watch()\n"
    "from psgrid.cluster.cli import main\n"
    "sys.exit(main())"
)


THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS")


def usable_cpus() -> int:
    """CPUs this process may run on (respects taskset, cpusets and Slurm bindings)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def limit_blas_threads(threads: int) -> None:
    """Cap BLAS/OpenMP threads of this process at ``threads`` unless the user set them.

    For processes that cannot set the variables before NumPy loads (MPI ranks): several ranks
    per node each starting one BLAS thread per core made CPU training five times slower.
    """
    if any(v in os.environ for v in THREAD_VARS):
        return
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=max(1, threads))


def child_env(extra: dict[str, str] | None = None, threads: int | None = None) -> dict[str, str]:
    """The environment of a child: ours (psgrid is installed, so it imports the same package), unbuffered
    output, parent watch on (:class:`Child` hands it this process's lifeline).

    ``threads`` caps the BLAS/OpenMP threads of the child unless the user set them, so that
    W workers on a C-core machine do not each start C threads.
    """
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env[PARENT_ENV] = str(os.getpid())
    if threads is not None:
        if not any(v in env for v in THREAD_VARS):
            env.update({v: str(max(1, threads)) for v in THREAD_VARS})
    env.update(extra or {})
    return env


def psctl_argv(*args: str) -> list[str]:
    """The command line that runs ``psctl ARGS`` with this interpreter and the psgrid installed in it.

    The current folder is not put on the child's path (see CHILD_BOOTSTRAP).
    """
    return [sys.executable, "-c", CHILD_BOOTSTRAP, *args]


class Child:
    """One child process in its own process group, stdout and stderr appended to ``log_path``.

    An ``env`` from :func:`child_env` of this process also gives it this process's lifeline.
    """

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: str | Path,
        env: dict[str, str] | None = None,
        cwd: str | Path | None = None,
    ):
        self.name = name
        self.argv = list(argv)
        self.log_path = Path(log_path)
        files.make_dirs(self.log_path.parent)
        env, held = lifeline.hand_to(env) if env is not None else (None, ())
        with files.open_new(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=True,
                pass_fds=held,
            )
        self.started = time.time()
        self.ended: float | None = None

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        code = self.proc.poll()
        if code is not None and self.ended is None:
            self.ended = time.time()
        return code

    @property
    def returncode(self) -> int | None:
        return self.poll()

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None if still running after ``timeout`` seconds."""
        try:
            self.proc.wait(timeout=max(0.0, timeout))
        except subprocess.TimeoutExpired:
            return None
        return self.poll()

    def signal_group(self, sig: int) -> None:
        # Only while the leader is unreaped: after that its pid (= the group id) may be reused.
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass

    def tail(self, lines: int = 20) -> str:
        return tail_file(self.log_path, lines)

    def describe_exit(self) -> str:
        code = self.poll()
        if code is None:
            return "is still running"
        if code < 0:
            try:
                return f"was killed by {signal.Signals(-code).name} (exit code {code})"
            except ValueError:
                return f"was killed by signal {-code} (exit code {code})"
        return f"exited with code {code}"


def stop_children(children: Iterable[Child], grace: float = 5.0) -> None:
    """SIGTERM every running child's group, wait up to ``grace`` seconds, then SIGKILL what is left."""
    alive = [c for c in children if c.poll() is None]
    for c in alive:
        c.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in alive:
        c.wait(deadline - time.monotonic())
    for c in alive:
        if c.poll() is None:
            c.signal_group(signal.SIGKILL)
            c.wait(5.0)


def tail_file(path: str | Path, lines: int = 20) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(deque(text.splitlines(), maxlen=lines))
