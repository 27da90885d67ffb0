"""MPICH's start-up shared memory, unlinked as soon as every rank of the job has mapped it.

MPICH (4.2 and later, the ``mpich`` wheel included) maps one POSIX shared-memory file per node in
``MPI_Init``, ``/dev/shm/mpich_shm_<hash of the job's PMI name>_<node>`` (about 4 MB), and
unlinks it only in ``MPI_Finalize``. A job that ends in ``MPI_Abort`` (which is how ``psctl mpi``
ends a job when a rank fails) or is killed leaves the file behind for good; under Slurm the name
comes from the job and step id, and a later job that gets the same id maps the stale file and
hangs in ``MPI_Init``. Once every rank has passed ``MPI_Init`` nobody opens the name again (each
rank keeps its own mapping), so psctl unlinks it then, as one does with a temporary file.
MPICH's own unlink at ``MPI_Finalize`` ignores the missing name; other MPIs map no such file.
"""

from __future__ import annotations

import os
import time

PREFIX = "/dev/shm/mpich_shm_"
POLL_S = 0.05


def mapped_init_shm(maps: str = "/proc/self/maps") -> list[str]:
    """The MPICH start-up files this process has mapped and that still have a name."""
    found = set()
    try:
        with open(maps) as f:
            for line in f:
                fields = line.rstrip("\n").split(maxsplit=5)  # address perms offset dev inode path
                if len(fields) == 6 and fields[5].startswith(PREFIX) and not fields[5].endswith(" (deleted)"):
                    found.add(fields[5])
    except OSError:  # no /proc (not Linux): nothing to do
        return []
    return sorted(found)


def unlink_init_shm(world) -> None:
    """Unlink MPICH's start-up file of this node once every rank of ``world`` has mapped it.

    Collective: call it on every rank with ``MPI.COMM_WORLD`` (not a sub-communicator: only a
    collective over the whole job proves that every rank of this node has passed ``MPI_Init``).
    Waits with a non-blocking barrier and a sleep, so waiting ranks do not spin a core.
    """
    request = world.Ibarrier()
    while not request.Test():
        time.sleep(POLL_S)
    for path in mapped_init_shm():
        try:
            os.unlink(path)
        except FileNotFoundError:  # another rank of this node was first
            pass
