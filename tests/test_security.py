"""Bearer token and mutual TLS, on the gRPC control plane and the bulk data plane alike."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess

import grpc
import numpy as np
import pytest

from psgrid.psserver.bulk import HELLO, MAGIC, PULL, REPLY, REQUEST, BulkClient, BulkError, client_ssl_context
from psgrid.psserver.client import ShardedClient
from psgrid.psserver.exceptions import RemoteError, ShardUnavailable
from psgrid.psserver.rpc import ps_pb2
from tests.cluster_utils import addresses, in_process_cluster
from tests.test_bulk import bulk_calls  # noqa: F401 - a fixture
from tests.test_integration import FEATURES, SPEC, make_problem

TOKEN = "s3cret"
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED


def fit(addrs, steps=60, **client_kw):
    """One client fits the regression; returns the final weights and the client's bulk connections."""
    x, y, w_true, _ = make_problem(0)
    with ShardedClient(addrs, deadline_s=20, **client_kw) as client:
        client.register(SPEC)
        client.init(np.zeros(SPEC.size, np.float32))
        params, grad = SPEC.flat(), SPEC.flat()
        for _ in range(steps):
            client.pull(params)
            residual = x @ params[:FEATURES] + params[FEATURES] - y
            grad[:FEATURES] = x.T @ residual / len(y)
            grad[FEATURES] = residual.mean()
            client.push(grad)
        client.pull(params)
        return params, list(client.bulk), w_true


def shard_state(server):
    shard = server.shard
    with shard.cond:
        return (None if shard.weights is None else shard.weights.copy(), shard.version,
                dict(shard.policy.clocks), shard.counters.pushes, shard.counters.pulls)


def assert_same_state(before, after):
    if before[0] is None:
        assert after[0] is None
    else:
        np.testing.assert_array_equal(before[0], after[0])
    assert before[1:] == after[1:]


# ----- bearer token -------------------------------------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("use_bulk", [False, True], ids=["grpc", "bulk"])
def test_right_token_trains(use_bulk, bulk_calls):  # noqa: F811
    with in_process_cluster(2, mode="sync", lr=0.3, token=TOKEN) as servers:
        params, used, w_true = fit(addresses(servers), token=TOKEN, bulk=use_bulk)
        np.testing.assert_allclose(params[:FEATURES], w_true, atol=0.05)
        assert all(s.shard.version == 60 for s in servers)
    if use_bulk:
        assert all(b is not None for b in used)
        assert bulk_calls["push"] == 2 * 60 and bulk_calls["pull"] == 2 * 61
    else:
        assert used == [None, None] and bulk_calls == {"pull": 0, "push": 0}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("token", [None, "wrong", "s3cre", "s3cret "])
def test_missing_or_wrong_token_is_unauthenticated_on_grpc(token):
    with in_process_cluster(1, mode="async", token=TOKEN) as servers:
        before = shard_state(servers[0])
        with ShardedClient(addresses(servers), token=token, retry_s=1) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.register(SPEC)
            assert err.value.code() == UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as err:
                client.init(np.zeros(SPEC.size, np.float32), spec=SPEC)
            assert err.value.code() == UNAUTHENTICATED
            with pytest.raises(RemoteError) as refused:
                client.stats()            # control calls raise the domain error, named by status
            assert refused.value.code == "UNAUTHENTICATED"
        assert_same_state(before, shard_state(servers[0]))
        assert servers[0].shard.leases.members == {}


@pytest.fixture
def token_job():
    """A token-protected async shard, initialized, with one worker registered by a client holding the token."""
    with in_process_cluster(1, mode="async", token=TOKEN) as servers:
        with ShardedClient(addresses(servers), token=TOKEN, bulk=False) as client:
            worker = client.register(SPEC)
            client.init(np.arange(SPEC.size, dtype=np.float32))
            client.push(np.ones(SPEC.size, np.float32))
            yield servers[0], worker


