"""Models: analytic gradients against finite differences, in-place gradients, init, training on CPU, CuPy = NumPy."""

import time

import numpy as np
import pytest

from psgrid.worker.data import BatchLoader, load_dataset
from psgrid.worker.models import MODELS, Model, accuracy, build_model, softmax_cross_entropy
from tests.gpu import cupy_or_skip

# (name, input_shape, build_model options): small enough for finite differences.
CASES = {
    "softmax": ("softmax", (1, 4, 4), {}),
    "mlp-relu": ("mlp", (12,), dict(hidden=(7, 5), activation="relu")),
    "mlp-sigmoid": ("mlp", (12,), dict(hidden=(6,), activation="sigmoid")),
    "cnn-8x8": ("cnn", (1, 8, 8), dict(hidden=(6,), channels=(3, 4))),
    "cnn-odd": ("cnn", (2, 7, 9), dict(hidden=(5,), channels=(2, 3))),  # pooling drops a row/column
}
CLASSES = 4


def make(case, dtype=np.float64, n=5, seed=0):
    """A model, its parameters in ``dtype`` and a small random batch."""
    name, shape, options = CASES[case]
    model = build_model(name, shape, CLASSES, **options)
    params = {k: v.astype(dtype) for k, v in model.init_params(seed).items()}
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((n, *shape)).astype(dtype)
    y = rng.integers(0, CLASSES, n)
    return model, params, x, y


def loss_only(model, params, x, y):
    scratch = {k: np.empty_like(v) for k, v in params.items()}
    return float(model.loss_and_grad(params, x, y, scratch))


@pytest.mark.parametrize("case", CASES)
def test_gradient_matches_finite_differences(case):
    model, params, x, y = make(case)
    flat = np.zeros(model.spec.size)
    grads = model.spec.views(flat)
    model.loss_and_grad(params, x, y, grads)
    rng = np.random.default_rng(2)
    h = 1e-6
    for name, value in params.items():
        coords = rng.choice(value.size, size=min(value.size, 12), replace=False)
        for i in coords:
            idx = np.unravel_index(i, value.shape)
            old = value[idx]
            value[idx] = old + h
            up = loss_only(model, params, x, y)
            value[idx] = old - h
            down = loss_only(model, params, x, y)
            value[idx] = old
            numeric, analytic = (up - down) / (2 * h), grads[name][idx]
            error = abs(numeric - analytic) / max(abs(numeric) + abs(analytic), 1e-7)
            assert error < 1e-5, f"{case} {name}{idx}: analytic {analytic}, numeric {numeric}"


@pytest.mark.parametrize("case", CASES)
def test_gradients_go_into_views_of_one_flat_buffer(case):
    model, params, x, y = make(case, np.float32)
    flat = model.spec.flat()
    grads = model.spec.views(flat)
    before = dict(grads)
    loss = model.loss_and_grad(params, x, y, grads)
    assert loss.shape == () and np.isfinite(loss)
    assert all(grads[k] is before[k] for k in before), "an entry of grads was rebound"
    # Every weight gets some gradient (biases of dead ReLUs may stay zero, weights of this size do not).
    for name, (lo, hi) in model.spec.offsets.items():
        if name.endswith(".w"):
            assert np.any(flat[lo:hi] != 0), f"no gradient written for {name}"
    # The same numbers as gradients written into separate arrays.
    separate = {k: np.full_like(v, np.nan) for k, v in params.items()}
    model.loss_and_grad(params, x, y, separate)
    np.testing.assert_array_equal(flat, model.spec.pack(separate))


@pytest.mark.parametrize("case", CASES)
def test_init_is_deterministic_float32_and_matches_spec(case):
    model, *_ = make(case)
    a, b, other = model.init_params(3), model.init_params(3), model.init_params(4)
    assert list(a) == model.spec.names
    for p in model.spec.params:
        assert a[p.name].dtype == np.float32 and a[p.name].shape == p.shape
        np.testing.assert_array_equal(a[p.name], b[p.name])
    assert any(not np.array_equal(a[k], other[k]) for k in a)
    doubled = model.init_params(3, scale=2.0)
    for k in a:
        np.testing.assert_allclose(doubled[k], 2 * a[k], rtol=1e-6)


@pytest.mark.parametrize("case", CASES)
def test_plain_sgd_lowers_the_loss(case):
    model, params, x, y = make(case, np.float32, n=16)
    flat = model.spec.flat()
    grads = model.spec.views(flat)
    first = float(model.loss_and_grad(params, x, y, grads))
    for _ in range(20):
        for k in params:
            params[k] -= 0.3 * grads[k]
        last = float(model.loss_and_grad(params, x, y, grads))
    assert last < 0.75 * first, (first, last)


def test_softmax_cross_entropy_is_stable_for_huge_logits():
    logits = np.array([[1e4, 0.0, -1e4], [0.0, 0.0, 0.0]])
    loss, d = softmax_cross_entropy(logits, np.array([0, 2]))
    assert np.isclose(float(loss), np.log(3) / 2)
    assert np.allclose(d.sum(axis=1), 0)


