"""A payload arriving from the wire, checked as it lands: a push's gradient, or the initial weights.

A plane fills a :class:`RangeIntake` in one of two ways: a stream receives it piece by piece (gRPC
chunks, a TCP landing), or the plane hands over the whole gradient at once as a
:class:`GradientSource` of its own (a worker's shared memory, a CUDA IPC slot, an array of the
shard's process) for :meth:`PushIntake.fill`. Nothing reaches the shard until it is complete and
checked. service.py opens them; what a valid payload does to the state is the shard's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import numpy as np

from psgrid.psserver import dtypes as wire
from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.protocol import FLOAT32, ITEMSIZE, WIRE_DTYPES, PushResult, Reason
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.state.buffers import BufferPool
from psgrid.psserver.state.shard import Shard

GRADIENT_DTYPES = frozenset(WIRE_DTYPES.values())
# A device shard copies a payload to its GPU as it comes, a piece this size at a time: each copy runs
# while the next piece is received, so the last piece's copy is all that follows the receive.
UPLOAD_CHUNK_BYTES = 8 << 20
WEIGHT_DTYPES = frozenset({FLOAT32})


class GradientSource(Protocol):
    """A whole gradient that a plane hands to :meth:`PushIntake.fill`, instead of a payload to receive.

    Each plane that has one defines its own (shm_server.py's ``SharedSegment``, ipc_server.py's
    ``DeviceSlot``, local_gradient.py's ``CallerArray``); the intake decides where it lands and
    whether it is checked, so every plane's gradient meets the same rules.
    """

    nbytes: int  # what the push moved, as the shard's counters count it

    def check(self, size: int) -> None:
        """Refuse (InvalidArgument, with its reason), before anything is read, a gradient that is not
        ``size`` elements of a gradient dtype."""

    def lend(self):
        """The gradient itself, float32, to be read where it lies during this push only; None: copy it."""

    def copy_into(self, destination) -> bool:
        """Copy the gradient, as float32, into ``destination`` (a pooled buffer of the shard's, where its
        arrays live: its GPU on a device shard); True when that same pass checked every value for NaN
        and infinity (raising :func:`non_finite` on one), so nothing reads it again for them."""


def check_dtype(dtype: int, allowed: frozenset[int]) -> None:
    """Refuse a wire dtype that is not one of ``allowed``, naming those that are."""
    if dtype not in allowed:
        kinds = "/".join(name for name, code in WIRE_DTYPES.items() if code in allowed)
        raise InvalidArgument(f"dtype {dtype} is not allowed here (expected {kinds})", Reason.BAD_DTYPE)


class RangeIntake:
    """One float range arriving from the wire, checked as it lands; nothing reaches the shard until :meth:`complete`.

    A stream fills it as its bytes come: the gRPC streams add chunks that must tile
    ``[begin, begin + size)`` in order (:meth:`add_chunk`); the TCP plane fills the whole range at
    once (:meth:`landing`, then :meth:`landed`); a plane that holds the whole gradient already hands
    it over instead (:meth:`PushIntake.fill`). Each piece is checked as it arrives, so a bad one
    is refused before the rest is read. ``finite`` is the check for NaN and infinity, or None
    where the values are checked later, by the update that reads them (see state/pushes.py
    :func:`finite_check`).
    """

    __slots__ = (
        "begin",
        "size",
        "buffer",
        "allowed",
        "scratch_pool",
        "scratch",
        "landing_dtype",
        "covered",
        "chunks",
        "nbytes",
        "finite",
    )

    def __init__(
        self,
        begin: int,
        size: int,
        buffer: np.ndarray | None,
        allowed: frozenset[int],
        scratch: Callable[[], BufferPool] | None = None,
        finite: Callable[[np.ndarray], bool] | None = wire.all_finite,
    ):
        self.begin, self.size, self.buffer, self.allowed = begin, size, buffer, allowed
        self.finite = finite
        self.scratch_pool = scratch  # where half-precision landings come from (asked only for those)
        self.scratch: np.ndarray | None = None
        self.landing_dtype = 0
        self.covered = self.chunks = self.nbytes = 0

    def _check_dtype(self, dtype: int) -> None:
        check_dtype(dtype, self.allowed)

    def _destination(self) -> np.ndarray:
        """The buffer the range lands in (a push takes its pooled one only once its payload comes)."""
        return self.buffer

    def add_chunk(self, offset: int, dtype: int, data) -> None:
        self._check_dtype(dtype)
        n = wire.element_count(data, dtype)
        expected = self.begin + self.covered
        if offset != expected:
            raise InvalidArgument(
                f"chunk {self.chunks} starts at offset {offset}, expected {expected}: chunks must "
                f"tile this shard's range [{self.begin}, {self.begin + self.size}) in order",
                Reason.BAD_OFFSET,
            )
        if self.covered + n > self.size:
            raise InvalidArgument(
                f"chunk {self.chunks} runs past the end of this shard's range [{self.begin}, {self.begin + self.size})",
                Reason.BAD_SIZE,
            )
        buffer = self.buffer if self.buffer is not None else self._destination()
        piece = buffer[self.covered : self.covered + n]
        wire.decode_into(piece, data, dtype)
        if self.finite is not None and not self.finite(piece):
            raise non_finite(f"chunk {self.chunks} (offset {offset})")
        self.covered += n
        self.chunks += 1
        self.nbytes += len(data)

    def landing(self, dtype: int, nbytes: int) -> memoryview:
        """The bytes a transport that moves the whole range at once must fill (dtype and size checked)."""
        if dtype not in self.allowed:
            self._check_dtype(dtype)
        expected = self.size * ITEMSIZE[dtype]
        if nbytes != expected:
            raise InvalidArgument(
                f"payload of {nbytes} bytes; this shard's range needs {expected} ({self.size} elements)",
                Reason.BAD_SIZE,
            )
        self.landing_dtype = dtype
        buffer = self._destination()
        if dtype == FLOAT32:
            return memoryview(buffer).cast("B")
        self.scratch = self.scratch_pool().take()
        return memoryview(self.scratch).cast("B")

    def landed(self) -> None:
        """The landing is full: convert a half-precision payload and check the values."""
        if self.scratch is not None:
            wire.decode_into(self.buffer, memoryview(self.scratch).cast("B"), self.landing_dtype)
            self.release_scratch()
        if self.finite is not None and not self.finite(self.buffer):
            raise non_finite("payload")
        self.covered, self.chunks = self.size, 1
        self.nbytes = self.size * ITEMSIZE[self.landing_dtype]

    def complete(self, declared_chunks: int | None = None) -> None:
        if self.covered != self.size:
            raise InvalidArgument(
                f"payload ended early: it covered {self.covered} of this shard's {self.size} elements", Reason.BAD_SIZE
            )
        if declared_chunks is not None and declared_chunks != self.chunks:
            raise InvalidArgument(
                f"stream declared {declared_chunks} chunks but sent {self.chunks}", Reason.BAD_CHUNK_COUNT
            )

    def release_scratch(self) -> None:
        if self.scratch is not None:
            self.scratch_pool().give(self.scratch)
            self.scratch = None


def non_finite(what: str) -> InvalidArgument:
    return InvalidArgument(f"{what} contains NaN or infinity", Reason.NON_FINITE)


class PushIntake(RangeIntake):
    """One push, whichever plane brings it: the gradient lands, then :meth:`commit` hands it to the shard.

    It lands in a pooled host buffer of the shard's, taken when the payload comes (and given back by
    :meth:`close` unless a sync round keeps it), or, handed over whole (:meth:`fill`), is read where
    the plane's source lends it (``borrowed``: a worker's shared memory) or copied out of it into a
    pooled buffer where the shard's arrays live (a CUDA IPC slot, into the shard's GPU). A device
    shard's network payload lands in page-locked host memory and goes on to the GPU as it comes: the
    TCP plane's a piece at a time (:meth:`receive`), gRPC's a chunk at a time (:meth:`add_chunk`).
    """

    __slots__ = (
        "shard",
        "worker_id",
        "clock",
        "version",
        "borrowed",
        "home",
        "checked",
        "flag",
        "staged",
        "uploaded",
    )

    def __init__(self, service, worker_id: int, clock: int, version: int):
        shard = service.shard
        super().__init__(shard.begin, shard.size, None, GRADIENT_DTYPES, service.half_pool, shard.pushes.finite_check)
        self.shard, self.worker_id, self.clock, self.version = shard, worker_id, clock, version
        self.borrowed = False
        self.checked = False  # the gradient is known finite (else the update checks it, in async)
        self.flag = None  # its check, queued on a device shard's GPU before the update that reads it (async)
        self.home = shard.landing_pool  # the pool ``buffer`` goes back to
        self.staged = None  # a device shard's copy of the payload on its GPU, as it comes
        self.uploaded = 0  # elements of gRPC chunks queued for the GPU so far

    def _destination(self) -> np.ndarray:
        if self.buffer is None:
            self.buffer = self.home.take()
        return self.buffer

    def add_chunk(self, offset: int, dtype: int, data) -> None:
        """A gRPC chunk: decoded and checked in the host landing, then, on a device shard, on its way to the GPU.

        What has landed goes up ``UPLOAD_CHUNK_BYTES`` at a time, each copy queued on the shard's
        stream while the next chunks are received, as the TCP plane's pieces do (:meth:`receive`);
        :meth:`commit` waits for the last.
        """
        super().add_chunk(offset, dtype, data)
        arrays = self.shard.arrays
        if arrays.on_gpu and (self.covered - self.uploaded >= UPLOAD_CHUNK_BYTES // 4 or self.covered == self.size):
            if self.staged is None:
                self.staged = self.shard.pool.take()
            arrays.upload_part(self.staged, self.buffer, self.uploaded, self.covered)
            self.uploaded = self.covered

    def receive(self, landing: memoryview, read: Callable[[memoryview], object]) -> None:
        """Fill ``landing`` (from :meth:`landing`) through ``read(view)``, which fills ``view`` from the wire.

        On a device shard a float32 payload goes on to the GPU a piece at a time, each piece's copy
        queued on the shard's stream while the next one is received; :meth:`landed` waits for the last.
        """
        arrays = self.shard.arrays
        if not (arrays.on_gpu and self.landing_dtype == FLOAT32):
            read(landing)
            return
        self.staged = self.shard.pool.take()
        for start in range(0, landing.nbytes, UPLOAD_CHUNK_BYTES):
            end = min(start + UPLOAD_CHUNK_BYTES, landing.nbytes)
            read(landing[start:end])
            arrays.upload_part(self.staged, self.buffer, start // 4, end // 4)

    def landed(self) -> None:
        if self.staged is None:
            super().landed()
            return
        arrays = self.shard.arrays
        arrays.finished()  # the last piece is on the GPU: the host landing is free again
        if not arrays.all_finite(self.staged):
            raise non_finite("payload")
        self.home.give(self.buffer)
        self.buffer, self.home, self.staged, self.checked = self.staged, self.shard.pool, None, True
        self.covered, self.chunks, self.nbytes = self.size, 1, self.size * ITEMSIZE[FLOAT32]

    def fill(self, source: GradientSource) -> None:
        """The whole gradient at once, handed over by a plane as ``source`` (see :class:`GradientSource`).

        Read where it lies when the source lends it, during this push only (``borrowed``: a sync
        round that keeps it copies it first); else copied into a pooled buffer of the shard's, where
        the worker cannot change it between its check and its update. Checked for NaN and infinity
        in the copy's own pass where the source does so, else as it lands where a sync round may hold
        it (``finite``); in async the update checks it as it reads it. In async a source that queues
        its checked copy on a device shard's GPU (``queue_into``: a CUDA IPC slot) leaves the check's
        flag there for the update, queued after it, to read: the shard waits for its GPU once a push.
        """
        source.check(self.size)
        lent = source.lend()
        if lent is not None:
            self.buffer, self.borrowed = lent, True
        else:
            self.home = self.shard.pool
            self.buffer = self.home.take()
            queue = getattr(source, "queue_into", None)
            if queue is not None and self.finite is None:
                self.flag = queue(self.buffer)
            else:
                self.checked = source.copy_into(self.buffer)
        if not self.checked and self.flag is None and self.finite is not None and not self._all_finite(self.buffer):
            raise non_finite("payload")
        self.covered, self.chunks, self.nbytes = self.size, 1, source.nbytes

    def _all_finite(self, values) -> bool:
        """``finite`` for host memory; a device array (of the shard's GPU) is checked by the shard's own arrays."""
        return self.finite(values) if isinstance(values, np.ndarray) else self.shard.arrays.all_finite(values)

    def commit(self, declared_chunks: int | None = None) -> PushResult:
        if self.covered != self.size or declared_chunks is not None:  # a whole landing is complete
            self.complete(declared_chunks)
        if self.buffer is None:  # headers alone to an empty range (whose pushes carry one empty chunk)
            raise InvalidArgument("a push with no payload: headers alone", Reason.BAD_SIZE)
        if self.staged is not None:  # gRPC chunks went on to the GPU as they came: the last copy ends first
            self.shard.arrays.finished()
            self.home.give(self.buffer)
            self.buffer, self.home, self.staged = self.staged, self.shard.pool, None
        result, kept = self.shard.push(
            self.worker_id,
            self.clock,
            self.version,
            self.buffer,
            self.nbytes,
            borrowed=self.borrowed,
            checked=self.checked,
            flag=self.flag,
        )
        if kept:
            self.buffer = None  # the shard holds it for its sync round now
        return result

    def close(self) -> None:
        if self.scratch is not None:
            self.release_scratch()
        if self.staged is not None:  # a receive that did not complete: its copies end before reuse
            self.shard.arrays.finished()
            self.shard.pool.give(self.staged)
            self.staged = None
        if self.buffer is not None:
            if not self.borrowed:
                self.home.give(self.buffer)
            self.buffer = None

    def __enter__(self) -> PushIntake:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class InitIntake(RangeIntake):
    """The initial weights of this shard's range, from the first worker to offer them."""

    __slots__ = ("shard", "spec")

    def __init__(self, shard: Shard, spec: ModelSpec):
        begin, end = shard.layout(spec)
        try:
            buffer = np.empty(end - begin, np.float32)
        except MemoryError:
            raise InvalidArgument(
                f"a range of {end - begin} elements does not fit in this shard's memory", Reason.BAD_SPEC
            ) from None
        super().__init__(begin, end - begin, buffer, WEIGHT_DTYPES)
        self.shard, self.spec = shard, spec

    def commit(self, declared_chunks: int | None = None) -> tuple[bool, int]:
        """Set the weights; returns (applied, version). False when the shard already had them."""
        self.complete(declared_chunks)
        applied = self.shard.init(self.spec, self.buffer)
        return applied, self.shard.version
