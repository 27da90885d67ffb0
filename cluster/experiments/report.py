"""The write-up of a ``psctl compare`` experiment: ``report.md`` and ``report.html`` from its rows.

The content is built once as a list of blocks (:class:`Heading`, :class:`Paragraph`,
:class:`Table`, :class:`Image`, :class:`Code`) and rendered twice: markdown that points at
``plots/NAME.png``, and one self-contained HTML page with the PNGs embedded, which opens
offline. The plots come from :mod:`psgrid.cluster.experiments.plots` (imported only by
:func:`write_report`, so matplotlib is loaded only when a report is written); the prose comes
from :mod:`psgrid.cluster.experiments.reading`, which only restates the numbers.
"""

from __future__ import annotations

import base64
import html
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from psgrid.cluster.experiments import provenance, stability
from psgrid.cluster.experiments.grouping import (
    MIN_REPEATS,
    Spread,
    acc,
    coverage_text,
    finished,
    group_title,
    groups_of,
    modes_of,
    rows_of,
    secs,
    sig,
    spread,
)
from psgrid.cluster.experiments.reading import reading
from psgrid.cluster.experiments.target import rule_text
from psgrid.cluster.experiments.tuning import grid_point
from psgrid.psserver import files

# matplotlib is an extra (psgrid[plots]): without it the report is written without its plots.
PLOTS_SKIPPED = "plots skipped: pip install 'psgrid[plots]'"


@dataclass
class Tuning:
    """What ``--tune`` ran and chose (:mod:`psgrid.cluster.experiments.tuning`)."""

    rows: list[dict]  # the tune runs' summary rows
    chosen: dict[tuple, list[str]]  # (mode, workers, stragglers) -> the run ids of its best point
    target: float | None  # the tuning target, the report's too unless one was given


# ---- the blocks and their two renderings ---------------------------------------------------


@dataclass
class Heading:
    text: str
    level: int = 2


@dataclass
class Paragraph:
    text: str


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]


@dataclass
class Image:
    path: Path  # the PNG on disk, embedded in the HTML
    rel: str  # its path relative to the report, for the markdown
    caption: str


@dataclass
class Code:
    text: str


def to_markdown(blocks: list) -> str:
    out = []
    for b in blocks:
        if isinstance(b, Heading):
            out.append("#" * b.level + " " + _md(b.text))
        elif isinstance(b, Paragraph):
            out.append(_md(b.text))
        elif isinstance(b, Table):
            cells = [[_md(c).replace("|", "\\|") for c in row] for row in [b.header, *b.rows]]
            lines = ["| " + " | ".join(row) + " |" for row in cells]
            out.append("\n".join([lines[0], "|" + "---|" * len(b.header), *lines[1:]]))
        elif isinstance(b, Image):
            out.append(f"![{_md(b.caption)}]({b.rel})\n\n*{_md(b.caption)}*")
        elif isinstance(b, Code):
            fence = "`" * max(3, 1 + max((len(m) for m in re.findall(r"`+", b.text)), default=0))
            out.append(f"{fence}\n{b.text}\n{fence}")
    return "\n\n".join(out) + "\n"


def _md(text: str) -> str:
    # Markdown passes HTML through: a '<' in a label or path must not become a tag.
    return text.replace("&", "&amp;").replace("<", "&lt;")


CSS = """body{font-family:system-ui,sans-serif;max-width:72rem;margin:2rem auto;padding:0 1rem;color:#222;
line-height:1.45}table{border-collapse:collapse;margin:1rem 0;font-size:.9rem}
th,td{border:1px solid #ccc;padding:.25rem .5rem;text-align:right}th{background:#f0f0f0}
td:first-child,th:first-child{text-align:left}pre{background:#f6f6f6;padding:.75rem;overflow-x:auto}
figure{margin:1.5rem 0}img{max-width:100%}figcaption{color:#555;font-style:italic}"""


