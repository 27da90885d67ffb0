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

from psgrid.psserver import checkpoint
from psgrid.psserver.client import ShardedClient
from psgrid.psserver.config import ServerConfig
from psgrid.psserver.rpc import ps_pb2, ps_pb2_grpc
from psgrid.psserver.server import serve
from psgrid.psserver.spec import ModelSpec
from tests.cluster_utils import addresses, in_process_cluster, run_threads

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
        client.pull(params)
        waits.append(time.monotonic() - t0)
        client.push(grad_for(client.worker_id, step))
    return waits


# ----- (a) (b) a worker that stops heart-beating is evicted; it may rejoin -----------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["sync", "ssp"])
def test_dead_worker_is_evicted_and_the_others_finish(mode):
    steps = 6
    with in_process_cluster(2, mode=mode, staleness=1, lease_s=LEASE, lr=0.01) as servers:
        addrs = addresses(servers)
        alive = [ShardedClient(addrs, deadline_s=10, retry_s=5) for _ in range(2)]
        dead = ShardedClient(addrs, deadline_s=10, retry_s=5)
        try:
            for c in (*alive, dead):
                c.register(SPEC)
            for c in alive:
                c.start_heartbeats()                # the dead one never heart-beats
            alive[0].init(np.zeros(SPEC.size, np.float32))
            params = SPEC.flat()
            dead.pull(params)
            dead.push(grad_for(dead.worker_id, 0))  # it takes part in clock 0, then goes silent
            t0 = time.monotonic()
            waits = run_threads([lambda c=c: live_worker(c, steps) for c in alive], timeout=20)
            elapsed = time.monotonic() - t0
            # The others waited for it about one lease (plus the reaper's tick), not forever, not never.
            assert 0.3 <= elapsed < LEASE + 3.0, elapsed
            assert max(max(w) for w in waits) >= 0.2
            for server in servers:
                stats = server.shard.stats()
                assert stats["evictions"] == 1
                assert dead.worker_id not in member_clocks(server)
                assert member_clocks(server) == {c.worker_id: steps for c in alive}
                if mode == "sync":
                    assert stats["version"] == steps
            # The evicted worker's next push is refused as unknown ("register again") ...
            stub = ps_pb2_grpc.ParameterServerStub(dead.channels[0])
            begin, end = dead.ranges[0]
            request = ps_pb2.PushRequest(worker_id=dead.worker_id, clock=1, version=0, num_chunks=1,
                                         chunk=ps_pb2.Chunk(offset=begin, dtype=ps_pb2.FLOAT32,
                                                            data=np.zeros(end - begin, "<f4").tobytes()))
            with pytest.raises(grpc.RpcError) as err:
                stub.Push(iter([request]), timeout=5)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "register again" in err.value.details()
            versions_before = [s.shard.version for s in servers]
            # ... and the ShardedClient registers again by itself and rejoins at the slowest live clock:
            # its stale gradient (computed at clock 1, far behind) is not applied. In sync it is a late
            # push for a closed round; in ssp it is past the staleness bound, acknowledged unapplied.
            results = dead.push(grad_for(dead.worker_id, 1))
            outcome = "DROPPED_LATE" if mode == "sync" else "DUPLICATE"
            assert [r["outcome"] for r in results] == [outcome, outcome]
            assert [r["next_clock"] for r in results] == [steps, steps]
            assert dead.clock == steps
            for server, before in zip(servers, versions_before):
                assert server.shard.version == before
                stats = server.shard.stats()
                assert stats["dropped_late" if mode == "sync" else "duplicates"] == 1
                assert member_clocks(server) == {alive[0].worker_id: steps, alive[1].worker_id: steps,
                                                 dead.worker_id: steps}
            # It trains on with the others: nobody is held back waiting for it to catch up.
            dead.start_heartbeats()
            run_threads([lambda c=c: live_worker(c, 2, start=steps) for c in (*alive, dead)], timeout=15)
            for server in servers:
                assert set(member_clocks(server).values()) == {steps + 2}
                assert server.shard.stats()["evictions"] == 1
        finally:
            for c in (*alive, dead):
                c.close()


