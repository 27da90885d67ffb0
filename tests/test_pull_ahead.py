"""The pull-ahead (worker/prefetch.py): the next step's pull runs during this step's compute, into a second buffer.

A recording exchange (shards in miniature: a version per push, a background push landing only when
waited for, the latest the shards may take it) shows the order of calls: the buffer a pull fills is
never the one the model reads until that pull is waited for, each push names the version its
gradient came from, and a step's weights are at most one version older than without the pull-ahead.
Real shards show that a job still learns; the option's checks are at the end.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from psgrid.cluster.job.config import ConfigError, job_from_dict
from psgrid.psserver.protocol import WIRE_DTYPES, Outcome, PushResult
from psgrid.psserver.spec import ModelSpec
from psgrid.worker.config import TrainConfig
from psgrid.worker.evaluate import evaluate
from psgrid.worker.flat import FlatBuffers
from psgrid.worker.loop import build, run_worker, train_loop
from psgrid.worker.prefetch import PullAhead, pulls_ahead
from tests.gpu import cupy_or_skip
from tests.support import run_threads

STEPS = 12


class Done:
    """A pull's or push's handle that runs its work when waited for (once)."""

    def __init__(self, work):
        self.work, self.result, self.seconds = work, None, 0.0

    def wait(self):
        if self.work is not None:
            self.result, self.work = self.work(), None
        return self.result


class RecordingExchange:
    """One shard in miniature that logs every pull, every wait for a pull and every push, with the buffer."""

    worker_id, data_planes, wire_dtype = 0, ["fake"], WIRE_DTYPES["float32"]

    def __init__(self, init: np.ndarray, mode: str = "async", restart_after: int | None = None):
        self.mode = mode
        self.weights, self.version, self.pushes = init.copy(), 0, 0
        self.restart_after, self.restarted, self.first_pull_since_restart = restart_after, False, None
        self.buffers: list[np.ndarray] = []  # the flat arrays pulls wrote into, in order of first use
        self.log: list[tuple] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    @property
    def clock(self) -> int:
        return self.pushes

    def buffer_of(self, array: np.ndarray) -> int:
        for i, flat in enumerate(self.buffers):
            if np.shares_memory(flat, array):
                return i
        self.buffers.append(array)
        return len(self.buffers) - 1

    def pull(self, out: np.ndarray, *, background: bool = False) -> Done:
        which, version = self.buffer_of(out), self.version
        if self.restarted and self.first_pull_since_restart is None:
            self.first_pull_since_restart = self.pushes  # the pull's clock
        np.copyto(out, self.weights)  # written when issued: the worst case for a reader of ``out``
        self.log.append(("pull", which, version))
        handle = Done(lambda: (self.log.append(("pulled", which, version)), [version])[1])
        if not background:
            handle.wait()
        return handle

    def push(self, grad: np.ndarray, *, versions=None, background: bool = False) -> Done:
        clock, self.pushes = self.pushes, self.pushes + 1
        self.log.append(("push", clock, versions))

        def land():
            # As psserver/state/pushes.py: after a restart, a push at a clock from the worker's first pull
            # of the new process on may not name a version past the new process's.
            if self.restarted and clock >= (self.first_pull_since_restart or float("inf")):
                assert versions[0] <= self.version, f"push {clock} names {versions}, the shard is at {self.version}"
            self.weights -= 0.5 * grad
            self.version += 1
            if clock == self.restart_after:  # the shard goes back to its checkpoint of 3 versions ago
                self.version, self.restarted = self.version - 3, True
            return [PushResult(Outcome.APPLIED, self.version, self.version - 1 - (versions or [0])[0], clock + 1)]

        handle = Done(land)
        if not background:
            handle.wait()
        return handle


class RecordingModel:
    """The model, logging which of the exchange's buffers each step computes from."""

    def __init__(self, model, exchange: RecordingExchange):
        self.model, self.exchange, self.spec = model, exchange, model.spec

    def loss_and_grad(self, params, x, y, grads):
        self.exchange.log.append(("compute", self.exchange.buffer_of(next(iter(params.values())))))
        return self.model.loss_and_grad(params, x, y, grads)


