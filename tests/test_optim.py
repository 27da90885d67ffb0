"""Server-side optimizers against float64 references, state round trips, validation, allocation."""

from __future__ import annotations

import re
import threading
import time
import tracemalloc

import numpy as np
import pytest

from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.kernels import optim
from psgrid.psserver.kernels.optim import SGD, Adam, check_settings, make_optimizer

STEPS = 4
SCALES = [1.0, 0.5, 1.0, 0.25]  # lr_scale per step, as staleness scaling would give


def ref_sgd(w, grads, scales, lr, momentum=0.0, nesterov=False, weight_decay=0.0):
    """torch.optim.SGD in float64."""
    w = w.astype(np.float64)
    v = np.zeros_like(w)
    for g, s in zip(grads, scales):
        g = g.astype(np.float64) + weight_decay * w
        if momentum:
            v = momentum * v + g
            d = g + momentum * v if nesterov else v
        else:
            d = g
        w = w - lr * s * d
    return w


def ref_adam(w, grads, scales, lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0):
    """torch.optim.Adam (L2 weight decay, bias correction) in float64."""
    w = w.astype(np.float64)
    m = np.zeros_like(w)
    v = np.zeros_like(w)
    for t, (g, s) in enumerate(zip(grads, scales), start=1):
        g = g.astype(np.float64) + weight_decay * w
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        denom = np.sqrt(v) / np.sqrt(1 - beta2**t) + eps
        w = w - lr * s / (1 - beta1**t) * m / denom
    return w


def data(size, steps=STEPS, seed=0):
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(size).astype(np.float32)
    grads = [rng.standard_normal(size).astype(np.float32) for _ in range(steps)]
    return w, grads


CASES = [
    ("sgd", dict(lr=0.1), ref_sgd),
    ("sgd", dict(lr=0.1, momentum=0.9), ref_sgd),
    ("sgd", dict(lr=0.1, momentum=0.9, nesterov=True), ref_sgd),
    ("sgd", dict(lr=0.1, weight_decay=0.01), ref_sgd),
    ("sgd", dict(lr=0.05, momentum=0.5, nesterov=True, weight_decay=0.1), ref_sgd),
    ("adam", dict(lr=0.01), ref_adam),
    ("adam", dict(lr=0.01, beta1=0.8, beta2=0.99, eps=1e-6, weight_decay=0.05), ref_adam),
]
CASE_IDS = ["sgd", "momentum", "nesterov", "sgd-wd", "nesterov-wd", "adam", "adam-wd"]


@pytest.fixture
def small_block(monkeypatch):
    """Blocks of 64 elements, so small arrays cross many block boundaries."""
    monkeypatch.setattr(optim, "BLOCK", 64)


@pytest.mark.parametrize(("name", "hp", "ref"), CASES, ids=CASE_IDS)
@pytest.mark.parametrize("size", [0, 1, 7, 63, 64, 65, 1000])
def test_matches_reference_across_small_blocks(small_block, name, hp, ref, size):
    w, grads = data(size)
    opt = make_optimizer(name, size, **hp)
    for g, s in zip(grads, SCALES):
        opt.step(w, g, lr_scale=s)
    np.testing.assert_allclose(w, ref(data(size)[0], grads, SCALES, **hp), rtol=1e-5, atol=1e-6)
    assert opt.steps == STEPS


@pytest.mark.parametrize(("name", "hp", "ref"), CASES, ids=CASE_IDS)
def test_matches_reference_across_default_block(name, hp, ref):
    size = optim.BLOCK + 3
    w, grads = data(size, steps=2)
    opt = make_optimizer(name, size, **hp)
    for g, s in zip(grads, SCALES):
        opt.step(w, g, lr_scale=s)
    np.testing.assert_allclose(w, ref(data(size, steps=2)[0], grads, SCALES, **hp), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("name", "hp", "ref"), CASES, ids=CASE_IDS)
