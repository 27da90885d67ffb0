"""The reading at the end of a ``psctl compare`` report: what the numbers say, in words.

Every sentence restates medians of the rows (:mod:`psgrid.cluster.experiments.grouping`): which mode
reached the target first and by how much, what stragglers changed, what staleness and waits
say about why, and whether the result is what theory predicts.

What would make a reader distrust the rest comes first: settings that trained unstably (their final
accuracies spread across repeats, or a loss that rose for a stretch) and runs that diverged, each with
the spread and the fix to try (:mod:`psgrid.cluster.experiments.stability`), then why the conclusions
are not settled (too few repeats with their own seeds for an interval, more processes than cores). A
difference is called settled only where the distribution-free 95% intervals of the two medians (order
statistics, :func:`psgrid.cluster.experiments.grouping.median_interval`) do not overlap.
"""

from __future__ import annotations

import statistics

from psgrid.cluster.experiments import stability
from psgrid.cluster.experiments.experiment import NO_STRAGGLERS, is_stale
from psgrid.cluster.experiments.grouping import (
    MIN_REPEATS,
    Group,
    Spread,
    acc,
    finished,
    group_phrase,
    group_title,
    groups_of,
    join,
    modes_of,
    ratio,
    rows_of,
    secs,
    separated,
    sig,
    spread,
    straggler_ranks,
    waits_per_rank,
)

# ---- the reading: the numbers in words ----------------------------------------------------------

# Cui et al., "Exploiting Bounded Staleness to Speed Up Big Data Analytics", USENIX ATC'14.
THEORY = "theory predicts (Cui et al., ATC'14: stale-synchronous parallel beats bulk-synchronous under stragglers)"
SAME_ACCURACY = 0.005  # final accuracies closer than this are called equal: too close to tell from noise


def reading(rows: list[dict], settings: dict, tune_rows: list[dict] | None = None) -> list[str]:
    """The report's "Reading": paragraphs that restate the numbers and what they say.

    Per group, which mode reached the target first and by how much; what stragglers did to each
    mode; staleness and waits as the reason; whether stale modes beat sync under stragglers, as
    theory predicts; final accuracy; scaling efficiency when there are several worker counts.
    Runs that did not finish are left out and counted. ``tune_rows`` (the ``--tune`` grid's runs)
    add which grid points diverged.
    """
    ok = finished(rows)
    failed = len(rows) - len(ok)
    tail = (
        [
            f"{failed} run{'s' if failed != 1 else ''} did not finish: see 'Runs that did not finish'. "
            f"{'They are' if failed != 1 else 'It is'} left out of every number here."
        ]
        if failed
        else []
    )
    if not ok:
        return ["No run finished, so there is nothing to compare."] + tail
    groups, modes = groups_of(ok, settings), modes_of(ok, settings)
    target = settings.get("target_accuracy")
    paras = [
        p
        for p in (
            _unstable(ok),
            _near_line(ok),
            _diverged(ok),
            _invalid(ok),
            _unsettled(ok, settings),
            _tuned(ok, settings, tune_rows or []),
        )
        if p
    ]
    paras += [_race(ok, g, modes, target) for g in groups]
    paras += _straggler_effects(ok, groups, modes)
    # Staleness and waits explain the race best where stragglers make the modes differ.
    for g in [g for g in groups if g[1] != NO_STRAGGLERS] or groups[-1:]:
        paras += [p for p in [_why(ok, g, modes)] if p]
    paras += [p for g in groups if g[1] != NO_STRAGGLERS for p in [_theory(ok, g, modes)] if p]
    paras += [p for g in groups for p in [_accuracy(ok, g, modes)] if p]
    paras += [p for p in [_scaling(ok, groups, modes)] if p]
    return paras + tail


def _compensation_flag() -> str:
    """How to turn staleness compensation on with the shards this tree has."""
    import dataclasses

    from psgrid.psserver.config import ServerConfig

    names = {f.name for f in dataclasses.fields(ServerConfig)}
    if "staleness_compensation" in names:
        return "--set staleness_compensation=dc (or =lr)"
    return "--set lr_staleness=true"


