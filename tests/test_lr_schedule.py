"""The rate's schedule on the shards (kernels/schedule.py): its factors, the updates a shard applies, the job's length."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from psgrid.cluster.errors import ConfigError
from psgrid.cluster.job import rate_schedule
from psgrid.cluster.job.config import job_from_dict
from psgrid.cluster.job.rate_schedule import schedule_updates
from psgrid.psserver.config import ServerConfig
from psgrid.psserver.exceptions import InvalidArgument
from psgrid.psserver.kernels.schedule import LrSchedule
from psgrid.psserver.protocol import Outcome
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.state.shard import Shard
from tests.support import run_launch

SPEC = ModelSpec([("w", (40,)), ("b", (3,))])
LR = 0.5


# ----- the factors -------------------------------------------------------------------------------


def test_a_linear_schedule_warms_up_then_falls_to_zero_at_its_length_and_stays_there():
    schedule = LrSchedule("linear", updates=10, warmup=0.2)  # 2 warm-up updates, then 8 to zero
    factors = [schedule.factor(v) for v in range(13)]
    expected = [0.5, 1.0] + [1 - k / 8 for k in range(8)] + [0.0, 0.0, 0.0]
    assert factors == pytest.approx(expected, abs=1e-12)


def test_a_cosine_schedule_is_half_way_at_its_middle_and_zero_at_its_end():
    schedule = LrSchedule("cosine", updates=100)
    assert schedule.factor(0) == 1.0
    assert schedule.factor(50) == pytest.approx(0.5, abs=1e-12)
    assert schedule.factor(25) == pytest.approx((1 + math.cos(math.pi / 4)) / 2, abs=1e-12)
    assert schedule.factor(100) == pytest.approx(0.0, abs=1e-12) and schedule.factor(1000) == pytest.approx(0.0)
    assert all(schedule.factor(v) >= schedule.factor(v + 1) for v in range(120))


def test_a_constant_rate_with_a_warm_up_holds_lr_once_warm_and_without_one_is_always_lr():
    warm = LrSchedule("constant", updates=40, warmup=0.1)
    assert [warm.factor(v) for v in (0, 1, 3, 4, 5, 10**6)] == pytest.approx([0.25, 0.5, 1.0, 1.0, 1.0, 1.0])
    assert {LrSchedule().factor(v) for v in range(50)} == {1.0}


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"lr_schedule": "step"}, "lr_schedule must be one of ('constant', 'linear', 'cosine'), got 'step'"),
        ({"lr_warmup": 1.0}, "lr_warmup must be in [0, 1), got 1.0"),
        ({"lr_updates": -1}, "lr_updates must be >= 0, got -1"),
    ],
)
def test_bad_schedule_settings_are_refused_in_one_line(settings, message):
    with pytest.raises(InvalidArgument) as err:
        ServerConfig(**settings)
    assert message in str(err.value) and "\n" not in str(err.value)


# ----- a shard's updates ----------------------------------------------------------------------------


def make_shard(**settings) -> Shard:
    shard = Shard(ServerConfig(shared_memory=False, lr=LR, **settings))
    shard.init(SPEC, np.random.default_rng(0).normal(size=SPEC.size).astype(np.float32))
    return shard


def push(shard: Shard, worker: int, clock: int, grad: np.ndarray) -> Outcome:
    buf = shard.pool.take()
    np.copyto(buf, grad)
    result, kept = shard.push(worker, clock, shard.version, buf, 0)
    if not kept:
        shard.pool.give(buf)
    return result.outcome


def weights(shard: Shard) -> np.ndarray:
    return shard.arrays.download(shard.weights).astype(np.float64)


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_each_update_of_a_stale_mode_takes_the_rate_of_the_version_it_starts_from(mode):
    shard = make_shard(mode=mode, lr_schedule="linear", lr_updates=4)
    shard.register(SPEC.hash(), 0, -1, "test")
    schedule = LrSchedule("linear", 4)
    rng = np.random.default_rng(1)
    expected = weights(shard)
    for clock in range(6):
        assert shard.stats()["lr"] == pytest.approx(LR * schedule.factor(clock))
        grad = rng.normal(size=SPEC.size).astype(np.float32)
        assert push(shard, 0, clock, grad) is Outcome.APPLIED
        expected -= LR * schedule.factor(clock) * grad
        np.testing.assert_allclose(weights(shard), expected, rtol=0, atol=1e-5)
    assert shard.version == 6 and shard.stats()["lr"] == 0.0  # past its length the rate stays at zero


def test_a_sync_round_takes_the_rate_of_its_round():
    shard = make_shard(mode="sync", lr_schedule="cosine", lr_updates=4, lr_warmup=0.5)  # 2 warm-up rounds
    for worker in (0, 1):
        shard.register(SPEC.hash(), worker, -1, "test")
    rng = np.random.default_rng(2)
    expected = weights(shard)
    for round_, factor in enumerate([0.5, 1.0, 1.0, 0.5]):  # warm-up, then cosine from 1 towards 0
        assert shard.stats()["lr"] == pytest.approx(LR * factor)
        grads = [rng.normal(size=SPEC.size).astype(np.float32) for _ in range(2)]
        for worker, grad in enumerate(grads):
            push(shard, worker, round_, grad)
        expected -= LR * factor * (grads[0].astype(np.float64) + grads[1]) / 2
        np.testing.assert_allclose(weights(shard), expected, rtol=0, atol=1e-5)
    assert shard.version == 4 and shard.stats()["lr"] == pytest.approx(0.0, abs=1e-12)


def test_a_warm_up_that_would_fill_the_schedule_leaves_the_decay_one_update():
    schedule = LrSchedule("linear", updates=2, warmup=0.9)  # round(1.8) = 2 = U: one is kept for the decay
    assert schedule.warmup_updates == 1
    assert [schedule.factor(v) for v in range(3)] == [1.0, 1.0, 0.0]


def checkpoint_then_restore(tmp_path, mode: str, updates: int, *, kept: int, lost: int = 0) -> Shard:
    """A shard of a linear schedule over ``updates``, checkpointed after worker 0's first ``kept`` pushes,
    then ``lost`` more pushes, then restored from that checkpoint (the ``lost`` ones gone with the process)."""
    settings = dict(mode=mode, lr_schedule="linear", lr_updates=updates, checkpoint_dir=str(tmp_path))
    shard = make_shard(**settings)
    shard.register(SPEC.hash(), 0, -1, "test")
    rng = np.random.default_rng(kept * 10 + lost)
    for clock in range(kept + lost):
        if clock == kept:
            shard.checkpoint()
        push(shard, 0, clock, rng.normal(size=SPEC.size).astype(np.float32))
    if not lost:
        shard.checkpoint()
    return Shard(ServerConfig(shared_memory=False, lr=LR, **settings))


def assert_step(shard: Shard, clock: int, factor: float) -> None:
    """Worker 0's push at ``clock`` is applied at ``LR * factor``."""
    before = weights(shard)
    grad = np.random.default_rng(clock).normal(size=SPEC.size).astype(np.float32)
    assert push(shard, 0, clock, grad) is Outcome.APPLIED
    np.testing.assert_allclose(weights(shard), before - LR * factor * grad, rtol=0, atol=1e-5)


