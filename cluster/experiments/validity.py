"""Which numbers a run's records may hold: a script's metrics are data to check, never trusted.

A user's script logs whatever it computes (``Session.push(loss=...)``, ``Session.log_eval(test_accuracy=...)``):
a loss of 1e308 or -inf, an accuracy of 1e9 or -1. The report takes means, medians and plots of them, so
every such value is checked where a run is read (results.py), and no report sees one out of its range:

* an accuracy is a number in [0, 1]; any other is left out (None), and the run is marked
  ``invalid_metrics`` with what it logged, so a value no evaluation can give never passes as a result;
* a loss beyond +-LARGEST_LOSS counts as infinite: means of losses near the largest float overflow
  (``math.fsum`` raises, NumPy warns and gives inf), and so does a log-scaled axis drawn up to them.
  NaN stays NaN: it is what a script that pushes no loss records. A loss that was finite and then was
  not is a divergence (results.divergence); one infinite before it was ever finite marks the run
  ``invalid_metrics``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

# Past it a loss is taken as infinite. No training that has not diverged gets near it (float32, in which
# workers compute, ends at 3.4e38), and it keeps every sum, mean and log-scaled plot of losses far from the
# largest float (1.8e308): at 1e300, matplotlib's log axis overflowed drawing a margin past it.
LARGEST_LOSS = 1e100
ACCURACIES = {"test_accuracy": "test accuracy", "train_accuracy": "train accuracy"}
REJECTED = "rejected"  # an event's key for the values left out of it, as the script logged them


def real(x) -> bool:
    """A JSON number (bool is not one)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def loss(x) -> float | None:
    """A loss as reports read it: None if not a number, +-inf beyond +-LARGEST_LOSS, else the number."""
    if not real(x):
        return None
    if abs(x) > LARGEST_LOSS:  # a JSON integer may be past any float: compared, never converted
        return math.inf if x > 0 else -math.inf
    return float(x)


def accuracy(x) -> float | None:
    """An accuracy as reports read it: the number if it is in [0, 1], else None."""
    return float(x) if real(x) and 0.0 <= x <= 1.0 else None


def checked_eval(event: dict) -> dict:
    """``event`` (an evaluation) with each accuracy out of range left out, and kept under ``rejected``."""
    rejected = {k: event[k] for k in ACCURACIES if event.get(k) is not None and accuracy(event[k]) is None}
    if not rejected:
        return event
    return {**event, **dict.fromkeys(rejected), REJECTED: rejected}


def problems(events: Iterable[dict], summary: dict) -> list[str]:
    """What a run logged that no report can use, in words; empty when nothing.

    ``events`` are the run's events as results.run_events reads them (accuracies already checked),
    ``summary`` its summary.json.
    """
    found = []
    events = list(events)
    for key, words in ACCURACIES.items():
        bad = [e[REJECTED][key] for e in events if key in e.get(REJECTED, {})]
        if bad:
            found.append(f"{words} {_text(bad[0])} at {_count(len(bad), 'evaluation')}, outside [0, 1]")
        final = summary.get(key)
        if not bad and final is not None and accuracy(final) is None:
            found.append(f"final {words} {_text(final)}, outside [0, 1]")
    recorded = [
        x for e in events if e["event"] == "step" and (x := loss(e.get("loss"))) is not None and not math.isnan(x)
    ]
    if recorded and math.isinf(recorded[0]):
        found.append(
            f"a loss infinite or past +-{LARGEST_LOSS:g} before any finite one "
            f"({_count(sum(map(math.isinf, recorded)), 'step')} in all)"
        )
    return found


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _text(x) -> str:
    """A logged value, shortly: 1e+09, -inf, nan, 'high' (a string)."""
    if not real(x):
        return repr(x)
    try:
        return f"{x:g}"
    except OverflowError:  # a JSON integer past the largest float
        return "an integer past 1.8e+308"
