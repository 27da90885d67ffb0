"""ModelSpec layout, hashing and JSON, and key-range sharding."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.sharding import chunk_ranges, shard_range, shard_ranges
from psgrid.psserver.spec import ModelSpec, ParamSpec

FAST = settings(max_examples=60, deadline=None)

names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_.0123456789/é", min_size=1, max_size=8)
shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@st.composite
def specs(draw, min_params=1, max_params=6):
    n = draw(st.integers(min_params, max_params))
    keys = draw(st.lists(names, min_size=n, max_size=n, unique=True))
    return ModelSpec([(k, draw(shapes)) for k in keys])


def random_arrays(spec, seed):
    rng = np.random.default_rng(seed)
    return {p.name: rng.standard_normal(p.shape).astype(np.float32) for p in spec.params}


# ----- layout ---------------------------------------------------------------------------------


@given(spec=specs(), seed=st.integers(0, 2**32 - 1))
@FAST
def test_pack_views_round_trip(spec, seed):
    arrays = random_arrays(spec, seed)
    flat = spec.pack(arrays)
    assert flat.dtype == np.float32 and flat.shape == (spec.size,)
    assert spec.size == sum(math.prod(p.shape) for p in spec.params)
    views = spec.views(flat)
    assert list(views) == spec.names
    for p in spec.params:
        assert views[p.name].shape == p.shape
        np.testing.assert_array_equal(views[p.name], arrays[p.name])
        begin, end = spec.offsets[p.name]
        np.testing.assert_array_equal(flat[begin:end], arrays[p.name].ravel())
    # layout is back to back in order
    begin = 0
    for p in spec.params:
        assert spec.offsets[p.name] == (begin, begin + p.size)
        begin += p.size
    assert begin == spec.size


@given(spec=specs(), seed=st.integers(0, 2**32 - 1))
@FAST
def test_views_are_views(spec, seed):
    flat = spec.flat()
    assert not flat.any()
    views = spec.views(flat)
    rng = np.random.default_rng(seed)
    for p in spec.params:
        v = views[p.name]
        assert v.size == 0 or np.shares_memory(v, flat)
        value = rng.standard_normal(p.shape).astype(np.float32)
        v[...] = value
        begin, end = spec.offsets[p.name]
        np.testing.assert_array_equal(flat[begin:end], value.ravel())
    # and writing the flat buffer shows through every view
    flat[:] = np.arange(spec.size, dtype=np.float32)
    for p in spec.params:
        begin, end = spec.offsets[p.name]
        np.testing.assert_array_equal(views[p.name].ravel(), np.arange(begin, end, dtype=np.float32))


def test_scalar_and_empty_params():
    spec = ModelSpec([("s", ()), ("e", (3, 0)), ("m", (2, 2))])
    assert spec.size == 5
    assert spec.offsets == {"s": (0, 1), "e": (1, 1), "m": (1, 5)}
    flat = spec.pack({"s": np.float32(7), "e": np.zeros((3, 0)), "m": np.ones((2, 2))})
    np.testing.assert_array_equal(flat, [7, 1, 1, 1, 1])
    views = spec.views(flat)
    assert views["s"].shape == () and views["e"].shape == (3, 0)
    views["s"][...] = 3
    assert flat[0] == 3


def test_pack_and_views_refuse_bad_input():
    spec = ModelSpec([("a", (2,)), ("b", (3,))])
    with pytest.raises(InvalidArgument):
        spec.pack({"a": np.zeros(2)})
    with pytest.raises(InvalidArgument):
        spec.pack({"a": np.zeros(2), "b": np.zeros(4)})
    with pytest.raises(InvalidArgument):
        spec.pack({"a": np.zeros((2, 1)), "b": np.zeros(3)})
    with pytest.raises(InvalidArgument):
        spec.views(np.zeros(4, np.float32))
    with pytest.raises(InvalidArgument):
        spec.views(np.zeros((5, 1), np.float32))


# ----- hash and JSON --------------------------------------------------------------------------


@given(spec=specs())
@FAST
def test_hash_stable_and_json_round_trip(spec):
    text = spec.to_json()
    again = ModelSpec.from_json(text)
    assert again == spec
    assert hash(again) == hash(spec)
    assert again.hash() == spec.hash()
    assert again.offsets == spec.offsets and again.size == spec.size
    assert ModelSpec(list(spec.params)).hash() == spec.hash()
    assert ModelSpec([(p.name, list(p.shape)) for p in spec.params]).hash() == spec.hash()
    assert len(spec.hash()) == 32 and int(spec.hash(), 16) >= 0


def test_hash_is_pinned():
    # A change here breaks every running job's registration: change it only on purpose.
    spec = ModelSpec([("w", (2, 3)), ("b", (3,))])
    assert spec.to_json() == '[["w", [2, 3], "float32"], ["b", [3], "float32"]]'
    canonical = b'[["w",[2,3],"float32"],["b",[3],"float32"]]'
    assert spec.hash() == hashlib.sha256(canonical).hexdigest()[:32] == "61ec6f99c54286d25c44010fc2561d6b"


@given(spec=specs(), data=st.data())
@FAST
def test_hash_changes_with_name(spec, data):
    i = data.draw(st.integers(0, len(spec.params) - 1))
    new_name = data.draw(names.filter(lambda s: s not in spec.names))
    params = list(spec.params)
    params[i] = ParamSpec(new_name, params[i].shape)
    other = ModelSpec(params)
    assert other.hash() != spec.hash()
    assert other != spec


@given(spec=specs(), data=st.data())
@FAST
def test_hash_changes_with_shape(spec, data):
    i = data.draw(st.integers(0, len(spec.params) - 1))
    new_shape = data.draw(shapes.filter(lambda s: s != spec.params[i].shape))
    params = list(spec.params)
    params[i] = ParamSpec(params[i].name, new_shape)
    other = ModelSpec(params)
    assert other.hash() != spec.hash()
    assert other != spec


@given(spec=specs(min_params=2), data=st.data())
@FAST
def test_hash_changes_with_order(spec, data):
    order = data.draw(st.permutations(range(len(spec.params))).filter(lambda p: list(p) != sorted(p)))
    other = ModelSpec([spec.params[i] for i in order])
    assert other.hash() != spec.hash()
    assert other != spec


def test_hash_distinguishes_shape_from_flattened_and_scalar():
    base = ModelSpec([("a", (2, 3))]).hash()
    assert ModelSpec([("a", (6,))]).hash() != base
    assert ModelSpec([("a", (3, 2))]).hash() != base
    assert ModelSpec([("a", ())]).hash() != ModelSpec([("a", (1,))]).hash()
    assert ModelSpec([("a", (0,))]).hash() != ModelSpec([("a", ())]).hash()


# ----- validation -----------------------------------------------------------------------------


def test_duplicate_names_raise():
    with pytest.raises(InvalidArgument):
        ModelSpec([("a", (1,)), ("b", (2,)), ("a", (1,))])


@pytest.mark.parametrize("shape", [(-1,), (2, -3), (0, -1, 4)])
def test_negative_dims_raise(shape):
    with pytest.raises(InvalidArgument):
        ModelSpec([("a", shape)])


@pytest.mark.parametrize("name", ["", None, 3])
def test_bad_names_raise(name):
    with pytest.raises(InvalidArgument):
        ParamSpec(name, (1,))


@pytest.mark.parametrize("dtype", ["float64", "float16", "int32", "uint8", "bool", "complex64", ">f4"])
def test_non_float32_dtype_raises(dtype):
    with pytest.raises(InvalidArgument):
        ParamSpec("a", (1,), dtype)
    with pytest.raises(InvalidArgument):
        ModelSpec.from_json(f'[["a", [1], "{dtype}"]]')


@pytest.mark.parametrize(
    "dtype", ["bogus", "float33", "tensor", "(-1,)f4", "(99999999999999999,)f4", "(1,2", "f4,(", "(2,)f4", "f4,f4"]
)
def test_unparseable_dtype_raises_invalid_argument(dtype):
    # The dtype travels as a free string in Init's spec (proto ParamSpec.dtype); an unknown one is
    # bad input and must be refused as InvalidArgument (INVALID_ARGUMENT), not leak a TypeError
    # (which the servicer answers as INTERNAL).
    with pytest.raises(InvalidArgument):
        ParamSpec("a", (1,), dtype)


@pytest.mark.parametrize("dtype", ["float32", "f4", "<f4", np.float32])
def test_float32_spellings_normalise(dtype):
    p = ParamSpec("a", [2, 3], dtype)
    assert p.dtype == "float32" and p.shape == (2, 3) and p.size == 6
    assert ModelSpec([p]).hash() == ModelSpec([("a", (2, 3))]).hash()


def test_from_shapes_keeps_order():
    spec = ModelSpec.from_shapes({"z": (2,), "a": (1, 1)})
    assert spec.names == ["z", "a"]
    assert spec.nbytes == 12


# ----- sharding -------------------------------------------------------------------------------


@given(total=st.integers(0, 10**6), num_shards=st.integers(1, 64))
@settings(max_examples=200, deadline=None)
def test_shard_ranges_tile_and_balance(total, num_shards):
    ranges = shard_ranges(total, num_shards)
    assert len(ranges) == num_shards
    assert ranges[0][0] == 0 and ranges[-1][1] == total
    for (_, e0), (b1, _) in zip(ranges, ranges[1:]):
        assert e0 == b1
    sizes = [e - b for b, e in ranges]
    assert all(s >= 0 for s in sizes)
    assert sum(sizes) == total
    assert max(sizes) - min(sizes) <= 1
    for i, r in enumerate(ranges):
        assert shard_range(total, i, num_shards) == r
        assert r == (total * i // num_shards, total * (i + 1) // num_shards)


@pytest.mark.parametrize("total,num_shards", [(0, 1), (0, 64), (1, 64), (63, 64), (64, 64), (10**6, 1), (7, 3)])
def test_shard_ranges_edges(total, num_shards):
    ranges = shard_ranges(total, num_shards)
    covered = [k for b, e in ranges for k in range(b, e)] if total < 1000 else None
    if covered is not None:
        assert covered == list(range(total))


@pytest.mark.parametrize("index,num_shards", [(-1, 4), (4, 4), (5, 4), (0, 0), (0, -1)])
def test_bad_shard_index_or_count_raises(index, num_shards):
    with pytest.raises(InvalidArgument):
        shard_range(100, index, num_shards)


@pytest.mark.parametrize("num_shards", [0, -3])
def test_bad_num_shards_raises_in_shard_ranges(num_shards):
    with pytest.raises(InvalidArgument):
        shard_ranges(100, num_shards)


def test_negative_total_raises():
    with pytest.raises(InvalidArgument):
        shard_range(-1, 0, 1)


@given(begin=st.integers(0, 10**5), length=st.integers(0, 10**4), chunk=st.integers(1, 5000))
@FAST
def test_chunk_ranges_tile(begin, length, chunk):
    end = begin + length
    pieces = chunk_ranges(begin, end, chunk)
    assert pieces[0][0] == begin and pieces[-1][1] == end
    for (_, e0), (b1, _) in zip(pieces, pieces[1:]):
        assert e0 == b1
    assert all(0 < e - b <= chunk for b, e in pieces) or pieces == [(begin, begin)]
    assert len(pieces) == max(1, -(-length // chunk))


@pytest.mark.parametrize("chunk", [0, -1])
def test_chunk_ranges_bad_size_raises(chunk):
    with pytest.raises(InvalidArgument):
        chunk_ranges(0, 10, chunk)
