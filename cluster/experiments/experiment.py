"""What a ``psctl compare`` experiment is: its runs (mode x workers x stragglers x repeat) and their names.

Pure data and parsing, no processes: :mod:`psgrid.cluster.experiments.compare` runs the plan,
:mod:`psgrid.cluster.experiments.results` turns finished runs into rows and :mod:`psgrid.cluster.experiments.report`
writes them up.

With ``--tune`` each mode first runs a grid of settings (the *tune* phase: short runs,
``--tune-repeats`` of each), and its repeats then run at the point that did best
(:mod:`psgrid.cluster.experiments.tuning`); a run's ``settings`` are the job keys it ran with beyond the base job.

Repeat r runs with seed base+r (the job's seed is the base): its data order, initial weights and straggler
draws differ from the other repeats', so the spread over repeats measures run-to-run noise
(:func:`repeat_seeds`; ``--seeds same`` pins them all to the base, ``--seeds 3,7,11`` names them).

A mode label is ``sync``, ``async``, ``ssp:S`` (stale-synchronous with bound S) or
``allreduce`` (no shards: gradients averaged with MPI Allreduce). A straggler setting is a
comma-separated list of :mod:`psgrid.worker.straggler` specs (``3:3,1:exp:20``) or ``none``.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass

from psgrid.cluster.errors import UsageError
from psgrid.cluster.job.mode_defaults import defaults_for
from psgrid.psserver.protocol import mode_rules
from psgrid.worker.straggler import parse_stragglers

ALLREDUCE = "allreduce"
NO_STRAGGLERS = "none"
TUNE, REPEAT = "tune", "repeat"  # a run's phase

Settings = tuple[tuple[str, object], ...]  # job keys and their values, in the order given

# The columns of summary.csv, one row per run, in this order (results.summarize_run makes a row).
ROW_FIELDS = (
    "run",  # the run's id, also its folder under D/runs/
    "mode",  # mode label: sync, async, ssp:2, allreduce
    "workers",  # number of workers
    "stragglers",  # straggler setting, "none" or e.g. "3:3" or "1:exp:20"
    "repeat",  # 0-based repeat index
    "seed",  # the job's seed this run ran with (data order, initial weights, straggler draws)
    "phase",  # tune (a grid point of --tune, short) | repeat (the runs the report compares)
    "settings",  # the job keys this run had beyond the base job, "lr=0.05 momentum=0.9"; empty: none
    "status",  # ok | diverged (stopped on non-finite weights or gradients) | failed | interrupted
    "stability",  # diverged (this run) | unstable (its setting: see stability.py) | stable
    "diverged",  # 1 where the loss grew or turned non-finite, or the accuracy fell to chance; else 0
    "loss_rise",  # where the loss rose for a stretch of the run (stability.py); empty: it did not
    "invalid_metrics",  # what the run logged that no report can use (an accuracy outside [0, 1], ...); empty: none
    "target_accuracy",  # the experiment's target test accuracy
    "time_to_target_s",  # seconds from the run's first worker start to the first evaluation >= target, the final
    # one included (timed at the end of training); empty if never
    "final_test_accuracy",
    "best_test_accuracy",  # the highest test accuracy any evaluation of the run saw, the final one included
    "final_train_accuracy",
    "final_loss",  # mean of the workers' last training losses
    "steps",  # all workers' steps together
    "samples",
    "wall_s",  # training wall time
    "samples_per_s",
    "mean_staleness",  # over every push (max over shards per push)
    "p99_staleness",
    "dropped_pushes",  # pushes a closed sync round dropped: the mean of the shards' dropped_late counts
    "bytes_moved",  # bytes every worker sent and received, all together
    "mean_wait_s",  # per worker: seconds blocked waiting for others (consistency waits; allreduce: in Allreduce)
    "max_wait_s",
    "wait_s_by_worker",  # "w0;w1;..." seconds, rank order
    "pull_s",
    "compute_s",
    "delay_s",
    "push_s",  # mean per step over all workers' steps
)


@dataclass(frozen=True)
class Mode:
    label: str  # as written: sync, async, ssp:2, allreduce
    mode: str  # the shards' mode (sync for allreduce: the same algorithm)
    staleness: int | None = None

    @property
    def uses_shards(self) -> bool:
        return self.label != ALLREDUCE

    @property
    def stale(self) -> bool:
        """Whether its pushes are applied as they come, each from weights others may have moved (async, ssp:S)."""
        return not mode_rules(self.mode).accumulates


def is_stale(label: str) -> bool:
    """:attr:`Mode.stale` of a mode as written (``sync``, ``async``, ``ssp:2``, ``allreduce``)."""
    return parse_modes(label)[0].stale


def parse_modes(text: str) -> list[Mode]:
    """``"sync,async,ssp:2,allreduce"`` -> Modes, in order; duplicates and unknown names refused."""
    modes: list[Mode] = []
    for item in (s.strip() for s in text.split(",")):
        if not item:
            continue
        if item in ("sync", "async"):
            mode = Mode(item, item)
        elif item == ALLREDUCE:
            mode = Mode(item, "sync")
        elif m := re.fullmatch(r"ssp:(\d+)", item):
            mode = Mode(item, "ssp", int(m.group(1)))
        elif item == "ssp":
            raise UsageError("--modes: write ssp:S with the staleness bound S, e.g. ssp:2")
        else:
            raise UsageError(f"--modes: unknown mode {item!r}; use sync, async, ssp:S or allreduce")
        if any(
            m.label == mode.label or (m.mode == mode.mode == "ssp" and m.staleness == mode.staleness) for m in modes
        ):
            raise UsageError(f"--modes: {item} is listed twice")  # ssp:02 is ssp:2
        modes.append(mode)
    if not modes:
        raise UsageError("--modes: name at least one mode, e.g. --modes sync,async,ssp:2,allreduce")
    return modes


def parse_counts(text: str, flag: str) -> list[int]:
    """``"1,2,4"`` -> ``[1, 2, 4]`` (positive, distinct)."""
    try:
        counts = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"{flag} expects positive integers separated by commas, e.g. 1,2,4; got {text!r}") from None
    if not counts or any(c < 1 for c in counts) or len(set(counts)) != len(counts):
        raise UsageError(f"{flag} expects distinct positive integers separated by commas, e.g. 1,2,4; got {text!r}")
    return counts


def parse_straggler_setting(text: str) -> str:
    """A ``--stragglers`` value, checked and written canonically ("none" or the specs joined by commas)."""
    text = text.strip()
    if text in ("", NO_STRAGGLERS):
        return NO_STRAGGLERS
    try:
        return ",".join(str(s) for s in parse_stragglers(text.split(",")))
    except ValueError as e:
        raise UsageError(f"--stragglers: {e}") from None


@dataclass(frozen=True)
class Run:
    """One training run of the experiment."""

    mode: Mode
    workers: int
    stragglers: str  # a canonical straggler setting
    repeat: int
    settings: Settings = ()
    phase: str = REPEAT
    seed: int | None = None  # the job's seed for this run; None: the job's own

    @property
    def id(self) -> str:
        """Its folder name: readable and unique within the experiment, e.g. ``ssp2-w4-s3x3-r0``.

        A tune run is named after its grid point (``tune-async-w4-lr0.05-momentum0.9``, its second
        repeat ``...-r1``); a repeat is not, so a resumed experiment finds its repeats whatever point
        they ran at.
        """
        strag = "" if self.stragglers == NO_STRAGGLERS else "-s" + re.sub(r"[^0-9a-z.]+", "x", self.stragglers)
        base = f"{self.mode.label.replace(':', '')}-w{self.workers}{strag}"
        if self.phase == TUNE:
            point = "-".join(re.sub(r"[^0-9A-Za-z.]+", "", f"{k.rpartition('.')[2]}{v}") for k, v in self.settings)
            return f"tune-{base}" + (f"-{point}" if point else "") + (f"-r{self.repeat}" if self.repeat else "")
        return f"{base}-r{self.repeat}"

    def describe(self) -> dict:
        return {
            "run": self.id,
            "mode": self.mode.label,
            "workers": self.workers,
            "stragglers": self.stragglers,
            "repeat": self.repeat,
            "seed": self.seed,
            "phase": self.phase,
            "settings": settings_text(self.settings),
        }


def settings_text(settings: Settings) -> str:
    """``(("lr", 0.05), ("momentum", 0.9))`` -> ``"lr=0.05 momentum=0.9"`` (as --set takes them)."""
    return " ".join(f"{k}={_value_text(v)}" for k, v in settings)


def _value_text(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ",".join(_value_text(v) for v in value) + "]"
    return f"{value:g}" if isinstance(value, float) else str(value)


def mode_defaults(modes: list[Mode], job, given=(), spec=None) -> dict[str, Settings]:
    """What each mode runs with unless told otherwise (--mode-set MODE:KEY=VALUE, or --set KEY=VALUE for all).

    The rule is psctl launch's and psctl mpi's too (cluster/job/mode_defaults.py, which says why): the job
    file ``spec``'s table of the mode ([async]), then async and ssp with ``async_momentum=auto`` where the
    shards' optimizer has momentum (SGD's, Adam's beta1); nothing the command line ``given`` sets.
    """
    found = {m.label: defaults_for(m.mode, job.server, given, spec).settings for m in modes}
    return {label: settings for label, settings in found.items() if settings}


SAME_SEED = "same"


def repeat_seeds(base: int, repeats: int, given: str | None = None, why: str = "one per repeat") -> list[int]:
    """The seed of each repeat: base+r, or all ``base`` (``given`` "same"), or the ``given`` list "3,7,11".

    Only seeds that differ make the repeats measure run-to-run noise: with one seed the repeats differ
    only by timing, and the report draws no interval from them. ``why`` says where ``repeats`` comes
    from in the refusal of a list of another length.
    """
    if given is None or given.strip() == "":
        return [base + r for r in range(repeats)]
    if given.strip() == SAME_SEED:
        return [base] * repeats
    try:
        seeds = [int(s) for s in given.split(",") if s.strip()]
    except ValueError:
        seeds = []
    if len(seeds) != repeats or len(set(seeds)) != len(seeds) or any(s < 0 for s in seeds):
        raise UsageError(
            f"--seeds expects {repeats} distinct non-negative integers separated by commas ({why}), "
            f"or 'same' to run every repeat with the job's seed; got {given!r}"
        )
    return seeds


def plan(
    modes: list[Mode],
    workers: list[int],
    stragglers: list[str],
    repeats: int,
    settings: dict | None = None,
    seeds: list[int] | None = None,
) -> list[Run]:
    """Every run, repeats outermost: a stopped experiment has every mode at the same number of repeats.

    ``settings`` maps ``(mode label, workers, stragglers)`` to the settings that group's repeats
    run with (the points tuning chose); absent: none. ``seeds[r]`` is repeat r's seed (None: the job's).
    """
    for setting in stragglers:
        if setting == NO_STRAGGLERS:
            continue
        for w in workers:
            ranks = [s.rank for s in parse_stragglers(setting.split(","))]
            if max(ranks) >= w:
                raise UsageError(
                    f"--stragglers {setting}: worker {max(ranks)} does not exist with --workers {w} "
                    f"(ranks are 0..{w - 1})"
                )
    settings = settings or {}
    return [
        Run(m, w, s, r, settings.get((m.label, w, s), ()), seed=seeds[r] if seeds else None)
        for r in range(repeats)
        for s in stragglers
        for w in workers
        for m in modes
    ]


def tune_plan(
    modes: list[Mode],
    workers: list[int],
    stragglers: list[str],
    points: list[Settings],
    repeats: int = 1,
    seeds: list[int] | None = None,
) -> list[Run]:
    """``repeats`` short runs per mode, group and grid point (repeat r at ``seeds[r]``), repeats outermost."""
    return [
        Run(m, w, s, r, p, TUNE, seed=seeds[r] if seeds else None)
        for r in range(repeats)
        for p in points
        for s in stragglers
        for w in workers
        for m in modes
    ]


def mode_dict(mode: Mode) -> dict:
    return asdict(mode)
