"""The shard's one Updater: chosen from the mode and the settings, and checked at Init before anything is published."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from psgrid.psserver.config import ServerConfig
from psgrid.psserver.exceptions import InvalidArgument, NotInitialized
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
BAD_SETTINGS = [("sgd", "lr", float("inf")), ("sgd", "lr", 0.0), ("sgd", "momentum", 1.5),
                ("sgd", "weight_decay", -1.0), ("adam", "beta1", 1.0), ("adam", "beta2", -0.1),
                ("adam", "eps", 0.0), ("adam", "momentum", 1.5)]


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
    with pytest.raises(NotInitialized):       # not INTERNAL: nothing was half built
        shard.check_pusher(0)
    setattr(shard.config, name, good)
    assert shard.init(SPEC, SPEC.flat())
    assert push_ones(shard, 0, 0).outcome is Outcome.APPLIED      # sync: the round of one worker closes
    assert shard.version == 1 and not np.array_equal(shard.weights, SPEC.flat())


@pytest.mark.parametrize("mode, settings, kind, keeps", [
    ("async", {}, HostUpdater, 0),
    ("async", {"staleness_compensation": "lr"}, HostUpdater, 0),
    ("async", {"staleness_compensation": "dc", "dc_versions": 4}, CompensatedUpdater, 4),
    ("ssp", {"async_momentum": "auto", "momentum": 0.9}, CompensatedUpdater, 0),
    ("async", {"async_momentum": "auto"}, HostUpdater, 0),                  # no momentum to lower
    ("sync", {"staleness_compensation": "dc", "async_momentum": "auto", "momentum": 0.9}, HostUpdater, 0),
])
def test_the_update_is_chosen_once_from_the_mode_and_the_remedies(mode, settings, kind, keeps):
    config = ServerConfig(mode=mode, **settings)
    updater = make_updater(config, HostArrays(), 8, stale=mode != "sync", parts=SERIAL, live_workers=lambda: 1)
    assert type(updater) is kind and updater.keep_versions == keeps
    assert updater.lr_scale(4) == (0.25 if config.compensation == "lr" else 1.0)


def test_a_device_shard_refuses_dc_before_it_builds_anything():
    config = ServerConfig(mode="async")
    config.staleness_compensation = "dc"        # past the job check, which refuses it too
    gpu = SimpleNamespace(on_gpu=True)          # refused before any GPU is touched
    with pytest.raises(InvalidArgument, match="dc' runs on host shards only"):
        make_updater(config, gpu, 8, stale=True, parts=SERIAL, live_workers=lambda: 1)
