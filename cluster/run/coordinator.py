"""What a coordinator does, whether it is ``psctl launch`` or MPI rank 0.

It follows the workers' JSON-lines metrics (:class:`MetricsTail`), shows one progress
bar (:class:`Progress`), and at the end evaluates the final weights, reads every
shard's counters, stops the shards (:func:`finish`) and writes ``metrics.jsonl``
and ``summary.json`` (:func:`write_results`).
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from psgrid.cluster.errors import JobFailed
from psgrid.cluster.job.config import JobConfig
from psgrid.psserver import files

EVAL_TIMEOUT_S = 600.0
# Shard counters copied into summary.json, per shard.
SHARD_FIELDS = (
    "shard_index",
    "address",
    "mode",
    "version",
    "begin",
    "end",
    "min_clock",
    "max_clock",
    "pushes",
    "pulls",
    "bytes_in",
    "bytes_out",
    "applied_updates",
    "dropped_late",
    "duplicates",
    "evictions",
    "rejected",
    "staleness_counts",
    "mean_staleness",
    "max_staleness",
    "wait_s_total",
    "checkpoint",
    "waits",
    "departed",
    "lost_updates",
    "restored_version",
    "stalled_evictions",
    "revoked_reads",
    "uncompensated_updates",
    "momentum",
    "lr",
)


class MetricsTail:
    """Reads the complete JSON lines appended to a set of files since the last call."""

    def __init__(self, paths: Iterable[str | Path] = ()):
        self._offsets: dict[Path, int] = {}
        self._partial: dict[Path, bytes] = {}
        for p in paths:
            self.add(p)

    def add(self, path: str | Path) -> None:
        self._offsets.setdefault(Path(path), 0)

    def read(self) -> list[dict]:
        events = []
        for path, offset in self._offsets.items():
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read()
            except FileNotFoundError:
                continue
            if not data:
                continue
            self._offsets[path] = offset + len(data)
            data = self._partial.pop(path, b"") + data
            lines = data.split(b"\n")
            if lines[-1]:
                self._partial[path] = lines[-1]
            for line in lines[:-1]:
                event = _parse(line)
                if event is not None:
                    events.append(event)
        return events


def _parse(line: bytes) -> dict | None:
    line = line.strip()
    if not line:
        return None
    try:
        event = json.loads(line)
    except ValueError:
        return None
    return event if isinstance(event, dict) else None


class JobState:
    """What the workers' events say so far: steps per rank, latest loss, evaluations, results."""

    def __init__(self):
        self.steps_done: dict[int, int] = {}
        self.samples: dict[int, int] = {}
        self.loss: dict[int, float] = {}
        self.last_eval: dict | None = None
        self.rank_evals: dict[int, dict] = {}  # each worker's latest evaluation
        self.done: dict[int, dict] = {}
        self.first_step: dict[int, int] = {}  # where each worker started: above 0 when a job resumes
        self.started: set[int] = set()  # ranks whose "start" event arrived: they joined the job
        self.first_start: float | None = None  # time of the first worker's "start" event
        self.last_done: float | None = None  # time of the last worker's "done" event

    def update(self, events: Iterable[dict]) -> list[dict]:
        """Fold in new events; returns the eval events among them."""
        evals = []
        for e in events:
            kind, rank = e.get("event"), e.get("rank")
            if kind == "step" and isinstance(rank, int):
                # "step" counts this worker's steps; "clock" may jump (a worker joining late starts at the
                # shards' clock), so it is not a step count.
                n = int(e["step"]) + 1 if isinstance(e.get("step"), int) else self.steps_done.get(rank, 0) + 1
                self.steps_done[rank] = max(self.steps_done.get(rank, 0), n)
                if isinstance(e.get("samples"), int):
                    self.samples[rank] = self.samples.get(rank, 0) + e["samples"]
                if finite(e.get("loss")):
                    self.loss[rank] = float(e["loss"])
            elif kind == "eval":
                self.last_eval = e
                evals.append(e)
                before = self.rank_evals.get(rank, {}).get("step", -1) if isinstance(rank, int) else None
                if before is not None and isinstance(e.get("step"), int) and e["step"] >= before:
                    self.rank_evals[rank] = e
            elif kind == "start" and finite(e.get("time")):
                self.first_start = min(self.first_start or e["time"], e["time"])
                if isinstance(rank, int):
                    self.started.add(rank)
                    if isinstance(e.get("first_step"), int):  # a rank's later sessions (a notebook's) start on
                        self.first_step[rank] = min(self.first_step.get(rank, e["first_step"]), e["first_step"])
            elif kind == "done" and isinstance(rank, int):
                before = self.done.get(rank, {})
                again = "time" in e and e.get("time") == before.get("time")  # the same record twice (psctl mpi)
                if not again and isinstance(before.get("samples"), int) and isinstance(e.get("samples"), int):
                    e = {**e, "samples": before["samples"] + e["samples"]}  # a rank's sessions, one after another
                self.done[rank] = e
                if finite(e.get("time")):
                    self.last_done = max(self.last_done or e["time"], e["time"])
        return evals

    def worker_position(self, rank: int) -> int:
        """The step a worker has reached, counting those made before a resume."""
        first = self.first_step.get(rank, 0)
        return max(self.steps_done.get(rank, first), first + int(self.done.get(rank, {}).get("steps", 0)))

    def worker_steps(self, rank: int) -> int:
        """Steps a worker made in this run."""
        return self.worker_position(rank) - self.first_step.get(rank, 0)

    @property
    def position(self) -> int:
        """All workers' steps reached, counting those made before a resume (what a progress bar shows)."""
        return sum(self.worker_position(r) for r in set(self.steps_done) | set(self.done) | set(self.first_step))

    def worker_samples(self, rank: int) -> int:
        """The worker's own count where its done record has one; else its step records' (a script that exited
        without ``close()`` has a done record the launcher made, with no count: its samples were not 0)."""
        done = self.done.get(rank, {})
        return int(done["samples"]) if "samples" in done else self.samples.get(rank, 0)

    @property
    def steps(self) -> int:
        return sum(self.worker_steps(r) for r in set(self.steps_done) | set(self.done))

    @property
    def total_samples(self) -> int:
        return sum(self.worker_samples(r) for r in set(self.samples) | set(self.done))

    def train_wall_s(self) -> float | None:
        """From the first worker's first step to the last worker's end, by the workers' own clocks."""
        if self.first_start is None or self.last_done is None:
            return None
        return max(0.0, self.last_done - self.first_start)

    @property
    def mean_loss(self) -> float | None:
        return sum(self.loss.values()) / len(self.loss) if self.loss else None

    @property
    def test_accuracy(self) -> float | None:
        return None if self.last_eval is None else self.last_eval.get("test_accuracy")

    def evaluation(self) -> dict:
        """Every worker's latest evaluation, averaged: not whichever worker happened to log last.

        Each worker's train accuracy is measured on its own part of the data, so their mean is
        the whole training set's; the test set is the same for all.
        """
        found = {}
        for key in ("test_accuracy", "train_accuracy", "test_loss"):
            values = [e[key] for e in self.rank_evals.values() if finite(e.get(key))]
            if values:
                found[key] = sum(values) / len(values)
        return found


