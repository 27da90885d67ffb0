"""Device shards (shard_device = "gpu") and the CUDA IPC plane: run where a GPU is, skipped elsewhere.

The device shard must do the host shard's maths (same pushes, same weights to float32 rounding),
keep its state through a checkpoint, and serve GPU workers of other processes over CUDA IPC as the
shared-memory plane serves host workers: a bad request is refused with its reason, a worker that
dies mid-push takes nothing with it, and a worker's slots are freed with its connection.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from psgrid.psserver.config import ServerConfig
from psgrid.psserver.protocol import FLOAT16, FLOAT32, Outcome, Reason, Status
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.transports.local_gradient import CallerArray
from tests.gpu import cupy_or_skip

pytestmark = pytest.mark.gpu
SPEC = ModelSpec([("w", (64, 33)), ("b", (33,))])
OPTIMIZERS = [
    dict(optimizer="sgd", lr=0.1),
    dict(optimizer="sgd", lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    dict(optimizer="adam", lr=0.01, weight_decay=0.001),
    # a rate warmed up, then decayed to zero before the last updates (async's 12): lr_scale 0 on the device too
    dict(optimizer="adam", lr=0.01, lr_schedule="cosine", lr_updates=8, lr_warmup=0.25),
]


def _push(shard, worker, clock, version, values):
    """Push host ``values`` as a network plane's landing would hand them to the shard."""
    grad = shard.landing_pool.take()
    grad[...] = values
    result, kept = shard.push(worker, clock, version, grad, grad.nbytes)
    if not kept:
        shard.landing_pool.give(grad)
    return result


def _weights(shard) -> np.ndarray:
    return shard.arrays.download(shard.weights)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("hparams", OPTIMIZERS, ids=["sgd", "nesterov-wd", "adam", "adam-cosine"])
def test_a_device_shard_applies_what_a_host_shard_applies(mode, hparams):
    cupy_or_skip()
    from psgrid.psserver.state.shard import Shard

    rng = np.random.default_rng(3)
    init = rng.normal(size=SPEC.size).astype(np.float32)
    shards = [Shard(ServerConfig(mode=mode, shard_device=device, **hparams)) for device in ("cpu", "gpu")]
    for shard in shards:
        shard.init(SPEC, init.copy())
        for worker in (0, 1):
            shard.register(SPEC.hash(), worker, -1, "test")
    assert shards[1].arrays.on_gpu and not shards[0].arrays.on_gpu
    for clock in range(6):
        for worker in (0, 1):
            grad = rng.normal(size=SPEC.size).astype(np.float32)
            results = [_push(s, worker, clock, s.version, grad) for s in shards]
            assert results[0] == results[1]
    host, device = (_weights(s) for s in shards)
    assert shards[0].version == shards[1].version == (12 if mode == "async" else 6)
    np.testing.assert_allclose(device, host, rtol=2e-5, atol=2e-6)
    assert not np.allclose(device, init)
    assert shards[1].pool.on_loan == 0 and shards[1].landing_pool.on_loan == 0


@pytest.mark.timeout(60)
def test_a_device_shard_refuses_a_gradient_with_nan_and_changes_nothing():
    cupy_or_skip()
    from psgrid.psserver.exceptions import InvalidArgument
    from psgrid.psserver.state.shard import Shard

    shard = Shard(ServerConfig(mode="async", shard_device="gpu", lr=0.1, momentum=0.9))
    shard.init(SPEC, np.ones(SPEC.size, np.float32))
    shard.register(SPEC.hash(), 0, -1, "test")
    bad = np.ones(SPEC.size, np.float32)
    bad[7] = np.nan
    with pytest.raises(InvalidArgument) as refused:
        _push(shard, 0, 0, 0, bad)
    assert refused.value.reason is Reason.NON_FINITE
    np.testing.assert_array_equal(_weights(shard), 1.0)
    assert shard.version == 0 and shard.policy.clocks[0] == 0
    assert _push(shard, 0, 0, 0, np.ones(SPEC.size, np.float32)).outcome is Outcome.APPLIED


