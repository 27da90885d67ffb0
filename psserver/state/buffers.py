"""Reusable flat buffers of one size, so pulls and pushes allocate nothing in the steady state."""

from __future__ import annotations

import threading

import numpy as np


class BufferPool:
    """Buffers of ``size`` elements of ``dtype``, handed out and taken back by the shard's data path."""

    def __init__(self, size: int, dtype=np.float32, make=None):
        self.size = size
        self.dtype = np.dtype(dtype)
        # make(size): a new buffer where the pool's live (a GPU's, page-locked host memory); default NumPy
        self.make = make if make is not None else (lambda n: np.empty(n, dtype=self.dtype))
        self.free: list[np.ndarray] = []
        self.lock = threading.Lock()
        self.on_loan = 0  # taken and not yet given back (tests check none is lost)

    def take(self) -> np.ndarray:
        """A buffer of ``size`` elements, holding whatever its last holder left in it."""
        with self.lock:
            self.on_loan += 1
            if self.free:
                return self.free.pop()
        return self.make(self.size)

    def give(self, buf: np.ndarray) -> None:
        """Take ``buf`` back for the next :meth:`take`.

        Raises
        ------
        ValueError
            When nothing is on loan (a buffer given back twice would be handed to two holders at
            once), or ``buf`` is not of this pool's size and dtype; the pool is left as it was.
        """
        if buf.shape != (self.size,) or buf.dtype != self.dtype:
            raise ValueError(f"a buffer of {buf.dtype} {buf.shape} given back to a pool of {self.dtype} ({self.size},)")
        with self.lock:
            if not self.on_loan:
                raise ValueError("a buffer given back to a pool that has none on loan (given back twice?)")
            self.on_loan -= 1
            self.free.append(buf)
