"""The client is hard to misuse: it joins, initialises, overlaps, leaves and fails in one clear way."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from psgrid.psserver.client.memory import ClientMemory
from psgrid.psserver.exceptions import (
    InvalidArgument,
    NotInitialized,
    PSError,
    ShardUnavailable,
    SpecMismatch,
    UnknownWorker,
    WaitTimeout,
    WrongJob,
)
from psgrid.psserver.protocol import Outcome, Reason
from psgrid.psserver.service import ShardService
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.transports.base import ConnectOptions, open_data_plane
from psgrid.psserver.transports.grpc_client import open_control
from tests.support import REGRESSION, plane_options, run_threads, wait_for

SPEC = ModelSpec([("w", (40,)), ("b", (3,))])
ONES = np.ones(SPEC.size, np.float32)


def members(cluster, shard=0) -> list[int]:
    return sorted(m["worker_id"] for m in cluster.shard(shard).stats()["members"])


@pytest.mark.timeout(30)
def test_leaving_the_context_releases_a_sync_peer_at_once(cluster):
    c = cluster(2, mode="sync", lease_s=30, lr=0.1)
    stayer = c.client(SPEC, worker_id=0, init=SPEC.flat()).join()
    with c.client(SPEC, worker_id=1) as leaver:
        leaver.pull(SPEC.flat()).wait()
        leaver.push(ONES).wait()
        assert members(c) == [0, 1]
    assert members(c) == [0] and members(c, 1) == [0]  # it left when the block ended
    params = SPEC.flat()
    start = time.monotonic()
    for _ in range(3):  # rounds close with the one worker left, not after a 30 s lease
        stayer.pull(params).wait()
        stayer.push(ONES).wait()
    assert time.monotonic() - start < 5
    assert c.shard().stats()["evictions"] == 0


@pytest.mark.timeout(30)
def test_an_exception_in_the_block_still_leaves(cluster):
    c = cluster(1, mode="sync")
    with pytest.raises(RuntimeError, match="the user's bug"):
        with c.client(SPEC, init=SPEC.flat()) as client:
            client.pull(SPEC.flat()).wait()
            assert members(c) == [client.worker_id]
            raise RuntimeError("the user's bug")
    assert members(c) == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["tcp"])  # joining is control RPCs: no payload crosses a data plane
def test_joining_waits_for_the_job_on_every_shard_not_only_the_first(cluster):
    c = cluster(2, mode="sync")
    # A stranger that registered with shard 0 only: shard 0 counts two members, shard 1 one.
    stranger = open_control(c.addresses[0], ConnectOptions())
    try:
        stranger.register(spec_hash=SPEC.hash(), worker_id=7, start_clock=-1, host="elsewhere")
        client = c.client(SPEC, worker_id=0, world=2, init=SPEC.flat(), join_timeout_s=20)
        joined = threading.Thread(target=client.join, daemon=True)
        joined.start()
        joined.join(1.0)
        assert joined.is_alive(), "started although shard 1 has only one of the job's two workers"
        open_control(c.addresses[1], ConnectOptions()).register(
            spec_hash=SPEC.hash(), worker_id=7, start_clock=-1, host="elsewhere"
        )
        joined.join(10)
        assert not joined.is_alive()
        assert members(c, 0) == members(c, 1) == [0, 7]
    finally:
        stranger.close()


@pytest.mark.timeout(30)
def test_one_worker_sends_the_initial_weights(cluster, monkeypatch):
    inits = []
    real = ShardService.open_init

    def counting(self, *args, **kw):
        inits.append(self.shard.config.shard_index)
        return real(self, *args, **kw)

    monkeypatch.setattr(ShardService, "open_init", counting)
    c = cluster(2, mode="sync")
    weights = np.arange(SPEC.size, dtype=np.float32)

    def work(rank):
        with c.client(SPEC, worker_id=rank, world=3, init=lambda: weights + rank) as client:
            out = SPEC.flat()
            client.pull(out).wait()
            return out

    pulled = run_threads([lambda r=r: work(r) for r in range(3)], timeout=20)
    assert sorted(inits) == [0, 1], "each shard must receive the weights once"
    for out in pulled:
        np.testing.assert_array_equal(out, weights)  # rank 0's, the lowest id


@pytest.mark.timeout(30)
def test_a_client_without_weights_waits_for_them_and_says_so_when_none_come(cluster):
    c = cluster(1, mode="async")
    with pytest.raises(NotInitialized, match="pass init="):
        with c.client(SPEC, join_timeout_s=0.5):
            pass
    with c.client(SPEC, init={"w": np.full(40, 2.0), "b": np.zeros(3)}) as owner:  # by name
        with c.client(SPEC) as reader:
            out = SPEC.flat()
            reader.pull(out).wait()
            assert out[:40].tolist() == [2.0] * 40 and owner.worker_id != reader.worker_id


@pytest.mark.timeout(30)
def test_failures_are_domain_exceptions_with_reasons(cluster):
    c = cluster(2, mode="async")
    with c.client(SPEC, init=SPEC.flat()) as client:
        with pytest.raises(InvalidArgument, match="float32"):
            client.pull(np.zeros(SPEC.size, np.float64))
        with pytest.raises(InvalidArgument, match="wire dtype"):
            c.client(SPEC, wire_dtype="float8")
        other = ModelSpec([("w", (40,)), ("b", (4,))])
        with pytest.raises(SpecMismatch) as err:
            with c.client(other):
                pass
        assert err.value.reason is Reason.SPEC_MISMATCH and isinstance(err.value, PSError)
        not_joined = c.client(SPEC)
        with pytest.raises(InvalidArgument, match="context manager"):
            not_joined.pull(SPEC.flat())
    nobody = c.client(SPEC, retry_s=0.3)
    nobody._conn.addresses[:] = ["127.0.0.1:1"] * 2  # noqa: SLF001 - a client for shards that are not there
    from psgrid.psserver.transports.grpc_client import open_control as reopen

    nobody._conn.controls[:] = [reopen("127.0.0.1:1", ConnectOptions()) for _ in range(2)]
    with pytest.raises(ShardUnavailable) as err:
        nobody.join()
    assert err.value.reason is Reason.UNREACHABLE and err.value.shard == 0
    nobody.close()


@pytest.mark.timeout(30)
def test_a_pull_issued_while_a_push_is_in_flight_is_for_the_next_step(cluster):
    c = cluster(2, mode="sync", lr=1.0)
    with c.client(SPEC, init=SPEC.flat()) as client:
        params = SPEC.flat()
        for step in range(5):
            pushed = client.push(ONES, background=True)  # not waited for: the pull overlaps it
            versions = client.pull(params).wait()  # at clock step+1: waits for the round the push closes
            assert versions == [step + 1, step + 1] and client.clock == step + 1
            results = pushed.wait()
            assert [r.outcome for r in results] == [Outcome.APPLIED] * 2
            assert pushed.seconds is not None and pushed.seconds > 0
            np.testing.assert_allclose(params, -(step + 1.0))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("one_thread", [False, True])
def test_a_background_pull_into_a_callable_hands_every_shard_over_once(cluster, one_thread):
    c = cluster(3, mode="async", lr=1.0)
    init = np.arange(SPEC.size, dtype=np.float32)
    with c.client(SPEC, init=init) as client:
        landed, threads = SPEC.flat(), []

        def land(begin, end, values):
            threads.append((threading.get_ident(), begin))
            landed[begin:end] = values

        versions = client.pull(into=land, background=True, one_thread=one_thread).wait()
        assert versions == [0, 0, 0]
        np.testing.assert_array_equal(landed, init)
        assert sorted(begin for _, begin in threads) == [begin for begin, _ in client.ranges]
        callers = {ident for ident, _ in threads}
        if one_thread:  # shard after shard, on one thread: the pull-ahead's (worker/flat.py)
            assert len(callers) == 1 and [begin for _, begin in threads] == [b for b, _ in client.ranges]


@pytest.mark.timeout(30)
def test_a_retried_push_is_applied_once(cluster):
    c = cluster(1, mode="async", lr=1.0)
    with c.client(REGRESSION, init=REGRESSION.flat()) as client:
        grad = np.ones(REGRESSION.size, np.float32)
        client.push(grad).wait()
        # The same (worker, clock) again, as a client whose reply was lost sends it: acknowledged, not applied.
        control = open_control(c.addresses[0], ConnectOptions())
        try:
            registration = control.register(
                spec_hash=REGRESSION.hash(), worker_id=client.worker_id, start_clock=-1, host="test"
            )
            options = ConnectOptions(shared_memory=c.data_plane == "shm", memory=ClientMemory(REGRESSION.size))
            plane = open_data_plane(plane_options(c.data_plane)["data_plane"], control, registration, options)
            try:
                assert plane.name == c.data_plane
                result = plane.push(
                    grad, begin=0, wire_dtype=1, worker_id=client.worker_id, clock=0, version=0, timeout_s=5
                )
            finally:
                plane.close()
                options.memory.close()
        finally:
            control.close()
        assert result.outcome is Outcome.DUPLICATE and result.next_clock == 1
        np.testing.assert_array_equal(c.shard().weights, -1.0)
        assert c.shard().stats()["duplicates"] == 1


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_worker_moved_to_the_largest_clock_allowed_can_push_on(cluster, mode):
    # A push may carry a later clock than the shard has for the worker (the shard restarted from an
    # older checkpoint): the worker moves there. The furthest it may move must leave room to push on;
    # a push at 2^53, the largest clock accepted, left the worker at 2^53 + 1, which no push may carry.
    from psgrid.psserver.state import policy

    c = cluster(1, mode=mode, lr=1.0)
    grad = np.ones(REGRESSION.size, np.float32)
    with c.client(REGRESSION, init=REGRESSION.flat()) as client:
        worker = client.worker_id
        control = open_control(c.addresses[0], ConnectOptions())
        registration = control.register(spec_hash=REGRESSION.hash(), worker_id=worker, start_clock=-1, host="t")
        options = ConnectOptions(memory=ClientMemory(REGRESSION.size), shared_memory=c.data_plane == "shm")
        plane = open_data_plane(plane_options(c.data_plane)["data_plane"], control, registration, options)
        try:
            assert plane.name == c.data_plane

            def push(clock):
                return plane.push(grad, begin=0, wire_dtype=1, worker_id=worker, clock=clock, version=0, timeout_s=5)

            for clock in (2**53, policy.MAX_START_CLOCK + 1):
                with pytest.raises(InvalidArgument) as refused:
                    push(clock)
                # Past the bound: bad_value. Within it, async takes no clock it could not have reached
                # (future_clock: this shard never restarted); sync moves the worker, up to the bound.
                beyond = clock == 2**53 or mode == "sync"
                assert refused.value.reason is (Reason.BAD_VALUE if beyond else Reason.FUTURE_CLOCK)
                with pytest.raises(InvalidArgument):
                    control.register(spec_hash=REGRESSION.hash(), worker_id=worker, start_clock=clock, host="t")
            assert c.shard().stats()["members"][0]["clock"] == 0 and c.shard().version == 0  # nothing changed
            clock = policy.MAX_START_CLOCK
            if mode == "async":  # a worker moves on by registering there (a push may not jump ahead)
                control.register(spec_hash=REGRESSION.hash(), worker_id=worker, start_clock=clock, host="t")
            for _ in range(3):  # moved to the furthest clock allowed, then on from there
                result = push(clock)
                assert result.outcome is Outcome.APPLIED and result.next_clock == clock + 1
                clock = result.next_clock
            assert c.shard().stats()["members"][0]["clock"] == policy.MAX_START_CLOCK + 3
            assert c.shard().version == 3
        finally:
            plane.close()
            options.memory.close()
            control.close()


@pytest.mark.timeout(30)
def test_a_forgotten_worker_registers_again_by_itself(cluster):
    c = cluster(2, mode="async", lr=1.0)
    with c.client(SPEC, init=SPEC.flat()) as client:
        client.push(ONES).wait()
        c.shard(1).leave(client.worker_id)  # as if shard 1 evicted it
        with pytest.raises(UnknownWorker):
            c.shard(1).check_pusher(client.worker_id)
        results = client.push(ONES).wait()  # registers again on shard 1 and pushes
        assert [r.outcome for r in results] == [Outcome.APPLIED] * 2
        assert members(c, 1) == [client.worker_id]


# ----- found in review ------------------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["tcp"])  # joining is control RPCs: no payload crosses a data plane
def test_workers_with_different_models_are_refused_before_any_weights_exist(cluster):
    c = cluster(2, mode="sync")
    other = ModelSpec([("w", (3, 40)), ("b", (3,))])  # the same size, another layout
    first = c.client(SPEC, worker_id=0, world=2, init=SPEC.flat(), join_timeout_s=10)
    waiting = threading.Thread(target=first.join, daemon=True)
    waiting.start()
    wait_for(lambda: members(c) == members(c, 1) == [0], 10, "worker 0 registered on every shard")
    assert not c.shard().initialized
    with pytest.raises(SpecMismatch):
        c.client(other, worker_id=1).join()
    assert members(c) == [0] and members(c, 1) == [0]  # the refused one left nothing behind
    c.client(SPEC, worker_id=1).join()  # the right model joins, and the job starts
    waiting.join(10)
    assert not waiting.is_alive() and c.shard().initialized


@pytest.mark.timeout(30)
def test_a_push_one_shard_refused_does_not_stop_the_next(cluster):
    # In async the other shard applied it, so this worker's next clock is one past what the refusing
    # shard has: the client says so by registering again there (the push it refused is counted lost).
    c = cluster(2, mode="async", lr=0.5)
    with c.client(SPEC, init=SPEC.flat()) as client:
        bad = ONES.copy()
        bad[-1] = np.nan  # in shard 1's range only
        with pytest.raises(InvalidArgument) as err:
            client.push(bad)
        assert err.value.reason is Reason.NON_FINITE
        assert [c.shard(i).version for i in range(2)] == [1, 0]
        results = client.push(ONES).wait()
        assert [r.outcome for r in results] == [Outcome.APPLIED] * 2
        assert [c.shard(i).version for i in range(2)] == [2, 1] and c.shard(1).counters.lost_updates == 1


@pytest.mark.timeout(30)
def test_a_client_that_left_never_registers_again(cluster):
    c = cluster(1, mode="async")
    client = c.client(SPEC, init=SPEC.flat()).join()
    c.shard().leave(client.worker_id)  # the shard forgot it (evicted) ...
    client.leave()  # ... and it is leaving: a data call must not rejoin
    with pytest.raises(UnknownWorker):
        client.pull(SPEC.flat())
    assert members(c) == []


@pytest.mark.timeout(30)
def test_waiting_on_a_handle_keeps_its_timeout(cluster):
    c = cluster(1, mode="sync")
    client = c.client(SPEC, worker_id=0, init=SPEC.flat()).join()
    c.client(SPEC, worker_id=1).join()
    client.push(ONES)  # round 0 waits for worker 1
    pending = client.pull(SPEC.flat(), background=True)
    t0 = time.monotonic()
    with pytest.raises(WaitTimeout) as err:
        pending.wait(timeout=0.2)
    assert err.value.reason is Reason.WAIT_TIMEOUT and time.monotonic() - t0 < 2
    assert not pending.done()


@pytest.mark.timeout(30)
def test_a_join_that_fails_halfway_leaves_and_closes(cluster):
    c = cluster(2, mode="async")
    other = ModelSpec([("w", (41,)), ("b", (3,))])
    stranger = open_control(c.addresses[1], ConnectOptions())
    begin, end = c.shard(1).layout(other)
    stranger.init(other, np.zeros(end - begin, np.float32), begin)  # shard 1 holds another model
    stranger.close()
    client = c.client(SPEC, init=SPEC.flat())
    with pytest.raises(SpecMismatch):
        client.join()  # shard 0 took it, shard 1 refused it
    assert members(c) == []  # it left shard 0 again
    with pytest.raises(InvalidArgument, match="closed"):
        client.join()


@pytest.mark.timeout(30)
def test_bad_arguments_are_refused_before_anything_is_sent(cluster, tmp_path):
    c = cluster(2, mode="async")
    with c.client(SPEC, init=SPEC.flat()) as client:
        with pytest.raises(InvalidArgument, match="one version per shard"):
            client.push(ONES, versions=[0])
        assert client.clock == 0
    with pytest.raises(InvalidArgument, match="no such file"):
        c.client(SPEC, tls_ca=str(tmp_path / "missing-ca.pem"))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["grpc"])
def test_a_call_that_runs_out_of_time_is_not_taken_for_a_consistency_wait(cluster, monkeypatch):
    real = ShardService.stats
    monkeypatch.setattr(ShardService, "stats", lambda self: (time.sleep(0.3), real(self))[1])  # a slow shard
    c = cluster(1, mode="async")
    with pytest.raises(ShardUnavailable) as err:
        c.admin(deadline_s=0.1, retry_s=0.3).stats()  # gRPC's own deadline: no answer from the shard
    assert err.value.__cause__.reason is Reason.TIMED_OUT


@pytest.mark.timeout(30)
def test_pushes_from_either_gradient_buffer_are_applied(cluster):
    """A worker computing into the client's two gradient buffers in turn: each push is the one it made."""
    c = cluster(2, mode="async", lr=1.0)
    with c.client(SPEC, init=SPEC.flat()) as client:
        buffers = [client.gradient_buffer(0), client.gradient_buffer(1)]
        assert buffers[0] is not buffers[1] and buffers[0].shape == buffers[1].shape == (SPEC.size,)
        with pytest.raises(ValueError, match="0 and 1"):
            client.gradient_buffer(2)
        total = np.zeros(SPEC.size, np.float32)
        handle = None
        for step in range(6):
            grad = buffers[step % 2]
            if handle is not None and step >= 2:
                handle.wait()  # the push that read this buffer has ended
            grad[...] = step + 1
            total += grad
            handle = client.push(grad, background=True)
        handle.wait()
        np.testing.assert_array_equal(c.weights(), -total)


