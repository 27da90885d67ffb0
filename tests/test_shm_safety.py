"""The shared-memory plane as an attacker with the token sees it: no mapped peer kills a shard or changes its weights.

Every peer here speaks the plane's frames by hand (tcp_frames.py, file descriptors over the
Unix socket), so the shard's checks are what is tested, not the client's. A shard that an
attack could kill (SIGBUS) runs in a subprocess, so a regression fails the test instead of
killing the test run.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import itertools
import json
import mmap
import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from psgrid.psserver import shared_memory
from psgrid.psserver.client.client import Client
from psgrid.psserver.protocol import BFLOAT16, FLOAT32, Reason, Status
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.state.weight_ring import MAX_SHARED_READERS, MAX_VERSIONS
from psgrid.psserver.transports.stream_frames import (
    ATTACH,
    FD_BYTE,
    MAGIC,
    MAP,
    MAX_MESSAGE,
    NO_MARK,
    OPEN,
    PULL,
    PUSH,
    REPLY,
    REQUEST,
    recv_exact,
    recv_struct,
)
from tests.support import ROOT

pytestmark = pytest.mark.skipif(not shared_memory.available(), reason="no memfd on this host")

SIZE = 3000  # elements: several pages, not a whole number of them
SPEC = ModelSpec([("w", (SIZE,))])
F_SEAL_FUTURE_WRITE = 0x10
FALLOC_FL_PUNCH_HOLE = 0x02 | 0x01  # with KEEP_SIZE, as the kernel requires
SERVE = """
import json, sys
from psgrid.psserver.config import ServerConfig
from psgrid.psserver.server import serve
server = serve(ServerConfig(**json.loads(sys.argv[1])))
print(server.address, flush=True)
sys.stdin.read()          # serves until the test closes this pipe (or kills it)
server.stop()
"""


class Refused(Exception):
    def __init__(self, status: int, reason: int, message: str):
        super().__init__(f"{Status(status).name} {Reason.from_code(reason).name}: {message}")
        self.status, self.reason, self.message = Status(status), Reason.from_code(reason), message


class Peer:
    """One connection to a shard's shared-memory plane, speaking its frames by hand."""

    def __init__(self, path: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(path)

    def call(
        self,
        op: int,
        *,
        dtype: int = 0,
        worker: int = 0,
        clock: int = 0,
        version: int = 0,
        nbytes: int = 0,
        fd: int | None = None,
    ) -> tuple:
        self.sock.sendall(REQUEST.pack(MAGIC, op, dtype, worker, clock, version, nbytes, 0.0))
        if fd is not None:
            socket.send_fds(self.sock, [FD_BYTE], [fd])
        _, status, reason, outcome, version, staleness, next_clock, nbytes = recv_struct(self.sock, REPLY)
        if status:
            text = bytearray(min(nbytes, MAX_MESSAGE))
            recv_exact(self.sock, memoryview(text))
            raise Refused(status, reason, text.decode())
        return outcome, version, staleness, next_clock

    def receive_fd(self) -> int:
        _, fds, _, _ = socket.recv_fds(self.sock, 1, 1)
        assert len(fds) == 1, "the shard sent no descriptor"
        return fds[0]

    def open(self) -> tuple[int, int]:
        """This connection's slot in the marks table, and the table's descriptor."""
        _, slot, _, _ = self.call(OPEN)
        return slot, self.receive_fd()

    def map(self, index: int) -> int:
        self.call(MAP, clock=index)
        return self.receive_fd()

    def pull(self, worker: int, clock: int = 0) -> tuple[int, int]:
        """(version, index of the buffer that holds it)."""
        _, version, index, _ = self.call(PULL, worker=worker, clock=clock)
        return version, index

    def close(self) -> None:
        self.sock.close()


def memfd(nbytes: int, seals: int = 0) -> int:
    fd = os.memfd_create("attacker", os.MFD_CLOEXEC | (os.MFD_ALLOW_SEALING if seals else 0))
    os.ftruncate(fd, nbytes)
    if seals:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    return fd


def punch_hole(fd: int, nbytes: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE, 0, nbytes) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


class ShardProcess:
    """A shard in a subprocess (an attack that works kills it, not the test run), and a worker of it."""

    def __init__(self, **settings):
        config = dict(host="127.0.0.1", port=0, lr=1.0, **settings)
        env = dict(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, json.dumps(config)],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            self.address = self.proc.stdout.readline().strip()
            assert self.address, f"the shard did not start (exit {self.proc.wait(10)})"
            self.worker = Client([self.address], SPEC, init=np.full(SIZE, 100, np.float32), deadline_s=10, retry_s=2)
            self.worker.join()
            self.params = np.zeros(SIZE, np.float32)
            self.worker.pull(self.params).wait()
            plane = self.worker._conn.planes[0]
            assert plane.name == "shm", f"the worker uses the {plane.name} plane"
            self.path = plane.path
        except BaseException:
            self.close()
            raise

    def alive(self) -> bool:
        return self.proc.poll() is None

    def death(self) -> str:
        code = self.proc.wait(10)
        return f"the shard died (exit {code}{', SIGBUS' if code == -7 else ''})"

    def step(self) -> None:
        """One legitimate push of ones and a pull: with lr 1 every element drops by exactly 1."""
        grad = self.worker.gradient_buffer()
        grad[:] = 1
        self.worker.push(grad).wait()
        self.worker.pull(self.params).wait()

    def close(self) -> None:
        worker = getattr(self, "worker", None)
        if worker is not None and self.alive():
            worker.close()
        if self.alive():
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self.proc.stdout.close()


@pytest.fixture
def shard_process():
    made = []

    def start(**settings) -> ShardProcess:
        made.append(ShardProcess(**settings))
        return made[-1]

    yield start
    for shard in made:
        if shard.proc.poll() is None:
            shard.close()
        else:
            shard.proc.stdout.close()


# ----- finding 1: gradient files ----------------------------------------------------------------------


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_an_unsealed_gradient_file_is_refused_and_shrinking_one_cannot_kill_the_shard(shard_process, mode):
    shard = shard_process(mode=mode)
    peer = Peer(shard.path)
    fd = memfd(SIZE * 4)
    try:
        try:
            peer.call(ATTACH, dtype=FLOAT32, nbytes=SIZE * 4, fd=fd)
            refusal = None
        except Refused as exc:
            refusal = exc
        if refusal is None:  # taken: the attack goes on, as it would against a shard that took it
            os.ftruncate(fd, 0)
            try:
                peer.call(PUSH, dtype=FLOAT32, worker=shard.worker.worker_id, clock=0)
            except (Refused, OSError):
                pass
            time.sleep(0.2)
            assert shard.alive(), shard.death()
        assert refusal is not None, "the shard took a gradient file its worker may shrink"
        assert refusal.status is Status.INVALID_ARGUMENT and refusal.reason is Reason.BAD_VALUE
        assert "F_SEAL_SHRINK" in refusal.message and "MFD_ALLOW_SEALING" in refusal.message
        shard.step()
        np.testing.assert_array_equal(shard.params, 99)
    finally:
        os.close(fd)
        peer.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_worker_cannot_shrink_its_own_gradient_file(shard_process, mode):
    shard = shard_process(mode=mode)
    shard.step()  # the gradient file is attached now
    _, fd = shard.worker._memory.segment(FLOAT32)
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    assert seals & fcntl.F_SEAL_SHRINK and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SEAL
    with pytest.raises(PermissionError):
        os.ftruncate(fd, 0)
    shard.step()
    assert shard.alive()
    np.testing.assert_array_equal(shard.params, 98)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["shm"])
