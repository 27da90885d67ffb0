"""Contiguous, balanced key ranges over the flat parameter vector (as in ps-lite).

Shard ``i`` of ``S`` owns ``[N*i//S, N*(i+1)//S)``: sizes differ by at most one
element, no tensor has to fit in one shard, and nothing is hashed. This is the
one function to replace for another placement.
"""

from __future__ import annotations

from psgrid.psserver.exceptions import InvalidArgument


def shard_range(total: int, index: int, num_shards: int) -> tuple[int, int]:
    """The ``[begin, end)`` element range that shard ``index`` of ``num_shards`` owns."""
    if num_shards < 1:
        raise InvalidArgument(f"num_shards must be at least 1, got {num_shards}")
    if not 0 <= index < num_shards:
        raise InvalidArgument(f"shard index {index} is outside 0..{num_shards - 1}")
    if total < 0:
        raise InvalidArgument(f"total size must be non-negative, got {total}")
    return total * index // num_shards, total * (index + 1) // num_shards


def shard_ranges(total: int, num_shards: int) -> list[tuple[int, int]]:
    """Every shard's range, in shard order; together they tile ``[0, total)``."""
    if num_shards < 1:
        raise InvalidArgument(f"num_shards must be at least 1, got {num_shards}")
    return [shard_range(total, i, num_shards) for i in range(num_shards)]


def chunk_ranges(begin: int, end: int, chunk_elems: int) -> list[tuple[int, int]]:
    """Split ``[begin, end)`` into consecutive pieces of at most ``chunk_elems`` elements."""
    if chunk_elems < 1:
        raise InvalidArgument(f"chunk size must be at least one element, got {chunk_elems}")
    return [(a, min(a + chunk_elems, end)) for a in range(begin, end, chunk_elems)] or [(begin, begin)]
