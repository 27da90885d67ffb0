"""The rules that make a psctl compare report citable: seeds per repeat, stability first, a target no single run
moves, provenance, tuning on repeats, TensorBoard and the modes' defaults. In-process, no training runs.

The numbers of the async runs are those the issue measured on the built-in MNIST job at 4 workers at the old
async defaults (lr 0.05, momentum 0.9): final test accuracy 0.494 to 0.769 over 5 repeats, sync 0.920 every time.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
import struct
import subprocess
import sys

import pytest

from psgrid.cluster.errors import UsageError
from psgrid.cluster.experiments import stability, target
from psgrid.cluster.experiments.compare import SETTINGS_FILE, experiment_from, rewrite_report, table_text
from psgrid.cluster.experiments.experiment import mode_defaults, parse_modes, plan, repeat_seeds, tune_plan
from psgrid.cluster.experiments.grouping import spread
from psgrid.cluster.experiments.results import run_events, summarize_run
from psgrid.cluster.experiments.settings import settings_for
from psgrid.cluster.job.config import apply_overrides, load_job
from tests.support import ROOT

ASYNC_OLD_DEFAULTS = [0.494, 0.509, 0.511, 0.615, 0.769]
SYNC = [0.920] * 5
WORKERS, STEPS, EVAL_EVERY = 4, 40, 10


@pytest.fixture(autouse=True)
def no_plots(request, monkeypatch):
    """Reports without their PNGs (matplotlib takes seconds a report), except in the tests about plots."""
    if "plots" not in request.node.name:
        from psgrid.cluster.experiments import report

        monkeypatch.setattr(report, "_plotting", lambda: None)


def mnist(**overrides):
    return apply_overrides(load_job("mnist"), {"train.device": "cpu", **overrides})


# ---- an experiment's folder as psctl compare leaves it ----------------------------------------------------------


def write_run(run_dir, final: float, *, losses=None, summary=None) -> None:
    """A run of WORKERS workers whose test accuracy climbs to ``final``; ``summary`` overrides summary.json."""
    run_dir.mkdir(parents=True)
    losses = losses or [2.3 * math.exp(-s / 10) + 0.1 for s in range(STEPS)]
    events = [{"event": "start", "rank": r, "time": 100.0, "shard_rows": 1000} for r in range(WORKERS)]
    for step, loss in enumerate(losses):
        events += [
            {
                "event": "step",
                "rank": r,
                "step": step,
                "started": 100.0 + 0.1 * step,
                "loss": loss,
                "pull_s": 0.01,
                "compute_s": 0.02,
                "push_s": 0.01,
                "staleness": step % 3,
                "samples": 50,
            }
            for r in range(WORKERS)
        ]
    evals = range(EVAL_EVERY, len(losses) + 1, EVAL_EVERY)
    events += [
        {"event": "eval", "rank": 0, "step": k, "time": 100.0 + 0.1 * k, "test_accuracy": final * k / len(losses)}
        for k in evals
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    body = {
        "status": "ok",
        "steps": STEPS * WORKERS,
        "samples": 50 * STEPS * WORKERS,
        "wall_s": 4.0,
        "samples_per_s": 2000.0,
        "test_accuracy": final,
        "final_loss": losses[-1],
        **(summary or {}),
    }
    (run_dir / "summary.json").write_text(json.dumps(body))


def plain_settings(job, modes: str = "sync", *, workers: int = 2, repeats: int = 1, seeds=None, **given):
    """compare's settings for ``modes`` at one worker count, no stragglers, no target: what a rule's test varies."""
    return settings_for(
        job,
        command=[],
        modes=parse_modes(modes),
        workers=[workers],
        stragglers=["none"],
        repeats=repeats,
        target=None,
        backup_workers=None,
        seeds=list(range(repeats)) if seeds is None else seeds,
        **given,
    )


def experiment_dir(tmp_path, finals: dict[str, list[float]], *, summaries=None, **given):
    """One folder with ``finals[mode][r]`` as repeat r's final accuracy, seeds 0..R-1; returns it."""
    out = tmp_path / "cmp"
    modes = parse_modes(",".join(finals))
    repeats = len(next(iter(finals.values())))
    settings = settings_for(
        mnist(),
        command=["--modes", ",".join(finals)],
        modes=modes,
        workers=[WORKERS],
        stragglers=["none"],
        repeats=repeats,
        target=None,
        backup_workers=None,
        seeds=repeat_seeds(0, repeats),
        **given,
    )
    out.mkdir(parents=True)
    (out / SETTINGS_FILE).write_text(json.dumps(settings))
    for mode, accs in finals.items():
        for r, final in enumerate(accs):
            write_run(out / "runs" / f"{mode}-w{WORKERS}-r{r}", final, summary=(summaries or {}).get((mode, r)))
    return out


