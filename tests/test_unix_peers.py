"""The machinery the shared-memory plane and a host's aggregation meet on (psserver/transports/unix_peers.py).

Over a real abstract socket: a memfd's descriptor crosses with a message and the other end reads what
was written through it; a receiver is left with no more descriptors than it asked for; a peer of
another user is refused (by forking a child that drops to ``nobody``, where the tests run as root);
and the refusal's wording, with a stand-in socket whose kernel says any uid.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import time

import pytest

from psgrid.psserver.transports.unix_peers import (
    PEERCRED,
    abstract_address,
    abstract_listener,
    peer_refusal,
    peer_uid,
    receive_one_fd,
    receive_with_fds,
    send_with_fds,
    unix_connection,
)

NOBODY = 65534
WAIT_S = 5.0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@contextlib.contextmanager
def connected_pair():
    """A listener on a fresh abstract name, a client connected to it, and the server's end of that connection."""
    name = f"psgrid-test-{secrets.token_hex(8)}"
    with abstract_listener(name, 4) as listener:
        listener.settimeout(WAIT_S)
        with unix_connection(abstract_address(name), WAIT_S) as client:
            server, _ = listener.accept()
            with server:
                server.settimeout(WAIT_S)
                yield server, client


def memfd_holding(data: bytes) -> int:
    fd = os.memfd_create("psgrid-test")
    os.write(fd, data)
    return fd


def test_a_memfds_descriptor_crosses_with_a_message_and_reads_what_was_written():
    with connected_pair() as (server, client):
        fd = memfd_holding(b"weights of step 7")
        try:
            send_with_fds(server, b"W", [fd])
        finally:
            os.close(fd)  # the receiver has its own copy: the file lives on
        data, fds = receive_with_fds(client, 1, 1)
        assert data == b"W" and len(fds) == 1
        try:
            assert os.pread(fds[0], 64, 0) == b"weights of step 7"
        finally:
            os.close(fds[0])

        # the other way, one descriptor expected: receive_one_fd gives it, or None when only bytes came
        fd = memfd_holding(b"gradient")
        try:
            send_with_fds(client, b"G", [fd])
        finally:
            os.close(fd)
        got = receive_one_fd(server, 1)
        assert got is not None
        try:
            assert os.pread(got, 64, 0) == b"gradient"
        finally:
            os.close(got)
        client.sendall(b"G")
        assert receive_one_fd(server, 1) is None


def test_descriptors_past_those_asked_for_are_not_left_open():
    with connected_pair() as (server, client):
        sent = [memfd_holding(b"x") for _ in range(3)]
        try:
            before = open_fds()
            send_with_fds(server, b"M", sent)
            data, fds = receive_with_fds(client, 1, 1)
            assert data == b"M" and len(fds) == 1
            assert open_fds() == before + 1  # the one taken; the two others closed on the way
            os.close(fds[0])
            assert open_fds() == before
        finally:
            for fd in sent:
                os.close(fd)


def test_a_name_nobody_listens_on_or_one_taken_fails_and_leaves_no_socket_open():
    name = f"psgrid-test-{secrets.token_hex(8)}"
    before = open_fds()
    with pytest.raises(ConnectionRefusedError):
        unix_connection(abstract_address(name), WAIT_S)
    with abstract_listener(name, 1):
        with pytest.raises(OSError):
            abstract_listener(name, 1)
    assert open_fds() == before


def test_a_peer_of_this_user_is_welcome():
    with connected_pair() as (server, client):
        assert peer_uid(server) == peer_uid(client) == os.geteuid()
        assert peer_refusal(server, "this test's socket") is None
        assert peer_refusal(client, "this test's socket") is None


class KernelSays:
    """A socket whose kernel says its peer is ``uid`` (SO_PEERCRED)."""

    def __init__(self, uid: int):
        self.uid = uid

    def getsockopt(self, level, option, size):
        assert (level, option, size) == (socket.SOL_SOCKET, socket.SO_PEERCRED, PEERCRED.size)
        return PEERCRED.pack(1234, self.uid, self.uid)


def test_the_refusal_names_who_may_connect():
    me = os.geteuid()
    assert peer_refusal(KernelSays(me), "this shard's shared memory") is None
    assert peer_refusal(KernelSays(0), "this shard's shared memory") is None  # root may (it may anyway)
    stranger = me + 1 if me not in (NOBODY - 1, NOBODY) else 4242
    refusal = peer_refusal(KernelSays(stranger), "this shard's shared memory")
    assert refusal == f"this shard's shared memory is for processes of user {me} only"


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user takes root")
def test_a_peer_of_another_user_is_refused():
    name = f"psgrid-test-{secrets.token_hex(8)}"
    with abstract_listener(name, 1) as listener:
        listener.settimeout(WAIT_S)
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.setuid(NOBODY)
                with unix_connection(abstract_address(name), WAIT_S) as sock:
                    sock.recv(1)  # until the parent closes its end
                code = 0
            finally:
                os._exit(code)
        try:
            server, _ = listener.accept()
            with server:
                assert peer_uid(server) == NOBODY
                assert peer_refusal(server, "this host's aggregation") == (
                    f"this host's aggregation is for processes of user {os.geteuid()} only"
                )
        finally:
            assert exit_code(pid) == 0


def exit_code(pid: int) -> int | None:
    """The child's exit code, waiting at most WAIT_S; killed (and reaped) past it."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return None
