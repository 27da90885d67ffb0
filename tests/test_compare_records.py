"""What a psctl compare experiment records of itself and says of its runs: the final evaluation in the
best accuracy and the time to target, provenance across --resume, the script's hash, the seeds, the rate
schedule of a script, dropped pushes, the --report-only command and the checks before anything runs.
In-process, no training runs: a run is a folder written as psctl launch leaves one.
"""

from __future__ import annotations

import hashlib
import json
import sys

import pytest

from psgrid.cluster.errors import JobFailed
from psgrid.cluster.experiments import provenance
from psgrid.cluster.experiments.compare import SETTINGS_FILE, Compare, experiment_from, rewrite_report
from psgrid.cluster.experiments.experiment import parse_modes, plan
from psgrid.cluster.experiments.report import _seeds_text
from psgrid.cluster.experiments.results import read_summary, run_events, summarize_run
from tests.test_compare_rules import (  # noqa: F401 - no_plots: reports without their PNGs here too
    STEPS,
    WORKERS,
    csv_rows,
    experiment_dir,
    mnist,
    no_plots,
    plain_settings,
    write_run,
)


def events_with_done(run_dir, done_at: float) -> None:
    """Add every worker's ``done`` at ``done_at`` (the end of training) to the run's metrics.jsonl."""
    done = [{"event": "done", "rank": r, "time": done_at} for r in range(WORKERS)]
    with open(run_dir / "metrics.jsonl", "a") as f:
        f.writelines(json.dumps(e) + "\n" for e in done)


def row_of(run_dir, target: float) -> dict:
    run = plan(parse_modes("async"), [WORKERS], ["none"], 1)[0]
    return summarize_run(run, read_summary(run_dir), run_events(run_dir), target)


# ---- 1. the final evaluation counts ----------------------------------------------------------------------------


def test_the_final_evaluation_counts_toward_the_best_accuracy_and_the_time_to_target(tmp_path):
    periodic, final = 0.894, 0.899  # the last periodic evaluation under the target, the final one over it
    write_run(tmp_path / "run", periodic, summary={"test_accuracy": final})
    start = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])["time"]
    row = row_of(tmp_path / "run", target=(periodic + final) / 2)
    assert row["final_test_accuracy"] == final and row["best_test_accuracy"] >= row["final_test_accuracy"]
    # With no worker's end recorded, the final evaluation is timed at the last thing the run recorded.
    last = max(e["t"] for e in run_events(tmp_path / "run") if e["event"] != "final_eval")
    assert row["time_to_target_s"] == pytest.approx(last)
    events_with_done(tmp_path / "run", start + 10.0)
    assert row_of(tmp_path / "run", target=(periodic + final) / 2)["time_to_target_s"] == pytest.approx(10.0)
    # A periodic evaluation that reached the target first is still the one that counts.
    early = row_of(tmp_path / "run", target=periodic / 2)["time_to_target_s"]
    assert early is not None and early < 10.0
    # The final evaluation has the step after the last one, beside the periodic evaluations in results.jsonl.
    (last,) = [e for e in run_events(tmp_path / "run") if e["event"] == "final_eval"]
    assert last["step"] == STEPS and last["test_accuracy"] == final


def test_a_report_for_a_target_only_the_final_evaluation_reached_counts_it_reached(tmp_path):
    out = experiment_dir(tmp_path, {"sync": [0.894], "async": [0.894]})
    for mode in ("sync", "async"):
        summary = out / "runs" / f"{mode}-w{WORKERS}-r0" / "summary.json"
        summary.write_text(json.dumps({**json.loads(summary.read_text()), "test_accuracy": 0.899}))
    rewrite_report(out, target=0.895)
    for row in csv_rows(out):
        assert float(row["best_test_accuracy"]) >= float(row["final_test_accuracy"]) >= 0.895
        assert row["time_to_target_s"] != ""
    assert "never" not in (out / "report.md").read_text().split("## Summary")[1].split("## Per mode")[0]


# ---- 2. provenance across --resume -----------------------------------------------------------------------------


def experiment_at(tmp_path, monkeypatch, commit: str, **given):
    """The experiment in tmp_path/cmp as psctl compare would set it up from a checkout at ``commit``."""
    monkeypatch.setattr(provenance, "git_state", lambda where: {"git_commit": commit, "git_tree": "clean"})
    settings = plain_settings(mnist(), "sync", workers=WORKERS, **given)
    return experiment_from(mnist(), settings, tmp_path / "cmp")