def test_threads_over_chunks_give_the_same_bits_as_one_and_write_only_out(monkeypatch, name, hp, ref):
    """A range cut among threads (parallel.py) is updated exactly as by one thread, into ``out`` alone."""
    from psgrid.psserver.kernels import parallel

    monkeypatch.setattr(parallel, "MIN_CHUNK", 100)
    size = 1003  # parts of uneven length, many 64-element blocks
    monkeypatch.setattr(optim, "BLOCK", 64)
    w, grads = data(size)
    chunks = parallel.Chunks(3)
    try:
        assert len(chunks.split(size)) > 3  # more parts than threads: taken in turn
        one, three = make_optimizer(name, size, **hp), make_optimizer(name, size, chunks=chunks, **hp)
        w1, w3 = w.copy(), w.copy()
        for g, s in zip(grads, SCALES):
            out1, out3 = np.full(size, np.nan, np.float32), np.full(size, np.nan, np.float32)
            one.step(w1, g, lr_scale=s, out=out1)
            before = w3.copy()
            three.step(w3, g, lr_scale=s, out=out3)
            np.testing.assert_array_equal(w3, before)  # the weights read are never written
            np.testing.assert_array_equal(out3, out1)  # every element written, bit for bit the same
            w1, w3 = out1, out3
        for key, value in one.state_dict().items():
            np.testing.assert_array_equal(three.state_dict()[key], value)
        np.testing.assert_allclose(w3, ref(w, grads, SCALES, **hp), rtol=1e-5, atol=1e-6)
    finally:
        chunks.close()


def test_a_failing_part_is_raised_once_every_part_begun_has_ended():
    from psgrid.psserver.kernels.parallel import Chunks

    chunks, began, ended = Chunks(3), [], []

    def work(lo, hi, thread):
        began.append(lo)
        time.sleep(0.001)
        if lo == 1 << 20:
            raise ValueError("part at 1M")
        ended.append(lo)
        return lo

    try:
        with pytest.raises(ValueError, match="part at 1M"):
            chunks.map(work, 3 << 20)
        assert sorted(ended) == sorted(lo for lo in began if lo != 1 << 20)  # nothing still running
    finally:
        chunks.close()


def test_the_threads_that_run_take_over_the_parts_of_one_held_up(monkeypatch):
    """A thread off its core for a while does not hold up the pass: the others take the parts left."""
    from psgrid.psserver.kernels import parallel

    monkeypatch.setattr(parallel, "MIN_CHUNK", 100)
    chunks, by_thread, lock = parallel.Chunks(2), {0: [], 1: []}, threading.Lock()
    parts = chunks.split(800)
    assert len(parts) == 8
    others_done = threading.Event()

    def work(lo, hi, thread):
        if thread == 1 and not by_thread[1]:
            others_done.wait(10)  # held up until the caller's thread has done the rest
        with lock:
            by_thread[thread].append((lo, hi))
            if len(by_thread[0]) >= len(parts) - 1:
                others_done.set()

    try:
        chunks.map(work, 800)
        assert others_done.is_set()
        assert len(by_thread[0]) >= len(parts) - 1
        assert sorted(by_thread[0] + by_thread[1]) == parts  # each part once
    finally:
        chunks.close()


def test_grad_not_modified(small_block):
    w, grads = data(200)
    for opt in (SGD(200, 0.1, momentum=0.9, nesterov=True, weight_decay=0.1), Adam(200, 0.01, weight_decay=0.1)):
        g = grads[0].copy()
        opt.step(w, g, lr_scale=0.5)
        np.testing.assert_array_equal(g, grads[0])


def test_read_only_grad_is_accepted():
    w, (g,) = data(100, steps=1)
    g.flags.writeable = False  # as np.frombuffer over received bytes gives
    Adam(100, 0.01).step(w, g)


@pytest.mark.parametrize(("name", "hp"), [(c[0], c[1]) for c in CASES], ids=CASE_IDS)
def test_state_round_trip_continues_identically(small_block, name, hp):
    size = 150
    w, grads = data(size, steps=6)
    a = make_optimizer(name, size, **hp)
    for g in grads[:3]:
        a.step(w, g)
    state = a.state_dict()
    b = make_optimizer(name, size, **hp)
    b.load_state_dict(state)
    assert b.steps == 3
    wa, wb = w.copy(), w.copy()
    for g in grads[3:]:
        a.step(wa, g, lr_scale=0.5)
        b.step(wb, g, lr_scale=0.5)
    np.testing.assert_array_equal(wa, wb)
    assert a.steps == b.steps == 6


