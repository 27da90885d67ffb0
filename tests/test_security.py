"""Bearer token and mutual TLS, on the gRPC control plane and the TCP data plane alike."""

from __future__ import annotations

import os
import socket
import ssl

import numpy as np
import pytest

from psgrid.psserver.exceptions import ShardUnavailable, Unauthenticated, Unavailable
from psgrid.psserver.protocol import FLOAT32, Reason, Status
from psgrid.psserver.transports.base import ConnectOptions
from psgrid.psserver.transports.stream_frames import HELLO, MAGIC, OPEN, PULL, REPLY, REQUEST, recv_exact, recv_struct
from psgrid.psserver.transports.tcp_client import TcpDataPlane
from tests.support import FEATURES, REGRESSION, make_problem, regression_grad

TOKEN = "s3cret"


def fit(cluster, steps=60, **client_kw):
    """One worker fits the regression; returns the final weights, its data planes and the true weights."""
    x, y, w_true, _ = make_problem(0)
    with cluster.client(REGRESSION, init=REGRESSION.flat(), **client_kw) as client:
        params, grad = REGRESSION.flat(), REGRESSION.flat()
        for _ in range(steps):
            client.pull(params).wait()
            client.push(regression_grad(params, x, y, out=grad)).wait()
        client.pull(params).wait()
        return params, client.data_planes, w_true


def shard_state(server):
    shard = server.shard
    with shard.cond:
        return (
            None if shard.weights is None else shard.weights.copy(),
            shard.version,
            dict(shard.policy.clocks),
            shard.counters.pushes,
            shard.counters.pulls,
        )


def assert_same_state(before, after):
    if before[0] is None:
        assert after[0] is None
    else:
        np.testing.assert_array_equal(before[0], after[0])
    assert before[1:] == after[1:]


# ----- bearer token -------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_right_token_trains(cluster, data_plane, tcp_calls):
    c = cluster(2, mode="sync", lr=0.3, token=TOKEN)
    params, planes, w_true = fit(c, token=TOKEN)
    np.testing.assert_allclose(params[:FEATURES], w_true, atol=0.05)
    assert all(s.shard.version == 60 for s in c.servers) and planes == [data_plane] * 2
    expected = {"push": 2 * 60, "pull": 2 * 61} if data_plane == "tcp" else {"pull": 0, "push": 0}
    assert tcp_calls == expected


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["tcp"])  # refused by the control connection, before any data plane
@pytest.mark.parametrize("token", [None, "wrong", "s3cre", "s3cret "])
def test_a_missing_or_wrong_token_is_refused_on_the_control_plane(cluster, token):
    c = cluster(1, mode="async", token=TOKEN)
    before = shard_state(c.servers[0])
    with pytest.raises(Unauthenticated) as err:
        with c.client(REGRESSION, init=REGRESSION.flat(), token=token, retry_s=1):
            pass
    assert err.value.reason is Reason.UNAUTHENTICATED
    with pytest.raises(Unauthenticated):
        c.admin(token=token).stats()  # control calls raise the same domain error
    assert_same_state(before, shard_state(c.servers[0]))
    assert c.shard().members.leases.members == {}


@pytest.fixture
def token_job(cluster):
    """A token-protected async shard, initialised, with one worker registered by a client holding the token."""
    c = cluster(1, mode="async", token=TOKEN)
    client = c.client(REGRESSION, init=np.arange(REGRESSION.size, dtype=np.float32), token=TOKEN).join()
    client.push(np.ones(REGRESSION.size, np.float32)).wait()
    return c, client.worker_id


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["tcp"])
@pytest.mark.parametrize("token", [None, "wrong"])
def test_the_tcp_plane_refuses_without_or_with_a_wrong_token(token_job, token):
    c, worker = token_job
    server = c.servers[0]
    before = shard_state(server)
    plane = TcpDataPlane("127.0.0.1", server.tcp.port, ConnectOptions(token=token))
    try:
        out = np.empty(REGRESSION.size, np.float32)
        with pytest.raises(Unauthenticated):
            plane.pull_into(out, begin=0, worker_id=worker, clock=1, timeout_s=5)
        with pytest.raises(Unauthenticated):
            plane.push(
                np.ones(REGRESSION.size, np.float32),
                begin=0,
                wire_dtype=FLOAT32,
                worker_id=worker,
                clock=1,
                version=1,
                timeout_s=5,
            )
    finally:
        plane.close()
    assert_same_state(before, shard_state(server))
    plane = TcpDataPlane("127.0.0.1", server.tcp.port, ConnectOptions(token=TOKEN))  # the right one works
    try:
        out = np.empty(REGRESSION.size, np.float32)
        assert plane.pull_into(out, begin=0, worker_id=worker, clock=1, timeout_s=5) == before[1]
        np.testing.assert_array_equal(out, before[0])
    finally:
        plane.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["tcp"])