def csv_rows(out) -> list[dict]:
    with open(out / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def reading_of(out) -> list[str]:
    return (out / "report.md").read_text().split("## Reading\n\n")[1].split("\n\n")


# ---- 1. seeds -------------------------------------------------------------------------------------------------


def test_each_repeat_has_its_own_seed_unless_pinned_and_the_run_records_it():
    assert repeat_seeds(7, 3) == [7, 8, 9]
    assert repeat_seeds(7, 3, "same") == [7, 7, 7]
    assert repeat_seeds(7, 3, "3,1,4") == [3, 1, 4]
    for bad in ("1,2", "1,1,2", "a,b,c", "-1,2,3"):
        with pytest.raises(UsageError, match="--seeds expects 3 distinct"):
            repeat_seeds(0, 3, bad)
    runs = plan(parse_modes("sync,async"), [2], ["none"], 3, seeds=[5, 6, 7])
    assert [(r.mode.label, r.repeat, r.seed) for r in runs] == [
        ("sync", 0, 5),
        ("async", 0, 5),
        ("sync", 1, 6),
        ("async", 1, 6),
        ("sync", 2, 7),
        ("async", 2, 7),
    ]
    assert runs[2].describe()["seed"] == 6 and runs[2].id == "sync-w2-r1"  # the id does not change


def test_a_runs_job_carries_its_seed_and_an_older_experiment_reads_back_as_one_seed(tmp_path):
    settings = plain_settings(mnist(), repeats=3, seeds=[0, 1, 2])
    x = experiment_from(mnist(), settings, tmp_path)
    assert [x.run_job(r).train.seed for r in x.runs] == [0, 1, 2]
    older = {k: v for k, v in settings.items() if k != "seeds"}  # written before seeds varied
    assert [r.seed for r in experiment_from(mnist(), older, tmp_path).runs] == [0, 0, 0]


def test_a_synthetic_jobs_repeats_vary_their_seeds_on_one_task_and_the_report_says_which(tmp_path):
    from psgrid.cluster.experiments.report import _seeds_text

    job = apply_overrides(load_job("synthetic-cnn"), {"train.synthetic_seed": 4})
    settings = plain_settings(job, repeats=3, seeds=[0, 1, 2])
    x = experiment_from(job, settings, tmp_path)
    assert [(x.run_job(r).train.seed, x.run_job(r).train.synthetic_seed) for r in x.runs] == [(0, 4), (1, 4), (2, 4)]
    assert "one synthetic task in every run, synthetic_seed 4" in _seeds_text(settings)
    assert "synthetic" not in _seeds_text(plain_settings(mnist(), repeats=3))
    del settings["job"]["train"]["synthetic_seed"]  # an experiment recorded when the seed chose the task
    assert "each seed also chose its synthetic task" in _seeds_text(settings)


def test_an_experiment_recorded_before_a_job_key_was_added_resumes_unless_its_seeds_chose_synthetic_tasks(tmp_path):
    from psgrid.cluster.experiments.resumable import check_resumable

    def recorded_before_the_keys(settings):
        older = json.loads(json.dumps(settings))
        for key in ("synthetic_seed", "synthetic_test_samples"):
            del older["job"]["train"][key]
        return older

    settings = plain_settings(mnist(), repeats=3)
    check_resumable(recorded_before_the_keys(settings), settings, tmp_path)  # nothing else changed: it resumes
    with pytest.raises(UsageError, match="other settings"):
        check_resumable(recorded_before_the_keys(settings), plain_settings(mnist(), repeats=2), tmp_path)
    synthetic = plain_settings(load_job("synthetic-50m"), repeats=3)  # its test set at the default size
    with pytest.raises(UsageError, match="each seed chose its own synthetic task"):
        check_resumable(recorded_before_the_keys(synthetic), synthetic, tmp_path)
    check_resumable(synthetic, synthetic, tmp_path)


def test_intervals_only_from_six_or_more_varied_seeds_and_min_max_below(tmp_path):
    out = experiment_dir(tmp_path, {"sync": [0.90, 0.91, 0.92, 0.93, 0.94, 0.95]})
    rewrite_report(out)
    assert [r["seed"] for r in csv_rows(out)] == ["0", "1", "2", "3", "4", "5"]
    summary = (out / "report.md").read_text().split("## Summary")[1].split("## Per mode")[0]
    assert "| 0.925 [0.900, 0.950] |" in summary  # of 6 repeats the 95% interval of the median is min..max
    five = experiment_dir(tmp_path / "five", {"sync": [0.90, 0.91, 0.92, 0.93, 0.94]})
    rewrite_report(five)
    assert "| 0.920 [0.900..0.940] |" in (five / "report.md").read_text()  # min..max of 5 holds it 93.75%: none
    three = experiment_dir(tmp_path / "three", {"sync": [0.90, 0.91, 0.93]})
    rewrite_report(three)
    md = (three / "report.md").read_text()
    assert "| 0.910 [0.900..0.930] |" in md and "not an interval" in md
    assert "95% interval of the median as" not in md


# ---- 2. stability first --------------------------------------------------------------------------------------


def test_a_setting_whose_repeats_spread_is_unstable_in_the_table_the_csv_and_the_first_lines(tmp_path):
    out = experiment_dir(tmp_path, {"sync": SYNC, "async": ASYNC_OLD_DEFAULTS})
    rows = rewrite_report(out)
    assert {r["mode"]: r["stability"] for r in rows} == {"sync": "stable", "async": "unstable"}
    assert {r["stability"] for r in csv_rows(out) if r["mode"] == "async"} == {"unstable"}
    first = reading_of(out)[0]
    assert first.startswith(
        "Unstable: async (4 workers, no stragglers): final test accuracy "
        "spread 0.275 across 5 repeats (0.494, 0.509, 0.511, 0.615, 0.769)"
    )
    assert f"more than {stability.UNSTABLE_SPREAD:g} apart" in first
    summary = (out / "report.md").read_text().split("## Summary")[1]
    assert "| async | unstable: final accuracy spread 0.275 (0.494..0.769) |" in summary
    assert "unstable" in table_text(rows, rows[0]["target_accuracy"]).splitlines()[2]


def test_a_loss_that_rose_for_a_stretch_makes_its_setting_unstable():
    falling = [2.3 * math.exp(-s / 30) for s in range(100)]
    bump = falling[:30] + [falling[30] * (1 + 0.05 * k) for k in range(40)] + falling[70:]
    steps = [{"event": "step", "loss": x} for x in bump]
    assert "rose from" in stability.loss_rise(steps)
    assert stability.loss_rise([{"event": "step", "loss": x} for x in falling]) is None
    noisy = [{"event": "step", "loss": 0.3 + 0.01 * (k % 7)} for k in range(100)]  # flat, wobbling
    assert stability.loss_rise(noisy) is None
    rows = [
        {
            "mode": "async",
            "workers": 4,
            "stragglers": "none",
            "status": "ok",
            "final_test_accuracy": 0.9,
            "loss_rise": "its loss rose",
            "diverged": 0,
        },
        {
            "mode": "async",
            "workers": 4,
            "stragglers": "none",
            "status": "ok",
            "final_test_accuracy": 0.9,
            "diverged": 0,
        },
    ]
    (verdict,) = stability.verdicts(rows).values()
    assert verdict.label == "unstable" and verdict.text() == "unstable: loss rose in 1 of 2"


def verdict_of(finals: list[float]) -> stability.Verdict:
    rows = [
        {"mode": "async", "workers": 4, "stragglers": "none", "status": "ok", "final_test_accuracy": a, "diverged": 0}
        for a in finals
    ]
    (verdict,) = stability.verdicts(rows).values()
    return verdict


def test_a_spread_close_to_the_line_is_said_to_be_near_it_on_either_side():
    below, above, clear = verdict_of([0.52, 0.55, 0.566]), verdict_of([0.52, 0.55, 0.574]), verdict_of([0.53, 0.55])
    assert below.label == "stable" and below.text() == "stable, spread 0.046, near the 0.05 line"
    assert above.label == "unstable"
    assert above.text() == "unstable: final accuracy spread 0.054 (0.520..0.574), near the 0.05 line"
    assert clear.text() == "stable, spread 0.020" and not clear.near_line
    assert not verdict_of([0.50, 0.58]).near_line  # 0.08: unstable, and clearly so


def test_a_spread_at_the_line_gets_one_label_whatever_the_accuracies_floating_point_says():
    # 0.55 - 0.50 is 0.05000000000000004 in binary64, 0.85 - 0.80 is 0.04999999999999993: both are 0.05
    assert verdict_of([0.50, 0.55]).label == verdict_of([0.80, 0.85]).label == "stable"
    # 0.07 and 0.03, the band's edges, each above and below in binary64: near the line, every one
    assert all(verdict_of(pair).near_line for pair in ([0.6, 0.67], [0.8, 0.87], [0.6, 0.63], [0.8, 0.83]))


def test_the_reading_says_first_which_stable_settings_are_near_the_line(tmp_path):
    out = experiment_dir(tmp_path, {"sync": SYNC, "async": [0.870, 0.880, 0.890, 0.900, 0.915]})
    rows = rewrite_report(out)
    assert {r["mode"]: r["stability"] for r in rows} == {"sync": "stable", "async": "stable"}
    first = reading_of(out)[0]
    assert first.startswith("Near the line: async (4 workers, no stragglers): spread 0.045."), first
    assert first.count("(4 workers") == 1  # sync's repeats agree: not named
    summary = (out / "report.md").read_text().split("## Summary")[1]
    assert "stable, spread 0.045, near the 0.05 line" in summary


def test_an_unstable_setting_near_the_line_says_other_seeds_may_put_it_under(tmp_path):
    out = experiment_dir(tmp_path, {"sync": SYNC, "async": [0.860, 0.880, 0.890, 0.900, 0.914]})
    rewrite_report(out)
    first = reading_of(out)[0]
    assert first.startswith("Unstable: async (4 workers, no stragglers): final test accuracy spread 0.054"), first
    assert "0.914) (near the line: other seeds may put it under)" in first


NON_FINITE_FAILURE = {
    "status": "failed",
    "test_accuracy": None,
    "final_loss": None,
    "message": "no worker completed (worker 0 exited with code 1). Last lines of worker-0.log:\n"
    "    psctl worker: shard 0 at 127.0.0.1:4000: payload contains NaN or infinity",
}


def test_a_run_the_shards_stopped_on_non_finite_values_is_diverged_never_failed(tmp_path):
    out = experiment_dir(
        tmp_path, {"sync": [0.92, 0.92], "async": [0.9, 0.1]}, summaries={("async", 1): NON_FINITE_FAILURE}
    )
    x = experiment_from(mnist(), json.loads((out / SETTINGS_FILE).read_text()), out)
    assert all(x.finished(r) for r in x.runs)  # a diverged run is a result: --resume does not redo it
    rows = {r["run"]: r for r in rewrite_report(out)}
    bad = rows[f"async-w{WORKERS}-r1"]
    assert (bad["status"], bad["diverged"], bad["stability"]) == ("diverged", 1, "diverged")
    assert rows[f"async-w{WORKERS}-r0"]["stability"] == "unstable"  # its setting diverged once in two
    md = (out / "report.md").read_text()
    assert "Runs that did not finish" not in md and "| failed |" not in md
    assert "| async | diverged in 1 of 2 |" in md
    assert reading_of(out)[0].startswith("Diverged: async in 1 of 2 runs")
    line = next(t for t in table_text(list(rows.values()), 0.9).splitlines() if t.startswith("async-w4-r1"))
    assert line.split()[2] == "diverged"
    # A failure of another kind stays a failure.
    other = dict(NON_FINITE_FAILURE, message="no worker completed (worker 0 exited with code 1): killed")
    assert not stability.refused_non_finite(other)
    run = x.runs[0]
    assert summarize_run(run, other, [], None)["status"] == "failed"


# ---- 3. the target -------------------------------------------------------------------------------------------


def test_the_automatic_target_is_a_fraction_of_the_best_settings_median_not_the_worst_run(tmp_path):
    eleven = [0.508, 0.655, 0.715, 0.778, 0.785, 0.794, 0.868, 0.885, 0.892, 0.904, 0.920]
    out = experiment_dir(tmp_path, {"sync": [0.920] * 11, "async": eleven})
    rows = rewrite_report(out)
    assert rows[0]["target_accuracy"] == pytest.approx(round(0.95 * 0.920, 4))  # 0.874, not 0.508
    assert "95% of the best setting's median final test accuracy" in (out / "report.md").read_text()
    # One bad run of the best setting moves its median, not the target's rule: still 95% of a median.
    assert target.auto_target(
        [
            {
                "mode": "sync",
                "workers": 4,
                "stragglers": "none",
                "status": "ok",
                "diverged": 0,
                "final_test_accuracy": a,
            }
            for a in (0.92, 0.92, 0.10)
        ]
    ) == round(0.95 * 0.92, 4)


def test_time_to_target_is_k_of_n_reached_with_a_median_only_where_more_than_half_reached(tmp_path):
    def rows(times):
        return [{"time_to_target_s": t, "seed": i} for i, t in enumerate(times)]

    most = spread(rows([1.0, 2.0, 3.0, None, None]), "time_to_target_s")
    assert (most.n, most.of, most.median, most.ci) == (3, 5, 3.0, None)  # the never-reached count as slowest
    assert spread(rows([1.0, 2.0, None, None]), "time_to_target_s").median is None  # half is not more than half
    out = experiment_dir(tmp_path, {"sync": [0.920] * 7, "async": [0.6, 0.7, 0.95, 0.95, 0.8, 0.75, 0.7]})
    rewrite_report(out)
    summary = (out / "report.md").read_text().split("## Summary")[1].split("## Per mode")[0]
    assert "2 of 7 reached, no median" in summary
    race = next(p for p in reading_of(out) if p.startswith("With 4 workers"))
    assert "Not every run reached it: async 2 of 7" in race and "fewer than 3 repeats" not in race


# ---- 4. provenance ---------------------------------------------------------------------------------------------


def test_a_scripts_report_names_the_script_its_hash_and_what_psgrid_imposed(tmp_path):
    script = tmp_path / "train_mine.py"
    script.write_text("import psgrid\n# my own model\n")
    command = ["python", str(script), "--steps", "30"]
    out = experiment_dir(tmp_path, {"sync": [0.9, 0.9], "async": [0.9, 0.9]}, script=command, script_given=command)
    rewrite_report(out)
    saved = json.loads((out / SETTINGS_FILE).read_text())
    md = (out / "report.md").read_text()
    digest = hashlib.sha256(script.read_bytes()).hexdigest()
    assert saved["provenance"]["script_files"] == {str(script.resolve()): digest} and digest in md
    assert "mlp [128]" not in md and "mnist5k" not in md and "mlp" not in saved["job_summary"]
    assert f"your script `python {script} --steps 30`" in md
    imposed = saved["provenance"]["imposed_settings"]
    assert imposed["server"]["lr"] == 0.05 and "seed" not in imposed["train"] and "model" not in imposed["train"]
    for key in ("psgrid", "git_commit", "python", "numpy", "seeds"):
        assert key in saved["provenance"] and f"| {key} |" in md
    assert saved["provenance"]["seeds"] == [0, 1]


# ---- 5. tuning ---------------------------------------------------------------------------------------------------


def test_tuning_runs_each_point_on_several_seeds_and_keeps_one_target_for_the_report(tmp_path):
    runs = tune_plan(parse_modes("async"), [4], ["none"], [(("lr", 0.05),), (("lr", 0.1),)], 2, [0, 1])
    assert [(r.id, r.seed) for r in runs] == [
        ("tune-async-w4-lr0.05", 0),
        ("tune-async-w4-lr0.1", 0),
        ("tune-async-w4-lr0.05-r1", 1),
        ("tune-async-w4-lr0.1-r1", 1),
    ]
    out = tmp_path / "cmp"
    settings = plain_settings(
        mnist(), "sync,async", workers=WORKERS, seeds=[0, 1], tune={"lr": [0.05, 0.1]}, tune_repeats=2
    )
    out.mkdir()
    (out / SETTINGS_FILE).write_text(json.dumps(settings))
    x = experiment_from(mnist(), settings, out)
    finals = {0.05: 0.90, 0.1: 0.80}
    for r in x.tune_runs:
        write_run(out / "runs" / r.id, finals[dict(r.settings)["lr"]])
    for r in x.repeat_runs({}):
        write_run(out / "runs" / r.id, 0.9)
    rows = rewrite_report(out)
    tune_target = round(0.95 * 0.90, 4)
    assert {r["target_accuracy"] for r in rows} == {tune_target}  # tuning's target is the report's
    md = (out / "report.md").read_text()
    assert "ran every point of the grid (lr in 0.05, 0.1) twice" in md and f"{tune_target:.3f}" in md
    assert {r["settings"] for r in rows if r["phase"] == "repeat"} == {"lr=0.05"}


def test_tune_repeats_and_seeds_are_checked_before_anything_runs(tmp_path):
    from psgrid.cluster.cli import build_parser
    from psgrid.cluster.commands.compare import _tuning

    parser = build_parser("compare")
    for argv, says in (
        (["--tune-repeats", "2"], "give --tune KEY=V1,V2 too"),
        (["--tune", "lr=0.01,0.1", "--tune-repeats", "0"], "--tune-repeats must be at least 1"),
    ):
        args = parser.parse_args(["compare", "--out", str(tmp_path / "x"), *argv])
        with pytest.raises(UsageError, match=says):
            _tuning(args, mnist(), None)
    assert not (tmp_path / "x").exists()


# ---- 6. smaller: whole-number staleness, epochs, the scaling sentence --------------------------------------------


def test_p99_staleness_is_an_observed_whole_number_and_evaluations_know_their_epoch(tmp_path):
    write_run(tmp_path / "run", 0.9)
    events = run_events(tmp_path / "run")
    run = plan(parse_modes("async"), [WORKERS], ["none"], 1)[0]
    row = summarize_run(run, json.loads((tmp_path / "run" / "summary.json").read_text()), events, None)
    assert row["p99_staleness"] == 2.0 and row["p99_staleness"].is_integer()
    first = next(e for e in events if e["event"] == "eval")
    assert first["step"] == EVAL_EVERY and first["epoch"] == pytest.approx(EVAL_EVERY * 50 / 1000)


def test_the_report_plots_accuracy_against_steps_and_epochs_and_ranges_without_bars_from_zero(tmp_path, monkeypatch):
    from psgrid.cluster.experiments import plots

    out = experiment_dir(tmp_path, {"sync": SYNC[:2], "async": [0.88, 0.90]})
    settings = json.loads((out / SETTINGS_FILE).read_text())
    x = experiment_from(mnist(), settings, out)
    events = {r.id: run_events(x.run_dir(r)) for r in x.runs}
    rows = [
        summarize_run(r, json.loads((x.run_dir(r) / "summary.json").read_text()), events[r.id], 0.85) for r in x.runs
    ]
    path = plots.accuracy_vs_progress(tmp_path / "plots", rows, events, settings)
    assert path.name == "accuracy_vs_progress.png" and path.read_bytes().startswith(b"\x89PNG")
    limits, titles = {}, {}
    save = plots._save
    monkeypatch.setattr(plots, "_save", lambda fig, d, name: titles.setdefault(name, fig._suptitle.get_text()))
    plots.accuracy_vs_progress(tmp_path / "plots", rows, events, settings)
    plots.accuracy_vs_time(tmp_path / "plots", rows, events, settings)
    # The bold line is the first repeat, not a median: both titles say so (the progress plot did not).
    assert all(t.endswith("(bold: the first repeat; faint: the others)") for t in titles.values()), titles
    monkeypatch.setattr(
        plots,
        "_save",
        lambda fig, d, name: limits.setdefault(name, [a.get_ylim() for a in fig.axes]) and save(fig, d, name),
    )
    assert plots.intervals(tmp_path / "plots", rows, events, settings).read_bytes().startswith(b"\x89PNG")
    low, high = limits["intervals"][1]  # min..max from 2 seeds; the accuracy axis shows 0.88 against 0.92
    assert 0.5 < low < 0.88 and 0.92 < high < 1.0


# ---- 7. TensorBoard --------------------------------------------------------------------------------------------------


def read_events(folder) -> list:
    """Every event of a folder's event files, read as TensorBoard does: TFRecord frames of Event protos."""
    event_pb2 = pytest.importorskip("tensorboardX.proto.event_pb2")
    found = []
    for path in sorted(folder.glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (length,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[at + 12 : at + 12 + length])
            found.append(event)
            at += 12 + length + 4
    return found


def test_tensorboard_gets_one_folder_per_run_named_by_mode_that_reads_back(tmp_path):
    pytest.importorskip("tensorboardX")  # the tensorboard extra, in the test extra too
    out = experiment_dir(tmp_path, {"sync": [0.92], "async": [0.88]})
    rewrite_report(out, tensorboard=tmp_path / "tb")
    assert [p.name for p in (tmp_path / "tb").iterdir()] == [out.name]  # the experiment's own folder
    assert sorted(p.name for p in (tmp_path / "tb" / out.name).glob("*-r0")) == ["async-w4-r0", "sync-w4-r0"]
    scalars: dict[str, list] = {}
    for e in read_events(tmp_path / "tb" / out.name / "async-w4-r0"):
        for v in e.summary.value:
            scalars.setdefault(v.tag, []).append((e.step, round(v.simple_value, 4)))
    assert scalars["test/accuracy"][-1] == (STEPS, 0.88) and len(scalars["train/loss"]) == STEPS
    assert scalars["test/accuracy_by_epoch"][0][0] == round(EVAL_EVERY * 50 / 1000 * 1000)
    rewrite_report(out, tensorboard=tmp_path / "tb")  # written again: replaced, not doubled
    assert len(list((tmp_path / "tb" / out.name / "sync-w4-r0").glob("events.out.tfevents.*"))) == 1


def test_launch_writes_a_jobs_folder_as_events_and_without_the_extra_or_out_says_what_to_give(tmp_path):
    pytest.importorskip("tensorboardX")
    from psgrid.cluster.experiments.tensorboard import write_job

    write_run(tmp_path / "job", 0.9)
    folder = write_job(tmp_path / "tb", "mnist", tmp_path / "job")
    assert folder == tmp_path / "tb" / "mnist"
    assert sum(1 for e in read_events(folder) for v in e.summary.value if v.tag == "test/accuracy") == 4
    assert write_job(tmp_path / "tb", "mnist", tmp_path / "job") == folder  # the same job again: replaced
    # An experiment whose --out is named like the job keeps its runs: the job takes the next name.
    experiment = experiment_dir(tmp_path, {"sync": [0.92]})
    rewrite_report(experiment, tensorboard=tmp_path / "tb2")
    kept = sorted((tmp_path / "tb2" / experiment.name).iterdir())
    assert write_job(tmp_path / "tb2", experiment.name, tmp_path / "job") == tmp_path / "tb2" / f"{experiment.name}-2"
    assert sorted((tmp_path / "tb2" / experiment.name).iterdir()) == kept
    code = "import sys\n{}from psgrid.cluster.cli import main\nsys.exit(main())"
    for blocked, args, says in (
        (
            True,
            ["compare", "--out", str(tmp_path / "c"), "--tensorboard", str(tmp_path / "t")],
            "psctl compare: error: --tensorboard needs tensorboardX: pip install 'psgrid[tensorboard]'",
        ),
        (
            False,
            ["launch", "--steps", "3", "--tensorboard", str(tmp_path / "t")],
            "psctl launch: error: --tensorboard reads the job's folder when it ends: give --out DIR too",
        ),
    ):
        absent = "sys.modules['tensorboardX'] = None\n" if blocked else ""  # as on an install without the extra
        done = subprocess.run(
            [sys.executable, "-c", code.format(absent), *args], capture_output=True, text=True, timeout=60, cwd=ROOT
        )
        assert (done.returncode, done.stderr.splitlines()) == (2, [says])
    assert not (tmp_path / "c").exists() and not (tmp_path / "t").exists()


# ---- 8. the modes' defaults ----------------------------------------------------------------------------------------


def test_async_and_ssp_default_to_auto_momentum_where_the_jobs_optimizer_has_momentum():
    modes = parse_modes("sync,async,ssp:2")
    auto = (("async_momentum", "auto"),)
    assert mode_defaults(modes, mnist()) == {"async": auto, "ssp:2": auto}  # sync keeps the job's
    assert mode_defaults(modes, mnist(momentum=0.0)) == {}
    assert mode_defaults(modes, mnist(optimizer="adam")) == {"async": auto, "ssp:2": auto}  # Adam's beta1 0.9
    assert mode_defaults(modes, mnist(optimizer="adam", beta1=0.0)) == {}


def test_a_mode_set_wins_over_the_modes_default_and_the_report_says_which_ran(tmp_path):
    settings = plain_settings(
        mnist(),
        "sync,async",
        mode_defaults={"async": (("async_momentum", "auto"),)},
        mode_settings={"async": (("async_momentum", "off"), ("lr", 0.02))},
    )
    x = experiment_from(mnist(), settings, tmp_path)
    job = x.run_job(next(r for r in x.runs if r.mode.label == "async"))
    assert (job.server.async_momentum, job.server.lr) == ("off", 0.02)
    defaults_only = experiment_from(mnist(), dict(settings, mode_settings={}), tmp_path)
    job = defaults_only.run_job(next(r for r in defaults_only.runs if r.mode.label == "async"))
    assert job.server.async_momentum == "auto"
    out = experiment_dir(
        tmp_path, {"sync": [0.92], "async": [0.90]}, mode_defaults={"async": (("async_momentum", "auto"),)}
    )
    rewrite_report(out)
    assert (
        "Settings each mode ran with, beyond the job's: sync the job's; async async_momentum=auto (the mode's default)."
    ) in (out / "report.md").read_text()


def test_a_job_files_stragglers_are_compared_unless_told_otherwise_and_a_count_they_do_not_fit_is_refused(
    tmp_path, capsys
):
    # examples/mnist-ssp.toml is a job about a straggler (worker 3, 3x slower): compare used to drop it unsaid.
    from psgrid.cluster.commands.compare import _straggler_settings

    job = load_job("examples/mnist-ssp.toml")
    assert job.train.stragglers == ["3:3"]
    assert _straggler_settings(None, job, [4, 8], say=True) == ["3:3"]
    assert capsys.readouterr().err == (
        "psctl compare: every run has the job's stragglers 3:3 (--stragglers none compares without them)\n"
    )
    assert _straggler_settings(["none", "1:2"], job, [2, 4], say=True) == ["none", "1:2"]
    assert _straggler_settings(None, load_job("mnist"), [2], say=True) == ["none"]
    assert capsys.readouterr().err == ""
    with pytest.raises(UsageError, match="given twice"):
        _straggler_settings(["3:3", "3:3.0"], job, [4], say=False)
    # Before anything runs: one line, naming the way out.
    done = subprocess.run(
        [sys.executable, "-m", "psgrid.cluster.cli", "compare", "--config", "examples/mnist-ssp.toml"]
        + ["--workers", "2,4", "--out", str(tmp_path / "cmp")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (done.returncode, done.stdout) == (2, "")
    assert done.stderr == (
        "psctl compare: error: the job's stragglers (3:3) slow worker 3, which a run of 2 workers does not have: "
        "give --stragglers none to compare without them, or --stragglers with ranks below 2\n"
    )
    assert not (tmp_path / "cmp").exists()


def test_a_shorter_tuning_runs_rate_schedule_runs_over_its_own_updates(tmp_path):
    from psgrid.cluster.job.config import apply_overrides
    from psgrid.cluster.job.rate_schedule import scheduled

    # a job of epochs sets its schedule's length by hand; a tuning run of 30 steps must not inherit it
    job = apply_overrides(mnist(), {"lr_schedule": "cosine", "lr_updates": 5000})
    settings = plain_settings(job, "sync,async", tune={"lr": [0.05, 0.1]}, tune_steps=30)
    x = experiment_from(job, settings, tmp_path)
    lengths = {r.mode.label: scheduled(x.run_job(r)).server.lr_updates for r in x.tune_runs}
    assert lengths == {"sync": 30, "async": 60}  # one update a round; one a push of each of 2 workers
    assert {scheduled(x.run_job(r)).server.lr_updates for r in x.repeat_runs({})} == {5000}