def to_html(blocks: list, title: str) -> str:
    e = html.escape
    body = []
    for b in blocks:
        if isinstance(b, Heading):
            body.append(f"<h{b.level}>{e(b.text)}</h{b.level}>")
        elif isinstance(b, Paragraph):
            body.append(f"<p>{e(b.text)}</p>")
        elif isinstance(b, Table):
            head = "".join(f"<th>{e(c)}</th>" for c in b.header)
            rows = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in row) + "</tr>\n" for row in b.rows)
            body.append(f"<table>\n<thead><tr>{head}</tr></thead>\n<tbody>\n{rows}</tbody>\n</table>")
        elif isinstance(b, Image):
            data = base64.b64encode(b.path.read_bytes()).decode("ascii")
            body.append(
                f'<figure><img alt="{e(b.caption)}" src="data:image/png;base64,{data}">'
                f"<figcaption>{e(b.caption)}</figcaption></figure>"
            )
        elif isinstance(b, Code):
            body.append(f"<pre><code>{e(b.text)}</code></pre>")
    return (
        f'<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>{e(title)}</title>\n'
        f"<style>{CSS}</style>\n</head>\n<body>\n" + "\n".join(body) + "\n</body>\n</html>\n"
    )


# ---- the content ------------------------------------------------------------------------------------

# The per-mode tables' numbers: row key, column title, format.
METRICS: tuple[tuple[str, str, Callable[[float], str]], ...] = (
    ("time_to_target_s", "time to target (s)", secs),
    ("final_test_accuracy", "final test accuracy", acc),
    ("samples_per_s", "samples/s", sig),
    ("mean_staleness", "mean staleness", sig),
    ("p99_staleness", "p99 staleness", sig),
    ("dropped_pushes", "dropped pushes", sig),
    ("mean_wait_s", "mean wait per worker (s)", secs),
)


def _cell(s: Spread, fmt: Callable[[float], str]) -> str:
    """``median [low, high]`` (a 95% interval) where there is one, else ``median [min..max]``."""
    if s.median is None:
        return "-"
    if s.ci is not None:
        return f"{fmt(s.median)} [{_bound(s.ci[0], fmt)}, {_bound(s.ci[1], fmt)}]"
    if s.low != s.high:
        return f"{fmt(s.median)} [{fmt(s.low)}..{fmt(s.high)}]"
    return fmt(s.median)


def _bound(x: float, fmt: Callable[[float], str]) -> str:
    """An interval's bound; infinite on a run that never reached the target (grouping.Spread)."""
    return fmt(x) if x < float("inf") else "never"


INTERVAL_METRICS = ("time_to_target_s", "final_test_accuracy")  # the summary shows their intervals or ranges


def _metric_cells(runs: list[dict], with_range: bool) -> list[str]:
    cells = []
    for key, _, fmt in METRICS:
        s = spread(runs, key)
        if with_range:  # the per-mode tables: the range of the repeats, always
            s = Spread(s.median, s.low, s.high, s.n)
        elif key not in INTERVAL_METRICS:
            s = Spread(s.median, s.median, s.median, s.n)
        cell = _cell(s, fmt)
        if key == "time_to_target_s" and runs and s.n < len(runs):
            # k of n: a run that never got there is counted, and the median exists only where most got there.
            reached = f"{s.n} of {len(runs)} reached"
            cell = "never" if s.n == 0 else f"{cell} ({reached})" if s.median is not None else f"{reached}, no median"
        cells.append(cell)
    return cells + [str(len(runs))]


def _stability_cell(runs: list[dict], verdicts: dict) -> str:
    found = [verdicts[k] for k in dict.fromkeys(map(stability.setting_of, runs)) if k in verdicts]
    return " / ".join(v.text() for v in found) or "-"


def summary_table(ok: list[dict], settings: dict) -> Table:
    """One row per (group, mode): its stability first, then medians with 95% intervals or min..max."""
    with_settings = any(r.get("settings") for r in ok)
    verdicts = stability.verdicts(ok)
    rows = [
        [
            str(g[0]),
            g[1],
            m,
            _stability_cell(runs, verdicts),
            *([_settings_of(runs)] if with_settings else []),
            *_metric_cells(runs, with_range=False),
        ]
        for g in groups_of(ok, settings)
        for m in modes_of(ok, settings)
        if (runs := rows_of(ok, g, m))
    ]
    return Table(
        [
            "workers",
            "stragglers",
            "mode",
            "stability",
            *(["settings"] if with_settings else []),
            *(t for _, t, _ in METRICS),
            "n",
        ],
        rows,
    )