def test_a_restored_shard_goes_on_where_the_schedule_was(tmp_path):
    restored = checkpoint_then_restore(tmp_path, "async", 5, kept=3)
    assert restored.version == 3 and restored.stats()["lr"] == pytest.approx(LR * 2 / 5)
    assert_step(restored, 3, 2 / 5)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_updates_lost_to_a_restart_move_the_schedule_on_as_the_workers_steps_did(tmp_path, mode):
    """A shard restored from an older checkpoint meets workers some steps on: the schedule goes on at their step.

    The rounds (sync) or pushes (async) after the checkpoint are lost; had the schedule counted the
    shard's version alone, it would lag by them for the rest of the job and end short of 0.
    """
    restored = checkpoint_then_restore(tmp_path, mode, 6, kept=2, lost=2)
    restored.register(SPEC.hash(), 0, 4, "test")  # the worker rejoins at its own step, 4
    assert_step(restored, 4, 2 / 6)  # the schedule's factor at 4, not at the shard's version 2
    assert restored.version == 3 and restored.stats()["lost_updates"] == 2
    assert restored.stats()["lr"] == pytest.approx(LR * 1 / 6)  # the next update is the job's sixth


def test_a_sync_round_a_checkpoint_held_open_takes_its_own_rate_when_later_rounds_were_lost(tmp_path):
    """Restored with round 3 open (worker 0 had pushed), both workers come back at 6: 3 closes first, then 4 and 5 lost."""
    settings = dict(mode="sync", lr_schedule="linear", lr_updates=10, checkpoint_dir=str(tmp_path))
    shard = make_shard(**settings)
    for worker in (0, 1):
        shard.register(SPEC.hash(), worker, -1, "test")
    rng = np.random.default_rng(6)
    for round_ in range(3):
        for worker in (0, 1):
            push(shard, worker, round_, rng.normal(size=SPEC.size).astype(np.float32))
    open_round = rng.normal(size=SPEC.size).astype(np.float32)
    push(shard, 0, 3, open_round)
    shard.checkpoint()  # version 3, round 3 open with worker 0's gradient
    restored = Shard(ServerConfig(shared_memory=False, lr=LR, **settings))
    before = weights(restored)
    for worker in (0, 1):
        restored.register(SPEC.hash(), worker, 6, "test")
    assert restored.version == 4 and restored.stats()["lost_updates"] == 2
    np.testing.assert_allclose(weights(restored), before - LR * (7 / 10) * open_round, rtol=0, atol=1e-5)  # factor(3)
    assert restored.stats()["lr"] == pytest.approx(LR * 4 / 10)  # the next round is 6


