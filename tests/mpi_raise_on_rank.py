"""``psctl mpi`` with one rank made to fail, for tests/test_mpi.py (run under mpiexec; not a test module).

    mpiexec -n 4 python tests/mpi_raise_on_rank.py RANK BUSY_FILE -- mpi --config mnist ...

Rank RANK starts its role (coordinate, serve or train) as usual, and raises once BUSY_FILE is not
empty, so that it fails while the whole job is busy; every other rank runs ``psctl ARGS``
unchanged.  The failure is injected here, by patching MPIJob, so production code carries no test hook.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from psgrid.cluster.cli import main
from psgrid.cluster.mpi import job as mpi

BUSY_WAIT_S = 60.0


def raising(role_method, target: int, busy: str):
    def method(self, *args, **kwargs):
        if self.rank != target:
            return role_method(self, *args, **kwargs)
        # The role goes on in the background: a worker must join before any worker trains.
        threading.Thread(target=role_method, args=(self, *args), kwargs=kwargs, daemon=True).start()
        deadline = time.monotonic() + BUSY_WAIT_S
        while not (os.path.exists(busy) and os.path.getsize(busy)) and time.monotonic() < deadline:
            time.sleep(0.05)
        raise RuntimeError(f"rank {target}: raising on purpose at t={time.time():.3f} (test)")

    return method


if __name__ == "__main__":
    target, busy, sep, *argv = sys.argv[1:]
    assert sep == "--", "usage: mpi_raise_on_rank.py RANK BUSY_FILE -- PSCTL_ARGS..."
    for name in ("coordinate", "serve_until_shutdown", "train"):
        setattr(mpi.MPIJob, name, raising(getattr(mpi.MPIJob, name), int(target), busy))
    sys.exit(main(argv))
