"""psctl compare's report and plots, from synthetic rows and events (no runs, no processes)."""

from __future__ import annotations

import math
import random
import statistics
import subprocess
import sys
import zlib

import pytest

from psgrid.cluster.experiments.experiment import ROW_FIELDS
from psgrid.cluster.experiments.grouping import secs
from psgrid.cluster.experiments.reading import reading
from psgrid.cluster.experiments.report import Paragraph, Table, to_html, to_markdown, write_report
from tests.support import ROOT

PNG = b"\x89PNG\r\n\x1a\n"
MODES = ["sync", "async", "ssp:2", "allreduce"]
TARGET = 0.9
# Designed seconds to the target: with stragglers async is clearly first, then ssp:2, and sync waits.
TIME_TO_TARGET = {
    ("sync", "none"): 0.50,
    ("async", "none"): 0.45,
    ("ssp:2", "none"): 0.47,
    ("allreduce", "none"): 0.40,
    ("sync", "3:3"): 1.40,
    ("async", "3:3"): 0.60,
    ("ssp:2", "3:3"): 0.85,
    ("allreduce", "3:3"): 1.30,
}


def synthetic_run(mode: str, workers: int, stragglers: str, repeat: int, ttt: float, steps: int = 30):
    """A plausible run: its summary row and its events.

    Each step: pull, compute, an injected delay on the straggler, push. Sync-like modes wait
    for the slowest worker each round (in the pull), ssp:2 waits half as long, async never.
    """
    rng = random.Random(zlib.crc32(f"{mode}{workers}{stragglers}{repeat}".encode()))
    slow = int(stragglers.split(":")[0]) if stragglers != "none" else None
    compute, push = 0.02, 0.002 * workers
    work = [0.003 + compute + push + (2 * compute if r == slow else 0.0) for r in range(workers)]
    share = {"async": 0.0, "ssp:2": 0.5}.get(mode, 1.0)
    waits = [share * (max(work) - w) for w in work]
    events, ends = [], []
    for rank in range(workers):
        t = 0.001 * rank
        for step in range(steps):
            stale = 0 if share == 1.0 else rng.randint(0, 2 if mode == "ssp:2" else 2 * workers)
            events.append(
                {
                    "event": "step",
                    "rank": rank,
                    "step": step,
                    "t": t,
                    "loss": 2.3 * math.exp(-step / 10) + 0.1 + 0.02 * rng.random(),
                    "pull_s": 0.003 + waits[rank],
                    "compute_s": compute,
                    "delay_s": 2 * compute if rank == slow else 0.0,
                    "push_s": push,
                    "staleness": stale,
                    "outcome": "APPLIED",
                    "samples": 64,
                    "bytes": 4000,
                }
            )
            t += work[rank] + waits[rank]
        ends.append(t)
    wall = max(ends)
    ttt *= 1 + 0.05 * repeat
    evals = [
        {
            "event": "eval",
            "rank": 0,
            "step": k,
            "t": 0.05 * k,
            "test_accuracy": 0.95 * (1 - math.exp(-2.9444 * 0.05 * k / ttt)),
        }
        for k in range(1, int(wall / 0.05))
    ]
    events += evals
    staleness = sorted(e["staleness"] for e in events if e["event"] == "step")
    row = dict.fromkeys(ROW_FIELDS)
    row.update(
        run=f"{mode.replace(':', '')}-w{workers}-{stragglers.replace(':', 'x')}-r{repeat}",
        mode=mode,
        workers=workers,
        stragglers=stragglers,
        repeat=repeat,
        seed=repeat,
        status="ok",
        target_accuracy=TARGET,
        time_to_target_s=next((e["t"] for e in evals if e["test_accuracy"] >= TARGET), None),
        final_test_accuracy=evals[-1]["test_accuracy"] - (0.02 if mode == "async" else 0.0),
        final_loss=0.12,
        steps=workers * steps,
        samples=64 * workers * steps,
        wall_s=wall,
        samples_per_s=64 * workers * steps / wall,
        mean_staleness=statistics.fmean(staleness),
        p99_staleness=float(staleness[int(0.99 * (len(staleness) - 1))]),
        dropped_pushes=0,
        bytes_moved=4000 * workers * steps,
        mean_wait_s=statistics.fmean(waits) * steps,
        max_wait_s=max(waits) * steps,
        wait_s_by_worker=";".join(f"{w * steps:.3f}" for w in waits),
        pull_s=0.003 + statistics.fmean(waits),
        compute_s=compute,
        delay_s=2 * compute / workers if slow is not None else 0.0,
        push_s=push,
    )
    return row, events


