"""Is a setting's training stable? Said before anything else in the report, because it decides what the rest means.

A *setting* is one mode with one worker count, straggler setting and set of job keys; its repeats
differ only by their seeds (experiment.repeat_seeds). It is

* ``diverged`` in the runs whose loss or weights turned non-finite (the shards refuse a non-finite
  gradient, ``non_finite``, and the workers stop: such a run is ``diverged``, never ``failed``), whose
  loss grew over the run, or whose accuracy fell to chance (results.divergence);
* ``unstable`` where its final test accuracies lie more than :data:`UNSTABLE_SPREAD` apart across
  repeats, or where the loss of one of its runs rose for a stretch (:func:`loss_rise`): the mode does
  not train reliably at these settings, and a median hides how often it fails;
* ``stable`` otherwise.

Pure functions of the rows and events: no files, no processes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from psgrid.cluster.experiments import validity

UNSTABLE_SPREAD = 0.05  # final test accuracies of one setting more than this apart (max - min): unstable
# A spread this close to the line is said to be near it: the range of a few repeats is a noisy measure (it
# moved by 0.018 and 0.033 from seeds 0-4 to seeds 5-9 for synthetic-cnn's async and ssp:2 at 8 workers,
# docs/experiments/synthetic-gpu-stale-tables-2xH200), so near the line the label alone overstates what
# was measured: other seeds may give the other one.
NEAR_LINE = 0.02
RISE_PARTS = 10  # the loss is read as the means of tenths of the run's steps (one step is too noisy)
RISE_STRETCH = 3  # rising through this many consecutive tenths ...
RISE_BY = 0.10  # ... by more than a tenth of where the stretch began: the loss rose for a stretch
STABLE, UNSTABLE, DIVERGED = "stable", "unstable", "diverged"

# What a worker's last lines say when the shards refused a non-finite push (psserver/intake.py's message, and the
# reason's name as a gRPC error shows it): the run diverged, it did not fail.
NON_FINITE_SIGNS = ("contains NaN or infinity", "NON_FINITE", "non_finite")

RULE = (
    f"unstable: final test accuracy spread more than {UNSTABLE_SPREAD:g} (max - min) across repeats, or a run's "
    f"mean loss rose through {RISE_STRETCH} consecutive tenths of its steps by more than "
    f"{RISE_BY:.0%}; diverged: loss or weights non-finite, loss grown over the run, or accuracy at chance; a "
    f"spread within {NEAR_LINE:g} of {UNSTABLE_SPREAD:g} is said to be near the line: the range of a few repeats "
    f"is a noisy measure, and other seeds may give the other label"
)


def refused_non_finite(summary: dict) -> bool:
    """Whether a failed run stopped because its weights or gradients turned non-finite (the shards' refusal)."""
    if summary.get("status") != "failed":
        return False
    said = [str(summary.get("message") or "")] + [
        str(f.get("tail") or "") for f in summary.get("failures") or [] if isinstance(f, dict)
    ]
    return any(sign in text for text in said for sign in NON_FINITE_SIGNS)


def loss_rise(events: Iterable[dict]) -> str | None:
    """Where the run's mean loss rose through RISE_STRETCH consecutive tenths by more than RISE_BY, in words."""
    losses = [
        e["loss"]
        for e in events
        if e.get("event") == "step" and validity.real(e.get("loss")) and math.isfinite(e["loss"])
    ]
    if len(losses) < RISE_PARTS * 2:
        return None
    parts = [float(np.mean(p)) for p in np.array_split(np.asarray(losses), RISE_PARTS)]
    for i in range(RISE_PARTS - RISE_STRETCH):
        stretch = parts[i : i + RISE_STRETCH + 1]
        rising = all(b > a for a, b in zip(stretch, stretch[1:]))
        if rising and stretch[-1] - stretch[0] > RISE_BY * abs(stretch[0]):
            return (
                f"its loss rose from {stretch[0]:.3g} to {stretch[-1]:.3g} over tenths "
                f"{i + 1}-{i + 1 + RISE_STRETCH} of its steps"
            )
    return None


def setting_of(row: dict) -> tuple:
    return row["mode"], row["workers"], row["stragglers"], row.get("settings") or ""


@dataclass(frozen=True)
class Verdict:
    """One setting's stability over its runs that count (finished or diverged)."""

    runs: int
    diverged: int  # runs that diverged
    finals: tuple[float, ...]  # final test accuracies of the runs that have one
    risen: int  # runs whose loss rose for a stretch

    @property
    def spread(self) -> float | None:
        # rounded below any accuracy's resolution, so that 0.55 - 0.50 is 0.05 as 0.85 - 0.80 is, not above it
        return round(max(self.finals) - min(self.finals), 9) if len(self.finals) >= 2 else None

    @property
    def near_line(self) -> bool:
        """Whether the spread is within :data:`NEAR_LINE` of the line: its label could go either way with other seeds."""
        return self.spread is not None and round(abs(self.spread - UNSTABLE_SPREAD), 9) <= NEAR_LINE

    @property
    def label(self) -> str:
        if self.diverged:
            return DIVERGED
        if self.risen or (self.spread is not None and self.spread > UNSTABLE_SPREAD):
            return UNSTABLE
        return STABLE

    def text(self) -> str:
        """In words: ``stable, spread 0.004``, ``unstable: final accuracy spread 0.275 (0.494..0.769)``,
        ``stable, spread 0.046, near the 0.05 line``, ``diverged in 2 of 5``."""
        near = f", near the {UNSTABLE_SPREAD:g} line" if self.near_line else ""
        said = []
        if self.spread is not None and self.spread > UNSTABLE_SPREAD:
            said.append(
                f"final accuracy spread {self.spread:.3f} ({min(self.finals):.3f}..{max(self.finals):.3f}){near}"
            )
        if self.risen:
            said.append(f"loss rose in {self.risen} of {self.runs}")
        if self.diverged:
            return ", ".join([f"diverged in {self.diverged} of {self.runs}", *said])
        if said:
            return UNSTABLE + ": " + ", ".join(said)
        return STABLE + (f", spread {self.spread:.3f}{near}" if self.spread is not None else "")


def counted(rows: Iterable[dict]) -> list[dict]:
    """The runs that are results: finished, or stopped because they diverged."""
    return [r for r in rows if r.get("status") in ("ok", DIVERGED)]


def verdicts(rows: Iterable[dict]) -> dict[tuple, Verdict]:
    """Each setting's :class:`Verdict`, by :func:`setting_of`."""
    by_setting: dict[tuple, list[dict]] = {}
    for r in counted(rows):
        by_setting.setdefault(setting_of(r), []).append(r)
    return {
        key: Verdict(
            len(runs),
            sum(1 for r in runs if r.get("diverged")),
            tuple(
                float(r["final_test_accuracy"])
                for r in runs
                if _number(r.get("final_test_accuracy")) and not r.get("diverged")
            ),
            sum(1 for r in runs if r.get("loss_rise")),
        )
        for key, runs in by_setting.items()
    }


def mark(rows: list[dict]) -> list[dict]:
    """Set each row's ``stability``: ``diverged`` for a run that did, else its setting's label."""
    found = verdicts(rows)
    for r in rows:
        verdict = found.get(setting_of(r))
        r["stability"] = (
            None
            if verdict is None
            else DIVERGED
            if r.get("diverged")
            else (UNSTABLE if verdict.label != STABLE else STABLE)
        )
    return rows


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
