"""What a mode runs with unless told otherwise: one rule for `psctl launch`, `psctl mpi`, LocalCluster and compare.

Two sources, the job's before psgrid's:

* the job file's table of the mode, ``[async]`` for async (cluster/job/config.py ``mode_tables``): what
  the job's author found that mode needs, a lower rate for example;
* psgrid's own: async and ssp run with ``async_momentum = "auto"`` where the shards' optimizer has
  momentum (SGD's ``momentum``, Adam's ``beta1``). Asynchrony adds momentum of its own (about 1 - 1/W
  with W workers, Mitliagkas et al. 2016), so the job's momentum on top overshoots: on the built-in
  MNIST job (docs/experiments/README.md) async with it off ended at 0.335 to 0.897 at 8 workers and
  0.817 to 0.930 at 4 (unstable), with it on at 0.903 to 0.928 and 0.864 to 0.916; ssp:2 at 8 workers
  at 0.097 to 0.892 off and 0.909 to 0.917 on. Where plain momentum did no harm (2 workers, and ssp:2
  at 4) it costs about 0.01 to 0.03 of final accuracy. Adam likewise (synthetic-20m on H200s, the two
  settings side by side over 5 seeds, docs/experiments/synthetic-stale-adam-2xH200): async at 8 workers
  ended at 0.233 to 0.476 with beta1 0.9 and at 0.531 to 0.746 with it lowered (sync: about 0.71); at 4
  workers the medians rose by 0.02; at 2 ssp:2 fell from 0.684 to 0.646 and spread more. On the digits
  CNN (CPU, docs/experiments/README.md) medians stayed within 0.014 either way, and ssp:2 at 2 workers
  again spread more with it (0.084 against 0.042).

A key the command line gives (a flag or ``--set``) is never replaced; psgrid's ``async_momentum`` is not
added where the job file says the key anywhere. Every command that adds a setting says so in one line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection
from pathlib import Path
from typing import NamedTuple

from psgrid.cluster.job.toml_writer import toml_value

STALE_MODES = ("async", "ssp")
KEY = "async_momentum"

Settings = tuple[tuple[str, object], ...]


def stale_defaults(server) -> Settings:
    """psgrid's setting for async and ssp on ``server`` (a ServerConfig): ``async_momentum=auto`` where the
    optimizer has momentum (SGD's ``momentum``, Adam's ``beta1``)."""
    if server.async_momentum != "off" or not getattr(server, server.momentum_key):
        return ()
    return ((KEY, "auto"),)


class Added(NamedTuple):
    """The settings a mode's defaults added: from the job file's table of the mode, and psgrid's own."""

    table: Settings = ()
    psgrid: Settings = ()

    @property
    def settings(self) -> Settings:
        return self.table + self.psgrid


def defaults_for(mode: str, server, given: Collection[str], spec: str | Path | None) -> Added:
    """The settings ``mode`` adds to ``server``: the job file's table of it, then psgrid's, less what ``given`` sets."""
    from psgrid.cluster.job.config import file_choices

    chosen, tables = file_choices(spec) if spec is not None else (set(), {})
    table = {k: v for k, v in tables.get(mode, {}).items() if k not in given}
    said = KEY in given or KEY in chosen or any(KEY in t for t in tables.values())  # anywhere in the file
    psgrid: Settings = ()
    if mode in STALE_MODES and not said:
        try:
            psgrid = stale_defaults(dataclasses.replace(server, **table))
        except ValueError:
            pass  # the table does not fit the job: applying it names why (ConfigError)
    return Added(tuple(table.items()), psgrid)


def with_mode_defaults(job, given: Collection[str], spec: str | Path | None = None):
    """``job`` with its mode's defaults (:func:`defaults_for`); returns the job and what was added (:class:`Added`)."""
    from psgrid.cluster.job.config import apply_overrides

    added = defaults_for(job.mode, job.server, given, spec)
    if not added.settings:
        return job, added
    return apply_overrides(job, {f"server.{k}": v for k, v in added.settings}), added


def note(job, added: Added, program: str) -> str | None:
    """The one line a command prints where it added settings to a mode (None where it added none)."""
    if not added.settings:
        return None
    why = []
    if added.table:
        why.append(f"the job file's [{job.mode}]")
    if added.psgrid:
        key = job.server.momentum_key
        why.append(
            f"the mode's default where the optimizer has momentum: the shards lower {key} "
            f"{getattr(job.server, key):g} by what W asynchronous workers add, 1 - 1/W "
            f"(--set async_momentum=off keeps it as it is)"
        )
    said = ", ".join(f"{k} = {toml_value(v)}" for k, v in added.settings)
    return f"{program}: {job.mode} runs with {said}: {'; '.join(why)}"