def _invalid(ok: list[dict]) -> str | None:
    """Said first: what a script logged that no loss or accuracy can be (validity.py), left out of the rest."""
    bad = [r for r in ok if r.get("invalid_metrics")]
    if not bad:
        return None
    said = "; ".join(f"{r['run']} logged {r['invalid_metrics']}" for r in bad)
    return (
        f"Invalid metrics: {said}. Those values are left out of every number and plot here (the runs' other "
        f"numbers count). The script's Session.log_eval(test_accuracy=...) takes an accuracy in [0, 1] and "
        f"Session.push(loss=...) the step's loss."
    )


def _unstable(ok: list[dict]) -> str | None:
    """Said first: a setting whose repeats disagree, or whose loss rose for a stretch, with its spread."""
    parts = []
    for key, verdict in stability.verdicts(ok).items():
        if verdict.label != stability.UNSTABLE:
            continue
        mode, workers, strag, settings = key
        said = []
        if verdict.spread is not None and verdict.spread > stability.UNSTABLE_SPREAD:
            finals = sorted(verdict.finals)
            near = " (near the line: other seeds may put it under)" if verdict.near_line and not verdict.risen else ""
            said.append(
                f"final test accuracy spread {verdict.spread:.3f} across {len(finals)} repeats "
                f"({', '.join(acc(a) for a in finals)}){near}"
            )
        if verdict.risen:
            said.append(f"the loss rose for a stretch in {verdict.risen} of {verdict.runs} runs")
        parts.append(
            f"{mode} ({group_title((workers, strag))}{', ' + settings if settings else ''}): " + " and ".join(said)
        )
    if not parts:
        return None
    stale = [
        key[0]
        for key, v in stability.verdicts(ok).items()
        if v.label == stability.UNSTABLE and is_stale(key[0]) and "async_momentum=auto" not in key[3]
    ]
    tries = (
        [f"--mode-set {stale[0]}:async_momentum=auto (the shards lower the momentum by what asynchrony adds)"]
        if stale
        else []
    ) + [
        "a lower learning rate (--mode-set MODE:lr=...)",
        "each mode at its own best settings (--tune lr=0.01,0.05,0.2)",
    ]
    return (
        f"Unstable: {'; '.join(parts)}. A setting is unstable where its final accuracies lie more than "
        f"{stability.UNSTABLE_SPREAD:g} apart across repeats or a run's loss rose for a stretch: it does not train "
        f"reliably, and its median hides how often it ends badly. To try: {', '.join(tries[:-1])} or "
        f"{tries[-1]}."
    )


def _near_line(ok: list[dict]) -> str | None:
    """Said first too: a stable setting whose spread is close under the line, which other seeds may cross."""
    parts = [
        f"{mode} ({group_title((workers, strag))}{', ' + settings if settings else ''}): spread {verdict.spread:.3f}"
        for (mode, workers, strag, settings), verdict in stability.verdicts(ok).items()
        if verdict.label == stability.STABLE and verdict.near_line
    ]
    if not parts:
        return None
    return (
        f"Near the line: {join(parts)}. Stable by the rule, but within {stability.NEAR_LINE:g} of "
        f"{stability.UNSTABLE_SPREAD:g}: the range of a few repeats is a noisy measure, and other seeds may "
        f"give the other label."
    )


def _diverged(ok: list[dict]) -> str | None:
    """Said first: a diverged run's numbers describe a failed training, not its mode."""
    bad = [r for r in ok if r.get("diverged")]
    if not bad:
        return None
    parts = []
    for key in dict.fromkeys((r["mode"], r["workers"], r["stragglers"]) for r in bad):
        runs = [r for r in ok if (r["mode"], r["workers"], r["stragglers"]) == key]
        n = sum(1 for r in runs if r.get("diverged"))
        settings = runs[0].get("settings")
        parts.append(
            f"{key[0]} in {n} of {len(runs)} run{'s' if len(runs) != 1 else ''} "
            f"({group_title((key[1], key[2]))}{', ' + settings if settings else ''})"
        )
    return (
        f"Diverged: {join(parts)}. A diverged run's loss grew, its loss or weights turned non-finite (the shards "
        f"then refuse the non-finite push and the workers stop), or its test accuracy fell to chance, so its "
        f"numbers describe a training that failed rather than its mode, and it did not set the target. "
        f"To try: a lower learning rate (--set lr=..., or for one mode --mode-set MODE:lr=...), each mode at its "
        f"own best settings (--tune lr=0.01,0.05,0.2), or staleness compensation ({_compensation_flag()})."
    )