# ----- shards of one job, and the Admin's shape -------------------------------------------------------


@pytest.mark.timeout(30)
def test_shards_of_different_jobs_are_said_in_one_line_and_a_shutdown_names_those_it_missed(cluster, caplog):
    # Two psctl server processes started by hand without --job-id: each made its own.
    c = cluster(2, mode="async", lr=0.1, job_id=None)
    ids = [s.config.job_id for s in c.servers]
    assert ids[0] != ids[1]
    with caplog.at_level("WARNING", logger="psgrid.client"):
        with c.client(SPEC, init=SPEC.flat()) as client:
            client.push(ONES)
        admin = c.admin()
        admin.stats()
    said = [r.getMessage() for r in caplog.records if "different jobs" in r.getMessage()]
    assert len(said) == 2 and said[0] == said[1], said  # one line from the client, one from the admin
    assert "\n" not in said[0] and f"shards 0 ({c.addresses[0]}) and 1 ({c.addresses[1]})" in said[0]
    assert "--job-id" in said[0]
    with pytest.raises(WrongJob) as refused:
        admin.shutdown(ids[0])
    assert refused.value.shard == 1 and str(refused.value).startswith(
        f"shard 1 did not stop: shard at {c.addresses[1]}: "
    )
    assert "must name this shard's job" in str(refused.value) and "--job-id" in str(refused.value)
    assert c.servers[0].shutdown_requested.is_set() and not c.servers[1].shutdown_requested.is_set()


