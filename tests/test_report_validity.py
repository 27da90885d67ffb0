"""psctl compare's report from runs whose script logged garbage: marked, left out, and never a crash.

Each case writes an experiment's folder as ``psctl compare`` leaves it (experiment.json, each run's
summary.json and metrics.jsonl), with the async run's script logging a loss or accuracy no training
gives, then writes the report again from it, as ``psctl compare --report-only`` does.
"""

from __future__ import annotations

import csv
import json
import math
import subprocess
import sys

import pytest

from psgrid.cluster.experiments import plots, validity
from psgrid.cluster.experiments.compare import SETTINGS_FILE, rewrite_report
from psgrid.cluster.experiments.experiment import parse_modes
from psgrid.cluster.experiments.results import divergence, read_summary
from psgrid.cluster.experiments.settings import settings_for
from psgrid.cluster.job.config import apply_overrides, load_job
from tests.support import ROOT

PNG = b"\x89PNG\r\n\x1a\n"
STEPS, WORKERS, EVAL_EVERY = 20, 2, 5
GOOD_LOSS = [2.0 / (1 + s) for s in range(STEPS)]  # falls: no divergence
GOOD_ACCURACY = [0.5 + 0.1 * k for k in range(STEPS // EVAL_EVERY)]


def write_run(run_dir, losses, accuracies, **summary) -> None:
    """A finished run of WORKERS workers: the losses of each step (every worker the same) and the evaluations."""
    run_dir.mkdir(parents=True)
    events = [{"event": "start", "rank": r, "time": 100.0} for r in range(WORKERS)]
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
                "staleness": 0,
            }
            for r in range(WORKERS)
        ]
    events += [
        {"event": "eval", "rank": 0, "step": (k + 1) * EVAL_EVERY, "time": 100.5 + 0.5 * k, "test_accuracy": a}
        for k, a in enumerate(accuracies)
    ]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    summary = {
        "status": "ok",
        "steps": STEPS * WORKERS,
        "samples": 640,
        "wall_s": 2.0,
        "samples_per_s": 320.0,
        "test_accuracy": accuracies[-1],
        "final_loss": losses[-1],
        **summary,
    }
    (run_dir / "summary.json").write_text(json.dumps(summary))


def experiment_dir(tmp_path, losses, accuracies, **summary):
    """sync (a sound run) and async (``losses``, ``accuracies``), one repeat each, in ``tmp_path / "cmp"``."""
    out = tmp_path / "cmp"
    job = apply_overrides(load_job("mnist"), {"train.device": "cpu"})
    settings = settings_for(
        job,
        command=["--modes", "sync,async"],
        modes=parse_modes("sync,async"),
        workers=[WORKERS],
        stragglers=["none"],
        repeats=1,
        target=None,
        backup_workers=None,
    )
    out.mkdir()
    (out / SETTINGS_FILE).write_text(json.dumps(settings))
    write_run(out / "runs" / f"sync-w{WORKERS}-r0", GOOD_LOSS, GOOD_ACCURACY)
    write_run(out / "runs" / f"async-w{WORKERS}-r0", losses, accuracies, **summary)
    return out


def rows(out) -> dict[str, dict]:
    with open(out / "summary.csv", newline="") as f:
        return {r["mode"]: r for r in csv.DictReader(f)}