def run_recorded(pull_ahead: bool, mode: str = "async", restart_after: int | None = None) -> RecordingExchange:
    train = TrainConfig(
        model="softmax",
        dataset="digits",
        batch_size=32,
        steps=STEPS,
        eval_every=0,
        init_scale=0.1,
        pull_ahead=pull_ahead,
    )
    xp, device, data, model = build(train, 0, 1, device="cpu")
    exchange = RecordingExchange(model.spec.pack(model.init_params(train.seed, train.init_scale)), mode, restart_after)
    result = train_loop(train, exchange, 0, xp, device, data, RecordingModel(model, exchange))
    assert result["steps"] == STEPS and np.isfinite(result["final_loss"])
    return exchange


def versions_used(log: list[tuple]) -> list[int]:
    """The version each step's gradient was computed from: the last pull waited for on the buffer it read."""
    landed, used = {}, []
    for event in log:
        if event[0] == "pulled":
            landed[event[1]] = event[2]
        elif event[0] == "compute":
            used.append(landed[event[1]])
    return used


def test_a_buffer_being_pulled_into_is_never_the_one_the_model_reads():
    log = run_recorded(pull_ahead=True).log
    in_flight = set()
    for i, event in enumerate(log):
        if event[0] == "pull":
            assert event[1] not in in_flight, f"two pulls into buffer {event[1]} at once: {log[: i + 1]}"
            in_flight.add(event[1])
        elif event[0] == "pulled":
            in_flight.discard(event[1])
        elif event[0] == "compute":
            assert event[1] not in in_flight, f"the model read buffer {event[1]} while a pull wrote it: {log[: i + 1]}"
    computes = [e for e in log if e[0] == "compute"]
    assert len(computes) == STEPS and {e[1] for e in computes} == {0, 1}  # two buffers, taken in turn
    assert [e[1] for e in computes] == [i % 2 for i in range(STEPS)]
    # The next step's pull is made before this step computes, and none after the last step's start.
    pulls = [i for i, e in enumerate(log) if e[0] == "pull"]
    assert len(pulls) == STEPS
    for step, at in enumerate([i for i, e in enumerate(log) if e[0] == "compute"][:-1]):
        assert pulls[step + 1] < at, f"step {step + 1}'s pull was not made before step {step} computed: {log}"


def test_each_push_names_the_weights_its_gradient_came_from():
    log = run_recorded(pull_ahead=True).log
    pushed = [e[2] for e in log if e[0] == "push"]
    assert pushed == [[v] for v in versions_used(log)]


def test_the_weights_a_step_uses_are_at_most_one_version_older_than_without_it():
    # Pushes land when waited for: the latest the shards may apply them, so these are the worst cases.
    without, with_ahead = versions_used(run_recorded(False).log), versions_used(run_recorded(True).log)
    assert without == [max(0, c - 1) for c in range(STEPS)]
    assert with_ahead == [max(0, c - 2) for c in range(STEPS)]
    assert all(0 <= a - b <= 1 for a, b in zip(without, with_ahead))


@pytest.mark.parametrize("restart_after", range(2, 8))
def test_after_a_shard_went_back_to_a_checkpoint_pushes_name_no_version_past_its_own(restart_after):
    """The pull for step c+1 (clock c) reaches the restarted shard before the push of step c: that push
    must then name the new process's version, which the next step's pull says (a real shard refuses
    it otherwise, and the worker stops: seen in test_recovery's killed-shard job)."""
    exchange = run_recorded(True, restart_after=restart_after)
    pushed = [e[2][0] for e in exchange.log if e[0] == "push"]
    assert len(pushed) == STEPS and exchange.first_pull_since_restart is not None