def test_predict_and_accuracy():
    model, params, x, y = make("cnn-8x8", np.float32, n=7)
    logits = model.predict(params, x.reshape(7, -1))  # flat rows are reshaped to input_shape
    assert logits.shape == (7, CLASSES)
    expected = float(np.mean(logits.argmax(axis=1) == y))
    assert accuracy(model, params, x, y, batch=3) == pytest.approx(expected)


def test_build_model_refuses_bad_names_and_shapes():
    assert set(MODELS) == {"softmax", "mlp", "cnn"}
    with pytest.raises(ValueError, match="unknown model"):
        build_model("resnet", (4,), 2)
    with pytest.raises(ValueError, match=r"\(C, H, W\)"):
        build_model("cnn", (784,), 10)
    with pytest.raises(ValueError, match="activation"):
        build_model("mlp", (4,), 2, activation="tanh")
    model = build_model("mlp", (1, 28, 28), 10, hidden=(25,), activation="sigmoid")
    assert isinstance(model, Model)
    assert [(p.name, p.shape) for p in model.spec.params] == [
        ("fc1.w", (784, 25)),
        ("fc1.b", (25,)),
        ("fc2.w", (25, 10)),
        ("fc2.b", (10,)),
    ]


# ---------------------------------------------------------------- training on the CPU, no servers


@pytest.fixture(scope="module")
def mnist():
    return load_dataset("mnist5k")


@pytest.fixture
def one_blas_thread():
    """Small matmuls on a busy machine run many times slower with BLAS threads that spin-wait."""
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=1, user_api="blas"):
        yield


def test_sigmoid_mlp_full_batch_reaches_95_percent_training_accuracy(mnist, one_blas_thread):
    """784-25-10 sigmoid, full-batch gradient descent with momentum 0.9, lr 1.0, 100 steps."""
    model = build_model("mlp", mnist.input_shape, 10, hidden=(25,), activation="sigmoid")
    params_flat = model.spec.pack(model.init_params(0))
    params = model.spec.views(params_flat)
    grads_flat = model.spec.flat()
    grads = model.spec.views(grads_flat)
    velocity = np.zeros_like(params_flat)
    start = time.perf_counter()
    for _ in range(100):
        model.loss_and_grad(params, mnist.train_x, mnist.train_y, grads)
        velocity *= 0.9
        velocity -= 1.0 * grads_flat
        params_flat += velocity
    seconds = time.perf_counter() - start
    train = accuracy(model, params, mnist.train_x, mnist.train_y)
    assert train >= 0.95, f"training accuracy {train:.4f} after 100 steps ({seconds:.1f} s)"


def test_relu_mlp_minibatch_sgd_reaches_90_percent_test_accuracy(mnist, one_blas_thread):
    """784-128-10 relu, plain SGD, lr 0.1, batch 32, 20 epochs of the 4,000 images (2,500 steps)."""
    model = build_model("mlp", mnist.input_shape, 10, hidden=(128,), activation="relu")
    params_flat = model.spec.pack(model.init_params(0))
    params = model.spec.views(params_flat)
    grads_flat = model.spec.flat()
    grads = model.spec.views(grads_flat)
    with BatchLoader(mnist.train_x, mnist.train_y, 32, seed=0, epochs=20) as loader:
        for x, y in loader:
            model.loss_and_grad(params, x, y, grads)
            params_flat -= 0.1 * grads_flat
    test = accuracy(model, params, mnist.test_x, mnist.test_y)
    assert test >= 0.90, f"test accuracy {test:.4f}"


# ---------------------------------------------------------------- CuPy gives NumPy's numbers


def relative_error(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-12))


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES)
def test_cupy_loss_and_gradients_match_numpy(case):
    cupy = cupy_or_skip()
    model, params, x, y = make(case, np.float32, n=16)
    host_flat = model.spec.flat()
    host_loss = model.loss_and_grad(params, x, y, model.spec.views(host_flat))

    device_params = {k: cupy.asarray(v) for k, v in params.items()}
    device_flat = model.spec.flat(cupy)
    device_grads = model.spec.views(device_flat)
    device_loss = model.loss_and_grad(device_params, cupy.asarray(x), cupy.asarray(y), device_grads)
    assert isinstance(device_loss, cupy.ndarray) and device_loss.shape == ()
    assert all(isinstance(g, cupy.ndarray) for g in device_grads.values())

    assert float(device_loss) == pytest.approx(float(host_loss), rel=1e-5)
    assert relative_error(cupy.asnumpy(device_flat), host_flat) < 1e-4
    for name, grad in device_grads.items():
        assert relative_error(cupy.asnumpy(grad), model.spec.views(host_flat)[name]) < 1e-4, name
    logits = model.predict(device_params, cupy.asarray(x))
    np.testing.assert_allclose(cupy.asnumpy(logits), model.predict(params, x), rtol=1e-4, atol=1e-5)
    assert accuracy(model, device_params, x, y) == accuracy(model, params, x, y)
