"""The target test accuracy whose time to reach an experiment compares, chosen by a rule no single run can move.

Given on the command line (``--target-accuracy``), it is that. Otherwise it is :data:`FRACTION` of the
best setting's median final test accuracy: the best that one mode reliably ends at, a little lowered so
that every run of a setting that trains as well can reach it. A median over repeats is not moved by
one bad run, and a diverged run has no say: the target is never set by the worst run, as a minimum
over runs would be (one async run ending at 0.51 once set a target every other run passed long before).

Tuning (``--tune``) races its grid points to the same rule over the tune runs, and the report then
keeps that target, so tuning and the report judge by one number.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

from psgrid.cluster.experiments.stability import counted, setting_of

FRACTION = 0.95
GIVEN, AUTO, TUNING = "given", "auto", "tuning"  # where the target came from


def rule_text(source: str) -> str:
    """How the target was chosen, for the report."""
    if source == GIVEN:
        return "given on the command line"
    rule = (
        f"{FRACTION:.0%} of the best setting's median final test accuracy (a median over repeats, diverged "
        f"runs left out, so no single run sets it)"
    )
    return rule + (", over the tuning runs; the repeats are timed to the same target" if source == TUNING else "")


def auto_target(rows: Iterable[dict]) -> float | None:
    """FRACTION of the highest median final test accuracy of any setting (None: no run has one)."""
    finals: dict[tuple, list[float]] = {}
    for r in counted(rows):
        if not r.get("diverged") and _number(r.get("final_test_accuracy")):
            finals.setdefault(setting_of(r), []).append(float(r["final_test_accuracy"]))
    if not finals:
        return None
    return round(FRACTION * max(statistics.median(v) for v in finals.values()), 4)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
