"""What benchmarks/mode_settings_probe.py keeps of a run besides its accuracy: the task, failures, the curve."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "mode_settings_probe.py"
_spec = importlib.util.spec_from_file_location("mode_settings_probe", _PATH)
probe = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(probe)


def test_a_synthetic_runs_row_names_its_task_and_test_set_and_a_shipped_datasets_none():
    synthetic = {"config": {"train": {"dataset": "synthetic", "synthetic_seed": 3, "synthetic_test_samples": 10000}}}
    assert probe.task_of(synthetic) == {"synthetic_seed": 3, "test_samples": 10000}
    assert probe.task_of({"config": {"train": {"dataset": "mnist5k", "synthetic_seed": 0}}}) == {}
    assert probe.task_of({}) == {}


def test_a_lost_worker_is_counted_and_a_restarted_shard_is_named_but_loses_nothing():
    summary = {
        "status": "ok",
        "failures": [
            {"name": "shard-1", "role": "shard", "exit_code": -9, "tail": "restored\n"},
            {"name": "worker-2", "role": "worker", "exit_code": 1, "tail": "x\nMemoryError\n\n"},
        ],
    }
    row = probe.failures_of(summary)
    assert row["lost"] == 1 and "message" not in row
    assert row["failure"] == "shard-1 (shard) exit -9: restored"


def test_the_curve_is_rank_zeros_evaluations_in_order(tmp_path):
    records = [
        {"event": "eval", "rank": 0, "step": 50, "test_accuracy": 0.25},
        {"event": "eval", "rank": 1, "step": 50, "test_accuracy": 0.99},
        {"event": "step", "rank": 0, "step": 60},
        {"event": "eval", "rank": 0, "step": 100, "test_accuracy": 0.5},
    ]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert probe.eval_curve(tmp_path / "metrics.jsonl") == "50:0.250 100:0.500"
    assert probe.eval_curve(tmp_path / "missing.jsonl") == ""
