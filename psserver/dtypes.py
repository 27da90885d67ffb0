"""Chunks on the wire: raw little-endian bytes of float32, float16 or bfloat16.

Encoding copies once (``tobytes``); decoding reads with ``numpy.frombuffer`` (no
copy) and converts straight into the caller's float32 buffer.
"""

from __future__ import annotations

import numpy as np

from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.protocol import BFLOAT16, FLOAT16, FLOAT32, ITEMSIZE, WIRE_DTYPES, Reason

__all__ = ["ITEMSIZE", "WIRE_DTYPES", "all_finite", "decode_into", "element_count", "encode", "wire_dtype"]
_LE_F32 = np.dtype("<f4")
_LE_F16 = np.dtype("<f2")
_LE_U16 = np.dtype("<u2")
F16_MAX = float(np.finfo(np.float16).max)


def wire_dtype(name: str) -> int:
    try:
        return WIRE_DTYPES[name]
    except KeyError:
        raise InvalidArgument(
            f"wire dtype must be one of {sorted(WIRE_DTYPES)}, got {name!r}", Reason.BAD_DTYPE
        ) from None


def encode(values: np.ndarray, dtype: int) -> bytes:
    """Raw bytes of a float32 array in the wire dtype (round to nearest even for bfloat16)."""
    if dtype == FLOAT32:
        return values.astype(_LE_F32, copy=False).tobytes()
    if dtype == FLOAT16:
        # Saturate finite values past float16's range instead of turning them into infinities,
        # which the shard would refuse; a true infinity or NaN still travels as one (and is refused).
        saturated = np.where(np.isinf(values), values, np.clip(values, -F16_MAX, F16_MAX))
        return saturated.astype(_LE_F16).tobytes()
    if dtype == BFLOAT16:
        bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
        rounded = (bits + (0x7FFF + ((bits >> 16) & 1))) >> 16
        # NaN must stay NaN: rounding can carry a NaN's payload into the exponent.
        nan = np.isnan(values)
        if nan.any():
            rounded[nan] = 0x7FC0
        return rounded.astype(_LE_U16).tobytes()
    raise InvalidArgument(f"unknown wire dtype {dtype}", Reason.BAD_DTYPE)


FINITE_BLOCK = 1 << 16


def all_finite(values: np.ndarray) -> bool:
    """Whether every value is finite, checked a block at a time so the boolean temporary stays small."""
    for start in range(0, len(values), FINITE_BLOCK):
        if not np.isfinite(values[start : start + FINITE_BLOCK]).all():
            return False
    return True


def element_count(data: bytes, dtype: int) -> int:
    size = ITEMSIZE.get(dtype)
    if size is None:
        raise InvalidArgument(f"unknown or unspecified chunk dtype {dtype}", Reason.BAD_DTYPE)
    if len(data) % size:
        raise InvalidArgument(
            f"chunk of {len(data)} bytes is not a whole number of {size}-byte elements", Reason.BAD_SIZE
        )
    return len(data) // size


def decode_into(out: np.ndarray, data: bytes, dtype: int) -> None:
    """Write the chunk's elements, converted to float32, into ``out`` (same length)."""
    if dtype == FLOAT32:
        out[...] = np.frombuffer(data, dtype=_LE_F32)
    elif dtype == FLOAT16:
        out[...] = np.frombuffer(data, dtype=_LE_F16)
    elif dtype == BFLOAT16:
        bits = out.view(np.uint32)
        np.left_shift(np.frombuffer(data, dtype=_LE_U16), 16, out=bits, dtype=np.uint32)
    else:
        raise InvalidArgument(f"unknown chunk dtype {dtype}", Reason.BAD_DTYPE)
