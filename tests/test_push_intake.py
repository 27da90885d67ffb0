"""The push intake (service.py), driven without sockets: every plane's fill method, one finiteness rule."""

from __future__ import annotations

import numpy as np
import pytest

from psgrid.psserver import dtypes
from psgrid.psserver.config import ServerConfig
from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.kernels import optim, parallel
from psgrid.psserver.protocol import BFLOAT16, FLOAT16, FLOAT32, Outcome, Reason
from psgrid.psserver.service import ShardService
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.state.shard import Shard
from psgrid.psserver.transports.shm_server import SharedSegment

SPEC = ModelSpec([("w", (100,)), ("b", (7,))])
MODES = ["sync", "ssp", "async"]


def started(mode: str, **settings) -> tuple[ShardService, int]:
    service = ShardService(Shard(ServerConfig(mode=mode, shared_memory=False, **settings)))
    service.shard.init(SPEC, np.zeros(SPEC.size, np.float32))
    worker = service.register(spec_hash=SPEC.hash(), worker_id=-1, start_clock=-1, host="here").worker_id
    return service, worker


def by_chunks(service, worker, values, dtype=FLOAT32, chunk=40):
    """The gRPC streams' way: chunks that tile the range in order."""
    data = dtypes.encode(values, dtype)
    size = len(data) // len(values)
    with service.open_push(worker_id=worker, clock=0, version=0) as intake:
        for start in range(0, len(values), chunk):
            intake.add_chunk(start, dtype, data[start * size : (start + chunk) * size])
        return intake.commit((len(values) + chunk - 1) // chunk)


def at_once(service, worker, values, dtype=FLOAT32):
    """The TCP plane's way: the whole range into one landing."""
    data = dtypes.encode(values, dtype)
    with service.open_push(worker_id=worker, clock=0, version=0) as intake:
        intake.landing(dtype, len(data))[:] = data
        intake.landed()
        return intake.commit()


def in_place(service, worker, values, dtype=FLOAT32):
    """The shared-memory plane's way: the worker's own memory, handed over whole and read where it lies."""
    segment = np.frombuffer(dtypes.encode(values, dtype), "<f4" if dtype == FLOAT32 else "<u2")
    return service.push(worker_id=worker, clock=0, version=0, source=SharedSegment(dtype, segment))


FILLS = {"chunks": by_chunks, "landing": at_once, "shared": in_place}


@pytest.fixture
def checked(monkeypatch) -> list[int]:
    """Elements read for NaN and infinity, by whichever check reads them (the intake's or the update's)."""
    seen: list[int] = []
    plain, fused = dtypes.all_finite, optim._checked

    def counting(values):
        seen.append(len(values))
        return plain(values)

    def counting_blocks(blocks, grad):
        for block in fused(blocks, grad):
            seen.append(len(grad[block[0]]))
            yield block

    monkeypatch.setattr(dtypes, "all_finite", counting)
    if hasattr(parallel, "all_finite"):
        monkeypatch.setattr(parallel, "all_finite", counting)
    monkeypatch.setattr(optim, "_checked", counting_blocks)
    return seen


@pytest.mark.parametrize("dtype", [FLOAT32, FLOAT16, BFLOAT16], ids=["f32", "f16", "bf16"])
@pytest.mark.parametrize("fill", FILLS)
@pytest.mark.parametrize("mode", MODES)
def test_a_gradient_is_read_for_nan_once_per_push_whatever_the_plane_and_mode(checked, mode, fill, dtype):
    service, worker = started(mode)
    result = FILLS[fill](service, worker, np.full(SPEC.size, 0.5, np.float32), dtype)
    assert result.outcome is Outcome.APPLIED
    assert sum(checked) == SPEC.size, f"{mode} {fill}: {checked}"


@pytest.mark.parametrize("fill", FILLS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [np.nan, np.inf], ids=["nan", "inf"])
def test_a_non_finite_gradient_is_refused_on_every_plane_and_changes_nothing(mode, fill, bad):
    service, worker = started(mode)
    shard = service.shard
    before = shard.weights.copy()
    values = np.full(SPEC.size, 0.5, np.float32)
    values[73] = bad
    for dtype in (FLOAT32, FLOAT16):
        with pytest.raises(InvalidArgument) as refused:
            FILLS[fill](service, worker, values, dtype)
        assert refused.value.reason is Reason.NON_FINITE
    assert (shard.version, shard.policy.clocks[worker]) == (0, 0)
    np.testing.assert_array_equal(shard.weights, before)
    assert shard.pool.on_loan == 0 and service.half_pool().on_loan == 0
    assert FILLS[fill](service, worker, np.full(SPEC.size, 0.5, np.float32)).outcome is Outcome.APPLIED


@pytest.mark.parametrize("fill", FILLS)
def test_a_sync_round_keeps_a_pooled_gradient_and_never_the_workers_own_memory(fill):
    service, first = started("sync")
    second = service.register(spec_hash=SPEC.hash(), worker_id=-1, start_clock=-1, host="here").worker_id
    pool = service.shard.pool
    own = np.full(SPEC.size, 2.0, np.float32)
    if fill == "shared":  # the segment is the worker's memory itself
        pushed = service.push(worker_id=first, clock=0, version=0, source=SharedSegment(FLOAT32, own))
    else:
        pushed = FILLS[fill](service, first, own)
    assert pushed.outcome is Outcome.ACCUMULATED
    assert pool.on_loan == 1  # held for the round: a pooled buffer, the worker's own copied
    own[:] = 1e6  # the worker may write its memory once answered
    assert FILLS[fill](service, second, np.zeros(SPEC.size, np.float32)).outcome is Outcome.APPLIED
    assert pool.on_loan == 0
    lr = service.shard.config.lr
    np.testing.assert_allclose(service.shard.weights, np.full(SPEC.size, -lr * 1.0, np.float32), rtol=1e-6)


def test_the_shared_plane_refuses_a_wrong_dtype_or_size_before_it_reads():
    service, worker = started("sync")
    with pytest.raises(InvalidArgument) as refused:
        service.push(worker_id=worker, clock=0, version=0, source=SharedSegment(99, np.zeros(SPEC.size, np.float32)))
    assert refused.value.reason is Reason.BAD_DTYPE
    with pytest.raises(InvalidArgument) as refused:
        service.push(
            worker_id=worker, clock=0, version=0, source=SharedSegment(FLOAT32, np.zeros(SPEC.size - 1, np.float32))
        )
    assert refused.value.reason is Reason.BAD_SIZE
    assert service.shard.policy.clocks[worker] == 0 and service.shard.pool.on_loan == 0