def test_an_async_push_from_steps_ahead_of_a_restore_takes_the_rate_of_its_own_step(tmp_path):
    """A worker that pushes to a restored shard without registering again: its update is at its own step."""
    restored = checkpoint_then_restore(tmp_path, "async", 6, kept=1)  # the worker at clock 1
    assert_step(restored, 3, 3 / 6)  # its pushes at clocks 1 and 2 were lost
    assert restored.stats()["lost_updates"] == 2 and restored.stats()["lr"] == pytest.approx(LR * 2 / 6)


def test_an_async_worker_that_leaves_while_its_update_is_computed_is_not_counted_lost_when_it_returns():
    """Its push was applied: coming back at the next clock it lost nothing, and the schedule does not skip ahead."""
    shard = make_shard(mode="async", lr_schedule="linear", lr_updates=6)
    shard.register(SPEC.hash(), 0, -1, "test")
    apply = shard.updater.apply

    def leaving_apply(*args, **kwargs):
        shard.leave(0)  # what a lease's expiry or a goodbye does between the push's two locked parts
        return apply(*args, **kwargs)

    shard.updater.apply = leaving_apply
    push(shard, 0, 0, np.ones(SPEC.size, np.float32))
    shard.updater.apply = apply
    assert shard.version == 1
    shard.register(SPEC.hash(), 0, 1, "test")
    assert shard.stats()["lost_updates"] == 0 and shard.stats()["lr"] == pytest.approx(LR * 5 / 6)


def test_a_schedule_without_its_length_is_refused_at_init_and_changes_nothing():
    shard = Shard(ServerConfig(shared_memory=False, lr_schedule="cosine"))
    with pytest.raises(InvalidArgument) as err:
        shard.init(SPEC, np.zeros(SPEC.size, np.float32))
    assert "needs lr_updates" in str(err.value) and "\n" not in str(err.value)
    assert not shard.initialized and shard.version == 0


def test_psctl_server_refuses_a_schedule_without_its_length_in_one_line():
    from psgrid.cluster.cli import build_parser
    from psgrid.cluster.commands.server import server_config_from_args

    with pytest.raises(ConfigError) as err:
        server_config_from_args(build_parser().parse_args(["server", "--lr-schedule", "linear"]))
    assert "--lr-updates" in str(err.value) and "\n" not in str(err.value)
    given = server_config_from_args(
        build_parser().parse_args(["server", "--lr-schedule", "linear", "--lr-updates", "9"])
    )
    assert given.schedule() == LrSchedule("linear", 9)


# ----- the job's length ------------------------------------------------------------------------------


def job(mode: str, **server):
    return job_from_dict({"job": {"workers": 4}, "server": {"mode": mode, **server}, "train": {"steps": 100}})


