"""Reusable flat buffers of one size, so pulls and pushes allocate nothing in the steady state."""

from __future__ import annotations

import threading

import numpy as np


class BufferPool:
    """Buffers of ``size`` elements of ``dtype``, handed out and taken back by the shard's data path."""

    def __init__(self, size: int, dtype=np.float32):
        self.size = size
        self.dtype = np.dtype(dtype)
        self.free: list[np.ndarray] = []
        self.lock = threading.Lock()
        self.on_loan = 0          # taken and not yet given back (tests check none is lost)

    def take(self) -> np.ndarray:
        with self.lock:
            self.on_loan += 1
            if self.free:
                return self.free.pop()
        return np.empty(self.size, dtype=self.dtype)

    def give(self, buf: np.ndarray) -> None:
        with self.lock:
            self.on_loan -= 1
            self.free.append(buf)
