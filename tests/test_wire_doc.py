"""docs/wire.md is the wire, byte by byte: its vectors and tables are checked here against the project's code.

* Every ```hex vector is built with the shards' own encoders (stream_frames.py, the stream server's
  reply) and compared byte for byte, then parsed back with their decoders (``read_request``,
  ``read_reply``) from a socket, fields and payload checked against the vector's first line.
* The tables (header layouts, op codes, element types, status codes, reasons, outcomes) are
  compared with stream_frames.py's structs and protocol.py's enums, and the reasons' status codes
  with proto/ps.proto's list.
* Every ```f32 arithmetic vector is computed three ways: by the page's formulas (a float32
  simulation written here), by the host optimizers (kernels/optim.py), and by a shard (its
  service's pushes: the sync round's mean included); on a GPU also by the device kernels.
"""

from __future__ import annotations

import re
import shlex
import socket
import struct
from pathlib import Path

import grpc
import numpy as np
import pytest

from psgrid.psserver.config import ServerConfig
from psgrid.psserver.exceptions import PSError
from psgrid.psserver.kernels.optim import make_optimizer
from psgrid.psserver.kernels.schedule import LrSchedule
from psgrid.psserver.protocol import (
    CLIENT_SIDE_REASONS,
    FLOAT32,
    ITEMSIZE,
    WIRE_DTYPES,
    Outcome,
    PushResult,
    Reason,
    Status,
)
from psgrid.psserver.rpc import ps_pb2, ps_pb2_grpc
from psgrid.psserver.server import serve
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.transports import stream_frames as frames
from psgrid.psserver.transports.local_gradient import CallerArray
from psgrid.psserver.transports.stream_server import SocketDataServer

ROOT = Path(__file__).resolve().parent.parent
DOC = (ROOT / "docs" / "wire.md").read_text()
PROTO = (ROOT / "proto" / "ps.proto").read_text()
SPEC = ModelSpec([("w", (12,))])


# ----- reading the page -------------------------------------------------------------------------------


def _fields(text: str) -> dict:
    """``a=1 b=2.5 c="x y" p=1.0,-2.5`` as values: ints, floats, strings, float lists."""
    fields = {}
    for item in shlex.split(text):
        key, _, value = item.partition("=")
        if "," in value:
            fields[key] = [float(v) for v in value.split(",")]
        elif re.fullmatch(r"-?\d+", value):
            fields[key] = int(value)
        elif re.fullmatch(r"-?[\d.]+(e-?\d+)?", value):
            fields[key] = float(value)
        else:
            fields[key] = {"true": True, "false": False}.get(value, value)
    return fields


def hex_vectors() -> dict[tuple[str, str], tuple[dict, bytes]]:
    """(kind, name) -> (fields, frame) of every ```hex block of the page."""
    vectors = {}
    for block in re.findall(r"^```hex\n(.*?)^```", DOC, re.S | re.M):
        first, *lines = block.splitlines()
        head = re.fullmatch(r"# vector (request|reply) (\S+):(.*)", first)
        assert head, f"a hex block of docs/wire.md does not start with '# vector KIND NAME: FIELDS': {first!r}"
        data = "".join("".join(line.split("#")[0].split()) for line in lines)
        vectors[(head[1], head[2])] = (_fields(head[3]), bytes.fromhex(data))
    return vectors


def arithmetic_vectors() -> dict[str, tuple[dict, dict[str, np.ndarray]]]:
    """name -> (settings, {row: float32 values}) of every ```f32 block of the page."""
    vectors = {}
    for block in re.findall(r"^```f32\n(.*?)^```", DOC, re.S | re.M):
        first, *lines = block.splitlines()
        head = re.fullmatch(r"# arithmetic (\S+):(.*)", first)
        assert head, f"an f32 block of docs/wire.md does not start with '# arithmetic NAME: SETTINGS': {first!r}"
        rows = {}
        for line in lines:
            name, *values = line.split("#")[0].split()
            rows[name] = np.array([int(v, 16) for v in values], np.uint32).view(np.float32)
        vectors[head[1]] = (_fields(head[2]), rows)
    return vectors


