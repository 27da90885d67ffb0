"""Where a shard's arrays live and its update runs: host memory, or a GPU (``shard_device``).

A shard holds its weight ring, optimizer state and the buffers its pushes land in through one
:class:`HostArrays` or :class:`GpuArrays`; everything else (the consistency rules, leases,
checkpoints) is the same on both. On a GPU (GeePS' answer to a host-bound parameter server) the
update reads the gradient and the weights and writes the next version at the device's memory
bandwidth, and a worker on the same GPU pulls with a device-to-device copy: nothing crosses the
host. What crosses to the host is only what must: a network plane's payloads, which land in
page-locked buffers and are copied over, and checkpoints.

The GPU's buffers that other processes map (the ring's versions, the workers' gradient slots) are
allocated with ``cudaMalloc`` of their own, not from CuPy's pool: a CUDA IPC handle names a whole
allocation, so a buffer carved from a pooled block would hand its neighbours over with it.

CuPy is imported only by :class:`GpuArrays`, so a host shard never loads it.
"""

from __future__ import annotations

import contextlib

import numpy as np

from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.protocol import Reason

# Range-sized float32 buffers a device shard holds at least, beside its optimizer state and the
# workers' slots: its own weights (``DeviceUpdater.master``), the current version, the one an update writes,
# one a reader holds, and the private copy an update reads a gradient from.
DEVICE_RING_BUFFERS = 5
SLOTS_PER_WORKER = 2  # each worker's gradient slots on the IPC plane (two, for overlap)
OPTIMIZER_STATE = {"sgd": 0, "sgd+momentum": 1, "adam": 2}


def shard_device_bytes(elements: int, optimizer: str, momentum: float, workers: int) -> int:
    """The GPU memory a device shard of ``elements`` float32 weights needs with ``workers`` on its IPC plane.

    What the launcher compares with a GPU's free memory before it starts anything.
    """
    kind = "sgd+momentum" if optimizer == "sgd" and momentum else optimizer
    buffers = DEVICE_RING_BUFFERS + OPTIMIZER_STATE[kind] + SLOTS_PER_WORKER * max(1, workers)
    return buffers * elements * 4


def gpu_problem() -> str | None:
    """Why this process cannot keep a shard on a GPU (one line), or None when it can."""
    try:
        import cupy
    except ImportError as exc:
        return f"CuPy does not import here ({exc}): install psgrid[gpu], or use shard_device = 'cpu'"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - CUDARuntimeError: no driver, no device
        return f"CuPy finds no CUDA GPU ({type(exc).__name__}: {exc}): use shard_device = 'cpu'"
    if count < 1:
        return "CuPy finds no CUDA GPU: use shard_device = 'cpu'"
    return None


