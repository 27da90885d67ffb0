"""Pulls into and pushes out of a model's own GPU tensors in one launch (worker/fused_copies.py): exact, and only where it can be."""

from __future__ import annotations

import numpy as np
import pytest

from psgrid.psserver.config import ServerConfig
from psgrid.psserver.spec import ModelSpec
from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu

# Sizes that split the chunks of a block unevenly: a scalar, a tensor past one chunk (2,048), odd shapes.
SPEC = ModelSpec([("a", (3, 5)), ("b", (1,)), ("c", (4097,)), ("d", (64, 64)), ("e", (2, 3, 7)), ("f", (2049,))])


def _model(cupy, dtype=None):
    return {p.name: cupy.full(p.shape, cupy.nan, dtype or cupy.float32) for p in SPEC.params}


@pytest.mark.parametrize("cuts", [(), (7,), (15, 16, 4113), (1000, 6000, 9000)])
def test_each_range_lands_in_exactly_the_parameters_it_covers(cuts):
    cupy = cupy_or_skip()
    from psgrid.worker.fused_copies import FusedCopies

    model = _model(cupy)
    scatter = FusedCopies.of(SPEC, model)
    assert scatter is not None
    flat = cupy.asarray(np.random.default_rng(len(cuts)).normal(size=SPEC.size).astype(np.float32))
    bounds = [0, *cuts, SPEC.size]
    stream = cupy.cuda.Stream(non_blocking=True)
    for begin, end in zip(bounds, bounds[1:]):
        scatter.scatter(flat[begin:end].copy(), begin, end, stream)  # a copy: each range is an array of its own
    stream.synchronize()
    expected = SPEC.views(cupy.asnumpy(flat))
    for name, array in model.items():
        np.testing.assert_array_equal(cupy.asnumpy(array), expected[name], err_msg=name)  # every element written


def test_a_range_of_the_wrong_length_is_refused_and_writes_nothing():
    cupy = cupy_or_skip()
    from psgrid.worker.fused_copies import FusedCopies

    model = _model(cupy)
    scatter = FusedCopies.of(SPEC, model)
    with pytest.raises(ValueError, match="a range of 10 elements, given 9"):
        scatter.scatter(cupy.zeros(9, cupy.float32), 0, 10, cupy.cuda.get_current_stream())
    assert all(bool(cupy.isnan(a).all()) for a in model.values())


def test_parameters_it_cannot_write_exactly_keep_the_copy_per_tensor():
    cupy = cupy_or_skip()
    from psgrid.worker.fused_copies import FusedCopies

    half = _model(cupy)
    half["c"] = half["c"].astype(cupy.float16)
    strided = _model(cupy)
    strided["d"] = cupy.empty((64, 128), cupy.float32)[:, ::2]
    on_host = {p.name: np.zeros(p.shape, np.float32) for p in SPEC.params}
    assert [FusedCopies.of(SPEC, m) for m in (half, strided, on_host)] == [None, None, None]


@pytest.mark.parametrize("cuts", [(), (15, 16, 4113)])
def test_a_steps_gradients_are_gathered_into_each_range_and_a_missing_one_as_zeros(cuts):
    cupy = cupy_or_skip()
    from psgrid.worker.fused_copies import FusedCopies

    rng = np.random.default_rng(3)
    copies = FusedCopies.of(SPEC, _model(cupy))
    grads = {p.name: cupy.asarray(rng.normal(size=p.shape).astype(np.float32)) for p in SPEC.params}
    grads["c"] = None  # a parameter that took no part in the loss
    gather = copies.gatherer([grads[name] for name in SPEC.names])
    bounds = [0, *cuts, SPEC.size]
    stream = cupy.cuda.Stream(non_blocking=True)
    ranges = [cupy.full(end - begin, cupy.nan, cupy.float32) for begin, end in zip(bounds, bounds[1:])]
    for (begin, end), out in zip(zip(bounds, bounds[1:]), ranges):
        gather(begin, end, out, stream)
    stream.synchronize()
    flat = cupy.asnumpy(cupy.concatenate(ranges))
    for name, array in SPEC.views(flat).items():
        expected = np.zeros(array.shape, np.float32) if grads[name] is None else cupy.asnumpy(grads[name])
        np.testing.assert_array_equal(array, expected, err_msg=name)
    grads["a"] = grads["a"].astype(cupy.float64)
    assert copies.gatherer([grads[name] for name in SPEC.names]) is None  # converted per tensor instead


def _device_shard(mode: str, in_process: bool):
    from psgrid.psserver.server import serve

    config = ServerConfig(host="127.0.0.1", port=0, shard_device="gpu", mode=mode, lr=0.5, job_id="scatter-test")
    return serve(config, in_process_clients=in_process)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("plane", ["local", "tcp"])