def test_attach_takes_only_a_sealed_memfd_of_the_models_size(cluster, data_plane):
    c = cluster(1)
    with c.client(SPEC, init=SPEC.flat()) as client:
        client.pull(np.zeros(SIZE, np.float32)).wait()
        peer = Peer(client._conn.planes[0].path)
        fixed = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
        cases = [
            ("larger than the model", memfd(1 << 40, fixed), 1 << 40, Reason.BAD_SIZE),
            ("smaller than declared", memfd(SIZE * 2, fixed), SIZE * 4, Reason.BAD_SIZE),
            ("sealed against shrinking only", memfd(SIZE * 4, fcntl.F_SEAL_SHRINK), SIZE * 4, Reason.BAD_VALUE),
        ]
        r, w = os.pipe()
        cases.append(("a pipe", r, SIZE * 4, Reason.BAD_VALUE))
        try:
            for what, fd, nbytes, reason in cases:
                with pytest.raises(Refused) as refused:
                    peer.call(ATTACH, dtype=FLOAT32, nbytes=nbytes, fd=fd)
                assert refused.value.reason is reason, what
            fd = memfd(SIZE * 2, fixed)
            cases.append(("half precision", fd, 0, None))
            peer.call(ATTACH, dtype=BFLOAT16, nbytes=SIZE * 2, fd=fd)  # a sealed one is taken
        finally:
            for _, fd, _, _ in cases:
                os.close(fd)
            os.close(w)
            peer.close()


