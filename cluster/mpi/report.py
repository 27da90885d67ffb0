"""What ``psctl mpi`` leaves in its output folder besides the summary: the job, each rank's log, and
a partial summary when a rank fails.

* ``OUT/job.toml``: the job as it ran (token redacted), written by rank 0 as ``psctl launch`` does
  (cluster/job/records.py), and again once the shards said where they keep their state.
* ``OUT/logs/ROLE-I.log`` (``coordinator.log``, ``server-I.log``, ``worker-I.log``): everything the
  rank's Python code writes to stdout and stderr, its traceback included, also goes to the terminal
  through mpiexec as before. On several nodes each rank writes where OUT is on its own node (put OUT
  on a shared file system to have them together).
* A rank that raises tells rank 0 before the job is aborted (:func:`tell_coordinator`); rank 0
  folds it into ``summary.json`` (status ``failed``, the rank under ``failures``) and aborts the job
  itself. MPI allows this only while rank 0 is coordinating; a rank killed by a signal, or a failure
  while the job starts, leaves no summary: mpiexec ends every rank at once.
"""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path

from psgrid.psserver import files

TAG_FAILED = 72
# How long a failing rank waits for rank 0 to write the summary and abort the job, before it aborts it itself.
NOTICE_WAIT_S = 5.0
POLL_S = 0.05


def log_name(role: str, index: int) -> str:
    return "coordinator.log" if role == "coordinator" else f"{role}-{index}.log"


class _Tee:
    """A text stream that writes to the terminal's stream and to a log file."""

    def __init__(self, stream, log):
        self._stream, self._log = stream, log

    def write(self, text: str) -> int:
        self._log.write(text)
        self._log.flush()
        return self._stream.write(text)

    def flush(self) -> None:
        self._stream.flush()

    def __getattr__(self, name):
        return getattr(self._stream, name)


def tee_to_log(out: Path, rank: int, role: str, index: int) -> Path | None:
    """Copy this rank's stdout and stderr into ``OUT/logs/ROLE-I.log``; None if that folder is out of reach."""
    path = out / "logs" / log_name(role, index)
    try:
        files.make_dirs(path.parent)
        log = files.open_new(path, "a", buffering=1)
    except OSError:
        return None
    log.write(f"# rank {rank} ({role} {index}) on {socket.gethostname()}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    untee()  # a rank that runs several jobs (psctl compare --mpi) logs each into its own folder
    sys.stdout = _Tee(sys.stdout, log)
    sys.stderr = _Tee(sys.stderr, log)
    return path


def untee() -> None:
    """Stop copying stdout and stderr into a log (the job of :func:`tee_to_log` has ended)."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        if isinstance(stream, _Tee):
            setattr(sys, name, stream._stream)
            if not stream._log.closed:
                stream._log.close()


def tell_coordinator(comm, rank: int, role: str, index: int, error: str) -> None:
    """From a rank that failed: tell rank 0, and give it a moment to write the partial summary and abort.

    Returns when rank 0 did not abort the job within :data:`NOTICE_WAIT_S` (it is not coordinating yet,
    or is gone); the caller then aborts the job itself.
    """
    if rank == 0:
        return
    notice = {
        "rank": rank,
        "role": role,
        "index": index,
        "host": socket.gethostname(),
        "error": error,
        "log": f"logs/{log_name(role, index)}",
        "time": time.time(),
    }
    try:
        request = comm.isend(notice, dest=0, tag=TAG_FAILED)
    except Exception:  # the communicator is broken: nothing to tell
        return
    deadline = time.monotonic() + NOTICE_WAIT_S
    while time.monotonic() < deadline:  # rank 0's MPI_Abort ends this process
        request.Test()
        time.sleep(POLL_S)


def failures_reported(comm) -> list[dict]:
    """On rank 0: the notices of ranks that failed since the last call (see :func:`tell_coordinator`)."""
    from mpi4py import MPI

    status = MPI.Status()
    found = []
    while comm.iprobe(source=MPI.ANY_SOURCE, tag=TAG_FAILED, status=status):
        notice = comm.recv(source=status.Get_source(), tag=TAG_FAILED)
        found.append({"name": f"{notice['role']} {notice['index']}", "tolerated": False, **notice})
    return found


def describe(failures: list[dict]) -> str:
    """One line for the summary's message: who failed, where, and the error's last line."""
    return "; ".join(f"rank {f['rank']} ({f['name']} on {f['host']}) failed: {f['error']}" for f in failures)