HUGE, INF, NAN = 1e308, float("inf"), float("nan")
CASES = {  # name: (async's losses, its accuracies, what summary.csv says of it: invalid_metrics or diverged)
    "losses of 1e308 (a mean of two overflowed fsum)": ([HUGE] * STEPS, GOOD_ACCURACY, "loss infinite or past"),
    "accuracies of 1e9 and -1, losses of -inf": (
        [-INF] * STEPS,
        [0.6, 1e9, -1.0, 1e9],
        f"test accuracy 1e+09 at 3 evaluations, outside [0, 1]; a loss infinite or past +-1e+100 before any finite "
        f"one ({STEPS * WORKERS} steps in all)",
    ),
    "a finite loss, then 1e308": (GOOD_LOSS[:10] + [HUGE] * 10, GOOD_ACCURACY, "diverged"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_garbage_metrics_are_marked_left_out_and_the_report_is_written(tmp_path, case):
    losses, accuracies, said = CASES[case]
    out = experiment_dir(tmp_path, losses, accuracies)
    rewrite_report(out)
    sync, bad = (rows(out)[m] for m in ("sync", "async"))
    assert sync["invalid_metrics"] == "" and sync["diverged"] == "0"
    if said == "diverged":
        assert bad["diverged"] == "1" and bad["invalid_metrics"] == ""
    else:
        assert said in bad["invalid_metrics"], bad["invalid_metrics"]
    # No accuracy outside [0, 1] reaches a number: the automatic target is 95% of the best setting's median final
    # accuracy among the accuracies the runs could have had (sync's 0.8; async's final is garbage or lower).
    for key in ("final_test_accuracy", "best_test_accuracy", "target_accuracy"):
        assert bad[key] == "" or 0.0 <= float(bad[key]) <= 1.0, (key, bad[key])
    finals = [GOOD_ACCURACY[-1]] + ([accuracies[-1]] if said != "diverged" and 0 <= accuracies[-1] <= 1 else [])
    assert float(sync["target_accuracy"]) == pytest.approx(round(0.95 * max(finals), 4))
    md, html = (out / "report.md").read_text(), (out / "report.html").read_text()
    reading = md.split("## Reading\n\n")[1]
    assert reading.startswith("Diverged: async" if said == "diverged" else "Invalid metrics: async-w2-r0 logged ")
    assert "async" in html and "data:image/png;base64," in html
    for name in ("accuracy_vs_time", "loss_vs_steps", "samples_per_s"):
        assert (out / "plots" / f"{name}.png").read_bytes().startswith(PNG), name
    events = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert not [
        e for e in events if e["event"] == "eval" and not (e["test_accuracy"] is None or 0 <= e["test_accuracy"] <= 1)
    ]


@pytest.mark.timeout(60)
def test_report_only_writes_a_report_of_runs_that_logged_garbage(tmp_path):
    out = experiment_dir(tmp_path, [NAN] * 5 + [HUGE] * 15, [1e9, -1.0, NAN, 0.5], train_accuracy=7.0)
    p = subprocess.run(
        [sys.executable, "-m", "psgrid.cluster.cli", "compare", "--report-only", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=ROOT,
    )
    assert p.returncode == 0, p.stderr
    line = next(t for t in p.stdout.splitlines() if t.startswith("async-w2-r0"))
    assert line.split()[2] == "invalid"  # the terminal's table (run, seed, status) does not call it ok
    assert (out / "report.md").is_file() and (out / "report.html").is_file()
    bad = rows(out)["async"]["invalid_metrics"]
    assert "test accuracy 1e+09 at 3 evaluations" in bad and "loss infinite" in bad  # NaN is none either
    assert "final train accuracy 7, outside [0, 1]" in bad


def test_a_plot_that_cannot_be_drawn_is_left_out_and_the_report_written(tmp_path, monkeypatch, capsys):
    out = experiment_dir(tmp_path, GOOD_LOSS, GOOD_ACCURACY)

    def broken(plot_dir, rows, events, settings):
        raise OverflowError("intermediate overflow in fsum")

    broken.__name__ = "loss_vs_steps"
    monkeypatch.setattr(
        plots, "PLOTS", tuple((broken, c) if p.__name__ == "loss_vs_steps" else (p, c) for p, c in plots.PLOTS)
    )
    rewrite_report(out)
    assert "the loss_vs_steps plot is left out of the report: OverflowError" in capsys.readouterr().err
    md = (out / "report.md").read_text()
    assert "plots/accuracy_vs_time.png" in md and "plots/loss_vs_steps.png" not in md


@pytest.mark.parametrize("text", ["[1, 2]", "7", "null", '{"status": "ok"'])
def test_a_summary_that_is_not_an_object_is_a_run_without_one(tmp_path, text):
    (tmp_path / "summary.json").write_text(text)
    assert read_summary(tmp_path) is None
    (tmp_path / "summary.json").write_text('{"status": "ok"}')
    assert read_summary(tmp_path) == {"status": "ok"}


@pytest.mark.parametrize(
    "value, read",
    [
        (1e308, math.inf),
        (-1e101, -math.inf),
        (10**400, math.inf),
        (-(10**400), -math.inf),
        (1e99, 1e99),
        (-3.5, -3.5),
        ("2.0", None),
        (True, None),
        (None, None),
    ],
    ids=["1e308", "-1e101", "10**400", "-10**400", "1e99", "-3.5", "str", "bool", "None"],
)
def test_a_loss_past_the_largest_is_infinite_and_one_not_a_number_is_none(value, read):
    assert validity.loss(value) == read


def test_nan_losses_are_no_loss_recorded_not_garbage():
    events = [{"event": "step", "loss": NAN}] * 3
    assert validity.problems(events, {}) == []
    assert validity.problems(events + [{"event": "step", "loss": INF}], {}) != []


@pytest.mark.parametrize(
    "losses, grew",
    [
        ([-5.0] * 10, False),
        ([-5.0] * 5 + [-1.0] * 5, True),
        ([-1.0] * 5 + [-5.0] * 5, False),
        ([1.0] * 5 + [2.0] * 5, True),
    ],
)
def test_a_negative_loss_grows_only_when_it_rises(losses, grew):
    events = [{"event": "step", "loss": x} for x in losses]
    assert (divergence(events, {}, None) is not None) == grew
