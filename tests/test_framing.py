"""psserver.framing speaks exactly the protobuf encoding of PullReply and PushRequest.

Encoded frames parse with the generated classes to the same fields (and the
same bytes), protobuf-serialized messages decode to the same fields with the
payload as a view into the received buffer (no copy), and malformed bytes are
refused with InvalidArgument.
"""

from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.rpc import ps_pb2
from psgrid.psserver.transports import grpc_codec as framing

INT64 = st.integers(-(1 << 63), (1 << 63) - 1)
UINT64 = st.integers(0, (1 << 64) - 1)
UINT32 = st.integers(0, (1 << 32) - 1)
DTYPES = st.sampled_from([ps_pb2.DTYPE_UNSPECIFIED, ps_pb2.FLOAT32, ps_pb2.FLOAT16, ps_pb2.BFLOAT16])
PAYLOADS = st.binary(min_size=0, max_size=300)
FEW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def pb_chunk(offset, dtype, data):
    return ps_pb2.Chunk(offset=offset, dtype=dtype, data=bytes(data))


def assert_chunk_equal(view, pb):
    assert view.offset == pb.offset
    assert view.dtype == pb.dtype
    assert bytes(view.data) == pb.data


# ----- framing -> protobuf ------------------------------------------------------------------------


@pytest.mark.timeout(30)
@FEW
@given(version=UINT64, num_chunks=UINT32, offset=UINT64, dtype=DTYPES, data=PAYLOADS)
def test_encoded_pull_reply_parses_with_protobuf(version, num_chunks, offset, dtype, data):
    frame = framing.PullFrame(
        version=version,
        num_chunks=num_chunks,
        chunk=framing.ChunkView(offset=offset, dtype=dtype, data=memoryview(data)),
    )
    wire = framing.encode_pull_reply(frame)
    msg = ps_pb2.PullReply.FromString(wire)
    assert (msg.version, msg.num_chunks) == (version, num_chunks)
    assert_chunk_equal(frame.chunk, msg.chunk)
    assert msg.HasField("chunk")
    # Not just compatible: the very bytes protobuf itself would send.
    expected = ps_pb2.PullReply(version=version, num_chunks=num_chunks, chunk=pb_chunk(offset, dtype, data))
    assert wire == expected.SerializeToString()


@pytest.mark.timeout(30)
@FEW
@given(worker_id=INT64, clock=INT64, version=UINT64, num_chunks=UINT32, offset=UINT64, dtype=DTYPES, data=PAYLOADS)
def test_encoded_push_request_parses_with_protobuf(worker_id, clock, version, num_chunks, offset, dtype, data):
    frame = framing.PushFrame(
        worker_id=worker_id,
        clock=clock,
        version=version,
        num_chunks=num_chunks,
        chunk=framing.ChunkView(offset=offset, dtype=dtype, data=data),
    )
    wire = framing.encode_push_request(frame)
    msg = ps_pb2.PushRequest.FromString(wire)
    assert (msg.worker_id, msg.clock, msg.version, msg.num_chunks) == (worker_id, clock, version, num_chunks)
    assert_chunk_equal(frame.chunk, msg.chunk)
    expected = ps_pb2.PushRequest(
        worker_id=worker_id, clock=clock, version=version, num_chunks=num_chunks, chunk=pb_chunk(offset, dtype, data)
    )
    assert wire == expected.SerializeToString()


@pytest.mark.timeout(10)
def test_negative_worker_id_and_zeros_omitted():
    frame = framing.PushFrame(
        worker_id=-1, clock=0, version=0, num_chunks=0, chunk=framing.ChunkView(offset=0, dtype=0, data=b"")
    )
    wire = framing.encode_push_request(frame)
    msg = ps_pb2.PushRequest.FromString(wire)
    assert msg.worker_id == -1
    assert (msg.clock, msg.version, msg.num_chunks) == (0, 0, 0)
    assert msg.HasField("chunk") and msg.chunk.data == b"" and msg.chunk.offset == 0
    # worker_id -1 is a ten-byte varint; clock, version and num_chunks (all zero) are not on the wire;
    # the chunk is present but empty.
    assert wire == b"\x08" + b"\xff" * 9 + b"\x01" + b"\x2a\x00"
    # A pull reply with only a chunk: version and num_chunks are omitted as protobuf omits them.
    wire = framing.encode_pull_reply(framing.PullFrame(chunk=framing.ChunkView(offset=3, dtype=1, data=b"abcd")))
    assert wire == ps_pb2.PullReply(chunk=pb_chunk(3, 1, b"abcd")).SerializeToString()
    assert wire[0] == (3 << 3) | 2  # the chunk is the first field


# ----- protobuf -> framing ------------------------------------------------------------------------