def experiment(modes, workers, stragglers, repeats, ttt, **settings):
    rows, events = [], {}
    for r in range(repeats):
        for s in stragglers:
            for w in workers:
                for m in modes:
                    row, evs = synthetic_run(m, w, s, r, ttt(m, w, s))
                    rows.append(row)
                    events[row["run"]] = evs
    settings = {
        "command": "psctl compare --config mnist --out runs/cmp",
        "modes": modes,
        "workers": workers,
        "stragglers": stragglers,
        "repeats": repeats,
        "target_accuracy": TARGET,
        "target_source": "given",
        "machine": {"host": "box", "cpus": 8, "gpu": None, "python": "3.12.1"},
        "job_summary": "mlp [128] relu on mnist5k, batch 64 per worker, 30 steps per worker",
        **settings,
    }
    return rows, events, settings


def failed_row(run: str, mode: str, status: str) -> dict:
    row = dict.fromkeys(ROW_FIELDS)
    row.update(run=run, mode=mode, workers=4, stragglers="3:3", repeat=2, status=status)
    return row


@pytest.fixture(scope="module")
def stragglers_case(tmp_path_factory):
    """4 modes x {no stragglers, 3:3} x 2 repeats on 4 workers, one failed run; the command holds a '<'."""
    rows, events, settings = experiment(
        MODES,
        [4],
        ["none", "3:3"],
        2,
        lambda m, w, s: TIME_TO_TARGET[m, s],
        command="psctl compare --title '<b>bold</b>' --out runs/cmp",
    )
    rows.append(failed_row("sync-w4-s3x3-r2", "sync", "failed"))
    events["sync-w4-s3x3-r2"] = events[rows[0]["run"]][:10]
    out = tmp_path_factory.mktemp("stragglers")
    return rows, events, settings, write_report(out, settings, rows, events)


@pytest.fixture(scope="module")
def scaling_case(tmp_path_factory):
    """sync and async on 1, 2 and 4 workers, no stragglers."""
    rows, events, settings = experiment(
        ["sync", "async"], [1, 2, 4], ["none"], 1, lambda m, w, s: 0.6 / w**0.7 * (1.1 if m == "sync" else 1.0)
    )
    out = tmp_path_factory.mktemp("scaling")
    return rows, events, settings, write_report(out, settings, rows, events)


def test_the_report_mentions_every_mode_and_embeds_every_plot(stragglers_case):
    rows, _, settings, paths = stragglers_case
    md, html = paths["md"].read_text(), paths["html"].read_text()
    for mode in MODES:
        assert f"| {mode} |" in md and f"<td>{mode}</td>" in html
    pngs = {name: p for name, p in paths.items() if name not in ("md", "html")}
    assert set(pngs) == {
        "accuracy_vs_time",
        "accuracy_vs_progress",
        "intervals",
        "loss_vs_steps",
        "samples_per_s",
        "staleness",
        "timeline",
    }
    for name in pngs:
        assert f"](plots/{name}.png)" in md
    assert html.count("data:image/png;base64,") == len(pngs) and 'src="plots/' not in html
    assert "http://" not in html and "https://" not in html  # opens offline
    assert "Target test accuracy: 0.900, given" in md and "| gpu | none |" in md


def test_every_plot_is_a_real_picture(stragglers_case, scaling_case):
    from matplotlib.image import imread

    for *_, paths in (stragglers_case, scaling_case):
        for name, path in paths.items():
            if name in ("md", "html"):
                continue
            data = path.read_bytes()
            assert data.startswith(PNG) and len(data) > 10_000, name
            pixels = imread(path)
            assert pixels.ndim == 3 and pixels.std() > 0.02, name