class HostArrays:
    """A host shard's arrays: NumPy, in this process's memory (the weight ring puts its own in shared memory)."""

    on_gpu = False
    xp = np
    label = "cpu"

    def empty(self, size: int) -> np.ndarray:
        return np.empty(size, np.float32)

    def use(self):
        return contextlib.nullcontext(self)

    def landing(self, size: int) -> np.ndarray:
        """A host buffer a network payload lands in."""
        return np.empty(size, np.float32)

    def upload(self, dst, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def download(self, src, out: np.ndarray | None = None) -> np.ndarray:
        if out is None:
            return src.copy()
        np.copyto(out, src)
        return out

    def adopt(self, values: np.ndarray):
        return values

    def copy(self, dst: np.ndarray, src: np.ndarray) -> None:
        np.copyto(dst, src)

    def finished(self) -> None:
        """Everything queued so far is done (nothing is ever queued on the host)."""


class GpuArrays:
    """A device shard's arrays, on GPU ``index`` of those this process sees.

    Every kernel and copy runs on one stream of the shard's, and :meth:`finished` waits for it:
    a version is published only once written, since readers in other processes copy it with
    no event of ours to wait on.
    """

    on_gpu = True

    def __init__(self, index: int):
        import cupy

        self.xp = cupy
        count = cupy.cuda.runtime.getDeviceCount()
        if not 0 <= index < count:
            raise InvalidArgument(
                f"gpu {index} asked for, but this process sees {count} GPU(s) (0..{count - 1})", Reason.BAD_VALUE
            )
        self.index = index
        self.device = cupy.cuda.Device(index)
        self.pci_bus_id = cupy.cuda.runtime.deviceGetPCIBusId(index)
        with self.device:
            self.stream = cupy.cuda.Stream(non_blocking=True)
        self.label = f"cuda:{index} ({self.pci_bus_id})"
        self._copy_kernel = None

    def use(self):
        """Make this GPU and the shard's stream current for the calling thread (``with arrays.use():``)."""
        return _Using(self)

    def empty(self, size: int):
        """A float32 device array in an allocation of its own, which :meth:`ipc_handle` can export."""
        cupy = self.xp
        with self.device:
            memory = cupy.cuda.Memory(max(size, 1) * 4)  # cudaMalloc, not the pool (see the module's text)
            # the pointer holds the allocation: it is freed with the last array that uses it
            return cupy.ndarray((size,), cupy.float32, cupy.cuda.MemoryPointer(memory, 0))

    def ipc_handle(self, array) -> bytes:
        """The CUDA IPC handle of ``array``'s allocation, for a process of this host to map."""
        with self.device:
            return bytes(self.xp.cuda.runtime.ipcGetMemHandle(array.data.ptr))

    def landing(self, size: int) -> np.ndarray:
        """A page-locked host buffer a network payload lands in, so its copy to the GPU runs as a DMA."""
        import cupyx

        return cupyx.empty_pinned((size,), np.float32)

    def upload(self, dst, src: np.ndarray) -> None:
        with self.use():
            dst.set(src, stream=self.stream)
            self.stream.synchronize()  # src is the caller's again once this returns

    def upload_part(self, dst, src: np.ndarray, begin: int, end: int) -> None:
        """Queue the copy of ``src[begin:end]`` (page-locked) into ``dst[begin:end]`` on the shard's stream."""
        with self.use():
            dst[begin:end].set(src[begin:end], stream=self.stream)

    def download(self, src, out: np.ndarray | None = None) -> np.ndarray:
        with self.use():
            result = src.get(stream=self.stream, out=out)
            self.stream.synchronize()
        return result

    def copy(self, dst, src) -> None:
        """Copy device array ``src`` into ``dst``; done on return (``src`` is its owner's again then)."""
        with self.use():
            dst[...] = src
            self.stream.synchronize()

    def adopt(self, values: np.ndarray):
        """A device copy of host ``values``, in an allocation of its own."""
        array = self.empty(len(values))
        self.upload(array, np.ascontiguousarray(values, np.float32))
        return array

    def all_finite(self, array) -> bool:
        from psgrid.psserver.kernels.device_optim import all_finite

        with self.use():
            return all_finite(array)

    def check_into(self, dst, src):
        """Queue the copy of ``src`` into ``dst`` on the shard's stream, with its check for NaN and infinity in the
        same pass; returns the check's flag (one int32 on the GPU, set for a value that is not finite).

        A flag of its own per call: handler threads of several workers check at once, on one stream.
        Read it with :meth:`flagged`, or hand it to a guarded update queued after (device_optim.py),
        which writes nothing where it is set.
        """
        with self.use():
            if self._copy_kernel is None:
                self._copy_kernel = self.xp.ElementwiseKernel(
                    "float32 x",
                    "float32 y, raw int32 bad",
                    "y = x; if (!isfinite(x)) { bad[0] = 1; }",
                    "psgrid_copy_checked",
                )
            flag = self.xp.zeros(1, self.xp.int32)
            self._copy_kernel(src, dst, flag)
            return flag

    def flagged(self, flag) -> bool:
        """Wait for the shard's stream, then read a check's flag (:meth:`check_into`)."""
        with self.use():
            return bool(int(flag.get(stream=self.stream)[0]))

    def copy_checked(self, dst, src) -> bool:
        """Copy ``src`` into ``dst`` and say whether every value was finite: one pass, one wait for the stream."""
        return not self.flagged(self.check_into(dst, src))

    def warm_up(self) -> None:
        """Compile now the kernels a push runs (CuPy compiles each on its first launch): not in a worker's step."""
        with self.use():  # this GPU current: a shard's GPU need not be the calling thread's
            one = self.empty(1)
            one.fill(1.0)
            self.copy_checked(self.empty(1), one)
            self.xp.add(one, one, out=one)
            self.xp.multiply(one, 0.5, out=one)
            self.all_finite(one)
            self.stream.synchronize()

    def free_bytes(self) -> int:
        with self.device:
            return int(self.xp.cuda.runtime.memGetInfo()[0])

    def finished(self) -> None:
        self.stream.synchronize()


class _Using:
    """``with``: this GPU current and the shard's stream the current stream, for the calling thread."""

    __slots__ = ("arrays", "_device", "_stream")

    def __init__(self, arrays: GpuArrays):
        self.arrays = arrays

    def __enter__(self):
        self._device = self.arrays.device.__enter__()
        self._stream = self.arrays.stream.__enter__()
        return self.arrays

    def __exit__(self, *exc):
        self.arrays.stream.__exit__(*exc)
        self.arrays.device.__exit__(*exc)


def shard_arrays(config):
    """The arrays of shard ``config.shard_index``: on its GPU for ``shard_device = "gpu"``, else on the host.

    Raises
    ------
    InvalidArgument
        ``shard_device = "gpu"`` where this process has no usable GPU, or the GPU asked for is not one.
    """
    if config.shard_device != "gpu":
        return HostArrays()
    problem = gpu_problem()
    if problem is not None:
        raise InvalidArgument(f"shard_device = 'gpu': {problem}", Reason.BAD_VALUE)
    import cupy

    index = config.gpu if config.gpu >= 0 else config.shard_index % cupy.cuda.runtime.getDeviceCount()
    return GpuArrays(index)