def fake_runs(monkeypatch, fail: set[str] = frozenset()):
    """Compare's runs written as finished folders (the ids in ``fail``: failed) instead of trained."""

    def run_one(self, run, progress):
        if run.id in fail:
            raise JobFailed("failed on purpose")
        write_run(self.x.run_dir(run), 0.9)

    monkeypatch.setattr(Compare, "run_one", run_one)


def test_a_resume_keeps_the_provenance_of_the_runs_and_records_each_attempt_that_ran_one(tmp_path, monkeypatch):
    fake_runs(monkeypatch, fail={f"sync-w{WORKERS}-r1"})
    assert Compare(experiment_at(tmp_path, monkeypatch, "A" * 40, repeats=2), progress=False).run() == 1
    # A --resume from another checkout that has nothing to run changes nothing of what ran.
    fake_runs(monkeypatch)
    first = json.loads((tmp_path / "cmp" / SETTINGS_FILE).read_text())
    x = experiment_at(tmp_path, monkeypatch, "B" * 40, repeats=2)
    assert Compare(x, resume=True, progress=False).run() == 0  # runs r1 (which failed under A)
    saved = json.loads((tmp_path / "cmp" / SETTINGS_FILE).read_text())
    assert saved["provenance"]["git_commit"] == first["provenance"]["git_commit"] == "A" * 40
    assert [(a["provenance"]["git_commit"], a["runs"]) for a in saved["attempts"]] == [
        ("A" * 40, [f"sync-w{WORKERS}-r0", f"sync-w{WORKERS}-r1"]),
        ("B" * 40, [f"sync-w{WORKERS}-r1"]),
    ]
    md = (tmp_path / "cmp" / "report.md").read_text()
    assert (
        "ran in 2 attempts" in md
        and "whose records differ in git_commit:" in md
        and f"git_commit {'B' * 40}) ran sync" in md
    )
    x = experiment_at(tmp_path, monkeypatch, "C" * 40, repeats=2)
    assert Compare(x, resume=True, progress=False).run() == 0  # nothing left: no third attempt
    again = json.loads((tmp_path / "cmp" / SETTINGS_FILE).read_text())
    assert again["attempts"] == saved["attempts"] and again["provenance"] == saved["provenance"]
    assert "C" * 40 not in (tmp_path / "cmp" / "report.md").read_text()


def test_an_experiment_recorded_before_attempts_resumes_as_its_first_attempt(tmp_path, monkeypatch):
    older = plain_settings(mnist(), "sync", workers=WORKERS)
    now = {**older, "provenance": {**older["provenance"], "git_commit": "B"}}
    merged = provenance.resumed({**older, "provenance": {**older["provenance"], "git_commit": "A"}}, now)
    assert merged["provenance"]["git_commit"] == "A" and merged["attempts"][0]["runs"] is None


# ---- 3. a script run directly is hashed ---------------------------------------------------------------------------


def test_a_script_run_as_the_command_is_hashed_and_the_interpreter_never(tmp_path):
    script = tmp_path / "train_exec.py"
    script.write_text("#!/usr/bin/env python\nimport psgrid\n")
    script.chmod(0o755)
    digest = hashlib.sha256(script.read_bytes()).hexdigest()
    assert provenance.script_hashes([str(script), "--steps", "60"]) == {str(script.resolve()): digest}
    assert provenance.script_hashes([sys.executable, str(script)]) == {str(script.resolve()): digest}


# ---- 4. the seeds sentence says what ran ---------------------------------------------------------------------------


def test_the_seeds_sentence_says_what_ran():
    one = _seeds_text(plain_settings(mnist(), repeats=1))
    assert "one run per setting, seed 0" in one and "pinned" not in one and "every repeat" not in one
    varied = _seeds_text(plain_settings(mnist(), repeats=3))
    assert "repeats 0, 1, 2 of every mode ran with seeds 0, 1, 2" in varied and "pinned" not in varied
    pinned = _seeds_text(plain_settings(mnist(), repeats=3, seeds=[3, 7, 11], seeds_pinned=True))
    assert "seeds 3, 7, 11 (pinned with --seeds)" in pinned
    same = _seeds_text(plain_settings(mnist(), repeats=3, seeds=[5, 5, 5], seeds_pinned=True))
    assert "every repeat ran with seed 5 (pinned with --seeds)" in same
    tuned = _seeds_text(plain_settings(mnist(), repeats=1, seeds=[0, 1], tune={"lr": [0.05, 0.1]}, tune_repeats=2))
    assert "one run per setting, seed 0" in tuned and "repeats 0, 1" not in tuned
    assert "tuning ran each grid point twice, with seeds 0, 1" in tuned


# ---- 5. a script's rate schedule -------------------------------------------------------------------------------