def test_scaling_is_plotted_and_read_only_with_several_worker_counts(stragglers_case, scaling_case):
    one_count = stragglers_case[3]
    assert "scaling" not in one_count and not (one_count["md"].parent / "plots" / "scaling.png").exists()
    assert "Scaling efficiency" not in one_count["md"].read_text()
    rows, _, settings, paths = scaling_case
    assert paths["scaling"].name == "scaling.png" and "](plots/scaling.png)" in paths["md"].read_text()
    text = " ".join(reading(rows, settings))
    sps = {(r["mode"], r["workers"]): r["samples_per_s"] for r in rows}
    efficiency = [sps["sync", n] / (n * sps["sync", 1]) for n in (2, 4)]
    assert (
        f"Scaling efficiency (no stragglers): the samples/s of n workers divided by n times the samples/s of "
        f"1 worker (1.00 is perfect): sync {efficiency[0]:.2f} at 2 workers and {efficiency[1]:.2f} at 4 workers"
        in text
    )


def test_the_reading_names_the_fastest_mode_and_by_how_much(stragglers_case):
    rows, _, settings, _ = stragglers_case
    paras = reading(rows, settings)
    ok = [r for r in rows if r["status"] == "ok"]

    def ttt(mode):
        return statistics.median(r["time_to_target_s"] for r in ok if r["mode"] == mode and r["stragglers"] == "3:3")

    race = next(p for p in paras if p.startswith("With 4 workers and stragglers 3:3"))
    assert race.startswith(
        f"With 4 workers and stragglers 3:3, async reached the target test accuracy 0.900 first, "
        f"in {secs(ttt('async'))} s"
    )
    assert (
        f"the next, ssp:2 ({secs(ttt('ssp:2'))} s, {ttt('ssp:2') / ttt('async'):.3g}x as long; "
        f"not settled: fewer than 6 repeats)"
    ) in race
    # Every mode's time is said, all-reduce's too, slowest last.
    assert (
        f"; then allreduce {secs(ttt('allreduce'))} s, {ttt('allreduce') / ttt('async'):.3g}x as long and "
        f"sync {secs(ttt('sync'))} s, {ttt('sync') / ttt('async'):.3g}x as long."
    ) in race
    text = " ".join(paras)
    assert "async and ssp:2 reached the target before sync, as theory predicts (Cui et al., ATC'14" in text
    assert "Stragglers 3:3 with 4 workers, against none: sync took" in text
    # In sync the straggler (worker 3) waits least: the others wait for it.
    assert "in sync the straggling worker 3 waited 0.000 s and the others" in text
    assert "async ended 0.0" in text and "staler weights" in text  # async's synthetic accuracy cost
    assert "1 run did not finish" in text


def test_the_reading_says_plainly_when_stale_modes_lose_to_sync():
    rows, _, settings = experiment(["sync", "ssp:2"], [2], ["1:3"], 1, lambda m, w, s: 0.5 if m == "sync" else 0.9)
    text = " ".join(reading(rows, settings))
    assert "ssp:2 did not reach the target before sync, contrary to what theory predicts" in text
    assert "With 2 workers and stragglers 1:3, sync reached the target" in text
    never = [dict(r, time_to_target_s=None) if r["mode"] == "ssp:2" else r for r in rows]
    assert "ssp:2 never reached the target, sync did in" in " ".join(reading(never, settings))


def test_the_reading_says_when_a_lead_is_within_the_spread_of_repeats():
    rows, _, settings = experiment(["sync", "async"], [2], ["none"], 6, lambda m, w, s: 0.5 if m == "sync" else 0.49)
    race = next(p for p in reading(rows, settings) if p.startswith("With 2 workers"))
    assert "though their 95% intervals overlap, so the lead is not settled" in race


