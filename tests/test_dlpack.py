"""Arrays of any framework as NumPy views of the same memory: the DLPack path, tested with NumPy (CI has no PyTorch)."""

from __future__ import annotations

import numpy as np
import pytest

from psgrid.worker import dlpack


class Foreign:
    """A tensor of a framework psgrid does not know: it speaks DLPack and nothing else."""

    def __init__(self, array: np.ndarray, device: tuple[int, int] = (1, 0)):
        self._array = array
        self._device = device

    def __dlpack__(self, **kw):
        return self._array.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._device


class TorchLike(Foreign):
    """Like a PyTorch parameter: refuses DLPack while it requires grad; ``detach()`` shares its storage."""

    requires_grad = True

    def __init__(self, array: np.ndarray):
        super().__init__(array)
        self.grad = None

    def __dlpack__(self, **kw):
        raise RuntimeError("Can't export tensors that require gradient, use tensor.detach()")

    def detach(self):
        return Foreign(self._array)


class Immutable(Foreign):
    pass


Immutable.__module__ = "jaxlib.xla_extension"  # what a JAX array's type says


def test_a_foreign_array_is_viewed_not_copied():
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    v = dlpack.view(Foreign(a))
    assert isinstance(v, np.ndarray) and v.shape == (2, 3) and np.shares_memory(v, a)
    v[...] = -1  # what a pull does to it
    assert (a == -1).all()
    assert dlpack.view(a) is a  # NumPy needs no view at all
    assert dlpack.module_of(v) is np and dlpack.device_of(Foreign(a)) == ("cpu", 0)


def test_a_tensor_that_requires_grad_is_viewed_through_detach():
    a = np.zeros(3, np.float32)
    v = dlpack.view(TorchLike(a))
    assert np.shares_memory(v, a)


def test_devices_are_read_from_dlpack():
    a = np.zeros(2, np.float32)
    assert dlpack.device_of(Foreign(a, (2, 1))) == ("cuda", 1)
    assert dlpack.device_of(Foreign(a, (3, 0))) == ("cpu", 0)  # pinned host memory
    with pytest.raises(dlpack.ArrayError, match="DLPack device type 4"):
        dlpack.device_of(Foreign(a, (4, 0)))
    with pytest.raises(dlpack.ArrayError, match="not an array psgrid can exchange"):
        dlpack.device_of([1.0, 2.0])


def test_immutable_and_read_only_arrays_are_not_written():
    a = np.zeros(3, np.float32)
    assert dlpack.writable(Foreign(a), dlpack.view(Foreign(a)))
    assert not dlpack.writable(Immutable(a), dlpack.view(Immutable(a)))
    frozen = np.zeros(3, np.float32)
    frozen.flags.writeable = False
    assert not dlpack.writable(frozen, frozen)
