"""Model specs: an ordered list of named parameters laid out in one flat float32 vector.

Every worker and every shard computes the same :meth:`ModelSpec.hash`; a
registration or an Init with another hash is refused, so two processes can never
silently disagree on where a parameter lives in the flat vector.
"""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from psgrid.psserver.exceptions import InvalidArgument

FLAT_DTYPE = np.dtype(np.float32)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: its name, shape and (for now always float32) dtype."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"

    def __post_init__(self):
        if not self.name or not isinstance(self.name, str):
            raise InvalidArgument(f"parameter name must be a non-empty string, got {self.name!r}")
        shape = tuple(int(d) for d in self.shape)
        if any(d < 0 for d in shape):
            raise InvalidArgument(f"parameter {self.name!r} has a negative dimension: {shape}")
        try:
            with warnings.catch_warnings():  # a deprecated spelling from the wire is not this process's warning
                warnings.simplefilter("ignore")
                dtype = np.dtype(self.dtype)
        except Exception:  # noqa: BLE001 - NumPy's parser of free text from the wire: TypeError, ValueError, SyntaxError
            raise InvalidArgument(f"parameter {self.name!r} has an unknown dtype {self.dtype!r}") from None
        if dtype != FLAT_DTYPE:
            raise InvalidArgument(f"parameter {self.name!r}: only float32 parameters are supported, got {self.dtype}")
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "dtype", "float32")

    @property
    def size(self) -> int:
        return math.prod(self.shape)


class ModelSpec:
    """An ordered list of :class:`ParamSpec`, laid out back to back in one flat vector.

    Parameters
    ----------
    params : iterable of ParamSpec or (name, shape[, dtype]) tuples
        The parameters in layout order. Names must be unique.
    """

    def __init__(self, params: Iterable[ParamSpec | tuple]):
        self.params: tuple[ParamSpec, ...] = tuple(p if isinstance(p, ParamSpec) else ParamSpec(*p) for p in params)
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise InvalidArgument(f"duplicate parameter names in spec: {names}")
        self.offsets: dict[str, tuple[int, int]] = {}
        begin = 0
        for p in self.params:
            self.offsets[p.name] = (begin, begin + p.size)
            begin += p.size
        self.size: int = begin

    @classmethod
    def from_shapes(cls, shapes: Mapping[str, tuple[int, ...]]) -> ModelSpec:
        """Build a spec from an ordered ``{name: shape}`` mapping."""
        return cls(ParamSpec(name, tuple(shape)) for name, shape in shapes.items())

    @property
    def names(self) -> list[str]:
        return [p.name for p in self.params]

    @property
    def nbytes(self) -> int:
        return self.size * FLAT_DTYPE.itemsize

    def hash(self) -> str:
        """A stable hex digest of names, shapes and dtypes, in order."""
        canonical = json.dumps([[p.name, list(p.shape), p.dtype] for p in self.params], separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:32]

    def to_json(self) -> str:
        return json.dumps([[p.name, list(p.shape), p.dtype] for p in self.params])

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        return cls(ParamSpec(name, tuple(shape), dtype) for name, shape, dtype in json.loads(text))

    def flat(self, xp=np):
        """A new zeroed flat float32 buffer of ``size`` elements, from array module ``xp``."""
        return xp.zeros(self.size, dtype=xp.float32)

    def views(self, flat) -> dict:
        """Per-parameter views (no copies) into a flat buffer laid out by this spec."""
        if flat.ndim != 1 or flat.shape[0] != self.size:
            raise InvalidArgument(f"flat buffer has shape {flat.shape}, spec needs ({self.size},)")
        return {p.name: flat[self.offsets[p.name][0] : self.offsets[p.name][1]].reshape(p.shape) for p in self.params}

    def pack(self, arrays: Mapping, xp=np):
        """Copy named arrays into a new flat buffer (the inverse of :meth:`views`)."""
        flat = self.flat(xp)
        views = self.views(flat)
        for p in self.params:
            if p.name not in arrays:
                raise InvalidArgument(f"missing parameter {p.name!r}")
            value = arrays[p.name]
            if tuple(value.shape) != p.shape:
                raise InvalidArgument(f"parameter {p.name!r} has shape {tuple(value.shape)}, spec says {p.shape}")
            views[p.name][...] = value
        return flat

    def __eq__(self, other):
        return isinstance(other, ModelSpec) and self.params == other.params

    def __hash__(self):
        return hash(self.params)

    def __repr__(self):
        return f"ModelSpec({len(self.params)} params, {self.size} elements, hash={self.hash()[:8]})"
