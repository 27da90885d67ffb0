"""From a finished run's folder to the experiment's records: its step events and its summary row.

A run's folder is what ``psctl launch`` or ``psctl allreduce`` wrote (``summary.json``,
``metrics.jsonl``). Times are made relative to the run's start: the first worker's ``start``
event, which every worker writes once it has joined, so process start-up and the join are
not counted against any mode.
"""

from __future__ import annotations

import bisect
import csv
import itertools
import json
import math
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from psgrid.cluster.experiments import stability, validity
from psgrid.cluster.experiments.experiment import ROW_FIELDS, Run
from psgrid.psserver import files

STEP_FIELDS = (
    "rank",
    "step",
    "loss",
    "pull_s",
    "compute_s",
    "delay_s",
    "push_s",
    "staleness",
    "outcome",
    "samples",
    "bytes",
)


def read_jsonl(path: Path) -> list[dict]:
    events = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    event = json.loads(line)
                except ValueError:
                    continue  # a line cut short by a crash
                if isinstance(event, dict):
                    events.append(event)
    except FileNotFoundError:
        pass
    return events


def read_summary(run_dir: Path) -> dict | None:
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (FileNotFoundError, ValueError):
        return None
    return summary if isinstance(summary, dict) else None


def run_events(run_dir: Path) -> list[dict]:
    """The run's step and eval events, then its final evaluation, each with ``t``: seconds since the run's start.

    Losses and accuracies are as :mod:`~psgrid.cluster.experiments.validity` reads them: a loss past
    +-1e100 infinite, an accuracy outside [0, 1] left out (and kept under ``rejected``). An evaluation
    also has ``epoch`` where the evaluating worker said how many rows its shard has (the built-in
    trainer does): the passes over its shard its steps before the evaluation made.
    """
    raw = read_jsonl(run_dir / "metrics.jsonl")
    starts = [e["time"] for e in raw if e.get("event") == "start" and _number(e.get("time"))]
    if not starts:
        return []
    t0 = min(starts)
    rows = {
        e.get("rank"): e["shard_rows"]
        for e in raw
        if e.get("event") == "start" and _number(e.get("shard_rows")) and e["shard_rows"] > 0
    }
    events = []
    for e in raw:
        if e.get("event") == "step" and _number(e.get("started")):
            events.append(
                {
                    "event": "step",
                    "t": e["started"] - t0,
                    **{k: e.get(k) for k in STEP_FIELDS},
                    "loss": validity.loss(e.get("loss")),
                }
            )
        elif e.get("event") == "eval" and _number(e.get("time")):
            events.append(
                validity.checked_eval(
                    {
                        "event": "eval",
                        "t": e["time"] - t0,
                        "rank": e.get("rank"),
                        "step": e.get("step"),
                        "test_accuracy": e.get("test_accuracy"),
                    }
                )
            )
    events.sort(key=lambda e: e["t"])
    if rows:
        _add_epochs(events, rows)
    final = final_evaluation(raw, events, read_summary(run_dir) or {}, t0)
    return events + ([final] if final else [])


def final_evaluation(raw: list[dict], events: list[dict], summary: dict, t0: float) -> dict | None:
    """The run's final evaluation as an event (``final_eval``), or None where it has none that can be used.

    Its accuracy is the summary's, the one summary.csv gives as the final test accuracy, so that
    the best accuracy and the time to a target count it too. It is timed at the end of training
    (the last worker's ``done``), where the weights it measured were final; the coordinator's own
    ``final_eval`` record comes after the shards were also asked for their counters; a run without
    either (an older one, one that recorded neither) at the last step or evaluation it recorded, the
    latest time known to be before it. Its step is the most steps a worker made, as a periodic
    evaluation's is the steps before it.
    """
    accuracy = validity.accuracy(summary.get("test_accuracy"))
    if accuracy is None or not events:
        return None
    ends = [e["time"] for e in raw if e.get("event") == "done" and _number(e.get("time"))]
    if not ends:
        ends = [e["time"] for e in raw if e.get("event") == "final_eval" and _number(e.get("time"))]
    steps = [e["step"] for e in events if e["event"] == "step" and isinstance(e.get("step"), int)]
    return {
        "event": "final_eval",
        "t": max(ends) - t0 if ends else events[-1]["t"],
        "rank": None,
        "step": max(steps) + 1 if steps else None,
        "test_accuracy": accuracy,
    }


