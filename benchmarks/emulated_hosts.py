"""The cost model across hosts, checked on emulated hosts: namespaces on a bridge, links shaped by tbf.

Runs sync jobs of a model whose step is bound by the links (a 784-H-10 MLP on the synthetic task,
float32 gradients), shards and workers spread over emulated hosts (cluster/hosts/), and prints
for each the step measured beside the step cost_model.links_step_s predicts: the same placement's
step on unshaped links (measured here) with its transfer part replaced by the larger of that part and
the busiest link's pull and push bytes at ``share`` of the rate. Both come from plain TCP in the same
mesh, every host sending to every other at once in as many connections as the job opens: the transfer
part (``cpu ms``) is the busiest link's bytes at the rate the unshaped mesh reaches (the CPU's bound), and
``share`` what the slowest host gets of the shaped rate (measured at 1 Gbit/s; at 10 Gbit/s, which 2 cores
cannot fill, one TCP stream's 0.957). Beside it, for comparison, the model with the transfer part taken
as the workers' median pull + push in the unshaped run (``xfer ms``, ``by xfer``: it holds the waits for
the round) and the model before it was corrected (``by add``: the unshaped step plus the wire time).
It also prints the bytes the links carried per step (the bridge ports' counters) beside the
bytes the model says must cross, with and without ``aggregate = "host"``.

Root only; everything it makes is removed at the end, also on Ctrl-C. Usage:

    .venv/bin/python benchmarks/emulated_hosts.py              # the table and the sweep
    .venv/bin/python benchmarks/emulated_hosts.py --only table --steps 12 --hidden 2500

(as root, with the python of an environment psgrid is installed in).

On a loaded 2-core machine the workers' compute is shared by every emulated host: keep runs short,
and read the unshaped step (what the link is added to) beside each result.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import cost_model  # beside this script: its folder is on the path when it runs

from psgrid.cluster.hosts.job import EmulatedJob
from psgrid.cluster.hosts.network import EmulatedNetwork, available, rate_bits
from psgrid.cluster.job.config import job_from_dict


def make_job(hidden: int, steps: int, batch: int, shards: int, workers: int, aggregate: str):
    return job_from_dict(
        {
            "job": {"shards": shards, "workers": workers},
            "server": {"mode": "sync", "lr": 0.05, "momentum": 0.9},
            "train": {
                "dataset": "synthetic",
                "synthetic_samples": 4000,
                "model": "mlp",
                "hidden": [hidden],
                "steps": steps,
                "batch_size": batch,
                "eval_every": 0,
                "aggregate": aggregate,
                "join_timeout_s": 300.0,
            },
        }
    )


# Every host sends BYTES to every other at once over plain TCP in FLOWS connections (what a sync phase does),
# and prints the seconds until the last byte was taken (each receiver closes a connection once it has all of it).
_RECEIVER = """
import socket, sys, threading
listener = socket.socket(); listener.bind((sys.argv[1], 5001)); listener.listen(64)
print("ready", flush=True)
def take(conn):
    while conn.recv(1 << 20):
        pass
    conn.close()
threads = []
for _ in range(int(sys.argv[2])):
    conn, _ = listener.accept(); threads.append(threading.Thread(target=take, args=(conn,))); threads[-1].start()
for t in threads:
    t.join(timeout=120)
"""
_SENDER = """
import socket, sys, threading, time
count, flows = int(sys.argv[1]), int(sys.argv[2])
block = memoryview(b"x" * (1 << 20))
def send(address):
    with socket.create_connection((address, 5001), timeout=60) as s:
        left = count // flows
        while left:
            left -= s.send(block[:min(left, len(block))])
        s.shutdown(socket.SHUT_WR)
        s.recv(1)                   # the receiver's close: every byte arrived
threads = [threading.Thread(target=send, args=(a,)) for a in sys.argv[3:] for _ in range(flows)]
t0 = time.perf_counter()
for t in threads:
    t.start()
for t in threads:
    t.join(timeout=120)
print(time.perf_counter() - t0)
"""


def mesh_rate(hosts: int, rate, flows: int = 1, mib: int = 20) -> float:
    """The payload bytes per second the slowest host gets when every host sends ``mib`` MiB to every other at
    once over TCP, in ``flows`` connections per pair of hosts as the job opens them; ``rate`` None: unshaped
    (then the CPU is the bound)."""
    import subprocess

    with EmulatedNetwork(hosts, rate) as net:
        procs = []
        try:
            receivers = [
                subprocess.Popen(
                    h.argv([sys.executable, "-c", _RECEIVER, h.address, str((hosts - 1) * flows)]),
                    stdout=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
                for h in net.hosts
            ]
            procs += receivers
            for r in receivers:
                r.stdout.readline()
            senders = [
                subprocess.Popen(
                    h.argv(
                        [sys.executable, "-c", _SENDER, str(mib * 2**20), str(flows)]
                        + [o.address for o in net.hosts if o is not h]
                    ),
                    stdout=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
                for h in net.hosts
            ]
            procs += senders
            seconds = max(float(p.communicate(timeout=120)[0]) for p in senders)
            for r in receivers:
                r.wait(timeout=60)
        finally:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=10)
                proc.stdout.close()
    return (hosts - 1) * mib * 2**20 / seconds


def steady_step_s(result) -> float:
    """The median time between worker 0's step starts, after its first two steps (joining, first pulls)."""
    starts = [r["started"] for r in result.records[0]]
    gaps = [b - a for a, b in zip(starts[2:], starts[3:])]
    return statistics.median(gaps) if gaps else float("nan")


