"""Copies between a shard's range and a model's own GPU tensors: one kernel for all of the tensors.

A script's parameters and gradients are tensors of their own (PyTorch's, CuPy arrays), and psgrid
exchanges flat ranges. Going through psgrid's flat buffers reads and writes the model once more each
way: for a 34M-parameter model that is about a tenth of a millisecond of an H200's memory bandwidth
per copy, in the step's critical path in sync. :class:`FusedCopies` moves a range in one launch
however many tensors it covers, as PyTorch's ``_foreach`` kernels and Horovod's fusion buffer batch
theirs:

* :meth:`~FusedCopies.scatter`: a pulled range (a shard's device array over CUDA IPC or in this
  process, or host memory uploaded once) straight into the parameters it covers;
* :meth:`~FusedCopies.gatherer`: a step's gradients straight into a shard's gradient slot on the
  CUDA IPC plane (``Client.push(gather=...)``), a gradient of None as zeros.

It takes only what it can copy exactly: float32, C-contiguous tensors on the model's GPU (the
parameters writable in place). Anything else (half precision, strided tensors, JAX's immutable
arrays) keeps the flat buffers and the copy per tensor (worker/model_link.py), which converts and
strides as needed.
"""

from __future__ import annotations

import threading

import numpy as np

# Each block copies CHUNK consecutive elements of one tensor: enough work per block that the blocks of
# the small tensors (biases, norms) cost no more than their bytes.
THREADS = 256
CHUNK = THREADS * 8

_SOURCE = r"""
extern "C" __global__ void psgrid_fused_copy(
    float* __restrict__ flat,                   // the range: flat[0] is its first element
    const long long* __restrict__ table,        // 4 rows of `segments`: tensor pointer, offset in flat, length, first block
    const int segments,
    const int gather)                           // 0: flat into the tensors; 1: the tensors into flat (pointer 0: zeros)
{
    const long long* pointers = table;
    const long long* offsets = table + segments;
    const long long* lengths = table + 2 * segments;
    const long long* first_blocks = table + 3 * segments;
    // The segment of this block: the last whose first block is at or before it.
    const long long block = blockIdx.x;
    int lo = 0, hi = segments - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) >> 1;
        if (first_blocks[mid] <= block) lo = mid; else hi = mid - 1;
    }
    const long long start = (block - first_blocks[lo]) * CHUNK;
    const long long stop = min(start + (long long)CHUNK, lengths[lo]);
    float* part = (float*)pointers[lo];
    float* range = flat + offsets[lo];
    if (!gather) {
        for (long long i = start + threadIdx.x; i < stop; i += blockDim.x) part[i] = range[i];
    } else if (part == 0) {
        for (long long i = start + threadIdx.x; i < stop; i += blockDim.x) range[i] = 0.0f;
    } else {
        for (long long i = start + threadIdx.x; i < stop; i += blockDim.x) range[i] = part[i];
    }
}
"""

_kernels: dict[int, object] = {}  # by device: CuPy compiles a RawKernel per device on first launch
_kernels_lock = threading.Lock()


def _kernel(cupy):
    with _kernels_lock:
        device = cupy.cuda.Device().id
        kernel = _kernels.get(device)
        if kernel is None:
            kernel = _kernels[device] = cupy.RawKernel(_SOURCE, "psgrid_fused_copy", options=(f"-DCHUNK={CHUNK}",))
        return kernel


