"""A mode's defaults are one rule (cluster/job/mode_defaults.py): psctl launch, LocalCluster and compare apply it alike.

async and ssp run with ``async_momentum = "auto"`` where the shards' SGD has momentum, unless the job file
or the command line says ``async_momentum`` itself; a command that adds it says so in one line.
"""

from __future__ import annotations

import json

import pytest

import psgrid
from psgrid.cluster.job.config import apply_overrides, load_job
from psgrid.cluster.job.mode_defaults import note, with_mode_defaults
from tests.support import psctl

MNIST = "mnist"  # SGD, lr 0.05, momentum 0.9, mode sync


def write_job(tmp_path, extra: str = "") -> str:
    path = tmp_path / "job.toml"
    path.write_text(
        'name = "md"\nshards = 1\nworkers = 2\nmode = "async"\noptimizer = "sgd"\nlr = 0.05\nmomentum = 0.9\n'
        'model = "mlp"\nhidden = [16]\ndataset = "mnist5k"\nbatch_size = 32\nsteps = 3\neval_every = 0\n'
        'device = "cpu"\n' + extra
    )
    return str(path)


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_stale_modes_get_auto_momentum_where_sgd_has_momentum(mode):
    job = apply_overrides(load_job(MNIST), {"mode": mode})
    got, added = with_mode_defaults(job, given=(), spec=MNIST)
    assert added == (("async_momentum", "auto"),)
    assert got.server.async_momentum == "auto"
    assert job.server.async_momentum == "off"  # a new job: the one given is not changed
    line = note(got, added, "psctl launch")
    assert line.count("\n") == 0 and "async_momentum=off" in line and f"{mode} runs with" in line


@pytest.mark.parametrize(
    "overrides",
    [
        {"mode": "sync"},  # sync applies every gradient to the version it came from
        {"mode": "async", "momentum": 0.0},  # no momentum to lower
        {"mode": "async", "optimizer": "adam", "lr": 0.001},  # auto lowers SGD's momentum only
    ],
)
def test_nothing_is_added_where_the_rule_does_not_apply(overrides):
    job = apply_overrides(load_job(MNIST), overrides)
    got, added = with_mode_defaults(job, given=(), spec=MNIST)
    assert added == () and got.server.async_momentum == "off"
    assert note(got, added, "psctl launch") is None


def test_a_choice_on_the_command_line_or_in_the_file_is_kept(tmp_path):
    job = apply_overrides(load_job(MNIST), {"mode": "async"})
    assert with_mode_defaults(job, given=("async_momentum",), spec=MNIST)[1] == ()
    said_off = write_job(tmp_path, 'async_momentum = "off"\n')
    assert with_mode_defaults(load_job(said_off), given=(), spec=said_off)[1] == ()
    in_table = tmp_path / "table.toml"
    in_table.write_text('mode = "async"\nmomentum = 0.9\n[server]\nasync_momentum = "off"\n')
    assert with_mode_defaults(load_job(str(in_table)), given=(), spec=str(in_table))[1] == ()


def test_psctl_launch_runs_async_with_the_modes_default_and_says_so(tmp_path):
    spec = write_job(tmp_path)
    out = tmp_path / "run"
    done = psctl("launch", "--config", spec, "--out", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr
    said = [line for line in done.stderr.splitlines() if "the mode's default" in line]
    assert len(said) == 1 and said[0].startswith('psctl launch: async runs with async_momentum = "auto"')
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["server"]["async_momentum"] == "auto"
    assert 'async_momentum = "auto"' in (out / "job.toml").read_text()  # what --resume reads back

    kept = psctl(
        "launch", "--config", spec, "--out", str(tmp_path / "off"), "--no-progress", "--set", "async_momentum=off"
    )
    assert kept.returncode == 0, kept.stderr
    assert "the mode's default" not in kept.stderr
    assert json.loads((tmp_path / "off" / "summary.json").read_text())["config"]["server"]["async_momentum"] == "off"


def test_local_cluster_applies_the_same_rule(capsys):
    with psgrid.LocalCluster(shards=1, mode="async", config=MNIST) as cluster:
        assert cluster.job.server.async_momentum == "auto"
    assert "psgrid.LocalCluster: async runs with async_momentum" in capsys.readouterr().err
    with psgrid.LocalCluster(shards=1, mode="async", config=MNIST, async_momentum="off") as cluster:
        assert cluster.job.server.async_momentum == "off"


def test_compare_keeps_the_job_files_own_choice(tmp_path):
    spec = write_job(tmp_path, 'async_momentum = "off"\n')
    out = tmp_path / "cmp"
    done = psctl(
        "compare", "--config", spec, "--modes", "sync,async", "--workers", "2", "--repeats", "1", "--out", str(out),
        "--no-progress", timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    experiment = json.loads((out / "experiment.json").read_text())
    assert experiment["mode_defaults"] == {}
    rows = (out / "summary.csv").read_text()
    assert "async_momentum=auto" not in rows