@pytest.mark.timeout(30)
@FEW
@given(version=UINT64, num_chunks=UINT32, offset=UINT64, dtype=DTYPES, data=PAYLOADS)
def test_protobuf_pull_reply_decodes_without_copy(version, num_chunks, offset, dtype, data):
    wire = ps_pb2.PullReply(
        version=version, num_chunks=num_chunks, chunk=pb_chunk(offset, dtype, data)
    ).SerializeToString()
    frame = framing.decode_pull_reply(wire)
    assert (frame.version, frame.num_chunks) == (version, num_chunks)
    assert (frame.chunk.offset, frame.chunk.dtype, bytes(frame.chunk.data)) == (offset, dtype, data)
    if data:
        assert isinstance(frame.chunk.data, memoryview)
        assert frame.chunk.data.obj is wire  # a view into the received bytes, not a copy


@pytest.mark.timeout(30)
@FEW
@given(worker_id=INT64, clock=INT64, version=UINT64, num_chunks=UINT32, offset=UINT64, dtype=DTYPES, data=PAYLOADS)
def test_protobuf_push_request_decodes_without_copy(worker_id, clock, version, num_chunks, offset, dtype, data):
    wire = ps_pb2.PushRequest(
        worker_id=worker_id, clock=clock, version=version, num_chunks=num_chunks, chunk=pb_chunk(offset, dtype, data)
    ).SerializeToString()
    frame = framing.decode_push_request(wire)
    assert (frame.worker_id, frame.clock, frame.version, frame.num_chunks) == (worker_id, clock, version, num_chunks)
    assert (frame.chunk.offset, frame.chunk.dtype, bytes(frame.chunk.data)) == (offset, dtype, data)
    if data:
        assert isinstance(frame.chunk.data, memoryview)
        assert frame.chunk.data.obj is wire


@pytest.mark.timeout(10)
def test_decode_defaults_and_negative_ids():
    frame = framing.decode_push_request(ps_pb2.PushRequest(worker_id=-1, clock=-5).SerializeToString())
    assert (frame.worker_id, frame.clock, frame.version, frame.num_chunks) == (-1, -5, 0, 0)
    assert frame.chunk.data == b"" and frame.chunk.offset == 0
    frame = framing.decode_pull_reply(b"")
    assert (frame.version, frame.num_chunks, frame.chunk.offset, frame.chunk.dtype) == (0, 0, 0, 0)
    assert bytes(frame.chunk.data) == b""


@pytest.mark.timeout(10)
def test_unknown_fields_are_skipped_like_protobuf():
    # A newer peer may add fields; both parsers skip them (varint, fixed64, fixed32 and bytes).
    extra = (
        b"\x30\x07"  # field 6 varint
        + b"\x39"
        + b"\x01" * 8  # field 7 fixed64
        + b"\x45"
        + b"\x02" * 4  # field 8 fixed32
        + b"\x4a\x03xyz"
    )  # field 9 bytes
    wire = ps_pb2.PushRequest(worker_id=4, clock=2, chunk=pb_chunk(0, 1, b"\0" * 8)).SerializeToString() + extra
    msg = ps_pb2.PushRequest.FromString(wire)
    frame = framing.decode_push_request(wire)
    assert (frame.worker_id, frame.clock) == (msg.worker_id, msg.clock) == (4, 2)
    assert bytes(frame.chunk.data) == msg.chunk.data


# ----- malformed bytes ----------------------------------------------------------------------------


def _good_push() -> bytes:
    return ps_pb2.PushRequest(
        worker_id=3, clock=300, version=9, num_chunks=1, chunk=pb_chunk(1000, 1, b"\x01" * 64)
    ).SerializeToString()


MALFORMED = {
    "truncated varint value": b"\x10\xac",  # clock = continuation byte then nothing
    "truncated key": b"\x80",
    "overlong varint": b"\x08" + b"\xff" * 11 + b"\x01",
    "length past end": b"\x2a\x10" + b"\x00" * 4,  # chunk of 16 bytes, 4 present
    # chunk.data claims 16 bytes inside a 4-byte chunk (the chunk is field 5 of a push, field 3 of a pull)
    "nested length past end": {"push": b"\x2a\x04\x1a\x10\x00\x00", "pull": b"\x1a\x04\x1a\x10\x00\x00"},
    "truncated fixed64": b"\x39\x01\x02",  # unknown field 7, fixed64 with 2 of 8 bytes
    "truncated fixed32": b"\x45\x01",  # unknown field 8, fixed32 with 1 of 4 bytes
    "bad wire type": b"\x0b\x00",  # wire type 3 (start group) is not proto3
    "cut in the middle": _good_push()[:-10],
    "cut after the key": _good_push()[:8],  # the chunk key, no length
}


@pytest.mark.timeout(10)
@pytest.mark.parametrize("case", sorted(MALFORMED))
@pytest.mark.parametrize(
    "decode, message",
    [(framing.decode_push_request, ps_pb2.PushRequest), (framing.decode_pull_reply, ps_pb2.PullReply)],
    ids=["push", "pull"],
)
def test_malformed_bytes_raise_invalid_argument(case, decode, message):
    data = MALFORMED[case]
    if isinstance(data, dict):
        data = data["push" if message is ps_pb2.PushRequest else "pull"]
    with pytest.raises(InvalidArgument):
        decode(data)
    with pytest.raises(DecodeError):  # protobuf agrees that these are not messages
        message.FromString(data)


