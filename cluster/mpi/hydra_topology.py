"""MPICH's mpiexec (hydra) and the topology file it leaves in /tmp when a job does not end cleanly.

Each hydra proxy writes the node's hwloc topology to ``/tmp/hydra_hwloc_xmlfile_XXXXXX`` the first
time a rank asks for it in ``MPI_Init`` (when a node runs more than one rank), so that the ranks
need not probe the hardware, and removes it only when the job ends cleanly: a job that ends in
``MPI_Abort`` (how ``psctl mpi`` ends a failed job), a signal or a timeout leaves it behind. The
folder is fixed in the binary (TMPDIR does not move it).

Where ``HWLOC_XMLFILE`` is set, the proxy writes no file and hands that name to the ranks instead;
a name that does not exist makes each rank's hwloc discover the machine itself, as it does under
srun. Found by trying, with the ``mpich`` wheel (MPICH 5.0): an aborted 2-rank job leaves no file,
and ``mpiexec -bind-to core`` still binds rank 0 and 1 to cores 0 and 1. Every mpiexec that psgrid
starts (``psctl compare``'s all-reduce runs) and the tests' mpiexec get this environment; a user's
own mpiexec can be given it with ``export HWLOC_XMLFILE=/nonexistent``.
"""

from __future__ import annotations

LEFTOVERS = "/tmp/hydra_hwloc_xmlfile_*"
# The name hydra hands the ranks in place of a file of its own; nothing is ever written there.
NO_TOPOLOGY_FILE = "/nonexistent/psgrid-no-hydra-topology-file.xml"
ENV = {"HWLOC_XMLFILE": NO_TOPOLOGY_FILE}
