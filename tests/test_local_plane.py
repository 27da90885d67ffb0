"""The in-process plane: a worker that hosts its shard calls it (transports/local_server.py, local_client.py).

The plane is offered only by a shard started with ``in_process_clients``, chosen only by a client
of the same process, and a push on it is read where it lies: a sync round that stays open keeps a
copy, so the caller may write its gradient again once answered.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from psgrid.psserver.client.client import Client
from psgrid.psserver.config import ServerConfig
from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.protocol import Outcome, Reason
from psgrid.psserver.server import serve
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.transports.local_gradient import CallerArray
from psgrid.psserver.transports.local_registry import hosted_service
from tests.support import REGRESSION, make_problem, regression_grad, run_threads

SPEC = ModelSpec([("w", (1000,)), ("b", (10,))])
LR = 0.5


@pytest.fixture
def hosted():
    """``hosted(**settings)``: shards of this process that serve it by calls; stopped after the test."""
    started = []

    def start(num_shards: int = 1, in_process: bool = True, **settings):
        settings.setdefault("job_id", "local-plane")
        servers = [
            serve(
                ServerConfig(shard_index=i, num_shards=num_shards, host="127.0.0.1", port=0, lr=LR, **settings),
                in_process_clients=in_process,
            )
            for i in range(num_shards)
        ]
        started.extend(servers)
        return servers

    yield start
    for server in started:
        server.stop(grace=0.2)


def client(servers, **kw) -> Client:
    kw.setdefault("deadline_s", 20)
    kw.setdefault("retry_s", 5)
    return Client([s.address for s in servers], SPEC, data_plane="tcp", **kw)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_a_client_of_the_shards_process_calls_it_and_the_update_is_the_optimizers(hosted, mode):
    servers = hosted(2, mode=mode)
    start = np.linspace(-1, 1, SPEC.size).astype(np.float32)
    grad = np.full(SPEC.size, 0.25, np.float32)
    with client(servers, world=1, init=start.copy()) as c:
        params = np.empty(SPEC.size, np.float32)
        c.pull(params)
        np.testing.assert_array_equal(params, start)
        c.push(grad)
        c.pull(params)
        assert c.data_planes == ["local", "local"]
    np.testing.assert_allclose(params, start - LR * grad, rtol=1e-6)
    assert all(s.shard.version == 1 for s in servers)
    assert all(s.shard.counters.pulls == 2 and s.shard.counters.pushes == 1 for s in servers)


@pytest.mark.timeout(60)
def test_the_plane_is_offered_only_when_asked_and_only_to_the_shards_own_process(hosted):
    (plain,) = hosted(1, in_process=False)
    assert "local" not in dict(plain.service.offers())
    with client([plain], world=1, init=np.zeros(SPEC.size, np.float32)) as c:
        c.pull(np.empty(SPEC.size, np.float32))
        assert c.data_planes == ["shm"]  # a shard tests start in their process: the planes others use
    (server,) = hosted(1, job_id="other-job")
    offer = dict(server.service.offers())["local"]
    pid, _, key = offer.partition("|")
    assert pid == str(os.getpid()) and hosted_service(offer) is server.service
    assert hosted_service(f"{os.getppid()}|{key}") is None  # the same key, offered by another process
    with client([server], world=1, init=np.zeros(SPEC.size, np.float32), shared_memory=False) as c:
        c.pull(np.empty(SPEC.size, np.float32))
        assert c.data_planes == ["tcp"]  # shared_memory off keeps a client on its network plane
    server.stop(grace=0.2)
    assert hosted_service(offer) is None  # a stopped shard is no longer found


@pytest.mark.timeout(60)
def test_a_sync_round_keeps_a_copy_of_a_gradient_the_caller_writes_again(hosted):
    (server,) = hosted(1, mode="sync")
    first = np.full(SPEC.size, 1.0, np.float32)
    second = np.full(SPEC.size, 3.0, np.float32)
    start = np.zeros(SPEC.size, np.float32)
    a = client([server], worker_id=0, world=2, init=start.copy())
    b = client([server], worker_id=1, world=2, init=start.copy())
    run_threads([a.join, b.join], timeout=30)  # each join waits for the whole world
    with a, b:
        for c in (a, b):
            c.pull(np.empty(SPEC.size, np.float32))
        a.push(first)
        first[:] = np.nan  # the round is still open: the shard must not read this memory again
        b.push(second)
        params = np.empty(SPEC.size, np.float32)
        a.pull(params)
    np.testing.assert_allclose(params, -LR * (1.0 + 3.0) / 2)
    assert server.shard.version == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_bad_gradient_is_refused_with_its_reason_and_changes_nothing(hosted, mode):
    (server,) = hosted(1, mode=mode)
    service = server.service
    with client([server], worker_id=0, world=1, init=np.zeros(SPEC.size, np.float32)) as c:
        c.pull(np.empty(SPEC.size, np.float32))
        before = server.shard.weights.copy()
        bad = np.zeros(SPEC.size, np.float32)
        bad[7] = np.inf
        for grad, reason in (
            (bad, Reason.NON_FINITE),
            (np.zeros(SPEC.size, np.float64), Reason.BAD_DTYPE),
            (np.zeros(SPEC.size - 1, np.float32), Reason.BAD_SIZE),
        ):
            with pytest.raises(InvalidArgument) as refused:
                service.push(worker_id=0, clock=0, version=0, source=CallerArray(grad))
            assert refused.value.reason is reason
        np.testing.assert_array_equal(server.shard.weights, before)
        assert server.shard.version == 0
        result = service.push(worker_id=0, clock=0, version=0, source=CallerArray(np.ones(SPEC.size, np.float32)))
        assert result.outcome is Outcome.APPLIED and server.shard.version == 1


@pytest.mark.timeout(60)
def test_a_stopped_hosted_shard_refuses_and_a_regression_trains_on_the_plane(hosted):
    servers = hosted(2, mode="async")
    x, y, _, _ = make_problem()
    params, grad = np.zeros(REGRESSION.size, np.float32), np.empty(REGRESSION.size, np.float32)
    loss = lambda p: float(np.mean((x @ p[:-1] + p[-1] - y) ** 2))  # noqa: E731
    with Client([s.address for s in servers], REGRESSION, world=1, init=params.copy(), deadline_s=20, retry_s=1) as c:
        for _ in range(60):
            c.pull(params)
            c.push(regression_grad(params, x, y, grad) * np.float32(0.2))
        c.pull(params)
        assert c.data_planes == ["local", "local"]
        assert loss(params) < 0.5 * loss(np.zeros_like(params))
        servers[1].stop(grace=0.2)
        with pytest.raises(Exception) as gone:
            c.pull(params)
        assert "shard 1" in str(gone.value) or "unavailable" in str(gone.value).lower(), gone.value


@pytest.mark.timeout(90)
@pytest.mark.parametrize("overlap", ["auto", True])
def test_in_the_shards_process_async_steps_wait_for_their_push_unless_asked_to_overlap(hosted, tmp_path, overlap):
    import json

    from psgrid.worker.config import TrainConfig
    from psgrid.worker.loop import run_worker

    train = TrainConfig(model="softmax", dataset="digits", batch_size=32, steps=40, eval_every=0, overlap=overlap)
    servers = hosted(1, mode="async")
    run_worker(train, [s.address for s in servers], 0, 1, str(tmp_path / "w0.jsonl"))
    records = [json.loads(line) for line in (tmp_path / "w0.jsonl").read_text().splitlines()]
    start = records[0]
    steps = [r for r in records if r["event"] == "step"]
    assert start["data_planes"] == ["local"] and len(steps) == 40
    # "auto": the push is the shard's update, run in this process; each step waits for it, so a lone
    # worker's gradients are never stale. Asked to overlap, the push runs beside the next step.
    assert start["overlap"] is (overlap is True)
    assert max(s["staleness"] for s in steps) == (1 if overlap is True else 0)


def test_overlap_auto_is_off_only_where_every_shard_is_in_the_workers_process():
    from psgrid.cluster.job.config import ConfigError, job_from_dict
    from psgrid.worker.config import TrainConfig
    from psgrid.worker.loop import overlaps

    auto, on, off = (TrainConfig(overlap=v) for v in ("auto", True, False))
    assert not overlaps(auto, "async", ["local"]) and not overlaps(auto, "ssp", ["local", "local"])
    assert overlaps(auto, "async", ["local", "shm"]) and overlaps(auto, "async", ["ipc"])
    assert overlaps(on, "async", ["local"]) and not overlaps(off, "async", ["shm"])
    assert not overlaps(auto, "sync", ["shm"]) and not overlaps(on, "sync", ["local"])
    assert overlaps(TrainConfig(pull_ahead=True), "async", ["local"])  # pulling ahead needs the overlap
    assert job_from_dict({}).train.overlap == "auto"
    assert job_from_dict({"train": {"overlap": False}}).train.overlap is False
    with pytest.raises(ConfigError, match='overlap must be true, false or "auto"'):
        job_from_dict({"train": {"overlap": "sometimes"}})
    with pytest.raises(ValueError, match="pull_ahead = true needs overlap"):
        TrainConfig(pull_ahead=True, overlap=False).validate()
