"""The device optimizers against the host ones: the same maths over several steps, on a GPU.

Each case runs the host optimizer (:mod:`psgrid.psserver.kernels.optim`) and its fused CuPy kernel
on the same random weights and gradients, with the same per-step ``lr_scale``, in place and into
another buffer, and compares weights and state after every step. Skipped where no GPU is present.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.kernels.optim import make_optimizer
from tests.gpu import cupy_or_skip

SIZE = 100_003  # not a multiple of any block or warp size
STEPS = 6
SCALES = [1.0, 0.5, 1.0, 0.25, 1.0, 2.0]

CASES = [
    ("sgd", dict(lr=0.1)),
    ("sgd", dict(lr=0.1, momentum=0.9)),
    ("sgd", dict(lr=0.1, momentum=0.9, nesterov=True)),
    ("sgd", dict(lr=0.1, weight_decay=0.01)),
    ("sgd", dict(lr=0.05, momentum=0.5, nesterov=True, weight_decay=0.1)),
    ("adam", dict(lr=0.01)),
    ("adam", dict(lr=0.01, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.05)),
]


def rel_err(got, want) -> float:
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


@pytest.fixture
def cupy():
    return cupy_or_skip()


def make_device(name, size, **hparams):
    from psgrid.psserver.kernels.device_optim import make_device_optimizer

    return make_device_optimizer(name, size, **hparams)


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("in_place", [True, False], ids=["in-place", "out"])
@pytest.mark.parametrize("name, hparams", CASES)
def test_device_matches_host_step_by_step(cupy, name, hparams, in_place):
    rng = np.random.default_rng(zlib.crc32(f"{name}{hparams}{in_place}".encode()))
    host = make_optimizer(name, SIZE, **hparams)
    device = make_device(name, SIZE, **hparams)
    w_host = rng.standard_normal(SIZE).astype(np.float32)
    w_dev = cupy.asarray(w_host)
    for step in range(STEPS):
        g = rng.standard_normal(SIZE).astype(np.float32)
        if in_place:
            host.step(w_host, g, SCALES[step])
            device.step(w_dev, cupy.asarray(g), SCALES[step])
        else:
            out_host = np.full(SIZE, np.nan, np.float32)
            out_dev = cupy.full(SIZE, cupy.nan, cupy.float32)  # poisoned: every element must be written
            before = w_dev.copy()
            host.step(w_host, g, SCALES[step], out=out_host)
            device.step(w_dev, cupy.asarray(g), SCALES[step], out=out_dev)
            np.testing.assert_array_equal(cupy.asnumpy(w_dev), cupy.asnumpy(before))  # the input is only read
            w_host, w_dev = out_host, out_dev
        got = cupy.asnumpy(w_dev)
        assert np.isfinite(got).all()
        assert rel_err(got, w_host) < 1e-5, (step, rel_err(got, w_host))
        host_state, device_state = host.state_dict(), device.state_dict()
        assert set(host_state) == set(device_state) and device_state["steps"] == host_state["steps"] == step + 1
        for key in set(host_state) - {"steps"}:
            assert rel_err(device_state[key], host_state[key]) < 1e-5, (step, key)


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_a_beta1_changed_between_steps_gives_the_host_maths(cupy):
    """``async_momentum = "auto"`` lowers Adam's beta1 as workers come and go: the device takes it as the host does."""
    rng = np.random.default_rng(11)
    host, device = make_optimizer("adam", SIZE, lr=0.01), make_device("adam", SIZE, lr=0.01)
    w_host = rng.standard_normal(SIZE).astype(np.float32)
    w_dev = cupy.asarray(w_host)
    for beta1 in (0.9, 0.4, 0.4, 0.15, 0.0, 0.9):
        host.set_beta1(beta1)
        device.set_beta1(beta1)
        g = rng.standard_normal(SIZE).astype(np.float32)
        host.step(w_host, g)
        device.step(w_dev, cupy.asarray(g))
        assert rel_err(cupy.asnumpy(w_dev), w_host) < 1e-5, beta1
    with pytest.raises(InvalidArgument, match=r"beta1 must be in \[0, 1\), got 1.0"):
        device.set_beta1(1.0)
    assert device.beta1 == 0.9


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_state_round_trips_between_host_and_device(cupy):
    rng = np.random.default_rng(1)
    host = make_optimizer("adam", SIZE, lr=0.01)
    w = rng.standard_normal(SIZE).astype(np.float32)
    for _ in range(3):
        host.step(w, rng.standard_normal(SIZE).astype(np.float32))
    device = make_device("adam", SIZE, lr=0.01)
    device.load_state_dict(host.state_dict())  # a host checkpoint resumes on the device, Adam's clock too
    g = rng.standard_normal(SIZE).astype(np.float32)
    w_dev = cupy.asarray(w)
    host.step(w, g)
    device.step(w_dev, cupy.asarray(g))
    assert rel_err(cupy.asnumpy(w_dev), w) < 1e-5
    state = device.state_dict()
    assert state["steps"] == 4 and all(isinstance(state[k], np.ndarray) for k in ("exp_avg", "exp_avg_sq"))


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_bad_arrays_and_settings_are_refused_and_change_nothing(cupy):
    device = make_device("sgd", 16, lr=0.1, momentum=0.9)
    w = cupy.ones(16, cupy.float32)
    for bad in (np.ones(16, np.float32), cupy.ones(16, cupy.float64), cupy.ones(15, cupy.float32)):
        with pytest.raises(InvalidArgument):
            device.step(w, bad)
    with pytest.raises(InvalidArgument):
        device.step(w, cupy.ones(16, cupy.float32), lr_scale=float("inf"))
    assert device.steps == 0 and bool((w == 1).all())
    with pytest.raises(InvalidArgument, match="nesterov needs momentum"):
        make_device("sgd", 16, lr=0.1, nesterov=True)  # the host's validation, the host's message
    with pytest.raises(InvalidArgument, match="unknown optimizer"):
        make_device("lamb", 16, lr=0.1)
    with pytest.raises(InvalidArgument):
        device.load_state_dict({"steps": 1, "momentum_buffer": np.full(16, np.nan, np.float32)})
    assert device.steps == 0


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, hparams", CASES)
def test_a_published_copy_is_written_in_the_same_pass_and_changes_no_maths(cupy, name, hparams):
    # A device shard publishes each version as a copy of its own weights, written by the update itself.
    rng = np.random.default_rng(zlib.crc32(f"publish{name}{hparams}".encode()))
    published, plain = make_device(name, SIZE, **hparams), make_device(name, SIZE, **hparams)
    w_published = cupy.asarray(rng.standard_normal(SIZE).astype(np.float32))
    w_plain = w_published.copy()
    for step in range(3):
        g = cupy.asarray(rng.standard_normal(SIZE).astype(np.float32))
        copy = cupy.full(SIZE, cupy.nan, cupy.float32)  # poisoned: every element must be written
        published.step(w_published, g, SCALES[step], publish=copy)
        plain.step(w_plain, g, SCALES[step])
        np.testing.assert_array_equal(cupy.asnumpy(copy), cupy.asnumpy(w_published))
        np.testing.assert_array_equal(cupy.asnumpy(w_published), cupy.asnumpy(w_plain))
    for key, value in published.state_dict().items():
        np.testing.assert_array_equal(value, plain.state_dict()[key])