@pytest.mark.timeout(10)
def test_rejoin_with_an_old_clock_lands_at_the_slowest_live_clock_policy_level():
    from psgrid.psserver.policy import ConsistencyPolicy, Outcome

    for mode, outcome in (("ssp", Outcome.DUPLICATE), ("sync", Outcome.DROP_LATE)):
        policy = ConsistencyPolicy(mode, staleness=1)
        for w in range(3):
            policy.join(w)
        for c in range(6):
            for w in (0, 1):
                policy.on_push(w, c)
            if c == 0:
                policy.on_push(2, 0)
            if c == 1:
                policy.leave(2)                     # evicted at clock 1
            policy.rounds_to_close()
        assert policy.slowest_clock() == 6
        policy.join(2, start_clock=1)               # what the client asks for: the clock it had
        decision = policy.on_push(2, 1)             # its stale push is not applied ...
        assert decision.outcome is outcome and decision.next_clock == 6
        assert policy.clocks[2] == 6                # ... and it is at the slowest live clock
        if mode == "ssp":
            assert policy.may_pull(0, 7)            # nobody waits for the rejoined worker to catch up
    # joining ahead of the others (a shard restored from an older checkpoint) keeps the clock asked for
    policy = ConsistencyPolicy("ssp", staleness=1)
    policy.join(0, start_clock=3)
    assert policy.join(1, start_clock=5) == 5


# ----- (c) joining a running job -------------------------------------------------------------------

@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["sync", "async", "ssp"])
def test_worker_joins_a_running_job_at_the_slowest_live_clock(mode):
    with in_process_cluster(2, mode=mode, staleness=3, lease_s=5, lr=0.01) as servers:
        addrs = addresses(servers)
        fast, slow = ShardedClient(addrs, deadline_s=10), ShardedClient(addrs, deadline_s=10)
        late = ShardedClient(addrs, deadline_s=10)
        try:
            for c in (fast, slow):
                c.register(SPEC)
            fast.init(np.zeros(SPEC.size, np.float32))
            if mode == "sync":
                run_threads([lambda: live_worker(fast, 3), lambda: live_worker(slow, 3)], timeout=15)
                live_worker(fast, 1, start=3)       # fast is at 4, round 3 is open waiting for slow
                expected = 3
            else:
                live_worker(fast, 3)
                live_worker(slow, 1)
                expected = 1
            assert late.register(SPEC) >= 0
            assert late.clock == expected
            for server in servers:
                assert member_clocks(server)[late.worker_id] == expected
                assert server.shard.stats()["min_clock"] == expected
            # the newcomer trains with the others at once
            params = SPEC.flat()
            late.pull(params)
            [result, _] = late.push(grad_for(late.worker_id, expected))
            assert result["outcome"] in ("APPLIED", "ACCUMULATED")
            assert late.clock == expected + 1
        finally:
            for c in (fast, slow, late):
                c.close()


# ----- (d) (f) a shard process: kill, restart from its checkpoint; stop cleanly ------------------------

