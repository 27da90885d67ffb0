"""Staleness compensation on the shards (compensation.py): dc and auto momentum against NumPy references."""

from __future__ import annotations

import numpy as np
import pytest

from psgrid.psserver.config import ServerConfig
from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.kernels.compensation import DC_EPS, DelayCompensation, effective_momentum
from psgrid.psserver.kernels.optim import SGD, Adam
from psgrid.psserver.kernels.parallel import MIN_CHUNK, Chunks
from psgrid.psserver.protocol import Outcome
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.state.shard import Shard
from psgrid.psserver.state.updater import CompensatedUpdater

SPEC = ModelSpec([("w", (40,)), ("b", (3,))])


def dc_reference(g, now, pulled, mean_square, lambda0=2.0, beta=0.95):
    """DC-ASGD-a as Zheng et al. (2017) write it, in float64: returns (g_dc, the new mean square)."""
    g, now, pulled = (np.asarray(a, np.float64) for a in (g, now, pulled))
    mean_square = beta * mean_square + (1 - beta) * g * g
    lam = lambda0 / np.sqrt(mean_square + DC_EPS)
    return g + lam * g * g * (now - pulled), mean_square


def make_shard(**settings) -> Shard:
    shard = Shard(ServerConfig(shared_memory=False, **settings))
    shard.init(SPEC, np.random.default_rng(0).normal(size=SPEC.size).astype(np.float32))
    return shard


def push(shard: Shard, worker: int, clock: int, version_used: int, grad: np.ndarray):
    buf = shard.pool.take()
    np.copyto(buf, grad)
    result, kept = shard.push(worker, clock, version_used, buf, 0)
    if not kept:
        shard.pool.give(buf)
    assert result.outcome is Outcome.APPLIED, result
    return result


class Workers:
    """Workers that join ``shard`` and push from its current version, each at its own clock."""

    def __init__(self, shard: Shard):
        self.shard, self.clocks = shard, {}

    def join(self, *workers: int) -> None:
        for worker in workers:
            self.clocks[worker] = self.shard.register(SPEC.hash(), worker, -1, "test")["start_clock"]

    def push(self, worker: int, grad: np.ndarray) -> None:
        push(self.shard, worker, self.clocks[worker], self.shard.version, grad)
        self.clocks[worker] += 1


# ----- dc ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_dc_at_staleness_0_is_plain_sgd_bit_for_bit(momentum):
    size = 2 * MIN_CHUNK + 1001  # several threads' chunks, several blocks each
    rng = np.random.default_rng(1)
    w = rng.normal(size=size).astype(np.float32)
    plain, dc = (SGD(size, lr=0.3, momentum=momentum, chunks=Chunks(3)) for _ in range(2))
    delay = DelayCompensation(size)
    w_plain, w_dc = w.copy(), w.copy()
    for _ in range(3):
        g = rng.normal(size=size).astype(np.float32)
        out_plain, out_dc = np.empty_like(w), np.empty_like(w)
        plain.step(w_plain, g, out=out_plain)
        dc.step(w_dc, g, out=out_dc, check_finite=True, delay=delay, pulled=w_dc)  # w_pulled == w_now
        np.testing.assert_array_equal(out_dc, out_plain)
        w_plain, w_dc = out_plain, out_dc
    assert delay.mean_square.any()  # the mean square took every gradient all the same


def test_dc_step_matches_numpy_dc_asgd_a_over_chunks_and_threads():
    size = 2 * MIN_CHUNK + 77
    rng = np.random.default_rng(2)
    versions = [rng.normal(size=size).astype(np.float32)]
    opt, delay = SGD(size, lr=0.05, momentum=0.5, chunks=Chunks(3)), DelayCompensation(size, lambda0=3.0, beta=0.9)
    ref_w, ref_v, ref_m = versions[0].astype(np.float64), np.zeros(size), np.zeros(size)
    for step, staleness in enumerate([0, 1, 2, 1, 2]):
        g = rng.normal(size=size).astype(np.float32)
        pulled = versions[max(0, len(versions) - 1 - staleness)]
        out = np.empty(size, np.float32)
        opt.step(versions[-1], g, out=out, delay=delay, pulled=pulled)
        g_dc, ref_m = dc_reference(g, ref_w, pulled, ref_m, lambda0=3.0, beta=0.9)
        ref_v = 0.5 * ref_v + g_dc
        ref_w = ref_w - 0.05 * ref_v
        np.testing.assert_allclose(out, ref_w, rtol=1e-5, atol=1e-5, err_msg=f"step {step}")
        versions.append(out)
    np.testing.assert_allclose(delay.mean_square, ref_m, rtol=1e-5, atol=1e-7)