def finite(x: Any) -> bool:
    """Whether ``x`` is a real number, neither NaN nor infinite (a JSON record's field may be anything)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


class Progress:
    """One tqdm bar over all workers' steps, with loss and test accuracy; plain lines when not a terminal."""

    def __init__(self, total: int | None, enabled: bool | None = None, desc: str = "train"):
        from tqdm import tqdm

        self._tty = sys.stderr.isatty()
        show = self._tty if enabled is None else enabled
        self.bar = tqdm(
            total=total, desc=desc, unit="step", disable=not show, file=sys.stderr, dynamic_ncols=True, mininterval=0.5
        )
        self.total = total
        self._shown = 0
        self._said_step = 0  # the last evaluation's step given a line: one line per step, in order

    @property
    def enabled(self) -> bool:
        return not self.bar.disable

    def update(self, state: JobState, evals: list[dict]) -> None:
        steps = state.position
        if steps > self._shown:
            self.bar.update(steps - self._shown)
            self._shown = steps
        post = postfix(state)
        if post and self.enabled:
            self.bar.set_postfix(post, refresh=False)
        if not self.enabled:
            # Every worker of a script evaluates at the same steps, and events arrive file by file (and,
            # under psctl mpi, again with each worker's results): one line per step, in step order.
            for e in sorted((e for e in evals if isinstance(e.get("step"), int)), key=lambda e: e["step"]):
                if e["step"] > self._said_step:
                    self._said_step = e["step"]
                    print(self.describe(state, e), file=sys.stderr, flush=True)

    def describe(self, state: JobState, e: dict) -> str:
        """One line per evaluation, for logs where no bar is drawn."""
        total = f"/{self.total}" if self.total else ""
        acc, loss = e.get("test_accuracy"), state.mean_loss
        # the bar's count: a resumed job's steps count from where it was, as its total does
        parts = [f"[{state.position}{total} steps] worker {e.get('rank', 0)} step {e.get('step', '?')}:"]
        if finite(acc):
            parts.append(f"test accuracy {acc:.4f}")
        if loss is not None:
            parts.append(f"(mean training loss {loss:.4f})")
        return " ".join(parts)

    def close(self) -> None:
        self.bar.close()