def table(title: str) -> list[list[str]]:
    """The rows of the first table after the heading or line that contains ``title``, as cell texts."""
    start = DOC.index(title)
    rows = []
    for line in DOC[start:].splitlines()[1:]:
        if line.startswith("|"):
            rows.append([cell.strip().strip("`") for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    return rows[2:]  # past the header and its rule


HEX = hex_vectors()
ARITHMETIC = arithmetic_vectors()


# ----- the frames ---------------------------------------------------------------------------------------


class Sink:
    """What a stream server's reply writes, kept (the server's own ``_reply`` builds the frame)."""

    def __init__(self):
        self.data = bytearray()

    def sendall(self, data) -> None:
        self.data += bytes(data)


def served(reply, *args, **kw) -> bytes:
    sink = Sink()
    reply(_Replier(), sink, *args, **kw)
    return bytes(sink.data)


class _Replier:
    """The part of a stream server that answers (its replies need nothing else of it)."""

    _reply = SocketDataServer._reply


def f32(values) -> bytes:
    return np.asarray(values, "<f4").tobytes()


def build(kind: str, name: str, f: dict) -> bytes:
    """The frame the project's code makes for the fields a vector gives."""
    get = lambda key: f.get(key, 0)  # noqa: E731 - a field the vector leaves out is 0
    if kind == "request":
        return {
            "HELLO": lambda: frames.hello_request(f["token"].encode()),
            "PULL": lambda: frames.pull_request(get("dtype"), get("worker"), get("clock"), get("timeout")),
            "PUSH": lambda: (
                frames.push_request(
                    get("dtype"), get("worker"), get("clock"), get("version"), get("nbytes"), get("timeout")
                )
                + f32(f["payload"])
            ),
            "OPEN": frames.open_request,
            "MAP": lambda: frames.map_request(get("clock")),
            "ATTACH": lambda: frames.attach_request(
                frames.dtype_byte(get("dtype") & 15, get("dtype") >> 4), get("nbytes")
            ),
            "PUSH-SHM": lambda: frames.push_request(
                frames.dtype_byte(get("dtype") & 15, get("dtype") >> 4),
                get("worker"),
                get("clock"),
                get("version"),
                0,
                get("timeout"),
            ),
        }[name]()
    return {
        "OK": lambda: served(SocketDataServer._reply),
        "PULL": lambda: served(SocketDataServer._reply, version=get("version"), payload=f32(f["payload"])),
        "PUSH": lambda: served(
            SocketDataServer._reply_push,
            PushResult(Outcome(get("outcome")), get("version"), get("staleness"), get("next_clock")),
        ),
        "REFUSAL": lambda: frames.refusal_frame(get("status"), get("reason"), f["text"].encode()),
        "OPEN": lambda: frames.open_reply(get("version")),
        "MAP": lambda: frames.map_reply(get("version")),
        "PULL-SHM": lambda: frames.shared_pull_reply(get("version"), get("staleness")),
    }[name]()


BUILT = {("request", name) for name in ("HELLO", "PULL", "PUSH", "OPEN", "MAP", "ATTACH", "PUSH-SHM")} | {
    ("reply", name) for name in ("OK", "PULL", "PUSH", "REFUSAL", "OPEN", "MAP", "PULL-SHM")
}


def test_the_page_has_a_vector_of_every_frame():
    assert set(HEX) == BUILT


@pytest.mark.parametrize("kind, name", sorted(BUILT))
def test_each_vector_is_the_frame_the_code_builds(kind, name):
    fields, frame = HEX[(kind, name)]
    assert build(kind, name, fields).hex() == frame.hex()


def parse(frame: bytes, how):
    """``how(sock)`` on a socket that holds ``frame``, and the bytes left after it."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        theirs.settimeout(5)
        ours.sendall(frame)
        ours.shutdown(socket.SHUT_WR)
        parsed = how(theirs)
        rest = bytearray()
        while chunk := theirs.recv(1 << 16):
            rest += chunk
    return parsed, bytes(rest)


@pytest.mark.parametrize("name", sorted(name for kind, name in BUILT if kind == "request"))
def test_each_request_vector_parses_to_its_fields(name):
    fields, frame = HEX[("request", name)]
    request, payload = parse(frame, frames.read_request)
    follows = 0 if name == "ATTACH" else request.nbytes  # an ATTACH's nbytes is its file's size
    assert len(frame) == frames.REQUEST.size + follows == frames.REQUEST.size + len(payload)
    expected = {key: fields.get(key, 0) for key in ("op", "dtype", "worker", "clock", "version", "nbytes", "timeout")}
    assert {key: getattr(request, key) for key in expected} == expected
    if "token" in fields:
        assert payload == fields["token"].encode()
    if "payload" in fields:
        assert np.frombuffer(payload, "<f4").tolist() == fields["payload"]
    if name.endswith("-SHM") or name == "ATTACH":  # the dtype byte: wire dtype and gradient file
        assert (request.wire_dtype, request.file_index) == (fields["dtype"] & 15, fields["dtype"] >> 4)


@pytest.mark.parametrize("name", sorted(name for kind, name in BUILT if kind == "reply"))
def test_each_reply_vector_parses_to_its_fields(name):
    fields, frame = HEX[("reply", name)]
    if name == "REFUSAL":
        refused, rest = parse(frame, lambda sock: pytest.raises(PSError, frames.read_reply, sock, "doc").value)
        assert (refused.status, refused.reason, rest) == (fields["status"], fields["reason"], b"")
        assert refused.whole_frame and refused.message.endswith(fields["text"])
        return
    reply, payload = parse(frame, lambda sock: frames.read_reply(sock, "doc"))
    assert len(frame) == frames.REPLY.size + reply.nbytes == frames.REPLY.size + len(payload)
    expected = {
        key: fields.get(key, 0)
        for key in ("status", "reason", "outcome", "version", "staleness", "next_clock", "nbytes")
    }
    assert {key: getattr(reply, key) for key in expected} == expected
    if "payload" in fields:
        assert np.frombuffer(payload, "<f4").tolist() == fields["payload"]


# ----- the tables ---------------------------------------------------------------------------------------

TYPES = {"bytes": "4s", "u8": "B", "i64": "q", "u64": "Q", "f64": "d"}


@pytest.mark.parametrize(
    "title, layout, names",
    [
        ("### 2.1 The request header", frames.REQUEST, frames.Request._fields),
        ("### 2.2 The reply header", frames.REPLY, frames.Reply._fields),
    ],
    ids=["request", "reply"],
)
def test_the_header_tables_are_the_structs(title, layout, names):
    rows = table(title)
    assert f"{title}: {layout.size} bytes\n" in DOC
    assert [row[3] for row in rows] == list(names)
    assert "<" + "".join(TYPES[row[2]] for row in rows) == layout.format
    offset = 0
    for row in rows:
        assert int(row[0]) == offset, row
        offset += struct.calcsize("<" + TYPES[row[2]])
        assert int(row[1]) == struct.calcsize("<" + TYPES[row[2]]), row
    assert offset == layout.size


def test_the_op_codes_element_types_status_codes_and_outcomes_are_the_codes():
    assert {int(r[0]): r[1] for r in table("### 2.3 Operations")} == {
        getattr(frames, name): name for name in ("HELLO", "PULL", "PUSH", "OPEN", "MAP", "ATTACH")
    }
    types = table("### 2.4 Element types")
    assert {int(r[0]): r[1].lower() for r in types} == {code: name for name, code in WIRE_DTYPES.items()}
    assert {int(r[0]): int(r[2]) for r in types} == ITEMSIZE
    assert {int(r[0]): r[1] for r in table("`status` is the numeric gRPC status code")} == {
        s.value: s.name for s in Status
    }
    assert {int(r[0]): r[1] for r in table("### 2.6 Push outcomes")} == {o.value: o.name for o in Outcome}


def test_every_reason_number_its_name_and_its_status_as_the_proto_lists_them():
    rows = table("`reason` numbers the rule")
    assert {int(r[0]): r[1] for r in rows} == {r.value: r.wire_name for r in Reason}
    listed = dict(re.findall(r"^//   `(\w+)`\s+([A-Z_]+)", PROTO, re.M))  # the proto's list: name, code
    for number, name, status in rows:
        reason = Reason(int(number))
        if reason in CLIENT_SIDE_REASONS:
            assert status.startswith("("), f"{name} is never sent, the page must say so"
        else:
            assert status == listed[name], f"{name}: the page says {status}, the proto {listed[name]}"


# ----- the arithmetic -----------------------------------------------------------------------------------

OPTIMIZER_KEYS = ("lr", "momentum", "nesterov", "weight_decay", "beta1", "beta2", "eps")
STEPPED = sorted(name for name, (settings, rows) in ARITHMETIC.items() if "grad1" in rows)


def hparams(settings: dict) -> dict:
    return {key: settings[key] for key in OPTIMIZER_KEYS if key in settings}


def lr_scale(settings: dict) -> float:
    """The schedule's factor at the vector's version, over max(1, staleness) under compensation "lr"."""
    scale = LrSchedule(
        settings.get("lr_schedule", "constant"), settings.get("lr_updates", 0), settings.get("lr_warmup", 0.0)
    ).factor(settings.get("version", 0))
    return scale / max(1, settings["staleness"]) if settings.get("staleness_compensation") == "lr" else scale


def simulate(settings: dict, w: np.ndarray, grads: list[np.ndarray]) -> list[np.ndarray]:
    """The page's formulas, one float32 operation at a time (settings rounded to float32 as they meet arrays)."""
    fl = np.float32
    lr_eff = settings["lr"] * lr_scale(settings)
    wd, mu = settings.get("weight_decay", 0.0), settings.get("momentum", 0.0)
    b1, b2, eps = settings.get("beta1", 0.9), settings.get("beta2", 0.999), settings.get("eps", 1e-8)
    v = m = np.zeros_like(w)
    out = []
    for t, g in enumerate(grads, start=1):
        d = w * fl(wd) + g if wd else g
        if settings["optimizer"] == "adam":
            m = m + (d - m) * fl(1.0 - b1)
            v = v * fl(b2) + (d * d) * fl(1.0 - b2)
            s = (1.0 - b2**t) ** 0.5
            w = w - m / (np.sqrt(v) + fl(eps * s)) * fl(lr_eff / (1.0 - b1**t) * s)
        else:
            if mu:
                v = v * fl(mu) + d
                d = v * fl(mu) + d if settings.get("nesterov") else v
            w = w - fl(lr_eff) * d
        out.append(w)
    return out


def steps(rows: dict) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The gradients and the weights after each, in order."""
    count = sum(1 for name in rows if name.startswith("grad"))
    return [rows[f"grad{i}"] for i in range(1, count + 1)], [rows[f"w{i}"] for i in range(1, count + 1)]


def test_the_page_has_a_vector_of_each_optimizer_and_mode():
    assert {
        "SGD",
        "SGD-MOMENTUM-DECAY",
        "SGD-NESTEROV",
        "ADAM",
        "ADAM-DECAY",
        "SGD-STALE",
        "SGD-SCHEDULE",
        "SYNC-MEAN",
    } <= set(ARITHMETIC)


@pytest.mark.parametrize("name", STEPPED)
def test_each_update_vector_is_the_pages_formula_and_the_host_optimizer(name):
    settings, rows = ARITHMETIC[name]
    grads, expected = steps(rows)
    for got, want in zip(simulate(settings, rows["w0"], grads), expected):
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    optimizer = make_optimizer(settings["optimizer"], len(rows["w0"]), **hparams(settings))
    w = rows["w0"].copy()
    for g, want in zip(grads, expected):
        optimizer.step(w, g.copy(), lr_scale(settings))
        np.testing.assert_array_equal(w.view(np.uint32), want.view(np.uint32))
    if "other" in rows:  # the formula the page rules out would not give these weights
        assert not np.array_equal(rows["other"], expected[0])


SHARD_KEYS = ("staleness_compensation", "lr_schedule", "lr_updates", "lr_warmup")  # a vector's settings a shard takes


def a_shard(settings: dict, size: int):
    """A shard of its own (gRPC only) with these settings, and its data path; stopped by the caller."""
    config = dict(hparams(settings), optimizer=settings["optimizer"], mode=settings.get("mode", "async"))
    config |= {key: settings[key] for key in SHARD_KEYS if key in settings}
    server = serve(ServerConfig(host="127.0.0.1", port=0, data_plane="grpc", shared_memory=False, **config))
    return server, server.service


def start(service, w0: np.ndarray, workers: int) -> list[int]:
    """Register ``workers`` workers and set the weights to ``w0``; their ids."""
    spec = ModelSpec([("w", w0.shape)])
    ids = [
        service.register(spec_hash=spec.hash(), worker_id=-1, start_clock=-1, host="doc").worker_id
        for _ in range(workers)
    ]
    intake = service.open_init([("w", w0.shape, "float32")], spec.hash())
    intake.add_chunk(0, FLOAT32, w0.tobytes())
    assert intake.commit(1) == (True, 0)
    return ids


def weights(service) -> np.ndarray:
    with service.pull(worker_id=-1, clock=0, timeout_s=5) as snapshot:
        return np.array(snapshot.values)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", [n for n in STEPPED if lr_scale(ARITHMETIC[n][0]) == 1.0])
def test_a_shard_applies_each_update_vector_bit_for_bit(name, no_leaks):
    settings, rows = ARITHMETIC[name]
    grads, expected = steps(rows)
    server, service = a_shard(settings, len(rows["w0"]))
    try:
        (worker,) = start(service, rows["w0"], 1)
        for clock, (g, want) in enumerate(zip(grads, expected)):
            result = service.push(worker_id=worker, clock=clock, version=clock, source=CallerArray(g.copy()))
            assert (result.outcome, result.version) == (Outcome.APPLIED, clock + 1)
            np.testing.assert_array_equal(weights(service).view(np.uint32), want.view(np.uint32))
    finally:
        server.stop(grace=0)


@pytest.mark.timeout(30)
def test_a_shard_takes_the_schedules_rate_at_its_version_as_the_page_says(no_leaks):
    """lr_schedule = "cosine": the update from version 2 of 4 (one warm-up) takes lr_eff = lr × 0.75, rounded once."""
    settings, rows = ARITHMETIC["SGD-SCHEDULE"]
    server, _ = a_shard(settings, len(rows["w0"]))
    try:
        (worker,) = start(server.service, rows["w0"], 1)
        zero = np.zeros_like(rows["w0"])
        for clock in range(settings["version"]):  # plain SGD on a zero gradient leaves the weights as they are
            server.service.push(worker_id=worker, clock=clock, version=clock, source=CallerArray(zero.copy()))
        np.testing.assert_array_equal(weights(server.service), rows["w0"])
        version = settings["version"]
        server.service.push(worker_id=worker, clock=version, version=version, source=CallerArray(rows["grad1"].copy()))
        np.testing.assert_array_equal(weights(server.service).view(np.uint32), rows["w1"].view(np.uint32))
        assert server.service.stats()["lr"] == pytest.approx(settings["lr"] * 0.25)  # from 3: (1 + cos 2π/3) / 2
    finally:
        server.stop(grace=0)


@pytest.mark.timeout(30)
def test_a_shard_scales_a_stale_step_as_the_page_says(no_leaks):
    """staleness_compensation = "lr": a push two versions stale takes lr_eff = lr × 1/2, rounded once."""
    settings, rows = ARITHMETIC["SGD-STALE"]
    server, _ = a_shard(settings, len(rows["w0"]))
    try:
        service = server.service
        fresh, stale = start(service, rows["w0"], 2)
        for clock in range(settings["staleness"]):  # the other worker moves the shard on, each push fresh
            service.push(worker_id=fresh, clock=clock, version=clock, source=CallerArray(rows["grad1"].copy()))
        before = weights(service)
        result = service.push(worker_id=stale, clock=0, version=0, source=CallerArray(rows["grad1"].copy()))
        assert result.staleness == settings["staleness"]
        (expected,) = simulate(settings, before, [rows["grad1"]])
        np.testing.assert_array_equal(weights(service).view(np.uint32), expected.view(np.uint32))
    finally:
        server.stop(grace=0)


@pytest.mark.timeout(30)
def test_sync_multiplies_the_sum_in_worker_order_by_one_over_w(no_leaks):
    settings, rows = ARITHMETIC["SYNC-MEAN"]
    grads = [rows[f"worker{i}"] for i in range(settings["workers"])]
    total = grads[0]
    for g in grads[1:]:
        total = total + g
    mean = total * np.float32(1.0 / len(grads))
    np.testing.assert_array_equal(simulate(settings, rows["w0"], [mean])[0], rows["w1"])
    assert not np.array_equal(rows["other"], rows["w1"])  # dividing by W gives other weights here
    np.testing.assert_array_equal(rows["w0"] - np.float32(settings["lr"]) * (total / np.float32(3)), rows["other"])
    server, service = a_shard(settings, len(rows["w0"]))
    try:
        ids = start(service, rows["w0"], len(grads))
        outcomes = [
            service.push(worker_id=w, clock=0, version=0, source=CallerArray(g.copy())).outcome
            for w, g in zip(ids, grads)
        ]
        assert outcomes == [Outcome.ACCUMULATED] * (len(grads) - 1) + [Outcome.APPLIED]
        np.testing.assert_array_equal(weights(service).view(np.uint32), rows["w1"].view(np.uint32))
    finally:
        server.stop(grace=0)


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", STEPPED)
def test_the_device_kernels_agree_with_each_update_vector_to_float32_rounding(name):
    """A device shard runs the same operations, but its compiler may fuse a multiply and an add (one rounding)."""
    from tests.gpu import cupy_or_skip

    cupy = cupy_or_skip()
    from psgrid.psserver.kernels.device_optim import make_device_optimizer

    settings, rows = ARITHMETIC[name]
    grads, expected = steps(rows)
    optimizer = make_device_optimizer(settings["optimizer"], len(rows["w0"]), **hparams(settings))
    w = cupy.asarray(rows["w0"])
    for g, want in zip(grads, expected):
        optimizer.step(w, cupy.asarray(g), lr_scale(settings))
        np.testing.assert_allclose(cupy.asnumpy(w), want, rtol=1e-6, atol=1e-6)


# ----- the header-only push -----------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["grpc"])
@pytest.mark.parametrize("headers", [1, 2], ids=["one message", "two messages"])
def test_a_push_of_headers_alone_is_bad_size(cluster, headers):
    """A Push whose messages carry no chunk ended before its range: bad_size, as the proto lists it."""
    c = cluster(1)
    client = c.client(SPEC, init=np.ones(SPEC.size, np.float32)).join()
    channel = grpc.insecure_channel(c.addresses[0])
    try:
        push = ps_pb2_grpc.ParameterServerStub(channel).Push
        messages = [ps_pb2.PushRequest(worker_id=client.worker_id, clock=0, version=0, num_chunks=1)] + [
            ps_pb2.PushRequest()
        ] * (headers - 1)
        with pytest.raises(grpc.RpcError) as refused:
            push(iter(messages), timeout=10)
    finally:
        channel.close()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(refused.value.trailing_metadata())["ps-reason"] == "bad_size"
    assert "covered 0 of this shard's 12 elements" in refused.value.details()
    assert c.shard().version == 0 and c.shard().stats()["rejected"] == 1
