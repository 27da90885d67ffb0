"""The failure contract (DESIGN.md): leases and eviction, joining a running job, checkpoint and
restart of a killed shard, atomic checkpoint files, and graceful stops of ``psctl server``."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest

from psgrid.psserver.client.admin import Admin
from psgrid.psserver.client.client import Client
from psgrid.psserver.config import ServerConfig
from psgrid.psserver.exceptions import FailedPrecondition, ShardUnavailable
from psgrid.psserver.protocol import FLOAT32, REASON_KEY, Outcome, Reason, parse_address_file
from psgrid.psserver.rpc import ps_pb2, ps_pb2_grpc
from psgrid.psserver.server import serve
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.state import checkpoint_files as checkpoint
from psgrid.psserver.transports.base import ConnectOptions
from psgrid.psserver.transports.grpc_client import open_control
from tests.support import PLANES, plane_options, run_threads

ROOT = Path(__file__).resolve().parent.parent
SPEC = ModelSpec([("w", (40,)), ("b", (3,))])
LEASE = 0.5


def grad_for(worker: int, step: int) -> np.ndarray:
    return np.random.default_rng(1000 * worker + step).normal(size=SPEC.size).astype(np.float32)


def member_clocks(server) -> dict[int, int]:
    return {m["worker_id"]: m["clock"] for m in server.shard.stats()["members"]}


def live_worker(client, steps, start=0):
    """Pull and push ``steps`` times; returns how long each pull waited."""
    params = SPEC.flat()
    waits = []
    for step in range(start, start + steps):
        t0 = time.monotonic()
        client.pull(params).wait()
        waits.append(time.monotonic() - t0)
        client.push(grad_for(client.worker_id, step)).wait()
    return waits


class Heartbeats:
    """Heart-beats for a worker by hand (the client of a "dead" worker beats once an hour)."""

    def __init__(self, addresses, worker_id, interval=LEASE / 5):
        self.controls = [open_control(a, ConnectOptions()) for a in addresses]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(worker_id, interval), daemon=True)
        self.thread.start()

    def _run(self, worker_id, interval):
        while not self.stop.wait(interval):
            for control in self.controls:
                control.heartbeat(worker_id)

    def close(self):
        self.stop.set()
        self.thread.join(5)
        for control in self.controls:
            control.close()


# ----- (a) (b) a worker that stops heart-beating is evicted; it may rejoin -----------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_a_dead_worker_is_evicted_and_the_others_finish(cluster, data_plane, mode):
    steps = 6
    c = cluster(2, mode=mode, staleness=1, lease_s=LEASE, lr=0.01)
    alive = [c.client(SPEC, worker_id=r, init=SPEC.flat()).join() for r in range(2)]
    dead = c.client(SPEC, worker_id=2, heartbeat_s=3600).join()  # it never heart-beats
    params = SPEC.flat()
    dead.pull(params).wait()
    dead.push(grad_for(dead.worker_id, 0)).wait()  # it takes part in clock 0, then goes silent
    t0 = time.monotonic()
    waits = run_threads([lambda cl=cl: live_worker(cl, steps) for cl in alive], timeout=20)
    elapsed = time.monotonic() - t0
    # The others waited for it about one lease (plus the reaper's tick), not forever, not never.
    assert 0.3 <= elapsed < LEASE + 3.0, elapsed
    assert max(max(w) for w in waits) >= 0.2
    for server in c.servers:
        stats = server.shard.stats()
        assert stats["evictions"] == 1
        assert dead.worker_id not in member_clocks(server)
        assert member_clocks(server) == {cl.worker_id: steps for cl in alive}
        if mode == "sync":
            assert stats["version"] == steps
    # The evicted worker's next push is refused as unknown, with the reason that says "register again" ...
    with grpc.insecure_channel(c.addresses[0]) as channel:
        request = ps_pb2.PushRequest(
            worker_id=dead.worker_id,
            clock=1,
            version=0,
            num_chunks=1,
            chunk=ps_pb2.Chunk(offset=0, dtype=FLOAT32, data=np.zeros(21, "<f4").tobytes()),
        )
        with pytest.raises(grpc.RpcError) as err:
            ps_pb2_grpc.ParameterServerStub(channel).Push(iter([request]), timeout=5)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert dict(err.value.trailing_metadata())[REASON_KEY] == Reason.UNKNOWN_WORKER.wire_name
    versions_before = [s.shard.version for s in c.servers]
    # ... and its client registers again by itself and rejoins at the slowest live clock: its stale
    # gradient (computed at clock 1, far behind) is not applied. In sync it is a late push for a closed
    # round; in ssp it is past the staleness bound, acknowledged unapplied.
    results = dead.push(grad_for(dead.worker_id, 1)).wait()
    outcome = Outcome.DROPPED_LATE if mode == "sync" else Outcome.DUPLICATE
    assert [r.outcome for r in results] == [outcome, outcome]
    assert [r.next_clock for r in results] == [steps, steps]
    assert dead.clock == steps
    for server, before in zip(c.servers, versions_before):
        assert server.shard.version == before
        stats = server.shard.stats()
        assert stats["dropped_late" if mode == "sync" else "duplicates"] == 1
        assert member_clocks(server) == {0: steps, 1: steps, 2: steps}
    # It trains on with the others: nobody is held back waiting for it to catch up.
    beats = Heartbeats(c.addresses, dead.worker_id)
    try:
        run_threads([lambda cl=cl: live_worker(cl, 2, start=steps) for cl in (*alive, dead)], timeout=15)
    finally:
        beats.close()
    for server in c.servers:
        assert set(member_clocks(server).values()) == {steps + 2}
        assert server.shard.stats()["evictions"] == 1


@pytest.mark.timeout(10)
def test_rejoin_with_an_old_clock_lands_at_the_slowest_live_clock_policy_level():
    from psgrid.psserver.state.policy import ConsistencyPolicy

    for mode, outcome in (("ssp", Outcome.DUPLICATE), ("sync", Outcome.DROPPED_LATE)):
        policy = ConsistencyPolicy(mode, staleness=1)
        for w in range(3):
            policy.join(w)
        for c in range(6):
            for w in (0, 1):
                policy.on_push(w, c)
            if c == 0:
                policy.on_push(2, 0)
            if c == 1:
                policy.leave(2)  # evicted at clock 1
            policy.rounds_to_close()
        assert policy.slowest_clock() == 6
        policy.join(2, start_clock=1)  # what the client asks for: the clock it had
        decision = policy.on_push(2, 1)  # its stale push is not applied ...
        assert decision.outcome is outcome and decision.next_clock == 6
        assert policy.clocks[2] == 6  # ... and it is at the slowest live clock
        if mode == "ssp":
            assert policy.may_pull(0, 7)  # nobody waits for the rejoined worker to catch up
    # joining ahead of the others (a shard restored from an older checkpoint) keeps the clock asked for
    policy = ConsistencyPolicy("ssp", staleness=1)
    policy.join(0, start_clock=3)
    assert policy.join(1, start_clock=5) == 5


# ----- (c) joining a running job -------------------------------------------------------------------


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_a_worker_joins_a_running_job_at_the_slowest_live_clock(cluster, mode):
    c = cluster(2, mode=mode, staleness=3, lease_s=5, lr=0.01)
    fast = c.client(SPEC, worker_id=0, init=SPEC.flat()).join()
    slow = c.client(SPEC, worker_id=1).join()
    if mode == "sync":
        run_threads([lambda: live_worker(fast, 3), lambda: live_worker(slow, 3)], timeout=15)
        live_worker(fast, 1, start=3)  # fast is at 4, round 3 is open waiting for slow
        expected = 3
    else:
        live_worker(fast, 3)
        live_worker(slow, 1)
        expected = 1
    late = c.client(SPEC).join()
    assert late.worker_id == 2 and late.clock == expected
    for server in c.servers:
        assert member_clocks(server)[late.worker_id] == expected
        assert server.shard.stats()["min_clock"] == expected
    # the newcomer trains with the others at once
    late.pull(SPEC.flat()).wait()
    results = late.push(grad_for(late.worker_id, expected)).wait()
    assert results[0].outcome in (Outcome.APPLIED, Outcome.ACCUMULATED)
    assert late.clock == expected + 1


# ----- (d) (f) a shard process: kill, restart from its checkpoint; stop cleanly ------------------------


def start_shard(tmp_path: Path, name: str, *args: str) -> tuple[subprocess.Popen, str]:
    """``psctl server`` in a subprocess; returns it and its address once published."""
    address_file = tmp_path / f"{name}.addr"
    address_file.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PSCTL_PARENT_PID"}
    log = open(tmp_path / f"{name}.log", "ab")
    try:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "psgrid.cluster.cli",
                "server",
                "--shard",
                "0",
                "--num-shards",
                "1",
                "--address-file",
                str(address_file),
                *args,
            ],
            cwd=ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    finally:
        log.close()
    deadline = time.monotonic() + 20
    while not address_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill(proc)
            raise AssertionError(f"shard did not start: {(tmp_path / f'{name}.log').read_text()}")
        time.sleep(0.05)
    return proc, parse_address_file(address_file.read_text())[0]


def job_of(tmp_path: Path, name: str) -> str:
    """The job id a shard started by :func:`start_shard` published with its address."""
    return parse_address_file((tmp_path / f"{name}.addr").read_text())[1]


def kill(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def manifest_version(ckpt_dir: Path) -> int:
    return json.loads((ckpt_dir / "shard-0-of-1" / checkpoint.MANIFEST).read_text())["version"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plane", PLANES)
def test_a_killed_shard_restarts_from_its_checkpoint(tmp_path, plane, no_leaks):
    every = 5
    ckpt = tmp_path / "ckpt"
    args = [
        "--mode",
        "async",
        "--optimizer",
        "adam",
        "--lr",
        "0.05",
        "--lease-s",
        "30",
        "--checkpoint-dir",
        str(ckpt),
        "--checkpoint-every",
        str(every),
    ]
    first = second = None
    try:
        first, address = start_shard(tmp_path, "first", "--port", "0", *args)
        port = int(address.rsplit(":", 1)[1])
        with Client([address], SPEC, init=SPEC.flat(), retry_s=15, deadline_s=5, **plane_options(plane)) as client:
            params = SPEC.flat()
            history = {}  # version -> weights
            for step in range(12):
                [version] = client.pull(params).wait()
                history[version] = params.copy()
                client.push(grad_for(0, step)).wait()
            [version] = client.pull(params).wait()
            history[version] = params.copy()
            assert client.data_planes == [plane] and version == 12 and manifest_version(ckpt) == 10

            os.kill(first.pid, signal.SIGKILL)
            first.wait(timeout=10)
            # The next pull starts while the shard is down, and retries until it is back.
            t0 = time.monotonic()
            pending = client.pull(params, background=True)
            time.sleep(0.3)
            assert not pending.done()
            second, address2 = start_shard(tmp_path, "second", "--port", str(port), *args)
            assert address2 == address
            versions = pending.wait(timeout=20)
            recovered_in = time.monotonic() - t0
            # The restored shard holds the last checkpoint: at most `every` updates were lost.
            assert versions == [10] and 12 - versions[0] <= every
            np.testing.assert_array_equal(params, history[10])
            # A push goes through too, and the optimizer state (Adam moments, step count) came back:
            # the update equals the one a shard that never died makes from version 10.
            [reply] = client.push(grad_for(0, 99)).wait()
            assert reply.outcome is Outcome.APPLIED and reply.version == 11
            client.pull(params).wait()
            np.testing.assert_array_equal(params, reference_after(10, grad_for(0, 99)))
            # The data plane was chosen again from the restarted shard's registration (a TCP plane
            # listens on a new port), and it is the one in use.
            assert client.data_planes == [plane]
            assert recovered_in < 15
        # SIGTERM: a clean exit (0) with a final checkpoint of the version it reached.
        os.kill(second.pid, signal.SIGTERM)
        assert second.wait(timeout=15) == 0
        assert manifest_version(ckpt) == 11
    finally:
        kill(first)
        kill(second)


def reference_after(versions: int, extra: np.ndarray) -> np.ndarray:
    """Weights of an in-process adam shard after the first ``versions`` pushes of grad_for(0, .) and ``extra``."""
    server = serve(ServerConfig(mode="async", optimizer="adam", lr=0.05))
    try:
        with Client([server.address], SPEC, init=SPEC.flat()) as client:
            for step in range(versions):
                client.push(grad_for(0, step)).wait()
            client.push(extra).wait()
            out = SPEC.flat()
            client.pull(out).wait()
            return out
    finally:
        server.stop(grace=0.5)


@pytest.mark.timeout(40)
def test_the_shutdown_rpc_stops_psctl_server_with_a_final_checkpoint(tmp_path, no_leaks):
    ckpt = tmp_path / "ckpt"
    proc = None
    try:
        proc, address = start_shard(
            tmp_path, "shard", "--port", "0", "--mode", "sync", "--checkpoint-dir", str(ckpt)
        )  # no periodic checkpoints
        with Client([address], SPEC, init=SPEC.flat(), deadline_s=5, retry_s=2) as client:
            for step in range(3):
                client.pull(SPEC.flat()).wait()
                client.push(grad_for(0, step)).wait()
            assert not (ckpt / "shard-0-of-1" / checkpoint.MANIFEST).exists()
        job = job_of(tmp_path, "shard")
        assert len(job) == 12 and f"job {job}" in (tmp_path / "shard.log").read_text()  # printed and published
        with Admin([address], deadline_s=5, retry_s=2) as admin:
            for wrong in ("", "another-job", job[:-1]):  # garbage or another job's psctl cannot stop it
                with pytest.raises(FailedPrecondition) as refused:
                    admin.shutdown(wrong)
                assert refused.value.reason is Reason.WRONG_JOB
                assert "must name this shard's job" in str(refused.value)
            assert proc.poll() is None and admin.stats()[0]["version"] == 3
            admin.shutdown(job)
        assert proc.wait(timeout=15) == 0
        assert manifest_version(ckpt) == 3
        arrays, meta = checkpoint.load_latest(ckpt / "shard-0-of-1")
        assert meta["clocks"] == {} and meta["departed"] == {"0": 3}  # the worker left after clock 3
        assert arrays["weights"].shape == (SPEC.size,)
    finally:
        kill(proc)


# ----- (e) checkpoint files are atomic --------------------------------------------------------------


def checkpointing_cluster(cluster, ckpt: Path, **kw):
    return cluster(1, mode="async", optimizer="adam", lr=0.05, checkpoint_dir=str(ckpt), **kw)


@pytest.mark.timeout(30)
def test_restore_trusts_only_the_manifest(cluster, tmp_path):
    ckpt = tmp_path / "ckpt"
    c = checkpointing_cluster(cluster, ckpt, checkpoint_every=3)
    client = c.client(SPEC, worker_id=0, init=SPEC.flat(), heartbeat_s=3600).join()
    for step in range(7):
        client.push(grad_for(0, step)).wait()
    weights = c.shard().weights.copy()
    opt = c.shard().optimizer.state_dict()
    c.servers[0].stop(grace=0.5)  # with the worker still a member: stop() writes version 7
    client.close()
    d = ckpt / "shard-0-of-1"
    assert manifest_version(ckpt) == 7
    # the newest checkpoint_keep (default 3) are kept
    assert sorted(p.name for p in d.glob("ckpt-*.npz")) == [f"ckpt-00000000000{v}.npz" for v in (3, 6, 7)]
    # Leftovers of a crash in the middle of later saves: a half-written temp file, a temp manifest
    # pointing at it, and a newer-looking checkpoint the manifest never named (torn).
    (d / ".tmp-abc123.npz").write_bytes(b"PK\x03\x04 half a zip")
    (d / (checkpoint.MANIFEST + ".tmp")).write_text(json.dumps({"file": ".tmp-abc123.npz", "version": 99}))
    (d / "ckpt-000000000099.npz").write_bytes(b"torn")
    server = serve(ServerConfig(mode="async", optimizer="adam", lr=0.05, checkpoint_dir=str(ckpt)))
    try:
        shard = server.shard
        assert shard.version == 7
        np.testing.assert_array_equal(shard.weights, weights)
        restored = shard.optimizer.state_dict()
        assert restored["steps"] == opt["steps"] == 7
        for k in opt:
            np.testing.assert_array_equal(restored[k], opt[k])
        assert shard.policy.clocks == {0: 7}
        assert shard.claims.restored_version == 7
        # the crash's temporary files are gone; the torn file the manifest never named is left alone
        assert not (d / ".tmp-abc123.npz").exists() and not (d / (checkpoint.MANIFEST + ".tmp")).exists()
    finally:
        server.stop(grace=0.5)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("crash_at", ["array file", "manifest write", "manifest rename"])
def test_a_crash_during_save_leaves_the_previous_checkpoint(cluster, tmp_path, monkeypatch, crash_at):
    ckpt = tmp_path / "ckpt"
    d = ckpt / "shard-0-of-1"
    c = checkpointing_cluster(cluster, ckpt)
    shard = c.shard()
    client = c.client(SPEC, init=SPEC.flat()).join()
    admin = c.admin()
    client.push(grad_for(0, 0)).wait()
    admin.checkpoint()
    saved = shard.weights.copy()
    client.push(grad_for(0, 1)).wait()

    class Crash(Exception):
        pass

    if crash_at == "array file":

        def savez(f, **arrays):
            f.write(b"PK\x03\x04 partial")
            raise Crash()

        monkeypatch.setattr(checkpoint.np, "savez", savez)
    elif crash_at == "manifest write":

        def dump(obj, f, *a, **kw):
            f.write('{"file": "ckpt-0000')
            raise Crash()

        monkeypatch.setattr(checkpoint.json, "dump", dump)
    else:
        real = os.replace

        def replace(src, dst):
            if Path(dst).name == checkpoint.MANIFEST:
                raise Crash()
            return real(src, dst)

        monkeypatch.setattr(checkpoint.os, "replace", replace)
    with pytest.raises(Crash):
        shard.checkpoint()
    monkeypatch.undo()
    found = checkpoint.load_latest(d)
    assert found is not None
    arrays, meta = found
    assert meta["version"] == 1
    np.testing.assert_array_equal(arrays["weights"], saved)
    assert json.loads((d / checkpoint.MANIFEST).read_text())["version"] == 1
    # a checkpoint after the crash works and is what a restart sees
    admin.checkpoint()
    assert checkpoint.load_latest(d)[1]["version"] == 2


# ----- found in review: shutdown releases waits, checkpoints keep open rounds and never break training


@pytest.mark.timeout(30)
def test_stopping_a_server_releases_a_waiting_pull(cluster):
    c = cluster(1, mode="sync", lr=0.1)
    waiting = c.client(SPEC, worker_id=0, init=SPEC.flat(), retry_s=0.5, deadline_s=30).join()
    c.client(SPEC, worker_id=1, retry_s=0.5).join()
    waiting.push(np.ones(SPEC.size, np.float32)).wait()  # round 0 waits for the other worker
    pending = waiting.pull(SPEC.flat(), background=True)
    time.sleep(0.5)
    assert not pending.done()
    started = time.monotonic()
    c.servers[0].stop(grace=0.5)
    assert time.monotonic() - started < 8, "stop() waited for the pull's deadline"
    with pytest.raises(ShardUnavailable):
        pending.wait(timeout=10)
    assert time.monotonic() - started < 10


@pytest.mark.timeout(30)
def test_a_failing_checkpoint_does_not_stop_training(cluster, tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the checkpoint directory should be")
    c = cluster(1, mode="sync", lr=0.5, checkpoint_dir=str(blocker), checkpoint_every=1)
    clients = [c.client(SPEC, worker_id=r, init=SPEC.flat()).join() for r in range(2)]
    for _ in range(3):
        for client in clients:
            client.pull(SPEC.flat()).wait()
            client.push(np.ones(SPEC.size, np.float32)).wait()
    shard = c.shard()
    assert shard.version == 3 and shard.policy.closed_rounds == 3 and not shard.pushes.round_grads
    np.testing.assert_allclose(shard.weights, -1.5)


@pytest.mark.timeout(30)
def test_a_checkpoint_keeps_the_gradients_of_an_open_sync_round(tmp_path):
    from psgrid.psserver.state.shard import Shard

    config = ServerConfig(mode="sync", lr=1.0, checkpoint_dir=str(tmp_path))
    shard = Shard(config)
    shard.init(SPEC, np.zeros(SPEC.size, np.float32))
    for worker in (0, 1):
        shard.register(SPEC.hash(), worker, -1, "test")
    grad = shard.pool.take()
    grad[...] = 2.0
    shard.push(0, 0, 0, grad, 0)  # held: round 0 waits for worker 1
    shard.checkpoint()
    restored = Shard(config)  # a restart
    duplicate = restored.pool.take()
    assert restored.push(0, 0, 0, duplicate, 0)[0].outcome is Outcome.DUPLICATE
    restored.pool.give(duplicate)
    last = restored.pool.take()
    last[...] = 4.0
    restored.push(1, 0, 0, last, 0)  # closes round 0 with both
    np.testing.assert_allclose(restored.weights, -3.0)
    assert restored.pool.on_loan == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_a_restarted_shard_takes_the_versions_and_clocks_of_before_its_crash_and_only_those(tmp_path, mode):
    from psgrid.psserver.exceptions import InvalidArgument
    from psgrid.psserver.state.shard import Shard

    config = ServerConfig(mode=mode, lr=1.0, checkpoint_dir=str(tmp_path))

    def push(shard, clock, version):
        grad = shard.pool.take()
        grad[...] = 1.0
        try:
            result, kept = shard.push(0, clock, version, grad, 0)
        except InvalidArgument:
            kept = False
            raise
        finally:
            if not kept:
                shard.pool.give(grad)
        return result

    shard = Shard(config)
    shard.init(SPEC, np.zeros(SPEC.size, np.float32))
    shard.register(SPEC.hash(), 0, -1, "test")
    push(shard, 0, 0)
    shard.checkpoint()  # version 1, the worker at clock 1
    push(shard, 1, 1)
    push(shard, 2, 2)  # versions 2 and 3: lost in the crash
    restarted = Shard(config)
    assert restarted.version == 1 and restarted.policy.clocks == {0: 1}
    # The worker's push in flight at the crash: its clock and its version are of before the restart.
    result = push(restarted, 3, 3)
    assert result.outcome is Outcome.APPLIED and result.staleness == 0 and restarted.version == 2
    assert restarted.counters.lost_updates == 2
    # Caught up, the same claims cannot be true any more
    with pytest.raises(InvalidArgument) as err:
        push(restarted, 9, 2)
    assert err.value.reason is Reason.FUTURE_CLOCK
    restarted.wait_for_pull(0, 4, 1.0)  # a pull of this process's weights, at clock 4
    with pytest.raises(InvalidArgument) as err:
        push(restarted, 4, 3)
    assert err.value.reason is Reason.FUTURE_VERSION
    assert push(restarted, 4, 2).outcome is Outcome.APPLIED
    assert restarted.counters.lost_updates == 2 and restarted.pool.on_loan == 0


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_an_evicted_worker_back_at_a_later_clock_counts_what_it_pushed_meanwhile_as_lost(mode):
    # Seen under load: a restarted shard evicted a worker (its heartbeat late), the worker pushed to the
    # other shard meanwhile and came back three clocks on; those updates were never counted as lost.
    from psgrid.psserver.state.shard import Shard

    now = [0.0]
    shard = Shard(ServerConfig(mode=mode, lr=1.0, lease_s=2.0), now=lambda: now[0])
    shard.init(SPEC, np.zeros(SPEC.size, np.float32))
    shard.register(SPEC.hash(), 0, -1, "test")
    grad = shard.pool.take()
    grad[...] = 1.0
    try:
        shard.push(0, 0, 0, grad, 0)
    finally:
        shard.pool.give(grad)
    now[0] += 5.0
    assert shard.evict_expired() == [0]
    assert shard.register(SPEC.hash(), 0, 4, "test")["start_clock"] == 4
    assert shard.counters.lost_updates == 3 and shard.version == 1
    shard.leave(0)
    assert shard.register(SPEC.hash(), 0, 4, "test")["start_clock"] == 4  # back where it left: nothing missed
    assert shard.counters.lost_updates == 3


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_updates_lost_to_restarts_are_counted_across_every_restart(tmp_path, mode):
    # Three restarts from a checkpoint 3 steps old; each incarnation counts the steps it never got,
    # checkpoints, and dies. The last one lost nothing itself: the count must still be the job's.
    from psgrid.psserver.state.shard import Shard

    config = ServerConfig(mode=mode, staleness=10, lr=0.01, checkpoint_dir=str(tmp_path))

    def step(shard, clock):
        for worker in (0, 1):
            grad = shard.pool.take()
            grad[...] = 1.0
            _, kept = shard.push(worker, clock, shard.version, grad, 4)
            if not kept:
                shard.pool.give(grad)

    shard = Shard(config)
    shard.init(SPEC, SPEC.flat())
    for worker in (0, 1):
        shard.register(SPEC.hash(), worker, -1, "test")
    clock = 0
    for restart in range(3):
        for _ in range(2):
            step(shard, clock)
            clock += 1
        shard.checkpoint()
        for _ in range(3):  # never in a checkpoint: lost with the process
            step(shard, clock)
            clock += 1
        shard = Shard(config)  # restarted: the workers push on from where they are
        step(shard, clock)
        clock += 1
        assert shard.stats()["lost_updates"] == (restart + 1) * (3 if mode == "sync" else 6)
        shard.checkpoint()
    shard = Shard(config)
    assert shard.stats()["lost_updates"] == (9 if mode == "sync" else 18)


@pytest.mark.timeout(30)
def test_a_checkpoint_that_cannot_be_written_is_a_precondition_with_its_reason(cluster, tmp_path):
    from psgrid.psserver.exceptions import CheckpointFailed

    for settings, reason in (
        ({}, Reason.NO_CHECKPOINT_DIR),
        ({"checkpoint_dir": str(tmp_path / "a-file")}, Reason.CHECKPOINT_FAILED),
    ):
        (tmp_path / "a-file").write_text("a file where the checkpoint directory should be")
        c = cluster(1, mode="async", **settings)
        c.client(SPEC, init=SPEC.flat()).join()
        with pytest.raises(CheckpointFailed) as err:
            c.admin().checkpoint()
        assert err.value.reason is reason and err.value.status.name == "FAILED_PRECONDITION"
        assert c.shard().stats()["rejected"] == 0  # not bad input


# ----- (g) shards restored from checkpoints of different moments; progress leases ----------------------


def _sync_servers(ckpt: Path) -> list:
    return [
        serve(ServerConfig(shard_index=i, num_shards=2, mode="sync", lr=0.01, lease_s=30, checkpoint_dir=str(ckpt)))
        for i in range(2)
    ]


@pytest.mark.timeout(60)
def test_shards_restored_at_different_rounds_resume_from_the_earliest(tmp_path, no_leaks):
    # A Ctrl-C lands between two shards' final checkpoints: shard 0 holds round 5, shard 1 round 4.
    first, saved = tmp_path / "first", tmp_path / "saved"
    servers = _sync_servers(first)
    addresses = [s.address for s in servers]
    clients = [Client(addresses, SPEC, worker_id=w, world=2, init=SPEC.flat()) for w in (0, 1)]
    try:
        run_threads([lambda c=c: c.join() for c in clients], timeout=20)
        run_threads([lambda c=c: live_worker(c, 4) for c in clients], timeout=20)
        servers[1].shard.checkpoint()
        run_threads([lambda c=c: live_worker(c, 1, start=4) for c in clients], timeout=20)
        servers[0].shard.checkpoint()
        for i in range(2):
            name = f"shard-{i}-of-2"
            (saved / name).mkdir(parents=True)
            manifest = checkpoint.read_manifest(first / name)
            for f in (manifest["file"], checkpoint.MANIFEST):
                (saved / name / f).write_bytes((first / name / f).read_bytes())
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.stop(grace=0.5)
    servers = _sync_servers(saved)
    try:
        assert [s.shard.policy.closed_rounds for s in servers] == [5, 4]
        assert [s.shard.claims.restored_version for s in servers] == [5, 4]
        addresses = [s.address for s in servers]
        clients = [Client(addresses, SPEC, worker_id=w, world=2) for w in (0, 1)]
        try:
            run_threads([lambda c=c: c.join() for c in clients], timeout=20)
            assert [c.clock for c in clients] == [4, 4]  # the earliest shard's round
            run_threads([lambda c=c: live_worker(c, 3, start=4) for c in clients], timeout=20)
        finally:
            for c in clients:
                c.close()
        # shard 1 applied rounds 4, 5 and 6; shard 0 took round 4 again as duplicates, then 5 and 6
        assert [s.shard.policy.closed_rounds for s in servers] == [7, 7]
        assert [s.shard.version for s in servers] == [7, 7]
        assert servers[0].shard.counters.duplicates == 2
        assert [s.shard.counters.lost_updates for s in servers] == [0, 0]
    finally:
        for s in servers:
            s.stop(grace=0.5)


def _copy_latest(source: Path, target: Path) -> None:
    """Only the latest checkpoint of each shard in ``source`` (what a restore reads), into ``target``."""
    for shard_dir in sorted(source.glob("shard-*")):
        (target / shard_dir.name).mkdir(parents=True)
        manifest = checkpoint.read_manifest(shard_dir)
        for f in (manifest["file"], checkpoint.MANIFEST):
            (target / shard_dir.name / f).write_bytes((shard_dir / f).read_bytes())


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_shards_restored_rounds_apart_resume_at_the_earliest_in_every_mode(tmp_path, mode, no_leaks):
    # Shard 1's checkpoint is 3 rounds older than shard 0's, and no older one is kept: the workers
    # start at shard 1's clock and shard 0 answers the 3 pushes it has as duplicates. A duplicate's
    # answer must not move the worker to shard 0's clock: shard 1 would then wait for rounds (sync)
    # or clocks (ssp) nobody pushes, or count the pushes it never got as lost (async).
    def servers_in(ckpt: Path) -> list:
        return [
            serve(
                ServerConfig(
                    shard_index=i, num_shards=2, mode=mode, staleness=1, lr=0.01, lease_s=30, checkpoint_dir=str(ckpt)
                )
            )
            for i in range(2)
        ]

    first, saved = tmp_path / "first", tmp_path / "saved"
    servers = servers_in(first)
    clients = [Client([s.address for s in servers], SPEC, worker_id=w, world=2, init=SPEC.flat()) for w in (0, 1)]
    try:
        run_threads([lambda c=c: c.join() for c in clients], timeout=20)
        run_threads([lambda c=c: live_worker(c, 4) for c in clients], timeout=20)
        servers[1].shard.checkpoint()
        run_threads([lambda c=c: live_worker(c, 3, start=4) for c in clients], timeout=20)
        servers[0].shard.checkpoint()
        _copy_latest(first, saved)
    finally:
        for c in clients:
            c.close()
        for s in servers:
            s.stop(grace=0.5)
    servers = servers_in(saved)
    try:
        assert [sorted(member_clocks(s).values()) for s in servers] == [[7, 7], [4, 4]]
        clients = [Client([s.address for s in servers], SPEC, worker_id=w, world=2) for w in (0, 1)]
        try:
            run_threads([lambda c=c: c.join() for c in clients], timeout=20)
            assert [c.clock for c in clients] == [4, 4]
            run_threads([lambda c=c: live_worker(c, 5, start=4) for c in clients], timeout=30)
            assert [c.clock for c in clients] == [9, 9]
            stats = [s.shard.stats() for s in servers]
        finally:
            for c in clients:
                c.close()
        assert [s["min_clock"] for s in stats] == [9, 9]
        assert [s["lost_updates"] for s in stats] == [0, 0]  # nothing skipped ...
        assert [s["duplicates"] for s in stats] == [6, 0]  # ... and nothing applied twice
        assert stats[0]["version"] == stats[1]["version"]  # every push applied once on each shard
    finally:
        for s in servers:
            s.stop(grace=0.5)


@pytest.mark.parametrize("mode", ["sync", "ssp", "async"])
def test_progress_lease_evicts_only_a_worker_the_others_wait_on(mode):
    from psgrid.psserver.state.shard import Shard

    now = [0.0]
    shard = Shard(ServerConfig(mode=mode, staleness=1, lease_s=5, progress_timeout_s=30), now=lambda: now[0])
    shard.init(SPEC, SPEC.flat())
    for w in (0, 1, 2):
        shard.register(SPEC.hash(), w, -1, "h")
    grad = SPEC.flat()
    for step in range(20):
        now[0] += 2.0
        for w in (0, 1, 2):
            shard.heartbeat(w)  # everyone's heartbeat is alive
        for w in (0, 1):  # ... but worker 2 never pushes
            if mode != "sync" or step == 0:
                buf = shard.pool.take()
                np.copyto(buf, grad)
                _, kept = shard.push(w, step if mode != "sync" else 0, shard.version, buf, 4)
                if not kept:
                    shard.pool.give(buf)
        evicted = shard.evict_stalled()
        if evicted:
            break
    if mode == "async":
        assert evicted == [] and shard.counters.stalled_evictions == 0  # nobody waits in async
    else:
        assert evicted == [2] and now[0] > 30.0
        assert shard.counters.stalled_evictions == 1 and not shard.policy.is_live(2)
        assert shard.policy.is_live(0) and shard.policy.is_live(1)  # they pushed: progress
        if mode == "sync":
            assert shard.policy.closed_rounds == 1  # the round it held closed


def test_a_failed_checkpoint_write_removes_its_temporary_file(tmp_path, monkeypatch):
    def full_disk(file, **arrays):
        file.write(b"PK\x03\x04 partial")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint.np, "savez", full_disk)
    with pytest.raises(OSError):
        checkpoint.save(tmp_path, {"w": np.zeros(3, np.float32)}, {"version": 1})
    assert list(tmp_path.iterdir()) == []


def test_checkpoint_keep_keeps_the_newest(tmp_path):
    for version in range(1, 7):
        checkpoint.save(tmp_path, {"w": np.full(3, version, np.float32)}, {"version": version}, keep=2)
    assert sorted(p.name for p in tmp_path.glob("ckpt-*")) == ["ckpt-000000000005.npz", "ckpt-000000000006.npz"]
    arrays, meta = checkpoint.load_latest(tmp_path)
    assert meta["version"] == 6 and arrays["w"][0] == 6
