"""psctl compare's plan (modes, counts, straggler settings, runs) and its per-run results."""

from __future__ import annotations

import pytest

from psgrid.cluster import results as res
from psgrid.cluster.errors import UsageError
from psgrid.cluster.experiment import parse_counts, parse_modes, parse_straggler_setting, plan


def test_modes_parse_in_order_with_their_bounds():
    modes = parse_modes("sync, async,ssp:2,ssp:8,allreduce")
    assert [m.label for m in modes] == ["sync", "async", "ssp:2", "ssp:8", "allreduce"]
    assert [(m.mode, m.staleness) for m in modes[2:]] == [("ssp", 2), ("ssp", 8), ("sync", None)]
    assert [m.uses_shards for m in modes] == [True, True, True, True, False]


@pytest.mark.parametrize("text, says", [
    ("ssp", "ssp:S"), ("sync,bsp", "unknown mode 'bsp'"), ("sync,sync", "twice"), ("", "at least one"),
    ("ssp:x", "unknown mode"),
])
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
    events = [{"event": "eval", "t": 1.0, "test_accuracy": 0.5}, {"event": "step", "t": 1.5},
              {"event": "eval", "t": 2.0, "test_accuracy": 0.91}, {"event": "eval", "t": 3.0, "test_accuracy": 0.95}]
    assert res.time_to_target(events, 0.9) == 2.0
    assert res.time_to_target(events, 0.96) is None
    assert res.best_accuracy(events) == 0.95


def test_a_workers_wait_is_its_longest_over_the_shards():
    summary = {"workers": 3, "shard_stats": [
        {"waits": [{"worker_id": 0, "seconds": 1.0}, {"worker_id": 2, "seconds": 0.5}]},
        {"waits": [{"worker_id": 0, "seconds": 1.5}]}]}
    assert res.waits_by_worker(summary) == [1.5, 0.0, 0.5]
    assert res.waits_by_worker({"workers": 2, "wait_s_by_worker": [0.25, 0.5]}) == [0.25, 0.5]
