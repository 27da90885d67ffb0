"""Garbage against a live shard: 10,000+ generated requests over every RPC and the TCP data plane.

Every answer must be a status other than INTERNAL or UNKNOWN, the shard must log no traceback,
keep serving, keep its weights (their checksum) and not grow its resident memory by more than
10% after a warm-up. The shard runs as ``psctl server`` in its own process, so its memory and
its log are its own. hypothesis generates the requests, derandomized: CI sees the same ones.
"""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psgrid.psserver.client.admin import Admin
from psgrid.psserver.client.client import Client
from psgrid.psserver.protocol import REASON_KEY, SERVICE, Reason, parse_address_file
from psgrid.psserver.rpc import ps_pb2
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.transports.stream_frames import MAGIC, REPLY, REQUEST

ROOT = Path(__file__).resolve().parent.parent
SPEC = ModelSpec([("w", (1000,)), ("b", (10,))])
REFUSED_BADLY = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
INTERNAL, UNKNOWN = 13, 2

# Numbers a careless server mishandles: signs, word sizes, the ends of int64.
EDGES = [0, 1, -1, -2, 2**31 - 1, 2**31, 2**32, 2**53, 2**63 - 1, -(2**63)]
ints64 = st.one_of(st.sampled_from(EDGES), st.integers(-(2**63), 2**63 - 1))
uints64 = st.one_of(st.sampled_from([0, 1, 2**32, 2**63, 2**64 - 1]), st.integers(0, 2**64 - 1))
uints32 = st.integers(0, 2**32 - 1)
texts = st.text(max_size=300)
chunks = st.builds(ps_pb2.Chunk, offset=uints64, dtype=st.integers(0, 2**31 - 1), data=st.binary(max_size=64))
specs = st.builds(
    ps_pb2.ModelSpecMsg,
    params=st.lists(
        st.builds(
            ps_pb2.ParamInfo,
            name=texts,
            shape=st.lists(ints64, max_size=4),
            dtype=st.one_of(st.sampled_from(["float32", "", "x", "(-1,)f4", "(1,2", "f4,f4"]), st.text(max_size=12)),
        ),
        max_size=4,
    ),
    hash=texts,
)
garbage = st.binary(max_size=200)

MESSAGES = {  # RPC: (does the request stream, strategy of one request as bytes)
    "Register": (
        False,
        st.one_of(
            garbage,
            st.builds(
                ps_pb2.RegisterRequest,
                spec_hash=texts,
                worker_id=ints64,
                start_clock=ints64,
                host=texts,
                observer=st.booleans(),
            ).map(lambda m: m.SerializeToString()),
        ),
    ),
    "Pull": (
        False,
        st.one_of(
            garbage,
            st.builds(ps_pb2.PullRequest, worker_id=ints64, clock=ints64, chunk_bytes=uints32).map(
                lambda m: m.SerializeToString()
            ),
        ),
    ),
    "Heartbeat": (
        False,
        st.one_of(
            garbage,
            st.builds(ps_pb2.HeartbeatRequest, worker_id=ints64, leaving=st.booleans()).map(
                lambda m: m.SerializeToString()
            ),
        ),
    ),
    "Stats": (False, garbage),
    "Checkpoint": (False, garbage),
    "Shutdown": (
        False,
        st.one_of(garbage, st.builds(ps_pb2.ShutdownRequest, job_id=texts).map(lambda m: m.SerializeToString())),
    ),
    "Push": (
        True,
        st.lists(
            st.one_of(
                garbage,
                st.builds(
                    ps_pb2.PushRequest,
                    worker_id=ints64,
                    clock=ints64,
                    version=uints64,
                    num_chunks=uints32,
                    chunk=chunks,
                ).map(lambda m: m.SerializeToString()),
            ),
            max_size=4,
        ),
    ),
    "Init": (
        True,
        st.lists(
            st.one_of(
                garbage,
                st.builds(ps_pb2.InitRequest, spec=specs, num_chunks=uints32, chunk=chunks).map(
                    lambda m: m.SerializeToString()
                ),
            ),
            max_size=4,
        ),
    ),
}
PER_RPC = 1000
TCP_REQUESTS = 2000
# Requests drawn per Hypothesis example: drawing each request as an example of its own made the
# library's bookkeeping, not the shard, most of this file's time; the requests sent are as many.
PER_EXAMPLE = 10


