"""The all-reduce baseline on a GPU against the same model trained with no servers, in one process run.

For each MLP (20.0M: 784-4096-4096-10, 51.6M: 784-6800-6800-10; batch 512, the synthetic task):

* no servers: ``psctl bench train``'s reference, plain SGD where the weights live (median step);
* ``psctl allreduce`` with one rank, plain SGD at the same lr (the weights, the optimizer and the
  update on the GPU, nothing reduced), and with momentum 0.9 (the fused momentum kernel);
* with ``--shared 2``, two ranks on the one GPU: NCCL refuses that, so the host's MPI sums (the
  note on stderr is printed here) and the job must still train.

samples/s of the all-reduce runs are psctl's (first step to last end, every step counted); the
median step gives the same figure on the reference's terms. Rows go to ``--json``, a table to stdout.

    python3 benchmarks/gpu_allreduce.py --json out.jsonl --steps 300
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from psgrid.cluster.bench.train import base_job, no_servers
from psgrid.cluster.job.config import apply_overrides, load_job
from psgrid.cluster.job.records import write_job_file

MODELS = {"20M": [4096, 4096], "51.6M": [6800, 6800]}


def mpiexec() -> str:
    beside = Path(sys.executable).parent / "mpiexec"
    return str(beside) if beside.exists() else (shutil.which("mpiexec") or "mpiexec")


def allreduce(job, ranks: int, tmp: Path, mpi_args: tuple = ()) -> dict:
    """Run ``job`` under ``psctl allreduce`` with ``ranks`` ranks; its samples/s, median step and stderr notes."""
    folder = Path(tempfile.mkdtemp(dir=tmp, prefix=f"{job.train.hidden[0]}-{ranks}-"))
    job_file = write_job_file(folder, job, "by benchmarks/gpu_allreduce.py")
    cmd = [
        mpiexec(),
        "-n",
        str(ranks),
        *mpi_args,
        sys.executable,
        "-m",
        "psgrid.cluster.cli",
        "allreduce",
        "--config",
        str(job_file),
        "--out",
        str(folder / "run"),
        "--no-progress",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    if proc.returncode != 0:
        return {"status": f"exit {proc.returncode}", "stderr": proc.stderr[-2000:]}
    summary = json.loads((folder / "run" / "summary.json").read_text())
    events = [json.loads(line) for line in (folder / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [e for e in events if e.get("event") == "step"]
    steps = steps[len(steps) // 10 :] or steps
    step_s = statistics.median(e["pull_s"] + e["compute_s"] + e["push_s"] for e in steps)
    notes = [line for line in proc.stderr.splitlines() if "NCCL" in line]
    return {
        "status": summary["status"],
        "samples_per_s": summary["samples_per_s"],
        "step_s": step_s,
        "median_samples_per_s": ranks * job.train.batch_size / step_s,
        "push_s": statistics.median(e["push_s"] for e in steps),
        "compute_s": statistics.median(e["compute_s"] for e in steps),
        "test_accuracy": summary.get("test_accuracy"),
        "final_loss": summary.get("final_loss"),
        "notes": notes,
    }


def rows(models, steps: int, batch: int, shared: int, tmp: Path):
    for name in models:
        job = base_job("mlp", "gpu", MODELS[name], batch, steps)
        alone = no_servers(job.train)
        yield {
            "model": name,
            "params": alone["params"],
            "setting": "no servers (local SGD on the GPU)",
            "ranks": 1,
            "samples_per_s": alone["samples_per_s"],
            "median_samples_per_s": alone["samples_per_s"],
            "step_s": alone["step_s"],
            "device": alone["device"],
            "ratio": 1.0,
        }
        # Open MPI binds a rank to one core by default: its loader and progress threads then share that core.
        free = ("--bind-to", "none")
        settings = [
            ("allreduce, 1 rank, SGD", job, 1, ()),
            ("allreduce, 1 rank, SGD, --bind-to none", job, 1, free),
            ("allreduce, 1 rank, momentum 0.9, --bind-to none", apply_overrides(job, {"momentum": 0.9}), 1, free),
        ]
        if shared > 1:
            settings.append((f"allreduce, {shared} ranks sharing the GPU, SGD", job, shared, free))
        for setting, j, ranks, mpi_args in settings:
            r = allreduce(j, ranks, tmp, mpi_args)
            ratio = r.get("samples_per_s", 0.0) / alone["samples_per_s"]
            yield {"model": name, "params": alone["params"], "setting": setting, "ranks": ranks, **r, "ratio": ratio}
        again = no_servers(job.train)  # the reference twice: its spread is the noise of this table
        yield {
            "model": name,
            "params": again["params"],
            "setting": "no servers, again",
            "ranks": 1,
            "samples_per_s": again["samples_per_s"],
            "median_samples_per_s": again["samples_per_s"],
            "step_s": again["step_s"],
            "device": again["device"],
            "ratio": again["samples_per_s"] / alone["samples_per_s"],
        }
    # The run the 3,310 samples/s of the host-side update came from: examples/synthetic-50m.toml, one rank, at the
    # job's optimizer then (SGD lr 0.05; the job now runs Adam with a cosine rate).
    job = apply_overrides(
        load_job("examples/synthetic-50m.toml"),
        {"steps": steps, "eval_every": 0, "device": "gpu", "optimizer": "sgd", "lr": 0.05, "lr_schedule": "constant"},
    )
    r = allreduce(job, 1, tmp, ("--bind-to", "none"))
    yield {"model": "51.6M", "setting": "allreduce, 1 rank, synthetic-50m.toml, unbound", "ranks": 1, **r}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="20M,51.6M")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=512)
    p.add_argument("--shared", type=int, default=2, help="ranks sharing the one GPU in the last run (0: none)")
    p.add_argument("--json", help="append every row to this file")
    p.add_argument("--runs-out", help="keep every run's folder under this one")
    args = p.parse_args()
    print(
        f"{'model':>6} {'setting':<48} {'samples/s':>10} {'x none':>7} {'median/s':>9} {'step ms':>8} "
        f"{'compute ms':>10} {'push ms':>8} {'status':>7}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="gpu-allreduce-") as tmp:
        tmp = args.runs_out or tmp
        Path(tmp).mkdir(parents=True, exist_ok=True)
        for row in rows(args.models.split(","), args.steps, args.batch_size, args.shared, Path(tmp)):
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
            for note in row.get("notes", []):
                print(f"  note: {note}", flush=True)
            if "stderr" in row:
                print(row["stderr"], flush=True)
            f = lambda k, scale=1.0: f"{scale * row[k]:.2f}" if row.get(k) is not None else "-"  # noqa: E731
            print(
                f"{row['model']:>6} {row['setting']:<48} {row.get('samples_per_s') or 0:10.0f} "
                f"{row.get('ratio') or 0:7.3f} {row.get('median_samples_per_s') or 0:9.0f} {f('step_s', 1e3):>8} "
                f"{f('compute_s', 1e3):>10} {f('push_s', 1e3):>8} {row.get('status', 'ok'):>7}",
                flush=True,
            )


if __name__ == "__main__":
    main()