def test_attach_refuses_a_hugetlb_file():
    """Holes punched in a hugetlbfs file fault as SIGBUS once the pool is empty: only tmpfs memfds are taken."""
    from psgrid.psserver.transports.shm_server import check_gradient_file

    try:
        fd = os.memfd_create("huge", os.MFD_CLOEXEC | os.MFD_HUGETLB | os.MFD_ALLOW_SEALING)
    except OSError:
        pytest.skip("no hugetlbfs here")
    try:
        os.ftruncate(fd, 2 << 20)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
        with pytest.raises(Exception, match="hugetlbfs|memfd"):
            check_gradient_file(fd)
    finally:
        os.close(fd)


# ----- finding 1: the weights and the marks table handed out --------------------------------------------


def expect_refused(what: str, attempt) -> None:
    try:
        attempt()
    except OSError as exc:
        assert exc.errno in (errno.EPERM, errno.EACCES, errno.EBADF, errno.EINVAL), (what, exc)
    else:
        raise AssertionError(f"a peer could {what}")


@pytest.mark.timeout(60)
def test_a_mapped_weight_buffer_cannot_be_written_truncated_or_punched(shard_process):
    shard = shard_process(mode="async")
    peer = Peer(shard.path)
    slot, marks_fd = peer.open()
    _, index = peer.pull(shard.worker.worker_id)
    fd = peer.map(index)
    nbytes = SIZE * 4
    reopened = -1
    try:
        expect_refused(
            "map the weights writable", lambda: mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        )
        expect_refused("write the weights", lambda: os.pwrite(fd, np.full(4, np.nan, np.float32).tobytes(), 0))
        expect_refused("punch a hole in the weights", lambda: punch_hole(fd, nbytes))
        expect_refused("truncate the weights", lambda: os.ftruncate(fd, 0))
        expect_refused("add a seal to the weights", lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE))
        reopened = os.open(f"/proc/self/fd/{fd}", os.O_RDWR)  # the inode's mode lets its owner reopen it
        expect_refused(
            "map the reopened weights writable",
            lambda: mmap.mmap(reopened, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE),
        )
        expect_refused("write the reopened weights", lambda: os.pwrite(reopened, b"\xff" * 16, 0))
        expect_refused("truncate the reopened weights", lambda: os.ftruncate(reopened, 0))
        expect_refused("punch a hole in the reopened weights", lambda: punch_hole(reopened, nbytes))
        # the marks table: every reader writes its own slot, nobody may resize it
        expect_refused("truncate the marks table", lambda: os.ftruncate(marks_fd, 0))
        expect_refused("grow the marks table", lambda: os.ftruncate(marks_fd, 1 << 20))
        marks = np.frombuffer(
            mmap.mmap(marks_fd, MAX_SHARED_READERS * 8, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), np.int64
        )
        marks[slot] = NO_MARK
        for step in range(3):
            shard.step()
            assert shard.alive(), shard.death()
            np.testing.assert_array_equal(shard.params, 99 - step)  # finite, and what the updates made
    finally:
        for d in (fd, marks_fd, reopened):
            if d >= 0:
                os.close(d)
        peer.close()


# ----- finding 2: marks held forever, garbage in the table ------------------------------------------------


def untorn(params: np.ndarray, version: int) -> None:
    """With lr 1 and every gradient ones, version v's weights are 100 - v everywhere."""
    assert (params == params[0]).all(), "a torn read: the weights differ along the range"
    assert params[0] == 100 - version, (params[0], version)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("data_plane", ["shm"])
