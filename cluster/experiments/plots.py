"""The plots of a ``psctl compare`` report, as PNG files.

Each plot is a function ``(plot_dir, rows, events, settings) -> Path | None`` that writes
``plot_dir/NAME.png`` (NAME is the function's name) and returns its path, or returns None when
the runs hold nothing for it to show. :data:`PLOTS` lists them in the report's order with
their captions. Only finished runs (status ``ok``) are drawn, and a mode has the same colour in
every plot.

Figures are made with matplotlib's object API (:class:`~matplotlib.figure.Figure`), never
pyplot: nothing is registered globally, so no figure outlives its function and no GUI backend
is ever chosen. Only :mod:`psgrid.cluster.experiments.report` imports this module.
"""

from __future__ import annotations

import math
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch
from matplotlib.ticker import MaxNLocator

from psgrid.cluster.experiments.experiment import NO_STRAGGLERS
from psgrid.cluster.experiments.grouping import (
    MIN_REPEATS,
    finished,
    group_title,
    groups_of,
    modes_of,
    rows_of,
    showcase_group,
    sig,
    spread,
)
from psgrid.psserver import files

# matplotlib's tab10, by the mode's place in the experiment's list of modes.
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
DPI = 100
TIMELINE_FROM_STEP, TIMELINE_STEPS = 5, 20  # the timeline's window, in the lowest rank's steps
TIMELINE_MAX_BARS = 2000  # however fast some workers are, the window stays readable
# A step's parts, in the order a worker does them: (event field, legend, colour, hatch).
SEGMENTS = (
    ("pull_s", "pull, incl. waiting for others", "#9ecae1", None),
    ("compute_s", "compute", "#31a354", None),
    ("delay_s", "straggler delay", "#fdd0a2", "////"),
    ("push_s", "push", "#756bb1", None),
)
TIME_AXIS = "seconds since the run's start"


