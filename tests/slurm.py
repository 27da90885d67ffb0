"""A one-node Slurm cluster on this machine, for the ``srun`` tests (the ``slurm`` fixture in conftest.py).

Debian's ``munged``, ``slurmctld`` and ``slurmd`` (packages ``munge slurmctld slurmd
slurm-client``, which ``.ci/run`` installs) run as this user with everything they write in one
private temporary folder: config, munge key and socket, state, spool and logs. Nothing goes to
/etc, /run or /var. :meth:`SlurmCluster.stop` stops the daemons and everything they started, and
removes the MPICH files the cluster's jobs left in /dev/shm.

What it takes, found by trying (Slurm 22.05, MPICH 4.3 and later from the ``mpich`` wheel):

- no cgroups in a container: ``ProctrackType=proctrack/linuxproc``, ``TaskPlugin=task/none``;
- ``srun --mpi=pmi2`` wires the mpich wheel (``--mpi=none`` gives N singletons; PMIx is refused
  by that MPICH); leave ``MPIR_CVAR_PMI_VERSION`` unset;
- loopback only: ``SlurmctldHost=localhost(127.0.0.1)``, ``NodeAddr=127.0.0.1`` and
  ``CommunicationParameters=NoInAddrAny,NoCtldInAddrAny``;
- munged refuses a socket folder that is not executable by all;
- ``SlurmdParameters=config_overrides`` lets the node claim more CPUs than the machine has; it also
  claims 4 GPUs, empty files in the temporary folder (``gres.conf``), so that scripts asking for
  ``--gpus-per-node=4`` are accepted (nothing computes on them: the tests run ``--device cpu``);
- MPICH names its start-up file in /dev/shm after the job and step id, and a fresh cluster would
  count job ids from 1 again: a killed job's leftover file then made a later job with the same id
  assert in ``MPI_Init`` and hang. Hence a random ``FirstJobId``, ``KillOnBadExit=1``, and the
  cluster's own leftovers removed on stop (psctl itself unlinks the file early, cluster/mpi/mpich_shm.py).

Slurm reads its two ports from its config, so they are picked free just before the start (bound
on port 0 and released) instead of published after a bind: the one place the tests name ports.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.support import MPI_ENV, ROOT, alive, wait_for

PACKAGES = "slurmd slurmctld slurm-client munge"
REQUIRE_SLURM = "PSGRID_REQUIRE_SLURM"  # "1": missing Slurm fails the srun tests (CI) instead of skipping them
PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sbatch", "sinfo", "squeue", "scancel", "scontrol")
NODE = "psgrid-node"
PARTITION = "psgrid"
NODE_CPUS = 16  # claimed (config_overrides): room for every rank a test starts, on any machine
NODE_GPUS = 4  # claimed too, as empty files: enough for examples/slurm/*.sbatch
START_S = 30.0
STOP_S = 10.0
# Environment variables of an enclosing Slurm job or MPI launcher that would make srun or MPICH
# believe they run inside it.
FOREIGN_ENV = re.compile(r"^(SLURM_|SLURMD_|SALLOC_|SBATCH_|SRUN_|PMI_|PMIX_|HYDRA_|MPIR_CVAR_PMI|OMPI_)")

CONFIG = """\
ClusterName=psgridtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser={user}
SlurmdUser={user}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket.2
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
SlurmdParameters=config_overrides
CommunicationParameters=NoInAddrAny,NoCtldInAddrAny
FirstJobId={first_job_id}
KillOnBadExit=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
GresTypes=gpu
NodeName={node} NodeAddr=127.0.0.1 NodeHostname={hostname} CPUs={cpus} Gres=gpu:{gpus} State=UNKNOWN
PartitionName={partition} Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


def find_programs(search_path: str | None = None) -> dict[str, str]:
    """Where the Slurm and munge programs are (on ``search_path``, default PATH and the sbin folders).

    Where any is missing the srun tests are skipped, with one line naming the packages to install;
    under ``PSGRID_REQUIRE_SLURM=1`` (set by ``.ci/run``, which installs them) they fail instead.
    """
    if search_path is None:
        search_path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    found = {name: shutil.which(name, path=search_path) for name in PROGRAMS}
    missing = sorted(name for name, where in found.items() if not where)
    if missing and os.environ.get(REQUIRE_SLURM) == "1":
        pytest.fail(
            f"Slurm is not installed ({', '.join(missing)} not found) and {REQUIRE_SLURM}=1 asks for the "
            f"srun tests: `apt-get install --no-install-recommends {PACKAGES}` as root",
            pytrace=False,
        )
    if missing:
        pytest.skip(
            f"srun tests need Slurm ({', '.join(missing)} not found): "
            f"apt-get install --no-install-recommends {PACKAGES}"
        )
    return found


def free_ports(count: int) -> list[int]:
    """Ports free on loopback now, all different (each held until all are picked)."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def mpich_shm_name(step: str) -> str:
    """MPICH's start-up file for a job whose PMI-2 job id is ``step`` ("JOB.STEP"): FNV-1a of it, in hex."""
    h = 0x811C9DC5
    for byte in step.encode():
        h = ((h ^ byte) * 0x01000193) & 0xFFFFFFFF
    return f"mpich_shm_{h:x}"