def _add_epochs(events: list[dict], shard_rows: dict) -> None:
    """Each evaluation's ``epoch``: its rank's samples over the steps before it, over the rows of its shard."""
    steps: dict = {}  # rank -> [(step, samples)] in step order
    for e in events:
        if e["event"] == "step" and isinstance(e.get("step"), int) and e.get("rank") in shard_rows:
            steps.setdefault(e["rank"], []).append((e["step"], e["samples"] if _number(e.get("samples")) else 0))
    done: dict = {}  # rank -> (steps in order, samples through each)
    for rank, pairs in steps.items():
        pairs.sort()
        done[rank] = ([k for k, _ in pairs], list(itertools.accumulate(n for _, n in pairs)))
    for e in events:
        if e["event"] == "eval" and e.get("rank") in shard_rows and isinstance(e.get("step"), int):
            order, totals = done.get(e["rank"], ([], []))
            # An evaluation at step k follows the steps before k: the rank's samples through step k - 1.
            i = bisect.bisect_left(order, e["step"])
            e["epoch"] = (totals[i - 1] if i else 0) / shard_rows[e["rank"]]


EVALUATIONS = ("eval", "final_eval")  # the periodic ones and the run's final one: both count


def best_accuracy(events: Iterable[dict]) -> float | None:
    accs = [e["test_accuracy"] for e in events if e["event"] in EVALUATIONS and _number(e.get("test_accuracy"))]
    return max(accs) if accs else None


def time_to_target(events: Iterable[dict], target: float) -> float | None:
    """Seconds from the run's start to its first evaluation, the final one included, at or above ``target``.

    None: never.
    """
    for e in events:
        if e["event"] in EVALUATIONS and _number(e.get("test_accuracy")) and e["test_accuracy"] >= target:
            return e["t"]
    return None


def waits_by_worker(summary: dict) -> list[float] | None:
    """Seconds each worker spent waiting for the others, in rank order.

    Parameter server: the shards' consistency waits, per worker the longest over the shards (a
    worker pulls from every shard at once). All-reduce: the time its ranks spent in Allreduce.
    """
    if summary.get("wait_s_by_worker") is not None:
        return [float(w) for w in summary["wait_s_by_worker"]]
    per_worker: dict[int, float] = {}
    for shard in summary.get("shard_stats") or []:
        for w in shard.get("waits") or []:
            per_worker[w["worker_id"]] = max(per_worker.get(w["worker_id"], 0.0), w["seconds"])
    if not per_worker and not summary.get("shard_stats"):
        return None
    return [per_worker.get(rank, 0.0) for rank in range(int(summary.get("workers") or 0))]


CHANCE_FACTOR = 1.5  # test accuracy at or below 1.5 / classes is chance: the model learned nothing
LOSS_GROWTH = 1.1  # a loss that ends 10% above where it began grew (a flat one wobbles by less)