def test_a_scripts_pull_lands_in_its_own_tensors_from_the_shards_device_array_or_host_memory(mode, plane):
    """The in-process plane lends the shard's device array; TCP lands in host memory, uploaded once."""
    cupy = cupy_or_skip()
    import psgrid

    cupy.cuda.Device(0).use()
    server = _device_shard(mode, in_process=plane == "local")
    try:
        model = {p.name: cupy.ones(p.shape, cupy.float32) for p in SPEC.params}
        options = {} if plane == "local" else {"data_plane": "tcp", "shared_memory": False}
        with psgrid.init(model, addresses=[server.address], world=1, rank=0, **options) as ps:
            assert ps.client.data_planes == [plane] and ps._scatter is not None
            pulled = ps.pull()
            assert all(pulled[name] is model[name] for name in model)  # the model's own arrays, no flat copy
            grads = {name: cupy.full(a.shape, 2.0, cupy.float32) for name, a in model.items()}
            for _ in range(3):
                ps.push(grads, loss=1.0)
                ps.pull()
        np.testing.assert_allclose(_weights(server), 1.0 - 3 * 0.5 * 2.0)  # closed: every push applied
        # The last pull's version in every tensor: the last in sync; in async, where the push may still have
        # been in flight, one of the versions.
        versions = {-2.0} if mode == "sync" else {1.0 - k * 0.5 * 2.0 for k in range(4)}
        seen = {float(v) for array in model.values() for v in np.unique(cupy.asnumpy(array))}
        assert len(seen) == 1 and seen <= versions, seen
    finally:
        server.stop()


def _weights(server) -> np.ndarray:
    shard = server.shard
    return shard.arrays.download(shard.weights)


@pytest.mark.timeout(120)
def test_a_torch_model_is_pulled_into_its_parameters_in_place():
    cupy_or_skip()
    torch = pytest.importorskip("torch")
    import psgrid

    server = _device_shard("sync", in_process=True)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(33, 70), torch.nn.ReLU(), torch.nn.Linear(70, 3)).cuda()
        storage = [p.data_ptr() for p in model.parameters()]
        first = [p.detach().clone() for p in model.parameters()]
        with psgrid.init(model, addresses=[server.address], world=1, rank=0) as ps:
            assert ps._scatter is not None
            ps.pull()
            for p, before in zip(model.parameters(), first):
                torch.testing.assert_close(p.detach(), before, rtol=0, atol=0)  # rank 0's weights came back
            x = torch.randn(16, 33, device="cuda")
            model(x).square().mean().backward()
            grads = [p.grad.detach().clone() for p in model.parameters()]
            ps.push(loss=1.0)
            ps.pull()
        assert [p.data_ptr() for p in model.parameters()] == storage  # written in place
        for p, before, g in zip(model.parameters(), first, grads):
            torch.testing.assert_close(p.detach(), before - 0.5 * g, rtol=1e-6, atol=1e-6)
    finally:
        server.stop()


# A script on the same GPU as a device shard of another process: pulls and pushes over CUDA IPC.
IPC_SCRIPT = r"""
import json, sys
import cupy, numpy as np
import psgrid
from psgrid.psserver.spec import ModelSpec

spec = ModelSpec([("a", (3, 5)), ("b", (1,)), ("c", (4097,)), ("d", (64, 64))])
model = {p.name: cupy.ones(p.shape, cupy.float32) for p in spec.params}
with psgrid.init(model, addresses=[sys.argv[1]], world=1, rank=0) as ps:
    first = ps.pull()
    seen = dict(planes=ps.client.data_planes, scatters=ps._scatter is not None, gathers=ps._gathers,
                own=all(first[n] is model[n] for n in model))
    for step in range(3):
        grads = {n: cupy.full(a.shape, float(step + 1), cupy.float32) for n, a in model.items()}
        grads["b"] = None
        ps.push(grads, loss=1.0)
        ps.pull()
    seen["model"] = {n: cupy.asnumpy(a).ravel().tolist()[:3] for n, a in model.items()}
print(json.dumps(seen))
"""


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_over_cuda_ipc_a_script_gathers_into_the_shards_slots_in_sync_and_pulls_into_its_tensors(mode):
    cupy_or_skip()
    import json
    import subprocess
    import sys

    server = _device_shard(mode, in_process=False)
    try:
        done = subprocess.run(
            [sys.executable, "-c", IPC_SCRIPT, server.address], capture_output=True, text=True, timeout=150
        )
        assert done.returncode == 0, done.stderr[-3000:]
        seen = json.loads(done.stdout.splitlines()[-1])
        assert seen["planes"] == ["ipc"] and seen["scatters"] and seen["own"]
        assert seen["gathers"] is (mode == "sync")  # async overlaps the push with the next step: no gather there
        # lr 0.5, gradients 1, 2 and 3 (b: none, so zeros): each push applied in turn, in either mode
        expected = {"a": 1.0 - 0.5 * 6, "b": 1.0, "c": 1.0 - 0.5 * 6, "d": 1.0 - 0.5 * 6}
        if mode == "sync":  # async's last pull may come before its last push is applied
            for name, values in seen["model"].items():
                assert values == [expected[name]] * len(values), name
        np.testing.assert_allclose(_weights(server)[:15], expected["a"])
        np.testing.assert_allclose(_weights(server)[15], 1.0)
    finally:
        server.stop()