def test_a_dc_shard_compensates_stale_pushes_from_the_versions_its_ring_holds():
    shard = make_shard(mode="async", lr=0.5, staleness_compensation="dc")
    for worker in (0, 1):
        shard.register(SPEC.hash(), worker, -1, "test")
    rng = np.random.default_rng(3)
    versions = [shard.weights.astype(np.float64)]
    ref_m = np.zeros(SPEC.size)
    plain = versions[0].copy()
    # (worker, clock, version used): staleness 0, 1, 1, 2
    for worker, clock, used in [(0, 0, 0), (1, 0, 0), (0, 1, 1), (1, 1, 1)]:
        g = rng.normal(size=SPEC.size).astype(np.float32)
        result = push(shard, worker, clock, used, g)
        assert result.staleness == len(versions) - 1 - used
        g_dc, ref_m = dc_reference(g, versions[-1], versions[used], ref_m)
        versions.append(versions[-1] - 0.5 * g_dc)
        plain = plain - 0.5 * g
        np.testing.assert_allclose(shard.weights, versions[-1], rtol=1e-5, atol=1e-5)
    assert np.abs(shard.weights - plain).max() > 1e-2  # the compensation did change the updates
    assert shard.stats()["uncompensated_updates"] == 0
    np.testing.assert_allclose(shard.updater.delay.mean_square, ref_m, rtol=1e-5, atol=1e-7)


def test_a_stale_push_whose_version_the_ring_no_longer_holds_goes_uncompensated_and_is_counted():
    shard = make_shard(mode="ssp", staleness=10, lr=0.5, staleness_compensation="dc")
    shard.register(SPEC.hash(), 0, -1, "test")
    shard.register(SPEC.hash(), 1, -1, "test")
    rng = np.random.default_rng(4)
    for clock in range(4):  # worker 0 alone: versions 1..4, each from the last
        push(shard, 0, clock, clock, rng.normal(size=SPEC.size).astype(np.float32))
    assert shard.ring.find(0) is None  # version 0's buffer was written over
    before = shard.weights.astype(np.float64)
    ms = shard.updater.delay.mean_square.astype(np.float64)
    g = rng.normal(size=SPEC.size).astype(np.float32)
    result = push(shard, 1, 0, 0, g)  # computed from version 0, 4 versions ago
    assert result.staleness == 4
    np.testing.assert_allclose(shard.weights, before - 0.5 * g, rtol=1e-6, atol=1e-6)  # plain SGD
    assert shard.stats()["uncompensated_updates"] == 1
    _, ms = dc_reference(g, before, before, ms)
    np.testing.assert_allclose(shard.updater.delay.mean_square, ms, rtol=1e-5, atol=1e-7)


def test_the_ring_finds_a_version_only_while_a_buffer_holds_it():
    from psgrid.psserver.state.weight_ring import WeightRing

    ring = WeightRing(4, shared=False)
    ring.publish(ring.current, 7)
    target = ring.spare()
    ring.publish(target, 8)
    assert (ring.find(7), ring.find(8)) == (0, target)
    kept = ring.spare_keeping(0, 9)  # the update reads version 7: a new buffer
    assert kept not in (0, target) and ring.find(7) == 0
    again = ring.spare()  # handed out to be written: 7 is gone
    assert again == 0 and ring.find(7) is None and ring.find(9) is None
    ring.publish(kept, 9)
    assert ring.spare_keeping(None, 8) == 0  # 8 and 9 are kept; 0 holds no version
    ring.publish(0, 10)
    assert ring.spare_keeping(None, 8) == 3 and ring.find(8) == target  # all kept: the ring grows
    assert ring.spare_keeping(None, 9) == target  # 8 may go now


def test_a_dc_shard_keeps_dc_versions_past_versions_to_compensate_from():
    shard = make_shard(mode="async", lr=0.5, staleness_compensation="dc", dc_versions=3)
    shard.register(SPEC.hash(), 0, -1, "test")
    rng = np.random.default_rng(6)
    for clock in range(6):
        push(shard, 0, clock, clock, rng.normal(size=SPEC.size).astype(np.float32))
    assert [shard.ring.find(v) is not None for v in range(7)] == [False] * 3 + [True] * 4
    assert len(shard.ring.arrays) == 4  # the current version and 3 past ones
    push(shard, 0, 6, 3, rng.normal(size=SPEC.size).astype(np.float32))  # staleness 3: compensated
    assert shard.stats()["uncompensated_updates"] == 0
    assert len(shard.ring.arrays) == 5  # version 3 was read as version 7 was written
    push(shard, 0, 7, 4, rng.normal(size=SPEC.size).astype(np.float32))  # staleness 3 again
    assert shard.stats()["uncompensated_updates"] == 0
    push(shard, 0, 8, 2, rng.normal(size=SPEC.size).astype(np.float32))  # version 2 is long gone
    assert shard.stats()["uncompensated_updates"] == 1 and len(shard.ring.arrays) == 5


