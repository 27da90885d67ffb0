"""The in-process cluster every test module uses, in the manner of dask's ``gen_cluster``.

``cluster(num_shards, **ServerConfig fields)`` starts shards in this process on 127.0.0.1
port 0 and hands out clients that move payloads over the test's data plane: the fixture is
parametrised over every transport (``shm``: shared memory on this host; ``tcp``; ``grpc``), so
a test written once runs over each. Only a test about one plane pins it
(``@pytest.mark.parametrize("data_plane", ["tcp"])``), and one whose payloads never go through this
fixture's clients (its workers are other processes with their own default, or it only reads stats
over gRPC) pins the plane they do use, so that it does not run three times alike.
On teardown it checks invariants every shard must hold after any run, stops everything,
and fails the test if it left threads, sockets or child processes behind.
"""

from __future__ import annotations

import importlib.util
import os
import threading
import time
from pathlib import Path

import numpy as np
import pytest


def _installed_from_here() -> None:
    """Stop at once unless psgrid is installed from this clone: the tests would import another tree's code."""
    here = Path(__file__).resolve().parent.parent
    found = importlib.util.find_spec("psgrid.psserver")
    where = Path(found.origin).resolve().parent.parent if found is not None and found.origin else None
    if where != here:
        pytest.exit(
            f"psgrid.psserver comes from {where or 'nowhere'}, not from this clone {here}: "
            f"install it first (pip install -e '.[test]')",
            returncode=4,
        )


_installed_from_here()

PYCACHE_ENV = "PSGRID_TESTS_PYCACHE"  # the run's own compiled-module folder, named to the processes it starts


def pytest_configure(config) -> None:
    """Let the processes the tests start keep what they compile, in a folder of this run's own.

    The suite starts hundreds of Python processes (each job is a launcher, shards and workers). In an
    environment that sets PYTHONDONTWRITEBYTECODE (CI images and containers often do) each of them
    compiles psgrid's modules again: a fifth of the suite's CPU time on 2 cores. The folder is made by
    the run's first process (xdist's controller, before it starts its workers, which inherit it) and
    removed at its end; nothing is written into the clone.
    """
    if os.environ.get(PYCACHE_ENV) or not os.environ.get("PYTHONDONTWRITEBYTECODE"):
        return
    import tempfile

    folder = tempfile.mkdtemp(prefix="psgrid-tests-pycache-")
    config._psgrid_pycache = folder  # this process made it: it removes it
    os.environ.pop("PYTHONDONTWRITEBYTECODE")
    os.environ["PYTHONPYCACHEPREFIX"] = os.environ[PYCACHE_ENV] = folder


def pytest_unconfigure(config) -> None:
    folder = getattr(config, "_psgrid_pycache", None)
    if folder:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


from psgrid.psserver.client.admin import Admin  # noqa: E402
from psgrid.psserver.client.client import Client  # noqa: E402
from psgrid.psserver.config import ServerConfig  # noqa: E402
from psgrid.psserver.server import RunningServer, serve  # noqa: E402
from psgrid.psserver.spec import ModelSpec  # noqa: E402
from psgrid.psserver.state.shard import MAX_LENT_BUFFERS  # noqa: E402
from psgrid.psserver.state.weight_ring import MAX_VERSIONS  # noqa: E402
from tests.support import PLANES, plane_options  # noqa: E402

LEAK_GRACE_S = 5.0  # threads and sockets get this long to wind down after teardown


def check_invariants(server: RunningServer) -> None:
    """What holds for every shard after any run, whatever the test did to it."""
    shard = server.shard
    assert shard.cond.acquire(timeout=5), "shard lock held by someone after the test"
    shard.cond.release()
    stats = shard.stats()
    for key in ("pushes", "pulls", "applied_updates", "dropped_late", "duplicates", "evictions", "rejected"):
        assert stats[key] >= 0, key
    assert sum(stats["staleness_counts"]) <= stats["pushes"]
    if shard.initialized:
        assert np.isfinite(shard.weights).all(), "weights went non-finite"
        assert stats["applied_updates"] == stats["version"]
        held = sum(len(grads) for grads in shard.pushes.round_grads.values())
        assert shard.pool.on_loan == held, f"{shard.pool.on_loan - held} pooled buffers never came back"
        ring = shard.ring
        assert not any(ring.lent), f"weight buffers still lent to senders: {ring.lent}"
        bound = min(MAX_VERSIONS, 2 + MAX_LENT_BUFFERS + ring.peak_readers)  # current, one to write, one per reader
        assert len(ring.arrays) <= bound, f"the ring grew to {len(ring.arrays)} buffers (bound {bound})"
    half = server.service._half
    assert half is None or half.on_loan == 0, "a half-precision landing buffer never came back"


class InProcessCluster:
    """Shards in this process; clients and admins made here use the cluster's data plane and close with it."""

    def __init__(self, num_shards: int, client_plane: str, **settings):
        self.data_plane = client_plane  # what its clients use; settings["data_plane"] is what shards offer
        self.servers: list[RunningServer] = []
        self.owned: list = []
        settings.setdefault("job_id", "cluster-job")  # one job, as psctl gives its shards (None: each its own)
        for i in range(num_shards):
            self.servers.append(
                serve(ServerConfig(shard_index=i, num_shards=num_shards, host="127.0.0.1", port=0, **settings))
            )
        self.addresses = [s.address for s in self.servers]

    def shard(self, i: int = 0):
        return self.servers[i].shard

    def client(self, spec: ModelSpec, **kw) -> Client:
        """A client of this cluster (not joined yet: use it with ``with``)."""
        for key, value in plane_options(self.data_plane).items():
            kw.setdefault(key, value)
        kw.setdefault("deadline_s", 20)
        kw.setdefault("retry_s", 5)
        client = Client(self.addresses, spec, **kw)
        self.owned.append(client)
        return client

    def admin(self, **kw) -> Admin:
        kw.setdefault("data_plane", plane_options(self.data_plane)["data_plane"])
        admin = Admin(self.addresses, **kw)
        self.owned.append(admin)
        return admin

    def weights(self) -> np.ndarray:
        return np.concatenate([s.shard.weights for s in self.servers])

    def checksum(self) -> float:
        return sum(s.shard.checksum() for s in self.servers)

    def close(self) -> None:
        """Close its clients, stop every shard, then check what must hold once nothing is in flight."""
        try:
            for obj in self.owned:
                obj.close()
        finally:
            for server in self.servers:
                server.stop(grace=0.5)
        for server in self.servers:
            check_invariants(server)


