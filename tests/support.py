"""Plain helpers several test modules share (fixtures live in conftest.py)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from psgrid.cluster.mpi import hydra_topology
from psgrid.cluster.run.coordinator import JobState, MetricsTail
from psgrid.psserver.protocol import PLANES as BUILT_IN_PLANES
from psgrid.psserver.spec import ModelSpec

FEATURES = 12
REGRESSION = ModelSpec([("w", (FEATURES,)), ("b", (1,))])
# The planes the in-process fixtures run every test on. CUDA IPC serves GPU workers of other processes
# only (a process cannot map its own handles): tests/test_device_shard.py runs it on a GPU. The in-process
# plane serves only a shard's own process, by calls: tests/test_local_plane.py.
PLANES = tuple(p for p in BUILT_IN_PLANES if p not in ("ipc", "local"))


def plane_options(plane: str) -> dict:
    """A client's settings that make it use ``plane``: shared memory is chosen first where it is offered."""
    return {"data_plane": "tcp" if plane == "shm" else plane, "shared_memory": plane == "shm"}


def make_problem(seed: int = 0, n: int = 400):
    """A linear regression problem: inputs, targets, true weights and bias."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    w_true = rng.normal(size=FEATURES).astype(np.float32)
    b_true = np.float32(0.7)
    return x, x @ w_true + b_true, w_true, b_true


def regression_grad(params: np.ndarray, x: np.ndarray, y: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """The mean squared error's gradient for REGRESSION's flat layout."""
    out = np.empty(REGRESSION.size, np.float32) if out is None else out
    residual = x @ params[:FEATURES] + params[FEATURES] - y
    out[:FEATURES] = x.T @ residual / len(y)
    out[FEATURES] = residual.mean()
    return out


def run_threads(targets, timeout: float) -> list:
    """Run callables in threads; re-raise the first error; fail if any is still running after timeout."""
    results = [None] * len(targets)
    errors = []

    def wrap(i, fn):
        try:
            results[i] = fn()
        except BaseException as exc:  # noqa: BLE001 - reported to the test below
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(i, fn), daemon=True) for i, fn in enumerate(targets)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    alive = [t for t in threads if t.is_alive()]
    if errors:
        raise errors[0]
    assert not alive, f"{len(alive)} threads still running after {timeout}s (deadlock?)"
    return results


ROOT = Path(__file__).resolve().parent.parent
# Loopback only: no MPI transport may go looking for a network. And no hydra topology file for a
# failing test to leave in /tmp (cluster/mpi/hydra_topology.py).
MPI_ENV = {
    "HYDRA_IFACE": "lo",
    "UCX_TLS": "self,sm",
    "UCX_NET_DEVICES": "lo",
    "FI_TCP_IFACE": "lo",
    **hydra_topology.ENV,
}


def mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    found = str(beside) if beside.exists() else shutil.which("mpiexec")
    if not found:
        pytest.fail("mpiexec not found: install the test extra (pip install '.[test]'), which brings mpich")
    return found


def run_mpiexec(n: int, python_args: list[str], timeout: float = 120, extra_env: dict | None = None):
    env = dict(os.environ, **MPI_ENV, **(extra_env or {}))
    argv = [mpiexec(), "-n", str(n), sys.executable, *python_args]
    t = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"mpiexec -n {n} did not finish in {timeout} s:\n{out}\n{err}")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode, out, err, time.monotonic() - t


# ----- psctl launch as a background process ------------------------------------------------------


def psctl(*args: str, timeout: float = 120, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """``psctl ARGS`` as a user runs it, from the repository's root, its output captured (``env``: ours by default)."""
    return subprocess.run(
        [sys.executable, "-m", "psgrid.cluster.cli", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        **kw,
    )


def launch_env() -> dict:
    return dict(os.environ)  # psgrid is installed (pip install -e .): every child imports the same package


def wait_for(predicate, timeout: float, what: str, poll: float = 0.1):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(poll)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is dead for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def coordinator_events(out: Path) -> list[dict]:
    try:
        return [
            json.loads(line)
            for line in (out / "metrics" / "coordinator.jsonl").read_text().splitlines()
            if line.strip()
        ]
    except FileNotFoundError:
        return []


def child_pids(out: Path) -> dict[str, list[int]]:
    pids = {}
    for e in coordinator_events(out):
        if e["event"] == "shards_ready":
            pids["shards"] = e["pids"]
        if e["event"] == "workers_started":
            pids["workers"] = e["pids"]
    return pids


def steps_seen(out: Path, rank: int) -> int:
    path = out / "metrics" / f"worker-{rank}.jsonl"
    state = JobState()
    state.update(MetricsTail([path]).read())
    return state.position  # a resumed worker's steps count from where the job was


class Launch:
    """``psctl launch`` as a background process; everything it started is killed by pid on exit."""

    def __init__(self, tmp_path: Path, *args: str, log: str = "launch.log"):
        self.out = tmp_path / "run"
        self.log = tmp_path / log
        with open(self.log, "wb") as log:
            args = list(args)
            at = args.index("--") if "--" in args else len(args)  # after `--` comes the user's command
            argv = [
                sys.executable,
                "-m",
                "psgrid.cluster.cli",
                "launch",
                *args[:at],
                "--out",
                str(self.out),
                *args[at:],
            ]
            self.proc = subprocess.Popen(
                argv, cwd=ROOT, env=launch_env(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_for(self, predicate, timeout: float, what: str):
        def check():
            if predicate():
                return True
            assert self.proc.poll() is None, f"launch exited ({self.proc.returncode}) before {what}:\n{self.text()}"
            return False

        return wait_for(check, timeout, what)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def text(self) -> str:
        return self.log.read_text()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pids = [p for group in child_pids(self.out).values() for p in group]
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        for pid in pids:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


def run_launch(tmp_path: Path, *args: str, timeout: float = 120) -> tuple[int, str, Path]:
    with Launch(tmp_path, *args) as launch:
        code = launch.wait(timeout)
        return code, launch.text(), launch.out


def assert_token_kept(out: Path) -> str:
    """The job's token (from OUT/token) appears in no file of OUT that others can read; returns it."""
    token_file = out / "token"
    assert token_file.stat().st_mode & 0o777 == 0o600
    token = token_file.read_text().strip()
    assert len(token) >= 32
    for path in out.rglob("*"):
        if path.is_file() and token.encode() in path.read_bytes():
            assert path.stat().st_mode & 0o077 == 0, f"{path} holds the token and others may read it"
    return token


def address_lines(proc, addr: Path, log: Path, timeout: float = 30.0) -> list[str]:
    """The lines of a hand-started shard's address file, once it is written (its log, if it dies first)."""
    deadline = time.monotonic() + timeout
    while not addr.exists():
        assert proc.poll() is None, log.read_text()
        assert time.monotonic() < deadline, f"no address file after {timeout:.0f} s"
        time.sleep(0.05)
    return addr.read_text().splitlines()
