"""Arrays in memory that another process on this host can map: anonymous files passed by descriptor.

A :class:`SharedArray` lives in a ``memfd`` (an anonymous file in RAM) mapped into this
process. It has no name anywhere: another process gets it only by being handed its file
descriptor over a Unix socket (``SCM_RIGHTS``), so nothing is ever left in ``/dev/shm``,
whatever way a process ends, and only a process the owner chose to hand it to can map it.
The mapping outlives the descriptor and the owner: pages are freed when the last process
unmaps them. ``/dev/shm``'s size (64 MiB in a default container) does not limit it.

Linux only (``os.memfd_create``); :func:`available` says whether this host has it.

A process that maps a file another process hands it trusts that file not to shrink: a page
past its end faults as SIGBUS, which kills the reader. So every file made here is sealed
(``F_ADD_SEALS``) against resizing, and one that others only read also against new writers
(``F_SEAL_FUTURE_WRITE``, Linux 5.1): the maker's own mapping stays writable, but no
descriptor a peer gets, or reopens through ``/proc``, maps writable, writes, truncates or
punches holes. :func:`unsafe_to_map` says why a file received from a peer is not safe to map.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import mmap
import os

import numpy as np

# Python's fcntl names F_SEAL_FUTURE_WRITE only from 3.12 (the kernel's value since 5.1).
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)
# Sizes fixed, and no seal added after ours (a peer could otherwise seal out its maker's writes).
FIXED_SIZE = (
    getattr(fcntl, "F_SEAL_SHRINK", 0x2) | getattr(fcntl, "F_SEAL_GROW", 0x4) | getattr(fcntl, "F_SEAL_SEAL", 0x1)
)
READ_ONLY_TO_OTHERS = FIXED_SIZE | F_SEAL_FUTURE_WRITE  # for files the maker writes and peers only read


def available() -> bool:
    """Whether this host can make shared arrays (Linux's ``memfd_create``)."""
    return hasattr(os, "memfd_create") and hasattr(mmap, "MAP_SHARED") and hasattr(os, "MFD_ALLOW_SEALING")


@functools.cache
def can_share_read_only() -> bool:
    """Whether this kernel seals a file against every writer but its maker (``F_SEAL_FUTURE_WRITE``, Linux 5.1).

    A shard hands its weights to readers in other processes only then: without it, any of
    them could reopen the file writable and change the weights everyone is served.
    """
    if not available():
        return False
    try:
        SharedArray(1, np.uint8, "psgrid-probe", seals=READ_ONLY_TO_OTHERS).close()
    except OSError:
        return False
    return True


class SharedArray:
    """A flat array in an anonymous shared file; ``fd`` hands it to another process.

    Parameters
    ----------
    count : int
        Number of elements.
    dtype : numpy dtype
    name : str
        Shown in ``/proc/PID/maps`` (for people reading them), never a path.
    seals : int
        Added once this process has mapped the file writable: :data:`FIXED_SIZE` (peers may
        write it, never resize it) or :data:`READ_ONLY_TO_OTHERS` (peers only read it).
    """

    __slots__ = ("array", "fd", "nbytes", "_map", "_reader_fd")

    def __init__(self, count: int, dtype=np.float32, name: str = "psgrid", *, seals: int = FIXED_SIZE):
        dtype = np.dtype(dtype)
        self.nbytes = max(1, int(count)) * dtype.itemsize
        fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, self.nbytes)
            self._map = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            if seals:  # after our writable mapping: F_SEAL_FUTURE_WRITE leaves it be
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self._reader_fd = -1
        self.array = np.frombuffer(self._map, dtype=dtype, count=int(count))

    def reader_fd(self) -> int:
        """A read-only descriptor of the file, for a peer that only reads it (made once; closed with this).

        The seals are what protect the file (a peer may reopen any descriptor through ``/proc``);
        this one cannot even be written or truncated itself. Where ``/proc`` is missing, ``fd``.
        """
        if self._reader_fd < 0:
            try:
                self._reader_fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return self.fd
        return self._reader_fd

    def close(self) -> None:
        """Close the descriptors (the mapping stays while arrays use it; the kernel frees it after)."""
        for name in ("fd", "_reader_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                os.close(fd)
                setattr(self, name, -1)


def unsafe_to_map(fd: int) -> str | None:
    """Why mapping the file ``fd`` (received from a peer) could fault in this process later; None if it cannot.

    Safe is a ``memfd`` on tmpfs sealed against shrinking and growing: its owner can still change
    its bytes, or punch holes (read back as zeros), but no page of a mapping of it ever goes
    missing. Checked once, when the file is received; nothing on the path that reads it.
    """
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:
        return "it is not a memfd (it takes no seals)"
    if ~seals & (fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW):
        return f"it is not sealed against resizing (seals {seals:#x})"
    kind = _filesystem(fd)
    if kind is None or kind != _filesystem_of_memfd():
        # hugetlbfs: a hole its owner punches faults as SIGBUS when the pool of huge pages is empty
        return "it is not a plain memfd on tmpfs (a hugetlbfs file, say)"
    return None


@functools.cache
def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _filesystem(fd: int) -> int | None:
    """The first word of ``fstatfs``'s answer (the filesystem's magic number), None if it fails."""
    answer = ctypes.create_string_buffer(256)  # struct statfs is 120 bytes on 64-bit Linux
    if _libc().fstatfs(fd, answer) != 0:
        return None
    return ctypes.c_long.from_buffer(answer).value


@functools.cache
def _filesystem_of_memfd() -> int | None:
    """The same for a memfd made here (compared as read, so the layout of struct statfs does not matter)."""
    fd = os.memfd_create("psgrid-probe", os.MFD_CLOEXEC)
    try:
        return _filesystem(fd)
    finally:
        os.close(fd)


def map_fd(fd: int, count: int, dtype=np.float32, *, writable: bool = True, offset: int = 0) -> np.ndarray:
    """Map ``count`` elements of the shared file ``fd`` (received from its owner), from byte ``offset``, as an array.

    Only those pages are mapped. The descriptor is not kept: close it after this returns.
    Raises ``ValueError`` when the file is smaller than asked for (a peer that lied about a size
    cannot make us read past it; a file that may shrink later is :func:`unsafe_to_map`).
    """
    dtype = np.dtype(dtype)
    nbytes = int(count) * dtype.itemsize
    size = os.fstat(fd).st_size
    if offset + nbytes > size or nbytes <= 0 and count or offset % dtype.itemsize:
        raise ValueError(f"shared memory of {size} bytes is smaller than the {offset + nbytes} bytes expected")
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    mapped = mmap.mmap(fd, max(offset + nbytes - start, 1), mmap.MAP_SHARED, prot, offset=start)
    array = np.frombuffer(mapped, dtype=dtype, count=int(count), offset=offset - start)
    if not writable:
        array.flags.writeable = False
    return array


def refused(exc: OSError, nbytes: int) -> str:
    """Why this process could not make a shared file of ``nbytes``, for the one line that says so.

    A file-size limit (``ulimit -f``, which some clusters set) counts anonymous files too.
    """
    hint = " (a file-size limit, ulimit -f, counts shared memory's files)" if exc.errno == errno.EFBIG else ""
    return f"cannot make a shared file of {nbytes} bytes: {exc.strerror or exc}{hint}"


def address(array: np.ndarray) -> int:
    """Where ``array``'s first element is in this process's memory."""
    return array.__array_interface__["data"][0]