@pytest.mark.gpu
@pytest.mark.timeout(60)
def test_the_finite_check_finds_one_bad_value_anywhere(cupy):
    from psgrid.psserver.kernels.device_optim import all_finite

    values = cupy.ones(SIZE, cupy.float32)
    assert all_finite(values) and all_finite(values[:1])
    for where in (0, SIZE // 2, SIZE - 1):
        for bad in (np.nan, np.inf, -np.inf):
            values[where] = bad
            assert not all_finite(values), (where, bad)
            values[where] = 1.0
    assert all_finite(values)


@pytest.mark.gpu
@pytest.mark.timeout(120)
@pytest.mark.parametrize("name, hparams", [CASES[0], CASES[2], CASES[6]], ids=["sgd", "nesterov", "adam-wd"])
@pytest.mark.parametrize("publish", [True, False], ids=["published", "plain"])
def test_a_guarded_update_writes_nothing_where_its_flag_is_set_and_is_the_update_where_it_is_not(
    cupy, name, hparams, publish
):
    # The flag is a gradient's check queued before the update on the same stream (a device shard's async push).
    rng = np.random.default_rng(zlib.crc32(f"guard{name}{hparams}{publish}".encode()))
    guarded, plain = make_device(name, SIZE, **hparams), make_device(name, SIZE, **hparams)
    w_guarded = cupy.asarray(rng.standard_normal(SIZE).astype(np.float32))
    w_plain = w_guarded.copy()
    for step in range(3):
        g = cupy.asarray(rng.standard_normal(SIZE).astype(np.float32))
        before = (cupy.asnumpy(w_guarded), guarded.state_dict())
        copy = cupy.full(SIZE, 7.0, cupy.float32)
        with pytest.raises(InvalidArgument, match="NaN or infinity"):
            guarded.step(w_guarded, g, SCALES[step], publish=copy if publish else None, flag=cupy.ones(1, cupy.int32))
        np.testing.assert_array_equal(cupy.asnumpy(w_guarded), before[0])
        for key, value in guarded.state_dict().items():  # Adam's step count among them
            np.testing.assert_array_equal(value, before[1][key])
        assert (cupy.asnumpy(copy) == 7.0).all()
        guarded.step(w_guarded, g, SCALES[step], publish=copy if publish else None, flag=cupy.zeros(1, cupy.int32))
        plain.step(w_plain, g, SCALES[step])
        np.testing.assert_array_equal(cupy.asnumpy(w_guarded), cupy.asnumpy(w_plain))
        if publish:
            np.testing.assert_array_equal(cupy.asnumpy(copy), cupy.asnumpy(w_plain))
    for key, value in guarded.state_dict().items():
        np.testing.assert_array_equal(value, plain.state_dict()[key])
