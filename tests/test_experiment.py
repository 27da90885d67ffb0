"""psctl compare's plan (modes, counts, straggler settings, runs) and its per-run results."""

from __future__ import annotations

import pytest

from psgrid.cluster.errors import UsageError
from psgrid.cluster.experiments import results as res
from psgrid.cluster.experiments.experiment import parse_counts, parse_modes, parse_straggler_setting, plan


def test_modes_parse_in_order_with_their_bounds():
    modes = parse_modes("sync, async,ssp:2,ssp:8,allreduce")
    assert [m.label for m in modes] == ["sync", "async", "ssp:2", "ssp:8", "allreduce"]
    assert [(m.mode, m.staleness) for m in modes[2:]] == [("ssp", 2), ("ssp", 8), ("sync", None)]
    assert [m.uses_shards for m in modes] == [True, True, True, True, False]


@pytest.mark.parametrize(
    "text, says",
    [
        ("ssp", "ssp:S"),
        ("sync,bsp", "unknown mode 'bsp'"),
        ("sync,sync", "twice"),
        ("", "at least one"),
        ("ssp:x", "unknown mode"),
    ],
)
def test_bad_modes_say_what_to_write(text, says):
    with pytest.raises(UsageError, match=says):
        parse_modes(text)


def test_counts_and_straggler_settings():
    assert parse_counts("1,2,4", "--workers") == [1, 2, 4]
    for bad in ("0,1", "1,1", "a", ""):
        with pytest.raises(UsageError, match="--workers"):
            parse_counts(bad, "--workers")
    assert parse_straggler_setting("none") == "none"
    assert parse_straggler_setting("3:3.0, 1:exp:20") == "3:3,1:exp:20"
    with pytest.raises(UsageError, match="--stragglers: '3:0.5'"):
        parse_straggler_setting("3:0.5")


def test_the_plan_puts_repeats_outermost_and_names_every_run_once():
    runs = plan(parse_modes("sync,allreduce"), [1, 2], ["none", "0:3"], 2)
    assert len(runs) == 16 and len({r.id for r in runs}) == 16
    assert [r.repeat for r in runs] == [0] * 8 + [1] * 8
    assert runs[0].id == "sync-w1-r0" and runs[7].id == "allreduce-w2-s0x3-r0"


def test_a_straggler_that_does_not_exist_is_refused():
    with pytest.raises(UsageError, match="worker 3 does not exist with --workers 2"):
        plan(parse_modes("sync"), [2, 4], ["3:3"], 1)


def test_time_to_target_is_the_first_evaluation_at_or_above_it():
    events = [
        {"event": "eval", "t": 1.0, "test_accuracy": 0.5},
        {"event": "step", "t": 1.5},
        {"event": "eval", "t": 2.0, "test_accuracy": 0.91},
        {"event": "eval", "t": 3.0, "test_accuracy": 0.95},
    ]
    assert res.time_to_target(events, 0.9) == 2.0
    assert res.time_to_target(events, 0.96) is None
    assert res.best_accuracy(events) == 0.95


def test_a_workers_wait_is_its_longest_over_the_shards():
    summary = {
        "workers": 3,
        "shard_stats": [
            {"waits": [{"worker_id": 0, "seconds": 1.0}, {"worker_id": 2, "seconds": 0.5}]},
            {"waits": [{"worker_id": 0, "seconds": 1.5}]},
        ],
    }
    assert res.waits_by_worker(summary) == [1.5, 0.0, 0.5]
    assert res.waits_by_worker({"workers": 2, "wait_s_by_worker": [0.25, 0.5]}) == [0.25, 0.5]


def _steps(losses):
    return [{"event": "step", "t": float(i), "loss": x} for i, x in enumerate(losses)]


def test_a_run_diverged_where_its_loss_grew_turned_non_finite_or_its_accuracy_fell_to_chance():
    falling, flat = _steps([2.3 - 0.1 * i for i in range(20)]), _steps([2.30, 2.32, 2.29, 2.31] * 5)
    assert res.divergence(falling, {"test_accuracy": 0.9, "final_loss": 0.4}, 10) is None
    assert res.divergence(flat, {"test_accuracy": 0.5}, 10) is None  # not learning is not diverging
    assert "grew" in res.divergence(_steps([2.3 + i for i in range(20)]), {"test_accuracy": 0.5}, 10)
    assert "non-finite" in res.divergence(_steps([2.3, 5.0, float("nan")]), {"test_accuracy": 0.5}, 10)
    assert "non-finite" in res.divergence(falling, {"final_loss": float("inf")}, 10)
    assert "chance" in res.divergence(falling, {"test_accuracy": 0.15}, 10)
    assert res.divergence(falling, {"test_accuracy": 0.15}, None) is None  # a script: its classes unknown
    # A script that pushes no loss records NaN from its first step: that is no divergence.
    assert res.divergence(_steps([float("nan")] * 5), {"test_accuracy": 0.9}, None) is None


