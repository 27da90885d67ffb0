"""The in-process plane's gradient: a caller's array, handed to the shard of its own process to read in place.

The plane's client end (local_client.py) builds it and the shard's intake reads it (intake.py
``GradientSource``), so it lives apart from both: it knows nothing of a shard's insides.
"""

from __future__ import annotations

import numpy as np

from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.protocol import Reason


class CallerArray:
    """A gradient in float32 memory of a caller in the shard's own process (the in-process plane).

    Read where it lies, during the push only: host memory, or on a device shard a device array of
    its GPU, which the caller has finished writing. A sync round that keeps it copies it first.
    """

    __slots__ = ("grad",)

    def __init__(self, grad):
        self.grad = grad

    @property
    def nbytes(self) -> int:
        return self.grad.nbytes

    def check(self, size: int) -> None:
        grad = self.grad
        if getattr(grad, "dtype", None) != np.float32 or getattr(grad, "ndim", 0) != 1:
            raise InvalidArgument(
                f"a pushed gradient must be a 1-D float32 array, got {getattr(grad, 'dtype', grad)!r}", Reason.BAD_DTYPE
            )
        if len(grad) != size:
            raise InvalidArgument(
                f"the gradient has {len(grad)} elements; this shard's range has {size}", Reason.BAD_SIZE
            )

    def lend(self):
        return self.grad

    def copy_into(self, destination) -> bool:
        raise AssertionError("a caller's array is always lent")