def test_the_reading_calls_a_lead_settled_only_where_the_intervals_are_apart():
    rows, _, settings = experiment(["sync", "async"], [2], ["none"], 6, lambda m, w, s: 0.5 if m == "sync" else 0.25)
    paras = reading(rows, settings)
    race = next(p for p in paras if p.startswith("With 2 workers"))
    assert race.startswith("With 2 workers and no stragglers, async reached") and "settled: their 95% intervals" in race
    assert not any("not settled" in p for p in paras)  # 6 seeds, 5 processes on 8 cores: nothing to hedge
    # The same lead from 5 seeds each: their min..max holds a median only 93.75% of the time, so not settled.
    five = [r for r in rows if r["repeat"] < 5]
    paras = reading(five, dict(settings, repeats=5))
    assert "not settled: fewer than 6 repeats)" in next(p for p in paras if p.startswith("With 2"))
    assert paras[0].startswith(
        "These conclusions are not settled: each setting ran only 5 times, and it takes at least 6"
    )
    # The same runs at one seed measure only timing noise: no interval, and the reading says why.
    same = [dict(r, seed=0) for r in rows]
    paras = reading(same, settings)
    assert "not settled: its repeats ran with the same seed)" in next(p for p in paras if p.startswith("With 2"))
    assert "the repeats ran with the same seed" in paras[0]


def test_with_too_few_repeats_or_too_few_cores_the_reading_says_it_is_not_settled():
    rows, _, settings = experiment(["sync", "async"], [4], ["none"], 1, lambda m, w, s: 0.5, shards=1)
    first = reading(rows, settings)[0]
    assert first.startswith("These conclusions are not settled: each setting ran only 1 time")
    assert "shared" not in first  # 6 processes on 8 cores
    settings["machine"]["cpus"] = 2
    rows3, _, settings3 = experiment(["sync", "allreduce"], [4], ["none"], 6, lambda m, w, s: 0.5, shards=1)
    settings3["machine"]["cpus"] = 2
    first = reading(rows3, settings3)[0]
    assert first == (
        "These conclusions are not settled: 6 processes (1 coordinator, 1 shard and 4 workers; "
        "all-reduce ran 4) shared 2 cores, so they slowed one another and the times say as much about "
        "that sharing as about the modes."
    )


def test_a_diverged_run_is_said_first_with_the_fix_to_try(tmp_path):
    rows, events, settings = experiment(["sync", "async"], [2], ["none"], 6, lambda m, w, s: 0.5)
    for r in rows:
        if r["mode"] == "async":
            r.update(diverged=1, final_test_accuracy=0.1, time_to_target_s=None)
    paras = reading(rows, settings)
    assert paras[0].startswith("Diverged: async in 6 of 6 runs (2 workers, no stragglers).")
    assert "lower learning rate" in paras[0] and "--tune lr=" in paras[0] and "staleness" in paras[0]
    paths = write_report(tmp_path, settings, rows, events)
    summary = paths["md"].read_text().split("## Summary")[1].split("## Per mode")[0]
    assert "| 2 | none | async | diverged in 6 of 6 | never |" in summary
    assert "| 2 | none | sync | stable" in summary and ", " in summary.split("| sync |")[1]  # 6 seeds: intervals
    assert paths["intervals"].read_bytes().startswith(PNG)


def test_failed_runs_are_listed_and_left_out(stragglers_case):
    rows, _, _, paths = stragglers_case
    md = paths["md"].read_text()
    assert "## Runs that did not finish" in md and "| sync-w4-s3x3-r2 | sync | 4 | 3:3 | 2 | failed |" in md
    summary = md.split("## Summary")[1].split("## Per mode")[0]
    sync_row = next(line for line in summary.splitlines() if line.startswith("| 4 | 3:3 | sync |"))
    assert sync_row.startswith("| 4 | 3:3 | sync | stable") and sync_row.endswith("| 2 |")  # n: the two that finished


def test_missing_values_and_failed_runs_do_not_crash(tmp_path):
    rows, events, settings = experiment(["sync", "async"], [2], ["none"], 1, lambda m, w, s: 0.3)
    for key in (
        "time_to_target_s",
        "final_test_accuracy",
        "samples_per_s",
        "mean_staleness",
        "p99_staleness",
        "mean_wait_s",
        "wait_s_by_worker",
        "wall_s",
    ):
        rows[1][key] = None  # async: finished, but with nothing measured
    del events[rows[1]["run"]]
    rows.append(failed_row("async-w2-r1", "async", "interrupted"))
    paths = write_report(tmp_path, settings, rows, events)
    md = paths["md"].read_text()
    assert "async (1 run) never reached it" in md and "| 2 | none | async | stable | never | - |" in md
    assert "interrupted" in md
    # Nothing finished at all, and no target: still a report, saying so.
    only_failed = [failed_row("sync-w4-s3x3-r0", "sync", "failed")]
    paths = write_report(tmp_path / "none", dict(settings, target_accuracy=None, target_source="auto"), only_failed, {})
    md = paths["md"].read_text()
    assert set(paths) == {"md", "html"} and "No run finished" in md and "sync-w4-s3x3-r0" in md
    assert not (tmp_path / "none" / "plots").exists() or not list((tmp_path / "none" / "plots").iterdir())


