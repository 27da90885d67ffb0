"""A worker that hosts a shard in its own process (``[job] shard_placement = "worker"``): GeePS' placement.

The built-in trainer's; a user's script hosts its shard through ``psgrid.init`` (cluster/run/hosted_script.py).

``psctl launch`` starts worker i (i < shards) as ``psctl worker --host-shard i --address-dir OUT/addr``.
It starts shard i of the job in its own process, serving that process by calls (the in-process
plane, psserver/transports/local_server.py) and every other process over the shard's usual
planes; publishes the shard's address where a shard process would (``OUT/addr/shard-i``); waits
for the other shards' addresses; and trains. Its training done, it goes on serving, since the
other workers still push to its shard and the launcher evaluates from it, until the launcher's
Shutdown or a signal; then it stops the shard as ``psctl server`` does, writing its final
checkpoint where the job checkpoints.

The process holds a worker and a shard, and its death is both's: the job ends, or under
``restart_failed`` the launcher starts the shard again from its checkpoint as a process of its own
(docs/reliability.md).
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path

from psgrid.cluster.errors import JobFailed, UsageError
from psgrid.psserver.protocol import parse_address_file


def check_placement(job, *, launcher: str = "psctl launch") -> None:
    """Refuse in one line a job that asks for ``shard_placement = "worker"`` where it cannot be had."""
    if job.shard_placement != "worker":
        return
    use_process = 'use shard_placement = "process"'
    if launcher != "psctl launch":
        raise UsageError(
            f'[job] shard_placement = "worker" is for psctl launch, on one machine: {launcher} starts its '
            f"shards as processes of their own; {use_process}"
        )
    if job.train.aggregate == "host":
        raise UsageError(
            f'[job] shard_placement = "worker" and [train] aggregate = "host" do not go together (one '
            f"client per host pushes the host's mean); {use_process}"
        )


def wait_for_addresses(folder: Path, shards: int, timeout_s: float) -> list[str]:
    """Every shard's address, in shard order, once each has published it in ``folder`` (``shard-I``)."""
    files = [folder / f"shard-{i}" for i in range(shards)]
    deadline = time.monotonic() + timeout_s
    while not all(f.exists() for f in files):
        if time.monotonic() > deadline:
            missing = ", ".join(f.name for f in files if not f.exists())
            raise JobFailed(f"{missing} published no address in {folder} within {timeout_s:.0f} s (start_timeout_s)")
        time.sleep(0.05)
    return [parse_address_file(f.read_text())[0] for f in files]


def _stop_on_signal(signum, frame):
    # Raised in the main thread, wherever training is: the `finally` below stops the shard, which
    # writes its final checkpoint (a resumed job starts from it).
    raise SystemExit(128 + signum)


def run_hosting_worker(job, shard_index: int, address_dir: Path, rank: int, world: int, metrics: str | None) -> dict:
    """Host shard ``shard_index`` of ``job``, train as worker ``rank`` of ``world``, serve until stopped; the worker's result."""
    from psgrid.psserver.server import serve, write_address
    from psgrid.worker.loop import run_worker

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _stop_on_signal)
    server = serve(job.server_config(shard_index), in_process_clients=True)
    try:
        write_address(
            address_dir / f"shard-{shard_index}",
            server.address,
            server.config.job_id,
            server.metrics.port if server.metrics else None,
        )
        print(
            f"psgrid shard {shard_index}/{job.shards} listening on {server.address} in worker {rank}'s process "
            f"(mode {job.server.mode}, job {server.config.job_id})",
            flush=True,
        )
        addresses = wait_for_addresses(address_dir, job.shards, job.start_timeout_s)
        result = run_worker(job.train, addresses, rank, world, metrics_path=metrics)
        print(json.dumps(result), flush=True)
        server.wait()  # the other workers still train against this shard; the launcher's Shutdown ends it
        return result
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):  # a second signal must not cut the final checkpoint short
            signal.signal(sig, signal.SIG_IGN)
        server.stop(grace=1.0)
        print(f"psgrid shard {shard_index} stopped", file=sys.stderr, flush=True)