def postfix(state: JobState) -> dict:
    """What a progress bar shows after its count: the mean training loss and the latest test accuracy."""
    post = {}
    if state.mean_loss is not None:
        post["loss"] = f"{state.mean_loss:.4f}"
    if state.test_accuracy is not None:
        post["test_acc"] = f"{state.test_accuracy:.4f}"
    return post


def total_steps(job: JobConfig) -> int | None:
    """All workers' steps together, when known in advance (not with epochs: shard sizes decide)."""
    if job.train.epochs > 0:
        return None
    return job.train.steps * job.workers


def call_with_timeout(fn: Callable[[], Any], timeout: float, what: str) -> Any:
    """Run ``fn`` in a thread; raise JobFailed if it does not return within ``timeout`` seconds."""
    result: dict[str, Any] = {}

    def run():
        try:
            result["value"] = fn()
        except BaseException as e:  # handed back to the caller below
            result["error"] = e

    t = threading.Thread(target=run, name=f"psctl-{what}", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise JobFailed(f"{what} did not finish within {timeout:.0f} s")
    if "error" in result:
        raise result["error"]
    return result["value"]


def finish(job: JobConfig, addresses: list[str], *, evaluate: bool = True) -> tuple[dict | None, list[dict]]:
    """Evaluate the final weights, read every shard's counters and ask the shards to stop.

    Returns ``(evaluation, shard_stats)``; the shards are asked to stop even if the evaluation fails.
    """
    from psgrid.worker.loop import make_admin

    t = job.train
    admin = make_admin(t, addresses, deadline_s=t.deadline_s, retry_s=min(t.retry_s, 10.0))
    evaluation = None
    try:
        if evaluate:
            from psgrid.worker.evaluate import evaluate as evaluate_weights

            evaluation = call_with_timeout(
                lambda: evaluate_weights(job.train, addresses), EVAL_TIMEOUT_S, "final evaluation"
            )
        stats = call_with_timeout(admin.stats, 60.0, "reading shard stats")
    finally:
        try:
            call_with_timeout(lambda: admin.shutdown(job.server.job_id or ""), 30.0, "shard shutdown")
        finally:
            admin.close()
    return evaluation, [shard_summary(s) for s in stats]


def shard_summary(stats: dict) -> dict:
    """The counters of one shard's ``Admin.stats`` that summary.json keeps, and its number of members."""
    out = {k: stats[k] for k in SHARD_FIELDS if k in stats}
    out["members"] = len(stats.get("members", []))
    return out


def write_json(path: str | Path, data: Any) -> None:
    """Write JSON atomically (temp file, rename), so a reader never sees half a file."""
    with files.replacing(path) as f:
        json.dump(data, f, indent=2, default=_jsonable)
        f.write("\n")


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):  # numpy scalars
        return x.item()
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


def merge_metrics(sources: Iterable[str | Path | list[dict]], out: str | Path) -> int:
    """Merge JSON-lines files (or lists of events) into one time-sorted ``out``; returns the line count."""
    events: list[dict] = []
    for src in sources:
        if isinstance(src, list):
            events.extend(src)
            continue
        try:
            with open(src, "rb") as f:
                events.extend(e for e in (_parse(line) for line in f) if e is not None)
        except FileNotFoundError:
            continue
    events.sort(key=lambda e: e.get("time", 0.0) if finite(e.get("time")) else 0.0)
    with files.open_new(out, "w") as f:
        for e in events:
            f.write(json.dumps(e, default=_jsonable) + "\n")
    return len(events)


