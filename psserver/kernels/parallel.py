"""A shard's range cut into parts that threads take in turn, for the passes that read it all.

An update reads the gradient and the weights and writes the next version: pure memory traffic,
which one core cannot saturate on a large machine (about 6 GB/s for one thread on the H100 host
of DESIGN.md, against tens for the socket). NumPy releases the interpreter lock inside a ufunc, so
``threads`` threads each walking their own parts of the range run the pass that much sooner. The
caller's thread works too (no hand-off for one thread, the default).

Why parts rather than one chunk a thread: a shard shares its host with the others and with the
workers, so some thread of its pool is often off its core for a while; with a fixed chunk each,
the update ends when that one does. Taking parts of a few blocks in turn, the threads that run
take over the late one's share.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from psgrid.psserver.dtypes import all_finite

T = TypeVar("T")
MIN_CHUNK = 1 << 18  # elements: below this a thread's hand-off costs more than its share of the pass
PARTS_PER_THREAD = 4  # parts a thread takes, on average, of a range large enough (see the module's text)


class Chunks:
    """Runs ``fn(lo, hi, thread)`` over parts of ``[0, size)``, on up to ``threads`` threads at once.

    ``thread`` (0 .. threads-1) says which thread runs a part, for scratch memory of its own.
    """

    def __init__(self, threads: int = 1):
        self.threads = max(1, int(threads))
        self.pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="shard-apply") if self.threads > 1 else None

    def split(self, size: int) -> list[tuple[int, int]]:
        """The parts of ``[0, size)``: whole multiples of MIN_CHUNK (a block of the optimizers) but the last."""
        if self.threads == 1 or size < 2 * MIN_CHUNK:
            return [(0, size)]
        part = MIN_CHUNK * max(1, size // (self.threads * PARTS_PER_THREAD * MIN_CHUNK))
        return [(lo, min(lo + part, size)) for lo in range(0, size, part)]

    def map(self, fn: Callable[[int, int, int], T], size: int) -> list[T]:
        """``fn`` over every part, the results in the parts' order; the first error raised once all have stopped."""
        parts = self.split(size)
        if len(parts) == 1:
            return [fn(0, size, 0)]
        results: list = [None] * len(parts)
        taken = itertools.count()  # next() on it is atomic under the interpreter lock
        failed = []

        def take(thread: int) -> None:
            while not failed and (k := next(taken)) < len(parts):
                try:
                    results[k] = fn(*parts[k], thread)
                except BaseException as exc:
                    failed.append(exc)  # the other threads take no new part

        futures = [self.pool.submit(take, thread) for thread in range(1, min(self.threads, len(parts)))]
        take(0)
        for f in futures:  # every part ends before the caller goes on (or raises): none may still write
            f.result()
        if failed:
            raise failed[0]
        return results

    def all_finite(self, values) -> bool:
        """Whether ``values`` holds no NaN or infinity, checked a part at a time on the threads."""
        if self.threads == 1 or len(values) < 2 * MIN_CHUNK:  # one part (a gRPC push's): no hand-off
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
