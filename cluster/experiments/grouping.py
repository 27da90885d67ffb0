"""An experiment's rows grouped for comparison, medians over repeats, and numbers as text.

A *group* is one ``(workers, stragglers)`` setting; the modes are compared within a group,
and every number is a median over the group's repeats that finished (status ``ok``). The
report, its reading and its plots all read the rows through these.
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from fractions import Fraction

from psgrid.cluster.experiments.experiment import NO_STRAGGLERS

Group = tuple[int, str]  # (workers, straggler setting)


# ---- the rows, grouped ------------------------------------------------------------------------


def finished(rows: Iterable[dict]) -> list[dict]:
    """The runs that count: those that finished, and those that stopped because they diverged (a result of
    their mode and settings). A failed or interrupted run's numbers describe only part of a run."""
    return [r for r in rows if r.get("status") in ("ok", "diverged")]


def modes_of(rows: list[dict], settings: dict) -> list[str]:
    """Mode labels in the experiment's order, then any other found in the rows."""
    labels = list(settings.get("modes") or [])
    return labels + [m for m in dict.fromkeys(r["mode"] for r in rows) if m not in labels]


def groups_of(rows: list[dict], settings: dict) -> list[Group]:
    """The (workers, stragglers) settings present in ``rows``, in the experiment's order."""
    present = set((r["workers"], r["stragglers"]) for r in rows)
    order = [(w, s) for w in settings.get("workers") or [] for s in settings.get("stragglers") or []]
    return [g for g in order if g in present] + sorted(present - set(order), key=str)


def rows_of(rows: list[dict], group: Group, mode: str) -> list[dict]:
    return sorted(
        (r for r in rows if (r["workers"], r["stragglers"]) == group and r["mode"] == mode),
        key=lambda r: r.get("repeat") or 0,
    )


def showcase_group(groups: list[Group]) -> Group | None:
    """The group the detailed plots show: the first with stragglers, where the modes differ most, else the
    one with the most workers."""
    return next((g for g in groups if g[1] != NO_STRAGGLERS), max(groups, key=lambda g: g[0]) if groups else None)


def group_title(group: Group) -> str:
    """``4 workers, stragglers 3:3`` or ``1 worker, no stragglers``."""
    workers = f"{group[0]} worker{'s' if group[0] != 1 else ''}"
    return f"{workers}, {'no stragglers' if group[1] == NO_STRAGGLERS else 'stragglers ' + group[1]}"


def group_phrase(group: Group) -> str:
    return "With " + group_title(group).replace(", ", " and ", 1)


def straggler_ranks(setting: str) -> list[int]:
    """``"3:3,1:exp:20"`` -> ``[3, 1]``."""
    return [int(m.group(1)) for m in (re.match(r"\s*(\d+):", s) for s in setting.split(",")) if m]


LEVEL = Fraction(95, 100)  # the least probability an interval must hold the median with
# The fewest repeats, each with its own seed, a 95% interval is drawn from: min..max of n values holds the
# median with probability 1 - 2/2^n, 93.75% for 5 and 96.9% for 6. Fewer: min..max, and no interval.
MIN_REPEATS = 6
CENSORED = ("time_to_target_s",)  # a run that never got there has no time, and still counts: it took longer


@dataclass(frozen=True)
class Spread:
    """Median and range of one number over repeats; ``n`` counts the repeats that had it, ``of`` the repeats.

    ``ci`` is the distribution-free 95% interval of the median (:func:`median_interval`) where it can be
    drawn: ``of >= MIN_REPEATS`` repeats, each with its own seed, every one of them with the number; else
    None, and a reader gets ``low..high``. For a time to target (``CENSORED``) a run that never reached the
    target counts as longer than every run that did: the median exists only where more than half reached
    it, and the interval is drawn over every run, its upper bound ``math.inf`` ("never") where it falls on
    a run that never reached it.
    """

    median: float | None
    low: float | None
    high: float | None
    n: int
    ci: tuple[float, float] | None = None
    of: int = 0
    varied: bool = False  # every repeat had its own seed
    censored: bool = False  # a time to target: a run without one never reached it

    @property
    def no_interval(self) -> str | None:
        """Why there is no 95% interval, in words (None: there is one)."""
        if self.ci is not None:
            return None
        repeats = self.of or self.n
        if self.n < repeats and not self.censored:
            return f"only {self.n} of {repeats} runs have it"
        if not self.varied and repeats > 1:
            return "its repeats ran with the same seed"
        if repeats < MIN_REPEATS:
            return f"fewer than {MIN_REPEATS} repeats"
        return f"none of its {repeats} runs reached it"