# ----- what a test may not leave behind --------------------------------------------------------------


def _sockets() -> set[str]:
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed while listing
        if target.startswith("socket:"):
            found.add(target)
    return found


def _children() -> set[int]:
    pids = set()
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids |= {int(p) for p in f.read().split()}
        except OSError:
            continue
    return pids


def _alive_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.is_alive()}


def _cuda_started() -> None:
    """Where a GPU is, start CUDA before the first baseline (a worker's device "auto" takes the GPU): the driver
    keeps a socket of its own from its first context on, which is no test's leak. A no-op without CuPy."""
    global _CUDA_STARTED
    if _CUDA_STARTED or importlib.util.find_spec("cupy") is None:
        _CUDA_STARTED = True
        return
    _CUDA_STARTED = True
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount():
            cupy.zeros(1).sum()
    except Exception:  # noqa: BLE001 - no driver or no device: nothing to start
        pass


_CUDA_STARTED = False


@pytest.fixture
def no_leaks():
    """Fail the test if it leaves threads, sockets or child processes that were not there before."""
    _cuda_started()
    threads, sockets, children = _alive_threads(), _sockets(), _children()
    yield
    deadline = time.monotonic() + LEAK_GRACE_S
    while True:
        extra_threads = _alive_threads() - threads
        extra_sockets = _sockets() - sockets
        extra_children = _children() - children
        if not (extra_threads or extra_sockets or extra_children) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not extra_threads, f"threads left running: {sorted(t.name for t in extra_threads)}"
    assert not extra_sockets, f"{len(extra_sockets)} sockets left open"
    assert not extra_children, f"child processes left running: {sorted(extra_children)}"


@pytest.fixture(params=PLANES)
def data_plane(request) -> str:
    """Each data plane in turn; a test about one pins it with @pytest.mark.parametrize("data_plane", [...])."""
    return request.param


@pytest.fixture
def cluster(data_plane, no_leaks):
    """``cluster(num_shards=2, **settings)`` starts an InProcessCluster; all are checked and stopped after."""
    made: list[InProcessCluster] = []

    def start(num_shards: int = 2, **settings) -> InProcessCluster:
        made.append(InProcessCluster(num_shards, data_plane, **settings))
        return made[-1]

    yield start
    errors = []
    for c in made:
        try:
            c.close()
        except BaseException as exc:  # noqa: BLE001 - stop every cluster before reporting
            errors.append(exc)
    if errors:
        raise errors[0]


@pytest.fixture
def tcp_calls(monkeypatch):
    """Counts of the pulls and pushes shards served over the TCP data plane."""
    from psgrid.psserver.transports.tcp_server import TcpDataServer

    calls = {"pull": 0, "push": 0}
    lock = threading.Lock()

    def counting(kind, real):
        def method(self, *args):
            with lock:
                calls[kind] += 1
            return real(self, *args)

        return method

    monkeypatch.setattr(TcpDataServer, "_pull", counting("pull", TcpDataServer._pull))
    monkeypatch.setattr(TcpDataServer, "_push", counting("push", TcpDataServer._push))
    return calls


@pytest.fixture(scope="session")
def slurm():
    """A one-node Slurm cluster on this machine (tests/slurm.py), started once per session, stopped after.

    ``slurm.srun(n, argv, timeout=...)`` runs a job step and returns the completed process;
    ``slurm.strays()`` and ``slurm.shm_leftovers()`` say what a job left behind.
    """
    from tests.slurm import SlurmCluster

    cluster = SlurmCluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


# The test files that take longest, slowest first (their seconds in one run of the suite on 2 cores,
# 2026-11-29: 153, 134, 94, 74, 67, 62, 48, 46, 38, 36, 34, 33, 30, 24, 23, 23, 22, 20, 18, 17). Under
# --dist loadfile each file runs whole in one of the two test processes, handed out in collection order
# (addopts has --no-loadscope-reorder; xdist's own order, by number of tests, sent the one-test files of
# 46-74 s last), so the longest start first and the short ones fill in at the end, and the two processes
# end within seconds of each other. A file not listed keeps its place after these.
SLOWEST_FILES = (
    "test_recovery.py",
    "test_compare.py",
    "test_first_hour.py",
    "test_fuzz.py",
    "test_slurm.py",
    "test_integration.py",
    "test_worker_core.py",
    "test_soak.py",
    "test_bench.py",
    "test_mpi.py",
    "test_hosted_shards.py",
    "test_launch.py",
    "test_install.py",
    "test_user_script.py",
    "test_aggregate_deaths.py",
    "test_allreduce.py",
    "test_failures.py",
    "test_job_mps.py",
    "test_launcher_death.py",
    "test_emulated_hosts.py",
)


def pytest_collection_modifyitems(session, config, items) -> None:
    first = {name: i for i, name in enumerate(SLOWEST_FILES)}
    items.sort(
        key=lambda item: first.get(item.path.name, len(SLOWEST_FILES))
    )  # stable: a file's tests keep their order
