"""Waiting on MPI without spinning a core, and ending a whole MPI job.

A blocking MPICH call spins a core while it waits; on a small machine the waiting ranks would take
the CPU the workers train on. So the ranks that wait poll a non-blocking request with a sleep.
"""

from __future__ import annotations

import time

from psgrid.cluster.errors import JobFailed

POLL_S = 0.05
ABORT_GRACE_S = 0.5


INTERRUPT_WAIT_S = 20.0  # after Ctrl-C or SIGTERM, how long the ranks wait for each other before aborting


def wait_request(req, timeout: float | None, what: str) -> None:
    """Wait for a non-blocking MPI request (``Ibarrier``, ``isend``), polling with a sleep.

    Raises JobFailed naming ``what`` if it has not completed within ``timeout`` seconds (None: no limit).
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    while not req.Test():
        if deadline is not None and time.monotonic() > deadline:
            raise JobFailed(f"{what} did not complete within {timeout:.0f} s")
        time.sleep(POLL_S)


def abort(comm) -> None:
    """End every rank of ``comm``'s job (``MPI_Abort``), after letting the last messages out."""
    # Give mpiexec's output forwarding a moment: MPI_Abort kills every rank at once, and a message
    # still in a pipe when that happens is lost.
    time.sleep(ABORT_GRACE_S)
    comm.Abort(1)


def meet_after_signal(comm, signum: int, who: str, waiting=None) -> str:
    """After Ctrl-C or SIGTERM, which mpiexec and srun pass to every rank: the ranks of ``comm`` meet once more.

    ``waiting`` is a barrier request this rank had already posted on ``comm`` (it meets there, so every rank
    posts one). A rank that does not come within INTERRUPT_WAIT_S (the signal reached only some ranks)
    makes the job abort, ``who`` saying so. Returns the signal's name.
    """
    import signal
    import sys

    name = signal.Signals(signum).name
    try:
        wait_request(waiting or comm.Ibarrier(), INTERRUPT_WAIT_S, f"{name}: the other ranks stopping")
    except JobFailed as e:
        print(f"{who}: rank {comm.Get_rank()}: {e}; aborting the job", file=sys.stderr, flush=True)
        abort(comm)
    return name