def processes(settings: dict) -> tuple[int, str]:
    """The most processes one run of the experiment had on this machine, and what they were."""
    workers = max(settings.get("workers") or [1])
    shards = int(settings.get("shards") or (settings.get("job") or {}).get("job", {}).get("shards") or 1)
    modes = settings.get("modes") or []
    ps = any(m != "allreduce" for m in modes)
    if not ps:
        return workers, f"all-reduce ran {workers} rank{'s' if workers != 1 else ''}"
    what = (
        f"1 coordinator, {shards} shard{'s' if shards != 1 else ''} and {workers} worker{'s' if workers != 1 else ''}"
    )
    if "allreduce" in modes:
        what += f"; all-reduce ran {workers}"
    return 1 + shards + workers, what


def _unsettled(ok: list[dict], settings: dict) -> str | None:
    """Why the conclusions below are not settled, where they are not."""
    spreads = [
        spread(rows_of(ok, g, m), "final_test_accuracy")
        for g in groups_of(ok, settings)
        for m in modes_of(ok, settings)
        if rows_of(ok, g, m)
    ]
    counts = [s.of for s in spreads]
    reasons = []
    if counts and min(counts) < MIN_REPEATS:
        n = min(counts)
        reasons.append(
            f"{'each setting' if max(counts) == n else 'some settings'} ran only {n} time"
            f"{'s' if n != 1 else ''}, and it takes at least {MIN_REPEATS} repeats, each with its own "
            f"seed, to draw a distribution-free 95% interval of the median that separates a difference "
            f"from run-to-run noise (the tables show min..max instead)"
        )
    if any(s.of > 1 and not s.varied for s in spreads):
        reasons.append(
            "the repeats ran with the same seed, so they measure only timing noise, not how the "
            "training varies with its data order and initial weights"
        )
    cpus = (settings.get("machine") or {}).get("cpus")
    count, what = processes(settings)
    if cpus and count > cpus:
        reasons.append(
            f"{count} processes ({what}) shared {cpus} core{'s' if cpus != 1 else ''}, so they slowed "
            f"one another and the times say as much about that sharing as about the modes"
        )
    if not reasons:
        return None
    return "These conclusions are not settled: " + "; and ".join(reasons) + "."


def _tuned(ok: list[dict], settings: dict, tune_rows: list[dict]) -> str | None:
    """Each mode's own settings, where they differ (tuning, or --mode-set), and the grid points that diverged."""
    if not settings.get("tune") and not settings.get("mode_settings") and not settings.get("mode_defaults"):
        return None
    parts = [
        f"{m} " + " / ".join(dict.fromkeys(r.get("settings") or "the job's" for r in runs))
        for m in modes_of(ok, settings)
        if (runs := [r for r in ok if r["mode"] == m])
    ]
    how = "its best point of the tuning grid (see Tuning)" if settings.get("tune") else "its own settings"
    text = f"Each mode ran at {how}: {join(parts)}." if parts else ""
    bad = list(
        dict.fromkeys(
            r["mode"] + " at " + (r.get("settings") or "the job's settings")
            for r in finished(tune_rows)
            if r.get("diverged")
        )
    )
    if bad:
        text += f" While tuning, {join(bad)} diverged."
    return text.strip() or None


def _median(ok: list[dict], group: Group, mode: str, key: str) -> float | None:
    return spread(rows_of(ok, group, mode), key).median


def _as_long(t: float, t0: float) -> str:
    return f", {ratio(t / t0)} as long" if t0 > 0 else ""