def start_shard(tmp_path: Path, name: str, *args: str) -> tuple[subprocess.Popen, str]:
    """``psctl server`` in a subprocess; returns it and its address once published."""
    address_file = tmp_path / f"{name}.addr"
    address_file.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "PSCTL_PARENT_PID"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    log = open(tmp_path / f"{name}.log", "ab")
    try:
        proc = subprocess.Popen([sys.executable, "-m", "psgrid.cluster.cli", "server", "--shard", "0", "--num-shards", "1",
                                 "--address-file", str(address_file), *args],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    finally:
        log.close()
    deadline = time.monotonic() + 20
    while not address_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill(proc)
            raise AssertionError(f"shard did not start: {(tmp_path / f'{name}.log').read_text()}")
        time.sleep(0.05)
    return proc, address_file.read_text().strip()


def kill(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


def manifest_version(ckpt_dir: Path) -> int:
    return json.loads((ckpt_dir / "shard-0-of-1" / checkpoint.MANIFEST).read_text())["version"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("use_bulk", [True, False], ids=["bulk", "grpc"])
def test_killed_shard_restarts_from_its_checkpoint(tmp_path, use_bulk):
    every = 5
    ckpt = tmp_path / "ckpt"
    args = ["--mode", "async", "--optimizer", "adam", "--lr", "0.05", "--lease-s", "30",
            "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(every)]
    first = second = None
    try:
        first, address = start_shard(tmp_path, "first", "--port", "0", *args)
        port = int(address.rsplit(":", 1)[1])
        with ShardedClient([address], retry_s=15, deadline_s=5, bulk=use_bulk) as client:
            client.register(SPEC)
            client.init(np.zeros(SPEC.size, np.float32))
            assert (client.bulk[0] is not None) == use_bulk
            old_bulk_port = client.bulk[0].port if use_bulk else None
            params = SPEC.flat()
            history = {}                    # version -> weights
            for step in range(12):
                client.pull(params)
                history[client.versions[0]] = params.copy()
                client.push(grad_for(0, step))
            client.pull(params)
            history[client.versions[0]] = params.copy()
            assert client.versions == [12] and manifest_version(ckpt) == 10

            os.kill(first.pid, signal.SIGKILL)
            first.wait(timeout=10)
            # The client's next pull starts while the shard is down and retries until it is back.
            result = {}

            def pull():
                try:
                    result["versions"] = client.pull(params)
                except BaseException as exc:  # noqa: BLE001 - reported below
                    result["error"] = exc

            t0 = time.monotonic()
            waiter = threading.Thread(target=pull, daemon=True)
            waiter.start()
            time.sleep(0.3)
            assert waiter.is_alive()
            second, address2 = start_shard(tmp_path, "second", "--port", str(port), *args)
            assert address2 == address
            waiter.join(20)
            assert not waiter.is_alive(), "pull still retrying 20 s after the shard came back"
            assert "error" not in result, result.get("error")
            recovered_in = time.monotonic() - t0
            # The restored shard holds the last checkpoint: at most `every` updates were lost.
            assert result["versions"] == [10] and 12 - result["versions"][0] <= every
            np.testing.assert_array_equal(params, history[10])
            # A push goes through too, and the optimizer state (Adam moments, step count) came back:
            # the update equals the one a shard that never died makes from version 10.
            [reply] = client.push(grad_for(0, 99))
            assert reply["outcome"] == "APPLIED" and reply["version"] == 11
            client.pull(params)
            np.testing.assert_array_equal(params, reference_after(10, grad_for(0, 99)))
            if use_bulk:
                # the restarted shard's new bulk port was learned, and the data plane is in use again
                assert client.bulk[0] is not None and client.bulk[0].port != old_bulk_port
                assert client.bulk[0].idle, "no pooled bulk connection: the last calls did not use the bulk plane"
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
    with in_process_cluster(1, mode="async", optimizer="adam", lr=0.05) as servers:
        with ShardedClient(addresses(servers), bulk=False) as client:
            client.register(SPEC)
            client.init(np.zeros(SPEC.size, np.float32))
            for step in range(versions):
                client.push(grad_for(0, step))
            client.push(extra)
            out = SPEC.flat()
            client.pull(out)
            return out


@pytest.mark.timeout(40)
def test_shutdown_rpc_stops_psctl_server_with_a_final_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = None
    try:
        proc, address = start_shard(tmp_path, "shard", "--port", "0", "--mode", "sync",
                                    "--checkpoint-dir", str(ckpt))   # no periodic checkpoints
        with ShardedClient([address], deadline_s=5, retry_s=2) as client:
            client.register(SPEC)
            client.init(np.zeros(SPEC.size, np.float32))
            for step in range(3):
                client.pull(SPEC.flat())
                client.push(grad_for(0, step))
            assert not (ckpt / "shard-0-of-1" / checkpoint.MANIFEST).exists()
            client.shutdown()
            assert proc.wait(timeout=15) == 0
        assert manifest_version(ckpt) == 3
        arrays, meta = checkpoint.load_latest(ckpt / "shard-0-of-1")
        assert meta["clocks"] == {"0": 3} and arrays["weights"].shape == (SPEC.size,)
    finally:
        kill(proc)


# ----- (e) checkpoint files are atomic --------------------------------------------------------------

def small_checkpointing_cluster(ckpt: Path, **kw):
    return in_process_cluster(1, mode="async", optimizer="adam", lr=0.05, checkpoint_dir=str(ckpt), **kw)


@pytest.mark.timeout(30)
def test_restore_trusts_only_the_manifest(tmp_path):
    ckpt = tmp_path / "ckpt"
    with small_checkpointing_cluster(ckpt, checkpoint_every=3) as servers:
        with ShardedClient(addresses(servers), bulk=False) as client:
            client.register(SPEC)
            client.init(np.zeros(SPEC.size, np.float32))
            for step in range(7):
                client.push(grad_for(0, step))
        weights = servers[0].shard.weights.copy()
        opt = servers[0].shard.optimizer.state_dict()
    # stop() wrote a final checkpoint of version 7; only KEEP files remain
    d = ckpt / "shard-0-of-1"
    assert manifest_version(ckpt) == 7
    assert sorted(p.name for p in d.glob("ckpt-*.npz")) == ["ckpt-000000000006.npz", "ckpt-000000000007.npz"]
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
    finally:
        server.stop(grace=0.5)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("crash_at", ["array file", "manifest write", "manifest rename"])
def test_a_crash_during_save_leaves_the_previous_checkpoint(tmp_path, monkeypatch, crash_at):
    ckpt = tmp_path / "ckpt"
    d = ckpt / "shard-0-of-1"
    with small_checkpointing_cluster(ckpt) as servers:
        shard = servers[0].shard
        with ShardedClient(addresses(servers), bulk=False) as client:
            client.register(SPEC)
            client.init(np.zeros(SPEC.size, np.float32))
            client.push(grad_for(0, 0))
            client.checkpoint()
            saved = shard.weights.copy()
            client.push(grad_for(0, 1))

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
            client.checkpoint()
            assert checkpoint.load_latest(d)[1]["version"] == 2


# ----- found in review: shutdown releases waits, checkpoints keep open rounds and never break training

@pytest.mark.timeout(30)
def test_stopping_a_server_releases_a_waiting_pull():
    servers = [serve(ServerConfig(mode="sync", lr=0.1))]
    try:
        waiting, other = (ShardedClient(addresses(servers), retry_s=0.5, deadline_s=30) for _ in range(2))
        for c in (waiting, other):
            c.register(SPEC)
        waiting.init(np.zeros(SPEC.size, np.float32))
        waiting.push(np.ones(SPEC.size, np.float32))       # round 0 waits for `other`
        outcome = {}

        def pull():
            start = time.monotonic()
            try:
                waiting.pull(SPEC.flat())
            except Exception as exc:  # noqa: BLE001 - what it raised is the point
                outcome["error"] = exc
            outcome["seconds"] = time.monotonic() - start

        thread = threading.Thread(target=pull, daemon=True)
        thread.start()
        time.sleep(0.5)
        started = time.monotonic()
        servers[0].stop(grace=0.5)
        assert time.monotonic() - started < 8, "stop() waited for the pull's deadline"
        thread.join(timeout=10)
        assert not thread.is_alive() and "error" in outcome and outcome["seconds"] < 10
    finally:
        for s in servers:
            s.stop()
        for c in (waiting, other):
            c.close()


@pytest.mark.timeout(30)
def test_a_failing_checkpoint_does_not_stop_training(tmp_path):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the checkpoint directory should be")
    with in_process_cluster(1, mode="sync", lr=0.5, checkpoint_dir=str(blocker), checkpoint_every=1) as servers:
        clients = [ShardedClient(addresses(servers)) for _ in range(2)]
        try:
            for c in clients:
                c.register(SPEC)
            clients[0].init(np.zeros(SPEC.size, np.float32))
            for step in range(3):
                for c in clients:
                    c.pull(SPEC.flat())
                    c.push(np.ones(SPEC.size, np.float32))
            shard = servers[0].shard
            assert shard.version == 3 and shard.policy.closed_rounds == 3 and not shard.round_grads
            np.testing.assert_allclose(shard.weights, -1.5)
        finally:
            for c in clients:
                c.close()


@pytest.mark.timeout(30)
def test_a_checkpoint_keeps_the_gradients_of_an_open_sync_round(tmp_path):
    from psgrid.psserver.shard import Shard

    config = ServerConfig(mode="sync", lr=1.0, checkpoint_dir=str(tmp_path))
    shard = Shard(config)
    shard.init(SPEC, np.zeros(SPEC.size, np.float32))
    for worker in (0, 1):
        shard.register(SPEC.hash(), worker, -1, "test")
    shard.push(0, 0, 0, np.full(SPEC.size, 2.0, np.float32), 0)     # held: round 0 waits for worker 1
    shard.checkpoint()
    restored = Shard(config)                                          # a restart
    assert restored.push(0, 0, 0, np.full(SPEC.size, 2.0, np.float32), 0).outcome.name == "DUPLICATE"
    restored.push(1, 0, 0, np.full(SPEC.size, 4.0, np.float32), 0)   # closes round 0 with both
    np.testing.assert_allclose(restored.weights, -3.0)