def test_sync_shards_never_compensate():
    shard = make_shard(mode="sync", staleness_compensation="dc", async_momentum="auto", momentum=0.9)
    assert not isinstance(shard.updater, CompensatedUpdater)  # a plain step: no dc, no auto momentum


# ----- auto momentum ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "momentum, workers, expected",
    [(0.9, 1, 0.9), (0.9, 2, 0.4), (0.9, 4, 0.15), (0.5, 1, 0.5), (0.5, 2, 0.0), (0.5, 4, 0.0)],
)
def test_auto_momentum_is_mu_less_one_minus_one_over_w(momentum, workers, expected):
    assert effective_momentum(momentum, workers) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_an_auto_momentum_shard_follows_the_live_workers(mode):
    shard = make_shard(mode=mode, staleness=10, lr=0.1, momentum=0.9, async_momentum="auto")
    rng = np.random.default_rng(5)
    w, v = shard.weights.astype(np.float64), np.zeros(SPEC.size)
    workers = Workers(shard)

    def step(worker, mu):
        nonlocal w, v
        g = rng.normal(size=SPEC.size).astype(np.float32)
        workers.push(worker, g)
        v = mu * v + g if mu else np.zeros(SPEC.size)
        w = w - 0.1 * (v if mu else g)
        assert shard.stats()["momentum"] == pytest.approx(mu, abs=1e-12)
        np.testing.assert_allclose(shard.weights, w, rtol=1e-5, atol=1e-5)

    workers.join(0, 1)
    step(0, 0.4)
    step(1, 0.4)
    workers.join(2, 3)
    step(2, 0.15)
    for worker in (1, 2, 3):
        shard.leave(worker)
    step(0, 0.9)


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_an_auto_momentum_adam_shard_lowers_beta1_by_the_live_workers(mode):
    """Adam's momentum is beta1: W workers take 1 - 1/W off it, checked against torch's Adam in float64."""
    lr, b2, eps = 0.01, 0.999, 1e-8
    shard = make_shard(mode=mode, staleness=10, optimizer="adam", lr=lr, async_momentum="auto")
    rng = np.random.default_rng(6)
    w, m, v = shard.weights.astype(np.float64), np.zeros(SPEC.size), np.zeros(SPEC.size)
    workers, t = Workers(shard), 0

    def step(worker, b1):
        nonlocal w, m, v, t
        g = rng.normal(size=SPEC.size).astype(np.float32)
        workers.push(worker, g)
        t += 1
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g.astype(np.float64) ** 2
        w = w - lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        assert shard.stats()["momentum"] == pytest.approx(b1, abs=1e-12)
        np.testing.assert_allclose(shard.weights, w, rtol=1e-4, atol=1e-5)

    workers.join(0, 1)
    step(0, 0.4)
    step(1, 0.4)
    workers.join(2, 3)
    step(2, 0.15)
    step(3, 0.15)


def test_a_beta1_out_of_range_is_refused_and_changes_nothing():
    adam = Adam(SPEC.size, lr=0.01)
    with pytest.raises(InvalidArgument, match=r"beta1 must be in \[0, 1\), got 1.0"):
        adam.set_beta1(1.0)
    assert adam.beta1 == 0.9


def test_a_sync_adam_shard_keeps_beta1_under_auto_momentum():
    shard = make_shard(mode="sync", optimizer="adam", lr=0.01, async_momentum="auto")
    for worker in (0, 1):
        shard.register(SPEC.hash(), worker, -1, "test")
    assert not isinstance(shard.updater, CompensatedUpdater) and shard.stats()["momentum"] == 0.9


def test_auto_momentum_that_reaches_zero_clears_the_velocity():
    shard = make_shard(mode="async", lr=0.1, momentum=0.5, async_momentum="auto")
    shard.register(SPEC.hash(), 0, -1, "test")
    push(shard, 0, 0, 0, np.ones(SPEC.size, np.float32))  # alone: momentum 0.5, a velocity of ones
    shard.register(SPEC.hash(), 1, -1, "test")
    before = shard.weights.copy()
    push(shard, 1, 1, 1, np.ones(SPEC.size, np.float32))  # two: 0.5 - 0.5 = 0, plain SGD
    assert shard.optimizer.momentum == 0.0 and not shard.optimizer._v.any()
    np.testing.assert_allclose(shard.weights, before - 0.1, rtol=1e-6)


# ----- settings ---------------------------------------------------------------------------------


def test_lr_compensation_is_staleness_compensation_lr():
    assert ServerConfig(staleness_compensation="lr").compensation == "lr"
    assert ServerConfig().compensation == "none"
    assert make_shard(staleness_compensation="lr").updater.lr_staleness and not make_shard().updater.lr_staleness


