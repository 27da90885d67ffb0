"""What psctl compare refuses before it creates anything, and what it keeps apart from other experiments.

In-process, no training runs: each refusal is one line, exit code 2, and no folder or file written.
"""

from __future__ import annotations

import json

import pytest

from psgrid.cluster.cli import main
from psgrid.cluster.experiments.compare import SETTINGS_FILE
from tests.test_compare_rules import (  # noqa: F401 - no_plots: reports without their PNGs here too
    experiment_dir,
    no_plots,
    read_events,
)


def refusal(capsys, *argv: str) -> str:
    """The one line ``psctl compare ARGV`` refuses with (exit code 2)."""
    assert main(["compare", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    return err


# ---- 1. a seed is the repeats', never a setting ----------------------------------------------------------------


@pytest.mark.parametrize(
    "given",
    [
        ["--mode-set", "sync:seed=4"],
        ["--mode-set", "async:train.seed=4"],
        ["--tune", "seed=5,9"],
        ["--tune", "train.seed=5,9"],
    ],
)
def test_a_seed_in_tune_or_mode_set_is_refused_pointing_at_seeds(tmp_path, capsys, given):
    out = tmp_path / "cmp"
    err = refusal(capsys, "--modes", "sync,async", "--steps", "100", *given, "--out", str(out))
    assert err.startswith(f"psctl compare: error: {given[0]} ") and "give --seeds" in err
    assert not out.exists()


# ---- 2. backup workers that a sync run of the fewest workers cannot have ---------------------------------------------


def test_backup_workers_not_below_the_fewest_workers_are_refused_before_the_folder_is_made(tmp_path, capsys):
    out = tmp_path / "bw"
    argv = ["--modes", "sync", "--workers", "1,2", "--backup-workers", "1", "--steps", "50", "--out", str(out)]
    err = refusal(capsys, *argv)
    assert err.startswith("psctl compare: error: --backup-workers (1) must be less than the fewest --workers (1)")
    assert not out.exists()
    err = refusal(capsys, "--modes", "allreduce", "--workers", "2", "--backup-workers", "2", "--out", str(out))
    assert "--backup-workers (2)" in err and "--workers (2)" in err  # all-reduce runs as sync on the shards
    assert not out.exists()


# ---- 3. --report-only checks its values as a run does -----------------------------------------------------------


@pytest.mark.parametrize(
    "given, says",
    [
        (["--classes", "1"], "--classes must be at least 2, got 1"),
        (["--target-accuracy", "1.5"], "--target-accuracy must be in (0, 1], got 1.5"),
        (["--target-accuracy", "-3"], "--target-accuracy must be in (0, 1], got -3.0"),
        (["--modes", "foo,bar", "--repeats", "0"], "--modes: unknown mode 'foo'"),
        (["--repeats", "0", "--target-accuracy", "0.5"], "--repeats must be at least 1, got 0"),
    ],
)
def test_report_only_refuses_what_a_run_refuses_and_saves_nothing(tmp_path, capsys, given, says):
    out = experiment_dir(tmp_path, {"sync": [0.9]})
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    err = refusal(capsys, "--out", str(out), "--report-only", *given)
    assert err.startswith(f"psctl compare: error: {says}")
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert "report_command" not in json.loads((out / SETTINGS_FILE).read_text())


# ---- 4. experiments sharing one --tensorboard folder --------------------------------------------------------------


def final_accuracies(tb) -> list[float]:
    """The last test accuracy of every run folder named sync-w4-r0 anywhere under ``tb``."""
    found = []
    for folder in sorted(tb.rglob("sync-w4-r0")):
        values = [
            round(v.simple_value, 4) for e in read_events(folder) for v in e.summary.value if v.tag == "test/accuracy"
        ]
        found.append(values[-1])
    return found


def test_experiments_sharing_a_tensorboard_folder_keep_their_runs_of_the_same_name(tmp_path):
    pytest.importorskip("tensorboardX", reason="the tensorboard extra (in the test extra too, so CI runs this)")
    from psgrid.cluster.experiments.compare import rewrite_report

    tb = tmp_path / "tb"
    first = experiment_dir(tmp_path / "a", {"sync": [0.9]})  # both named cmp, both with a run sync-w4-r0
    second = experiment_dir(tmp_path / "b", {"sync": [0.8]})
    rewrite_report(first, tensorboard=tb)
    rewrite_report(second, tensorboard=tb)
    assert final_accuracies(tb) == [0.9, 0.8]
    assert sorted(p.name for p in tb.iterdir()) == ["cmp", "cmp-2"]
    rewrite_report(first, tensorboard=tb)  # its own runs written again: replaced, never doubled; the other's kept
    assert final_accuracies(tb) == [0.9, 0.8]
    assert [len(list(f.glob("events.out.tfevents.*"))) for f in sorted(tb.rglob("sync-w4-r0"))] == [1, 1]


# ---- 5. what a --resume that is refused says differs ----------------------------------------------------------


def test_a_refused_resume_names_only_the_settings_that_differ(tmp_path):
    from psgrid.cluster.errors import UsageError
    from psgrid.cluster.experiments.resumable import check_resumable
    from tests.test_compare_rules import mnist, plain_settings

    saved = plain_settings(mnist(steps=100), "sync,async", repeats=3)
    with pytest.raises(UsageError) as refused:
        check_resumable(saved, plain_settings(mnist(steps=200, lr=0.5), "sync,async", repeats=3), tmp_path)
    said = str(refused.value)
    assert "[train] steps was 100, now 200" in said and "[server] lr was 0.05, now 0.5" in said
    assert "modes" not in said.partition("(")[0] and "repeats" not in said.partition("(")[0]
    with pytest.raises(UsageError, match=r"other settings: repeats was 3, now 2 \("):
        check_resumable(saved, plain_settings(mnist(steps=100), "sync,async", repeats=2), tmp_path)


def test_a_resume_naming_the_script_from_another_folder_says_to_run_it_from_the_first(tmp_path, monkeypatch):
    from psgrid.cluster.errors import UsageError
    from psgrid.cluster.experiments.resumable import check_resumable
    from tests.test_compare_rules import mnist, plain_settings

    first, other = tmp_path / "first", tmp_path / "other"
    (first / "sub").mkdir(parents=True)
    other.mkdir()
    (first / "sub" / "train.py").write_text("import psgrid\n")
    monkeypatch.chdir(first)
    saved = plain_settings(mnist(), script=["python", "sub/train.py", "--steps", "9"])
    monkeypatch.chdir(other)
    now = plain_settings(mnist(), script=["python", str(first / "sub" / "train.py"), "--steps", "9"])
    with pytest.raises(UsageError) as refused:
        check_resumable(saved, now, tmp_path)
    said = str(refused.value)
    assert f"the same script named from another folder; run psctl compare --resume from {first} " in said
    assert "modes" not in said.partition("(")[0] and "workers" not in said.partition("(")[0]


# ---- --out that cannot be a folder -----------------------------------------------------------------------------


@pytest.mark.parametrize("report_only", [[], ["--report-only"]])
def test_an_out_that_is_a_file_is_refused_in_one_line(tmp_path, capsys, report_only):
    """It was a NotADirectoryError traceback from the first read of OUT/chosen.json."""
    file = tmp_path / "a-file"
    file.write_text("mine")
    said = refusal(capsys, "--config", "mnist", "--modes", "sync", "--out", str(file), *report_only)
    assert f"--out {file} is a file, not a folder" in said, said
    said = refusal(capsys, "--config", "mnist", "--modes", "sync", "--out", str(file / "run"), *report_only)
    assert f"{file} is a file, not a folder" in said, said
    assert file.read_text() == "mine" and [p.name for p in tmp_path.iterdir()] == ["a-file"]


def test_one_staleness_written_two_ways_is_one_mode(capsys):
    """ssp:02 and ssp:2 ran twice as "different" modes, the same bound each time."""
    from psgrid.cluster.experiments.experiment import parse_modes

    assert [(m.label, m.staleness) for m in parse_modes("sync,ssp:02")] == [("sync", None), ("ssp:02", 2)]
    said = refusal(capsys, "--config", "mnist", "--modes", "ssp:02,ssp:2", "--out", "/nonexistent/never-made")
    assert "--modes: ssp:2 is listed twice" in said, said


def test_seeds_of_the_wrong_count_under_tune_name_tune_repeats(capsys):
    said = refusal(
        capsys, "--config", "mnist", "--repeats", "1", "--seeds", "5", "--tune", "lr=0.1,0.2", "--out", "/nonexistent/x"
    )
    assert "--seeds expects 2 distinct" in said and "the most of --repeats 1 and --tune-repeats 2" in said, said


def test_a_tuned_backup_workers_not_below_the_fewest_workers_is_refused_before_the_folder_is_made(tmp_path, capsys):
    """--workers 1,2 with --tune backup_workers=0,1: the grid's 1 was checked against the job's 2 workers only."""
    out = tmp_path / "cmp"
    argv = ["--config", "mnist", "--modes", "sync", "--workers", "1,2", "--tune", "backup_workers=0,1"]
    said = refusal(capsys, *argv, "--out", str(out))
    assert "--tune backup_workers tries 1, not less than the fewest --workers (1)" in said, said
    assert not out.exists()
