"""psctl bench runs end to end and reports the documented fields (speed is judged in the benchmark, not here)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_bench_transport_json_rows():
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "psgrid.cluster.cli",
            "bench",
            "transport",
            "--sizes",
            "4K,64K",
            "--repeat",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    transport = [r for r in rows if r["bench"] == "transport"]
    apply = [r for r in rows if r["bench"] == "apply"]
    assert [r["size_bytes"] for r in transport] == [4096, 65536]
    for r in transport:
        for key in ("gbps", "tcp_gbps", "ratio_vs_tcp", "grpc_gbps", "grpc_ratio_vs_tcp"):
            assert r[key] > 0, key
        assert r["ratio_vs_tcp"] == pytest.approx(r["tcp_s"] / r["ps_s"])
        assert r["shm_planes"] == ["shm"]  # the shared-memory rows went through shared memory
        for key in ("shm_pull_s", "shm_push_s", "copyto_s", "apply_s", "shm_gbps", "shm_ratio_vs_copyto"):
            assert r[key] > 0, key
        assert r["shm_ratio_vs_copyto"] == pytest.approx(2 * r["copyto_s"] / (r["shm_pull_s"] + r["shm_push_s"]))
    assert {r["optimizer"] for r in apply} == {"sgd", "momentum", "adam"}
    for r in apply:
        assert r["apply_gbps"] > 0 and r["memcpy_gbps"] > 0
        assert r["ratio_vs_memcpy"] == pytest.approx(r["memcpy_s"] / r["apply_s"])


def test_bench_refuses_a_bad_size():
    done = subprocess.run(
        [sys.executable, "-m", "psgrid.cluster.cli", "bench", "transport", "--sizes", "10"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 2 and "at least 4 KiB" in done.stderr


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_ps_json_rows_name_their_suite_settings_and_the_floor(tmp_path):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "psgrid.cluster.cli",
            "bench",
            "ps",
            "--params",
            "100K",
            "--shards",
            "1",
            "--workers",
            "2",
            "--planes",
            "shm,tcp",
            "--seconds",
            "0.5",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["data_plane"], r["planes_used"]) for r in rows] == [("shm", ["shm"]), ("tcp", ["tcp"])]
    for r in rows:
        assert (r["suite"], r["params"], r["shards"], r["workers"], r["mode"]) == ("ps", 100_000, 1, 2, "async")
        assert r["updates_per_s"] > 0 and r["gbps"] > 0 and r["floor_updates_per_s"] > 0
        assert r["floor_s"] == pytest.approx(2 * r["copy_s"] + r["apply_s"])
        assert r["ratio_vs_floor"] == pytest.approx(r["updates_per_s"] / r["floor_updates_per_s"])


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("pull_ahead", [False, True])
def test_bench_train_json_rows_have_the_breakdown_beside_no_servers(tmp_path, pull_ahead):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "psgrid.cluster.cli",
            "bench",
            "train",
            "--models",
            "mlp",
            "--modes",
            "async",
            "--hidden",
            "32",
            "--batch-size",
            "32",
            "--steps",
            "20",
            "--shards",
            "1",
            "--workers",
            "1",
            "--json",
            *(["--pull-ahead"] if pull_ahead else ["--shard-placement", "process,worker"]),
        ],
        capture_output=True,
        text=True,
        timeout=230,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    served, *hosted, alone = [json.loads(line) for line in done.stdout.splitlines()]
    configurations = 1 + len(hosted)
    if not pull_ahead:  # the same job with its shard in the worker's process, which calls it
        (hosted,) = hosted
        assert (hosted["shard_placement"], hosted["planes_used"], hosted["mode"]) == ("worker", ["local"], "async")
        assert hosted["samples_per_s"] > 0 and hosted["push_s"] > 0
        assert hosted["ratio_vs_no_servers"] == pytest.approx(
            hosted["samples_per_s"] / hosted["no_servers_samples_per_s"]
        )
    assert served["shard_placement"] == "process"
    assert (alone["mode"], alone["shards"], alone["ratio_vs_no_servers"]) == ("none", 0, 1.0)
    assert (served["suite"], served["model"], served["mode"], served["data_plane"]) == ("train", "mlp", "async", "shm")
    assert served["planes_used"] == ["shm"] and served["params"] == alone["params"]
    assert (alone["shard_device"], served["shard_device"]) == (None, "cpu")  # CPU workers: auto keeps host shards
    assert served["pull_ahead"] is pull_ahead
    for key in ("samples_per_s", "pull_s", "compute_s", "push_s"):
        assert served[key] > 0, key
    # Each repeat is divided by the no-servers runs beside it: one before the first repeat, one after each.
    assert alone["repeats"] == 1 + configurations and len(alone["samples_per_s_each"]) == alone["repeats"]
    each = alone["samples_per_s_each"]
    assert served["no_servers_samples_per_s"] == pytest.approx((each[0] + each[1]) / 2)
    assert served["ratio_vs_no_servers"] == pytest.approx(served["samples_per_s"] / served["no_servers_samples_per_s"])
    assert served["ratios"] == [pytest.approx(served["ratio_vs_no_servers"])]
    # Steady steps: the first tenth left out, where the whole job's count has them all.
    assert served["samples_per_s"] > 0 and served["job_samples_per_s"] > 0
    assert served["samples_per_s"] != served["job_samples_per_s"]


def test_bench_ps_against_an_unknown_revision_says_so_in_one_line(tmp_path):
    temp = Path(tempfile.gettempdir())
    before = set(temp.glob("psgrid-bench-*"))
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "psgrid.cluster.cli",
            "bench",
            "ps",
            "--against",
            "no-such-rev",
            "--params",
            "100K",
            "--shards",
            "1",
            "--workers",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert done.returncode == 2, done.stderr
    root = subprocess.run(
        [sys.executable, "-c", "from psgrid.cluster.bench.ps import CODE_ROOT; print(CODE_ROOT)"],
        capture_output=True,
        text=True,
        timeout=30,
        cwd=tmp_path,
    ).stdout.strip()
    if (Path(root) / ".git").exists():  # psgrid runs from this checkout (an editable install)
        expected = f"--against no-such-rev: no such revision in {root} (try HEAD~1 or a commit id)"
    else:  # installed (CI, the quick start): no revisions to check out
        expected = (
            f"--against needs psgrid run from a git checkout, and this one runs from {root}: "
            f"install it from the checkout with pip install -e ."
        )
    assert done.stderr.strip() == f"psctl bench: error: {expected}", done.stderr
    assert set(temp.glob("psgrid-bench-*")) == before  # no worktree folder made or left


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_bench_script_measures_a_users_script_through_psgrid_against_itself_alone(tmp_path):
    from tests.support import ROOT

    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "psgrid.cluster.cli",
            "bench",
            "script",
            "--modes",
            "async",
            "--workers",
            "1",
            "--shard-placement",
            "process,worker",
            "--repeats",
            "2",
            "--skip",
            "5",
            "--set",
            "pull_ahead=true",  # a setting of async's, in the mode the runs are in
            "--json",
            "--",
            "python",
            str(ROOT / "examples" / "train_cupy.py"),
            "--steps",
            "25",
            "--eval-every",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=170,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    repeats, summary = [r for r in rows if "repeat" in r], [r for r in rows if "repeat" not in r]
    assert [(r["repeat"], r["shard_placement"]) for r in repeats] == [
        (0, "process"),
        (0, "worker"),
        (1, "process"),
        (1, "worker"),
    ]
    for r in repeats:  # each run's ratio is against the script alone just before it and just after
        assert r["status"] == "ok" and r["alone"]["samples_per_s"] > 0 and r["samples_per_s"] > 0
        assert r["pulled_ahead"] is True
        beside = (r["alone"]["samples_per_s"] + r["alone_after"]["samples_per_s"]) / 2
        assert r["alone_samples_per_s"] == pytest.approx(beside)
        assert r["ratio"] == pytest.approx(r["samples_per_s"] / beside)
    # alone, process, alone, worker, alone in each repeat: the run after one configuration is before the next
    assert repeats[0]["alone_after"] == repeats[1]["alone"] and repeats[2]["alone_after"] == repeats[3]["alone"]
    assert repeats[1]["alone_after"] != repeats[2]["alone"]
    assert [(r["shard_placement"], r["planes_used"]) for r in summary] == [("process", ["shm"]), ("worker", ["local"])]
    for row in summary:  # the row's alone is the reference its ratio is to: alone x ratio is its samples/s
        assert len(row["ratios"]) == 2 and row["alone_samples_per_s"] * row["ratio"] == pytest.approx(
            row["samples_per_s"]
        )


def test_bench_scripts_table_shows_the_reference_its_ratio_is_to():
    """Each row's alone column is its repeats' mean of the two alone runs beside them, not every alone run's."""
    import io

    from psgrid.cluster.bench.script import _row, _table

    # The script alone sped up between the runs: the first configuration's references are slow, the second's fast.
    references = [{"samples_per_s": v, "compute_s": 0.01, "push_s": 0.001} for v in (100.0, 140.0, 300.0)]
    runs = {
        "async": {"samples_per_s": 60.0, "alone_samples_per_s": 120.0, "ratio": 0.5},
        "sync": {"samples_per_s": 110.0, "alone_samples_per_s": 220.0, "ratio": 0.5},
    }
    rows = []
    for mode, found in runs.items():
        found.update(planes_used=["shm"], shard_device="cpu", pull_s=None, compute_s=None, push_s=None, delay_s=None)
        rows.append(_row(mode, 2, 1, "process", [found], references))
    out = io.StringIO()
    _table(rows, out)
    for row, line in zip(rows, out.getvalue().splitlines()[2:], strict=True):
        psgrid_column, alone_column, ratio_column = (float(x) for x in line.split()[5:8])
        assert alone_column == runs[row["mode"]]["alone_samples_per_s"]
        assert alone_column * ratio_column == pytest.approx(psgrid_column, rel=0.01)


def test_bench_script_refuses_a_setting_one_of_its_modes_cannot_take_before_anything_runs(capsys, tmp_path):
    from psgrid.cluster.cli import main

    script = tmp_path / "never_run.py"
    script.write_text("raise SystemExit('ran')\n")
    argv = ["bench", "script", "--modes", "async,sync", "--set", "pull_ahead=true", "--", "python", str(script)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "pull_ahead = true applies to async and ssp only" in err and len(err.strip().splitlines()) == 1


def test_bench_script_needs_a_command_and_other_targets_take_none(capsys):
    from psgrid.cluster.cli import main

    assert main(["bench", "script"]) == 2
    assert "psctl bench script needs the command each worker runs after --" in capsys.readouterr().err
    assert main(["bench", "apply", "--", "python", "train.py"]) == 2
    assert "psctl bench apply runs no command of yours" in capsys.readouterr().err
