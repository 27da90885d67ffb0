"""The ``mpiexec`` that psgrid starts itself (``psctl compare``'s all-reduce runs), and how to start it unbound.

Open MPI's mpiexec binds each rank to one core by default (MPICH's hydra binds nothing unless
asked). A GPU rank's batch loader thread then shares that core with its training loop: the 20M
MLP on an H100 ran at 165,653 samples/s bound and 226,828 with ``--bind-to none``
(docs/performance.md). Which MPI a launcher belongs to is read from ``mpiexec --version`` (Open
MPI names itself there, hydra prints its build details), so the launching process never
initializes MPI itself.
"""

from __future__ import annotations

import functools
import shutil
import subprocess
import sys
from pathlib import Path

VERSION_TIMEOUT_S = 10.0
UNBOUND = ("--bind-to", "none")


def mpiexec_path() -> str | None:
    """The mpiexec of the ``mpi`` extra (beside this Python), else the first on PATH; None where there is none."""
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else shutil.which("mpiexec")


@functools.lru_cache(maxsize=8)
def is_open_mpi(mpiexec: str) -> bool:
    """Whether ``mpiexec`` is Open MPI's (its ``--version`` says "Open MPI" or, before 5.0, "OpenRTE")."""
    try:
        done = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return False
    said = done.stdout + done.stderr
    return "Open MPI" in said or "OpenRTE" in said


def unbound_args(mpiexec: str) -> tuple[str, ...]:
    """The options that start ``mpiexec``'s ranks without binding them to cores (none needed: empty)."""
    return UNBOUND if is_open_mpi(mpiexec) else ()