def _settings_of(runs: list[dict]) -> str:
    return " / ".join(dict.fromkeys(r.get("settings") or "job's" for r in runs))


def mode_table(ok: list[dict], settings: dict, mode: str) -> Table:
    """One row per group: median [min..max] over repeats."""
    verdicts = stability.verdicts(ok)
    rows = [
        [str(g[0]), g[1], _stability_cell(runs, verdicts), *_metric_cells(runs, with_range=True)]
        for g in groups_of(ok, settings)
        if (runs := rows_of(ok, g, mode))
    ]
    return Table(["workers", "stragglers", "stability", *(t for _, t, _ in METRICS), "n"], rows)


def _target_text(settings: dict) -> str:
    target = settings.get("target_accuracy")
    if target is None:
        return (
            "Target test accuracy: none (no run that finished without diverging recorded a final test accuracy), "
            "so no time to target."
        )
    how = rule_text(settings.get("target_source") or "auto")
    if settings.get("target_source") == "given" and "--target-accuracy" in str(settings.get("report_command") or ""):
        how += " of the --report-only command above"
    return (
        f"Target test accuracy: {acc(target)}, {how}. Time to target counts from the run's start; a run that "
        f"never reached it is counted as 'k of n reached', and a median is given only where more than half "
        f"reached it."
    )


def _interval_text(ok: list[dict]) -> str:
    settings = [
        spread(rows_of(ok, g, m), key)
        for g, m in dict.fromkeys(((r["workers"], r["stragglers"]), r["mode"]) for r in ok)
        for key in INTERVAL_METRICS
    ]
    drawn = sorted({s.of for s in settings if s.ci is not None})
    if drawn:
        return (
            f"Where a setting ran {MIN_REPEATS} or more repeats, each with its own seed, time to target and final "
            f"accuracy show the distribution-free 95% interval of the median (order statistics) as [low, high]: "
            f"the k-th lowest and k-th highest of the n repeats, with the largest k that holds the median with "
            f"probability 95% or more whatever the distribution ({_coverages(drawn)}). A run that never reached the "
            f"target counts as slower than every run that did, so an upper bound that falls on one is 'never'. "
            f"Elsewhere [min..max] is the range of the repeats, not an interval. "
        )
    if any(s.of > 1 and not s.varied for s in settings):
        return (
            "[min..max] is the range of the repeats. They ran with the same seed, so they differ only by timing "
            "and no interval is drawn from them: nothing here is settled. "
        )
    return (
        f"[min..max] is the range of the repeats, not an interval: it takes {MIN_REPEATS} repeats, each with its "
        f"own seed, to draw a distribution-free 95% interval of the median, so nothing here is settled. "
    )


def _coverages(counts: list[int]) -> str:
    """``6 repeats: [min, max], 96.9% or more; 9 repeats: [2nd lowest, 2nd highest], 96.1% or more``"""
    return "; ".join(f"{n} repeats: {coverage_text(n)}" for n in counts)