def test_tune_values_are_parsed_as_set_parses_them_and_checked_before_anything_runs():
    from psgrid.cluster.experiments.tuning import parse_tune, points, split_values
    from psgrid.cluster.job.config import load_job

    job = load_job("mnist")
    assert split_values("[64,64],[128]") == ["[64,64]", "[128]"]
    grid = parse_tune(["lr=0.01,0.05", "momentum=0,0.9", "train.hidden=[32],[64,64]"], job)
    assert grid == {"lr": [0.01, 0.05], "momentum": [0, 0.9], "train.hidden": [[32], [64, 64]]}
    assert len(points(grid)) == 8 and points(grid)[0] == (("lr", 0.01), ("momentum", 0), ("train.hidden", [32]))
    for bad, says in (
        ("lr", "KEY=V1,V2"),
        ("nosuchkey=1,2", "nosuchkey"),
        ("lr=0.1,0.1", "twice"),
        ("mode=sync,async", "set by the experiment"),
        ("lr=-1,0.1", "lr"),
    ):
        with pytest.raises(UsageError, match=says):
            parse_tune([bad], job)
    with pytest.raises(UsageError, match="script"):
        parse_tune(["train.batch_size=32,64"], job, server_only=True)


def test_each_group_chooses_its_earliest_point_and_a_diverged_one_never_wins():
    from psgrid.cluster.experiments.tuning import choose, tuning_target

    def row(mode, settings, best, final, ttt=None, diverged=0, status="ok", repeat=0):
        return {
            "run": f"{mode}-{settings}-r{repeat}",
            "mode": mode,
            "workers": 2,
            "stragglers": "none",
            "status": status,
            "settings": settings,
            "best_test_accuracy": best,
            "final_test_accuracy": final,
            "time_to_target_s": ttt,
            "diverged": diverged,
            "seed": repeat,
            "repeat": repeat,
        }

    rows = [
        row("sync", "lr=0.01", 0.80, 0.80),
        row("sync", "lr=0.1", 0.95, 0.95),
        row("async", "lr=0.01", 0.90, 0.90),
        row("async", "lr=0.1", 0.99, 0.10, diverged=1),
    ]
    # The tuning target is the report's rule: 95% of the best point's median final accuracy (a diverged one has
    # no say), or the given target.
    assert tuning_target(rows, None) == round(0.95 * 0.95, 4)
    assert tuning_target(rows, 0.5) == 0.5
    rows[1]["time_to_target_s"], rows[2]["time_to_target_s"], rows[3]["time_to_target_s"] = 3.0, 5.0, 1.0
    chosen = choose(rows)
    assert chosen["sync", 2, "none"][0]["settings"] == "lr=0.1"
    assert chosen["async", 2, "none"][0]["settings"] == "lr=0.01"  # the diverged point was faster
    # Where no point reaches the target: the best final accuracy.
    slow = [
        row("sync", "lr=0.01", 0.5, 0.5),
        row("sync", "lr=0.1", 0.6, 0.6),
        row("sync", "lr=1", 0.1, 0.7, status="failed"),
    ]
    assert choose(slow)["sync", 2, "none"][0]["settings"] == "lr=0.1"


def test_tuning_judges_a_point_on_its_repeats_not_on_one_lucky_run():
    from psgrid.cluster.experiments.tuning import choose

    def row(settings, repeat, ttt, final, diverged=0):
        return {
            "run": f"async-{settings}-r{repeat}",
            "mode": "async",
            "workers": 4,
            "stragglers": "none",
            "status": "ok",
            "settings": settings,
            "final_test_accuracy": final,
            "time_to_target_s": ttt,
            "diverged": diverged,
            "seed": repeat,
            "repeat": repeat,
        }

    # lr=0.2 was fastest once, then diverged; lr=0.1 reached the target once in two (not more than half);
    # lr=0.05 reached it in both runs: a single run per point would have picked lr=0.2.
    rows = [
        row("lr=0.2", 0, 1.0, 0.92),
        row("lr=0.2", 1, None, 0.10, diverged=1),
        row("lr=0.1", 0, 1.5, 0.91),
        row("lr=0.1", 1, None, 0.60),
        row("lr=0.05", 0, 3.0, 0.90),
        row("lr=0.05", 1, 4.0, 0.90),
    ]
    chosen = choose(rows)["async", 4, "none"]
    assert [r["run"] for r in chosen] == ["async-lr=0.05-r0", "async-lr=0.05-r1"]
    assert [r["run"] for r in choose(rows[:1] + rows[2:3])["async", 4, "none"]] == ["async-lr=0.2-r0"]
