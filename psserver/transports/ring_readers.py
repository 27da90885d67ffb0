"""The readers of a shard's weight ring in other processes of its host: their slots, their marks, a marked pull.

The shared-memory plane (shm_server.py) and the CUDA IPC plane (ipc_server.py) lend a version by
handing over the ring's buffer itself, not a copy (weight_ring.py): a reader holds a slot in the
ring's table of marks (a shared file), a pull marks the buffer of the current version as read by
that slot, and the reader clears the mark once its copy is done. Both planes keep their readers
here; what they ask of the shard is its reader calls (``take_reader_slot``, ``free_reader_slot``,
``mark_current``) and its ``ring``, and of the service only what every plane asks: the pull's
admission (the consistency wait) and its refusals.
"""

from __future__ import annotations

from psgrid.psserver.exceptions import Unavailable
from psgrid.psserver.protocol import Reason


def require_shared(shard) -> None:
    """Refuse a call of a shard whose weights could not be shared (its log says why).

    A client that chose a shared plane before Init finds it out so: it drops the plane, and its
    next registration no longer offers it.
    """
    if not shard.shares_memory:
        raise Unavailable(
            f"shard {shard.config.shard_index} keeps its weights in private memory (its log says why): "
            f"use a network plane"
        )


class RingReaders:
    """One shard's readers in other processes, for the planes that lend its ring's buffers in place."""

    def __init__(self, service):
        self.service = service  # the shard's ShardService: admission and refusals
        self.shard = service.shard

    def open(self) -> tuple[int, int]:
        """A slot in the table of reader marks, and the table's shared file; refused when full or not shared."""
        shard = self.shard
        try:
            slot = shard.take_reader_slot()
        except ValueError as exc:
            raise Unavailable(str(exc), Reason.TOO_MANY_CONNECTIONS) from None
        if shard.ring.marks_fd < 0:
            shard.free_reader_slot(slot)
            require_shared(shard)
            raise Unavailable(
                f"shard {shard.config.shard_index} has no shared table of marks (its log says why): use a network plane"
            )
        return slot, shard.ring.marks_fd

    def marks_fd(self) -> int:
        """The table of marks again (a reader that opened already)."""
        return self.shard.ring.marks_fd

    def close(self, slot: int) -> None:
        self.shard.free_reader_slot(slot)

    def pull(self, *, worker_id: int, clock: int, timeout_s: float | None, slot: int) -> tuple[int, int]:
        """Wait as every pull does, then hand the current version to the reader of ``slot``.

        Returns (version, buffer index): the reader reads that buffer in place and clears its mark
        when done; nothing is copied here.
        """
        self.service.admit_pull(worker_id=worker_id, clock=clock, timeout_s=timeout_s)
        return self.shard.mark_current(slot)
