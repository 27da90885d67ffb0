"""A shard's range cut into contiguous chunks, one per thread, for the passes that read it all.

An update reads the gradient and the weights and writes the next version: pure memory traffic,
which one core cannot saturate on a large machine (about 6 GB/s for one thread on the H100 host
of DESIGN.md, against tens for the socket). NumPy releases the interpreter lock inside a ufunc, so
``threads`` threads each walking their own chunk of the range run the pass that much sooner. The
caller's thread takes the first chunk itself (no hand-off for one thread, the default).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, TypeVar

from psgrid.psserver.dtypes import all_finite

T = TypeVar("T")
MIN_CHUNK = 1 << 18       # elements: below this a thread's hand-off costs more than its share of the pass


class Chunks:
    """Runs ``fn(lo, hi, index)`` over ``[0, size)`` split among up to ``threads`` threads."""

    def __init__(self, threads: int = 1):
        self.threads = max(1, int(threads))
        self.pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="shard-apply") if self.threads > 1 else None

    def split(self, size: int) -> list[tuple[int, int]]:
        count = max(1, min(self.threads, size // MIN_CHUNK))
        return [(size * i // count, size * (i + 1) // count) for i in range(count)]

    def map(self, fn: Callable[[int, int, int], T], size: int) -> list[T]:
        parts = self.split(size)
        if len(parts) == 1:
            return [fn(0, size, 0)]
        futures = [self.pool.submit(fn, lo, hi, i) for i, (lo, hi) in enumerate(parts) if i]
        try:
            first = fn(*parts[0], 0)
        finally:
            # Every chunk ends before the caller goes on (or raises): none may still write its buffers.
            rest = [f.exception() or f.result() for f in futures]
        errors = [r for r in rest if isinstance(r, BaseException)]
        if errors:
            raise errors[0]
        return [first, *rest]

    def all_finite(self, values) -> bool:
        """Whether ``values`` holds no NaN or infinity, checked a chunk per thread."""
        if self.threads == 1 or len(values) < 2 * MIN_CHUNK:     # one chunk (a gRPC push's): no hand-off
            return all_finite(values)
        return all(self.map(lambda lo, hi, _: all_finite(values[lo:hi]), len(values)))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True)


SERIAL = Chunks(1)


def default_threads() -> int:
    """A quarter of the CPUs this process may use, 1 to 8: shards share a machine with workers and each other."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(8, cpus // 4))