def divergence(events: list[dict], summary: dict, classes: int | None) -> str | None:
    """Why the run diverged, or None: its loss turned non-finite or grew, or its accuracy fell to chance.

    The loss's start and end are the means over the first and last tenth of all workers' steps
    (one step's loss is too noisy to compare). ``classes`` None skips the chance test (a user's
    script, whose number of classes psctl does not know).
    """
    losses = [e["loss"] for e in events if e["event"] == "step" and validity.real(e.get("loss"))]
    finite = [x for x in losses if math.isfinite(x)]
    last = validity.loss(summary.get("final_loss"))
    # A script that pushes no loss records NaN from its first step: only a loss that was finite can diverge.
    if finite and (not math.isfinite(losses[-1]) or (last is not None and not math.isfinite(last))):
        return "its loss became non-finite"
    if len(finite) >= 2:
        k = max(1, len(finite) // 10)
        start, end = float(np.mean(finite[:k])), float(np.mean(finite[-k:]))
        # Grown by a tenth of its size, whatever its sign: a script's own loss may be negative.
        if end > start + (LOSS_GROWTH - 1) * abs(start):
            return f"its loss grew from {start:.3g} to {end:.3g}"
    final = validity.accuracy(summary.get("test_accuracy"))
    if classes and final is not None and final <= CHANCE_FACTOR / classes:
        return f"its test accuracy {final:.3f} is at chance (<= {CHANCE_FACTOR:g}/{classes} classes)"
    return None


def summarize_run(
    run: Run, summary: dict | None, events: list[dict], target: float | None, classes: int | None = None
) -> dict:
    """The run's row of summary.csv (keys: ROW_FIELDS); ``classes`` as :func:`divergence` takes it."""
    summary = summary or {}
    # The shards refuse a non-finite gradient and the workers stop: the training diverged, psgrid did not fail.
    refused = stability.refused_non_finite(summary)
    steps = [e for e in events if e["event"] == "step"]
    staleness = [e["staleness"] for e in steps if _number(e.get("staleness")) and e["staleness"] >= 0]
    waits = waits_by_worker(summary) if summary else None
    row = dict.fromkeys(ROW_FIELDS)
    row.update(run.describe())
    row.update(
        status=stability.DIVERGED if refused else summary.get("status", "interrupted"),
        diverged=int(refused or (bool(summary) and divergence(events, summary, classes) is not None)),
        loss_rise=stability.loss_rise(events),
        invalid_metrics="; ".join(validity.problems(events, summary)) or None,
        best_test_accuracy=best_accuracy(events),
        target_accuracy=target,
        time_to_target_s=time_to_target(events, target) if target is not None else None,
        final_test_accuracy=validity.accuracy(summary.get("test_accuracy")),
        final_train_accuracy=validity.accuracy(summary.get("train_accuracy")),
        final_loss=validity.loss(summary.get("final_loss")),
        steps=summary.get("steps"),
        samples=summary.get("samples"),
        wall_s=summary.get("wall_s"),
        samples_per_s=summary.get("samples_per_s"),
        mean_staleness=float(np.mean(staleness)) if staleness else None,
        # An observed staleness (a whole number of updates), not one interpolated between two.
        p99_staleness=float(np.percentile(staleness, 99, method="higher")) if staleness else None,
        dropped_pushes=dropped_pushes(steps, summary),
        bytes_moved=sum(int(e["bytes"]) for e in steps if _number(e.get("bytes"))),
        mean_wait_s=float(np.mean(waits)) if waits else None,
        max_wait_s=max(waits) if waits else None,
        wait_s_by_worker=";".join(f"{w:.3f}" for w in waits) if waits else None,
    )
    for key in ("pull_s", "compute_s", "delay_s", "push_s"):
        values = [e[key] for e in steps if _number(e.get(key))]
        row[key] = float(np.mean(values)) if values else None
    return row


def dropped_pushes(steps: list[dict], summary: dict) -> float:
    """The pushes a closed sync round dropped, as the shards counted them: the mean of their ``dropped_late``.

    A worker's push is one push to every shard, and a round can close on one shard before another: a
    push some shards dropped and others applied or held is, to the worker, outcome MIXED, which a push
    applied by one shard and held by another is too. So the shards' counts are the ones to read; their
    mean counts a push every shard dropped once, and one half of them dropped as half. A run whose
    summary has no shard counts (an older one): the pushes every shard dropped (outcome DROPPED_LATE).
    """
    counts = [s["dropped_late"] for s in summary.get("shard_stats") or [] if _number(s.get("dropped_late"))]
    if counts:
        return sum(counts) / len(counts)
    return sum(1 for e in steps if e.get("outcome") == "DROPPED_LATE")


def set_target(row: dict, events: list[dict], target: float | None) -> dict:
    """``row`` with its target and time to it (for a target chosen once every row is known)."""
    row.update(target_accuracy=target, time_to_target_s=time_to_target(events, target) if target is not None else None)
    return row


def write_csv(path: Path, rows: list[dict]) -> None:
    with files.replacing(path, newline="") as f:
        writer = csv.DictWriter(f, fieldnames=ROW_FIELDS)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _cell(row.get(k)) for k in ROW_FIELDS})


def read_csv(path: Path) -> list[dict]:
    """summary.csv back as rows, numbers as numbers and empty cells as None."""
    with open(path, newline="") as f:
        return [{k: _parse_cell(v) for k, v in row.items()} for row in csv.DictReader(f)]


def result_lines(run: Run, events: list[dict]) -> list[str]:
    """results.jsonl's lines for one run: every step and evaluation, tagged with the run."""
    tag = run.describe()
    return [json.dumps({**tag, **e}) for e in events]


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _parse_cell(text: str):
    if text == "":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