@pytest.mark.timeout(30)
def test_shards_of_one_job_say_nothing(cluster, caplog):
    c = cluster(2, mode="async", lr=0.1)
    with caplog.at_level("WARNING", logger="psgrid.client"):
        with c.client(SPEC, init=SPEC.flat()) as client:
            client.push(ONES)
    assert not [r for r in caplog.records if "different jobs" in r.getMessage()]


@pytest.mark.timeout(30)
def test_admin_pull_is_a_handle_like_the_clients_and_registers_once(cluster, monkeypatch):
    c = cluster(2, mode="async", lr=1.0)
    with c.client(SPEC, init=SPEC.flat()) as client:
        params = SPEC.flat()
        pulled = client.pull(params)
        assert pulled.out is params and pulled.wait() == [0, 0]
        client.push(ONES)
    admin = c.admin()
    looks = []
    real = admin._look
    monkeypatch.setattr(admin, "_look", lambda shard: looks.append(shard) or real(shard))
    first = admin.pull()
    assert first.done() and first.wait() == [1, 1]
    np.testing.assert_array_equal(first.out, -ONES)
    into = SPEC.flat()
    again = admin.pull(into)
    assert again.out is into and again.wait() == [1, 1] and again.seconds is not None
    np.testing.assert_array_equal(into, -ONES)
    assert sorted(looks) == [0, 1]  # the layout learnt once: a second pull only reads
    with pytest.raises(InvalidArgument):
        admin.pull(np.zeros(3, np.float32))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("data_plane", ["tcp"])  # membership, read over gRPC: no payload crosses a data plane
