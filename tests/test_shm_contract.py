"""The shared-memory plane's frames, as a client in another language would write them.

The peer here writes raw frames from the layout that docs/wire.md (section 3, "The
shared-memory plane") describes, spelled out below: no psgrid client code and no psgrid frame module, so a
change to the bytes on the wire fails here. It joins through tests/wire_client.py (gRPC only),
then opens, maps, pulls and pushes over the Unix socket, and gets each documented refusal. Values
are small dyadic numbers and lr is 1/2, so the weights it reads back are exact.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import socket
import struct

import numpy as np
import pytest

from psgrid.psserver import shared_memory
from tests.wire_client import WireWorker

pytestmark = [
    pytest.mark.skipif(not shared_memory.available(), reason="no memfd on this host"),
    pytest.mark.parametrize("data_plane", ["shm"]),
]

# ----- the contract: header layouts, operations, numbers ------------------------------------------
MAGIC = b"PST2"
REQUEST = struct.Struct("<4sBBqqQQd")  # magic, op, dtype byte, worker, clock, version, nbytes, timeout_s: 48 bytes
REPLY = struct.Struct("<4sBBBQqqQ")  # magic, status, reason, outcome, version, staleness, next_clock, nbytes
HELLO, PULL, PUSH, OPEN, MAP, ATTACH = 1, 2, 3, 4, 5, 6
FLOAT32 = 1  # the low four bits of the dtype byte; the high four: the gradient file
OK, INVALID_ARGUMENT, FAILED_PRECONDITION, UNAUTHENTICATED = 0, 3, 9, 16  # statuses: gRPC's numbers
MALFORMED, BAD_SIZE, BAD_DTYPE, BAD_VALUE, UNKNOWN_WORKER = 1, 2, 4, 7, 10  # reasons: proto/ps.proto's
NO_MARK = -1  # a reader's slot in the marks table once its copy is done
TOKEN = "shm-contract-token"
PARAMS = [("w", [1000]), ("b", [24])]
SIZE = 1024


class Refused(Exception):
    def __init__(self, status: int, reason: int, text: str):
        super().__init__(f"status {status} reason {reason}: {text}")
        self.status, self.reason, self.text = status, reason, text


class RawPeer:
    """One connection to the shard's abstract Unix socket, speaking the frames by hand."""

    def __init__(self, address: str):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect("\0" + address[1:])  # "@name": Linux's abstract namespace

    def send(
        self,
        op: int,
        *,
        dtype=0,
        worker=0,
        clock=0,
        version=0,
        nbytes=0,
        timeout_s=0.0,
        payload=b"",
        fd: int | None = None,
    ) -> None:
        self.sock.sendall(REQUEST.pack(MAGIC, op, dtype, worker, clock, version, nbytes, timeout_s) + payload)
        if fd is not None:
            socket.send_fds(self.sock, [b"F"], [fd])

    def reply(self) -> tuple[int, int, int, int]:
        """(outcome, version, staleness, next_clock); a refusal raised with its status, reason and text."""
        magic, status, reason, outcome, version, staleness, next_clock, nbytes = REPLY.unpack(self.read(REPLY.size))
        assert magic == MAGIC
        if status != OK:
            raise Refused(status, reason, self.read(nbytes).decode())
        assert nbytes == 0
        return outcome, version, staleness, next_clock

    def call(self, op: int, **fields) -> tuple[int, int, int, int]:
        self.send(op, **fields)
        return self.reply()

    def read(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            more = self.sock.recv(n - len(data))
            assert more, "the shard closed the connection"
            data += more
        return data

    def receive_fd(self) -> int:
        _, fds, _, _ = socket.recv_fds(self.sock, 1, 1)
        assert len(fds) == 1, "no file descriptor came with the reply"
        return fds[0]

    def closed_by_shard(self) -> bool:
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def close(self) -> None:
        self.sock.close()


def refusal(peer: RawPeer, op: int, **fields) -> Refused:
    with pytest.raises(Refused) as refused:
        peer.call(op, **fields)
    return refused.value


def gradient_file(values: np.ndarray, seal: bool = True) -> int:
    """The whole model's gradient in a sealed memfd, as the shard requires."""
    fd = os.memfd_create("grad", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.write(fd, values.astype("<f4").tobytes())
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def shm_address(cluster) -> str:
    return cluster.servers[0].shm.address  # what RegisterReply names the shard's shm socket


@pytest.fixture
def joined(cluster):
    """A one-shard async job with a token; a wire worker joined it and set every weight to 2."""
    c = cluster(1, mode="async", optimizer="sgd", lr=0.5, token=TOKEN)
    worker = WireWorker(c.addresses, PARAMS, TOKEN, world=1).join([2.0] * SIZE)
    peer = RawPeer(shm_address(c))
    yield c, worker, peer
    peer.close()
    worker.close()


@pytest.mark.timeout(30)
def test_open_map_pull_attach_push_by_hand(joined):
    c, worker, peer = joined
    peer.call(HELLO, nbytes=len(TOKEN), payload=TOKEN.encode())
    _, slot, _, _ = peer.call(OPEN)  # the slot comes in ``version``
    marks_fd = peer.receive_fd()
    marks = np.frombuffer(mmap.mmap(marks_fd, os.fstat(marks_fd).st_size), "<i8")
    os.close(marks_fd)

    _, version, index, _ = peer.call(PULL, worker=worker.worker_id, clock=0, timeout_s=5.0)  # index in ``staleness``
    assert version == 0 and marks[slot] == index
    _, nbytes, _, _ = peer.call(MAP, clock=index)  # MAP: the index in ``clock``, bytes in ``version``
    buffer_fd = peer.receive_fd()
    assert nbytes == 4 * SIZE
    with mmap.mmap(buffer_fd, nbytes, prot=mmap.PROT_READ) as weights:
        assert np.frombuffer(weights, "<f4").tolist() == [2.0] * SIZE
    marks[slot] = NO_MARK  # done reading: the shard may write it again

    grad = gradient_file(np.full(SIZE, 1.0))
    file_index = 1
    kind = FLOAT32 | file_index << 4
    peer.call(ATTACH, dtype=kind, nbytes=4 * SIZE, fd=grad)
    os.close(grad)
    outcome, new_version, staleness, next_clock = peer.call(
        PUSH, dtype=kind, worker=worker.worker_id, clock=0, version=0, timeout_s=5.0
    )
    assert (new_version, staleness, next_clock) == (1, 0, 1)
    assert c.shard().weights.tolist() == [1.5] * SIZE  # 2 - 0.5 * 1

    _, version, index, _ = peer.call(PULL, worker=worker.worker_id, clock=1, timeout_s=5.0)
    assert version == 1
    peer.call(MAP, clock=index)
    buffer_fd2 = peer.receive_fd()
    with mmap.mmap(buffer_fd2, 4 * SIZE, prot=mmap.PROT_READ) as weights:
        assert np.frombuffer(weights, "<f4").tolist() == [1.5] * SIZE
    marks[slot] = NO_MARK
    for fd in (buffer_fd, buffer_fd2):
        os.close(fd)


@pytest.mark.timeout(30)
def test_each_documented_refusal_and_whether_the_connection_stays(joined):
    c, worker, peer = joined
    # Before the hello: UNAUTHENTICATED, then the shard closes.
    refused = refusal(peer, OPEN)
    assert refused.status == UNAUTHENTICATED and peer.closed_by_shard()
    wrong = RawPeer(shm_address(c))
    refused = refusal(wrong, HELLO, nbytes=5, payload=b"wrong")
    assert refused.status == UNAUTHENTICATED and wrong.closed_by_shard()
    wrong.close()

    peer = RawPeer(shm_address(c))
    try:
        peer.call(HELLO, nbytes=len(TOKEN), payload=TOKEN.encode())
        # Refusals of the service leave the connection in step: each is followed by a call it serves.
        refused = refusal(peer, PULL, worker=worker.worker_id)
        assert (refused.status, refused.reason) == (INVALID_ARGUMENT, MALFORMED) and "OPEN" in refused.text  # malformed
        peer.call(OPEN)
        os.close(peer.receive_fd())
        refused = refusal(peer, PULL, worker=worker.worker_id + 1000, timeout_s=5.0)
        assert (refused.status, refused.reason) == (FAILED_PRECONDITION, UNKNOWN_WORKER)
        refused = refusal(peer, MAP, clock=1 << 40)
        assert (refused.status, refused.reason) == (INVALID_ARGUMENT, BAD_VALUE)  # no such buffer
        refused = refusal(peer, PUSH, dtype=FLOAT32, worker=worker.worker_id)
        assert (refused.status, refused.reason) == (INVALID_ARGUMENT, BAD_DTYPE) and "ATTACH" in refused.text
        for fd, nbytes, reason in [
            (gradient_file(np.zeros(SIZE)), 4 * SIZE + 4, BAD_SIZE),  # not the model's size
            (gradient_file(np.zeros(SIZE), seal=False), 4 * SIZE, BAD_VALUE),
        ]:  # unsealed
            refused = refusal(peer, ATTACH, dtype=FLOAT32, nbytes=nbytes, fd=fd)
            os.close(fd)
            assert (refused.status, refused.reason) == (INVALID_ARGUMENT, reason), refused.text
        _, version, _, _ = peer.call(PULL, worker=worker.worker_id, timeout_s=5.0)
        assert version == 0
        # A frame the shard cannot follow: refused MALFORMED, then closed.
        refused = refusal(peer, 99)
        assert (refused.status, refused.reason) == (INVALID_ARGUMENT, MALFORMED) and peer.closed_by_shard()
    finally:
        peer.close()
    peer = RawPeer(shm_address(c))
    try:
        peer.call(HELLO, nbytes=len(TOKEN), payload=TOKEN.encode())
        refused = refusal(peer, ATTACH, dtype=FLOAT32, nbytes=4 * SIZE, payload=b"F")  # its byte, no descriptor
        assert (refused.status, refused.reason) == (INVALID_ARGUMENT, MALFORMED) and peer.closed_by_shard()
    finally:
        peer.close()