def test_state_dict_holds_copies():
    w, (g,) = data(10, steps=1)
    opt = Adam(10, 0.01)
    opt.step(w, g)
    state = opt.state_dict()
    assert sorted(state) == ["exp_avg", "exp_avg_sq", "steps"]
    state["exp_avg"][:] = 123.0
    assert not (opt.state_dict()["exp_avg"] == 123.0).any()


def test_state_loads_from_npz_form():
    """A checkpoint read back with numpy.load gives 0-d arrays for scalars and may widen dtypes."""
    w, (g,) = data(10, steps=1)
    a = SGD(10, 0.1, momentum=0.9)
    a.step(w, g)
    state = {k: np.asarray(v, dtype=np.float64 if k != "steps" else np.int64) for k, v in a.state_dict().items()}
    b = SGD(10, 0.1, momentum=0.9)
    b.load_state_dict(state)
    assert b.steps == 1 and isinstance(b.steps, int)
    np.testing.assert_array_equal(b.state_dict()["momentum_buffer"], a.state_dict()["momentum_buffer"])


def _trained_adam(size=10):
    w, grads = data(size, steps=2)
    opt = Adam(size, 0.01)
    for g in grads:
        opt.step(w, g)
    return opt


def _bad_states():
    good = _trained_adam().state_dict()
    nan = good["exp_avg"].copy()
    nan[3] = np.nan
    return {
        "missing key": {k: v for k, v in good.items() if k != "exp_avg_sq"},
        "extra key": {**good, "momentum_buffer": good["exp_avg"]},
        "wrong shape": {**good, "exp_avg": np.zeros(11, np.float32)},
        "2-d": {**good, "exp_avg": np.zeros((1, 10), np.float32)},
        "int array": {**good, "exp_avg": np.zeros(10, np.int32)},
        "non-finite": {**good, "exp_avg": nan},
        "negative steps": {**good, "steps": -1},
        "float steps": {**good, "steps": 2.5},
        "not a mapping": [1, 2],
    }


@pytest.mark.parametrize("case", list(_bad_states()))
def test_bad_state_raises_and_changes_nothing(case):
    bad = _bad_states()[case]
    # the good arrays come first, so a partial load would show
    if isinstance(bad, dict) and "exp_avg_sq" in bad:
        bad = {"exp_avg_sq": np.full(10, 7.0, np.float32), **{k: v for k, v in bad.items() if k != "exp_avg_sq"}}
    opt = _trained_adam()
    before = opt.state_dict()
    with pytest.raises(InvalidArgument):
        opt.load_state_dict(bad)
    after = opt.state_dict()
    assert after["steps"] == before["steps"]
    for k in ("exp_avg", "exp_avg_sq"):
        np.testing.assert_array_equal(after[k], before[k])


def test_state_of_other_optimizer_is_refused():
    sgd = SGD(10, 0.1, momentum=0.9)
    with pytest.raises(InvalidArgument, match="keys"):
        sgd.load_state_dict(_trained_adam().state_dict())
    with pytest.raises(InvalidArgument, match="keys"):
        SGD(10, 0.1).load_state_dict(sgd.state_dict())


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lr=0.0),
        dict(lr=-1.0),
        dict(lr=float("nan")),
        dict(lr=float("inf")),
        dict(lr="0.1"),
        dict(lr=True),
        dict(lr=0.1, momentum=1.0),
        dict(lr=0.1, momentum=-0.1),
        dict(lr=0.1, nesterov=True),
        dict(lr=0.1, momentum=0.9, nesterov="yes"),
        dict(lr=0.1, weight_decay=-1e-4),
        dict(lr=0.1, weight_decay=float("nan")),
    ],
)
def test_bad_sgd_hyperparameters(kwargs):
    with pytest.raises(InvalidArgument):
        make_optimizer("sgd", 10, **kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(lr=0.0),
        dict(lr=0.1, beta1=1.0),
        dict(lr=0.1, beta1=-0.5),
        dict(lr=0.1, beta2=1.0),
        dict(lr=0.1, beta2=float("nan")),
        dict(lr=0.1, eps=0.0),
        dict(lr=0.1, eps=-1e-8),
        dict(lr=0.1, weight_decay=-0.1),
    ],
)
def test_bad_adam_hyperparameters(kwargs):
    with pytest.raises(InvalidArgument):
        make_optimizer("adam", 10, **kwargs)


