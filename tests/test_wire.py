"""Chunk payloads: float32 exact, float16 and bfloat16 rounding, special values, validation."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from psgrid.psserver import dtypes as wire
from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.rpc import ps_pb2

FAST = settings(max_examples=80, deadline=None)
F32, F16, BF16 = ps_pb2.FLOAT32, ps_pb2.FLOAT16, ps_pb2.BFLOAT16


def round_trip(values, dtype):
    data = wire.encode(values, dtype)
    n = wire.element_count(data, dtype)
    assert n == values.size
    out = np.full(n, 12345.0, dtype=np.float32)
    wire.decode_into(out, data, dtype)
    return data, out


def bits_of(values):
    return np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)


def bf16_reference(bits: int) -> int:
    """Round-to-nearest-even of a binary32 bit pattern to its upper 16 bits, one element at a time."""
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    if exponent == 0xFF and mantissa:
        return -1  # NaN: any NaN pattern will do
    upper, lower = bits >> 16, bits & 0xFFFF
    if lower > 0x8000 or (lower == 0x8000 and upper & 1):
        upper += 1  # carries into the exponent correctly, up to infinity
    return upper


def check_bf16(values):
    values = np.asarray(values, dtype=np.float32)
    data, out = round_trip(values, BF16)
    assert len(data) == 2 * values.size
    wire_bits = np.frombuffer(data, dtype="<u2")
    out_bits = out.view(np.uint32)
    for x, b, w, o in zip(values.tolist(), bits_of(values).tolist(), wire_bits.tolist(), out_bits.tolist()):
        ref = bf16_reference(b)
        if ref < 0:
            assert np.isnan(np.float32(x))
            assert (w & 0x7F80) == 0x7F80 and (w & 0x7F), f"NaN {b:#010x} encoded as non-NaN {w:#06x}"
            assert np.isnan(np.uint32(o).view(np.float32))
        else:
            assert w == ref, f"{x!r} ({b:#010x}) encoded as {w:#06x}, expected {ref:#06x}"
            assert o == ref << 16


# ----- float32 --------------------------------------------------------------------------------


@given(hnp.arrays(np.float32, st.integers(0, 300), elements=st.floats(width=32, allow_nan=False)))
@FAST
def test_float32_round_trip_exact(values):
    data, out = round_trip(values, F32)
    assert data == values.astype("<f4").tobytes()
    np.testing.assert_array_equal(out.view(np.uint32), values.view(np.uint32))


def test_float32_special_values_and_layout():
    values = np.array([1.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, np.finfo(np.float32).max], np.float32)
    data, out = round_trip(values, F32)
    assert data[:4] == b"\x00\x00\x80\x3f"  # little-endian on the wire
    np.testing.assert_array_equal(out, values)  # NaN == NaN for assert_array_equal
    assert np.signbit(out[1])


def test_float32_encode_converts_other_dtypes_and_strides():
    values = np.arange(10, dtype=np.float64) / 3
    data, out = round_trip(values[::2], F32)
    np.testing.assert_array_equal(out, values[::2].astype(np.float32))
    big_endian = np.arange(5, dtype=">f4")
    assert wire.encode(big_endian, F32) == np.arange(5, dtype="<f4").tobytes()


# ----- float16 --------------------------------------------------------------------------------


@given(hnp.arrays(np.float32, st.integers(0, 300), elements=st.floats(-65504, 65504, width=32)))
@FAST
def test_float16_round_trip_within_rounding(values):
    data, out = round_trip(values, F16)
    assert len(data) == 2 * values.size
    expected = values.astype(np.float16).astype(np.float32)
    np.testing.assert_array_equal(out, expected)
    # error at most half a float16 ulp: 2**-11 relative for normals, 2**-25 absolute for subnormals
    err = np.abs(out.astype(np.float64) - values.astype(np.float64))
    bound = np.maximum(np.abs(values.astype(np.float64)) * 2.0**-11, 2.0**-25)
    assert np.all(err <= bound)


def test_float16_special_values():
    values = np.array([np.nan, np.inf, -np.inf, -0.0, 65504.0, 2.0**-24], np.float32)
    data, out = round_trip(values, F16)
    assert np.isnan(out[0])
    assert out[1] == np.inf and out[2] == -np.inf
    assert out[3] == 0 and np.signbit(out[3])
    assert out[4] == 65504.0 and out[5] == 2.0**-24
    assert wire.encode(np.array([1.0], np.float32), F16) == b"\x00\x3c"


def test_float16_ties_to_even():
    # 1 + 2**-11 lies halfway between 1 and 1 + 2**-10: ties go to the even mantissa (1.0)
    values = np.array([1 + 2.0**-11, 1 + 3 * 2.0**-11, -(1 + 2.0**-11)], np.float32)
    _, out = round_trip(values, F16)
    np.testing.assert_array_equal(out, [1.0, 1 + 2 * 2.0**-10, -1.0])


# ----- bfloat16 -------------------------------------------------------------------------------


@given(st.lists(st.integers(0, 2**32 - 1), min_size=0, max_size=200))
@FAST
def test_bfloat16_matches_reference_on_any_bit_pattern(patterns):
    check_bf16(np.array(patterns, dtype=np.uint32).view(np.float32))


@given(
    upper=st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=100),
    lower=st.sampled_from([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF]),
)
@FAST
def test_bfloat16_ties_and_neighbours(upper, lower):
    patterns = (np.array(upper, dtype=np.uint32) << 16) | np.uint32(lower)
    check_bf16(patterns.view(np.float32))


@given(hnp.arrays(np.float32, st.integers(0, 300), elements=st.floats(width=32, allow_nan=False, allow_infinity=False)))
@FAST
def test_bfloat16_is_nearest(values):
    """Independently of bit tricks: the result is a nearest bfloat16, the even one on a tie."""
    _, out = round_trip(values, BF16)
    for x, b, g in zip(values.astype(np.float64).tolist(), bits_of(values).tolist(), out.astype(np.float64).tolist()):
        lo_bits = b & 0xFFFF0000  # the bfloat16 neighbour toward zero
        hi_bits = lo_bits + 0x10000  # and the one away from zero (may be infinity)
        lo = float(np.uint32(lo_bits).view(np.float32))
        hi = float(np.uint32(hi_bits).view(np.float32))
        if x == lo:
            assert g == x
            continue
        assert g in (lo, hi), (x, g, lo, hi)
        # for distances, infinity stands where the next binade would start (2**128), as IEEE rounding has it
        hi_d = hi if np.isfinite(hi) else np.copysign(2.0**128, x)
        d_lo, d_hi = abs(x - lo), abs(hi_d - x)
        if d_lo != d_hi:
            assert g == (lo if d_lo < d_hi else hi), (x, g)
        else:  # tie: the even bfloat16 (last kept mantissa bit clear)
            g_bits = lo_bits if g == lo else hi_bits
            assert (g_bits >> 16) & 1 == 0, (x, g)


def test_bfloat16_explicit_ties():
    one = 0x3F800000
    cases = {
        one: 0x3F80,  # 1.0 exact
        one | 0x8000: 0x3F80,  # 1 + 2**-8: tie, 0x3F80 is even -> stays
        0x3F818000: 0x3F82,  # tie, 0x3F81 is odd -> rounds up to even
        0x3F808001: 0x3F81,  # just above the tie -> up
        0x3F807FFF: 0x3F80,  # just below the tie -> down
        0xBF808000: 0xBF80,  # negative tie, even -> stays (magnitude)
        0xBF818000: 0xBF82,  # negative tie, odd -> magnitude up
        0x7F7FFFFF: 0x7F80,  # float32 max rounds to +inf
        0xFF7FFFFF: 0xFF80,  # and -max to -inf
        0x7F7F8000: 0x7F80,  # tie at the top, 0x7F7F odd -> inf
        0x00008000: 0x0000,  # subnormal tie, even -> 0
        0x00018000: 0x0002,  # subnormal tie, odd -> up
        0x80000000: 0x8000,  # -0.0 keeps its sign
        0x007FFFFF: 0x0080,  # largest subnormal rounds up to the smallest normal
    }
    patterns = np.array(list(cases), dtype=np.uint32)
    data = wire.encode(patterns.view(np.float32), BF16)
    assert np.frombuffer(data, "<u2").tolist() == list(cases.values())
    check_bf16(patterns.view(np.float32))


def test_bfloat16_nan_stays_nan_and_inf_stays_inf():
    patterns = np.array(
        [
            0x7FC00000,  # quiet NaN
            0xFFC00000,  # negative quiet NaN
            0x7F800001,  # signalling NaN whose payload is only in the low half: truncation would make it inf
            0x7F80FFFF,  # rounding would carry the payload into ... still NaN
            0x7FFFFFFF,  # rounding would overflow the exponent
            0xFFFFFFFF,  # and the 32-bit word
            0x7F800000,  # +inf
            0xFF800000,  # -inf
        ],
        dtype=np.uint32,
    )
    values = patterns.view(np.float32)
    data, out = round_trip(values, BF16)
    assert np.isnan(out[:6]).all()
    assert out[6] == np.inf and out[7] == -np.inf
    check_bf16(values)


def test_bfloat16_does_not_touch_input_and_accepts_strides_and_float64():
    values = np.array([1.00390625, 2.5, -3.14159, 1e-3], np.float32)
    before = values.copy()
    wire.encode(values, BF16)
    np.testing.assert_array_equal(values.view(np.uint32), before.view(np.uint32))
    base = np.linspace(-5, 5, 21, dtype=np.float32)
    assert wire.encode(base[::3], BF16) == wire.encode(base[::3].copy(), BF16)
    assert wire.encode(base.astype(np.float64), BF16) == wire.encode(base, BF16)
    assert wire.encode(np.array([1.0], np.float32), BF16) == b"\x80\x3f"


def test_decode_into_a_slice_of_a_larger_buffer():
    buffer = np.zeros(10, np.float32)
    values = np.array([1.5, -2.0, 3.25], np.float32)
    for dtype in (F32, F16, BF16):
        buffer[:] = 0
        wire.decode_into(buffer[4:7], wire.encode(values, dtype), dtype)
        np.testing.assert_array_equal(buffer, [0, 0, 0, 0, 1.5, -2.0, 3.25, 0, 0, 0])


# ----- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype,nbytes", [(F32, 1), (F32, 2), (F32, 3), (F32, 7), (F16, 1), (F16, 5), (BF16, 1), (BF16, 9)]
)
def test_element_count_rejects_partial_elements(dtype, nbytes):
    with pytest.raises(InvalidArgument):
        wire.element_count(b"\x00" * nbytes, dtype)


@pytest.mark.parametrize("dtype,nbytes,count", [(F32, 0, 0), (F32, 8, 2), (F16, 6, 3), (BF16, 2, 1)])
def test_element_count(dtype, nbytes, count):
    assert wire.element_count(b"\x00" * nbytes, dtype) == count


@pytest.mark.parametrize("dtype", [ps_pb2.DTYPE_UNSPECIFIED, 0, 4, 99, -1])
def test_unknown_dtype_rejected(dtype):
    with pytest.raises(InvalidArgument):
        wire.element_count(b"\x00" * 4, dtype)
    with pytest.raises(InvalidArgument):
        wire.encode(np.zeros(1, np.float32), dtype)
    with pytest.raises(InvalidArgument):
        wire.decode_into(np.zeros(1, np.float32), b"\x00" * 4, dtype)


def test_wire_dtype_names():
    assert wire.wire_dtype("float32") == F32
    assert wire.wire_dtype("float16") == F16
    assert wire.wire_dtype("bfloat16") == BF16
    for bad in ("float64", "bf16", "", "FLOAT32"):
        with pytest.raises(InvalidArgument):
            wire.wire_dtype(bad)