@pytest.mark.parametrize(
    "settings, message",
    [
        (
            {"staleness_compensation": "delay"},
            "staleness_compensation must be one of ('none', 'lr', 'dc'), got 'delay'",
        ),
        ({"async_momentum": "on"}, "async_momentum must be one of ('off', 'auto'), got 'on'"),
        ({"dc_lambda0": 0.0}, "dc_lambda0 must be finite and > 0"),
        ({"dc_beta": 1.0}, "dc_beta must be in [0, 1)"),
    ],
)
def test_bad_compensation_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(InvalidArgument) as err:
        ServerConfig(**settings)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_an_earlier_job_file_with_lr_staleness_is_read_and_a_command_line_is_refused_naming_the_key():
    from psgrid.cluster.errors import ConfigError
    from psgrid.cluster.job.config import apply_overrides, job_from_dict

    job = job_from_dict({"server": {"staleness_compensation": "dc", "async_momentum": "auto", "momentum": 0.9}})
    assert (job.server.compensation, job.server.async_momentum) == ("dc", "auto")
    # Every job.toml written before the alias went says lr_staleness = false; a resume must read it.
    assert job_from_dict({"server": {"lr_staleness": False}}).server.compensation == "none"
    assert job_from_dict({"lr_staleness": True}).server.compensation == "lr"
    with pytest.raises(ConfigError) as err:
        job_from_dict({"server": {"lr_staleness": True, "staleness_compensation": "dc"}})
    assert "[server] lr_staleness = true means" in str(err.value) and "\n" not in str(err.value)
    for where in ({"train": {"lr_staleness": True}},):
        with pytest.raises(ConfigError, match='use staleness_compensation = "lr"'):
            job_from_dict(where)
    with pytest.raises(ConfigError, match='use staleness_compensation = "lr"') as err:
        apply_overrides(job, {"lr_staleness": True})
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError, match=r"must be one of \('none', 'lr', 'dc'\)"):
        job_from_dict({"server": {"staleness_compensation": "1/s"}})


def test_psctl_server_takes_the_compensation_flags():
    from psgrid.cluster.cli import build_parser
    from psgrid.cluster.commands.server import server_config_from_args
    from psgrid.cluster.errors import ConfigError

    args = [
        "server",
        "--staleness-compensation",
        "dc",
        "--dc-lambda0",
        "0.5",
        "--dc-beta",
        "0.9",
        "--async-momentum",
        "auto",
        "--momentum",
        "0.9",
    ]
    c = server_config_from_args(build_parser().parse_args(args))
    assert (c.compensation, c.dc_lambda0, c.dc_beta, c.async_momentum) == ("dc", 0.5, 0.9, "auto")
    with pytest.raises(ConfigError, match="--staleness-compensation dc"):
        server_config_from_args(
            build_parser().parse_args(["server", "--device", "gpu", "--staleness-compensation", "dc"])
        )


def test_a_restored_dc_shard_compensates_from_the_version_it_restored(tmp_path):
    settings = dict(mode="async", lr=0.5, staleness_compensation="dc", checkpoint_dir=str(tmp_path))
    shard = make_shard(**settings)
    shard.register(SPEC.hash(), 0, -1, "test")
    shard.register(SPEC.hash(), 1, -1, "test")
    rng = np.random.default_rng(7)
    for clock in range(3):
        push(shard, 0, clock, clock, rng.normal(size=SPEC.size).astype(np.float32))
    shard.checkpoint()  # version 3
    restored = Shard(ServerConfig(shared_memory=False, **settings))
    assert restored.version == 3 and restored.ring.find(3) == restored.ring.current
    push(restored, 0, 3, 3, rng.normal(size=SPEC.size).astype(np.float32))
    push(restored, 1, 0, 3, rng.normal(size=SPEC.size).astype(np.float32))  # staleness 1, from the restored one
    assert restored.stats()["uncompensated_updates"] == 0
    push(restored, 0, 4, 2, rng.normal(size=SPEC.size).astype(np.float32))  # version 2: before the restart
    assert restored.stats()["uncompensated_updates"] == 1


def test_a_dc_step_with_pulled_weights_of_another_shape_changes_nothing():
    opt, delay = SGD(8, lr=0.1), DelayCompensation(8)
    w, g = np.ones(8, np.float32), np.ones(8, np.float32)
    with pytest.raises(InvalidArgument, match=r"pulled must be float32 of shape \(8,\)"):
        opt.step(w, g, delay=delay, pulled=np.ones(7, np.float32))
    assert opt.steps == 0 and not delay.mean_square.any() and (w == 1).all()