def test_readers_that_hold_their_marks_forever_cannot_grow_the_ring(cluster, data_plane):
    c = cluster(1, mode="async", lr=1.0)
    shard = c.shard(0)
    with c.client(SPEC, init=np.full(SIZE, 100, np.float32)) as client:
        params = np.zeros(SIZE, np.float32)
        client.pull(params).wait()
        grad = client.gradient_buffer()
        grad[:] = 1
        path = client._conn.planes[0].path
        peers, fds = [], []
        try:
            for _ in range(40):  # each holds the version it pulled, and never lets go
                peers.append(Peer(path))
                fds.append(peers[-1].open()[1])
                peers[-1].pull(client.worker_id)
                client.push(grad).wait()
                versions = client.pull(params).wait()
                untorn(params, versions[0])
            assert len(shard.ring.arrays) <= MAX_VERSIONS
            revoked = shard.stats()["revoked_reads"]
            assert revoked >= 40 - MAX_VERSIONS
            # garbage everywhere: indices out of range, huge numbers, every buffer's index in every slot
            marks = np.frombuffer(
                mmap.mmap(fds[0], MAX_SHARED_READERS * 8, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE), np.int64
            )
            rng = np.random.default_rng(0)
            for _ in range(20):
                marks[:] = rng.choice([-(1 << 63), -7, 2, 0, 1, MAX_VERSIONS, 1 << 62], MAX_SHARED_READERS)
                client.push(grad).wait()
                versions = client.pull(params).wait()
                untorn(params, versions[0])
            marks[:] = np.arange(MAX_SHARED_READERS) % MAX_VERSIONS
            for _ in range(20):
                client.push(grad).wait()
                versions = client.pull(params).wait()
                untorn(params, versions[0])
            assert len(shard.ring.arrays) <= MAX_VERSIONS
            assert shard.version == 80 and np.isfinite(shard.weights).all()
        finally:
            for fd in fds:
                os.close(fd)
            for peer in peers:
                peer.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("data_plane", ["shm"])
def test_a_reader_whose_mark_is_revoked_reads_again_and_never_returns_torn_weights(cluster, data_plane):
    """A slow reader; updates racing it; peers that keep the ring at its cap by marking each new version."""
    c = cluster(1, mode="async", lr=1.0)
    shard = c.shard(0)
    with c.client(SPEC, init=np.full(SIZE, 100, np.float32)) as reader, c.client(SPEC) as writer:
        grad = writer.gradient_buffer()
        grad[:] = 1
        path = reader._conn.planes[0].path
        holders = [Peer(path) for _ in range(MAX_VERSIONS)]
        fds = [peer.open()[1] for peer in holders]
        stop = threading.Event()
        calls = [0]

        def push_and_hold():
            for pushed in itertools.count():
                if stop.is_set():
                    return
                writer.push(grad).wait()
                holders[pushed % len(holders)].pull(writer.worker_id)

        def read_slowly(begin, end, values):
            # Every other read copies its first page, then waits for more versions than the ring
            # holds before it copies the rest (its mark is revoked meanwhile); the read after it
            # is quick, as a reader's usually is.
            calls[0] += 1
            started = shard.version
            params[begin : begin + 1024] = values[:1024]
            if calls[0] % 2:
                deadline = time.monotonic() + 10
                while shard.version <= started + MAX_VERSIONS and time.monotonic() < deadline:
                    time.sleep(0.002)
            params[begin + 1024 : end] = values[1024:]

        params = np.zeros(SIZE, np.float32)
        pusher = threading.Thread(target=push_and_hold, daemon=True)
        pusher.start()
        try:
            for _ in range(10):
                versions = reader.pull(into=read_slowly).wait()
                untorn(params, versions[0])
        finally:
            stop.set()
            pusher.join(10)
            for fd in fds:
                os.close(fd)
            for peer in holders:
                peer.close()
        assert len(shard.ring.arrays) <= MAX_VERSIONS
        assert shard.stats()["revoked_reads"] > 0, "the updates never caught up with the reader"
        assert calls[0] > 10, "no read was taken back and done again"