def examples(requests: int) -> int:
    return max(1, requests // PER_EXAMPLE)


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


@pytest.fixture
def shard(tmp_path):
    """``psctl server`` (async, lease 1 s) with weights: (process, address, job id, log path)."""
    address_file, log = tmp_path / "addr", tmp_path / "shard.log"
    env = {k: v for k, v in os.environ.items() if k not in ("PSCTL_PARENT_PID", "PSGRID_TOKEN")}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "psgrid.cluster.cli",
                "server",
                "--port",
                "0",
                "--mode",
                "async",
                "--lease-s",
                "1",
                "--address-file",
                str(address_file),
            ],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while not address_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
        address, job = parse_address_file(address_file.read_text())
        with Client([address], SPEC, init=np.linspace(-1, 1, SPEC.size, dtype=np.float32)) as client:
            client.push(np.full(SPEC.size, 0.5, np.float32)).wait()
        yield proc, address, job, log
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=10)


def checksum(address: str) -> float:
    with Admin([address], deadline_s=10, retry_s=5) as admin:
        weights = admin.pull().out
    return math.fsum(weights.astype(np.float64))


class Counter:
    def __init__(self):
        self.sent = 0
        self.codes: dict[str, int] = {}

    def note(self, code: str) -> None:
        self.sent += 1
        self.codes[code] = self.codes.get(code, 0) + 1