def _race(ok: list[dict], group: Group, modes: list[str], target: float | None) -> str:
    head = group_phrase(group)
    if target is None:
        return f"{head}, there is no target accuracy, so no time to target."
    runs = {m: rs for m in modes if (rs := rows_of(ok, group, m))}
    times = {m: spread(rs, "time_to_target_s") for m, rs in runs.items()}
    reached = sorted((s.median, m) for m, s in times.items() if s.median is not None)
    if not reached:
        return f"{head}, no mode reached the target test accuracy {acc(target)} in more than half its runs" + (
            f" ({_reached(times)})." if any(s.n for s in times.values()) else "."
        )
    t0, first = reached[0]
    n = len(runs[first])
    text = (
        f"{head}, {first} reached the target test accuracy {acc(target)} first, in {secs(t0)} s "
        f"(median of {n} run{'s' if n != 1 else ''})"
    )
    if len(reached) > 1:
        t1, second = reached[1]
        text += f", {secs(t1 - t0)} s sooner than the next, {second} ({secs(t1)} s{_as_long(t1, t0)}"
        # Say when the repeats do not separate the two: the lead is then within the run-to-run noise.
        apart = separated(times[first], times[second])
        text += (
            f"; not settled: {_why_no_interval(times[first], times[second])})"
            if apart is None
            else "; settled: their 95% intervals do not overlap)"
            if apart
            else ", though their 95% intervals overlap, so the lead is not settled)"
        )
    later = [f"{m} {secs(t)} s{_as_long(t, t0)}" for t, m in reached[2:]]
    if later:
        text += f"; then {join(later)}"
    text += "."
    partial = {m: s for m, s in times.items() if 0 < s.n < s.of}
    if partial:
        text += (
            f" Not every run reached it: {_reached(partial)}. A run that never reached it counts as slower than "
            f"every run that did; a median is given only where more than half reached it."
        )
    never = [f"{m} ({s.of} run{'s' if s.of != 1 else ''})" for m, s in times.items() if s.n == 0]
    if never:
        text += f" {join(never)} never reached it."
    return text


def _reached(times: dict[str, Spread]) -> str:
    return join([f"{m} {s.n} of {s.of}" for m, s in times.items()])


def _why_no_interval(a: Spread, b: Spread) -> str:
    return next(why for why in (a.no_interval, b.no_interval) if why)


def _straggler_effects(ok: list[dict], groups: list[Group], modes: list[str]) -> list[str]:
    """Each straggler setting against no stragglers with the same number of workers."""
    paras = []
    for workers, setting in groups:
        base = (workers, NO_STRAGGLERS)
        if setting == NO_STRAGGLERS or base not in groups:
            continue
        parts = []
        for m in modes:
            if rows_of(ok, (workers, setting), m) and rows_of(ok, base, m):
                parts.append(
                    f"{m} "
                    + _change(
                        *(
                            _median(ok, g, m, k)
                            for k in ("time_to_target_s", "samples_per_s")
                            for g in ((workers, setting), base)
                        )
                    )
                )
        if parts:
            paras.append(f"Stragglers {setting} with {workers} workers, against none: " + "; ".join(parts) + ".")
    return paras


def _change(t_slow, t_fast, s_slow, s_fast) -> str:
    bits = []
    if t_slow is not None and t_fast is not None:
        bits.append(
            f"took {secs(t_slow)} s to reach the target against {secs(t_fast)} s without"
            + (f" ({ratio(t_slow / t_fast)} as long)" if t_fast > 0 else "")
        )
    elif t_fast is not None:
        bits.append(f"no longer reached the target (it did in {secs(t_fast)} s without stragglers)")
    elif t_slow is not None:
        bits.append(f"reached the target in {secs(t_slow)} s, which it did not without stragglers")
    if s_slow is not None and s_fast:
        bits.append(
            f"its samples/s {'fell' if s_slow < s_fast else 'rose'} to {ratio(s_slow / s_fast)} "
            f"({sig(s_slow)} against {sig(s_fast)})"
        )
    return " and ".join(bits) or "has no numbers to compare"


