"""Shared by the GPU tests: CuPy with a CUDA device, or a skip that says which is missing."""

from __future__ import annotations

import pytest


def cupy_or_skip():
    """CuPy with at least one CUDA device, or skip the test (only where no GPU is present)."""
    cupy = pytest.importorskip("cupy", exc_type=ImportError)
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except cupy.cuda.runtime.CUDARuntimeError:
        count = 0
    if count < 1:
        pytest.skip("CuPy is installed but sees no CUDA device")
    return cupy
