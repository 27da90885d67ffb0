"""The shard's one Updater: chosen from the mode and the settings, and checked at Init before anything is published."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest

from psgrid.psserver.config import ServerConfig
from psgrid.psserver.exceptions import InvalidArgument, NotInitialized
from psgrid.psserver.kernels import optim
from psgrid.psserver.kernels.parallel import SERIAL
from psgrid.psserver.protocol import Outcome
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.state.device import HostArrays
from psgrid.psserver.state.shard import Shard
from psgrid.psserver.state.updater import CompensatedUpdater, HostUpdater, make_updater

SPEC = ModelSpec([("w", (6,)), ("b", (2,))])


def push_ones(shard: Shard, worker: int, clock: int):
    buf = shard.pool.take()
    buf.fill(1.0)
    result, kept = shard.push(worker, clock, shard.version, buf, buf.nbytes)
    if not kept:
        shard.pool.give(buf)
    return result


# Each optimizer setting out of its bounds (kernels/optim.py's BOUNDS), set past the job check as only a bug could.
BAD_SETTINGS = [
    ("sgd", "lr", float("inf")),
    ("sgd", "lr", 0.0),
    ("sgd", "momentum", 1.5),
    ("sgd", "weight_decay", -1.0),
    ("adam", "beta1", 1.0),
    ("adam", "beta2", -0.1),
    ("adam", "eps", 0.0),
    ("adam", "momentum", 1.5),
]


@pytest.mark.parametrize("optimizer, name, bad", BAD_SETTINGS)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_refused_init_leaves_the_shard_uninitialised_and_a_correct_init_then_trains(mode, optimizer, name, bad):
    shard = Shard(ServerConfig(shared_memory=False, mode=mode, optimizer=optimizer, lr=0.5))
    shard.register(SPEC.hash(), 0, -1, "test")
    good = getattr(shard.config, name)
    setattr(shard.config, name, bad)
    with pytest.raises(InvalidArgument, match=name) as refused:
        shard.init(SPEC, SPEC.flat())
    assert "\n" not in str(refused.value)
    assert not shard.initialized and shard.spec is None and shard.updater is None and shard.pool is None
    with pytest.raises(NotInitialized):  # not INTERNAL: nothing was half built
        shard.check_pusher(0)
    setattr(shard.config, name, good)
    assert shard.init(SPEC, SPEC.flat())
    assert push_ones(shard, 0, 0).outcome is Outcome.APPLIED  # sync: the round of one worker closes
    assert shard.version == 1 and not np.array_equal(shard.weights, SPEC.flat())


@pytest.mark.parametrize(
    "mode, settings, kind, keeps",
    [
        ("async", {}, HostUpdater, 0),
        ("async", {"staleness_compensation": "lr"}, HostUpdater, 0),
        ("async", {"staleness_compensation": "dc", "dc_versions": 4}, CompensatedUpdater, 4),
        ("ssp", {"async_momentum": "auto", "momentum": 0.9}, CompensatedUpdater, 0),
        ("async", {"async_momentum": "auto"}, HostUpdater, 0),  # no momentum to lower
        ("sync", {"staleness_compensation": "dc", "async_momentum": "auto", "momentum": 0.9}, HostUpdater, 0),
    ],
)
def test_the_update_is_chosen_once_from_the_mode_and_the_remedies(mode, settings, kind, keeps):
    config = ServerConfig(mode=mode, **settings)
    updater = make_updater(config, HostArrays(), 8, stale=mode != "sync", parts=SERIAL, live_workers=lambda: 1)
    assert type(updater) is kind and updater.keep_versions == keeps
    assert updater.lr_scale(4, 0) == (0.25 if config.compensation == "lr" else 1.0)


def test_a_device_shard_refuses_dc_before_it_builds_anything():
    config = ServerConfig(mode="async")
    config.staleness_compensation = "dc"  # past the job check, which refuses it too
    gpu = SimpleNamespace(on_gpu=True)  # refused before any GPU is touched
    with pytest.raises(InvalidArgument, match="dc' runs on host shards only"):
        make_updater(config, gpu, 8, stale=True, parts=SERIAL, live_workers=lambda: 1)


# ----- a device shard's path, with NumPy standing in for the GPU (the kernels themselves: test_device_*.py) ----------


class NumpyDeviceOptimizer:
    """A device optimizer's interface (``publish``: the next weights also written there) over the host's."""

    def __init__(self, host):
        self.host, self.momentum = host, getattr(host, "momentum", 0.0)

    def step(self, weights, grad, lr_scale=1.0, *, out=None, check_finite=False, publish=None, flag=None):
        if flag is not None and flag[0]:  # the guarded kernel writes nothing where its check's flag is set
            raise optim.NON_FINITE()
        self.host.step(weights, grad, lr_scale, out=out, check_finite=check_finite)
        if publish is not None:
            publish[...] = weights if out is None else out

    def set_momentum(self, momentum):
        self.host.set_momentum(momentum)
        self.momentum = momentum

    def warm_up(self):
        pass


class NumpyGpuArrays(HostArrays):
    """GpuArrays' interface on host memory: the shard takes every path a device shard takes."""

    on_gpu = True
    read_at_once = 0  # checks whose flag the shard read before the update (not left to the update's kernel)

    def adopt(self, values):
        return np.array(values, np.float32)

    def check_into(self, dst, src):
        np.copyto(dst, src)
        return np.array([0 if np.isfinite(src).all() else 1], np.int32)

    def flagged(self, flag) -> bool:
        self.read_at_once += 1
        return bool(flag[0])

    def copy_checked(self, dst, src) -> bool:
        return not self.flagged(self.check_into(dst, src))

    def warm_up(self):
        pass