def transfer_s(result, worker_hosts: list[int], aggregate: str) -> tuple[float, float]:
    """The median pull and push seconds of the workers that talk to the shards (every worker; with
    aggregation each host's leader, its first rank), after their first two steps."""
    talkers = (
        range(len(worker_hosts)) if aggregate == "none" else [worker_hosts.index(h) for h in sorted(set(worker_hosts))]
    )
    steps = [r for rank in talkers for r in result.records[rank][2:]]
    return statistics.median(r["pull_s"] for r in steps), statistics.median(r["push_s"] for r in steps)


def flows_per_pair(worker_hosts: list[int], aggregate: str) -> int:
    """The TCP connections the job opens from one host to another: one per worker of the host (one per host
    with aggregation)."""
    return 1 if aggregate == "host" else max(worker_hosts.count(h) for h in set(worker_hosts))


def run_one(hosts: int, rate, *, shards: int, workers: int, aggregate: str, args, out: Path) -> dict:
    job = make_job(args.hidden, args.steps, args.batch, shards, workers, aggregate)
    with EmulatedNetwork(hosts, rate) as net:
        emulated = EmulatedJob(net, job, out)
        result = emulated.run(timeout_s=args.timeout)
        shard_hosts, worker_hosts = emulated.shard_hosts, emulated.worker_hosts
    params = result.starts[0]["params"]
    step = steady_step_s(result)
    pull, push = transfer_s(result, worker_hosts, aggregate)
    return {
        "hosts": hosts,
        "rate": rate,
        "shards": shards,
        "workers": workers,
        "aggregate": aggregate,
        "params": params,
        "step_s": step,
        "samples_per_s": workers * args.batch / step,
        "pull_s": pull,
        "push_s": push,
        "transfer_s": pull + push,
        "link_bytes_per_step": result.bytes_per_step,
        "shard_hosts": shard_hosts,
        "worker_hosts": worker_hosts,
        "compute_s": statistics.median(r["compute_s"] for recs in result.records for r in recs[2:]),
        "accuracy": result.accuracy,
    }


def with_prediction(row: dict, base: dict, cpu_rate: float, share: float | None = None) -> dict:
    """``row`` with the model's step and bytes beside it, from ``base`` (the same placement's step unshaped),
    ``cpu_rate`` (bytes/s the slowest host moves in the same mesh unshaped: the unshaped transfer is the busiest
    link's bytes at that rate) and ``share`` (the payload share of the shaped rate in the same mesh; None
    where not measured: one stream's). For comparison: ``xfer_step_s``, the model with the unshaped transfer
    taken as the workers' median pull + push there (which holds the waits for the round and, with
    aggregation, for the host's other workers), and ``add_step_s``, the model before it was corrected (the
    unshaped step plus the wire time at one stream's share)."""
    model = dict(
        params=row["params"],
        shard_hosts=row["shard_hosts"],
        worker_hosts=row["worker_hosts"],
        aggregate=row["aggregate"] == "host",
    )
    transfer = sum(cost_model.busiest_link_bytes(**model)) / cpu_rate
    row = dict(row, cpu_rate=cpu_rate, model_transfer_s=transfer)
    if row["rate"] is None:
        return dict(row, predicted_step_s=row["step_s"], predicted_link_bytes=None)
    model.update(rate_bits=rate_bits(row["rate"]), base_step_s=base["step_s"])
    p = cost_model.links_step_s(**model, base_transfer_s=transfer, share=share)
    xfer = cost_model.links_step_s(**model, base_transfer_s=base["transfer_s"], share=share)["step_s"]
    added = cost_model.links_step_s(**model)["step_s"]
    return dict(
        row,
        predicted_step_s=p["step_s"],
        predicted_link_bytes=p["link_bytes"],
        share=p["share"],
        wire_s=p["wire_s"],
        xfer_step_s=xfer,
        add_step_s=added,
    )


