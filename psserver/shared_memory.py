"""Arrays in memory that another process on this host can map: anonymous files passed by descriptor.

A :class:`SharedArray` lives in a ``memfd`` (an anonymous file in RAM) mapped into this
process. It has no name anywhere: another process gets it only by being handed its file
descriptor over a Unix socket (``SCM_RIGHTS``), so nothing is ever left in ``/dev/shm``,
whatever way a process ends, and only a process the owner chose to hand it to can map it.
The mapping outlives the descriptor and the owner: pages are freed when the last process
unmaps them. ``/dev/shm``'s size (64 MiB in a default container) does not limit it.

Linux only (``os.memfd_create``); :func:`available` says whether this host has it.
"""

from __future__ import annotations

import errno
import mmap
import os

import numpy as np


def available() -> bool:
    """Whether this host can make shared arrays (Linux's ``memfd_create``)."""
    return hasattr(os, "memfd_create") and hasattr(mmap, "MAP_SHARED")


class SharedArray:
    """A flat array in an anonymous shared file; ``fd`` hands it to another process.

    Parameters
    ----------
    count : int
        Number of elements.
    dtype : numpy dtype
    name : str
        Shown in ``/proc/PID/maps`` (for people reading them), never a path.
    """

    __slots__ = ("array", "fd", "nbytes", "_map")

    def __init__(self, count: int, dtype=np.float32, name: str = "psgrid"):
        dtype = np.dtype(dtype)
        self.nbytes = max(1, int(count)) * dtype.itemsize
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, self.nbytes)
            self._map = mmap.mmap(fd, self.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        self.array = np.frombuffer(self._map, dtype=dtype, count=int(count))

    def close(self) -> None:
        """Close the descriptor (the mapping stays while arrays use it; the kernel frees it after)."""
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def map_fd(fd: int, count: int, dtype=np.float32, *, writable: bool = True) -> np.ndarray:
    """Map ``count`` elements of the shared file ``fd`` (received from its owner) as an array.

    The descriptor is not kept: close it after this returns. Raises ``ValueError`` when the
    file is smaller than asked for (a peer that lied about a size cannot make us read past it).
    """
    dtype = np.dtype(dtype)
    nbytes = int(count) * dtype.itemsize
    size = os.fstat(fd).st_size
    if nbytes > size or nbytes <= 0 and count:
        raise ValueError(f"shared memory of {size} bytes is smaller than the {nbytes} bytes expected")
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    mapped = mmap.mmap(fd, max(nbytes, 1), mmap.MAP_SHARED, prot)
    array = np.frombuffer(mapped, dtype=dtype, count=int(count))
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