def test_admin_waits_for_members(cluster):
    c = cluster(2, mode="async", lr=0.1)
    admin = c.admin()
    with pytest.raises(WaitTimeout, match="0 of 1 workers registered on every shard after 0.2 s"):
        admin.wait_for_members(1, timeout_s=0.2)
    with c.client(SPEC, init=SPEC.flat()):
        stats = admin.wait_for_members(1, timeout_s=10)
        assert [len(s["members"]) for s in stats] == [1, 1]


@pytest.mark.timeout(60)
def test_a_refused_push_moves_no_clock_so_a_sync_worker_goes_on(cluster):
    c = cluster(2, mode="sync", lr=0.5)
    with c.client(REGRESSION, worker_id=0, init=np.zeros(REGRESSION.size, np.float32), max_wait_s=3) as client:
        grad = np.ones(REGRESSION.size, np.float32)
        client.push(grad)
        bad = grad.copy()
        bad[-1] = np.nan  # in the last shard's range only: the first shard takes it
        with pytest.raises(InvalidArgument):
            client.push(bad)
        assert client.clock == 1
        out = np.empty(REGRESSION.size, np.float32)
        client.pull(out)  # before: waited for round 1, which this worker never pushed to
        first = client.ranges[0][1]
        np.testing.assert_allclose(out[:first], -1.0)  # the first shard applied the finite half of clock 1
        np.testing.assert_allclose(out[first:], -0.5)
        client.push(grad)  # clock 1 again: a duplicate there, the first time on the other
        client.pull(out)
        np.testing.assert_allclose(out, -1.0)
        assert client.clock == 2 and client.versions == [2, 2]
