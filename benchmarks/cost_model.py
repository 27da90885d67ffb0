"""A cost model of one training step: pull, compute, push and the shards' update, against P, S, W and bandwidths.

One worker per GPU; shards are CPU processes. A step moves the model's 4P bytes each way and the
shards update it:

* pull  = rtt + 4P / pull bandwidth (on one host: a DMA from the shard's pages at PCIe speed;
          across hosts: the network, then the DMA from the pinned buffer it landed in);
* d2h   = 4P / PCIe (the gradient off the GPU, part of compute in the records);
* update = 12P bytes (read gradient and weights, write the next version) / the host's update
           bandwidth for the threads all S shards run at once (S x apply_threads), times the
           checked update's cost over the plain one (async checks as it applies); sync checks the
           gradient in a pass of its own first (4P more bytes); async: W workers' updates queue on every
           shard; sync: one update per round, after the sum of the round's W gradients;
* push  = rtt + [4P / network] + update.
* sync:  step = pull + compute + d2h + push (the next pull waits for the round's update).
  async (overlap): step = max(pull + compute + d2h, push): the push of step c runs beside step c+1;
  with the pull-ahead (``pull_ahead``, worker/prefetch.py) the pull of step c+1 also runs beside
  step c's compute: step = max(compute + d2h, pull, push). The sweep it is checked on was measured
  without it.
* plus a fixed cost per step (Python: the calls to S shards, the records), which only the
  measurements give: it is fitted on the smallest model of the sweep, per mode, and the model is
  checked on the other sizes.

Every constant is a measurement, named with the file it comes from (benchmarks/results/). Run:

    python benchmarks/cost_model.py            # predicted against measured (the GPU sweep), then
                                               # predictions for 25, 100 and 400 Gb/s networks
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
RTT_S = 100e-6  # a control round trip in Python on one host (bench ps at 100K floats: 0.1-0.2 ms)


def _rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (RESULTS / name).read_text().splitlines() if line.strip()]


@dataclass
class Host:
    """One machine's measured bandwidths (GB/s)."""

    pcie_h2d: float
    pcie_d2h: float
    update_gbps: dict[int, float] = field(default_factory=dict)  # host update bandwidth by threads at once
    check_factor: dict[int, float] = field(default_factory=dict)  # checked update / plain update, by threads
    apply_threads: int = 4

    def update_s(
        self, params: int, shards: int, threads_per_shard: int | None = None, *, separate_check: bool = False
    ) -> float:
        threads = shards * (threads_per_shard or self.apply_threads)
        known = sorted(self.update_gbps)
        nearest = min(known, key=lambda t: abs(t - threads))
        plain = 12 * params / (self.update_gbps[nearest] * 1e9)
        # sync checks in a pass of its own (a third more bytes); async as it applies
        return plain * 16 / 12 if separate_check else plain * self.check_factor[nearest]

    @classmethod
    def h100(cls) -> Host:
        """The lent H100 machine: gpu-workers-1xH100.log (pinned copy), host-bandwidth-1xH100.jsonl."""
        copy = next(r for r in _rows("gpu-workers-1xH100.jsonl") if "h2d_gbps" in r)
        bandwidth = _rows("host-bandwidth-1xH100.jsonl")
        return cls(
            pcie_h2d=copy["h2d_gbps"],
            pcie_d2h=copy["d2h_gbps"],
            update_gbps={r["threads"]: r["update_gbps"] for r in bandwidth},
            check_factor={r["threads"]: r["checked_update_s"] / r["update_s"] for r in bandwidth},
        )