@pytest.mark.timeout(30)
@FEW
@given(cut=st.integers(1, 200))
def test_every_truncation_is_refused_or_a_prefix_protobuf_also_reads(cut):
    wire = _good_push()
    data = wire[: max(0, len(wire) - cut)]
    try:
        msg = ps_pb2.PushRequest.FromString(data)
    except Exception:  # noqa: BLE001 - protobuf refuses: so must framing
        with pytest.raises(InvalidArgument):
            framing.decode_push_request(data)
    else:
        frame = framing.decode_push_request(data)
        assert (frame.worker_id, frame.clock, frame.version, frame.num_chunks) == (
            msg.worker_id,
            msg.clock,
            msg.version,
            msg.num_chunks,
        )
        assert bytes(frame.chunk.data) == msg.chunk.data


# ----- any well-formed field soup decodes as protobuf decodes it ----------------------------------


def _raw_varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


CHUNK_FIELDS = st.lists(
    st.tuples(st.integers(1, 4), st.sampled_from([0, 1, 2, 5]), st.integers(0, (1 << 70) - 1), st.binary(max_size=12)),
    max_size=4,
)


def _soup(fields, nested) -> bytes:
    """Raw protobuf: each (field, wire type, int, bytes) encoded with that wire type, whatever the schema says."""
    out = b""
    for i, (field, wire_type, number, blob) in enumerate(fields):
        out += _raw_varint((field << 3) | wire_type)
        if wire_type == 0:
            out += _raw_varint(number)  # may be past 64 bits: protobuf keeps the low 64
        elif wire_type == 1:
            out += (number & ((1 << 64) - 1)).to_bytes(8, "little")
        elif wire_type == 5:
            out += (number & 0xFFFFFFFF).to_bytes(4, "little")
        else:
            body = _soup(nested[i % len(nested)], [[]]) if nested and number % 2 else blob
            out += _raw_varint(len(body)) + body
    return out


@pytest.mark.timeout(60)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fields=st.lists(
        st.tuples(
            st.integers(1, 6), st.sampled_from([0, 1, 2, 5]), st.integers(0, (1 << 70) - 1), st.binary(max_size=12)
        ),
        max_size=8,
    ),
    nested=st.lists(CHUNK_FIELDS, min_size=1, max_size=3),
)
def test_field_soup_decodes_like_protobuf(fields, nested):
    """Wrong wire types are unknown fields, repeated chunks merge, oversized varints are cut, as in protobuf."""
    data = _soup(fields, nested)
    for decode, message, header in (
        (framing.decode_push_request, ps_pb2.PushRequest, ("worker_id", "clock", "version", "num_chunks")),
        (framing.decode_pull_reply, ps_pb2.PullReply, ("version", "num_chunks")),
    ):
        try:
            msg = message.FromString(data)
        except DecodeError:
            with pytest.raises(InvalidArgument):
                decode(data)
            continue
        frame = decode(data)
        assert tuple(getattr(frame, k) for k in header) == tuple(getattr(msg, k) for k in header)
        assert (frame.chunk.offset, frame.chunk.dtype, bytes(frame.chunk.data)) == (
            msg.chunk.offset,
            msg.chunk.dtype,
            msg.chunk.data,
        )


# ----- on a live shard ----------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["grpc"])
def test_shard_refuses_malformed_push_frames_as_bad_input_and_takes_protobuf_ones(cluster):
    import grpc
    import numpy as np

    from psgrid.psserver.spec import ModelSpec

    spec = ModelSpec([("w", (10,))])
    c = cluster(1, mode="async", lr=1.0)
    shard = c.shard()
    worker = c.client(spec, init=spec.flat()).join().worker_id
    with grpc.insecure_channel(c.addresses[0]) as channel:
        raw_push = channel.stream_unary("/ps.ParameterServer/Push")  # bytes in, bytes out
        good = ps_pb2.PushRequest(
            worker_id=worker,
            clock=0,
            version=0,
            num_chunks=1,
            chunk=pb_chunk(0, ps_pb2.FLOAT32, np.ones(10, "<f4").tobytes()),
        )
        for case, data in sorted(MALFORMED.items()):
            if isinstance(data, dict):
                data = data["push"]
            with pytest.raises(grpc.RpcError) as err:
                raw_push(iter([data]), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (case, err.value.details())
            # a malformed second frame after a good first one is refused as well
            with pytest.raises(grpc.RpcError) as err:
                raw_push(iter([good.SerializeToString(), data]), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
        assert shard.version == 0 and shard.counters.pushes == 0
        assert shard.stats()["rejected"] == 2 * len(MALFORMED)
        np.testing.assert_array_equal(shard.weights, 0.0)
        # A message serialized by protobuf itself (any generated client) is taken.
        reply = ps_pb2.PushReply.FromString(raw_push(iter([good.SerializeToString()]), timeout=5))
        assert reply.outcome == ps_pb2.PushReply.APPLIED and reply.version == 1
        np.testing.assert_array_equal(shard.weights, -1.0)