def fuzz_grpc(channel, name: str, streams: bool, strategy, counter: Counter, job: str, requests: int) -> None:
    path = f"/{SERVICE}/{name}"
    call = channel.stream_unary(path) if streams else channel.unary_unary(path)  # bytes in, bytes out

    @settings(
        max_examples=examples(requests), deadline=None, derandomize=True, database=None,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(st.lists(strategy, min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
    def some(batch):
        for request in batch:
            if name == "Shutdown" and request == ps_pb2.ShutdownRequest(job_id=job).SerializeToString():
                continue  # the one request that may stop it
            try:
                call(iter(request) if streams else request, timeout=10)
                counter.note("OK")
            except grpc.RpcError as exc:
                assert exc.code() not in REFUSED_BADLY, f"{name}: {exc.code()} {exc.details()} for {request!r}"
                counter.note(exc.code().name)

    some()


def fuzz_tcp(port: int, counter: Counter, requests: int) -> None:
    request = st.tuples(
        st.one_of(st.just(MAGIC), st.binary(min_size=4, max_size=4)),
        st.integers(0, 255),
        st.integers(0, 255),
        ints64,
        ints64,
        uints64,
        st.one_of(st.sampled_from([0, 1 << 40, 2**64 - 1]), st.integers(0, 4096)),
        st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -1.0, 0.5])),
    ).map(lambda f: REQUEST.pack(*f))
    streams = st.tuples(
        st.lists(request, min_size=1, max_size=3), st.binary(max_size=512), st.integers(0, REQUEST.size)
    )

    @settings(
        max_examples=examples(requests), deadline=None, derandomize=True, database=None,
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(st.lists(streams, min_size=PER_EXAMPLE, max_size=PER_EXAMPLE))
    def some(batch):
        for headers, payload, cut in batch:
            data = b"".join(headers) + payload
            data = data[: len(data) - cut] if cut else data  # sometimes truncated
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                try:
                    sock.sendall(data)
                    sock.shutdown(socket.SHUT_WR)
                    replies = read_replies(sock)
                except OSError:  # the shard closed first (a bad header): nothing to read
                    replies = []
            for status in replies:
                assert status not in (INTERNAL, UNKNOWN), f"TCP plane answered {status} to {data!r}"
            counter.note(f"tcp:{replies[0] if replies else 'closed'}")

    some()


def read_replies(sock) -> list[int]:
    """The status of every reply the shard sent before closing."""
    data = b""
    while chunk := sock.recv(1 << 16):
        data += chunk
    statuses = []
    while len(data) >= REPLY.size and data[:4] == MAGIC:
        fields = REPLY.unpack(data[: REPLY.size])
        statuses.append(fields[1])
        data = data[REPLY.size + fields[-1] :]
    return statuses


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ten_thousand_malformed_requests_are_refused_cleanly(shard):
    proc, address, job, log = shard
    before = checksum(address)
    counter = Counter()
    with Admin([address], deadline_s=10, retry_s=5) as admin:
        tcp_port = int(admin._look(0).address("tcp"))
    with grpc.insecure_channel(address) as channel:
        # warm-up: every kind of request once in numbers, before memory is measured
        for name, (streams, strategy) in MESSAGES.items():
            fuzz_grpc(channel, name, streams, strategy, counter, job, 50)
        fuzz_tcp(tcp_port, counter, 100)
        warm_rss = rss_kib(proc.pid)
        for name, (streams, strategy) in MESSAGES.items():
            fuzz_grpc(channel, name, streams, strategy, counter, job, PER_RPC)
        fuzz_tcp(tcp_port, counter, TCP_REQUESTS)
    grown = rss_kib(proc.pid) / warm_rss - 1
    print(
        f"{counter.sent} requests; answers {dict(sorted(counter.codes.items()))}; "
        f"resident memory {warm_rss} KiB after warm-up, {grown:+.1%} after"
    )
    assert counter.sent >= 10_000
    assert proc.poll() is None, "the shard stopped"
    assert checksum(address) == before  # garbage changed no weight
    assert grown < 0.10
    text = log.read_text()
    assert "Traceback" not in text and " ERROR " not in text, text[-3000:]
    # still serving a valid worker
    with Client([address], SPEC, retry_s=5) as client:
        client.pull(SPEC.flat()).wait()


def test_edge_ids_and_clocks_are_refused_or_handled_and_break_nothing_later(tmp_path):
    """0, -1, 2^31, 2^63-1 as ids, clocks and versions, on both planes, then a restart from checkpoint."""
    from psgrid.psserver.config import ServerConfig
    from psgrid.psserver.exceptions import PSError
    from psgrid.psserver.server import serve
    from psgrid.psserver.transports.base import ConnectOptions
    from psgrid.psserver.transports.grpc_client import open_control
    from psgrid.psserver.transports.tcp_client import TcpDataPlane

    ckpt = str(tmp_path / "ckpt")
    server = serve(ServerConfig(mode="sync", lr=0.1, checkpoint_dir=ckpt))
    try:
        with Client([server.address], SPEC, worker_id=0, init=SPEC.flat()) as client:
            client.push(SPEC.flat()).wait()
        control = open_control(server.address, ConnectOptions())
        reply = control.register(spec_hash="", worker_id=-1, start_clock=-1, host="h", observer=True)
        plane = TcpDataPlane("127.0.0.1", int(reply.address("tcp")), ConnectOptions())
        refused = 0
        for value in (0, -1, 2**31 - 1, 2**31, 2**63 - 1):
            for call in (
                lambda: control.register(spec_hash="", worker_id=value, start_clock=value, host="h"),
                lambda: control.heartbeat(value),
                lambda: plane.pull_into(
                    np.empty(SPEC.size, np.float32), begin=0, worker_id=value, clock=value, timeout_s=1
                ),
                lambda: plane.push(
                    np.zeros(SPEC.size, np.float32),
                    begin=0,
                    wire_dtype="float32",
                    worker_id=value,
                    clock=value,
                    version=value,
                    timeout_s=1,
                ),
            ):
                try:
                    call()
                except PSError as exc:
                    assert exc.status.name not in ("INTERNAL", "UNKNOWN"), exc
                    refused += 1
        assert refused > 0
        plane.close()
        control.close()
        # a new worker still gets an id, here and after a restart from the checkpoint
        with Client([server.address], SPEC) as late:
            assert 0 <= late.worker_id < 2**31
    finally:
        server.stop(grace=0.5)
    server = serve(ServerConfig(mode="sync", lr=0.1, checkpoint_dir=ckpt))
    try:
        with Client([server.address], SPEC) as again:
            assert 0 <= again.worker_id < 2**31
            again.pull(SPEC.flat()).wait()
    finally:
        server.stop(grace=0.5)


def test_init_with_an_absurd_shape_is_refused_before_anything_is_allocated():
    from psgrid.psserver.config import ServerConfig
    from psgrid.psserver.exceptions import InvalidArgument
    from psgrid.psserver.server import serve
    from psgrid.psserver.transports.base import ConnectOptions
    from psgrid.psserver.transports.grpc_client import open_control

    server = serve(ServerConfig(mode="async"))
    try:
        control = open_control(server.address, ConnectOptions())
        try:
            huge = ModelSpec([("w", (2**20, 2**20))])  # 4 TiB of float32
            with pytest.raises(InvalidArgument, match="more than this shard can hold"):
                control.init(huge, np.zeros(4, np.float32), 0)
        finally:
            control.close()
        assert not server.shard.initialized
    finally:
        server.stop(grace=0.5)


# ----- the health service: anyone may call it -------------------------------------------------------

HEALTH_CHECK = "/grpc.health.v1.Health/Check"
# HealthCheckRequest bytes that do not parse: a bad tag, a string longer than the message, a string that
# is not UTF-8, a truncated length.
MALFORMED_HEALTH = [b"\xff\xff\xff\x01", b"\x0a\x05ab", b"\x0a\x02\xff\xfe", b"\x0a", b"\x0a\xff\xff\xff\xff\xff"]


def malformed_health_checks(channel, n: int) -> dict[str, int]:
    call, codes = channel.unary_unary(HEALTH_CHECK), {}
    for i in range(n):
        try:
            call(MALFORMED_HEALTH[i % len(MALFORMED_HEALTH)], timeout=5)
            code = "OK"
        except grpc.RpcError as exc:
            code = exc.code().name
            if code == "INVALID_ARGUMENT":
                assert (REASON_KEY, Reason.MALFORMED.wire_name) in exc.trailing_metadata(), exc.trailing_metadata()
        codes[code] = codes.get(code, 0) + 1
    return codes


@pytest.mark.timeout(120)
def test_malformed_health_checks_are_refused_without_growth_and_real_probes_are_served(shard):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    proc, address, _, log = shard
    n = 2000
    with grpc.insecure_channel(address) as channel:
        malformed_health_checks(channel, 200)  # warm-up
        rss, logged = rss_kib(proc.pid), log.stat().st_size
        codes = malformed_health_checks(channel, n)
        grown_kib, log_grown = rss_kib(proc.pid) - rss, log.stat().st_size - logged
        stub = health_pb2_grpc.HealthStub(channel)
        serving = health_pb2.HealthCheckResponse.SERVING
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=5).status == serving
        assert stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5).status == serving
        with pytest.raises(grpc.RpcError) as unknown:
            stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND
        watch = stub.Watch(health_pb2.HealthCheckRequest(service=SERVICE), timeout=5)
        assert next(watch).status == serving
        watch.cancel()
        with pytest.raises(grpc.RpcError) as malformed_watch:
            next(channel.unary_stream("/grpc.health.v1.Health/Watch")(MALFORMED_HEALTH[0], timeout=5))
        assert malformed_watch.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    print(f"{n} malformed health checks: {codes}; resident memory {grown_kib:+d} KiB, log {log_grown:+d} bytes")
    assert codes == {"INVALID_ARGUMENT": n}
    assert grown_kib < 4096, grown_kib  # was about 38 MB per 2,000
    assert log_grown < 1024, log_grown  # was about 790 KB per 2,000 (a traceback each)
    text = log.read_text()
    assert "Traceback" not in text and text.count("malformed health checks") == 1, text[-3000:]  # once a minute
