"""How long a job's rate schedule runs: the updates each of its shards applies (``lr_updates``).

A shard's schedule (psserver/kernels/schedule.py) counts its own updates, one per round in sync and
one per push in async and ssp. Given ``[train] steps`` per worker, the job knows how many that is in
each mode, so every mode reaches the same rate at the same share of the job's samples, and a
comparison of modes compares them, not their schedules.
"""

from __future__ import annotations

import dataclasses

from psgrid.cluster.errors import ConfigError
from psgrid.psserver.protocol import mode_rules


def schedule_updates(job) -> int:
    """The updates each shard of ``job`` (a JobConfig) applies: the length of its rate's schedule.

    The job's own where it sets ``lr_updates``; else ``[train] steps`` in sync (one update a round),
    workers x steps in async and ssp (one a push). 0 where the rate is constant.
    """
    server = job.server
    if server.lr_updates or not (server.lr_schedule != "constant" or server.lr_warmup):
        return server.lr_updates
    if job.train.epochs:
        raise ConfigError(
            f"[server] lr_schedule = {server.lr_schedule!r} with [train] epochs: the steps depend on the data, "
            "so set [server] lr_updates (the updates each shard applies)"
        )
    return job.train.steps * (1 if mode_rules(server.mode).accumulates else job.workers)


def scheduled(job):
    """``job`` with ``lr_updates`` set where its rate's schedule needs it (:func:`schedule_updates`)."""
    updates = schedule_updates(job)
    if updates == job.server.lr_updates:
        return job
    return dataclasses.replace(job, server=dataclasses.replace(job.server, lr_updates=updates))