def step_s(
    params: int,
    shards: int,
    workers: int,
    mode: str,
    compute_s: float,
    host: Host,
    *,
    network_gbps: float | None = None,
    tcp_efficiency: float = 1.0,
    overhead_s: float = 0.0,
    pull_ahead: bool = False,
) -> dict:
    """Predicted seconds of each part of a step, and of the step, for one worker of ``workers``.

    ``network_gbps``: None on one host (shared memory); else the link between workers and shards
    in Gb/s, each worker and each shard on a host of its own, at ``tcp_efficiency`` of the link.
    ``pull_ahead``: in async, the next step's pull runs beside this step's compute.
    """
    nbytes = 4 * params
    h2d, d2h = nbytes / (host.pcie_h2d * 1e9), nbytes / (host.pcie_d2h * 1e9)
    # One host: every shard shares its memory; across hosts each shard has its own.
    check = mode == "sync"
    update = (
        host.update_s(params, shards, separate_check=check)
        if network_gbps is None
        else host.update_s(params // shards, 1, separate_check=check)
    )
    if mode == "sync":  # one update per round, after summing the round's W gradients (read two, write one)
        part = params if network_gbps is None else params // shards
        update += (workers - 1) * 12 * part / (max(host.update_gbps.values()) * 1e9)
    else:  # every push is an update, and they queue on every shard
        update *= workers
    if network_gbps is None:
        wire = 0.0
    else:
        link = network_gbps / 8 * 1e9 * tcp_efficiency
        # the worker's link carries the model; each shard's carries its part for every worker
        wire = max(nbytes / link, workers * nbytes / shards / link)
    pull = RTT_S + (wire + h2d if network_gbps else h2d)
    push = RTT_S + wire + update
    if mode == "sync":
        step = pull + compute_s + d2h + push + overhead_s
    elif pull_ahead:
        step = max(compute_s + d2h + overhead_s, pull, push) + RTT_S
    else:
        step = max(pull + compute_s + d2h + overhead_s, push) + RTT_S
    return {"pull_s": pull, "d2h_s": d2h, "update_s": update, "push_s": push, "wire_s": wire, "step_s": step}


def overheads(host: Host) -> dict[str, float]:
    """The fixed cost per step, per mode: the median over shard counts of measured minus the model's
    terms, on the smallest model of the sweep (where it dominates)."""
    rows = _rows("gpu-sweep-1xH100.jsonl")
    smallest = min(r["params"] for r in rows)
    alone = next(r for r in rows if r["params"] == smallest and r["mode"] == "none")
    fitted = {}
    for mode in ("sync", "async"):
        gaps = [
            r["batch_size"] / r["samples_per_s"]
            - step_s(smallest, r["shards"], r["workers"], mode, alone["compute_s"], host)["step_s"]
            for r in rows
            if r["params"] == smallest and r["mode"] == mode
        ]
        fitted[mode] = max(0.0, statistics.median(gaps))
    return fitted


def check(host: Host, overhead: dict[str, float]) -> list[dict]:
    """Predicted against measured step time for every point of the GPU sweep (gpu-sweep-1xH100.jsonl)."""
    rows = _rows("gpu-sweep-1xH100.jsonl")
    alone = {r["params"]: r for r in rows if r["mode"] == "none"}
    smallest = min(alone)
    out = []
    for r in rows:
        if r["mode"] == "none":
            continue
        measured = r["batch_size"] / r["samples_per_s"]
        predicted = step_s(
            r["params"],
            r["shards"],
            r["workers"],
            r["mode"],
            alone[r["params"]]["compute_s"],
            host,
            overhead_s=overhead[r["mode"]],
        )
        out.append(
            {
                "params": r["params"],
                "shards": r["shards"],
                "mode": r["mode"],
                "measured_s": measured,
                "predicted_s": predicted["step_s"],
                "ratio": predicted["step_s"] / measured,
                "fitted_on": r["params"] == smallest,
            }
        )
    return out


def networks(host: Host, *, tcp_efficiency: float, overhead: dict[str, float]) -> list[dict]:
    """Predictions for jobs across hosts: 8 workers (one GPU each), 4 shard hosts, 25/100/400 Gb/s."""
    sweep = {r["params"]: r for r in _rows("gpu-sweep-1xH100.jsonl") if r["mode"] == "none"}
    out = []
    for params in (20_037_642, 51_652_810):
        compute = sweep[params]["compute_s"]
        batch = sweep[params]["batch_size"]
        for gbps in (25, 100, 400):
            for mode in ("sync", "async"):
                p = step_s(
                    params,
                    4,
                    8,
                    mode,
                    compute,
                    host,
                    network_gbps=gbps,
                    tcp_efficiency=tcp_efficiency,
                    overhead_s=overhead[mode],
                )
                out.append(
                    {
                        "params": params,
                        "network_gbps": gbps,
                        "mode": mode,
                        **p,
                        "samples_per_s_per_worker": batch / p["step_s"],
                        "ratio_vs_no_servers": compute / p["step_s"],
                    }
                )
    return out


# -- across emulated hosts (benchmarks/emulated_hosts.py checks these against namespaces on a shaped bridge) --

# Payload a TCP stream carries per bit of a tbf rate: tbf counts every segment's headers (issue 23: 100 MiB
# crossed a 1 Gbit/s tbf link at 957 Mbit/s). The default only: a sync phase has every host send to every other
# at once, and then the slowest host gets less than one stream does (0.77-0.89 of a 1 Gbit/s rate with plain TCP
# on 2 and 4 emulated hosts, less with more connections per pair of hosts: TCP's flows do not share a tbf bucket
# evenly, and the phase waits for the slowest).
# So the model takes the share measured on the same network in the same mesh, as it takes memcpy from a
# measurement (benchmarks/emulated_hosts.py measures it), and falls back to one stream's only where none is.
TBF_PAYLOAD_SHARE = 0.957


def link_bytes(
    params: int, shard_hosts: list[int], worker_hosts: list[int], *, aggregate: bool = False, wire_itemsize: int = 4
) -> dict[int, dict[str, int]]:
    """Payload bytes each host's link carries in one step, by phase and direction.

    A worker pulls every shard's range (float32) and pushes its gradient to every shard; a range
    whose shard is on the worker's own host stays there (shared memory). With ``aggregate`` one
    worker per host does both for its host. Returns ``{host: {"pull_in", "pull_out", "push_in",
    "push_out"}}``.
    """
    hosts = sorted(set(shard_hosts) | set(worker_hosts))
    out = {h: {"pull_in": 0, "pull_out": 0, "push_in": 0, "push_out": 0} for h in hosts}
    clients = sorted(set(worker_hosts)) if aggregate else worker_hosts
    shards = len(shard_hosts)
    for wh in clients:
        for i, sh in enumerate(shard_hosts):
            if sh == wh:
                continue
            part = params * (i + 1) // shards - params * i // shards
            out[sh]["pull_out"] += 4 * part
            out[wh]["pull_in"] += 4 * part
            out[wh]["push_out"] += wire_itemsize * part
            out[sh]["push_in"] += wire_itemsize * part
    return out


def busiest_link_bytes(
    params: int, shard_hosts: list[int], worker_hosts: list[int], *, aggregate: bool = False
) -> tuple[int, int]:
    """The payload bytes of the busiest link in the pull phase and in the push phase (either direction)."""
    per_host = link_bytes(params, shard_hosts, worker_hosts, aggregate=aggregate)
    return (
        max(max(b["pull_in"], b["pull_out"]) for b in per_host.values()),
        max(max(b["push_in"], b["push_out"]) for b in per_host.values()),
    )


def links_step_s(
    params: int,
    shard_hosts: list[int],
    worker_hosts: list[int],
    rate_bits: float,
    base_step_s: float,
    *,
    base_transfer_s: float = 0.0,
    aggregate: bool = False,
    share: float | None = None,
) -> dict:
    """A sync step across hosts whose links run at ``rate_bits`` each way.

    The step is the same placement's step on unshaped links with its transfer part replaced by the larger of
    that part and the links' wire time::

        step = base_step_s - base_transfer_s + max(base_transfer_s, wire)

    ``base_transfer_s`` is the time the unshaped run spent moving the busiest link's bytes: the CPU's
    cost of the copies and of TCP, which a shaped link does not add to but overlaps, since the copies run
    while the bytes trickle in (a wait for the round or for other workers' compute is not part of it: in
    sync it does not overlap the wire, the link being idle while the workers compute). ``wire`` is the busiest link's pull bytes plus its push bytes
    at ``share`` of the rate (the phases do not overlap in sync: the next pull waits for the round the push
    closes). ``share`` is the payload share of the rate the slowest host gets with every host sending at
    once, measured on the same network; None: one TCP stream's (``TBF_PAYLOAD_SHARE``), an upper bound.

    Returns
    -------
    dict
        ``pull_wire_s``, ``push_wire_s``, ``wire_s``, ``share`` (the one used), ``step_s`` and
        ``link_bytes`` (the payload bytes of every link, both directions, per step).
    """
    share = TBF_PAYLOAD_SHARE if share is None else share
    rate = rate_bits / 8 * share
    pull, push = (n / rate for n in busiest_link_bytes(params, shard_hosts, worker_hosts, aggregate=aggregate))
    total = sum(sum(b.values()) for b in link_bytes(params, shard_hosts, worker_hosts, aggregate=aggregate).values())
    wire = pull + push
    step = base_step_s - base_transfer_s + max(base_transfer_s, wire)
    return {
        "pull_wire_s": pull,
        "push_wire_s": push,
        "wire_s": wire,
        "share": share,
        "step_s": step,
        "link_bytes": total,
    }


# ----- device shards: the shard on the worker's GPU, over CUDA IPC ------------------------------------


@dataclass
class DeviceLink:
    """A device shard and a worker on one GPU: the GPU's copy bandwidth and the fixed costs of a call (s).

    ``push_fixed_s`` and ``pull_fixed_s`` are a tiny model's push and pull over CUDA IPC (frames, threads,
    stream waits; a push also moves the GPU to the shard's context); ``switch_s`` is what a pull right
    after a push costs beyond a pull alone: the GPU comes back to the worker's context first.
    """

    copy_gbps: float  # device-to-device copy, bytes moved (read + write) per second / 1e9
    push_fixed_s: float
    pull_fixed_s: float
    switch_s: float

    @classmethod
    def h100(cls) -> DeviceLink:
        """The lent H100: ipc-latency-1xH100.jsonl (benchmarks/ipc_latency.py, sync)."""
        rows = [r for r in _rows("ipc-latency-1xH100.jsonl") if r.get("mode") == "sync" and "push_ms" in r]
        tiny, big = min(rows, key=lambda r: r["elements"]), max(rows, key=lambda r: r["elements"])
        return cls(
            copy_gbps=8 * big["elements"] / (big["d2d_copy_ms"] * 1e-3) / 1e9,
            push_fixed_s=tiny["push_ms"] * 1e-3,
            pull_fixed_s=tiny["pull_ms"] * 1e-3,
            switch_s=max(0.0, big["pull_after_push_ms"] - big["pull_ms"]) * 1e-3,
        )


STATE_BYTES = {"sgd": 0, "momentum": 8, "adam": 16}  # per element, read and written by the update


def device_step_s(
    params: int, mode: str, compute_s: float, link: DeviceLink, *, optimizer: str = "sgd", overlap: bool = True
) -> dict:
    """Predicted seconds of a step of one worker against one device shard on its own GPU.

    * copy   = 8P bytes / the GPU's copy bandwidth (the gradient into its slot; the pull's copy);
    * update = (8P + 12P + state) / the same: the shard copies the slot out and checks it in one
               pass, then reads gradient and weights and writes the next version (HBM, not the host);
    * pull   = the fixed cost + copy + the switch back to the worker's context after a push;
    * push   = the fixed cost + copy + update;
    * sync (and async without overlap): step = pull + compute + push; async with overlap: the push
      runs beside the next pull and compute, but its copy and update take the same GPU:
      step = max(pull + compute + copy + update, push).
    """
    rate = link.copy_gbps * 1e9
    copy = 8 * params / rate
    update = (20 + STATE_BYTES[optimizer]) * params / rate
    pull = link.pull_fixed_s + copy + link.switch_s
    push = link.push_fixed_s + copy + update
    if mode == "sync" or not overlap:
        step = pull + compute_s + push
    else:
        step = max(pull + compute_s + copy + update, push)
    return {"copy_s": copy, "update_s": update, "pull_s": pull, "push_s": push, "step_s": step}


def main() -> int:
    host = Host.h100()
    # The TCP plane's share of raw TCP at 64 MiB on that machine (bench-transport-1xH100.txt, 4th column).
    row = (RESULTS / "bench-transport-1xH100.txt").read_text().splitlines()[1].split()
    tcp = float(row[4])
    overhead = overheads(host)
    print(
        "fixed cost per step, fitted on the smallest model: "
        + ", ".join(f"{mode} {1e3 * s:.2f} ms" for mode, s in overhead.items())
    )
    rows = check(host, overhead)
    print(f"{'params':>9} {'S':>2} {'mode':>6} {'measured ms':>11} {'predicted ms':>12} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['params'] / 1e6:8.1f}M {r['shards']:>2} {r['mode']:>6} {1e3 * r['measured_s']:11.2f} "
            f"{1e3 * r['predicted_s']:12.2f} {r['ratio']:6.2f}{'  (fitted here)' if r['fitted_on'] else ''}"
        )
    ratios = [r["ratio"] for r in rows if not r["fitted_on"]]
    print(
        f"predicted / measured on the other sizes: median {statistics.median(ratios):.2f}, "
        f"range {min(ratios):.2f}..{max(ratios):.2f}"
    )
    print(f"\nacross hosts: 8 workers (one H100 each), 4 shard hosts, the TCP plane at {tcp:.2f} of the link")
    print(
        f"{'params':>9} {'Gb/s':>5} {'mode':>6} {'wire ms':>8} {'update ms':>9} {'step ms':>8} {'samples/s/worker':>16} "
        f"{'x alone':>7}"
    )
    for r in networks(host, tcp_efficiency=tcp, overhead=overhead):
        print(
            f"{r['params'] / 1e6:8.1f}M {r['network_gbps']:5d} {r['mode']:>6} {1e3 * r['wire_s']:8.2f} "
            f"{1e3 * r['update_s']:9.2f} {1e3 * r['step_s']:8.2f} {r['samples_per_s_per_worker']:16.0f} "
            f"{r['ratio_vs_no_servers']:7.3f}"
        )
    if (RESULTS / "ipc-latency-1xH100.jsonl").exists() and (RESULTS / "device-workers-1xH100.jsonl").exists():
        print_device_check(DeviceLink.h100())
    return 0


def print_device_check(link: DeviceLink) -> None:
    """Device shards, predicted against device-workers-1xH100.jsonl (benchmarks/gpu_device_shards.sh part 2)."""
    rows = _rows("device-workers-1xH100.jsonl")
    alone = next(r for r in rows if r["setting"].startswith("no servers"))
    print(
        f"\ndevice shards on the H100: copy {link.copy_gbps:.0f} GB/s, push {1e3 * link.push_fixed_s:.2f} ms and "
        f"pull {1e3 * link.pull_fixed_s:.2f} ms fixed, switch back {1e3 * link.switch_s:.2f} ms"
    )
    print(f"{'setting':<34} {'measured ms':>11} {'predicted ms':>12} {'ratio':>6} {'x no servers':>12}")
    params = next(r["params"] for r in rows if r.get("params"))
    for r in rows:
        if not r.get("steady_step_s") or not r["setting"].startswith("1 shard(s)"):
            continue
        mode = r["setting"].split(", ")[1]
        predicted = device_step_s(params, mode, alone["step_s"], link, overlap="no overlap" not in r["setting"])[
            "step_s"
        ]
        print(
            f"{r['setting']:<34} {1e3 * r['steady_step_s']:11.2f} {1e3 * predicted:12.2f} "
            f"{predicted / r['steady_step_s']:6.2f} {alone['step_s'] / predicted:12.3f}"
        )


if __name__ == "__main__":
    sys.exit(main())
