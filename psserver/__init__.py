"""Sharded parameter servers: the wire contract, shards, consistency policies and the client."""

from psgrid.psserver.sharding import shard_range, shard_ranges
from psgrid.psserver.spec import ModelSpec, ParamSpec

__all__ = ["ModelSpec", "ParamSpec", "shard_range", "shard_ranges"]
