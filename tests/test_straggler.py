"""Stragglers: parsing, the delay each kind adds, and a straggler in a real sync job."""

from __future__ import annotations

import json

import numpy as np
import pytest

from psgrid.worker.straggler import Delay, parse_straggler, parse_stragglers


def test_the_two_kinds_parse_and_print_back():
    assert parse_straggler("3:3").factor == 3.0 and parse_straggler("3:3").rank == 3
    s = parse_straggler(" 1:exp:20 ")
    assert (s.rank, s.mean_ms, s.factor) == (1, 20.0, None)
    assert [str(x) for x in parse_stragglers(["3:2.5", "0:exp:7"])] == ["3:2.5", "0:exp:7"]


@pytest.mark.parametrize(
    "text, says",
    [
        ("3", "not a straggler"),
        ("a:3", "not a straggler"),
        ("3:0.5", "must be >= 1"),
        ("1:exp:0", "must be > 0"),
        ("1:exp:-3", "must be > 0"),
        ("1:exp:inf", "finite"),
        ("1:nan", "finite"),
        ("1:uniform:3", "not a straggler"),
    ],
)
def test_a_bad_straggler_says_how_to_write_one(text, says):
    with pytest.raises(ValueError, match=says):
        parse_straggler(text)


def test_a_worker_named_twice_is_refused():
    with pytest.raises(ValueError, match="twice"):
        parse_stragglers(["1:2", "1:exp:3"])


def test_a_factor_sleeps_in_proportion_to_the_measured_compute():
    d = Delay(["2:3"], rank=2, seed=0)
    assert d.seconds(0.010) == pytest.approx(0.020)
    assert d.seconds(0.100) == pytest.approx(0.200)
    assert Delay(["2:3"], rank=1, seed=0).seconds(0.010) == 0.0


def test_exponential_delays_have_the_stated_mean_and_repeat_with_the_seed():
    draws = [Delay(["1:exp:20"], rank=1, seed=5).seconds(0.0) for _ in range(3)]
    assert len(set(draws)) == 1  # a fresh Delay with the same seed starts the same
    d = Delay(["1:exp:20"], rank=1, seed=5)
    sample = np.array([d.seconds(0.0) for _ in range(20000)])
    assert sample.mean() == pytest.approx(0.020, rel=0.05)
    assert sample.std() == pytest.approx(0.020, rel=0.05)  # exponential: std = mean
    other = Delay(["1:exp:20", "0:exp:20"], rank=0, seed=5)
    assert other.seconds(0.0) != draws[0]  # another rank draws its own


@pytest.mark.slow
@pytest.mark.parametrize("data_plane", ["shm"])  # the built-in trainer takes its default plane: shared memory here
def test_a_straggler_in_sync_makes_the_others_wait_and_is_recorded(cluster, tmp_path):
    from psgrid.cluster.job.config import apply_overrides, load_job
    from psgrid.worker.loop import run_worker
    from tests.support import run_threads

    job = apply_overrides(
        load_job("mnist"), {"steps": 30, "eval_every": 0, "mode": "sync", "stragglers": ["1:5"], "batch_size": 256}
    )
    c = cluster(1, mode="sync", lr=0.05)
    metrics = [tmp_path / f"w{r}.jsonl" for r in range(2)]
    run_threads([lambda r=r: run_worker(job.train, c.addresses, r, 2, str(metrics[r])) for r in range(2)], timeout=120)
    steps = {
        r: [e for e in map(json.loads, metrics[r].read_text().splitlines()) if e["event"] == "step"] for r in range(2)
    }
    slow = steps[1]
    assert all(e["delay_s"] == pytest.approx(4 * e["compute_s"]) for e in slow)
    assert all(e["delay_s"] == 0.0 for e in steps[0])
    waits = {w["worker_id"]: w["seconds"] for w in c.shard().stats()["waits"]}
    # Worker 0 waits each round for the straggler's delay; the straggler hardly waits at all.
    assert waits[0] > 0.5 * sum(e["delay_s"] for e in slow)
    assert waits[0] > 5 * waits.get(1, 0.0)