class EventLog:
    """The coordinator's own JSON lines (job start, shards ready, exits, final evaluation)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        files.make_dirs(self.path.parent)
        self._f = files.open_new(self.path, "a")

    def __call__(self, event: str, **fields: Any) -> None:
        self._f.write(
            json.dumps({"event": event, "time": time.time(), "source": "coordinator", **fields}, default=_jsonable)
            + "\n"
        )
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def build_summary(
    job: JobConfig,
    *,
    launcher: str,
    status: str,
    addresses: list[str],
    state: JobState,
    train_wall_s: float | None,
    total_wall_s: float,
    evaluation: dict | None,
    shard_stats: list[dict],
    failures: list[dict],
    worker_exits: dict[int, int | None],
    out: str,
    message: str | None = None,
    restarts: list[dict] | None = None,
    resumed: list[dict] | None = None,
) -> dict:
    """summary.json: the same fields for ``launch`` and ``mpi``.

    ``shards`` is the number of shards (as ``workers`` is of workers); each shard's counters are
    under ``shard_stats``, as in the coordinator's ``shard_stats`` events.
    """
    steps, samples = state.steps, state.total_samples
    # Training time as the workers saw it (first step to last end); without their events, the caller's.
    train_wall_s = state.train_wall_s() or train_wall_s
    workers = []
    for rank in range(job.workers):
        d = state.done.get(rank, {})
        workers.append(
            {
                "rank": rank,
                "exit_code": worker_exits.get(rank),
                "completed": rank in state.done,
                "steps": state.worker_steps(rank),
                "samples": state.worker_samples(rank),
                "wall_s": d.get("wall_s"),
                "final_loss": d.get("final_loss", state.loss.get(rank)),
                "warmup_s": d.get("warmup_s", 0.0),  # compiling GPU kernels before joining: not in wall_s
                "device": d.get("device"),  # cpu, or cuda:N
            }
        )
    losses = [w["final_loss"] for w in workers if finite(w["final_loss"])]
    evaluation = evaluation or {}
    return {
        "name": job.name,
        "status": status,
        "message": message,
        "launcher": launcher,
        "mode": job.server.mode,
        "shards": job.shards,
        "shard_device": None if launcher == "allreduce" else job.server.shard_device,  # "auto" resolved at launch
        "shard_placement": None if launcher == "allreduce" else job.shard_placement,
        "workers": job.workers,
        "workers_completed": sum(1 for w in workers if w["completed"]),
        "steps": steps,
        "samples": samples,
        "wall_s": train_wall_s,
        "warmup_s": max((w["warmup_s"] or 0.0 for w in workers), default=0.0),
        "total_wall_s": round(total_wall_s, 3),
        "samples_per_s": (samples / train_wall_s) if train_wall_s else None,
        "steps_per_s": (steps / train_wall_s) if train_wall_s else None,
        "train_accuracy": evaluation.get("train_accuracy"),
        "test_accuracy": evaluation.get("test_accuracy"),
        "test_loss": evaluation.get("test_loss"),
        "final_version": evaluation.get("version"),
        "final_loss": (sum(losses) / len(losses)) if losses else None,
        "addresses": addresses,
        "shard_stats": shard_stats,
        "worker_results": workers,
        "failures": failures,
        "restarts": restarts or [],
        "resumed": resumed,
        "lost_updates": sum(s.get("lost_updates", 0) for s in shard_stats),
        "out": out,
        "job_id": job.server.job_id,
        "optimizer": job.server.applied_optimizer(),  # what the shards applied, whatever the workers ran
        "config": job.public_dict(),
    }


def headline(summary: dict) -> str:
    """One line for the terminal: mode, steps, time, throughput, accuracies."""

    def f(x, spec):
        return format(x, spec) if finite(x) else "n/a"

    return (
        f"{summary['name']} ({summary['mode']}, {_n(summary['shards'], 'shard')}, "
        f"{_n(summary['workers'], 'worker')}): "
        f"{summary['steps']} steps in {f(summary['wall_s'], '.1f')} s, "
        f"{f(summary['samples_per_s'], '.0f')} samples/s, train accuracy {f(summary['train_accuracy'], '.4f')}, "
        f"test accuracy {f(summary['test_accuracy'], '.4f')}"
    )


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"