def test_the_hello_must_come_first_and_a_refused_hello_closes(token_job):
    c, worker = token_job
    server = c.servers[0]
    before = shard_state(server)
    with socket.create_connection(("127.0.0.1", server.tcp.port), timeout=5) as sock:
        # a pull with no hello: refused, then the shard closes the connection
        sock.sendall(REQUEST.pack(MAGIC, PULL, FLOAT32, worker, 1, 0, 0, 5.0))
        reply = _read_reply(sock)
        assert (reply[1], reply[2]) == (Status.UNAUTHENTICATED, Reason.UNAUTHENTICATED)
        assert sock.recv(1) == b""
    with socket.create_connection(("127.0.0.1", server.tcp.port), timeout=5) as sock:
        wrong = b"S3CRET"
        sock.sendall(REQUEST.pack(MAGIC, HELLO, 0, 0, 0, 0, len(wrong), 0.0) + wrong)
        assert _read_reply(sock)[1] == Status.UNAUTHENTICATED
        assert sock.recv(1) == b""
    assert_same_state(before, shard_state(server))


def _read_reply(sock):
    fields = recv_struct(sock, REPLY)
    recv_exact(sock, memoryview(bytearray(fields[-1])))  # the refusal's text
    return fields


# ----- mutual TLS ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """``psctl certs`` twice: this job's CA and certificates, and another job's (right shape, wrong issuer)."""
    from psgrid.cluster.job.pki import make_certs

    d = tmp_path_factory.mktemp("pki")
    ours = make_certs(d / "job", ["localhost", "127.0.0.1"], days=2)
    theirs = make_certs(d / "other", ["localhost", "127.0.0.1"], days=2)
    return {
        "ca": str(ours["ca_cert"]),
        "server_cert": str(ours["shard_cert"]),
        "server_key": str(ours["shard_key"]),
        "client_cert": str(ours["client_cert"]),
        "client_key": str(ours["client_key"]),
        "rogue_cert": str(theirs["client_cert"]),
        "rogue_key": str(theirs["client_key"]),
    }


def client_tls(certs, who: str = "valid") -> dict:
    return {
        "valid": dict(tls_ca=certs["ca"], tls_cert=certs["client_cert"], tls_key=certs["client_key"]),
        "no client cert": dict(tls_ca=certs["ca"]),
        "rogue client cert": dict(tls_ca=certs["ca"], tls_cert=certs["rogue_cert"], tls_key=certs["rogue_key"]),
        "no TLS": {},
    }[who]


@pytest.fixture
def tls_cluster(cluster, certs):
    return cluster(
        2, mode="sync", lr=0.3, tls_cert=certs["server_cert"], tls_key=certs["server_key"], tls_ca=certs["ca"]
    )


@pytest.mark.timeout(60)
def test_a_client_with_a_certificate_of_the_ca_trains_over_mutual_tls(tls_cluster, certs, data_plane, tcp_calls):
    params, planes, w_true = fit(tls_cluster, **client_tls(certs))
    np.testing.assert_allclose(params[:FEATURES], w_true, atol=0.05)
    assert all(s.shard.version == 60 for s in tls_cluster.servers) and planes == [data_plane] * 2
    assert tcp_calls["push"] == (2 * 60 if data_plane == "tcp" else 0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["tcp"])
@pytest.mark.parametrize("host", ["localhost", "127.0.0.1"])
def test_the_tcp_plane_verifies_the_shard_by_name_or_address(tls_cluster, certs, host):
    """The server certificate names localhost and 127.0.0.1, so a client given either verifies it."""
    client = tls_cluster.client(REGRESSION, init=np.ones(REGRESSION.size, np.float32), **client_tls(certs)).join()
    server = tls_cluster.servers[0]
    plane = TcpDataPlane(host, server.tcp.port, ConnectOptions(**client_tls(certs)))
    try:
        out = np.empty(server.shard.size, np.float32)
        assert plane.pull_into(out, begin=0, worker_id=client.worker_id, clock=0, timeout_s=5) == 0
        np.testing.assert_array_equal(out, 1.0)
    finally:
        plane.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["tcp"])  # refused by the control connection, before any data plane
