"""``psctl bench script -- CMD``: a user's own script through psgrid against the same script alone.

Each repeat runs the command alone (``PSGRID_ALONE=1``: :func:`psgrid.init` returns a session with
no servers that updates the parameters in place by plain SGD, ``torch.optim.SGD`` for a PyTorch
module; worker/alone.py) and through ``psctl launch`` in each mode and worker count asked for, in
turn: alone, a configuration, alone, the next, ..., alone. Each configuration's ratio is to the mean
of the two alone runs beside it (over repeats, the median of its samples/s over the median of those
means, the reference the table prints beside it): on a shared machine the script alone moved by a fifth between runs
minutes apart (docs/performance.md, "Your own script"), and a reference taken once per repeat moved
every ratio of that repeat with it. Both write the same step records; samples/s is taken over the
steps after the first ``skip`` of each worker (connections, caches, cuDNN's choice of kernels),
summed over a job's workers.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from itertools import product
from pathlib import Path

from psgrid.cluster.bench.steady import beside, steady_samples_per_s
from psgrid.cluster.errors import JobFailed, UsageError
from psgrid.cluster.job.config import JobConfig, apply_overrides, load_job


def base_job(device: str, shards: int, shard_device: str, settings: dict) -> JobConfig:
    """The job each run of the script belongs to: plain SGD at lr 0.01 unless ``settings`` (``--set``) say else."""
    return apply_overrides(
        load_job("mnist"),
        {
            "name": "bench-script",
            "device": device,
            "shards": shards,
            "optimizer": "sgd",
            "lr": 0.01,
            "momentum": 0.0,
            "shard_device": shard_device,
            **settings,
        },
    )


def alone(command: list[str], job: JobConfig, skip: int, timeout_s: float) -> dict | None:
    """The script with no servers: its samples/s and its step's parts (None: it recorded no samples)."""
    from psgrid.cluster.job.records import write_job_file
    from psgrid.cluster.run.procs import child_env
    from psgrid.cluster.run.script import gpu_for
    from psgrid.worker.alone import ALONE
    from psgrid.worker.env import JobEnv

    with tempfile.TemporaryDirectory(prefix="psgrid-bench-alone-") as tmp:
        metrics = Path(tmp) / "worker-0.jsonl"
        job_file = write_job_file(tmp, job, "by psctl bench script, alone")
        described = JobEnv(
            rank=0,
            world=1,
            local_rank=0,
            gpu=gpu_for(0, job.train.device),
            metrics=str(metrics),
            job_file=str(job_file),
            out=tmp,
            seed=job.train.seed,
        )
        env = child_env({**described.to_env(), ALONE: "1", "LOCAL_RANK": "0"})
        done = subprocess.run(
            command, env=env, timeout=timeout_s, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        if done.returncode != 0:
            tail = done.stderr.strip().splitlines()[-1:] or ["(no output)"]
            raise JobFailed(f"the script alone exited {done.returncode}: {tail[0]}")
        rate = steady_samples_per_s([metrics], skip) if metrics.exists() else None
        if rate is None:
            return None
        steps = [r for r in map(json.loads, metrics.read_text().splitlines()) if r.get("event") == "step"][skip:]
        return {"samples_per_s": rate, **{k: statistics.median(r[k] for r in steps) for k in ("compute_s", "push_s")}}


def through_psgrid(command: list[str], job: JobConfig, skip: int) -> dict:
    """One ``psctl launch -- CMD`` of ``job``: samples/s, the planes its workers used, its step parts."""
    from psgrid.cluster.run.launch import Launcher, prepare_out

    with tempfile.TemporaryDirectory(prefix="psgrid-bench-script-") as tmp:
        job = apply_overrides(job, {"out": str(Path(tmp) / "run")})
        summary = Launcher(job, prepare_out(job), progress=False, quiet=True, command=command, relay=False).run()
        files = sorted((Path(job.out) / "metrics").glob("worker-*.jsonl"))
        records = [r for f in files for r in map(json.loads, f.read_text().splitlines())]
        rate = steady_samples_per_s(files, skip) if files else None
    steps = [r for r in records if r.get("event") == "step"][skip:]
    starts = [r for r in records if r.get("event") == "start"]
    planes = sorted({p for r in starts for p in r.get("data_planes") or []})
    parts = {
        k: statistics.median(r[k] for r in steps) if steps else None
        for k in ("pull_s", "compute_s", "push_s", "delay_s")
    }
    return {
        "samples_per_s": rate,
        "status": summary["status"],
        "planes_used": planes,
        "pulled_ahead": bool(starts) and all(r.get("pull_ahead") for r in starts),
        "shard_device": summary.get("shard_device"),
        **parts,
    }


def run(
    command: list[str],
    *,
    modes,
    workers,
    shards: int,
    device: str,
    shard_device: str,
    repeats: int,
    skip: int,
    settings: dict,
    as_json: bool,
    placements=("process",),
    timeout_s: float = 600.0,
    out=sys.stdout,
) -> list[dict]:
    """Every configuration's row (its ratio in each repeat and their median), printed as it comes."""
    from psgrid.cluster.run.script import resolve_command

    command = resolve_command(command)  # `python` is this interpreter; a missing script is one line, here
    # Checked in the mode of the runs (a setting of async alone, pull_ahead, is refused with mode sync).
    base = base_job(device, shards, shard_device, {"mode": modes[0], **settings})
    if base.server.optimizer != "sgd":
        raise UsageError(
            f"psctl bench script compares with the script alone under plain SGD: leave optimizer at "
            f'"sgd", not {base.server.optimizer!r}'
        )
    configs = [(m, w, p) for m, w, p in product(modes, workers, placements) if p == "process" or w >= shards]
    for mode, w, placement in configs:  # every configuration's job checked before anything runs
        apply_overrides(base, {"mode": mode, "workers": w, "shard_placement": placement})
    if not as_json:
        print(
            f"{' '.join(command)}: alone and through psgrid in turn ({shards} shard(s), device {device}), each "
            f"ratio to the alone runs either side; samples/s after the first {skip} steps of each worker",
            file=out,
            flush=True,
        )
    runs, references = _measure(
        command, base, configs, repeats=repeats, skip=skip, timeout_s=timeout_s, as_json=as_json, out=out
    )
    rows = []
    for (mode, w, placement), found in runs.items():
        rows.append(_row(mode, w, shards, placement, found, references))
        if as_json:
            print(json.dumps(rows[-1]), file=out, flush=True)
    if not as_json:
        _table(rows, out)
    return rows


def _measure(
    command: list[str],
    base: JobConfig,
    configs: list[tuple],
    *,
    repeats: int,
    skip: int,
    timeout_s: float,
    as_json: bool,
    out,
) -> tuple[dict, list[dict]]:
    """Each configuration's runs in every repeat, each with its ratio to the alone runs beside it, and every alone run."""
    shards = base.shards
    runs: dict[tuple, list[dict]] = {c: [] for c in configs}
    references: list[dict] = []

    def reference() -> dict:
        found = alone(command, base, skip, timeout_s)
        if found is None:
            raise JobFailed(
                f"the script recorded no samples alone: pass samples= to ps.push() and run more than "
                f"{skip + 1} steps (--skip {skip})"
            )
        references.append(found)
        return found

    for r in range(repeats):
        before = reference()
        for mode, w, placement in configs:
            job = apply_overrides(
                base, {"mode": mode, "workers": w, "seed": base.train.seed + r, "shard_placement": placement}
            )
            found = through_psgrid(command, job, skip)
            after = reference()
            found["alone_samples_per_s"] = beside(before["samples_per_s"], after["samples_per_s"])
            found["ratio"] = (found["samples_per_s"] or 0.0) / found["alone_samples_per_s"]
            runs[(mode, w, placement)].append(found)
            if as_json:
                print(
                    json.dumps(
                        {
                            "suite": "script",
                            "repeat": r,
                            "mode": mode,
                            "workers": w,
                            "shards": shards,
                            "shard_placement": placement,
                            "alone": before,
                            "alone_after": after,
                            **found,
                        }
                    ),
                    file=out,
                    flush=True,
                )
            before = after
    return runs, references


def _row(mode: str, w: int, shards: int, placement: str, found: list[dict], references: list[dict]) -> dict:
    """One configuration's summary: its samples/s and its reference's, medians over its repeats, and their ratio.

    The reference is the one its ratios use, the mean of the two alone runs beside each repeat, so that
    the row's alone samples/s times its ratio is its samples/s through psgrid, as the table prints them;
    ``ratios`` are each repeat's own, and ``alone_median_samples_per_s`` the median of every alone run.
    """
    samples = statistics.median(f["samples_per_s"] or 0.0 for f in found)
    reference = statistics.median(f["alone_samples_per_s"] for f in found)
    return {
        "suite": "script",
        "mode": mode,
        "workers": w,
        "shards": shards,
        "shard_placement": placement,
        "ratio": samples / reference,
        "ratios": [f["ratio"] for f in found],
        "samples_per_s": samples,
        "alone_samples_per_s": reference,
        "alone_median_samples_per_s": statistics.median(r["samples_per_s"] for r in references),
        "alone_compute_s": statistics.median(r["compute_s"] for r in references),
        "alone_update_s": statistics.median(r["push_s"] for r in references),
        "planes_used": found[0]["planes_used"],
        "pull_ahead": found[0].get("pulled_ahead", False),
        "shard_device": found[0]["shard_device"],
        **{k: _median(f[k] for f in found) for k in ("pull_s", "compute_s", "push_s", "delay_s")},
    }


def _median(values):
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _table(rows: list[dict], out) -> None:
    if rows:
        print(
            f"alone: {rows[0]['alone_median_samples_per_s']:.0f} samples/s, {1e3 * rows[0]['alone_compute_s']:.2f} ms "
            f"compute (pull to update), {1e3 * rows[0]['alone_update_s']:.2f} ms update (medians of every alone run); "
            f"each row's alone is the mean of the two alone runs beside it (median over repeats), and x alone "
            f"is its samples/s over that",
            file=out,
        )
    print(
        f"{'mode':>6} {'W':>2} {'shards on':>9} {'in':>7} {'plane':>9} {'samples/s':>10} {'alone':>10} {'x alone':>7} "
        f"{'pull ms':>8} {'compute ms':>10} {'push ms':>8}  each repeat's x alone",
        file=out,
    )
    for row in rows:
        ms = {k: "-" if row[k] is None else f"{1e3 * row[k]:.2f}" for k in ("pull_s", "compute_s", "push_s")}
        print(
            f"{row['mode']:>6} {row['workers']:>2} {row['shard_device'] or '-':>9} {row['shard_placement']:>7} "
            f"{'+'.join(row['planes_used']) or '-':>9} {row['samples_per_s']:10.0f} {row['alone_samples_per_s']:10.0f} "
            f"{row['ratio']:7.2f} {ms['pull_s']:>8} {ms['compute_s']:>10} {ms['push_s']:>8}  "
            f"{' '.join(f'{r:.2f}' for r in row['ratios'])}",
            file=out,
            flush=True,
        )