def _slot_push(service, worker, clock, values):
    """Push host ``values`` from a CUDA IPC slot, as the IPC plane hands one to the shard (its checked copy)."""
    import cupy

    from psgrid.psserver.transports.ipc_server import DeviceSlot

    arrays = service.shard.arrays
    with arrays.use():
        slot = cupy.asarray(values)
        arrays.finished()
    return service.push(worker_id=worker, clock=clock, version=service.shard.version, source=DeviceSlot(slot, arrays))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("hparams", OPTIMIZERS[1:3], ids=["nesterov-wd", "adam"])
def test_a_slots_gradient_with_nan_is_refused_and_changes_nothing_the_next_update_reads(mode, hparams):
    """In async the slot's check stays on the GPU for the update to read: a NaN stops the update there.
    The optimizer's state and step count (Adam's bias correction) must be as if the push never came."""
    cupy_or_skip()
    from psgrid.psserver.exceptions import InvalidArgument
    from psgrid.psserver.service import ShardService
    from psgrid.psserver.state.shard import Shard

    rng = np.random.default_rng(5)
    init = rng.normal(size=SPEC.size).astype(np.float32)
    grads = [rng.normal(size=SPEC.size).astype(np.float32) for _ in range(3)]
    bad = grads[1].copy()
    bad[SPEC.size - 1] = np.inf
    bad[3] = np.nan
    host = Shard(ServerConfig(mode=mode, shard_device="cpu", **hparams))
    device = ShardService(Shard(ServerConfig(mode=mode, shard_device="gpu", **hparams)))
    for shard in (host, device.shard):
        shard.init(SPEC, init.copy())
        shard.register(SPEC.hash(), 0, -1, "test")
    for clock, grad in enumerate(grads):
        _push(host, 0, clock, host.version, grad)
        if clock == 1:
            before = (_weights(device.shard), device.shard.optimizer.state_dict(), device.shard.version)
            with pytest.raises(InvalidArgument) as refused:
                _slot_push(device, 0, clock, bad)
            assert refused.value.reason is Reason.NON_FINITE
            weights, state, version = before
            np.testing.assert_array_equal(_weights(device.shard), weights)
            for key, value in device.shard.optimizer.state_dict().items():
                np.testing.assert_array_equal(value, state[key])
            assert device.shard.version == version and device.shard.policy.clocks[0] == clock
        assert _slot_push(device, 0, clock, grad).outcome is Outcome.APPLIED
    np.testing.assert_allclose(_weights(device.shard), _weights(host), rtol=2e-5, atol=2e-6)
    assert device.shard.optimizer.steps == host.optimizer.steps == 3
    assert device.shard.pool.on_loan == 0


@pytest.mark.timeout(60)
def test_each_check_queued_on_the_shards_stream_keeps_its_own_answer():
    """Two checks queued before either is read (two workers' handler threads, one stream): each flag is its own."""
    cupy = cupy_or_skip()
    from psgrid.psserver.state.device import GpuArrays

    arrays = GpuArrays(0)
    bad, good = cupy.ones(1000, cupy.float32), cupy.ones(1000, cupy.float32)
    bad[999] = cupy.nan
    first = arrays.check_into(arrays.empty(1000), bad)
    second = arrays.check_into(arrays.empty(1000), good)
    third = arrays.check_into(arrays.empty(1000), bad)
    assert [arrays.flagged(f) for f in (second, first, third)] == [False, True, True]