def test_messages_name_the_problem():
    with pytest.raises(InvalidArgument, match="unknown optimizer 'rmsprop'"):
        make_optimizer("rmsprop", 10, lr=0.1)
    with pytest.raises(InvalidArgument, match="learning_rate"):
        make_optimizer("sgd", 10, learning_rate=0.1)
    with pytest.raises(InvalidArgument, match="needs lr"):
        make_optimizer("adam", 10)
    with pytest.raises(InvalidArgument, match="momentum must be in"):
        make_optimizer("sgd", 10, lr=0.1, momentum=1.5)
    with pytest.raises(InvalidArgument, match="nesterov needs momentum"):
        SGD(10, 0.1, nesterov=True)
    with pytest.raises(InvalidArgument, match="size"):
        SGD(-1, 0.1)


# Every setting out of its bounds, with the words of the refusal (kernels/optim.py's BOUNDS).
OUT_OF_BOUNDS = [
    ("lr", float("inf"), "lr must be finite and > 0"),
    ("lr", 0.0, "lr must be finite and > 0"),
    ("lr", float("nan"), "lr must be finite and > 0"),
    ("momentum", 1.0, "momentum must be in [0, 1)"),
    ("momentum", -0.1, "momentum must be in [0, 1)"),
    ("weight_decay", float("inf"), "weight_decay must be finite"),
    ("weight_decay", -1e-4, "weight_decay must be finite and >= 0"),
    ("beta1", 1.0, "beta1 must be in [0, 1)"),
    ("beta2", float("nan"), "beta2 must be in [0, 1)"),
    ("eps", 0.0, "eps must be finite and > 0"),
    ("eps", float("inf"), "eps must be finite and > 0"),
]

USED_BY = {
    "lr": ("sgd", "adam"),
    "weight_decay": ("sgd", "adam"),
    "momentum": ("sgd",),
    "beta1": ("adam",),
    "beta2": ("adam",),
    "eps": ("adam",),
}


@pytest.mark.parametrize(("name", "value", "words"), OUT_OF_BOUNDS)
def test_the_bounds_are_stated_once_the_job_check_and_the_optimizers_refuse_alike(name, value, words):
    good = dict(lr=0.1, momentum=0.5, nesterov=False, weight_decay=0.0, beta1=0.9, beta2=0.999, eps=1e-8)
    check_settings(good)
    bad = dict(good, **{name: value})
    with pytest.raises(InvalidArgument, match=re.escape(words)):
        check_settings(bad)
    # The optimizer that uses the setting refuses it with the same words as it is built (a shard's Init)
    for kind in USED_BY[name]:
        with pytest.raises(InvalidArgument, match=re.escape(words)):
            make_optimizer(kind, 10, **bad)


def test_the_job_check_refuses_a_setting_its_optimizer_does_not_use():
    """momentum = 1.5 with Adam is as much a mistake as with SGD: refused before anything starts."""
    make_optimizer("adam", 10, lr=0.1, momentum=1.5)  # Adam itself ignores it
    with pytest.raises(InvalidArgument, match=re.escape("momentum must be in [0, 1), got 1.5")):
        check_settings(dict(lr=0.1, momentum=1.5))
    with pytest.raises(InvalidArgument, match="nesterov needs momentum > 0"):
        check_settings(dict(lr=0.1, momentum=0.0, nesterov=True))