@pytest.mark.parametrize("mode, updates", [("sync", 100), ("async", 400), ("ssp", 400)])
def test_a_job_gives_its_shards_the_updates_they_will_apply(mode, updates):
    scheduled = job(mode, lr_schedule="cosine")
    assert schedule_updates(scheduled) == updates
    assert scheduled.server_config(0).lr_updates == updates
    assert rate_schedule.scheduled(scheduled).server.lr_updates == updates
    assert job(mode, lr_schedule="cosine", lr_updates=77).server_config(0).lr_updates == 77  # the job's own
    assert job(mode).server_config(0).lr_updates == 0  # a constant rate needs none


def test_a_job_of_epochs_with_a_schedule_must_say_its_length():
    with pytest.raises(ConfigError) as err:
        job_from_dict({"server": {"lr_schedule": "linear"}, "train": {"epochs": 2}})
    assert "set [server] lr_updates" in str(err.value) and "\n" not in str(err.value)
    given = job_from_dict({"server": {"lr_schedule": "linear", "lr_updates": 50}, "train": {"epochs": 2}})
    assert given.server_config(0).lr_updates == 50


def test_psctl_launch_writes_the_length_and_the_rate_ends_at_zero(tmp_path):
    code, text, out = run_launch(
        tmp_path,
        "--config",
        "mnist",
        "--mode",
        "async",
        "--workers",
        "2",
        "--set",
        "steps=30",
        "--set",
        "lr_schedule=linear",
        "--set",
        "eval_every=0",
    )
    assert code == 0, text
    assert "linear to 0 over 60 updates" in text  # the optimizer's line names the schedule
    # job.toml keeps the job's own lr_updates (none): each shard derives it, so a resume with other steps
    # or workers, or the file reused with another mode, gets its own length
    assert "lr_updates = 0" in (out / "job.toml").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert [s["lr"] for s in summary["shard_stats"]] == [0.0, 0.0]  # 60 updates applied: the rate reached zero


def test_a_shard_started_from_a_job_file_derives_the_length_and_leaves_the_workers_keys_to_them(tmp_path):
    from psgrid.cluster.cli import build_parser
    from psgrid.cluster.commands.server import server_config_from_args

    path = tmp_path / "job.toml"
    # [train] modle: a typo that is the workers' to refuse, not the shard's
    path.write_text(
        '[job]\nworkers = 3\n[server]\nmode = "async"\nlr_schedule = "cosine"\n[train]\nsteps = 7\nmodle = "x"\n'
    )
    args = build_parser().parse_args(["server", "--config", str(path)])
    assert server_config_from_args(args).lr_updates == 21  # 3 workers x 7 pushes
    args = build_parser().parse_args(["server", "--config", str(path), "--mode", "sync"])
    assert server_config_from_args(args).lr_updates == 7  # one update a round


def test_with_host_aggregation_each_host_pushes_once_a_step():
    hosted = job_from_dict(
        {
            "job": {"workers": 4},
            "server": {"mode": "async", "lr_schedule": "linear"},
            "train": {"steps": 10, "aggregate": "host"},
        }
    )
    assert schedule_updates(hosted) == 10  # one host (psctl launch): its leader's pushes
    assert schedule_updates(hosted, hosts=3) == 30  # psctl mpi over three nodes with workers


def test_a_mode_table_with_a_schedule_is_checked_with_the_job_before_anything_runs():
    with pytest.raises(ConfigError) as err:
        job_from_dict({"train": {"epochs": 2}, "async": {"lr_schedule": "cosine"}})
    assert "[async]" in str(err.value) and "set [server] lr_updates" in str(err.value) and "\n" not in str(err.value)
    assert (
        job_from_dict({"train": {"epochs": 2}, "async": {"lr_schedule": "cosine", "lr_updates": 9}}).server.lr_schedule
        == "constant"
    )


def test_the_note_says_where_a_derived_length_came_from():
    derived = job("async", lr_schedule="cosine")
    assert rate_schedule.derived_note(derived) == (
        "lr_schedule cosine runs over 400 updates, from [train] steps = 100; a script that runs another number "
        "of steps sets lr_updates"
    )
    assert rate_schedule.derived_note(job("async", lr_schedule="cosine", lr_updates=5)) is None
    assert rate_schedule.derived_note(job("async")) is None
