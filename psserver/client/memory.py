"""The host memory a client owns and shares: its gradient, the staging of its pulls, and their pinning.

A client's gradient lives in a shared file (shared_memory.py) when this host can make one: a
shard on the same host maps it and applies the gradient where it lies, so a worker that computes
(or copies from its GPU) straight into :meth:`ClientMemory.gradient` pushes without a copy. A
half-precision push is encoded into a second shared file of its dtype. Pulls that arrive over a
network plane but are wanted elsewhere (a GPU) land in :meth:`staging` first.

The client knows nothing of GPUs: a caller that copies these buffers to and from a device passes
a ``pinner`` (worker/backend.py has one for CUDA), and every buffer a device will copy from or
into, here or mapped from a shard, is registered with it once and unregistered before it goes.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

import numpy as np

from psgrid.psserver import shared_memory
from psgrid.psserver.protocol import FLOAT32

# Elements of a gradient file per wire dtype: float32 as itself, half precision as raw 16-bit words.
SEGMENT_KINDS = {FLOAT32: np.dtype("<f4")}
HALF_KIND = np.dtype("<u2")
log = logging.getLogger("psgrid.client")


class Pinner(Protocol):
    """Makes host memory fast to copy to and from a device (page-locked); given by the caller."""

    def register(self, array: np.ndarray, read_only: bool) -> None: ...

    def unregister(self, array: np.ndarray) -> None: ...


class ClientMemory:
    """Buffers of a client's model of ``size`` elements, made on first use and shared where possible.

    Parameters
    ----------
    size : int
        Elements of the model's flat vector.
    shared : bool
        Put the gradient in shared memory (when the host can) so shards on this host read it in place.
    pinner : Pinner, optional
        Registers buffers a device copies to or from.
    """

    def __init__(self, size: int, *, shared: bool = True, pinner: Pinner | None = None):
        self.size = size
        self.shared = shared and shared_memory.available()
        self.pinner = pinner
        self.lock = threading.Lock()
        self._segments: dict[tuple[int, int], tuple[np.ndarray, shared_memory.SharedArray | None]] = {}
        self._staging: np.ndarray | None = None
        self._pinned: list[np.ndarray] = []

    def gradient(self, index: int = 0) -> np.ndarray:
        """Float32 gradient buffer ``index`` (0 or 1), which pushes copy nothing from (shared with shards here)."""
        return self.segment(FLOAT32, index)[0]

    def segment(self, dtype: int, index: int = 0) -> tuple[np.ndarray, int]:
        """Whole-model buffer ``index`` of wire dtype ``dtype`` and its shared file (-1 when not shared)."""
        if index not in (0, 1):
            raise ValueError(f"a client has gradient buffers 0 and 1, not {index}")
        with self.lock:
            key = (dtype, index)
            if key not in self._segments:
                kind = SEGMENT_KINDS.get(dtype, HALF_KIND)
                holder = self._shared_file(kind) if self.shared else None
                array = holder.array if holder is not None else np.empty(self.size, kind)
                if dtype == FLOAT32:
                    self._pin(array, read_only=False)
                self._segments[key] = (array, holder)
            array, holder = self._segments[key]
            return array, holder.fd if holder is not None else -1

    def shares(self) -> bool:
        """Whether shards on this host can read this client's gradients in place (made now, if not yet)."""
        self.segment(FLOAT32, 0)
        return self.shared

    def _shared_file(self, kind: np.dtype) -> shared_memory.SharedArray | None:
        """A gradient's shared file, or None (said once) where this process may not make one: a file-size
        limit counts anonymous files too, and the gradients then live in private memory."""
        try:
            return shared_memory.SharedArray(self.size, kind, "psgrid-gradient")
        except OSError as exc:
            log.warning(
                "gradient buffers in private memory, %s; shards on this host are reached over the network plane",
                shared_memory.refused(exc, self.size * kind.itemsize),
            )
            self.shared = False
            return None

    def staging(self) -> np.ndarray:
        """A float32 host buffer of the whole model, where network pulls land before they go elsewhere."""
        with self.lock:
            if self._staging is None:
                self._staging = np.empty(self.size, np.float32)
                self._pin(self._staging, read_only=False)
            return self._staging

    def gradient_index(self, values: np.ndarray, begin: int) -> int | None:
        """Which float32 gradient buffer ``values`` already lies in at element ``begin`` (None: neither)."""
        where = shared_memory.address(values)
        for index in (0, 1):
            found = self._segments.get((FLOAT32, index))
            if found is not None and where == shared_memory.address(found[0][begin:]):
                return index
        return None

    def _pin(self, array: np.ndarray, read_only: bool) -> None:
        if self.pinner is not None and array.nbytes:
            self.pinner.register(array, read_only)
            self._pinned.append(array)

    def pin(self, array: np.ndarray, read_only: bool) -> None:
        """Register memory mapped from a shard (``unpin`` it before it is unmapped)."""
        with self.lock:
            self._pin(array, read_only)

    def unpin(self, array: np.ndarray) -> None:
        with self.lock:
            for i, pinned in enumerate(self._pinned):
                if pinned is array:
                    del self._pinned[i]
                    self.pinner.unregister(array)
                    return

    def close(self) -> None:
        """Unregister everything and close the shared files (mappings go with the last array using them)."""
        with self.lock:
            pinned, self._pinned = self._pinned, []
            for array in pinned:
                self.pinner.unregister(array)
            for _, holder in self._segments.values():
                if holder is not None:
                    holder.close()