@pytest.mark.parametrize("who", ["no client cert", "rogue client cert", "no TLS"])
def test_a_client_without_a_valid_certificate_is_refused(tls_cluster, certs, who):
    before = [shard_state(s) for s in tls_cluster.servers]
    with pytest.raises(ShardUnavailable):
        with tls_cluster.client(
            REGRESSION, init=REGRESSION.flat(), retry_s=0.5, deadline_s=5, **client_tls(certs, who)
        ):
            pass
    for server, state in zip(tls_cluster.servers, before):
        assert_same_state(state, shard_state(server))
    assert all(s.shard.members.leases.members == {} for s in tls_cluster.servers)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["tcp"])
@pytest.mark.parametrize("who", ["no client cert", "rogue client cert", "no TLS"])
def test_the_tcp_plane_refuses_a_client_without_a_valid_certificate(tls_cluster, certs, who):
    client = tls_cluster.client(REGRESSION, init=np.ones(REGRESSION.size, np.float32), **client_tls(certs)).join()
    server = tls_cluster.servers[0]
    before = shard_state(server)
    plane = TcpDataPlane("localhost", server.tcp.port, ConnectOptions(**client_tls(certs, who)))
    try:
        out = np.empty(server.shard.size, np.float32)
        with pytest.raises(Unavailable):
            plane.pull_into(out, begin=0, worker_id=client.worker_id, clock=0, timeout_s=3)
        with pytest.raises(Unavailable):
            plane.push(
                np.full(server.shard.size, 2.0, np.float32),
                begin=0,
                wire_dtype=FLOAT32,
                worker_id=client.worker_id,
                clock=0,
                version=0,
                timeout_s=3,
            )
    finally:
        plane.close()
    assert_same_state(before, shard_state(server))


def shm_open(address: str, context: ssl.SSLContext | None = None) -> bool:
    """Whether the shard's shared-memory socket hands this connection a reader slot and the marks' descriptor.

    With ``context``, the connection first proves a certificate by a TLS handshake, then goes back
    to plain frames (``unwrap``), as the client of that plane does.
    """
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.settimeout(5)
    owned = [raw]
    try:
        raw.connect("\0" + address[1:])
        sock = raw
        if context is not None:
            tls = context.wrap_socket(raw, server_hostname="localhost")
            owned.append(tls)
            sock = socket.socket(fileno=tls.unwrap().detach())
            owned.append(sock)
            sock.settimeout(5)
        sock.sendall(REQUEST.pack(MAGIC, OPEN, 0, 0, 0, 0, 0, 0.0))
        if _read_reply(sock)[1] != Status.OK:
            return False
        _, fds, _, _ = socket.recv_fds(sock, 1, 1)
        for fd in fds:
            os.close(fd)
        return len(fds) == 1
    except (OSError, ConnectionError):  # ssl.SSLError is an OSError: a refused handshake
        return False
    finally:
        for s in owned:
            s.close()


def tls_context(certs, who: str) -> ssl.SSLContext | None:
    options = client_tls(certs, who)
    if not options:
        return None
    context = ssl.create_default_context(cafile=options["tls_ca"])
    if "tls_cert" in options:
        context.load_cert_chain(options["tls_cert"], options["tls_key"])
    return context


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["shm"])
def test_the_shared_memory_plane_asks_for_the_client_certificate_too(tls_cluster, certs):
    """A token-less shard with mutual TLS: a process of the same user without the certificate gets nothing."""
    tls_cluster.client(REGRESSION, init=np.ones(REGRESSION.size, np.float32), **client_tls(certs)).join()
    server = tls_cluster.servers[0]
    before, slots = shard_state(server), len(server.shard.ring.free_slots)
    for who in ("no TLS", "no client cert", "rogue client cert"):
        assert not shm_open(server.shm.address, tls_context(certs, who)), who
    assert_same_state(before, shard_state(server))
    assert len(server.shard.ring.free_slots) == slots
    assert shm_open(server.shm.address, tls_context(certs, "valid"))