def tuning_blocks(t: Tuning, settings: dict) -> list:
    """Each mode's chosen settings, and how every grid point did (mode x setting)."""
    steps = settings.get("tune_steps")
    n = int(settings.get("tune_repeats") or 1)
    blocks = [
        Heading("Tuning"),
        Paragraph(
            f"Each mode ran every point of the grid ({_grid_text(settings)}) {_times(n)}"
            + (f", {steps} steps per worker" if steps else "")
            + (", repeat r with seed base+r" if n > 1 else "")
            + ", and its repeats ran at its best point: over the point's tuning runs, none diverged, "
            "more than half reached the tuning target, the shortest median time to it, then the best "
            "median final test accuracy. The tuning target is "
            + ("-" if t.target is None else acc(t.target))
            + ", "
            + rule_text("given" if settings.get("target_source") == "given" else "tuning")
            + "."
        ),
    ]
    by_id = {r["run"]: r for r in t.rows}
    chosen_rows = []
    for (mode, workers, strag), runs in t.chosen.items():
        rs = [by_id[r] for r in runs if r in by_id]
        if rs:
            chosen_rows.append([str(workers), strag, mode, rs[0].get("settings") or "job's", _ttt(rs), _final(rs)])
    blocks.append(
        Table(
            ["workers", "stragglers", "mode", "chosen settings", "time to target (s)", "final test accuracy"],
            chosen_rows,
        )
    )
    for g in dict.fromkeys((r["workers"], r["stragglers"]) for r in t.rows):
        modes = list(dict.fromkeys(r["mode"] for r in t.rows if (r["workers"], r["stragglers"]) == g))
        points = list(
            dict.fromkeys(
                grid_point(r, settings.get("tune") or {}) for r in t.rows if (r["workers"], r["stragglers"]) == g
            )
        )
        cells: dict[tuple, list[dict]] = {}
        for r in t.rows:
            if (r["workers"], r["stragglers"]) == g:
                cells.setdefault((r["mode"], grid_point(r, settings.get("tune") or {})), []).append(r)
        table = [[p, *(_point_cell(cells.get((m, p)), t.chosen.get((m, *g))) for m in modes)] for p in points]
        blocks += [
            Heading(f"Sensitivity, {group_title(g)}", 3),
            Paragraph(
                "Each cell, over that point's tuning runs: median time to the tuning target (s) / median "
                "final test accuracy, and what did not hold (reached by k of n, diverged, unstable); "
                "* marks the point chosen for the repeats."
            ),
            Table(["setting", *modes], table),
        ]
    return blocks


def _times(n: int) -> str:
    return "once" if n == 1 else "twice" if n == 2 else f"{n} times"


def _grid_text(settings: dict) -> str:
    tune = settings.get("tune") or {}
    return "; ".join(f"{k} in {', '.join(map(str, v))}" for k, v in tune.items()) or "no grid"


def _ttt(runs: list[dict]) -> str:
    s = spread([r for r in runs if r.get("status") in ("ok", "diverged")], "time_to_target_s")
    if s.median is None:
        return "never" if s.n == 0 else f"{s.n} of {s.of} reached"
    return secs(s.median) + (f" ({s.n} of {s.of} reached)" if s.n < s.of else "")


def _final(runs: list[dict]) -> str:
    s = spread(runs, "final_test_accuracy")
    return "-" if s.median is None else acc(s.median)


def _point_cell(runs: list[dict] | None, chosen: list[str] | None) -> str:
    if not runs:
        return "-"
    counted = finished(runs)
    if not counted:
        return " / ".join(dict.fromkeys(r.get("status") or "-" for r in runs))
    text = f"{_ttt(counted)} / {_final(counted)}"
    label = stability.verdicts(counted)
    verdict = next(iter(label.values()), None)
    if verdict is not None and verdict.label != stability.STABLE:
        text += " " + verdict.label
    return text + (" *" if chosen and runs[0]["run"] in chosen else "")


def provenance_table(settings: dict) -> Table | None:
    """What ran, so that another user can run it again from the report alone (settings.provenance)."""
    found = settings.get("provenance") or {}
    if not found:
        return None
    rows = [[str(k), "none" if v is None else v if isinstance(v, str) else json.dumps(v)] for k, v in found.items()]
    return Table(["provenance", ""], rows)


def command_blocks(settings: dict) -> list:
    """The command that ran the experiment, and the ``--report-only`` one that changed its target or classes."""
    ran = str(settings.get("command") or "(command not recorded)")
    if not settings.get("report_command"):
        return [
            Paragraph("The command that ran this experiment and wrote this report (run it again to reproduce both):"),
            Code(ran),
        ]
    return [
        Paragraph("The command that ran this experiment (run it again to reproduce its runs):"),
        Code(ran),
        Paragraph(
            "The command that wrote this report from those runs, with its own target accuracy or number of classes "
            "(run it after the first to reproduce the report):"
        ),
        Code(str(settings["report_command"])),
    ]