@pytest.mark.timeout(30)
@pytest.mark.parametrize("token", [None, "wrong"])
def test_bulk_plane_refuses_without_or_with_wrong_token(token_job, token):
    server, worker = token_job
    before = shard_state(server)
    bulk = BulkClient("127.0.0.1", server.bulk.port, token=token)
    try:
        out = np.empty(SPEC.size, np.float32)
        with pytest.raises(BulkError) as err:
            bulk.pull_into(memoryview(out).cast("B"), worker, 1, 5)
        assert err.value.code() == UNAUTHENTICATED
        with pytest.raises(BulkError) as err:
            bulk.push(np.ones(SPEC.size, "<f4").tobytes(), ps_pb2.FLOAT32, worker, 1, 1, 5)
        assert err.value.code() == UNAUTHENTICATED
    finally:
        bulk.close()
    assert_same_state(before, shard_state(server))
    # the right token on the same plane works
    bulk = BulkClient("127.0.0.1", server.bulk.port, token=TOKEN)
    try:
        out = np.empty(SPEC.size, np.float32)
        assert bulk.pull_into(memoryview(out).cast("B"), worker, 1, 5) == before[1]
        np.testing.assert_array_equal(out, before[0])
    finally:
        bulk.close()


@pytest.mark.timeout(30)
def test_bulk_hello_must_come_first_and_a_refused_hello_closes(token_job):
    server, worker = token_job
    before = shard_state(server)
    with socket.create_connection(("127.0.0.1", server.bulk.port), timeout=5) as sock:
        # a pull with no hello: refused, then the shard closes the connection
        sock.sendall(REQUEST.pack(MAGIC, PULL, ps_pb2.FLOAT32, worker, 1, 0, 0, 5.0))
        reply = _read_reply(sock)
        assert reply[1] == UNAUTHENTICATED.value[0]
        assert sock.recv(1) == b""
    with socket.create_connection(("127.0.0.1", server.bulk.port), timeout=5) as sock:
        wrong = b"S3CRET"
        sock.sendall(REQUEST.pack(MAGIC, HELLO, 0, 0, 0, 0, len(wrong), 0.0) + wrong)
        assert _read_reply(sock)[1] == UNAUTHENTICATED.value[0]
        assert sock.recv(1) == b""
    assert_same_state(before, shard_state(server))


def _read_reply(sock):
    buf = b""
    while len(buf) < REPLY.size:
        more = sock.recv(REPLY.size - len(buf))
        assert more, "shard closed before replying"
        buf += more
    fields = REPLY.unpack(buf)
    sock.recv(fields[-1], socket.MSG_WAITALL)     # the error text
    return fields


# ----- mutual TLS ---------------------------------------------------------------------------------