def test_a_scripts_derived_rate_schedule_is_said_once_before_running_and_named_in_the_report(
    tmp_path, monkeypatch, capsys
):
    from psgrid.cluster.experiments.settings import schedule_note

    script = tmp_path / "train.py"
    script.write_text("import psgrid\n")
    command = [sys.executable, str(script), "--steps", "100"]
    job = mnist(lr_schedule="cosine")
    settings = plain_settings(job, "sync,async", workers=WORKERS, script=command, script_given=command)
    x = experiment_from(job, settings, tmp_path / "cmp")
    note = schedule_note(x)
    assert f"from [train] steps = {job.train.steps}" in note and "sets lr_updates" in note
    fake_runs(monkeypatch)
    assert Compare(x, progress=False).run() == 0
    assert capsys.readouterr().err.count(f"psctl compare: {note}") == 1
    md = (tmp_path / "cmp" / "report.md").read_text()
    script_line = next(line for line in md.splitlines() if line.startswith("Script: "))
    assert "cosine" in script_line and "lr_updates" in script_line
    assert schedule_note(experiment_from(mnist(), plain_settings(mnist(), script=command), tmp_path)) is None
    built_in = plain_settings(job)["job_summary"]
    assert "cosine" in built_in and schedule_note(experiment_from(job, plain_settings(job), tmp_path)) is None


# ---- 6. dropped pushes ------------------------------------------------------------------------------------------------


def test_dropped_pushes_are_what_the_shards_counted_not_only_those_every_shard_dropped(tmp_path):
    write_run(tmp_path / "run", 0.9, summary={"shard_stats": [{"dropped_late": 31}, {"dropped_late": 33}]})
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    steps = [i for i, line in enumerate(lines) if '"step"' in line]
    # 20 pushes every shard dropped, 24 that some shards dropped and another applied (MIXED to the worker).
    for n, i in enumerate(steps[:44]):
        lines[i] = json.dumps({**json.loads(lines[i]), "outcome": "DROPPED_LATE" if n < 20 else "MIXED"})
    (tmp_path / "run" / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    row = row_of(tmp_path / "run", target=0.5)
    assert row["dropped_pushes"] == pytest.approx((31 + 33) / 2) and row["dropped_pushes"] > 20
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    del summary["shard_stats"]  # an older run: the pushes every shard dropped
    (tmp_path / "run" / "summary.json").write_text(json.dumps(summary))
    assert row_of(tmp_path / "run", target=0.5)["dropped_pushes"] == 20


# ---- 7. --report-only with a target ---------------------------------------------------------------------------------


def test_report_only_with_a_target_records_the_command_that_set_it(tmp_path):
    from psgrid.cluster.cli import main

    out = experiment_dir(tmp_path, {"sync": [0.9], "async": [0.9]})
    assert main(["compare", "--out", str(out), "--report-only", "--target-accuracy", "0.5"]) == 0
    saved = json.loads((out / SETTINGS_FILE).read_text())
    assert (saved["target_accuracy"], saved["target_source"]) == (0.5, "given")
    assert "--report-only" in saved["report_command"] and "--target-accuracy 0.5" in saved["report_command"]
    rows = rewrite_report(out)  # written again without a target: the one given stays, and who gave it
    assert {r["target_accuracy"] for r in rows} == {0.5}
    md = (out / "report.md").read_text()
    assert saved["command"] in md and saved["report_command"] in md
    assert "given on the command line of the --report-only command above" in md


# ---- 8. a script's length is its own ----------------------------------------------------------------------------


@pytest.mark.parametrize("flag", ["--steps", "--epochs"])
def test_steps_or_epochs_with_a_script_are_refused_in_one_line(tmp_path, capsys, flag):
    from psgrid.cluster.cli import main

    script = tmp_path / "train.py"
    script.write_text("import psgrid\n")
    out = tmp_path / "cmp"
    assert main(["compare", "--out", str(out), flag, "60", "--", "python", str(script)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"psctl compare: error: {flag}: a script decides its own length; pass it the steps after -- instead"
    assert not out.exists()


# ---- 10. the help and the title -------------------------------------------------------------------------------


def test_the_help_gives_the_tuning_repeats_default_and_a_scripts_report_is_named_after_it(tmp_path, capsys):
    from psgrid.cluster.cli import main
    from psgrid.cluster.commands.compare import TUNE_REPEATS

    with pytest.raises(SystemExit):
        main(["compare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "one each" not in text and f"{TUNE_REPEATS} of each point" in text
    script = tmp_path / "train_mine.py"
    script.write_text("import psgrid\n")
    settings = plain_settings(mnist(), script=["python", str(script)], script_given=["python", str(script)])
    assert settings["title"] == "psctl compare: train_mine"