def mode_settings_text(settings: dict) -> str | None:
    """Which settings each mode ran with beyond the job's, and which of them are the mode's own defaults."""
    defaults = {m: dict(p) for m, p in (settings.get("mode_defaults") or {}).items()}
    given = {m: dict(p) for m, p in (settings.get("mode_settings") or {}).items()}
    parts = []
    for m in settings.get("modes") or []:
        own = {**defaults.get(m, {}), **given.get(m, {})}
        if not own:
            parts.append(f"{m} the job's")
            continue
        said = [
            f"{k}={_value(v)}"
            + (" (the mode's default)" if k in defaults.get(m, {}) and k not in given.get(m, {}) else "")
            for k, v in own.items()
        ]
        parts.append(f"{m} " + ", ".join(said))
    if not parts:
        return None
    return "Settings each mode ran with, beyond the job's: " + "; ".join(parts) + "."


def _value(v) -> str:
    return "true" if v is True else "false" if v is False else f"{v:g}" if isinstance(v, float) else str(v)


def build(
    settings: dict, rows: list[dict], plots: dict[str, tuple[Path, str]] | None, tuning: Tuning | None = None
) -> list:
    """The report's blocks; ``plots`` maps a plot's name to its PNG and caption (None: matplotlib is missing)."""
    ok = finished(rows)
    blocks: list = [Heading(settings.get("title") or "psctl compare", 1), *command_blocks(settings), Heading("Setup")]
    if machine := settings.get("machine") or {}:
        blocks.append(Table(["machine", ""], [[str(k), "none" if v is None else str(v)] for k, v in machine.items()]))
    if table := provenance_table(settings):
        blocks.append(table)
    blocks += [
        *([Paragraph(text)] if (text := provenance.attempts_text(settings)) else []),
        Paragraph(
            ("Script: " if settings.get("script") else "Job: ")
            + str(settings.get("job_summary") or "not recorded")
            + "."
        ),
        *([Paragraph(text)] if (text := mode_settings_text(settings)) else []),
        Paragraph(_seeds_text(settings)),
        Paragraph(_target_text(settings)),
        *(tuning_blocks(tuning, settings) if tuning is not None else []),
        Heading("Summary"),
        Paragraph(
            "Medians over the repeats that finished or diverged; n counts them. "
            + _interval_text(ok)
            + f"Stability comes first: {stability.RULE}. Staleness is how many updates behind the "
            "weights a push was computed on (a run's p99 is one it observed, a whole number; the table "
            "gives the median over repeats); wait is the time a worker spent blocked waiting for the "
            "others."
        ),
        summary_table(ok, settings) if ok else Paragraph("No run finished."),
        Heading("Per mode"),
        Paragraph("Median [min..max] over the repeats that finished or diverged."),
    ]
    for mode in modes_of(ok, settings):
        if any(r["mode"] == mode for r in ok):
            blocks += [Heading(mode, 3), mode_table(ok, settings, mode)]
    if plots is None:
        blocks += [Heading("Plots"), Paragraph(f"No plots: matplotlib is not installed ({PLOTS_SKIPPED}).")]
    elif plots:
        blocks.append(Heading("Plots"))
        blocks += [Image(path, f"plots/{path.name}", caption) for path, caption in plots.values()]
    blocks.append(Heading("Reading"))
    blocks += [Paragraph(p) for p in reading(rows, settings, tuning.rows if tuning is not None else None)]
    failed = [r for r in rows if r not in ok]
    if failed:
        blocks += [
            Heading("Runs that did not finish"),
            Paragraph("These are left out of every number above."),
            Table(
                ["run", "mode", "workers", "stragglers", "repeat", "status"],
                [[str(r.get(k)) for k in ("run", "mode", "workers", "stragglers", "repeat", "status")] for r in failed],
            ),
        ]
    return blocks


