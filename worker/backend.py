"""The array module, chosen once: CuPy on a CUDA GPU, NumPy everywhere else.

Only the functions here ever import cupy, and only when asked for a GPU (or
``"auto"``) or handed a cupy array; a ``device="cpu"`` run never imports it.
Model and data code takes ``xp`` (or arrays) and never imports cupy itself.
"""

from __future__ import annotations

import sys

import numpy as np

from psgrid.worker.config import DEVICES

GPU_MISSING = "device='gpu' asked for but no CUDA GPU/CuPy is available: install psgrid[gpu] or use device='cpu'"


def _usable_cupy():
    """Return ``(cupy, None)`` when CuPy imports and sees a GPU, else ``(None, reason)``."""
    try:
        import cupy
    except ImportError as exc:  # not installed, or its CUDA libraries are missing
        return None, exc
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # CUDARuntimeError: no driver, no device
        return None, exc
    if count < 1:
        return None, RuntimeError("cupy.cuda.runtime.getDeviceCount() is 0")
    return cupy, None


def gpu_unavailable() -> str | None:
    """Why this process cannot compute on a GPU (``"CuPy is not installed"``, ...), or None when it can."""
    cupy, reason = _usable_cupy()
    if cupy is not None:
        return None
    if isinstance(reason, ImportError):
        return f"CuPy does not import here ({reason})"
    return f"CuPy finds no CUDA GPU ({type(reason).__name__}: {reason})"


def get_xp(device: str = "auto"):
    """Choose the array module for this process.

    Parameters
    ----------
    device : {"auto", "cpu", "gpu"}
        ``"auto"`` takes CuPy when it imports and sees at least one CUDA
        device, else NumPy; ``"cpu"`` takes NumPy without importing cupy;
        ``"gpu"`` takes CuPy or raises.

    Returns
    -------
    xp : module
        ``numpy`` or ``cupy``.
    device_name : str
        ``"cpu"`` or ``"cuda:<id>"`` of the current CUDA device.

    Raises
    ------
    RuntimeError
        ``device="gpu"`` and no CUDA GPU or CuPy is available.
    ValueError
        An unknown device name.
    """
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "cpu":
        return np, "cpu"
    cupy, reason = _usable_cupy()
    if cupy is None:
        if device == "gpu":
            raise RuntimeError(f"{GPU_MISSING} ({type(reason).__name__}: {reason})") from reason
        return np, "cpu"
    return cupy, f"cuda:{cupy.cuda.runtime.getDevice()}"


def is_cupy_array(a) -> bool:
    """True for a cupy array, decided without importing cupy."""
    return type(a).__module__.split(".", 1)[0] == "cupy"


def array_module(a):
    """The module (numpy or cupy) that array ``a`` belongs to, without importing cupy."""
    return sys.modules["cupy"] if is_cupy_array(a) else np


def to_host(a) -> np.ndarray:
    """A host NumPy array of ``a`` (a copy from the device for a cupy array)."""
    if is_cupy_array(a):
        return sys.modules["cupy"].asnumpy(a)
    return np.asarray(a)


def sync(xp) -> None:
    """Wait for the work queued on the current CUDA stream; a no-op for NumPy.

    Timings of GPU work are only meaningful after this.
    """
    if xp is not np:
        xp.cuda.get_current_stream().synchronize()


def select_gpu(local_rank: int) -> int:
    """Make GPU ``local_rank % count`` current for this thread; return its id.

    One worker process per GPU passes its node-local rank.
    """
    cupy, reason = _usable_cupy()
    if cupy is None:
        raise RuntimeError(f"{GPU_MISSING} ({type(reason).__name__}: {reason})") from reason
    device_id = int(local_rank) % cupy.cuda.runtime.getDeviceCount()
    cupy.cuda.Device(device_id).use()
    return device_id


def visible_gpus() -> list[str]:
    """The PCI bus ids of the CUDA GPUs this process sees, in device order; ``[]`` without CuPy or a GPU.

    Ranks of one node that see the same GPU report the same id, whatever ``CUDA_VISIBLE_DEVICES``
    numbers it as, which is what ``psctl mpi``'s placement needs. Only device queries are made:
    no GPU gets a context (and its memory) from a rank that merely asks.
    """
    cupy, _ = _usable_cupy()
    if cupy is None:
        return []
    runtime = cupy.cuda.runtime
    return [runtime.deviceGetPCIBusId(i) for i in range(runtime.getDeviceCount())]


def current_gpu(xp) -> int | None:
    """The GPU this thread computes on (a client's ``gpu``), or None on the CPU."""
    return None if xp is np else int(xp.cuda.runtime.getDevice())


def pinned_empty(n, dtype, xp) -> np.ndarray:
    """An uninitialised host array, in CUDA pinned (page-locked) memory when ``xp`` is cupy.

    Copies between pinned host memory and the device can run asynchronously
    on a stream; with NumPy this is plain ``np.empty``.

    Parameters
    ----------
    n : int or tuple of int
        Number of elements, or a shape.
    dtype : numpy dtype
    xp : module
        ``numpy`` or ``cupy``.
    """
    shape = (int(n),) if np.isscalar(n) else tuple(int(d) for d in n)
    if xp is np:
        return np.empty(shape, dtype=dtype)
    try:
        import cupyx

        return cupyx.empty_pinned(shape, dtype=dtype)
    except (ImportError, AttributeError):  # CuPy older than v8 has no empty_pinned
        dtype = np.dtype(dtype)
        count = int(np.prod(shape))
        memory = xp.cuda.alloc_pinned_memory(max(count, 1) * dtype.itemsize)
        return np.frombuffer(memory, dtype=dtype, count=count).reshape(shape)


# cudaHostRegister flags: Portable (every context sees it as pinned) and ReadOnly (the device only
# reads it: needed to register a mapping the process may not write, such as a shard's weights).
HOST_REGISTER_PORTABLE = 1
HOST_REGISTER_READ_ONLY = 8


class CudaPinner:
    """Page-locks host memory the GPU copies to and from (``cudaHostRegister``), so copies run as DMA.

    A client hands it every buffer a device copy touches (the shared gradient, the shards' weights
    mapped from shared memory), once each: a copy from pageable memory runs at a fraction of PCIe
    speed (6.5 against 53.6 GB/s host-to-device on an H100, DESIGN.md), and registering 80 MB costs
    about 5 ms once. Memory that cannot be registered stays pageable and works, slower; that is said
    once in the log.
    """

    def __init__(self, cupy):
        self.cupy = cupy
        self.warned = False

    def register(self, array: np.ndarray, read_only: bool) -> None:
        flags = HOST_REGISTER_PORTABLE | (HOST_REGISTER_READ_ONLY if read_only else 0)
        try:
            self.cupy.cuda.runtime.hostRegister(array.ctypes.data, array.nbytes, flags)
        except self.cupy.cuda.runtime.CUDARuntimeError as exc:
            if not self.warned:
                self.warned = True
                import logging

                logging.getLogger("psgrid.worker").warning(
                    "could not page-lock %d MB of host memory for the GPU (%s): copies use pageable memory, slower",
                    array.nbytes >> 20,
                    exc,
                )

    def unregister(self, array: np.ndarray) -> None:
        try:
            self.cupy.cuda.runtime.hostUnregister(array.ctypes.data)
        except self.cupy.cuda.runtime.CUDARuntimeError:
            pass  # it was never registered (see register)


def pinner_for(xp):
    """A :class:`CudaPinner` for CuPy, None for NumPy (nothing to pin)."""
    return None if xp is np else CudaPinner(xp)
