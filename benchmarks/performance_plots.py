"""The plots of docs/performance.md, drawn from the measurements in benchmarks/results/.

    python benchmarks/performance_plots.py          # writes docs/performance/*.png

* gpu-samples-vs-size.png: samples/s of the MLP on one H100 against its size, no servers and 1, 2,
  4 shards in async and sync (psctl bench train, benchmarks/gpu_sweep.sh);
* gpu-step-breakdown.png: where a step's time goes there (pull, compute with the gradient's copy to
  the host, push, wait), against size and shard count;
* cpu-updates.png: psctl bench ps on the 2-core development machine: updates/s against model size
  per data plane, beside the floor of one update, for 2 workers and 1 to 4 shards;
* cost-model.png: the cost model's step time against the measured one (benchmarks/cost_model.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from matplotlib.figure import Figure

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "performance"

COLORS = {
    "async": "tab:blue",
    "sync": "tab:orange",
    "none": "black",
    "shm": "tab:green",
    "tcp": "tab:blue",
    "grpc": "tab:red",
}
STYLES = {1: ":", 2: "--", 4: "-"}


def rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (RESULTS / name).read_text().splitlines() if line.strip()]


def gpu_samples_vs_size(sweep: list[dict]) -> Figure:
    fig = Figure(figsize=(7.5, 4.5))
    ax = fig.subplots()
    alone = sorted((r for r in sweep if r["mode"] == "none"), key=lambda r: r["params"])
    ax.plot(
        [r["params"] / 1e6 for r in alone],
        [r["samples_per_s"] for r in alone],
        "o-",
        color="black",
        label="no servers (SGD on the GPU)",
    )
    for mode in ("async", "sync"):
        for shards in (1, 2, 4):
            points = sorted(
                (r for r in sweep if r["mode"] == mode and r["shards"] == shards), key=lambda r: r["params"]
            )
            ax.plot(
                [r["params"] / 1e6 for r in points],
                [r["samples_per_s"] for r in points],
                "o",
                linestyle=STYLES[shards],
                color=COLORS[mode],
                label=f"{mode}, {shards} shard(s)",
            )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("MLP parameters (millions)")
    ax.set_ylabel("samples/s (batch 512, one worker)")
    ax.set_title("One H100, shards on its host's CPUs, shared memory")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def gpu_step_breakdown(sweep: list[dict]) -> Figure:
    fig = Figure(figsize=(10, 4.5))
    ax = fig.subplots()
    points = sorted((r for r in sweep if r["mode"] != "none"), key=lambda r: (r["params"], r["mode"], r["shards"]))
    labels, x = [], range(len(points))
    bottom = [0.0] * len(points)
    for key, color in (
        ("pull_s", "tab:green"),
        ("wait_s", "tab:gray"),
        ("compute_s", "tab:purple"),
        ("push_s", "tab:red"),
    ):
        values = [1e3 * r[key] for r in points]
        ax.bar(x, values, bottom=bottom, color=color, label=key.removesuffix("_s"))
        bottom = [b + v for b, v in zip(bottom, values)]
    for r in points:
        labels.append(f"{r['params'] / 1e6:.0f}M {r['mode'][0]}{r['shards']}")
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels, rotation=70, fontsize=7)
    ax.set_ylabel("ms per step (medians; async's push overlaps the next step)")
    ax.set_title("Where a step goes: model size, a(sync)/s(ync), shard count; compute includes the gradient's copy")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def cpu_updates(grid: list[dict]) -> Figure:
    fig = Figure(figsize=(10, 4))
    axes = fig.subplots(1, 3, sharey=True)
    measured = [r for r in grid if "skipped" not in r and r["workers"] == 2]
    for ax, shards in zip(axes, (1, 2, 4)):
        for plane in ("shm", "tcp", "grpc"):
            points = sorted(
                (r for r in measured if r["shards"] == shards and r["data_plane"] == plane), key=lambda r: r["params"]
            )
            ax.plot(
                [r["params"] / 1e6 for r in points],
                [r["updates_per_s"] for r in points],
                "o-",
                color=COLORS[plane],
                label=plane,
            )
        floor = sorted({(r["params"], r["floor_updates_per_s"]) for r in measured if r["shards"] == shards})
        ax.plot([p / 1e6 for p, _ in floor], [f for _, f in floor], "k--", label="floor (2 copies + apply)")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_title(f"2 workers, {shards} shard(s)")
        ax.set_xlabel("parameters (millions)")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("updates/s")
    axes[0].legend(fontsize=7)
    fig.suptitle("psctl bench ps on the 2-core development machine (async, a fixed gradient)")
    fig.tight_layout()
    return fig


def cost_model_check() -> Figure:
    import cost_model

    host = cost_model.Host.h100()
    points = cost_model.check(host, cost_model.overheads(host))
    fig = Figure(figsize=(5, 5))
    ax = fig.subplots()
    for mode in ("async", "sync"):
        chosen = [p for p in points if p["mode"] == mode]
        ax.scatter(
            [1e3 * p["measured_s"] for p in chosen],
            [1e3 * p["predicted_s"] for p in chosen],
            color=COLORS[mode],
            label=mode,
        )
    top = max(1e3 * max(p["measured_s"], p["predicted_s"]) for p in points) * 1.1
    ax.plot([0, top], [0, top], "k:", label="predicted = measured")
    ax.set_xlabel("measured step (ms)")
    ax.set_ylabel("predicted step (ms)")
    ax.set_title("Cost model against the GPU sweep")
    ax.legend()
    fig.tight_layout()
    return fig


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    sweep = rows("gpu-sweep-1xH100.jsonl")
    figures = {
        "gpu-samples-vs-size.png": gpu_samples_vs_size(sweep),
        "gpu-step-breakdown.png": gpu_step_breakdown(sweep),
        "cpu-updates.png": cpu_updates(rows("bench-ps-2core.jsonl")),
        "cost-model.png": cost_model_check(),
    }
    for name, fig in figures.items():
        fig.savefig(OUT / name, dpi=110)
        print(OUT / name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
