"""What a mode runs with unless told otherwise: one rule for `psctl launch`, `psctl mpi`, LocalCluster and compare.

async and ssp run with ``async_momentum = "auto"`` where the shards' SGD has momentum. Asynchrony adds
momentum of its own (about 1 - 1/W with W workers, Mitliagkas et al. 2016), so the job's momentum on
top overshoots: on the built-in MNIST job (docs/experiments/README.md) async with it off ended at 0.335
to 0.897 at 8 workers and 0.817 to 0.930 at 4 (unstable), with it on at 0.903 to 0.928 and 0.864 to
0.916; ssp:2 at 8 workers at 0.097 to 0.892 off and 0.909 to 0.917 on. Where plain momentum did no harm
(2 workers, and ssp:2 at 4) it costs about 0.01 to 0.03 of final accuracy.

A job that says ``async_momentum`` itself (in its file, a flag or ``--set``) runs as it says: the rule
fills in only what nobody chose, and every command that applies it says so in one line.
"""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

STALE_MODES = ("async", "ssp")
KEY = "async_momentum"


def stale_defaults(server) -> tuple[tuple[str, str], ...]:
    """The settings async and ssp add to ``server`` (a ServerConfig): ``async_momentum=auto`` where SGD has momentum."""
    if server.optimizer != "sgd" or not server.momentum or server.async_momentum != "off":
        return ()
    return ((KEY, "auto"),)


def file_sets(spec: str | Path | None, key: str = KEY) -> bool:
    """Whether the job file ``spec`` gives ``key`` itself (at the top level or in [server])."""
    if spec is None:
        return False
    from psgrid.cluster.job.config import server_keys_given

    return key in server_keys_given(spec)


def with_mode_defaults(job, given: Collection[str], spec: str | Path | None = None):
    """``job`` with its mode's defaults where neither ``given`` (the keys a caller set) nor the file ``spec`` chose.

    Returns the job and the settings added (empty where none was).
    """
    from psgrid.cluster.job.config import apply_overrides

    if job.mode not in STALE_MODES or KEY in given or file_sets(spec):
        return job, ()
    added = stale_defaults(job.server)
    return (apply_overrides(job, dict(added)) if added else job), added


def note(job, added: tuple[tuple[str, str], ...], program: str) -> str | None:
    """The one line a command prints where it added a mode's default (None where it added nothing)."""
    if not added:
        return None
    return (
        f'{program}: {job.mode} runs with async_momentum = "auto", the mode\'s default where SGD has momentum: the '
        f"shards lower momentum {job.server.momentum:g} by what W asynchronous workers add, 1 - 1/W "
        f"(--set async_momentum=off keeps it as it is)"
    )