def segments(parts, begin: int, end: int) -> np.ndarray | None:
    """The table of the tensors ``parts`` (``(first, last, pointer)`` in the flat layout) that ``begin:end`` covers.

    Four rows (pointer to the segment's first element, its offset in the range, its length, its first
    block); None where the range covers none.
    """
    rows = []
    for first, last, pointer in parts:
        lo, hi = max(first, begin), min(last, end)
        if lo < hi:
            rows.append((pointer + (lo - first) * 4 if pointer else 0, lo - begin, hi - lo))
    if not rows:
        return None
    table = np.empty((4, len(rows)), np.int64)
    table[:3] = np.array(rows, np.int64).T
    blocks = -(-table[2] // CHUNK)
    table[3] = np.cumsum(blocks) - blocks
    return table


class FusedCopies:
    """The flat layout of ``spec`` against a model's tensors on one GPU (``device``: a CuPy device)."""

    def __init__(self, spec, device, cupy):
        self.spec, self.device, self.cupy = spec, device, cupy
        self._targets: list | None = None
        self._tables: dict[tuple[int, int], object] = {}
        self._lock = threading.Lock()

    @classmethod
    def of(cls, spec, views: dict) -> FusedCopies | None:
        """Copies for a model whose parameters are ``views`` (CuPy arrays over them, by name), scattering pulls
        into them; None where one launch cannot write them all exactly."""
        arrays = [views.get(name) for name in spec.names]
        if not arrays or any(a is None or isinstance(a, np.ndarray) for a in arrays):
            return None
        import cupy

        if not all(isinstance(a, cupy.ndarray) for a in arrays):
            return None
        if any(a.dtype != cupy.float32 or not a.flags.c_contiguous for a in arrays):
            return None
        if len({a.device.id for a in arrays}) != 1:
            return None
        copies = cls(spec, arrays[0].device, cupy)
        copies._targets = [(*spec.offsets[name], int(a.data.ptr)) for name, a in zip(spec.names, arrays)]
        return copies

    # ----- pulls: a range into the parameters ------------------------------------------------------

    def scatter(self, src, begin: int, end: int, stream) -> None:
        """Queue on ``stream`` the copy of ``src`` (a float32 device array: flat elements ``begin:end``) into the parameters."""
        if len(src) != end - begin:
            raise ValueError(f"a range of {end - begin} elements, given {len(src)}")
        key = (begin, end)
        if key not in self._tables:
            with self._lock:  # the client's threads pull their shards at once; each range's table is made once
                if key not in self._tables:
                    table = segments(self._targets, begin, end)
                    with self.device:
                        on_device = None if table is None else self.cupy.asarray(table)
                        self.cupy.cuda.get_current_stream().synchronize()  # on the device before a launch reads it
                    self._tables[key] = None if table is None else (on_device, launch_blocks(table))
        if self._tables[key] is not None:
            self._launch(src, *self._tables[key], stream, gather=False)

    # ----- pushes: the gradients into a range ------------------------------------------------------

    def gatherer(self, sources: list):
        """``gather(begin, end, out, stream)`` copying this step's gradients (``sources``, in the layout's order:
        PyTorch tensors, CuPy arrays or None) into ``out``, a range's device array; None where some gradient is
        not a float32, C-contiguous tensor on this GPU."""
        parts = []
        for (first, last), source in zip((self.spec.offsets[n] for n in self.spec.names), sources):
            pointer = 0 if source is None else _pointer(source, self.device.id)
            if pointer is None:
                return None
            parts.append((first, last, pointer))

        def gather(begin: int, end: int, out, stream) -> None:
            self._gather(parts, begin, end, out, stream)

        gather.sources = list(sources)  # alive while the push may gather them (a retry gathers again)
        return gather

    def _gather(self, parts, begin: int, end: int, out, stream) -> None:
        if len(out) != end - begin:
            raise ValueError(f"a range of {end - begin} elements, given {len(out)}")
        table = segments(parts, begin, end)
        if table is None:
            return
        # The pointers move each step: a small copy, ordered before the launch. Allocated on ``stream``, the
        # table's memory goes back to the pool for that stream only, so nothing reuses it before the launch ends.
        with self.device, stream:
            on_device = self.cupy.empty(table.shape, self.cupy.int64)
            on_device.set(table, stream=stream)
            self._launch(out, on_device, launch_blocks(table), stream, gather=True)

    def _launch(self, flat, table, blocks: int, stream, *, gather: bool) -> None:
        with self.device:
            count = np.int32(table.shape[1])
            _kernel(self.cupy)((blocks,), (THREADS,), (flat, table, count, np.int32(gather)), stream=stream)


def launch_blocks(table: np.ndarray) -> int:
    """The blocks a launch over ``table`` takes: its last segment's first block, plus that segment's own."""
    return int(table[3, -1] + -(-table[2, -1] // CHUNK))


def _pointer(source, device_id: int) -> int | None:
    """The device address of a float32, C-contiguous gradient on GPU ``device_id`` (PyTorch or CuPy), else None."""
    kind = type(source).__module__.split(".", 1)[0]
    if kind == "torch":
        import torch

        ok = (
            source.dtype == torch.float32
            and source.is_contiguous()
            and source.device.type == "cuda"
            and source.device.index == device_id
        )
        return int(source.data_ptr()) if ok else None
    if kind == "cupy":
        ok = source.dtype == np.float32 and source.flags.c_contiguous and source.device.id == device_id
        return int(source.data.ptr) if ok else None
    return None