@pytest.mark.parametrize(
    "mode, settings",
    [
        ("async", {}),
        ("ssp", {"staleness": 5}),
        ("sync", {}),
        ("async", {"momentum": 0.9, "async_momentum": "auto"}),
        ("ssp", {"staleness_compensation": "lr", "staleness": 5}),
    ],
)
def test_a_device_shards_update_trains_as_a_host_shards_does(monkeypatch, mode, settings):
    from psgrid.psserver.state import shard as shard_module

    device_optim = SimpleNamespace(
        make_device_optimizer=lambda name, size, **hp: NumpyDeviceOptimizer(optim.make_optimizer(name, size, **hp))
    )
    monkeypatch.setitem(sys.modules, "psgrid.psserver.kernels.device_optim", device_optim)

    def trained(arrays) -> Shard:
        monkeypatch.setattr(shard_module, "shard_arrays", lambda config: arrays)
        shard = Shard(ServerConfig(shared_memory=False, mode=mode, lr=0.1, **settings))
        shard.init(SPEC, np.linspace(-1, 1, SPEC.size).astype(np.float32))
        for worker in (0, 1):
            shard.register(SPEC.hash(), worker, -1, "test")
        rng = np.random.default_rng(0)
        for step in range(10):  # each a host gradient: a device shard stages it on its GPU first
            buf = shard.pool.take()
            buf[...] = rng.normal(size=SPEC.size)
            _, kept = shard.push(step % 2, step // 2, shard.version, buf, buf.nbytes)
            if not kept:
                shard.pool.give(buf)
        return shard

    host, device = trained(HostArrays()), trained(NumpyGpuArrays())
    assert type(device.updater).__name__ == "DeviceUpdater"
    assert device.version == host.version == (5 if mode == "sync" else 10)
    np.testing.assert_allclose(device.weights, host.weights, rtol=1e-6)
    assert device.stats()["momentum"] == host.stats()["momentum"]
    version, published = device.snapshot()  # what readers get: the copy written in the update's pass
    np.testing.assert_array_equal(published, device.weights)
    device.release_snapshot(published)


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_slots_check_reaches_async_update_on_the_device_and_sync_before_the_round(monkeypatch, mode):
    """A CUDA IPC slot's checked copy: in async its flag is left for the update (one wait for the GPU a push),
    in sync it is read before the push is taken; a NaN changes nothing either way (NumPy stands in for the GPU)."""
    from psgrid.psserver.service import ShardService
    from psgrid.psserver.state import shard as shard_module
    from psgrid.psserver.transports.ipc_server import DeviceSlot

    device_optim = SimpleNamespace(
        make_device_optimizer=lambda name, size, **hp: NumpyDeviceOptimizer(optim.make_optimizer(name, size, **hp))
    )
    monkeypatch.setitem(sys.modules, "psgrid.psserver.kernels.device_optim", device_optim)
    arrays = NumpyGpuArrays()
    monkeypatch.setattr(shard_module, "shard_arrays", lambda config: arrays)
    service = ShardService(Shard(ServerConfig(shared_memory=False, mode=mode, lr=0.5, momentum=0.9)))
    shard = service.shard
    shard.init(SPEC, np.zeros(SPEC.size, np.float32))
    shard.register(SPEC.hash(), 0, -1, "test")

    def push(values):
        return service.push(
            worker_id=0, clock=shard.policy.clocks[0], version=shard.version, source=DeviceSlot(values, arrays)
        )

    assert push(np.ones(SPEC.size, np.float32)).outcome is Outcome.APPLIED
    weights, momentum, version = shard.weights.copy(), shard.optimizer.host.state_dict(), shard.version
    bad = np.ones(SPEC.size, np.float32)
    bad[3] = np.nan
    with pytest.raises(InvalidArgument) as refused:
        push(bad)
    assert refused.value.reason.name == "NON_FINITE"
    np.testing.assert_array_equal(shard.weights, weights)
    np.testing.assert_array_equal(shard.optimizer.host.state_dict()["momentum_buffer"], momentum["momentum_buffer"])
    assert shard.version == version and shard.policy.clocks[0] == 1 and shard.pool.on_loan == 0
    assert push(np.ones(SPEC.size, np.float32)).outcome is Outcome.APPLIED
    np.testing.assert_allclose(shard.weights, -0.5 - 0.5 * 1.9)  # two steps of momentum 0.9 at lr 0.5
    assert arrays.read_at_once == (0 if mode == "async" else 3)  # async: each check read by the update itself
