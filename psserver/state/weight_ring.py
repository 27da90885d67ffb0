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

Every connected reader can write the whole table, so the shard trusts a slot only to say that a
buffer it handed out is still held: a slot holds buffer ``i`` when the shard gave it ``i`` and the
slot still says ``i``; anything else in it (garbage, another slot's index) holds nothing. And a
reader may hold on for ever, so the ring has at most :data:`MAX_VERSIONS` buffers: an update
that finds none spare at that size takes back the buffer handed out longest ago, writing
:data:`~psgrid.psserver.protocol.REVOKED` into the slots that hold it first. A reader checks its slot once its copy is
done: a slot that no longer names its buffer means the copy may be torn, and the reader reads
again (shm_client.py). The shard's store of REVOKED precedes its writes to the buffer, the
reader's loads of the buffer precede its load of the slot, and x86 keeps both orders: a reader
that still finds its index read nothing written after the revocation.

Short of the cap there are as many buffers as readers hold at once, plus the current one and one
to write: the ring grows when an update finds no spare buffer.

A device shard's ring (state/device.py) keeps its buffers on a GPU, each in an allocation of its
own that readers on this host map through CUDA IPC; its table of marks is in shared memory all the
same, and the rules above hold as written, a reader's device copy synchronized before it clears
its mark, the shard's update finished before it publishes.
"""

from __future__ import annotations

import numpy as np

from psgrid.psserver.protocol import NO_MARK, REVOKED
from psgrid.psserver.shared_memory import READ_ONLY_TO_OTHERS, SharedArray

MAX_SHARED_READERS = 256  # slots in the table of marks: connections of the shared-memory plane at once
# Buffers at most: the current one, the one an update writes, two lent to in-process senders
# (snapshots.MAX_LENT_BUFFERS) and four versions for readers in other processes. A reader holds its
# buffer for one copy, and an update takes as long as a copy or longer (it reads the weights and
# the gradient and writes the next version), so a reader's mark is revoked only when four
# updates finish during one of its copies; then it copies again. Readers that hold on for ever
# cost the shard these eight buffers, no more.
MAX_VERSIONS = 8
NOT_GIVEN = -3  # what the shard gave a slot that holds nothing (no buffer has this index)
NO_VERSION = -1  # what a buffer holds while it holds no whole version


class WeightRing:
    """The versions of one shard's range: buffers, which one is current, and who reads which.

    Parameters
    ----------
    size : int
        Elements of the shard's range.
    shared : bool
        Keep every buffer (and the table of marks) in shared memory, so readers in other
        processes on this host can map them.
    device : GpuArrays, optional
        Keep the buffers on this GPU instead (``shared`` then puts only the table of marks in
        shared memory, for readers that map the buffers through CUDA IPC).
    """

    def __init__(self, size: int, *, shared: bool, keep_versions: int = 0, device=None):
        self.size = size
        self.device = device
        # Delay compensation keeps the last few versions (spare_keeping): room for them past the cap.
        self.max_versions = MAX_VERSIONS + max(0, keep_versions)
        self.holders: list[SharedArray | None] = []  # the shared file behind each buffer, if shared
        self.arrays: list[np.ndarray] = []
        self.lent: list[int] = []  # in-process readers of each buffer
        self.versions: list[int] = []  # the version each buffer holds (NO_VERSION: none whole)
        self.current = 0
        # readers write their own slots in it: sealed against resizing only
        self._marks_holder = SharedArray(MAX_SHARED_READERS, np.int64, "psgrid-marks") if shared else None
        self.marks = self._marks_holder.array if shared else np.full(MAX_SHARED_READERS, NO_MARK, np.int64)
        self.shared = shared and device is None  # the buffers themselves
        self.marks[:] = NO_MARK
        self.given = np.full(MAX_SHARED_READERS, NOT_GIVEN, np.int64)  # the buffer the shard handed each slot
        self.free_slots = list(range(MAX_SHARED_READERS - 1, -1, -1))
        self.peak_readers = 0  # most slots taken at once (tests bound the ring by it)
        self.published: list[int] = []  # when each buffer was last made current ...
        self.publications = 0  # ... counted in versions published
        self.revoked = 0  # reads taken back (their readers read again)
        self._grow()

    @property
    def weights(self) -> np.ndarray:
        """The current version: read it, never write it."""
        return self.arrays[self.current]

    @property
    def marks_fd(self) -> int:
        return self._marks_holder.fd if self._marks_holder is not None else -1

    def reader_fd(self, index: int) -> int:
        """A read-only descriptor of buffer ``index``'s file (to hand to a reader in another process).

        The file is sealed against resizing and against every writer but this process's own
        mapping: no reader can change or shrink the weights it is handed.
        """
        holder = self.holders[index]
        if holder is None:
            raise ValueError("this ring is not in shared memory")
        return holder.reader_fd()

    def ipc_handle(self, index: int) -> bytes:
        """Buffer ``index``'s CUDA IPC handle, for a reader in another process (a device ring only)."""
        if self.device is None:
            raise ValueError("this ring is not on a GPU")
        return self.device.ipc_handle(self.arrays[index])

    def _grow(self) -> int:
        if self.device is not None:
            self.holders.append(None)
            self.arrays.append(self.device.empty(self.size))
        elif self.shared:
            holder = SharedArray(self.size, np.float32, "psgrid-weights", seals=READ_ONLY_TO_OTHERS)
            self.holders.append(holder)
            self.arrays.append(holder.array)
        else:
            self.holders.append(None)
            self.arrays.append(np.empty(self.size, np.float32))
        self.lent.append(0)
        self.published.append(-1)
        self.versions.append(NO_VERSION)
        return len(self.arrays) - 1

    # ----- writing a version ------------------------------------------------------------------

    def spare(self) -> int:
        """A buffer nobody reads, to write the next version into.

        A new one if every buffer is held, up to ``max_versions``; past that, the buffer
        handed out longest ago, taken back from the readers that hold it (:meth:`_revoke`).
        """
        return self.spare_keeping(None, None)

    def spare_keeping(self, keep: int | None, keep_since: int | None) -> int:
        """:meth:`spare`, but never buffer ``keep``, nor (while others are free) one holding a version from ``keep_since`` on.

        Delay compensation reads ``keep`` (the version a stale gradient came from) during the
        update, and keeps the last few versions so that the next stale push finds its own; at
        the cap, the versions kept give way before a reader's read is taken back.
        """
        held = self._held()
        free = [i for i in range(len(self.arrays)) if i != self.current and i != keep and not self.lent[i]]
        for index in free:
            if index not in held and (keep_since is None or self.versions[index] < max(0, keep_since)):
                return self._taken(index)
        if len(self.arrays) < self.max_versions:
            return self._taken(self._grow())
        unheld = [i for i in free if i not in held]
        if unheld:  # only versions kept for compensation: the oldest gives way
            return self._taken(min(unheld, key=self.published.__getitem__))
        if not free:  # only in-process lending past its cap (snapshots.MAX_LENT_BUFFERS) could do this
            return self._taken(self._grow())
        return self._taken(self._revoke(min(free, key=self.published.__getitem__)))

    def _taken(self, index: int) -> int:
        self.versions[index] = NO_VERSION  # about to be overwritten (or half-written, if refused)
        return index

    def _held(self) -> set[int]:
        """Buffers readers in other processes hold: slots that still say what the shard gave them.

        One comparison per update: a slot given nothing matches only a peer's NOT_GIVEN, no index.
        """
        return set(self.given[self.marks == self.given].tolist())

    def _revoke(self, index: int) -> int:
        """Take buffer ``index`` back from the slots that hold it: they read REVOKED before it is written."""
        slots = np.flatnonzero(self.given == index)
        self.revoked += int(np.count_nonzero(self.marks[slots] == index))
        self.marks[slots] = REVOKED  # also where the slot says something else now: its reader reads again
        self.given[slots] = NOT_GIVEN
        return index

    def publish(self, index: int, version: int = NO_VERSION) -> None:
        """Make buffer ``index`` (just written, holding ``version``) the current version."""
        self.current = index
        self.publications += 1
        self.published[index] = self.publications
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
        """An in-process reader is done with buffer ``index`` (ValueError if it was not lent)."""
        if not self.lent[index]:
            raise ValueError(f"buffer {index} given back but not lent: it could be overwritten while read")
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
        """The reader is gone: whatever it held is released with its slot (ValueError if it is free)."""
        if not 0 <= slot < MAX_SHARED_READERS or slot in self.free_slots:
            raise ValueError(f"slot {slot} is not taken: freed twice, it would go to two readers")
        self.marks[slot] = NO_MARK
        self.given[slot] = NOT_GIVEN
        self.free_slots.append(slot)

    def mark(self, slot: int) -> int:
        """Hand the current buffer to the reader of ``slot``; it clears the mark when its copy is done."""
        self.given[slot] = self.marks[slot] = self.current
        return self.current

    def close(self) -> None:
        """Close the shared files' descriptors (the memory goes once no process maps it)."""
        for holder in [*self.holders, self._marks_holder]:
            if holder is not None:
                holder.close()