def test_one_settings_dict_serves_both():
    settings = dict(lr=0.01, momentum=0.9, nesterov=True, weight_decay=1e-4, beta1=0.9, beta2=0.999, eps=1e-8)
    sgd = make_optimizer("sgd", 10, **settings)
    adam = make_optimizer("adam", 10, **settings)
    assert isinstance(sgd, SGD) and sgd.momentum == 0.9 and sgd.nesterov
    assert isinstance(adam, Adam) and adam.beta2 == 0.999 and adam.weight_decay == 1e-4


@pytest.mark.parametrize(
    "bad",
    [
        dict(weights=np.zeros(11, np.float32)),
        dict(grad=np.zeros(9, np.float32)),
        dict(grad=np.zeros(10, np.float64)),
        dict(weights=np.zeros((2, 5), np.float32)),
        dict(grad=[0.0] * 10),
        dict(lr_scale=-0.5),
        dict(lr_scale=float("nan")),
        dict(weights=np.frombuffer(np.ones(10, np.float32).tobytes(), np.float32)),  # read-only
    ],
)
def test_bad_step_arguments_change_nothing(bad):
    opt = SGD(10, 0.1, momentum=0.9)
    args = dict(weights=np.ones(10, np.float32), grad=np.ones(10, np.float32), lr_scale=1.0) | bad
    before = args["weights"].copy() if isinstance(args["weights"], np.ndarray) else None
    with pytest.raises(InvalidArgument):
        opt.step(**args)
    assert opt.steps == 0
    assert not opt.state_dict()["momentum_buffer"].any()
    np.testing.assert_array_equal(args["weights"], before)


def _peak_bytes(fn) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    ("name", "hp"),
    [
        ("sgd", dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-4)),
        ("adam", dict(lr=1e-3, weight_decay=1e-4)),
    ],
)
def test_step_allocates_no_parameter_sized_arrays(name, hp):
    size = 4 << 20
    w = np.zeros(size, np.float32)
    g = np.full(size, 1e-3, np.float32)
    opt = make_optimizer(name, size, **hp)
    # tracemalloc sees numpy's buffers: a whole-array update shows up as at least one full array
    assert _peak_bytes(lambda: np.subtract(w, g * 0.1)) >= w.nbytes
    peak = _peak_bytes(lambda: opt.step(w, g, lr_scale=0.5))
    assert peak < w.nbytes // 64, f"step allocated {peak} bytes at peak for a {w.nbytes}-byte range"


@pytest.mark.parametrize(
    ("name", "hp"),
    [
        ("sgd", dict(lr=0.1)),
        ("sgd", dict(lr=0.1, weight_decay=0.01)),
        ("sgd", dict(lr=0.1, momentum=0.9)),
        ("adam", dict(lr=0.01)),
    ],
    ids=["sgd", "sgd-wd", "momentum", "adam"],
)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_checked_step_refuses_a_non_finite_gradient_and_changes_no_state(small_block, name, hp, bad):
    w, grads = data(1000)
    opt = make_optimizer(name, 1000, **hp)
    opt.step(w, grads[0])  # some state to keep
    state, weights = opt.state_dict(), w.copy()
    poisoned = grads[1].copy()
    poisoned[777] = bad  # in a late block: earlier ones pass the check
    with pytest.raises(InvalidArgument, match="NaN or infinity") as refused:
        opt.step(w, poisoned, out=np.empty_like(w), check_finite=True)
    assert refused.value.reason.name == "NON_FINITE"
    np.testing.assert_array_equal(w, weights)
    after = opt.state_dict()
    assert after["steps"] == state["steps"]
    for key in state:
        np.testing.assert_array_equal(after[key], state[key])
    out = np.empty_like(w)
    opt.step(w, grads[1], out=out, check_finite=True)  # a clean gradient passes, the same as unchecked
    reference = make_optimizer(name, 1000, **hp)
    reference.load_state_dict(state)
    expected = np.empty_like(w)
    reference.step(w, grads[1], out=expected)
    np.testing.assert_array_equal(out, expected)
