"""Any framework's arrays as NumPy or CuPy views of the same memory, through DLPack.

The user API (api.py) exchanges a model's parameters and gradients in whatever arrays the
model keeps them: NumPy, CuPy, PyTorch tensors, JAX arrays, on the CPU or a CUDA GPU. It never
copies them into another framework's memory: :func:`view` gives a NumPy array (CPU) or a CuPy
array (GPU) over the same bytes (``np.from_dlpack`` / ``cupy.from_dlpack``), so weights are
written into the model's own tensors and gradients read from them in place. CuPy is imported
only when a GPU array shows up.
"""

from __future__ import annotations

import numpy as np

from psgrid.worker.backend import is_cupy_array

# DLPack device types (dlpack.h): what np.from_dlpack and cupy.from_dlpack take.
_CPU_TYPES = {1: "cpu", 3: "cpu"}  # kDLCPU, kDLCUDAHost (pinned host memory)
_GPU_TYPES = {2: "cuda", 13: "cuda"}  # kDLCUDA, kDLCUDAManaged
# Frameworks whose arrays are immutable: their memory is read, never written.
_IMMUTABLE = ("jax", "jaxlib")


class ArrayError(TypeError):
    """An array the exchange cannot take (wrong type, dtype or device); the message names it."""


def device_of(a) -> tuple[str, int]:
    """``("cpu", 0)`` or ``("cuda", device_id)`` of a NumPy, CuPy or DLPack array."""
    if isinstance(a, np.ndarray):
        return "cpu", 0
    if is_cupy_array(a):
        return "cuda", int(a.device.id)
    probe = getattr(a, "__dlpack_device__", None)
    if probe is None:
        raise ArrayError(
            f"{type(a).__module__}.{type(a).__name__} is not an array psgrid can exchange: give NumPy "
            f"or CuPy arrays, or arrays that speak DLPack (PyTorch, JAX, ...)"
        )
    kind, device_id = probe()
    kind = int(kind)
    if kind in _CPU_TYPES:
        return "cpu", 0
    if kind in _GPU_TYPES:
        return "cuda", int(device_id)
    raise ArrayError(f"an array on DLPack device type {kind}: psgrid exchanges arrays on the CPU or a CUDA GPU")


def exportable(a):
    """What to hand to ``from_dlpack``: ``a``, or for a PyTorch tensor its detached self (same storage)."""
    # A PyTorch tensor that requires grad refuses __dlpack__; its detached self shares the same storage.
    detach = getattr(a, "detach", None)
    return detach() if callable(detach) else a


def view(a):
    """A NumPy (CPU) or CuPy (GPU) array over the memory of ``a``: no copy."""
    if isinstance(a, np.ndarray) or is_cupy_array(a):
        return a
    source = exportable(a)
    kind, _ = device_of(source)
    if kind == "cpu":
        return np.from_dlpack(source)
    try:
        import cupy
    except ImportError as exc:
        raise ArrayError(
            f"{type(a).__name__} lives on a CUDA GPU: exchanging it without a copy needs CuPy "
            f"(pip install 'psgrid[gpu]')"
        ) from exc
    return cupy.from_dlpack(source)


def writable(original, array) -> bool:
    """Whether the weights may be written into ``original`` in place (``array`` is its :func:`view`).

    JAX arrays are immutable (jit may have captured them), and a NumPy view may be read-only.
    """
    if type(original).__module__.split(".", 1)[0] in _IMMUTABLE:
        return False
    return bool(array.flags.writeable) if isinstance(array, np.ndarray) else True


def module_of(array):
    """``numpy`` or ``cupy`` for a :func:`view`."""
    if isinstance(array, np.ndarray):
        return np
    import cupy

    return cupy
