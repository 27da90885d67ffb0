"""``psctl`` with every rank made to see GPUs it does not have, for tests/test_mpi.py (run under mpiexec).

    mpiexec -n 6 python tests/mpi_fake_gpus.py GPUS -- mpi --config mnist ...

Every rank reports GPUS made-up GPUs (the same ids on every rank, as on one node), so the
placement of ``psctl mpi`` can be driven on a machine without a GPU. Nothing can train on them:
this is for layouts that must be refused before any role starts. Patched here, so production
code carries no test hook.
"""

from __future__ import annotations

import sys

from psgrid.cluster.cli import main
from psgrid.worker import backend

if __name__ == "__main__":
    count, sep, *argv = sys.argv[1:]
    assert sep == "--", "usage: mpi_fake_gpus.py GPUS -- PSCTL_ARGS..."
    backend.visible_gpus = lambda: [f"0000:{i + 1:02x}:00.0" for i in range(int(count))]
    sys.exit(main(argv))
