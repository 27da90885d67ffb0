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


def schedule_updates(job, hosts: int = 1) -> int:
    """The updates each shard of ``job`` (a JobConfig) applies: the length of its rate's schedule.

    The job's own where it sets ``lr_updates``; else ``[train] steps`` in sync (one update a round),
    and in async and ssp one a push: workers x steps, or with ``aggregate = "host"`` (one push a step
    from each host's leader) ``hosts`` x steps, ``hosts`` the machines with workers (one under psctl
    launch). 0 where the rate is constant.
    """
    server = job.server
    if server.lr_updates or not changes_rate(server):
        return server.lr_updates
    if job.train.epochs:
        raise ConfigError(
            f"[server] lr_schedule = {server.lr_schedule!r} with [train] epochs: the steps depend on the data, "
            "so set [server] lr_updates (the updates each shard applies)"
        )
    if mode_rules(server.mode).accumulates:
        return job.train.steps
    return job.train.steps * pushing_clients(job, hosts)


def pushing_clients(job, hosts: int = 1) -> int:
    """The clients that push to each shard: the workers, or with ``aggregate = "host"`` each host's leader.

    What a shard counts as its live workers (auto momentum lowers the momentum by what that many add).
    """
    return hosts if job.train.aggregate == "host" else job.workers


def scheduled(job, hosts: int = 1):
    """``job`` with ``lr_updates`` set where its rate's schedule needs it (:func:`schedule_updates`)."""
    updates = schedule_updates(job, hosts)
    if updates == job.server.lr_updates:
        return job
    return dataclasses.replace(job, server=dataclasses.replace(job.server, lr_updates=updates))


def changes_rate(server) -> bool:
    """Whether ``server`` (a ServerConfig) ever runs at another rate than ``lr``."""
    return server.lr_schedule != "constant" or server.lr_warmup > 0


def derived_note(job) -> str | None:
    """The line that says a schedule's length came from ``[train] steps`` (None where the job gave it, or none is
    needed): for a script, whose steps are its own."""
    if job.server.lr_updates or not changes_rate(job.server) or job.train.epochs:
        return None
    return (
        f"lr_schedule {job.server.lr_schedule} runs over {schedule_updates(job)} updates, from [train] "
        f"steps = {job.train.steps}; a script that runs another number of steps sets lr_updates"
    )


def updates_in_file(path, server) -> int:
    """The updates a shard of ``server`` (its ServerConfig) applies in the job of file ``path``.

    Read as a shard reads a job file (cluster/job/config.py ``load_shard_settings``): only what the length
    needs, [job] workers and [train] steps, epochs and aggregate, at their defaults where the file is silent;
    the rest of [train] is the workers' to check.
    """
    from types import SimpleNamespace

    from psgrid.cluster.job.config import JobConfig, read_job_file
    from psgrid.worker.config import TrainConfig

    _, data = read_job_file(path)

    def given(section: str, key: str, default):
        table = data.get(section)
        return table[key] if isinstance(table, dict) and key in table else data.get(key, default)

    train = SimpleNamespace(**{k: given("train", k, getattr(TrainConfig, k)) for k in ("steps", "epochs", "aggregate")})
    job = SimpleNamespace(server=server, train=train, workers=given("job", "workers", JobConfig.workers))
    return schedule_updates(job)
