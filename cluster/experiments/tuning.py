"""Each mode at its own best settings: ``psctl compare --tune KEY=V1,V2 ...``.

Published comparisons tune every method before comparing them (Chen et al. 2016, "Revisiting
Distributed Synchronous SGD"): one learning rate for all modes decides the race before it
starts. So, per mode and (workers, stragglers) group, the experiment first runs every point of
the grid (the *tune* phase: ``--tune-repeats`` short runs each, repeat r at seed base+r), then
picks the point that did best and runs the repeats there. One run per point picks by luck where
a mode is unstable: two runs of a point that trains half the time disagree.

Best, over a point's repeats: no repeat diverged; more than half reached the tuning target; the
median time to it (a run that never reached it counting as longer); the median final test
accuracy. The tuning target is the report's (:mod:`psgrid.cluster.experiments.target`): the given
``--target-accuracy``, else 95% of the best grid point's median final test accuracy.
"""

from __future__ import annotations

import itertools
import math
import re

from psgrid.cluster.errors import UsageError
from psgrid.cluster.experiments.experiment import Settings
from psgrid.cluster.experiments.grouping import spread
from psgrid.cluster.experiments.target import auto_target
from psgrid.cluster.job.config import ConfigError, JobConfig, apply_overrides, parse_assignment, route

DEFAULT_REPEATS = 2

# Keys the experiment sets per run: tuning them would change what is compared.
PER_RUN = ("mode", "staleness", "workers", "stragglers", "out", "name")
# Set per repeat (base+r, or --seeds): a value given for it would be overwritten by every run.
SEED = "seed"

Group = tuple[str, int, str]  # (mode label, workers, stragglers)


def split_values(text: str) -> list[str]:
    """``"0.01,0.05"`` -> ``["0.01", "0.05"]``; commas inside brackets stay (``[64,64],[128]``)."""
    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    return [item.strip() for item in items if item.strip()]


def parse_tune(texts: list[str], job: JobConfig, *, flag: str = "--tune", server_only: bool = False) -> dict:
    """``["lr=0.01,0.05", "momentum=0,0.9"]`` -> ``{"lr": [0.01, 0.05], "momentum": [0, 0.9]}``.

    Values are parsed as ``--set`` parses them (TOML, bare words strings), and each is checked
    against ``job`` now, so a bad value is refused before anything runs. With ``server_only``
    (a user's script, which reads its own training settings) only the shards' keys are taken.
    """
    grid: dict[str, list] = {}
    for text in texts:
        key, sep, raw = text.partition("=")
        key = key.strip()
        values = [parse_assignment(f"{key}={v}")[1] for v in split_values(raw)] if sep and key else []
        if not values:
            raise UsageError(f"{flag} expects KEY=V1,V2,... (e.g. {flag} lr=0.01,0.05,0.2), got {text!r}")
        if key.rpartition(".")[2] == SEED:
            raise UsageError(
                f"{flag} {text}: seeds are set per repeat: give --seeds S1,S2,... (or --seed BASE for base+r)"
            )
        if key.rpartition(".")[2] in PER_RUN:
            raise UsageError(f"{flag} {text}: {key} is set by the experiment itself (--modes, --workers, ...)")
        if key in grid:
            raise UsageError(f"{flag}: {key} is given twice")
        try:
            sections = {section for section, _ in route(key)}
            for value in values:
                apply_overrides(job, {key: value})
        except ConfigError as e:
            # Not the job file's name: the value came from this flag.
            raise UsageError(f"{flag} {text}: {re.sub(r'^.*?[(]with overrides[)]: ', '', str(e))}") from None
        if server_only and sections != {"server"}:
            raise UsageError(
                f"{flag} {text}: with a script after --, tune the shards' keys (lr, momentum, "
                f"optimizer, ...); the script reads its own training settings"
            )
        if len(set(map(repr, values))) != len(values):
            raise UsageError(f"{flag} {text}: a value is given twice")
        grid[key] = values
    return grid


def points(grid: dict) -> list[Settings]:
    """Every combination of the grid's values, the first key outermost."""
    keys = list(grid)
    return [tuple(zip(keys, combo)) for combo in itertools.product(*(grid[k] for k in keys))]


def group_of(row: dict) -> Group:
    return row["mode"], row["workers"], row["stragglers"]


def tuning_target(rows: list[dict], given: float | None) -> float | None:
    """The target every grid point races to: the given one, else the report's rule over the tune runs."""
    return given if given is not None else auto_target(rows)


def grid_point(row: dict, grid: dict) -> str:
    """A tune run's point of the grid alone ("lr=0.05"): its settings less the mode's own (defaults, --mode-set)."""
    point = " ".join(t for t in (row.get("settings") or "").split() if t.partition("=")[0] in set(grid))
    return point or "job's"


def point_of(row: dict) -> tuple:
    return (*group_of(row), row.get("settings") or "")


def choose(rows: list[dict]) -> dict[Group, list[dict]]:
    """Each (mode, workers, stragglers) group's best grid point: the rows of its repeats (rows: the tune runs')."""
    points: dict[tuple, list[dict]] = {}
    for r in _usable(rows):
        points.setdefault(point_of(r), []).append(r)
    chosen: dict[Group, list[dict]] = {}
    for point, runs in points.items():  # the grid's order: the first of equals wins
        group = point[:3]
        if group not in chosen or _rank(runs) < _rank(chosen[group]):
            chosen[group] = runs
    return chosen


def _rank(runs: list[dict]) -> tuple:
    """Smaller is better: no repeat diverged, more than half reached the target, sooner, higher final accuracy."""
    ttt, final = spread(runs, "time_to_target_s").median, spread(runs, "final_test_accuracy").median
    return (
        any(r.get("diverged") for r in runs),
        ttt is None,
        ttt if ttt is not None else 0.0,
        -(final if final is not None else -1.0),
    )


def _usable(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("status") == "ok"]


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