def spread(rows: Iterable[dict], key: str) -> Spread:
    rows = list(rows)
    values = [float(r[key]) for r in rows if _number(r.get(key))]
    seeds = [r.get("seed") for r in rows]
    varied = None not in seeds and len(set(seeds)) == len(seeds)
    censored = key in CENSORED
    if not values:
        return Spread(None, None, None, 0, of=len(rows), varied=varied, censored=censored)
    # Never reached: longer than any run that did. Ranked last, such runs keep every order statistic
    # meaningful, so the median and its interval are taken over all runs, "never" (inf) where one falls on them.
    ranked = values + [math.inf] * (len(rows) - len(values)) if censored else values
    median = statistics.median(ranked)
    median = median if math.isfinite(median) else None  # more than half never reached it
    whole = len(ranked) == len(rows)
    ci = median_interval(ranked) if varied and whole else None
    return Spread(median, min(values), max(values), len(values), ci, of=len(rows), varied=varied, censored=censored)


def interval_ranks(n: int, level: Fraction = LEVEL) -> tuple[int, Fraction] | None:
    """``(k, coverage)``: the largest k whose ``[x_(k), x_(n-k+1)]`` of n sorted values holds the median
    with probability ``coverage`` >= ``level``; None where even min..max (k = 1) falls short (n <= 5 at 95%).

    The median lies below x_(k) only where at most k - 1 values do, Binomial(n, 1/2), and above x_(n-k+1)
    as often, whatever the distribution: coverage = 1 - 2 P(B <= k - 1), summed exactly. With ties it is
    at least that, the interval being closed.
    """
    best, below = None, 0
    for k in range(1, (n + 1) // 2 + 1):
        below += math.comb(n, k - 1)
        coverage = 1 - Fraction(2 * below, 2**n)
        if coverage < level:
            break  # a larger k only narrows the interval further
        best = (k, coverage)
    return best


def median_interval(values: list[float], level: Fraction = LEVEL) -> tuple[float, float] | None:
    """The distribution-free interval of the median of ``values``: order statistics ``[x_(k), x_(n-k+1)]``
    with k from :func:`interval_ranks`, or None where ``len(values)`` is too few for ``level``."""
    ranks = interval_ranks(len(values), level)
    if ranks is None:
        return None
    ordered = sorted(values)
    return ordered[ranks[0] - 1], ordered[-ranks[0]]


def coverage_text(n: int) -> str:
    """How the interval of n repeats is drawn and how sure it is: ``"[min, max], 96.9% or more"``."""
    k, coverage = interval_ranks(n)
    bounds = "[min, max]" if k == 1 else f"[{_ordinal(k)} lowest, {_ordinal(k)} highest]"
    return f"{bounds}, {float(coverage):.1%} or more"


def _ordinal(k: int) -> str:
    return f"{k}{'th' if 10 <= k % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(k % 10, 'th')}"


def separated(a: Spread, b: Spread) -> bool | None:
    """Whether the two intervals do not overlap; None where either has none (see Spread.no_interval)."""
    if a.ci is None or b.ci is None:
        return None
    return a.ci[1] < b.ci[0] or b.ci[1] < a.ci[0]


def waits_per_rank(row: dict) -> list[float] | None:
    """``wait_s_by_worker`` (``"0.12;0.50"`` or a list) as floats in rank order."""
    raw = row.get("wait_s_by_worker")
    if isinstance(raw, str):
        raw = [w for w in raw.split(";") if w.strip()]
    try:
        return [float(w) for w in raw] if raw else None
    except (TypeError, ValueError):
        return None


# ---- numbers as text ----------------------------------------------------------------------------


def sig(x: float) -> str:
    """Three significant digits, no exponent and no trailing zeros: 0.00123, 1.2, 8, 12300."""
    if x == 0 or not math.isfinite(x):
        return f"{x:g}"
    digits = 2 - math.floor(math.log10(abs(x)))
    text = f"{round(x, digits):.{max(digits, 0)}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def secs(x: float) -> str:
    """Seconds: 0.123, 1.23, 12.3, 1234."""
    return next(f"{x:.{d}f}" for limit, d in ((1, 3), (10, 2), (1000, 1), (math.inf, 0)) if abs(x) < limit)


def acc(x: float) -> str:
    return f"{x:.3f}"


def ratio(x: float) -> str:
    return f"{sig(x)}x"


def join(words: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return words[0] if len(words) == 1 else ", ".join(words[:-1]) + " and " + words[-1]


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