def fmt(row: dict, batch: int) -> str:
    rate = row["rate"] or "unshaped"
    predicted = row.get("predicted_step_s")
    ratio = row["step_s"] / predicted if predicted else float("nan")
    pbytes = row.get("predicted_link_bytes")
    return (
        f"{row['hosts']:>5} {row['shards']:>2} {row['workers']:>2} {rate:>9} {row['aggregate']:>5} "
        f"{1e3 * row['step_s']:9.1f} {1e3 * predicted:9.1f} {ratio:6.2f} "
        f"{row['samples_per_s']:9.0f} {row['workers'] * batch / predicted:9.0f} "
        f"{row['link_bytes_per_step'] / 1e6:9.2f} {'' if pbytes is None else f'{pbytes / 1e6:9.2f}':>9} "
        f"{1e3 * row['compute_s']:8.1f} {1e3 * row['transfer_s']:8.1f} {1e3 * row['model_transfer_s']:8.1f} "
        f"{row.get('share') or float('nan'):5.2f} {1e3 * (row.get('wire_s') or float('nan')):8.1f} "
        f"{1e3 * (row.get('xfer_step_s') or float('nan')):8.1f} {1e3 * (row.get('add_step_s') or float('nan')):8.1f}"
    )


HEADER = (
    f"{'hosts':>5} {'S':>2} {'W':>2} {'link':>9} {'aggr':>5} {'step ms':>9} {'model ms':>9} {'meas/model':>6} "
    f"{'samples/s':>9} {'model':>9} {'MB/step':>9} {'model MB':>9} {'compute':>8} {'xfer ms':>8} {'cpu ms':>8} "
    f"{'share':>5} {'wire ms':>8} {'by xfer':>8} {'by add':>8}"
)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", choices=("table", "sweep"), help="run only the aggregation table or only the sweep")
    p.add_argument("--hidden", type=int, default=2500, help="MLP width (2500: 1.99M parameters, 8 MB a copy)")
    p.add_argument("--steps", type=int, default=12, help="steps per worker (the first two are not timed)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="runs of each point; the median run's step is shown")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one job may take")
    p.add_argument("--json", metavar="FILE", help="append each row as a JSON line here")
    args = p.parse_args()
    why = available()
    if why:
        print(f"emulated_hosts: {why}", file=sys.stderr)
        return 2
    # SIGTERM ends the runs as Ctrl-C does: every context manager removes what it made.
    signal.signal(signal.SIGTERM, _interrupt)
    plan = []  # (title, hosts, rate, shards, workers, aggregate)
    if args.only in (None, "table"):
        for aggregate in ("none", "host"):
            plan += [("table", 2, None, 2, 8, aggregate), ("table", 2, "1gbit", 2, 8, aggregate)]
    if args.only in (None, "sweep"):
        for hosts in (2, 4):
            plan += [("sweep", hosts, rate, hosts, 4, "none") for rate in (None, "1gbit", "10gbit")]
    print(
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; load: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}; cpus: {os.cpu_count()}; "
        f"MLP 784-{args.hidden}-10, batch {args.batch}, {args.steps} steps, sync, float32, "
        f"median of {args.repeats} runs",
        flush=True,
    )
    rows, bases, shares, cpu_rates = [], {}, {}, {}
    with tempfile.TemporaryDirectory(prefix="psgrid-emulated-") as tmp:
        for n, (title, hosts, rate, shards, workers, aggregate) in enumerate(plan):
            t0 = time.monotonic()
            repeats = [
                run_one(
                    hosts,
                    rate,
                    shards=shards,
                    workers=workers,
                    aggregate=aggregate,
                    args=args,
                    out=Path(tmp) / f"run-{n}-{r}",
                )
                for r in range(args.repeats)
            ]
            row = sorted(repeats, key=lambda r: r["step_s"])[len(repeats) // 2]  # the median run
            row["steps_s"] = [r["step_s"] for r in repeats]
            row["title"], row["batch"], row["run_s"] = title, args.batch, time.monotonic() - t0
            key = (hosts, shards, workers, aggregate)
            flows = flows_per_pair(row["worker_hosts"], aggregate)
            if rate is None:
                bases[key] = row
                cpu_rates[hosts, flows] = mesh_rate(hosts, None, flows, mib=64)
            elif rate_bits(rate) <= 10**9 and (hosts, rate, flows) not in shares:  # (2 cores cannot fill 10 Gbit/s)
                shares[hosts, rate, flows] = mesh_rate(hosts, rate, flows) / (rate_bits(rate) / 8)
            row = with_prediction(row, bases[key], cpu_rates[hosts, flows], shares.get((hosts, rate, flows)))
            rows.append(row)
            if n == 0:
                print(HEADER)
            spread_ms = "/".join(f"{1e3 * x:.0f}" for x in sorted(row["steps_s"]))
            print(fmt(row, args.batch) + f"   ({spread_ms} ms; {row['run_s']:.0f} s)", flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
