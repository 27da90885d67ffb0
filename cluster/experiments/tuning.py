"""Each mode at its own best settings: ``psctl compare --tune KEY=V1,V2 ...``.

Published comparisons tune every method before comparing them (Chen et al. 2016, "Revisiting
Distributed Synchronous SGD"): one learning rate for all modes decides the race before it
starts. So, per mode and (workers, stragglers) group, the experiment first runs every point of
the grid (the *tune* phase: one short run each), then picks the point that did best and runs
the repeats there.

Best is the earliest to the tuning target; where no point reaches it, the best final test
accuracy; a point that diverged never wins while another did not. The tuning target is the
given ``--target-accuracy``, else per group the highest accuracy that every mode reached at
some point of its grid (so each mode is judged at a level it can reach when well tuned).
"""

from __future__ import annotations

import itertools
import math
import re

from psgrid.cluster.job.config import JobConfig, ConfigError, apply_overrides, parse_assignment, route
from psgrid.cluster.errors import UsageError
from psgrid.cluster.experiments.experiment import Settings

# Keys the experiment sets per run: tuning them would change what is compared.
PER_RUN = ("mode", "staleness", "workers", "stragglers", "out", "name")

Group = tuple[str, int, str]      # (mode label, workers, stragglers)


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
            raise UsageError(f"{flag} {text}: with a script after --, tune the shards' keys (lr, momentum, "
                             f"optimizer, ...); the script reads its own training settings")
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


def tuning_targets(rows: list[dict], given: float | None) -> dict[tuple[int, str], float | None]:
    """Per (workers, stragglers): the target the grid points race to (see the module's docstring)."""
    targets: dict[tuple[int, str], float | None] = {}
    by_group: dict[tuple[int, str], dict[str, float]] = {}
    for r in _usable(rows):
        if r.get("diverged") or not _number(r.get("best_test_accuracy")):
            continue
        best = by_group.setdefault((r["workers"], r["stragglers"]), {})
        best[r["mode"]] = max(best.get(r["mode"], -1.0), r["best_test_accuracy"])
    for r in rows:
        g = (r["workers"], r["stragglers"])
        targets[g] = given if given is not None else (min(by_group[g].values()) if by_group.get(g) else None)
    return targets


def choose(rows: list[dict]) -> dict[Group, dict]:
    """Each (mode, workers, stragglers) group's best grid point: its row (rows: the tune runs' rows)."""
    chosen = {}
    for group in dict.fromkeys(group_of(r) for r in rows):
        runs = [r for r in _usable(rows) if group_of(r) == group]
        if runs:
            chosen[group] = min(runs, key=_rank)
    return chosen


def _rank(row: dict) -> tuple:
    """Smaller is better: not diverged, reached the target, sooner, then higher final accuracy."""
    ttt, final = row.get("time_to_target_s"), row.get("final_test_accuracy")
    return (bool(row.get("diverged")), not _number(ttt), ttt if _number(ttt) else 0.0,
            -(final if _number(final) else -1.0))


def _usable(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("status") == "ok"]


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
