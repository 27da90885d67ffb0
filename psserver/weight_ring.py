"""A shard's weights as a ring of buffers: a pull reads the current one in place, an update writes another.

Why: a pull that copies the weights under the shard's lock costs a copy of the whole range per
pull, and a reader in another process (a worker on this host, through the shared-memory data
plane) cannot copy under our lock at all. So the weights are never changed in place: an update
writes the next version into a buffer nobody reads (:meth:`WeightRing.spare`), then makes it
current (:meth:`WeightRing.publish`). A reader is handed the current buffer and holds it until it
is done; a buffer is written again only when nobody holds it, so a read is never torn, in any
mode, without a lock held while it reads.

Two kinds of readers hold buffers. In-process ones (a TCP or gRPC send) are counted under the
shard's lock (:meth:`lend`, :meth:`give_back`). Readers in other processes have a slot each in a
table of marks that lives in shared memory: the shard writes the index of the buffer it hands
out into the reader's slot (:meth:`mark`), and the reader writes -1 there when its copy is done,
with no message. The reader's loads complete before its store of -1 becomes visible (x86 keeps
loads ahead of later stores; a GPU copy is synchronized before the store), so a buffer whose
mark is gone is safe to overwrite.

There are as many buffers as readers hold at once, plus the current one and one to write: the
ring grows when an update finds no spare buffer, and no further (in-process lending is capped
by the caller; every cross-process reader holds at most one buffer).
"""

from __future__ import annotations

import numpy as np

from psgrid.psserver.shared_memory import SharedArray

MAX_SHARED_READERS = 256     # slots in the table of marks: connections of the shared-memory plane at once
NO_MARK = -1
NO_VERSION = -1


class WeightRing:
    """The versions of one shard's range: buffers, which one is current, and who reads which.

    Parameters
    ----------
    size : int
        Elements of the shard's range.
    shared : bool
        Keep every buffer (and the table of marks) in shared memory, so readers in other
        processes on this host can map them.
    """

    def __init__(self, size: int, *, shared: bool):
        self.size = size
        self.shared = shared
        self.holders: list[SharedArray | None] = []     # the shared file behind each buffer, if shared
        self.arrays: list[np.ndarray] = []
        self.lent: list[int] = []                       # in-process readers of each buffer
        self.versions: list[int] = []                   # the version each buffer holds (NO_VERSION: none whole)
        self.current = 0
        self._marks_holder = SharedArray(MAX_SHARED_READERS, np.int64, "psgrid-marks") if shared else None
        self.marks = self._marks_holder.array if shared else np.full(MAX_SHARED_READERS, NO_MARK, np.int64)
        self.marks[:] = NO_MARK
        self.free_slots = list(range(MAX_SHARED_READERS - 1, -1, -1))
        self.peak_readers = 0                           # most slots taken at once (tests bound the ring by it)
        self._grow()

    @property
    def weights(self) -> np.ndarray:
        """The current version: read it, never write it."""
        return self.arrays[self.current]

    @property
    def marks_fd(self) -> int:
        return self._marks_holder.fd if self._marks_holder is not None else -1

    def fd(self, index: int) -> int:
        """The shared file of buffer ``index`` (to hand to a reader in another process)."""
        holder = self.holders[index]
        if holder is None:
            raise ValueError("this ring is not in shared memory")
        return holder.fd

    def _grow(self) -> int:
        if self.shared:
            holder = SharedArray(self.size, np.float32, "psgrid-weights")
            self.holders.append(holder)
            self.arrays.append(holder.array)
        else:
            self.holders.append(None)
            self.arrays.append(np.empty(self.size, np.float32))
        self.lent.append(0)
        self.versions.append(NO_VERSION)
        return len(self.arrays) - 1

    # ----- writing a version ------------------------------------------------------------------

    def spare(self) -> int:
        """A buffer nobody reads, to write the next version into (a new one if every buffer is held)."""
        marked = set(self.marks[self.marks >= 0].tolist())
        for index in range(len(self.arrays)):
            if index != self.current and not self.lent[index] and index not in marked:
                self.versions[index] = NO_VERSION      # about to be overwritten (or half-written, if refused)
                return index
        return self._grow()

    def spare_keeping(self, keep: int | None, keep_since: int) -> int:
        """:meth:`spare`, but never buffer ``keep`` nor one that holds a version from ``keep_since`` on.

        Delay compensation reads ``keep`` (the version a stale gradient came from) during the
        update, and keeps the last few versions so that the next stale push finds its own.
        """
        marked = set(self.marks[self.marks >= 0].tolist())
        keep_since = max(0, keep_since)            # a buffer that holds no version is never kept
        for index in range(len(self.arrays)):
            if (index != self.current and index != keep and not self.lent[index] and index not in marked
                    and self.versions[index] < keep_since):
                self.versions[index] = NO_VERSION
                return index
        return self._grow()

    def publish(self, index: int, version: int = NO_VERSION) -> None:
        """Make buffer ``index`` (just written, holding ``version``) the current version."""
        self.current = index
        self.versions[index] = version

    def find(self, version: int) -> int | None:
        """The buffer that still holds ``version``, if one does (older ones are overwritten as buffers free up)."""
        if version == NO_VERSION:
            return None
        for index, held in enumerate(self.versions):
            if held == version:
                return index
        return None

    # ----- readers ----------------------------------------------------------------------------

    def lend(self) -> int:
        """Hand the current buffer to an in-process reader; it calls :meth:`give_back` when done."""
        self.lent[self.current] += 1
        return self.current

    def give_back(self, index: int) -> None:
        self.lent[index] -= 1

    def lent_buffers(self) -> int:
        """How many buffers in-process readers hold now."""
        return sum(1 for n in self.lent if n)

    def take_slot(self) -> int:
        """A slot in the table of marks for a reader in another process (ValueError when all are taken)."""
        if not self.free_slots:
            raise ValueError(f"all {MAX_SHARED_READERS} shared-memory reader slots are taken")
        slot = self.free_slots.pop()
        self.peak_readers = max(self.peak_readers, MAX_SHARED_READERS - len(self.free_slots))
        return slot

    def free_slot(self, slot: int) -> None:
        """The reader is gone: whatever it held is released with its slot."""
        self.marks[slot] = NO_MARK
        self.free_slots.append(slot)

    def mark(self, slot: int) -> int:
        """Hand the current buffer to the reader of ``slot``; it clears the mark when its copy is done."""
        self.marks[slot] = self.current
        return self.current

    def close(self) -> None:
        """Close the shared files' descriptors (the memory goes once no process maps it)."""
        for holder in [*self.holders, self._marks_holder]:
            if holder is not None:
                holder.close()