def test_every_mode_pulls_when_each_step_starts_unless_asked():
    for mode, pull_ahead in (("sync", False), ("ssp", False), ("async", False), ("sync", True)):
        log = run_recorded(pull_ahead, mode).log
        assert [e[0] for e in log[:3]] == ["pull", "pulled", "compute"], (mode, log[:3])
        assert {e[1] for e in log if e[0] == "compute"} == {0}, mode  # one buffer only
    log = run_recorded(True, "ssp").log
    assert {e[1] for e in log if e[0] == "compute"} == {0, 1}


def test_when_a_worker_pulls_ahead():
    from psgrid.worker.core import exchange_rules

    def ahead(train, mode):
        return pulls_ahead(train, exchange_rules(mode))

    assert not any(ahead(TrainConfig(), mode) for mode in ("async", "ssp", "sync", "allreduce"))
    train = TrainConfig(pull_ahead=True)
    assert ahead(train, "async") and ahead(train, "ssp")
    assert not ahead(train, "sync") and not ahead(train, "allreduce")
    assert not ahead(TrainConfig(pull_ahead=True, overlap=False), "async")
    assert not ahead(TrainConfig(pull_ahead=True, aggregate="host"), "async")


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(pull_ahead=True, overlap=False), "pull_ahead = true needs overlap = true"),
        (dict(pull_ahead=True, aggregate="host"), 'pull_ahead = true does not apply with aggregate = "host"'),
        (dict(pull_ahead="yes"), "pull_ahead must be true or false, got 'yes'"),
    ],
)
def test_the_option_is_checked(settings, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**settings).validate()


@pytest.mark.parametrize(
    "data, fragment",
    [
        ({"mode": "sync", "pull_ahead": True}, "[train] pull_ahead = true applies to async and ssp only"),
        ({"pull_ahead": 1}, "[train] pull_ahead must be true or false, got 1"),
        ({"overlap": False, "pull_ahead": True}, "[train] pull_ahead = true needs overlap = true"),
    ],
)
def test_job_files_refuse_it_where_it_cannot_apply(data, fragment):
    with pytest.raises(ConfigError) as err:
        job_from_dict(data, source="f.toml")
    assert fragment in str(err.value)


def test_job_files_take_it_in_async_and_ssp():
    assert job_from_dict({"mode": "ssp", "pull_ahead": True}).train.pull_ahead is True
    assert job_from_dict({"mode": "async", "pull_ahead": True}).train.pull_ahead is True
    assert job_from_dict({"mode": "sync", "pull_ahead": False}).train.pull_ahead is False
    assert job_from_dict({}).train.pull_ahead is False


@pytest.mark.slow
@pytest.mark.parametrize("data_plane", ["shm"])
@pytest.mark.timeout(120)
def test_a_lone_async_worker_pulling_ahead_learns_at_most_two_updates_behind(cluster, tmp_path, data_plane):
    train = TrainConfig(
        model="softmax", dataset="digits", batch_size=32, steps=120, eval_every=0, init_scale=0.1, pull_ahead=True
    )
    c = cluster(2, mode="async", lr=0.5)
    result = run_worker(train, c.addresses, 0, 1, str(tmp_path / "w0.jsonl"))
    records = [json.loads(line) for line in (tmp_path / "w0.jsonl").read_text().splitlines()]
    assert records[0]["event"] == "start" and records[0]["pull_ahead"] is True
    steps = [r for r in records if r["event"] == "step"]
    assert result["steps"] == 120 and all(s["outcome"] == "APPLIED" for s in steps)
    assert max(s["staleness"] for s in steps) <= 2
    assert all("pull_ahead_s" in s for s in steps[1:]) and "pull_ahead_s" not in steps[0]
    scores = evaluate(train, c.addresses)
    assert scores["test_accuracy"] >= 0.85, scores