# ----- secure by default: psctl launch ------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_launch_without_a_token_flag_refuses_strangers_and_keeps_its_token_secret(tmp_path):
    import json
    import signal as signals
    from pathlib import Path

    from psgrid.psserver.client.admin import Admin
    from psgrid.psserver.exceptions import FailedPrecondition
    from psgrid.psserver.protocol import parse_address_file
    from tests.support import Launch, assert_token_kept, child_pids, steps_seen

    args = ["--config", "mnist", "--steps", "100000", "--no-progress", "--set", 'stragglers=["0:exp:5", "1:exp:5"]']
    with Launch(tmp_path, *args) as launch:
        out = launch.out
        launch.wait_for(lambda: steps_seen(out, 0) >= 3, 60, "training")
        pids = child_pids(out)
        token = assert_token_kept(out)
        for pid in [launch.proc.pid, *pids["shards"], *pids["workers"]]:  # what `ps` shows every user
            assert token.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        assert "<redacted>" in (out / "job.toml").read_text()
        address, job_id = parse_address_file((out / "addr" / "shard-0").read_text())
        # a stranger (no token, or a wrong one) is refused on the control plane, Shutdown included
        for stranger in (None, token[:-1] + "x"):
            with Admin([address], token=stranger, deadline_s=5, retry_s=1) as admin:
                for call in (admin.stats, lambda: admin.shutdown(job_id), lambda: admin.report_gone(0)):
                    with pytest.raises(Unauthenticated):
                        call()
        with Admin([address], token=token, deadline_s=5, retry_s=1) as admin:
            with pytest.raises(FailedPrecondition):
                admin.shutdown("not-this-job")  # the token alone does not stop it either
            look = admin._look(0)
            assert admin.stats()[0]["initialized"]  # the job's token is served
        # ... and on the TCP data plane
        for hello in (b"", b"wrong"):
            with socket.create_connection(("127.0.0.1", int(look.address("tcp"))), timeout=5) as sock:
                sock.sendall(REQUEST.pack(MAGIC, HELLO, 0, 0, 0, 0, len(hello), 0.0) + hello)
                assert recv_struct(sock, REPLY)[1] == Status.UNAUTHENTICATED
        assert steps_seen(out, 0) >= 3 and launch.proc.poll() is None  # the job goes on
        launch.proc.send_signal(signals.SIGTERM)
        assert launch.wait(30) == 128 + signals.SIGTERM
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["server"]["token"] == "<redacted>" and summary["job_id"] == job_id
    assert_token_kept(out)


def test_psctl_certs_writes_private_keys_for_their_owner_alone(tmp_path, capsys):
    import os
    import stat

    from psgrid.cluster.cli import main

    assert main(["certs", str(tmp_path / "pki"), "--host", "node1", "--host", "10.0.0.7", "--days", "3"]) == 0
    printed = capsys.readouterr().out
    for name in ("ca", "shard", "client"):
        assert stat.S_IMODE(os.stat(tmp_path / "pki" / f"{name}.key").st_mode) == 0o600
        assert f"{name}.pem" in printed
    assert "[server]\ntls_cert = " in printed and "[train]\ntls_ca = " in printed
    from cryptography import x509

    shard = x509.load_pem_x509_certificate((tmp_path / "pki" / "shard.pem").read_bytes())
    names = shard.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert names.get_values_for_type(x509.DNSName) == ["node1"]
    assert [str(a) for a in names.get_values_for_type(x509.IPAddress)] == ["10.0.0.7"]
    before = (tmp_path / "pki" / "ca.pem").read_bytes()
    assert main(["certs", str(tmp_path / "pki")]) == 2  # never overwritten unasked
    assert "already holds" in capsys.readouterr().err
    assert (tmp_path / "pki" / "ca.pem").read_bytes() == before
    assert main(["certs", str(tmp_path / "pki"), "--force"]) == 0
    assert (tmp_path / "pki" / "ca.pem").read_bytes() != before


def test_the_redacted_placeholder_is_never_taken_for_a_token():
    from psgrid.psserver.config import ServerConfig
    from psgrid.psserver.exceptions import InvalidArgument
    from psgrid.psserver.server import RunningServer

    with pytest.raises(InvalidArgument, match="placeholder of a redacted job file"):
        ConnectOptions(token="<redacted>")
    with pytest.raises(InvalidArgument, match="placeholder of a redacted job file"):
        RunningServer(ServerConfig(token="<redacted>"))


def test_a_shard_beyond_loopback_without_token_or_client_certificates_warns(caplog):
    from psgrid.psserver.config import ServerConfig
    from psgrid.psserver.server import is_loopback, warn_if_open

    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("node1")
    assert warn_if_open(ServerConfig(host="0.0.0.0"))  # decided from the settings: nothing is bound
    assert "with no token and no client certificates" in caplog.text
    assert not warn_if_open(ServerConfig(host="0.0.0.0", token="t"))
    assert warn_if_open(ServerConfig(host="node1", tls_cert="c.pem", tls_key="k.pem"))  # TLS, but anyone may connect
    assert not warn_if_open(ServerConfig(host="node1", tls_cert="c.pem", tls_key="k.pem", tls_ca="ca.pem"))
    assert not warn_if_open(ServerConfig())
