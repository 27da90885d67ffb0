"""A CUDA MPS control daemon of the job's own (``[job] mps = true``): one GPU context for its shards and workers.

Without MPS, device shards and GPU workers in processes of their own time-slice the GPU: every push
and the pull after it move the GPU between two contexts (0.14-0.16 ms a move on an H100), and the
kernels of two processes never run side by side (docs/performance.md, "Device shards"). An MPS
control daemon gives the CUDA processes that find its pipe one context. A machine's owner may run one
for everybody (``nvidia-cuda-mps-control -d``); with ``mps = true`` the launcher runs one for the job
alone when none serves it already (:func:`mps_serving`):

* its pipe is in a private temporary folder (0700) named to the job's children only
  (``CUDA_MPS_PIPE_DIRECTORY``): the user's other processes, which look in the default folder, are
  not served by it; its own logs (``CUDA_MPS_LOG_DIRECTORY``) go to the job's ``logs/mps/``;
* it runs in the foreground under a keeper process (:func:`keep`) that holds the launcher's lifeline
  like any child (psserver/lifeline.py): when the launcher ends, however it ends, or stops it, the
  keeper tells the daemon to quit, waits for it (killing what is left after :data:`QUIT_S`) and
  removes the folder. The daemon dies with its keeper too (``PR_SET_PDEATHSIG``);
* the launcher stops it last, after every child it served has ended.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

from psgrid.cluster.job.shard_device import mps_serving

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV, LOG_ENV = "CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY"
START_S = 20.0  # how long the daemon may take to make its pipe
QUIT_S = 10.0  # how long it may take to quit once asked (its clients have ended by then)
POLL_S = 0.25

# The keeper starts like psctl's children, without the current folder on its path (cluster/run/procs.py).
KEEPER = (
    "import sys\n"
    "if sys.path and sys.path[0] == '':\n"
    "    del sys.path[0]\n"
    "from psgrid.cluster.run.mps import keep\n"
    "sys.exit(keep(sys.argv[1]))"
)


def mps_problem(environ: Mapping[str, str] = os.environ) -> str | None:
    """Why ``mps = true`` cannot be had here (one line), or None: a daemon serves already, or one can be started."""
    if mps_serving(environ) or shutil.which(CONTROL, path=environ.get("PATH")):
        return None
    return (
        f"[job] mps = true starts an MPS control daemon for the job, but {CONTROL} is not on PATH (it comes "
        "with the NVIDIA driver); install it, or leave out --mps (mps = false)"
    )


def daemon_env(environ: Mapping[str, str], folder: str | Path, logs: str | Path) -> dict[str, str]:
    """``environ`` with CUDA told to find the daemon whose pipe is in ``folder`` and whose logs go to ``logs``."""
    return {**environ, PIPE_ENV: str(Path(folder) / "pipe"), LOG_ENV: str(logs)}


class JobMps:
    """The job's own daemon, from :meth:`spawn` to :meth:`stop`; ``env`` is what its clients need in theirs."""

    def __init__(self, logs: str | Path):
        self.logs = Path(logs)  # the daemon's own logs; the keeper's output beside them, in mps.log
        self.log_path = self.logs.parent / "mps.log"
        self.folder: str | None = None
        self.keeper = None  # the keeper's procs.Child
        self.env: dict[str, str] = {}

    def spawn(self) -> bool:
        """Start the daemon's keeper unless a daemon serves this process's environment already; returns whether it did.

        Quick (one fork): a launcher holds its signals around it, so no keeper goes unrecorded.
        """
        if mps_serving(os.environ):
            return False  # the machine's (or the user's) daemon serves the job's children as it serves us
        from psgrid.cluster.run.procs import Child, child_env

        self.folder = tempfile.mkdtemp(prefix="psgrid-mps-")  # 0700: the user's alone
        env = daemon_env(child_env(), self.folder, self.logs.resolve())
        self.keeper = Child("mps control daemon", [sys.executable, "-c", KEEPER, self.folder], self.log_path, env)
        self.env = {PIPE_ENV: env[PIPE_ENV], LOG_ENV: env[LOG_ENV]}
        return True

    def ready(self) -> dict[str, str]:
        """Wait for the spawned daemon's pipe; returns the variables its clients need (none where none was spawned).

        Raises
        ------
        RuntimeError
            The daemon made no pipe within :data:`START_S`, or ended: one line naming its log.
        """
        if self.keeper is None:
            return {}
        deadline = time.monotonic() + START_S
        control = Path(self.env[PIPE_ENV]) / "control"
        while not control.exists():
            if self.keeper.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(
                    f"the job's MPS control daemon ({CONTROL} -f) did not start within {START_S:.0f} s: see "
                    f"{self.log_path}; or set mps = false"
                )
            time.sleep(0.05)
        return self.env

    def stop(self) -> None:
        """Ask the keeper to quit the daemon and wait for it (its clients must have ended)."""
        from psgrid.cluster.run.procs import stop_children

        if self.keeper is not None:
            stop_children([self.keeper], QUIT_S + 5.0)
            self.keeper = None
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)  # the keeper removes it; a killed keeper did not
            self.folder = None


# ----- the keeper: its own process, started by JobMps -----------------------------------------------


def keep(folder: str) -> int:
    """Run the MPS control daemon of ``folder`` until the launcher stops us or is gone; then quit it and tidy up.

    The daemon's variables are in our environment already (:class:`JobMps` put them there).
    """
    from psgrid.psserver import files, lifeline

    env = dict(os.environ)
    stopping: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stopping.append(signum))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the launcher, which stops us in turn
    line = lifeline.inherited()
    try:
        if line is not None and lifeline.cut(line):
            return 0  # the launcher is already gone: start nothing
        for sub in (PIPE_ENV, LOG_ENV):
            files.make_dirs(env[sub], mode=0o700)
        daemon = subprocess.Popen(
            [CONTROL, "-f"],
            env=env,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # the launcher's signals to our group are ours to pass on, as a quit
            preexec_fn=_die_with_parent,  # noqa: PLW1509 - this process has no other thread
        )
        poller = select.poll()
        if line is not None:
            poller.register(line, select.POLLIN)
        while not stopping and daemon.poll() is None and not poller.poll(POLL_S * 1000):
            pass
        ended = daemon.poll()
        _quit(daemon, env)
        print(f"{CONTROL}: quit ({'it had ended, ' + str(ended) if ended is not None else 'asked'})", flush=True)
        return 0 if ended is None else 1
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _quit(daemon: subprocess.Popen, env: dict[str, str]) -> None:
    if daemon.poll() is None:
        try:
            subprocess.run([CONTROL], input="quit\n", text=True, env=env, timeout=QUIT_S, capture_output=True)
            daemon.wait(QUIT_S)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(daemon.pid, signal.SIGKILL)  # what is left of its group: the daemon, the MPS server it started
    except ProcessLookupError:
        pass
    daemon.wait()


def _die_with_parent() -> None:
    """In the daemon, before exec: SIGKILL when the keeper dies (a keeper killed outright quits nothing)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