def test_text_is_escaped_in_html_and_markdown(stragglers_case):
    html = stragglers_case[3]["html"].read_text()
    assert "&lt;b&gt;bold&lt;/b&gt;" in html and "<b>" not in html
    blocks = [Paragraph("a < b & c"), Table(["mode"], [["<ssp:2>|x"]])]
    assert "<td>&lt;ssp:2&gt;|x</td>" in to_html(blocks, "t<")
    assert "<title>t&lt;</title>" in to_html(blocks, "t<")
    md = to_markdown(blocks)
    assert "a &lt; b &amp; c" in md and "| &lt;ssp:2>\\|x |" in md


def test_importing_the_report_does_not_load_matplotlib():
    code = "import sys, psgrid.cluster.experiments.report; assert 'matplotlib' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=60)


def test_throughput_within_noise_of_sync_is_called_the_same():
    from psgrid.cluster.experiments.reading import _throughput_versus_sync

    assert "about as many samples per second" in _throughput_versus_sync("ssp:2", 15304, 15259)
    assert "staleness bound" in _throughput_versus_sync("ssp:2", 15304, 15259)
    assert "staleness bound" not in _throughput_versus_sync("async", 15304, 15259)
    assert "processed more samples per second" in _throughput_versus_sync("async", 21929, 15259)
    assert "did not even process more" in _throughput_versus_sync("ssp:8", 12000, 15259)


def seeded(values, key="x"):
    """Rows of one setting, each repeat with its own seed."""
    return [{key: v, "seed": i} for i, v in enumerate(values)]


def test_no_95_percent_interval_of_the_median_is_drawn_from_5_repeats():
    from psgrid.cluster.experiments.grouping import interval_ranks, median_interval, separated, spread

    # min..max of 5 holds the median with probability 1 - 2/2^5 = 93.75% only: no 95% interval, not settled.
    assert interval_ranks(5) is None and median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) is None
    five = spread(seeded([1.0, 2.0, 3.0, 4.0, 5.0]), "x")
    assert five.ci is None and five.no_interval == "fewer than 6 repeats"
    assert separated(five, spread(seeded([10.0, 11.0, 12.0, 13.0, 14.0]), "x")) is None


def test_the_interval_of_the_median_is_min_max_for_6_to_8_repeats_and_x2_x8_for_9():
    from psgrid.cluster.experiments.grouping import median_interval, spread

    shuffled = [4.0, 9.0, 1.0, 7.0, 3.0, 8.0, 2.0, 6.0, 5.0]
    for n in (6, 7, 8):
        assert median_interval(shuffled[:n]) == (min(shuffled[:n]), max(shuffled[:n]))
    assert median_interval(shuffled) == (2.0, 8.0)  # x_(2), x_(8)
    assert spread(seeded(shuffled[:6]), "x").ci == (1.0, 9.0) and spread(seeded(shuffled), "x").ci == (2.0, 8.0)
    # Only from repeats with seeds of their own, every one with the number.
    assert spread([dict(r, seed=7) for r in seeded(shuffled)], "x").no_interval == "its repeats ran with the same seed"
    assert spread(seeded(shuffled[:6] + [None]), "x").no_interval == "only 6 of 7 runs have it"


