"""The wire contract is complete: a worker written from proto/ps.proto and the docs alone trains beside a Client.

tests/wire_client.py is that worker (gRPC, the generated modules and the standard library only).
Here it registers with a token, sends Init, splits the vector over two shards in chunks of the size
the shards report, and trains in async and in sync beside a ``psgrid.Client`` worker; the final
weights are checked exactly. Values are small dyadic numbers and lr is 1/2, so every sum and
product the shards make is exact and the expected weights do not depend on the order of updates.
"""

from __future__ import annotations

import ast
import hashlib
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from psgrid.psserver.spec import ModelSpec
from tests import wire_client
from tests.wire_client import WireWorker

ROOT = Path(__file__).resolve().parent.parent
TOKEN = "wire-client-token"
PARAMS = [("layer.weight", [40, 50]), ("layer.bias", [40]), ("gain", [])]  # 2041 elements
SPEC = ModelSpec([(name, tuple(shape)) for name, shape in PARAMS])
STEPS = 5

# The test vectors of the spec hash that proto/ps.proto and docs/contract.md give: (params, canonical text, hash).
HASH_VECTORS = [
    (
        [("layer1.weight", [4, 3]), ("layer1.bias", [4]), ("scale", [])],
        '[["layer1.weight",[4,3],"float32"],["layer1.bias",[4],"float32"],["scale",[],"float32"]]',
        "8513880b1cb74a54143811ed065797dc",
    ),
    (
        [("poids_\u00e9", [2, 2]), ("\u5c64", [3]), ("emoji_\U0001f642", [1]), ('q"\\/x', [2])],
        '[["poids_\\u00e9",[2,2],"float32"],["\\u5c64",[3],"float32"],["emoji_\\ud83d\\ude42",[1],"float32"],'
        '["q\\"\\\\/x",[2],"float32"]]',
        "3a648d74ce573e296b927571ffdae8ad",
    ),
]


def test_the_wire_client_imports_no_psgrid_code_but_the_generated_modules():
    tree = ast.parse((ROOT / "tests" / "wire_client.py").read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported |= {f"{node.module}.{alias.name}" for alias in node.names}
    outside = {name for name in imported if name.split(".")[0] not in sys.stdlib_module_names | {"grpc"}}
    assert outside == {"psgrid.psserver.rpc.ps_pb2", "psgrid.psserver.rpc.ps_pb2_grpc"}


@pytest.mark.parametrize("params, canonical, digest", HASH_VECTORS)
def test_the_documented_hash_vectors(params, canonical, digest):
    """The rule as documented, computed three ways: by hand, by the wire client, by ModelSpec."""
    assert hashlib.sha256(canonical.encode("ascii")).hexdigest()[:32] == digest
    assert wire_client.canonical_spec(params) == canonical and wire_client.spec_hash(params) == digest
    assert json.dumps([[n, s, "float32"] for n, s in params], separators=(",", ":")) == canonical
    assert ModelSpec([(n, tuple(s)) for n, s in params]).hash() == digest
    # ... and the proto and the docs show each vector as the test has it
    for doc in ("proto/ps.proto", "docs/contract.md"):
        text = (ROOT / doc).read_text()
        assert canonical in text and digest in text, f"{doc} does not show the hash vector {digest}"


def test_the_wire_clients_hash_agrees_with_modelspec_on_awkward_names():
    names = ["a", "\x00\x1f\x7f", "tab\there", "\u2028", "\U0010ffff", "é/ü", 'x"y\\z', "\ud7ff\ue000"]
    for i, name in enumerate(names):
        params = [(name, [i, 2]), ("b", [])]
        assert wire_client.spec_hash(params) == ModelSpec([(n, tuple(s)) for n, s in params]).hash(), repr(name)


def initial_weights() -> np.ndarray:
    return (np.arange(SPEC.size) % 17 - 8).astype(np.float32)


TARGET = (np.arange(SPEC.size) % 5 - 2).astype(np.float32)
OFFSET = np.where(np.arange(SPEC.size) % 2, 1.0, -1.0).astype(np.float32)


def client_worker(c, mode: str, results: list) -> None:
    """The psgrid.Client beside the wire worker: STEPS pulls and pushes of a gradient it records."""
    with c.client(SPEC, world=2, token=TOKEN) as client:
        w = SPEC.flat()
        for step in range(STEPS):
            client.pull(w).wait()
            grad = (w - TARGET + OFFSET) if mode == "sync" else np.full(SPEC.size, float(step + 1), np.float32)
            results.append((client.worker_id, grad.copy(), client.push(grad).wait()))


def in_thread(fn, *args) -> tuple[threading.Thread, list]:
    """Run ``fn(*args)`` in a thread; the list gets its exception, if any."""
    errors: list = []

    def run():
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_worker_written_from_the_proto_trains_beside_a_client(cluster, mode):
    c = cluster(2, mode=mode, lr=0.5, token=TOKEN, chunk_bytes=4096)  # 4 KiB chunks: several per range
    wire = WireWorker(c.addresses, PARAMS, TOKEN, world=2)
    theirs: list = []
    try:
        joining, join_errors = in_thread(wire.join, initial_weights().tolist())
        for _ in range(500):  # it registers first, so it has the lowest id and sends Init
            if wire.worker_id >= 0 or join_errors:
                break
            time.sleep(0.01)
        beside, beside_errors = in_thread(client_worker, c, mode, theirs)
        joining.join(20)
        assert not join_errors and not joining.is_alive(), join_errors
        assert wire.worker_id == 0 and wire.max_chunk_bytes == [4096, 4096]
        ours = []
        for step in range(STEPS):
            w = np.array(wire.pull(), np.float32)
            grad = (w - TARGET) if mode == "sync" else np.arange(SPEC.size, dtype=np.float32) % 3 * (step + 1)
            ours.append((wire.worker_id, grad, wire.push(grad.tolist())))
        beside.join(20)
        assert not beside_errors and not beside.is_alive(), beside_errors
        assert len(theirs) == STEPS
        wire.leave()
    finally:
        wire.close()
    expected = initial_weights()
    if mode == "async":
        # Every push applied once: each shard's versions after them are 1..2*STEPS; the order does not matter.
        for shard in range(2):
            versions = sorted([r[shard].version for _, _, r in ours] + [r[shard].version for _, _, r in theirs])
            assert versions == list(range(1, 2 * STEPS + 1))
        for _, grad, _ in ours + theirs:
            expected = expected - np.float32(0.5) * grad
    else:
        # Each round's mean, summed in worker order (the wire worker is 0), applied once.
        for (_, g0, _), (_, g1, _) in zip(ours, theirs):
            expected = expected - np.float32(0.5) * ((g0 + g1) * np.float32(0.5))
        outcomes = {r.outcome for _, _, replies in ours for r in replies}
        assert outcomes <= {0, 1}, outcomes  # applied (closed the round) or accumulated: none late
    np.testing.assert_array_equal(c.weights(), expected)
    assert [s.shard.version for s in c.servers] == [2 * STEPS if mode == "async" else STEPS] * 2