@pytest.mark.slow
@pytest.mark.parametrize("data_plane", ["shm"])
@pytest.mark.timeout(150)
def test_two_ssp_workers_pulling_ahead_learn(cluster, tmp_path, data_plane):
    train = TrainConfig(
        model="softmax", dataset="digits", batch_size=32, steps=100, eval_every=0, init_scale=0.1, pull_ahead=True
    )
    c = cluster(2, mode="ssp", staleness=1, lr=0.3)
    results = run_threads(
        [lambda r=r: run_worker(train, c.addresses, r, 2, str(tmp_path / f"w{r}.jsonl")) for r in range(2)], timeout=120
    )
    assert [r["steps"] for r in results] == [100, 100]
    assert evaluate(train, c.addresses)["test_accuracy"] >= 0.85


SPEC = ModelSpec([("w", (512, 300)), ("b", (300,))])


@pytest.mark.gpu
@pytest.mark.parametrize("data_plane", ["shm", "tcp"])
@pytest.mark.timeout(60)
def test_on_a_gpu_the_next_weights_land_in_the_other_buffer(cluster, data_plane):
    from psgrid.worker.backend import pinner_for

    cupy = cupy_or_skip()
    c = cluster(2, mode="async", lr=1.0)
    init = np.random.default_rng(0).standard_normal(SPEC.size).astype(np.float32)
    with c.client(SPEC, init=init, pin_memory=pinner_for(cupy)) as client:
        bufs = FlatBuffers(SPEC, cupy, client, double=True)
        ahead = PullAhead(bufs, SPEC)
        ahead.pull()  # step 0: pulled now, step 1's pull started
        # Over shared memory it is posted: its copy started on this thread, no client thread waits for it.
        assert ahead.pending.deferred is (data_plane == "shm")
        first = bufs.params
        np.testing.assert_array_equal(cupy.asnumpy(first), init)
        grad = np.ones(SPEC.size, np.float32)
        client.push(grad, versions=ahead.versions).wait()
        ahead.pull()  # step 1: the weights pulled during step 0, in the other buffer
        assert bufs.params is not first
        np.testing.assert_array_equal(cupy.asnumpy(bufs.params), init)  # pulled before the push landed
        ahead.pull(ahead=False)  # step 2: pulled during step 1, after the push
        assert bufs.params is first
        np.testing.assert_allclose(cupy.asnumpy(bufs.params), init - grad, rtol=1e-6, atol=1e-6)
        assert ahead.pending is None and ahead.pulled_s is not None


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_shard_restarted_from_its_checkpoint_takes_the_pushes_of_workers_pulling_ahead(tmp_path):
    """The killed-shard job of test_recovery.py, pulling ahead: the workers' next pulls reach the new
    process before their pushes do, and those pushes must not name versions it never published."""
    import os
    import signal

    from tests.support import Launch, child_pids, steps_seen

    args = [
        "--config",
        "mnist",
        "--eval-every",
        "0",
        "--no-progress",
        "--lease-s",
        "2",
        "--shards",
        "2",
        "--steps",
        "300",
        "--restart-failed",
        "--set",
        "mode=async",
        "--set",
        "pull_ahead=true",
        "--set",
        "momentum=0.0",
        "--set",
        "lr=0.2",
        "--set",
        f"checkpoint_dir={tmp_path / 'ckpt'}",
        "--set",
        "checkpoint_every=10",
    ]
    with Launch(tmp_path, *args) as launch:
        launch.wait_for(lambda: steps_seen(launch.out, 0) >= 40, 60, "worker 0 training")
        os.kill(child_pids(launch.out)["shards"][1], signal.SIGKILL)
        code = launch.wait(150)
        text = launch.text()
    assert code == 0, text
    summary = json.loads((launch.out / "summary.json").read_text())
    assert len(summary["restarts"]) == 1 and summary["shard_stats"][1]["restored_version"] >= 10
    assert all(w["completed"] for w in summary["worker_results"]), summary["worker_results"]
    assert summary["test_accuracy"] > 0.85, summary["test_accuracy"]
