"""How long a shard spends on each push, timed inside the shard processes a benchmark spawns.

A worker's records time a push from its side (for a posted push, until its answers are read: an
upper bound). This times it where it runs: ``Pushes.push`` (the whole push, lock waits included)
and ``Optimizer.step`` (the update's passes over the range). A benchmark calls ``use(folder)``
before it spawns its shards and ``install_if_asked()`` at the top of its module (a spawned process
imports its parent's main module again, so the shards wrap their own methods); each shard process
then keeps ``shard-<pid>.json`` in ``folder`` up to date, and ``summary(folder)`` reads them back.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

ENV = "PSGRID_BENCH_SHARD_TIMES"
EVERY = 25  # pushes between two writes of a shard's file


def _timed(cls, name: str, times: list, write) -> None:
    original = getattr(cls, name)

    def timed(*args, **kw):
        t0 = time.perf_counter()
        try:
            return original(*args, **kw)
        finally:
            times.append((t0, time.perf_counter()))
            write()

    setattr(cls, name, timed)


def install_if_asked() -> None:
    folder = os.environ.get(ENV)
    if not folder:
        return
    from psgrid.psserver.kernels.optim import Optimizer
    from psgrid.psserver.state.pushes import Pushes

    times: dict[str, list] = {"push": [], "update": []}
    path = Path(folder) / f"shard-{os.getpid()}.json"

    def write() -> None:
        if len(times["push"]) % EVERY == 0:
            path.write_text(json.dumps(times))

    _timed(Pushes, "push", times["push"], write)
    _timed(Optimizer, "step", times["update"], lambda: None)


def use(folder: str | None) -> None:
    """Shards spawned from now on time their pushes into ``folder`` (None: they do not)."""
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        for old in Path(folder).glob("shard-*.json"):
            old.unlink()
        os.environ[ENV] = folder
    else:
        os.environ.pop(ENV, None)


def summary(folder: str, posted: list[float] = (), answered: list[float] = (), skip: int = 5) -> dict:
    """Medians over the shards, in seconds: a push, an update, and the time from one push's start to the next.

    With the worker's own times (``time.perf_counter``, one clock for every process of the host) of
    each push's post (``posted``) and of the end of its wait for the answers (``answered``), in order:
    how long a push took to reach ``Pushes.push`` (``to_shard_s``) and its answer to reach the worker
    after it (``to_worker_s``), for the slowest shard of each push. ``slowest_push_s``: the slowest
    shard's ``Pushes.push`` of each push.
    """
    push, update, period = [], [], []
    starts, ends = [], []
    for path in Path(folder).glob("shard-*.json"):
        times = json.loads(path.read_text())
        spans = times["push"]
        push += [b - a for a, b in spans[skip:]]
        update += [b - a for a, b in times["update"][skip:]]
        period += [b[0] - a[0] for a, b in zip(spans[skip:], spans[skip + 1 :])]
        starts.append([a for a, _ in spans])
        ends.append([b for _, b in spans])
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    row = {"shard_push_s": med(push), "shard_update_s": med(update), "shard_period_s": med(period)}
    n = min([len(posted), len(answered), *map(len, starts)]) if starts else 0
    row["slowest_push_s"] = med(
        [max(e[i] - s[i] for s, e in zip(starts, ends)) for i in range(skip, min(map(len, starts), default=0))]
    )
    row["to_shard_s"] = med([max(s[i] for s in starts) - posted[i] for i in range(skip, n)])
    row["to_worker_s"] = med([answered[i] - max(e[i] for e in ends) for i in range(skip, n)])
    return row
