"""A mode's defaults are one rule (cluster/job/mode_defaults.py): launch, mpi, LocalCluster, compare and server alike.

The job file's table of the mode ([async]) first, then psgrid's own: async and ssp run with
``async_momentum = "auto"`` where the shards' optimizer has momentum (SGD's, Adam's beta1), unless the job file or the command line
says ``async_momentum`` itself. The command line always wins; a command that adds a setting says so.
"""

from __future__ import annotations

import csv
import json

import pytest

import psgrid
from psgrid.cluster.cli import build_parser
from psgrid.cluster.commands.server import server_config_from_args
from psgrid.cluster.errors import ConfigError
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
    assert added.settings == (("async_momentum", "auto"),) and added.table == ()
    assert got.server.async_momentum == "auto"
    assert job.server.async_momentum == "off"  # a new job: the one given is not changed
    line = note(got, added, "psctl launch")
    assert line.count("\n") == 0 and "async_momentum=off" in line and f"{mode} runs with" in line


@pytest.mark.parametrize("mode", ["async", "ssp"])
def test_stale_modes_lower_adams_beta1_too(mode):
    job = apply_overrides(load_job(MNIST), {"mode": mode, "optimizer": "adam", "lr": 0.001})
    got, added = with_mode_defaults(job, given=(), spec=MNIST)
    assert added.psgrid == (("async_momentum", "auto"),) and got.server.async_momentum == "auto"
    line = note(got, added, "psctl launch")
    assert "the shards lower beta1 0.9 by what W asynchronous workers add" in line and "\n" not in line


@pytest.mark.parametrize(
    "overrides",
    [
        {"mode": "sync"},  # sync applies every gradient to the version it came from
        {"mode": "async", "momentum": 0.0},  # no momentum to lower
        {"mode": "async", "optimizer": "adam", "lr": 0.001, "beta1": 0.0},  # Adam without momentum
    ],
)
def test_nothing_is_added_where_the_rule_does_not_apply(overrides):
    job = apply_overrides(load_job(MNIST), overrides)
    got, added = with_mode_defaults(job, given=(), spec=MNIST)
    assert added.settings == () and got.server.async_momentum == "off"
    assert note(got, added, "psctl launch") is None


def test_a_choice_on_the_command_line_or_in_the_file_is_kept(tmp_path):
    job = apply_overrides(load_job(MNIST), {"mode": "async"})
    assert with_mode_defaults(job, given=("async_momentum",), spec=MNIST)[1].settings == ()
    said_off = write_job(tmp_path, 'async_momentum = "off"\n')
    assert with_mode_defaults(load_job(said_off), given=(), spec=said_off)[1].settings == ()
    in_table = tmp_path / "table.toml"
    in_table.write_text('mode = "async"\nmomentum = 0.9\n[server]\nasync_momentum = "off"\n')
    assert with_mode_defaults(load_job(str(in_table)), given=(), spec=str(in_table))[1].settings == ()


def test_the_job_files_table_of_the_mode_is_applied_under_the_command_line(tmp_path):
    spec = write_job(tmp_path, "[async]\nlr = 0.01\nmomentum = 0.0\n[sync]\nlr = 0.2\n")
    job = load_job(spec)
    assert job.server.lr == 0.05  # the tables wait for the mode
    got, added = with_mode_defaults(job, given=(), spec=spec)
    assert (got.server.lr, got.server.momentum, got.server.async_momentum) == (0.01, 0.0, "off")  # no momentum left
    assert added.table == (("lr", 0.01), ("momentum", 0.0)) and added.psgrid == ()
    line = note(got, added, "psctl launch")
    assert line == "psctl launch: async runs with lr = 0.01, momentum = 0.0: the job file's [async]"
    got, _ = with_mode_defaults(job, given=("lr",), spec=spec)  # --lr on the command line
    assert (got.server.lr, got.server.momentum) == (0.05, 0.0)
    synced = apply_overrides(job, {"mode": "sync"})
    assert with_mode_defaults(synced, given=(), spec=spec)[0].server.lr == 0.2
    ssp = apply_overrides(job, {"mode": "ssp"})  # no [ssp]: psgrid's own default only
    got, added = with_mode_defaults(ssp, given=(), spec=spec)
    assert (got.server.lr, added.settings) == (0.05, (("async_momentum", "auto"),))


@pytest.mark.parametrize(
    ("table", "said"),
    [
        ("[async]\nsteps = 3\n", "[async] steps: a mode's table takes the shards' [server] keys only"),
        ("[async]\nlr_rate = 0.1\n", "unknown key 'lr_rate' in [async]"),
        ("[async]\nmode = 'sync'\n", "cannot change the mode"),
        ("[ssp]\nlr = -1.0\n", "[ssp] lr must be"),
        ("[ssp]\nlr = 'fast'\n", "lr must be a number"),
        ("[bsp]\nlr = 0.1\n", "[sync], [async] and [ssp]"),
    ],
)
def test_a_bad_mode_table_is_refused_when_the_file_is_read(tmp_path, table, said):
    path = tmp_path / "bad.toml"
    path.write_text('mode = "sync"\n' + table)
    with pytest.raises(ConfigError, match=None) as refused:
        load_job(str(path))
    assert said in str(refused.value) and "\n" not in str(refused.value)


def test_psctl_server_applies_its_modes_table_under_its_flags(tmp_path):
    spec = tmp_path / "job.toml"
    spec.write_text('[server]\nmode = "sync"\nlr = 0.05\n[async]\nlr = 0.01\nstaleness_compensation = "lr"\n')
    parse = build_parser().parse_args
    assert server_config_from_args(parse(["server", "--config", str(spec)])).lr == 0.05  # sync: [server] as is
    c = server_config_from_args(parse(["server", "--config", str(spec), "--mode", "async"]))
    assert (c.lr, c.staleness_compensation) == (0.01, "lr")
    c = server_config_from_args(parse(["server", "--config", str(spec), "--mode", "async", "--set", "lr=0.3"]))
    assert (c.lr, c.staleness_compensation) == (0.3, "lr")


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


def test_compare_keeps_the_job_files_own_choice_and_runs_its_mode_tables(tmp_path):
    spec = write_job(tmp_path, 'async_momentum = "off"\n[async]\nlr = 0.02\n')
    out = tmp_path / "cmp"
    done = psctl(
        "compare", "--config", spec, "--modes", "sync,async", "--workers", "2", "--repeats", "1", "--out", str(out),
        "--no-progress", timeout=240,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    experiment = json.loads((out / "experiment.json").read_text())
    assert experiment["mode_defaults"] == {"async": [["lr", 0.02]]}  # sync: the job's; no auto momentum
    with (out / "summary.csv").open() as f:
        rows = {r["mode"]: r for r in csv.DictReader(f)}
    assert rows["async"]["settings"] == "lr=0.02" and rows["sync"]["settings"] == ""