@pytest.mark.timeout(120)
def test_workers_pushing_from_their_slots_at_once_each_get_their_own_checks_answer():
    """Handler threads of several workers check their slots at once on the shard's one stream: a NaN of one
    must never be taken for the other's, nor pass as finite because the other's check was read."""
    cupy_or_skip()
    import threading

    from psgrid.psserver.exceptions import InvalidArgument
    from psgrid.psserver.service import ShardService
    from psgrid.psserver.state.shard import Shard

    service = ShardService(Shard(ServerConfig(mode="async", shard_device="gpu", lr=1e-3)))
    service.shard.init(SPEC, np.zeros(SPEC.size, np.float32))
    for worker in (0, 1):
        service.shard.register(SPEC.hash(), worker, -1, "test")
    bad = np.ones(SPEC.size, np.float32)
    bad[11] = np.nan
    outcomes = {0: [], 1: []}

    def pusher(worker: int, values: np.ndarray) -> None:
        for _ in range(60):
            clock = service.shard.policy.clocks[worker]  # a refused push leaves it where it was
            try:
                outcomes[worker].append(_slot_push(service, worker, clock, values).outcome)
            except InvalidArgument as exc:
                outcomes[worker].append(exc.reason)

    threads = [
        threading.Thread(target=pusher, args=(0, bad)),
        threading.Thread(target=pusher, args=(1, np.ones_like(bad))),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    assert outcomes[0] == [Reason.NON_FINITE] * 60
    assert outcomes[1] == [Outcome.APPLIED] * 60
    weights = _weights(service.shard)
    assert np.isfinite(weights).all() and service.shard.version == 60
    np.testing.assert_allclose(weights, -60e-3, rtol=1e-4)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_device_checkpoint_restores_on_the_device_and_on_the_host(tmp_path, mode):
    cupy_or_skip()
    from psgrid.psserver.state.shard import Shard

    config = dict(mode=mode, optimizer="adam", lr=0.01, checkpoint_dir=str(tmp_path))
    shard = Shard(ServerConfig(shard_device="gpu", **config))
    shard.init(SPEC, np.zeros(SPEC.size, np.float32))
    for worker in (0, 1):
        shard.register(SPEC.hash(), worker, -1, "test")
    rng = np.random.default_rng(1)
    for clock in range(3):
        for worker in (0, 1):
            _push(shard, worker, clock, shard.version, rng.normal(size=SPEC.size).astype(np.float32))
    if mode == "sync":  # an open round: worker 0's gradient of clock 3 is held on the device
        _push(shard, 0, 3, shard.version, np.full(SPEC.size, 0.5, np.float32))
    shard.checkpoint()
    saved = _weights(shard)
    state = shard.optimizer.state_dict()
    last = np.full(SPEC.size, 0.25, np.float32)
    expected = None
    for device in ("gpu", "cpu"):
        restored = Shard(ServerConfig(shard_device=device, **config))
        assert restored.version == shard.version
        np.testing.assert_array_equal(_weights(restored), saved)
        for key, value in restored.optimizer.state_dict().items():
            np.testing.assert_allclose(value, state[key], rtol=1e-6)
        _push(restored, 1, 3, restored.version, last)  # closes the held round (sync), or applies (async)
        after = _weights(restored)
        if expected is None:
            expected = after
        np.testing.assert_allclose(after, expected, rtol=2e-5, atol=2e-6)
        assert not np.array_equal(after, saved)


# ----- the CUDA IPC plane: the shard here, its clients in processes of their own ---------------------

CLIENT = textwrap.dedent("""
    import json, sys
    import cupy, numpy as np
    from psgrid.psserver.client.client import Client
    from psgrid.psserver.spec import ModelSpec
    address, worker, pushes, value = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    spec = ModelSpec([("w", (64, 33)), ("b", (33,))])
    cupy.cuda.Device(0).use()
    with Client([address], spec, worker_id=worker, init=np.zeros(spec.size, np.float32), gpu=0,
                deadline_s=20, retry_s=5) as client:
        params = cupy.zeros(spec.size, cupy.float32)
        grad = cupy.full(spec.size, value, cupy.float32)
        for _ in range(pushes):
            client.pull(into=lambda b, e, v: params[b:e].__setitem__(Ellipsis, v) or cupy.cuda.Device(0).synchronize())
            client.push(grad)
        client.pull(into=lambda b, e, v: params[b:e].__setitem__(Ellipsis, v) or cupy.cuda.Device(0).synchronize())
        print(json.dumps({"planes": client.data_planes, "device_push": client.takes_device_gradients(),
                          "w0": float(params[0]), "version": client.versions[0]}), flush=True)
        if len(sys.argv) > 5:            # hold on, pushing, until killed
            print("ready", flush=True)
            while True:
                client.push(grad)
""")


WRITER = textwrap.dedent("""
    import sys
    import cupy, numpy as np
    from psgrid.psserver.client.client import Client
    from psgrid.psserver.spec import ModelSpec
    spec = ModelSpec([("w", (64, 33)), ("b", (33,))])
    cupy.cuda.Device(0).use()
    with Client([sys.argv[1]], spec, worker_id=0, init=np.zeros(spec.size, np.float32), gpu=0, deadline_s=20) as client:
        def scribble(begin, end, values):       # the mapped version: writable, as every IPC mapping is
            values.fill(1e9)
            cupy.cuda.Device(0).synchronize()
        client.pull(into=scribble)
        client.push(cupy.ones(spec.size, cupy.float32))
    print("done", flush=True)
""")


def _run_client(address, worker, pushes, value, *extra, timeout=90):
    return subprocess.run(
        [sys.executable, "-c", CLIENT, address, str(worker), str(pushes), str(value), *extra],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


@pytest.fixture
def device_server():
    cupy_or_skip()
    from psgrid.psserver.server import serve

    servers = []

    def start(**settings):
        settings.setdefault("job_id", "ipc-test")
        servers.append(serve(ServerConfig(host="127.0.0.1", port=0, shard_device="gpu", **settings)))
        return servers[-1]

    yield start
    for server in servers:
        server.stop()


@pytest.mark.timeout(180)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_gpu_workers_of_other_processes_train_over_cuda_ipc(device_server, mode):
    server = device_server(mode=mode, lr=0.5)
    assert dict(server.service.offers())["ipc"].count("|") == 2 and "shm" not in dict(server.service.offers())
    done = _run_client(server.address, 0, 4, 1.0)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["planes"] == ["ipc"] and seen["device_push"] is True
    assert seen["w0"] == pytest.approx(-0.5 * 4) and seen["version"] == 4
    assert server.ipc.slots == 0, "the worker's slots are freed with its connection"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_reader_that_writes_a_published_version_changes_no_update(device_server, mode):
    server = device_server(mode=mode, lr=0.5, momentum=0.9)
    done = subprocess.run([sys.executable, "-c", WRITER, server.address], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0 and "done" in done.stdout, done.stderr[-2000:]
    weights = server.shard.arrays.download(server.shard.weights)
    np.testing.assert_allclose(weights, -0.5)  # 0 - lr * 1: the scribbled version was never read
    seen = json.loads(_run_client(server.address, 1, 0, 0.0).stdout.splitlines()[-1])
    assert seen["w0"] == pytest.approx(-0.5)  # the version served now is the shard's, published anew


def _raw(server, token=None) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect("\0" + server.ipc.socket_name[1:])
    return sock


@pytest.mark.timeout(120)
def test_the_ipc_plane_refuses_bad_requests_with_their_reason(device_server):
    from psgrid.psserver.exceptions import PSError
    from psgrid.psserver.transports.stream_frames import (
        ATTACH,
        MAGIC,
        REQUEST,
        attach_request,
        dtype_byte,
        map_request,
        push_request,
        read_reply,
    )

    server = device_server(mode="async", lr=0.1)
    assert _run_client(server.address, 0, 1, 0.0).returncode == 0  # the shard has weights now
    sock = _raw(server)
    cases = [
        (map_request(99), Reason.BAD_VALUE),  # no such ring buffer
        (attach_request(dtype_byte(FLOAT16, 0), 0), Reason.BAD_DTYPE),  # slots hold float32 only
        (attach_request(dtype_byte(FLOAT32, 3), 0), Reason.BAD_DTYPE),  # two slots: 0 and 1
        (push_request(dtype_byte(FLOAT32, 1), 0, 1, 0, 0, 5.0), Reason.BAD_DTYPE),  # no slot attached
    ]
    for frame, reason in cases:
        sock.sendall(frame)
        with pytest.raises(PSError) as refused:
            read_reply(sock, "test")
        assert refused.value.status == Status.INVALID_ARGUMENT and refused.value.reason is reason
    sock.sendall(REQUEST.pack(MAGIC, ATTACH, dtype_byte(FLOAT32, 0), 0, 0, 0, 64, 0.0) + b"x" * 64)
    with pytest.raises(PSError) as refused:
        read_reply(sock, "test")  # an ATTACH with a payload: not this plane's
    assert refused.value.reason is Reason.MALFORMED
    sock.close()
    assert _run_client(server.address, 1, 1, 0.0).returncode == 0  # still serving
    assert server.ipc.slots == 0


@pytest.mark.timeout(180)
def test_a_worker_killed_mid_push_leaves_the_shard_serving_and_its_slots_are_reused(device_server):
    server = device_server(mode="async", lr=0.1, lease_s=2.0)
    with subprocess.Popen(
        [sys.executable, "-c", CLIENT, server.address, "0", "1", "1.0", "hold"],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    ) as victim:
        _kill_mid_push(server, victim)
    deadline = time.monotonic() + 30
    while (server.ipc.slots or 0 in server.shard.policy.clocks) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.ipc.slots == 0, "a dead worker's slots are freed with its connection"
    assert 0 not in server.shard.policy.clocks, "its lease ran out"
    version = server.shard.version
    done = _run_client(server.address, 1, 3, 0.0)  # slots made afresh for the next worker
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["planes"] == ["ipc"] and seen["version"] == version + 3
    assert np.isfinite(server.shard.checksum())


def _kill_mid_push(server, victim) -> None:
    try:
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline and victim.stdout.readline().strip() != "ready":
            pass
        assert server.ipc.slots >= 1
        time.sleep(0.2)  # pushing in a loop: killed in the middle of one
        os.kill(victim.pid, signal.SIGKILL)
        victim.wait(timeout=30)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait(timeout=30)


@pytest.mark.timeout(60)
def test_a_device_shard_refuses_a_range_its_gpu_cannot_hold_before_it_allocates(device_server):
    from psgrid.psserver.exceptions import InvalidArgument

    cupy = cupy_or_skip()
    server = device_server(mode="async", lr=0.1)
    # Weights alone as large as the GPU's free memory (its buffers make several times that), whatever the card.
    elements = cupy.cuda.runtime.memGetInfo()[0] // 4 + 1
    huge = ModelSpec([("w", (elements,))])
    with pytest.raises(InvalidArgument) as refused:
        server.service.open_init([("w", (elements,), "float32")], huge.hash())
    assert refused.value.reason is Reason.BAD_SPEC and "MiB free" in str(refused.value)
    assert not server.shard.initialized


def _launch_mnist_on_device_shards(out, pipe_dir, *extra: str) -> tuple[dict, set, str]:
    """psctl launch of the default job on GPU workers and device shards, CUDA told to find MPS in ``pipe_dir``."""
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe_dir)}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "psgrid.cluster.cli",
            "launch",
            "--config",
            "mnist",
            "--device",
            "gpu",
            "--set",
            "shard_device=gpu",
            "--out",
            str(out),
            "--no-progress",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=280,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    starts = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"start"' in line]
    planes = {p for event in starts if event.get("event") == "start" for p in event.get("data_planes") or []}
    return summary, planes, done.stderr


@pytest.mark.timeout(300)
def test_the_default_job_trains_on_device_shards_over_cuda_ipc(tmp_path):
    cupy_or_skip()
    summary, planes, said = _launch_mnist_on_device_shards(tmp_path / "run", tmp_path / "no-mps-here")
    assert summary["shard_device"] == "gpu" and planes == {"ipc"}
    assert summary["test_accuracy"] >= 0.9, summary["test_accuracy"]
    assert "without MPS" in said and "--mps" in said  # the launcher says what would help


@pytest.mark.timeout(300)
def test_with_mps_the_job_starts_its_own_daemon_trains_over_cuda_ipc_under_it_and_quits_it(tmp_path):
    import shutil

    cupy_or_skip()
    if shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("no MPS control daemon (nvidia-cuda-mps-control) on this machine")
    out = tmp_path / "run"
    summary, planes, said = _launch_mnist_on_device_shards(out, tmp_path / "no-mps-here", "--mps")
    assert summary["shard_device"] == "gpu" and planes == {"ipc"}
    assert summary["test_accuracy"] >= 0.9, summary["test_accuracy"]
    assert "without MPS" not in said, said
    keeper = (out / "logs" / "mps.log").read_text()  # the keeper's lines and the daemon's own, in the foreground
    if os.environ.get("OUT"):  # the device scripts' output folder: the log comes back with them
        Path(os.environ["OUT"], "mps-test-daemon.log").write_text(keeper)
    # An MPS server ran for the job's clients (the daemon starts one at its first client's first CUDA call).
    assert "server" in keeper.lower(), keeper[-3000:]
    assert "quit (asked)" in keeper, keeper


@pytest.mark.timeout(300)
def test_the_default_job_trains_with_each_device_shard_in_its_workers_process(tmp_path):
    # shard_placement = "worker": each worker calls its own shard on the GPU and reaches the other's over IPC.
    cupy_or_skip()
    out = tmp_path / "run"
    summary, planes, said = _launch_mnist_on_device_shards(
        out, tmp_path / "no-mps-here", "--set", "shard_placement=worker"
    )
    assert summary["shard_device"] == "gpu" and summary["test_accuracy"] >= 0.9, summary["test_accuracy"]
    starts = {
        e["rank"]: e["data_planes"]
        for e in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
        if e.get("event") == "start"
    }
    assert starts == {0: ["local", "ipc"], 1: ["ipc", "local"]}, starts
    assert "shard_placement = worker" in said and not (out / "logs" / "server-0.log").exists()


@pytest.mark.timeout(300)
def test_under_an_mps_daemon_the_job_trains_over_cuda_ipc_and_nothing_is_said(tmp_path):
    # MPS gives the shard and the workers one GPU context; CUDA IPC must work between its clients.
    import shutil

    from psgrid.cluster.job.shard_device import mps_serving

    cupy_or_skip()
    control = shutil.which("nvidia-cuda-mps-control")
    if control is None:
        pytest.skip("no MPS control daemon (nvidia-cuda-mps-control) on this machine")
    pipe, logs = tmp_path / "mps-pipe", tmp_path / "mps-log"
    pipe.mkdir()
    logs.mkdir()
    env = {**os.environ, "CUDA_MPS_PIPE_DIRECTORY": str(pipe), "CUDA_MPS_LOG_DIRECTORY": str(logs)}
    daemon = subprocess.Popen(
        [control, "-f"], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )  # in the foreground: this test's child, ended by its pid
    try:
        deadline = time.monotonic() + 30
        while not mps_serving(env) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert mps_serving(env), "the MPS control daemon made no pipe"
        summary, planes, said = _launch_mnist_on_device_shards(tmp_path / "run", pipe)
        assert planes == {"ipc"} and "without MPS" not in said, said
        assert summary["test_accuracy"] >= 0.9, summary["test_accuracy"]
    finally:
        subprocess.run([control], input="quit\n", text=True, env=env, timeout=30, capture_output=True)
        try:
            daemon.wait(timeout=30)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait(timeout=10)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("plane", ["tcp", "grpc"])
@pytest.mark.parametrize("mode", ["async", "sync"])
def test_a_remote_worker_trains_a_device_shard_over_a_network_plane(device_server, plane, mode):
    from psgrid.psserver.client.client import Client
    from psgrid.psserver.exceptions import InvalidArgument

    server = device_server(mode=mode, lr=0.5, data_plane="tcp")
    # Both planes' float32 payloads go on to the GPU as they come (TCP in pieces, gRPC chunks 8 MiB at a
    # time), never as one copy of the whole landing after the receive.
    server.shard.pushes._push_staged = lambda *a, **k: pytest.fail(f"a {plane} push went to the GPU whole")
    size = 3_000_000  # 12 MB: a TCP payload goes to the GPU in more than one piece, gRPC's 12 chunks in two
    spec = ModelSpec([("w", (size,))])
    with Client(
        [server.address],
        spec,
        worker_id=0,
        init=np.zeros(size, np.float32),
        data_plane=plane,
        shared_memory=False,
        deadline_s=30,
    ) as client:
        grad = np.linspace(-1.0, 1.0, size, dtype=np.float32)
        for _ in range(3):
            client.push(grad)
        bad = grad.copy()
        bad[size - 1] = np.inf
        with pytest.raises(InvalidArgument):
            client.push(bad)
        out = np.empty(size, np.float32)
        client.pull(out)
        assert client.data_planes == [plane]
    np.testing.assert_allclose(out, -1.5 * grad, rtol=1e-6, atol=1e-6)
    assert server.shard.pool.on_loan == 0 and server.shard.landing_pool.on_loan == 0


@pytest.mark.timeout(180)
def test_a_worker_on_another_gpu_reaches_the_shard_by_peer_access_or_a_network_plane(device_server):
    cupy = cupy_or_skip()
    if cupy.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs: a shard on one, its worker on the other")
    server = device_server(mode="async", lr=0.5, gpu=1)  # the worker (CLIENT) computes on GPU 0
    peer = bool(cupy.cuda.runtime.deviceCanAccessPeer(0, 1))
    done = _run_client(server.address, 0, 4, 1.0)
    assert done.returncode == 0, done.stderr[-2000:]
    seen = json.loads(done.stdout.splitlines()[-1])
    assert seen["planes"] == (["ipc"] if peer else ["tcp"]), (peer, seen)
    assert seen["w0"] == pytest.approx(-0.5 * 4) and seen["device_push"] is peer


@pytest.mark.timeout(420)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_killed_device_shard_restarts_from_its_checkpoint_and_a_stopped_job_resumes(tmp_path, mode):
    # psctl launch on GPU workers and device shards: a shard killed mid-run comes back from its
    # checkpoint onto its GPU (--restart-failed), then the job, stopped by Ctrl-C, resumes (--resume)
    # from the device shards' checkpoints and finishes its steps.
    from tests.support import Launch, child_pids, steps_seen

    cupy_or_skip()
    every, steps, ckpt = 10, 2000, tmp_path / "ckpt"
    args = [
        "--config",
        "mnist",
        "--eval-every",
        "0",
        "--no-progress",
        "--lease-s",
        "2",
        "--device",
        "gpu",
        "--set",
        "shard_device=gpu",
        "--mode",
        mode,
        "--shards",
        "2",
        "--steps",
        str(steps),
        "--restart-failed",
        "--set",
        f"checkpoint_dir={ckpt}",
        "--set",
        f"checkpoint_every={every}",
        "--set",
        'stragglers=["0:exp:10", "1:exp:10"]',
    ]  # 10 ms a step: the kill and Ctrl-C land mid-run
    with Launch(tmp_path, *args, log="first.log") as launch:
        launch.wait_for(lambda: steps_seen(launch.out, 0) >= 40, 120, "worker 0 training")
        victim = child_pids(launch.out)["shards"][1]
        os.kill(victim, signal.SIGKILL)
        launch.wait_for(lambda: "restarting it on" in launch.text(), 60, "the shard's restart")
        launch.wait_for(lambda: steps_seen(launch.out, 0) >= 150, 180, "training after the restart")
        launch.proc.send_signal(signal.SIGINT)
        assert launch.wait(60) == 128 + signal.SIGINT, launch.text()
        first = launch.text()
    assert "server 1 was killed by SIGKILL (exit code -9)" in first, first
    assert "restored its checkpoint at version" in (launch.out / "logs" / "server-1.log").read_text()
    with Launch(
        tmp_path, "--no-progress", "--resume", str(tmp_path / "run"), "--set", "stragglers=[]", log="resume.log"
    ) as resumed:
        code = resumed.wait(240)
        text = resumed.text()
    assert code == 0, text
    summary = json.loads((resumed.out / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["shard_device"] == "gpu", summary
    assert all(s["restored_version"] > 0 for s in summary["shard_stats"]), summary["shard_stats"]
    assert all(w["completed"] for w in summary["worker_results"])
    assert summary["worker_results"][0]["steps"] < steps  # the resumed attempt made only what was left
    assert summary["test_accuracy"] > 0.85, summary["test_accuracy"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_gpu_workers_of_the_shards_own_process_call_it_and_push_device_gradients_in_place(mode):
    """The in-process plane on a device shard: pulls lend the GPU buffer, pushes are read where computed."""
    cupy = cupy_or_skip()
    from psgrid.psserver.client.client import Client
    from psgrid.psserver.exceptions import InvalidArgument
    from psgrid.psserver.server import serve
    from tests.support import run_threads

    cupy.cuda.Device(0).use()
    server = serve(
        ServerConfig(host="127.0.0.1", port=0, shard_device="gpu", mode=mode, lr=0.5, job_id="local-gpu"),
        in_process_clients=True,
    )
    try:
        clients = [
            Client(
                [server.address], SPEC, worker_id=w, world=2, init=np.zeros(SPEC.size, np.float32), gpu=0, deadline_s=20
            )
            for w in (0, 1)
        ]
        run_threads([c.join for c in clients], timeout=60)
        params = [cupy.empty(SPEC.size, cupy.float32) for _ in clients]

        def pull(i):
            def land(begin, end, values):
                assert isinstance(values, cupy.ndarray)  # the shard's own GPU buffer, lent
                params[i][begin:end] = values
                cupy.cuda.Device(0).synchronize()

            clients[i].pull(into=land)

        for i in (0, 1):
            pull(i)
        assert [c.data_planes for c in clients] == [["local"], ["local"]]
        assert all(c.takes_device_gradients() for c in clients)
        grads = [cupy.full(SPEC.size, 1.0, cupy.float32), cupy.full(SPEC.size, 3.0, cupy.float32)]
        clients[0].push(grads[0])
        grads[0].fill(cupy.nan)  # answered: a round still open must not read it again
        clients[1].push(grads[1])
        for i in (0, 1):
            pull(i)
        expected = -0.5 * (2.0 if mode == "sync" else 4.0)  # the round's mean; or each push in turn
        assert clients[0].versions[0] == (1 if mode == "sync" else 2)
        np.testing.assert_allclose(cupy.asnumpy(params[0]), expected)
        np.testing.assert_allclose(_weights(server.shard), expected)
        bad = cupy.zeros(SPEC.size, cupy.float32)
        bad[5] = cupy.inf
        with pytest.raises(InvalidArgument) as refused:
            server.service.push(worker_id=0, clock=1, version=server.shard.version, source=CallerArray(bad))
        assert refused.value.reason is Reason.NON_FINITE
        np.testing.assert_allclose(_weights(server.shard), expected)
        for c in clients:
            c.close()
        assert server.shard.pool.on_loan == 0 and not any(server.shard.ring.lent)
    finally:
        server.stop()