class SlurmCluster:
    """munged, slurmctld and slurmd in one temporary folder; :meth:`srun` runs a job step on it."""

    def __init__(self):
        self.programs = find_programs()
        self.root = Path(tempfile.mkdtemp(prefix="psgrid-slurm-"))
        self.conf = self.root / "slurm.conf"
        self.first_job_id = random.randrange(10_000, 60_000_000)  # below Slurm's MaxJobId (67,043,328)
        self.daemons: dict[str, subprocess.Popen] = {}
        self.logs: dict[str, Path] = {}

    # -- start and stop ------------------------------------------------------------------------

    @classmethod
    def start(cls) -> SlurmCluster:
        """Start a cluster and wait until its node takes jobs (a few seconds)."""
        cluster = cls()
        try:
            cluster._start()
        except BaseException:
            cluster.stop()
            raise
        return cluster

    def _start(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir()
        munge = self.root / "munge"
        munge.mkdir(mode=0o711)
        munge.chmod(0o711)  # munged wants its socket folder executable by all
        key = munge / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self._spawn(
            "munged",
            "-F",
            "--force",
            f"--socket={munge}/munge.socket.2",
            f"--key-file={key}",
            f"--pid-file={munge}/munged.pid",
            f"--seed-file={munge}/munged.seed",
            f"--log-file={self.root}/log/munged.log",
        )
        self._wait(lambda: (munge / "munge.socket.2").exists(), "munged's socket")
        ctld_port, slurmd_port = free_ports(2)
        self.conf.write_text(
            CONFIG.format(
                root=self.root,
                ctld_port=ctld_port,
                slurmd_port=slurmd_port,
                user=_user(),
                node=NODE,
                hostname=socket.gethostname(),
                cpus=NODE_CPUS,
                gpus=NODE_GPUS,
                partition=PARTITION,
                first_job_id=self.first_job_id,
            )
        )
        for i in range(NODE_GPUS):
            (self.root / f"gpu{i}").touch()
        (self.root / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName={NODE} Name=gpu File={self.root}/gpu[0-{NODE_GPUS - 1}]\n"
        )
        self._spawn("slurmctld", "-D", "-i")
        self._spawn("slurmd", "-D", "-N", NODE)
        self._wait(
            lambda: self._client("sinfo", "-h", "-n", NODE, "-o", "%t").stdout.strip() == "idle", "the node to be idle"
        )

    def stop(self) -> None:
        """Cancel every job, stop the daemons and whatever they started, and remove what they left."""
        try:
            next_job_id = self._next_job_id()
            if "slurmctld" in self.daemons and self.daemons["slurmctld"].poll() is None:
                self._client("scancel", f"--partition={PARTITION}", check=False)
                self._wait(
                    lambda: not self._client("squeue", "-h", check=False).stdout.strip(),
                    "jobs to end",
                    timeout=STOP_S,
                    fail=False,
                )
            for name in ("slurmd", "slurmctld", "munged"):
                proc = self.daemons.get(name)
                if proc is not None and proc.poll() is None:
                    proc.terminate()
                    try:
                        proc.wait(STOP_S)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait(STOP_S)
            for pid in self.strays():  # slurmstepd, tasks: anything that outlived the daemons
                _kill(pid)
            wait_for(lambda: not self.strays(), STOP_S, "the cluster's processes to end")
            for path in self.shm_leftovers(next_job_id):
                path.unlink(missing_ok=True)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- what tests use ------------------------------------------------------------------------

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """The environment of a command on this cluster: ours without any enclosing job's, its config,
        this Python's ``psctl`` first on the path, MPI on loopback."""
        env = {k: v for k, v in os.environ.items() if not FOREIGN_ENV.match(k)}
        env.update(
            SLURM_CONF=str(self.conf),
            **MPI_ENV,
            PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        )
        env.update(extra or {})
        return env

    def srun(
        self,
        n: int,
        argv: list[str],
        *,
        timeout: float = 120,
        options: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess:
        """``srun --mpi=pmi2 -n N [OPTIONS] ARGV`` on this cluster, from the checkout's root: the completed
        process (text ``stdout`` and ``stderr``). Fails the test, after cancelling the job, past ``timeout``."""
        minutes = int(timeout // 60) + 1  # Slurm's own limit, a little above ours
        return self._run(
            [self.programs["srun"], "--mpi=pmi2", "-n", str(n), f"--time={minutes}", *options, *argv], timeout, env
        )

    def sbatch(
        self,
        script: Path,
        *args: str,
        options: tuple[str, ...] = (),
        timeout: float = 120,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess:
        """``sbatch [OPTIONS] SCRIPT ARGS`` from the checkout's root, waited for: a completed process with the
        job's exit code and its output (stdout and stderr) as ``stdout``. Fails the test past ``timeout``.

        Waits by asking the controller every 0.2 s (``sbatch --wait`` polls only every 10 s).
        """
        output = self.root / "log" / f"sbatch-{time.monotonic_ns()}.out"
        cmd = [self.programs["sbatch"], "--parsable", f"--output={output}", *options, str(script), *args]
        submitted = self._run(cmd, STOP_S, env)
        assert submitted.returncode == 0, f"{' '.join(cmd)}: {submitted.stderr}"
        job = submitted.stdout.strip().split(";")[0]
        state = {}

        def ended() -> bool:
            shown = self._client("scontrol", "show", "job", job, check=False).stdout
            state.update(re.findall(r"\b(JobState|ExitCode)=(\S+)", shown))
            return state.get("JobState") not in (None, "PENDING", "CONFIGURING", "RUNNING", "COMPLETING")

        try:
            wait_for(ended, timeout, f"batch job {job}", poll=0.2)
        except AssertionError:
            self._client("scancel", job, check=False)
            pytest.fail(f"batch job {job} ({script.name}) did not end in {timeout} s")
        code, signal_number = (int(x) for x in state["ExitCode"].split(":"))
        text = output.read_text(errors="replace") if output.exists() else ""
        return subprocess.CompletedProcess(
            cmd, code or (128 + signal_number if signal_number else 0), text, f"job {job}: {state['JobState']}"
        )

    def strays(self) -> list[int]:
        """Live processes of this cluster besides its daemons and their own helpers: job steps, tasks, sruns.

        Everything the cluster starts inherits ``SLURM_CONF`` naming this cluster's config (the
        daemons have it from us, slurmstepd from slurmd, tasks from srun), however it detaches.
        """
        marker = f"SLURM_CONF={self.conf}".encode()
        daemons = {p.pid for p in self.daemons.values() if p.poll() is None}
        found = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in daemons:
                continue
            try:
                environ = Path(f"/proc/{entry}/environ").read_bytes()
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):  # gone, or not ours to read
                continue
            if marker in environ.split(b"\0") and parent not in daemons and alive(int(entry)):
                found.append(int(entry))
        return found

    def shm_leftovers(self, next_job_id: int | None = None) -> list[Path]:
        """MPICH start-up files in /dev/shm that belong to this cluster's jobs (any of their first steps)."""
        last = next_job_id if next_job_id is not None else self._next_job_id()
        names = {mpich_shm_name(f"{job}.{step}") for job in range(self.first_job_id, last) for step in range(8)}
        shm = Path("/dev/shm")
        return sorted(p for p in shm.glob("mpich_shm_*") if p.name.rsplit("_", 1)[0] in names) if shm.is_dir() else []

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(
            f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
            for name, path in self.logs.items()
            if path.exists()
        )

    # -- helpers -------------------------------------------------------------------------------

    def _run(self, cmd: list[str], timeout: float, env: dict[str, str] | None) -> subprocess.CompletedProcess:
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=self.env(env),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate(timeout=STOP_S)
            self._client("scancel", f"--partition={PARTITION}", check=False)
            pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s:\n{out}\n{err}")
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(STOP_S)
        return subprocess.CompletedProcess(cmd, proc.returncode, out, err)

    def _spawn(self, name: str, *args: str) -> None:
        self.logs[name] = self.root / "log" / f"{name}.out"
        with open(self.logs[name], "wb") as log:
            self.daemons[name] = subprocess.Popen(
                [self.programs[name], *args],
                env=self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def _client(self, name: str, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        try:
            result = subprocess.run(
                [self.programs[name], *args], env=self.env(), capture_output=True, text=True, timeout=STOP_S
            )
        except subprocess.TimeoutExpired:
            if check:
                raise
            return subprocess.CompletedProcess(args, -1, "", "")
        return result

    def _next_job_id(self) -> int:
        """The id the controller would give the next job (so every id this cluster used is below it)."""
        proc = self.daemons.get("slurmctld")
        if proc is None or proc.poll() is not None:
            return self.first_job_id
        found = re.search(r"NEXT_JOB_ID\s*=\s*(\d+)", self._client("scontrol", "show", "config", check=False).stdout)
        return int(found.group(1)) if found else self.first_job_id + 1000

    def _wait(self, ready, what: str, timeout: float = START_S, fail: bool = True) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            dead = [name for name, p in self.daemons.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                if not fail:
                    return
                why = f"{', '.join(dead)} exited" if dead else f"not within {timeout:.0f} s"
                raise RuntimeError(f"Slurm test cluster: waiting for {what}: {why}\n{self.log_tail()}")
            time.sleep(0.1)


def _user() -> str:
    import pwd

    return pwd.getpwuid(os.getuid()).pw_name


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":  # by hand: start a cluster, run srun ARGS on it, stop it
    c = SlurmCluster.start()
    try:
        r = c.srun(int(sys.argv[1]), sys.argv[2:])
        print(r.stdout, r.stderr, f"exit {r.returncode}", sep="\n")
    finally:
        c.stop()
