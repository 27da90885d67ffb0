"""A user's script that hosts a shard in its own process: ``shard_placement = "worker"`` under ``psctl launch -- CMD``.

GeePS' placement for your own model, as the built-in trainer has it (cluster/run/hosting.py). The
launcher starts worker i (i < shards) with ``PSGRID_HOST_SHARD=i`` and ``PSGRID_ADDRESS_DIR`` in its
environment and no shard process for shard i. :func:`init` (what ``psgrid.init`` is) then starts
shard i in the script's process, serving it by calls (the in-process plane) and every other
process over its usual planes; publishes its address where a shard process would; waits for the
other shards' addresses; and joins the job as :func:`psgrid.worker.api.init` does. Its training
done (``ps.close()``), the process goes on serving, since the other workers still push to its
shard and the launcher evaluates from it: ``close()`` returns once the launcher's Shutdown has
stopped the shard (with its final checkpoint), at the job's end, and the script's own code after it
runs then.

Without ``PSGRID_HOST_SHARD`` (every other job) :func:`init` is :func:`psgrid.worker.api.init`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
import threading
from pathlib import Path

from psgrid.worker import api

# How long a hosting script waits for the other shards' addresses (as ``psctl worker --host-shard`` does).
ADDRESS_TIMEOUT_S = 120.0


@functools.wraps(api.init)
def init(params, **options):
    from psgrid.cluster.run.hosting import wait_for_addresses
    from psgrid.worker import alone
    from psgrid.worker.env import job_env

    env = job_env()
    if env.host_shard is None or options.get("addresses") is not None or alone.wanted():
        return api.init(params, **options)
    server = start_shard(env)
    stop = functools.partial(server.stop, grace=1.0)
    if threading.current_thread() is threading.main_thread():
        # SIGTERM (the launcher stopping this worker, or its lifeline when the launcher is gone) ends the
        # process as it would have, once the shard has stopped and written its final checkpoint.
        signal.signal(signal.SIGTERM, functools.partial(_stop_then_die, stop))
    try:
        addresses = wait_for_addresses(Path(env.address_dir), server.config.num_shards, ADDRESS_TIMEOUT_S)
        session = api.init(params, **{**options, "addresses": addresses})
    except BaseException:
        stop()
        raise
    # Its training ended as asked: serve on until the job ends. Else the shard stops with it (the launcher
    # starts it again as a process of its own under restart_failed, or the job ends).
    session.after_close(lambda ended: serve_on(server) if ended else stop())
    return session


def _stop_then_die(stop, signum, frame) -> None:
    # Not SystemExit: the script's threads and pools would then hold the process, and no exit hook runs.
    signal.signal(signum, signal.SIG_DFL)
    try:
        stop()
    finally:
        os.kill(os.getpid(), signum)


def start_shard(env):
    """Shard ``env.host_shard`` of the job in ``env.job_file``, served in this process; its address published."""
    from psgrid.cluster.job.config import load_shard_settings
    from psgrid.psserver.server import serve, write_address

    config, shards = load_shard_settings(env.job_file)
    index = env.host_shard
    changes = {"shard_index": index, "num_shards": shards, "port": 0}
    if config.metrics_port:
        changes["metrics_port"] = config.metrics_port + index  # one port per shard, as JobConfig.server_config
    server = serve(dataclasses.replace(config, **changes), in_process_clients=True)
    try:
        write_address(
            Path(env.address_dir) / f"shard-{index}",
            server.address,
            server.config.job_id,
            server.metrics.port if server.metrics else None,
        )
    except BaseException:
        server.stop(grace=1.0)
        raise
    print(
        f"psgrid shard {index}/{shards} listening on {server.address} in worker {env.rank}'s process "
        f"(mode {config.mode}, job {server.config.job_id})",
        flush=True,
    )
    return server


def serve_on(server) -> None:
    """Serve the shard until the launcher's Shutdown (or the shard's end), then stop it (its final checkpoint).

    In the caller's thread, which ``close()`` is called on: once a script's main thread ends, Python stops
    every thread pool from taking work (before it waits for other threads), and the shard's would refuse
    the other workers' calls.
    """
    try:
        while not server.shutdown_requested.wait(timeout=1.0):
            if server.wait(timeout=0):
                return
    finally:
        server.stop(grace=1.0)