def _seeds_text(settings: dict) -> str:
    """What seeds the runs that ran had: the repeats', then the tuning runs' (they may be more: --tune-repeats)."""
    seeds = settings.get("seeds")
    if not seeds:
        return "Seeds: every repeat ran with the job's seed (recorded before seeds varied per repeat)."
    repeats = seeds[: int(settings.get("repeats") or 1)]
    tuned = seeds[: int(settings.get("tune_repeats") or 1)] if settings.get("tune") else []
    # Recorded before it was: only --seeds could give every one of several repeats one seed.
    pinned = settings.get("seeds_pinned", len(repeats) > 1 and len(set(repeats)) == 1)
    how = " (pinned with --seeds)" if pinned else ""
    base = " (base+r: the job's seed plus the repeat)" if "seeds_pinned" in settings else ""
    if len(repeats) == 1:
        text = f"Seeds: one run per setting, seed {repeats[0]}{how} ({_seeded(settings)})"
    elif len(set(repeats)) == 1:
        text = (
            f"Seeds: every repeat ran with seed {repeats[0]}{how}, so repeats differ only by timing and no "
            f"interval is drawn from them"
        )
    else:
        text = (
            f"Seeds: repeats {', '.join(map(str, range(len(repeats))))} of every mode ran with seeds "
            f"{', '.join(map(str, repeats))}{how or base} ({_seeded(settings)})"
        )
    if tuned:
        seeds_of_tuning = f"seed {tuned[0]}" if len(set(tuned)) == 1 else f"seeds {', '.join(map(str, tuned))}"
        text += f"; tuning ran each grid point {_times(len(tuned))}, with {seeds_of_tuning}"
    return text + "; each run's seed is in summary.csv."


def _seeded(settings: dict) -> str:
    """What a run's seed decides."""
    what = (
        "the job's [train] seed, in PSGRID_SEED: the straggler draws follow it, and your script's own data "
        "order and initial weights where it reads that seed, as the examples do"
        if settings.get("script")
        else "data order, initial weights and straggler draws"
    )
    train = (settings.get("job") or {}).get("train") or {}
    if not settings.get("script") and train.get("dataset") == "synthetic":
        what += (
            f"; one synthetic task in every run, synthetic_seed {train['synthetic_seed']}"
            if "synthetic_seed" in train
            else "; each seed also chose its synthetic task (recorded before synthetic_seed)"
        )
    return what


def write_report(
    out: Path, settings: dict, rows: list[dict], events: dict[str, list[dict]], tuning: Tuning | None = None
) -> dict[str, Path]:
    """Write ``out/report.md``, ``out/report.html`` and ``out/plots/*.png``.

    Parameters
    ----------
    out : the experiment's folder.
    settings : the experiment's settings (``command``, ``modes``, ``workers``, ``stragglers``,
        ``target_accuracy``, ``target_source``, ``machine``, ``job_summary``, optional ``title``).
    rows : one summary row per run (keys: :data:`psgrid.cluster.experiments.experiment.ROW_FIELDS`).
    events : each run's step and eval events, by run id.
    tuning : what ``--tune`` ran and chose, for the report's Tuning section and sensitivity plot.

    Returns
    -------
    The paths written: ``"md"``, ``"html"`` and one per plot, by the plot's name.
    """
    out = Path(out)
    files.make_dirs(out)
    plotting = _plotting()
    plots = None if plotting is None else plotting.write_plots(out / "plots", rows, events, settings, tuning)
    blocks = build(settings, rows, plots, tuning)
    paths = {"md": out / "report.md", "html": out / "report.html"}
    _write(paths["md"], to_markdown(blocks))
    _write(paths["html"], to_html(blocks, settings.get("title") or "psctl compare"))
    return {**paths, **{name: path for name, (path, _) in (plots or {}).items()}}


def _plotting():
    """:mod:`psgrid.cluster.experiments.plots`, or None (and one line on stderr) where matplotlib is not installed."""
    try:
        from psgrid.cluster.experiments import plots  # matplotlib is loaded only to write a report
    except ImportError as exc:
        if (exc.name or "").split(".")[0] != "matplotlib":
            raise
        print(f"psctl compare: {PLOTS_SKIPPED}", file=sys.stderr)
        return None
    return plots


def _write(path: Path, text: str) -> None:
    files.replace_text(path, text)