def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=30)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    """A CA, a server certificate for localhost / 127.0.0.1 and a client certificate, made with openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command line tool is not installed")
    d = tmp_path_factory.mktemp("pki")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=psgrid test CA",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=d)
    for name, cn, ext in (
            ("server", "localhost", "subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n"),
            ("client", "worker-0", "extendedKeyUsage=clientAuth\n"),
            ):
        (d / f"{name}.ext").write_text("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature\n"
                                       "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n" + ext)
        _openssl("req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=d)
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
                 "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext", cwd=d)
    # a second, unrelated CA and a client certificate it signed: right shape, wrong issuer
    _openssl("req", "-x509", *ec, "-keyout", "rogue.key", "-out", "rogue.pem", "-days", "2", "-subj", "/CN=worker-0",
             cwd=d)
    return {k: str(d / v) for k, v in (("ca", "ca.pem"), ("server_cert", "server.pem"), ("server_key", "server.key"),
                                       ("client_cert", "client.pem"), ("client_key", "client.key"),
                                       ("rogue_cert", "rogue.pem"), ("rogue_key", "rogue.key"))}


@pytest.fixture
def tls_cluster(certs):
    with in_process_cluster(2, mode="sync", lr=0.3, tls_cert=certs["server_cert"], tls_key=certs["server_key"],
                            tls_ca=certs["ca"]) as servers:
        yield servers, [f"localhost:{s.port}" for s in servers]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("use_bulk", [False, True], ids=["grpc", "bulk"])
def test_mutual_tls_client_trains(tls_cluster, certs, use_bulk, bulk_calls):  # noqa: F811
    servers, addrs = tls_cluster
    params, used, w_true = fit(addrs, tls_ca=certs["ca"], tls_cert=certs["client_cert"],
                               tls_key=certs["client_key"], bulk=use_bulk)
    np.testing.assert_allclose(params[:FEATURES], w_true, atol=0.05)
    assert all(s.shard.version == 60 for s in servers)
    if use_bulk:
        assert all(b is not None for b in used)
        assert bulk_calls["push"] == 2 * 60
    else:
        assert bulk_calls == {"pull": 0, "push": 0}


@pytest.mark.timeout(30)
def test_bulk_plane_speaks_tls_to_ip_addresses_too(tls_cluster, certs):
    """The server certificate names 127.0.0.1 as well, so a client given the IP verifies it."""
    servers, _ = tls_cluster
    ctx = client_ssl_context(certs["ca"], certs["client_cert"], certs["client_key"])
    with ShardedClient([f"localhost:{s.port}" for s in servers], tls_ca=certs["ca"], tls_cert=certs["client_cert"],
                       tls_key=certs["client_key"], bulk=False) as client:
        worker = client.register(SPEC)
        client.init(np.ones(SPEC.size, np.float32))
    bulk = BulkClient("127.0.0.1", servers[0].bulk.port, ssl_context=ctx)
    try:
        out = np.empty(servers[0].shard.size, np.float32)
        assert bulk.pull_into(memoryview(out).cast("B"), worker, 0, 5) == 0
        np.testing.assert_array_equal(out, 1.0)
    finally:
        bulk.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("who", ["no client cert", "rogue client cert", "no TLS"])
def test_client_without_a_valid_certificate_is_refused(tls_cluster, certs, who):
    servers, addrs = tls_cluster
    before = [shard_state(s) for s in servers]
    kw = {"no client cert": dict(tls_ca=certs["ca"]),
          "rogue client cert": dict(tls_ca=certs["ca"], tls_cert=certs["rogue_cert"], tls_key=certs["rogue_key"]),
          "no TLS": {}}[who]
    with ShardedClient(addrs, retry_s=0.5, deadline_s=5, **kw) as client:
        with pytest.raises(ShardUnavailable):
            client.register(SPEC)
    for server, state in zip(servers, before):
        assert_same_state(state, shard_state(server))
    assert all(s.shard.leases.members == {} for s in servers)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("who", ["no client cert", "rogue client cert", "no TLS"])
def test_bulk_plane_refuses_a_client_without_a_valid_certificate(tls_cluster, certs, who):
    servers, addrs = tls_cluster
    with ShardedClient(addrs, tls_ca=certs["ca"], tls_cert=certs["client_cert"], tls_key=certs["client_key"],
                       bulk=False) as client:
        worker = client.register(SPEC)
        client.init(np.ones(SPEC.size, np.float32))
    server = servers[0]
    before = shard_state(server)
    ctx = {"no client cert": lambda: client_ssl_context(certs["ca"], None, None),
           "rogue client cert": lambda: client_ssl_context(certs["ca"], certs["rogue_cert"], certs["rogue_key"]),
           "no TLS": lambda: None}[who]()
    bulk = BulkClient("localhost", server.bulk.port, ssl_context=ctx)
    try:
        out = np.empty(server.shard.size, np.float32)
        with pytest.raises((OSError, ssl.SSLError)):
            bulk.pull_into(memoryview(out).cast("B"), worker, 0, 3)
        with pytest.raises((OSError, ssl.SSLError)):
            bulk.push(np.full(server.shard.size, 2.0, "<f4").tobytes(), ps_pb2.FLOAT32, worker, 0, 0, 3)
    finally:
        bulk.close()
    assert_same_state(before, shard_state(server))