def _context(rows: list[dict], settings: dict):
    ok = finished(rows)
    modes = modes_of(ok, settings)
    return ok, groups_of(ok, settings), modes, dict(zip(modes, (COLOURS * (1 + len(modes) // len(COLOURS)))))


def _grid(n: int, ncols: int, width: float, height: float) -> tuple[Figure, list]:
    """A figure with ``n`` subplots of ``width`` x ``height`` inches, ``ncols`` to a row at most."""
    ncols = min(n, ncols)
    nrows = math.ceil(n / ncols)
    fig = Figure(figsize=(width * ncols, height * nrows + 1.0), layout="constrained")
    axes = list(fig.subplots(nrows, ncols, squeeze=False).ravel())
    for ax in axes[n:]:
        ax.remove()
    return fig, axes[:n]


def _save(fig: Figure, plot_dir: Path, name: str) -> Path:
    files.make_dirs(plot_dir)
    path = plot_dir / f"{name}.png"
    with files.open_new(path, "wb") as f:
        fig.savefig(f, dpi=DPI, format="png")
    fig.clear()
    return path


def _legend(fig: Figure, handles: list) -> None:
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 6), frameon=False)


def _mode_handles(modes: list[str], colour: dict) -> list:
    return [Line2D([], [], color=colour[m], lw=2, label=m) for m in modes]


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _evals(events: dict, run: str) -> list[tuple[float, float]]:
    return sorted(
        (e["t"], e["test_accuracy"])
        for e in events.get(run) or []
        if e.get("event") == "eval" and _number(e.get("t")) and _number(e.get("test_accuracy"))
    )


def _steps(events: dict, run: str) -> list[dict]:
    return [e for e in events.get(run) or [] if e.get("event") == "step"]


def accuracy_vs_time(plot_dir: Path, rows: list[dict], events: dict, settings: dict) -> Path | None:
    """Test accuracy against time, one subplot per group; the first repeat bold, the others faint."""
    ok, groups, modes, colour = _context(rows, settings)
    curves = {(g, m): [_evals(events, r["run"]) for r in rows_of(ok, g, m)] for g in groups for m in modes}
    drawn = [m for m in modes if any(c for g in groups for c in curves[g, m])]
    if not drawn:
        return None
    target = settings.get("target_accuracy")
    fig, axes = _grid(len(groups), 2, 6.0, 4.0)
    for ax, g in zip(axes, groups):
        for m in drawn:
            for i, curve in enumerate(c for c in curves[g, m] if c):
                t, a = zip(*curve)
                ax.plot(
                    t,
                    a,
                    color=colour[m],
                    lw=2 if i == 0 else 1,
                    alpha=1 if i == 0 else 0.4,
                    marker="o" if len(t) < 3 else None,
                )
        if target is not None:
            ax.axhline(target, color="0.3", ls="--", lw=1)
        ax.set(title=group_title(g), xlabel=TIME_AXIS, ylabel="test accuracy")
        ax.grid(alpha=0.3)
    handles = _mode_handles(drawn, colour)
    if target is not None:
        handles.append(Line2D([], [], color="0.3", ls="--", lw=1, label=f"target {target:.3f}"))
    _legend(fig, handles)
    repeats = any(sum(1 for c in curves[g, m] if c) > 1 for g in groups for m in drawn)
    fig.suptitle("Test accuracy against time" + (" (bold: the first repeat; faint: the others)" if repeats else ""))
    return _save(fig, plot_dir, "accuracy_vs_time")


def _mean_loss(steps: list[dict]) -> tuple[list[int], list[float]]:
    by_step = defaultdict(list)
    for e in steps:
        if isinstance(e.get("step"), int) and _number(e.get("loss")):
            by_step[e["step"]].append(e["loss"])
    order = sorted(by_step)
    return order, [statistics.fmean(by_step[s]) for s in order]


def loss_vs_steps(plot_dir: Path, rows: list[dict], events: dict, settings: dict) -> Path | None:
    """Training loss per step, the mean over workers and repeats, one subplot per group."""
    ok, groups, modes, colour = _context(rows, settings)
    curves = {
        (g, m): _mean_loss([e for r in rows_of(ok, g, m) for e in _steps(events, r["run"])])
        for g in groups
        for m in modes
    }
    drawn = [m for m in modes if any(curves[g, m][0] for g in groups)]
    if not drawn:
        return None
    fig, axes = _grid(len(groups), 2, 6.0, 4.0)
    for ax, g in zip(axes, groups):
        losses = [v for m in drawn for v in curves[g, m][1]]
        for m in drawn:
            if curves[g, m][0]:
                ax.plot(*curves[g, m], color=colour[m], lw=1.5)
        # A diverging mode would flatten everyone else's curve on a linear axis.
        if losses and min(losses) > 0 and max(losses) / min(losses) > 50:
            ax.set_yscale("log")
        ax.set(title=group_title(g), xlabel="step (per worker)", ylabel="training loss, mean over workers")
        ax.grid(alpha=0.3)
    _legend(fig, _mode_handles(drawn, colour))
    fig.suptitle("Training loss against steps")
    return _save(fig, plot_dir, "loss_vs_steps")


def samples_per_s(plot_dir: Path, rows: list[dict], events: dict, settings: dict) -> Path | None:
    """Throughput per mode and group: median bars, min..max error bars."""
    ok, groups, modes, colour = _context(rows, settings)
    stats = {(g, m): spread(rows_of(ok, g, m), "samples_per_s") for g in groups for m in modes}
    drawn = [m for m in modes if any(stats[g, m].median is not None for g in groups)]
    if not drawn:
        return None
    fig = Figure(figsize=(max(6.0, 1.5 + 0.45 * len(groups) * len(drawn)), 4.8), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(drawn)
    for i, m in enumerate(drawn):
        bars = [(j - 0.4 + width * (i + 0.5), stats[g, m]) for j, g in enumerate(groups) if stats[g, m].median]
        if bars:
            ax.bar(
                [x for x, _ in bars],
                [s.median for _, s in bars],
                width,
                color=colour[m],
                yerr=[[s.median - s.low for _, s in bars], [s.high - s.median for _, s in bars]],
                capsize=3,
            )
    ax.set_xticks(range(len(groups)), [group_title(g).replace(", ", "\n") for g in groups])
    ax.set_ylabel("samples/s (all workers)")
    ax.grid(axis="y", alpha=0.3)
    _legend(fig, [Patch(color=colour[m], label=m) for m in drawn])
    fig.suptitle("Throughput: median over repeats, bars from min to max")
    return _save(fig, plot_dir, "samples_per_s")


def staleness(plot_dir: Path, rows: list[dict], events: dict, settings: dict) -> Path | None:
    """How stale the pushes were, per mode, in the showcase group (the first with stragglers)."""
    ok, groups, modes, colour = _context(rows, settings)
    group = showcase_group(groups)
    present = [m for m in modes if group and rows_of(ok, group, m)]
    values = {
        m: [
            int(e["staleness"])
            for r in rows_of(ok, group, m)
            for e in _steps(events, r["run"])
            if _number(e.get("staleness")) and e["staleness"] >= 0
        ]
        for m in present
    }
    if not any(values.values()):
        return None
    fig, axes = _grid(len(present), 4, 3.4, 3.0)
    for ax, m in zip(axes, present):
        v = values[m]
        if v:
            counts = np.bincount(v)
            ax.bar(np.arange(len(counts)), counts, width=0.9, color=colour[m])
            ax.set_xlim(-0.6, max(len(counts), 3) - 0.4)  # a lone bar at 0 (sync) stays a narrow bar
            ax.set_title(f"{m}: mean {sig(float(np.mean(v)))}, p99 {sig(float(np.percentile(v, 99)))}")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        else:
            ax.text(0.5, 0.5, "no staleness recorded", ha="center", va="center", transform=ax.transAxes)
            ax.set(title=m, xticks=[], yticks=[])
        ax.set(xlabel="staleness (updates behind)", ylabel="pushes")
    fig.suptitle(f"Staleness of each push, {group_title(group)}, all repeats pooled")
    return _save(fig, plot_dir, "staleness")


def _duration(e: dict, key: str) -> float:
    return float(e[key]) if _number(e.get(key)) and e[key] > 0 else 0.0


def _end(e: dict) -> float:
    return e["t"] + sum(_duration(e, key) for key, *_ in SEGMENTS)


def _window(steps: list[dict]) -> tuple[float, float] | None:
    """About TIMELINE_STEPS steps of the lowest rank from its step TIMELINE_FROM_STEP (earlier if short)."""
    if not steps:
        return None
    lowest = min(e["rank"] for e in steps)
    mine = sorted((e for e in steps if e["rank"] == lowest), key=lambda e: e["t"])
    first = min(TIMELINE_FROM_STEP, max(0, len(mine) - TIMELINE_STEPS))
    shown = mine[first : first + TIMELINE_STEPS]
    start = shown[0]["t"]
    return start, max(max(map(_end, shown)), start + 1e-3)  # steps with no recorded times: still a window


def _draw_timeline(ax, steps: list[dict], lo: float, hi: float) -> None:
    inside = sorted((e for e in steps if e["t"] < hi and _end(e) > lo), key=lambda e: e["t"])[:TIMELINE_MAX_BARS]
    for rank in sorted({e["rank"] for e in inside}):
        mine = [e for e in inside if e["rank"] == rank]
        starts = [e["t"] for e in mine]
        for key, _, colour, hatch in SEGMENTS:
            spans = []
            for i, e in enumerate(mine):
                if (d := _duration(e, key)) > 0:
                    spans.append((starts[i], d))
                starts[i] += d
            if spans:
                ax.broken_barh(
                    spans,
                    (rank - 0.4, 0.8),
                    facecolors=colour,
                    hatch=hatch,
                    linewidth=0.3,
                    edgecolor="#e6550d" if hatch else "white",
                )


def timeline(plot_dir: Path, rows: list[dict], events: dict, settings: dict) -> Path | None:
    """What each worker did, step by step, in one run per mode (the showcase group's first repeat)."""
    ok, groups, modes, _ = _context(rows, settings)
    group = showcase_group(groups)
    shown = []
    for m in modes:
        runs = rows_of(ok, group, m) if group else []
        steps = (
            [e for e in _steps(events, runs[0]["run"]) if _number(e.get("t")) and isinstance(e.get("rank"), int)]
            if runs
            else []
        )
        if window := _window(steps):
            shown.append((m, runs[0]["run"], steps, window))
    if not shown:
        return None
    ranks = 1 + max(e["rank"] for _, _, steps, _ in shown for e in steps)
    fig, axes = _grid(len(shown), 1, 11.0, 1.0 + 0.35 * max(ranks, 2))
    for ax, (m, run, steps, (lo, hi)) in zip(axes, shown):
        _draw_timeline(ax, steps, lo, hi)
        ax.set(
            xlim=(lo, hi), ylim=(ranks - 0.5, -0.5), title=f"{m} (run {run})", xlabel=TIME_AXIS, ylabel="worker rank"
        )
        ax.set_yticks(range(ranks))
    _legend(
        fig, [Patch(facecolor=c, hatch=h, edgecolor="#e6550d" if h else c, label=label) for _, label, c, h in SEGMENTS]
    )
    fig.suptitle(f"Per-worker timeline, {group_title(group)}, about {TIMELINE_STEPS} steps of the first repeat")
    return _save(fig, plot_dir, "timeline")


def scaling(plot_dir: Path, rows: list[dict], events: dict, settings: dict) -> Path | None:
    """samples/s and time to target against the number of workers (with no stragglers if run)."""
    ok, groups, modes, colour = _context(rows, settings)
    setting = NO_STRAGGLERS if any(s == NO_STRAGGLERS for _, s in groups) else (groups[0][1] if groups else None)
    counts = sorted({w for w, s in groups if s == setting})
    if len(counts) < 2:
        return None
    fig = Figure(figsize=(11.0, 4.8), layout="constrained")
    left, right = fig.subplots(1, 2)
    ideal, drawn = None, []
    for m in modes:
        for ax, key in ((left, "samples_per_s"), (right, "time_to_target_s")):
            points = [(n, s) for n in counts if (s := spread(rows_of(ok, (n, setting), m), key)).median is not None]
            if not points:
                continue
            ax.errorbar(
                [n for n, _ in points],
                [s.median for _, s in points],
                color=colour[m],
                marker="o",
                capsize=3,
                yerr=[[s.median - s.low for _, s in points], [s.high - s.median for _, s in points]],
            )
            if m not in drawn:
                drawn.append(m)
            if key == "samples_per_s" and ideal is None and points[0][0] == counts[0]:
                ideal = (counts[0], points[0][1].median)
    if not drawn:
        return None
    handles = _mode_handles(drawn, colour)
    if ideal:
        left.plot(counts, [ideal[1] * n / ideal[0] for n in counts], ls="--", color="0.5", lw=1)
        handles.append(Line2D([], [], ls="--", color="0.5", lw=1, label="perfect scaling"))
    if not right.lines:
        right.text(0.5, 0.5, "no run reached the target", ha="center", va="center", transform=right.transAxes)
    for ax in (left, right):
        ax.set_xticks(counts)
        ax.set_xlabel("workers")
        ax.grid(alpha=0.3)
    left.set(title="Throughput", ylabel="samples/s (all workers)")
    right.set(title="Time to target accuracy", ylabel="seconds")
    _legend(fig, handles)
    where = "no stragglers" if setting == NO_STRAGGLERS else f"stragglers {setting}"
    fig.suptitle(f"Scaling with the number of workers ({where}): medians, bars from min to max")
    return _save(fig, plot_dir, "scaling")


def intervals(plot_dir: Path, rows: list[dict], events: dict, settings: dict) -> Path | None:
    """Time to target and final test accuracy per mode and group: medians, with the distribution-free 95%
    interval of the median where there is one (MIN_REPEATS or more repeats, each its own seed) and min..max
    (dashed) elsewhere. An upper bound of "never" (grouping.Spread) is drawn to the slowest run that reached
    the target, capped by an upward triangle.

    Points, not bars: a bar starts at 0, and 0.88 against 0.90 would look the same.
    """
    ok, groups, modes, colour = _context(rows, settings)
    cells = {
        (g, m, k): spread(rows_of(ok, g, m), k)
        for g in groups
        for m in modes
        for k in ("time_to_target_s", "final_test_accuracy")
    }
    if not any(s.n > 1 for s in cells.values()):
        return None
    fig, axes = _grid(2, 2, 6.0, 4.0)
    width = 0.8 / max(1, len(modes))
    for ax, key, label in zip(
        axes, ("time_to_target_s", "final_test_accuracy"), ("seconds to the target", "final test accuracy")
    ):
        for i, m in enumerate(modes):
            for j, g in enumerate(groups):
                s = cells[g, m, key]
                if s.median is None:
                    continue
                lo, hi = s.ci if s.ci else (s.low, s.high)
                x = j + (i - (len(modes) - 1) / 2) * width
                if math.isinf(hi):  # no axis reaches "never": stop at the slowest run that got there
                    hi = s.high
                    ax.plot(x, hi, marker="^", ms=7, color=colour[m])
                bars = ax.errorbar(
                    x,
                    s.median,
                    yerr=[[s.median - lo], [max(hi - s.median, 0.0)]],
                    color=colour[m],
                    marker="o",
                    ms=6,
                    capsize=4,
                    lw=1.5,
                )
                if s.ci is None:
                    bars[-1][0].set_linestyle("--")
        ax.set_xticks(range(len(groups)), [group_title(g) for g in groups], rotation=10, fontsize=8)
        ax.set(ylabel=label)
        ax.margins(y=0.15)
        ax.grid(alpha=0.3, axis="y")
    handles = [Patch(color=colour[m], label=m) for m in modes]
    if any(s.ci is None and s.n > 1 for s in cells.values()):
        handles.append(Line2D([], [], color="0.3", ls="--", label=f"min..max (fewer than {MIN_REPEATS} seeds)"))
    if any(s.ci and s.median is not None and math.isinf(s.ci[1]) for s in cells.values()):
        handles.append(Line2D([], [], color="0.3", marker="^", ls="", label="upper bound: never"))
    _legend(fig, handles)
    fig.suptitle(
        f"Medians over repeats: distribution-free 95% intervals from {MIN_REPEATS} or more seeds, else min..max"
    )
    return _save(fig, plot_dir, "intervals")


def accuracy_vs_progress(plot_dir: Path, rows: list[dict], events: dict, settings: dict) -> Path | None:
    """Test accuracy against steps and, where the workers said their shard's size, against epochs.

    One row per group; a mode's curves in its colour, further repeats faint. Time alone mixes how fast a
    mode computes with how much it learns per step; steps and epochs separate the two.
    """
    ok, groups, modes, colour = _context(rows, settings)
    curves = {
        (g, m): [
            [
                e
                for e in events.get(r["run"]) or []
                if e.get("event") == "eval" and _number(e.get("test_accuracy")) and isinstance(e.get("step"), int)
            ]
            for r in rows_of(ok, g, m)
        ]
        for g in groups
        for m in modes
    }
    drawn = [m for m in modes if any(c for g in groups for c in curves[g, m])]
    if not drawn:
        return None
    by_epoch = any(_number(e.get("epoch")) for cs in curves.values() for c in cs for e in c)
    axes_per_group = 2 if by_epoch else 1
    fig, axes = _grid(len(groups) * axes_per_group, axes_per_group, 6.0, 4.0)
    target = settings.get("target_accuracy")
    for k, g in enumerate(groups):
        for a, (x_key, x_label) in enumerate(
            (("step", "step (of the evaluating worker)"), ("epoch", "epoch (passes over the worker's shard)"))[
                :axes_per_group
            ]
        ):
            ax = axes[k * axes_per_group + a]
            for m in drawn:
                for i, curve in enumerate(c for c in curves[g, m] if c):
                    points = [(e[x_key], e["test_accuracy"]) for e in curve if _number(e.get(x_key))]
                    if points:
                        x, y = zip(*sorted(points))
                        ax.plot(
                            x,
                            y,
                            color=colour[m],
                            lw=2 if i == 0 else 1,
                            alpha=1 if i == 0 else 0.4,
                            marker="o" if len(x) < 3 else None,
                        )
            if target is not None:
                ax.axhline(target, color="0.3", ls="--", lw=1)
            ax.set(title=group_title(g), xlabel=x_label, ylabel="test accuracy")
            ax.grid(alpha=0.3)
    _legend(fig, _mode_handles(drawn, colour))
    repeats = any(sum(1 for c in curves[g, m] if c) > 1 for g in groups for m in drawn)
    fig.suptitle(
        "Test accuracy against steps"
        + (" and epochs" if by_epoch else "")
        + (" (bold: the first repeat; faint: the others)" if repeats else "")
    )
    return _save(fig, plot_dir, "accuracy_vs_progress")


def sensitivity(plot_dir: Path, tune_rows: list[dict], settings: dict) -> Path | None:
    """Tuning: each grid point's median time to target and final accuracy over its runs, a line per mode
    (first group); x marks a point where a run diverged."""
    from psgrid.cluster.experiments.tuning import grid_point

    ok = finished(tune_rows)
    if not ok:
        return None
    group = (ok[0]["workers"], ok[0]["stragglers"])
    in_group = [r for r in ok if (r["workers"], r["stragglers"]) == group]
    modes = modes_of(in_group, settings)
    colour = dict(zip(modes, COLOURS * (1 + len(modes) // len(COLOURS))))
    grid = settings.get("tune") or {}
    points = list(dict.fromkeys(grid_point(r, grid) for r in in_group))
    fig, axes = _grid(2, 2, 6.0, 4.0)
    for ax, key, label in zip(
        axes,
        ("time_to_target_s", "final_test_accuracy"),
        ("median seconds to the tuning target", "median final test accuracy"),
    ):
        for m in modes:
            runs = {p: [r for r in in_group if r["mode"] == m and grid_point(r, grid) == p] for p in points}
            medians = {p: spread(rs, key).median for p, rs in runs.items() if rs}
            xs = [i for i, p in enumerate(points) if medians.get(p) is not None]
            ax.plot(xs, [medians[points[i]] for i in xs], color=colour[m], marker="o", lw=1.5)
            bad = [i for i in xs if any(r.get("diverged") for r in runs[points[i]])]
            ax.plot(bad, [medians[points[i]] for i in bad], ls="none", marker="x", ms=10, color="k")
        ax.set_xticks(range(len(points)), points, rotation=30, ha="right", fontsize=8)
        ax.set(ylabel=label)
        ax.grid(alpha=0.3)
    handles = _mode_handles(modes, colour) + [Line2D([], [], ls="none", marker="x", color="k", label="diverged")]
    _legend(fig, handles)
    fig.suptitle(f"Tuning, {group_title(group)}: how each setting did")
    return _save(fig, plot_dir, "sensitivity")


PLOTS = (
    (accuracy_vs_time, "Test accuracy against seconds since the run's start, per mode; the dashed line is the target."),
    (
        accuracy_vs_progress,
        "Test accuracy against the evaluating worker's steps and, where known, epochs (passes over "
        "its shard), per mode; the dashed line is the target.",
    ),
    (
        intervals,
        "Time to target and final test accuracy per mode: medians over repeats; solid error bars the "
        "distribution-free 95% interval of the median (order statistics, from "
        f"{MIN_REPEATS} or more repeats each with its own seed; a triangle: its upper bound is 'never', a run "
        "that did not reach the target), dashed ones the range min..max where there are fewer. A difference "
        "is settled only where the intervals do not overlap.",
    ),
    (loss_vs_steps, "Training loss per step, averaged over workers and repeats."),
    (samples_per_s, "Samples per second of all workers together: median over repeats, error bars min to max."),
    (
        staleness,
        "How many updates behind the weights each push was computed on, per mode (the first group with "
        "stragglers, else the one with the most workers).",
    ),
    (
        timeline,
        "What each worker did over about twenty steps of one run per mode: pulling (including waiting for "
        "the others), computing, the injected straggler delay and pushing.",
    ),
    (scaling, "Throughput and time to target against the number of workers; the dashed line is perfect scaling."),
)
SENSITIVITY = (
    "Tuning: median time to the tuning target and median final test accuracy of each mode at each grid "
    "point, over its tuning runs (x: a run there diverged)."
)


def write_plots(
    plot_dir: Path, rows: list[dict], events: dict, settings: dict, tuning=None
) -> dict[str, tuple[Path, str]]:
    """Every plot that has something to show: its name -> (PNG path, caption), in the report's order.

    ``tuning`` (a :class:`psgrid.cluster.experiments.report.Tuning`) adds the sensitivity plot first.
    """
    written = {}
    plots = [
        (lambda d, r, e, s: sensitivity(d, tuning.rows, s) if tuning else None, SENSITIVITY, "sensitivity"),
        *((plot, caption, plot.__name__) for plot, caption in PLOTS),
    ]
    for plot, caption, name in plots:
        try:
            path = plot(plot_dir, rows, events, settings)
        except Exception as exc:  # noqa: BLE001 - a plot that cannot be drawn must not take the report with it
            print(
                f"psctl compare: the {name} plot is left out of the report: {type(exc).__name__}: {exc}",
                file=sys.stderr,
            )
            path = None
        if path is None:
            # An earlier report of this folder (before a --resume) may have left one behind.
            (plot_dir / f"{name}.png").unlink(missing_ok=True)
        else:
            written[name] = (path, caption)
    return written