def test_the_interval_covers_the_median_with_its_exact_binomial_probability_at_least_95_percent():
    from fractions import Fraction

    from psgrid.cluster.experiments.grouping import coverage_text, interval_ranks

    # Exact: 1 - 2 P(Binomial(n, 1/2) <= k - 1).
    assert interval_ranks(6) == (1, Fraction(31, 32)) and interval_ranks(8) == (1, Fraction(127, 128))
    assert interval_ranks(9) == (2, 1 - Fraction(2 * (1 + 9), 2**9))
    assert interval_ranks(20) == (6, Fraction(125647, 131072))  # [x_(6), x_(15)], 95.86%
    assert coverage_text(6) == "[min, max], 96.9% or more"
    assert coverage_text(9) == "[2nd lowest, 2nd highest], 96.1% or more"
    # Counted rather than summed: the median is inside [x_(k), x_(n-k+1)] where k to n-k of the n values lie
    # below it, each below with probability 1/2; k is the largest with that at 95% or more.
    for n in range(1, 15):

        def inside(k, n=n):
            return Fraction(sum(k <= bin(b).count("1") <= n - k for b in range(2**n)), 2**n)

        ks = [k for k in range(1, (n + 1) // 2 + 1) if inside(k) >= Fraction(95, 100)]
        assert interval_ranks(n) == ((max(ks), inside(max(ks))) if ks else None), n


def test_a_run_that_never_reached_the_target_makes_an_upper_bound_never():
    from psgrid.cluster.experiments.grouping import separated, spread
    from psgrid.cluster.experiments.report import _cell

    never = spread(seeded([3.0, 1.0, 2.0, None, 4.0, None], "time_to_target_s"), "time_to_target_s")
    assert never.ci == (1.0, math.inf) and never.median == 3.5 and (never.n, never.of) == (4, 6)
    assert _cell(never, secs) == "3.50 [1.00, never]"
    # Of 9 runs with one never there, x_(8) is still a time.
    one = spread(seeded([5.0, 1.0, 2.0, 3.0, 4.0, 6.0, 7.0, 8.0, None], "time_to_target_s"), "time_to_target_s")
    assert one.ci == (2.0, 8.0)
    # "never" is slower than any time: faster runs whose interval ends below this one's start are settled.
    fast = spread(seeded([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], "time_to_target_s"), "time_to_target_s")
    late = spread(seeded([0.5, 1.5, 2.0, 2.5, 3.0, None], "time_to_target_s"), "time_to_target_s")
    assert separated(fast, never) is True and separated(fast, late) is False
    slow = spread(seeded([2.0, 3.0, 4.0, None, None, None, None], "time_to_target_s"), "time_to_target_s")
    assert slow.median is None and slow.ci == (2.0, math.inf) and separated(fast, slow) is True


def test_six_runs_are_settled_only_where_their_whole_ranges_are_apart():
    from psgrid.cluster.experiments.grouping import separated, spread

    a, b = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [5.8, 7.0, 8.0, 9.0, 10.0, 11.0]
    # A percentile bootstrap of 6 gives a narrower [1.5, 5.5] and [6.4, 10.5] and called this settled.
    assert separated(spread(seeded(a), "x"), spread(seeded(b), "x")) is False
    assert separated(spread(seeded(a), "x"), spread(seeded([x + 0.5 for x in b]), "x")) is True
    assert separated(spread(seeded(a), "x"), spread(seeded([3.5] * 6), "x")) is False


def test_the_reading_names_each_modes_tuned_settings_and_the_grid_points_that_diverged():
    rows, _, settings = experiment(["sync", "async"], [2], ["none"], 3, lambda m, w, s: 0.5, tune={"lr": [0.1, 0.5]})
    for r in rows:
        r["settings"] = "lr=0.5" if r["mode"] == "sync" else "lr=0.1"
    tune = [
        {
            "run": f"tune-{m}-{lr}",
            "mode": m,
            "workers": 2,
            "stragglers": "none",
            "status": "ok",
            "settings": f"lr={lr}",
            "diverged": int(m == "async" and lr == 0.5),
        }
        for m in ("sync", "async")
        for lr in (0.1, 0.5)
    ]
    tuned = next(p for p in reading(rows, settings, tune) if p.startswith("Each mode ran at"))
    assert tuned == (
        "Each mode ran at its best point of the tuning grid (see Tuning): sync lr=0.5 and async lr=0.1. "
        "While tuning, async at lr=0.5 diverged."
    )