def _why(ok: list[dict], group: Group, modes: list[str]) -> str | None:
    present = [m for m in modes if rows_of(ok, group, m)]
    med = {
        (m, k): _median(ok, group, m, k)
        for m in present
        for k in ("mean_staleness", "p99_staleness", "mean_wait_s", "dropped_pushes")
    }
    stale = [
        f"{m} {sig(med[m, 'mean_staleness'])} (p99 {sig(med[m, 'p99_staleness'])})"
        for m in present
        if med[m, "mean_staleness"] is not None and med[m, "p99_staleness"] is not None
    ]
    waits = [f"{m} {secs(med[m, 'mean_wait_s'])} s" for m in present if med[m, "mean_wait_s"] is not None]
    dropped = [f"{m} {sig(med[m, 'dropped_pushes'])}" for m in present if (med[m, "dropped_pushes"] or 0) > 0]
    said = []
    if stale:
        said.append("mean staleness (how many updates behind the weights a push was computed on) was " + join(stale))
    if waits:
        said.append("a worker spent on average " + join(waits) + " waiting for the others")
    if dropped:
        said.append(
            "late pushes that a closed sync round dropped (the shards' counts, mean over shards): " + join(dropped)
        )
    said += [f"in {m} {p}" for m in present if (p := _waiting_for_stragglers(rows_of(ok, group, m), group[1]))]
    return f"Why, {group_title(group)}: " + "; ".join(said) + "." if said else None


def _waiting_for_stragglers(runs: list[dict], setting: str) -> str | None:
    """Says so when the fast workers waited much longer than the stragglers: they waited for them."""
    per_run = [w for w in map(waits_per_rank, runs) if w]
    slow = [r for r in straggler_ranks(setting) if per_run and r < min(map(len, per_run))]
    if not slow:
        return None
    by_rank = [statistics.mean(w[r] for w in per_run) for r in range(min(map(len, per_run)))]
    fast = [r for r in range(len(by_rank)) if r not in slow]
    if not fast:
        return None
    w_slow, w_fast = statistics.mean(by_rank[r] for r in slow), statistics.mean(by_rank[r] for r in fast)
    wall = spread(runs, "wall_s").median
    # A difference worth a sentence: twice as long, and a visible part of the run.
    if w_fast < 2 * w_slow or w_fast - w_slow < (0.05 * wall if wall else 0.1):
        return None
    who = f"worker{'s' if len(slow) > 1 else ''} {join([str(r) for r in slow])}"
    return (
        f"the straggling {who} waited {secs(w_slow)} s and the others {secs(w_fast)} s on average: "
        f"the fast workers spent their time waiting for the straggler"
    )


def _theory(ok: list[dict], group: Group, modes: list[str]) -> str | None:
    """Did the stale modes beat sync under stragglers, as theory predicts?"""
    rivals = [m for m in modes if is_stale(m) and rows_of(ok, group, m)]
    if not rivals or not rows_of(ok, group, "sync"):
        return None
    t_sync, s_sync = (_median(ok, group, "sync", k) for k in ("time_to_target_s", "samples_per_s"))
    won, lost, why = [], [], []
    for m in rivals:
        t, s = (_median(ok, group, m, k) for k in ("time_to_target_s", "samples_per_s"))
        if t is not None and (t_sync is None or t < t_sync):
            won.append(m)
        elif t is not None or t_sync is not None:
            lost.append(m)
            if t is None:
                why.append(f"{m} never reached the target, sync did in {secs(t_sync)} s")
            elif s is not None and s_sync is not None:
                why.append(_throughput_versus_sync(m, s, s_sync))
    head = f"Under stragglers ({group_title(group)}), "
    if not won and not lost:
        return head + f"neither sync nor {join(rivals)} reached the target, so this cannot say whether {THEORY}."
    if not lost:
        return head + f"{join(won)} reached the target before sync, as {THEORY}."
    text = head + (f"{join(won)} reached the target before sync, but " if won else "")
    text += f"{join(lost)} did not{'' if won else ' reach the target before sync'}, contrary to what {THEORY}."
    return text + (" Here " + "; ".join(why) + "." if why else "")


def _accuracy(ok: list[dict], group: Group, modes: list[str]) -> str | None:
    finals = {m: a for m in modes if (a := _median(ok, group, m, "final_test_accuracy")) is not None}
    if not finals:
        return None
    text = f"Final test accuracy, {group_title(group)}: " + join([f"{m} {acc(a)}" for m, a in finals.items()])
    if len(finals) > 1:
        best, worst = max(finals, key=finals.get), min(finals, key=finals.get)
        shaky = [
            m
            for m in finals
            if any(v.label != stability.STABLE for v in stability.verdicts(rows_of(ok, group, m)).values())
        ]
        if finals[best] - finals[worst] < SAME_ACCURACY and shaky:
            # Equal medians of a mode that trains unstably say nothing about what its worst runs cost.
            text += (
                f"; the medians are within {SAME_ACCURACY} of each other, but {join(shaky)} trained unstably "
                f"(see above): the median hides its worst runs"
            )
        elif finals[best] - finals[worst] < SAME_ACCURACY:
            text += f"; all within {SAME_ACCURACY} of each other, so staleness cost no visible accuracy here"
        else:
            text += f"; {worst} ended {acc(finals[best] - finals[worst])} below {best}"
            apart = separated(*(spread(rows_of(ok, group, m), "final_test_accuracy") for m in (worst, best)))
            text += {
                None: "",
                True: " (settled: their 95% intervals do not overlap)",
                False: " (not settled: their 95% intervals overlap)",
            }[apart]
            s_worst, s_best = (_median(ok, group, m, "mean_staleness") for m in (worst, best))
            label = next(
                (
                    v.label
                    for v in stability.verdicts(rows_of(ok, group, worst)).values()
                    if v.label != stability.STABLE
                ),
                None,
            )
            if label is not None:
                # Not a cost of staleness: the setting did not train reliably (said first, with its spread).
                text += f", where it {'diverged' if label == stability.DIVERGED else 'trained unstably'} (see above)"
            elif s_worst is not None and s_best is not None and s_worst > s_best:
                text += (
                    f" and trained on staler weights (mean staleness {sig(s_worst)} against {sig(s_best)}), "
                    f"which can cost accuracy"
                )
    return text + "."


def _scaling(ok: list[dict], groups: list[Group], modes: list[str]) -> str | None:
    """samples/s(n) / (n/n0 x samples/s(n0)), n0 the fewest workers (1.00 is perfect), per mode."""
    setting = NO_STRAGGLERS if any(g[1] == NO_STRAGGLERS for g in groups) else groups[0][1]
    counts = sorted({w for w, s in groups if s == setting})
    if len(counts) < 2:
        return None
    n0, parts = counts[0], []
    for m in modes:
        base = _median(ok, (n0, setting), m, "samples_per_s")
        effs = [
            f"{s / (n / n0 * base):.2f} at {n} workers"
            for n in counts[1:]
            if base and (s := _median(ok, (n, setting), m, "samples_per_s")) is not None
        ]
        if effs:
            parts.append(f"{m} {join(effs)}")
    if not parts:
        return None
    basis = "n times the samples/s of 1 worker" if n0 == 1 else f"n/{n0} times the samples/s of {n0} workers"
    where = "no stragglers" if setting == NO_STRAGGLERS else f"stragglers {setting}"
    return (
        f"Scaling efficiency ({where}): the samples/s of n workers divided by {basis} "
        f"(1.00 is perfect): " + "; ".join(parts) + "."
    )


SAME_THROUGHPUT = 0.03  # samples/s within 3% of each other are called the same: run-to-run noise is larger


def _throughput_versus_sync(mode: str, s: float, s_sync: float) -> str:
    against = f"({sig(s)} against {sig(s_sync)})"
    if abs(s - s_sync) <= SAME_THROUGHPUT * s_sync:
        bound = (
            ": its staleness bound still holds the fast workers back when a straggler is slow at every step, and it"
            if mode.startswith("ssp:")
            else ", and"
        )
        return f"{mode} processed about as many samples per second as sync {against}{bound} needed more samples to reach the target"
    if s > s_sync:
        return (
            f"{mode} processed more samples per second than sync {against} but needed more of them to reach the target"
        )
    return f"{mode} did not even process more samples per second {against}"
