"""A shard's checkpoints: when one is due, captured under its lock, written outside it, restored at start.

A part of :class:`~psgrid.psserver.state.shard.Shard`; the file format (atomic writes, the
manifest) is :mod:`~psgrid.psserver.state.checkpoint_files`'s. State is copied under ``cond``
(:meth:`Checkpoints.capture`) and written by the thread whose update made a checkpoint due,
before that update is answered (:meth:`Checkpoints.flush`).

A checkpoint holds the state of every other part, so it is given each piece by name, and calls
none of the parts: the shard's ``core`` (its locks, clock, settings, policy and counters), the
``served`` range (the weights, optimizer and version, and ``take_on`` to restore them), the
``leases``, the ``round_grads`` held for open sync rounds, and the ``claims`` a restart sets.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import numpy as np

from psgrid.psserver.exceptions import CheckpointFailed
from psgrid.psserver.protocol import Reason
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.state import checkpoint_files
from psgrid.psserver.state.claims import Claims
from psgrid.psserver.state.core import ShardCore
from psgrid.psserver.state.membership import Leases
from psgrid.psserver.state.served_range import ServedRange

log = logging.getLogger("psgrid.shard")

# The gradients held for open sync rounds, round -> {worker: gradient}: pushes.py holds each until its
# round closes; a checkpoint captures them (their pushers' clocks have moved past them) and restores them.
RoundGrads = dict[int, dict[int, np.ndarray]]


class Checkpoints:
    """When a checkpoint is due, what it holds, writing it, and loading the latest back."""

    def __init__(self, core: ShardCore, served: ServedRange, leases: Leases, round_grads: RoundGrads, claims: Claims):
        self.core = core
        self.served = served
        self.leases = leases
        self.round_grads = round_grads
        self.claims = claims
        config = core.config
        self.directory = (
            str(checkpoint_files.shard_dir(config.checkpoint_dir, config.shard_index, config.num_shards))
            if config.checkpoint_dir
            else ""
        )
        # State is copied under the lock (capture) and written outside it by the thread whose update
        # made one due, before that update is answered (flush).
        self.pending: tuple[dict, dict] | None = None
        self.write_lock = threading.Lock()
        self.written_version = -1
        self.last = ""  # the path of the last one written (or restored)
        self.updates_since = 0
        self.last_time = core.now()

    def _due(self) -> bool:
        config, now = self.core.config, self.core.now
        every, every_s = config.checkpoint_every, config.checkpoint_every_s
        return bool(
            config.checkpoint_dir
            and self.served.initialized
            and self.updates_since
            and ((every and self.updates_since >= every) or (every_s and now() - self.last_time >= every_s))
        )

    def updated(self) -> None:
        """A new version is published (call under ``cond``): capture a checkpoint if one is due now."""
        self.updates_since += 1
        if self._due():
            self.pending = self.capture()

    def if_due(self) -> None:
        with self.core.apply_lock, self.core.cond:  # never while an async update changes the optimizer's state
            if self._due():
                self.pending = self.capture()
        self.flush()

    def flush(self) -> None:
        """Write the checkpoint captured under the lock, if any (call without the lock held).

        Peeked at first without the lock, as every push ends here: a thread that captures one
        calls this itself afterwards, and sees its own store.
        """
        if self.pending is None:
            return
        with self.core.cond:
            capture, self.pending = self.pending, None
        if capture is not None:
            self._write_logged(*capture)

    def write_now(self) -> tuple[str, int]:
        """Write a checkpoint of this moment and return its path once it is on disk."""
        core = self.core
        with core.apply_lock, core.cond:
            self.served.require_initialized()  # also while stopping: that is when the final one is written
            if not core.config.checkpoint_dir:
                raise CheckpointFailed(
                    "this shard was started without a checkpoint directory (psctl server --checkpoint-dir)",
                    Reason.NO_CHECKPOINT_DIR,
                )
            arrays, meta = self.capture()
        try:
            return self._write(arrays, meta), meta["version"]
        except OSError as exc:
            raise CheckpointFailed(f"shard {core.config.shard_index} could not write its checkpoint: {exc}") from exc

    def first(self) -> None:
        """The weights were just given (Init): where checkpoints are taken every interval, the first holds them.

        A shard that dies before its first interval is then restarted from the job's start, losing at
        most that interval as any restart does; with no checkpoint it came back with no weights at all,
        and every worker failed on it. (A shard that checkpoints only as it stops has no interval.)
        """
        config = self.core.config
        if not (config.checkpoint_dir and (config.checkpoint_every or config.checkpoint_every_s)):
            return
        with self.core.apply_lock, self.core.cond:
            capture = self.capture()
        self._write_logged(*capture)

    def _write_logged(self, arrays: dict, meta: dict) -> None:
        try:
            self._write(arrays, meta)
        except Exception:  # noqa: BLE001 - a full disk must not stop training; the last good one stays
            log.exception("shard %d: checkpoint failed; training goes on", self.core.config.shard_index)

    def _write(self, arrays: dict, meta: dict) -> str:
        # Serialized, and never behind: a capture overtaken by a newer write is dropped, so the
        # manifest only moves forward.
        with self.write_lock:
            if meta["version"] < self.written_version:
                return self.last
            path = str(checkpoint_files.save(self.directory, arrays, meta, keep=self.core.config.checkpoint_keep))
            self.written_version = meta["version"]
            with self.core.cond:
                self.last = path
            return path

    def capture(self) -> tuple[dict, dict]:
        """Copies of everything a checkpoint holds, taken atomically (call under the lock)."""
        core, served = self.core, self.served
        arrays = {"weights": served.arrays.download(served.weights)}  # a copy (from the GPU on a device shard)
        for key, value in served.optimizer.state_dict().items():  # state_dict returns copies
            arrays[f"opt.{key}"] = np.asarray(value)
        # Gradients held for open sync rounds: their pushers' clocks have moved past them.
        for round_, grads in self.round_grads.items():
            for worker, grad in grads.items():
                arrays[f"round.{round_}.{worker}"] = served.arrays.download(grad)
        leases, policy, config = self.leases, core.policy, core.config
        meta = {
            "version": served.version,
            "spec": served.spec.to_json(),
            "begin": served.begin,
            "end": served.end,
            "shard_index": config.shard_index,
            "num_shards": config.num_shards,
            "mode": config.mode,
            "clocks": {str(w): c for w, c in policy.clocks.items()},
            "closed_rounds": policy.closed_rounds,
            "next_id": leases.next_id,
            "hosts": {str(w): m.host for w, m in leases.members.items()},
            "departed": {str(w): c for w, c in policy.departed.items()},
            # A restarted process starts its counters afresh: the job's losses so far go on with it.
            "lost_updates": core.counters.lost_updates,
        }
        self.updates_since = 0
        self.last_time = core.now()
        return arrays, meta

    def begin_restore(self) -> None:
        """Refuse every call as UNAVAILABLE (reason ``restoring``) until :meth:`restore` has run."""
        with self.core.cond:
            self.core.restoring = True

    def restore(self) -> bool:
        """Load the latest complete checkpoint, if any; members get a fresh lease to come back."""
        try:
            return self._restore()
        finally:
            with self.core.cond:
                self.core.restoring = False
                self.core.cond.notify_all()

    def _restore(self) -> bool:
        found = checkpoint_files.load_latest(self.directory)  # read outside the lock: calls meanwhile are refused
        if found is None:
            return False
        core, served = self.core, self.served
        with core.cond:
            arrays, meta = found
            spec = ModelSpec.from_json(meta["spec"])
            opt_state = {k[4:]: (v if v.ndim else v.item()) for k, v in arrays.items() if k.startswith("opt.")}
            served.take_on(spec, meta["begin"], meta["end"], arrays["weights"], meta["version"], opt_state)
            for key, value in arrays.items():
                if key.startswith("round."):
                    _, round_, worker = key.split(".")
                    held = served.pool.take()  # the round gives it back to the pool when it closes
                    served.arrays.upload(held, np.ascontiguousarray(value, np.float32))
                    self._restore_round(int(round_), int(worker), held)
            policy, leases = core.policy, self.leases
            policy.closed_rounds = meta["closed_rounds"]
            leases.next_id = meta["next_id"]
            now = core.now()
            policy.departed = {int(w): c for w, c in meta.get("departed", {}).items()}
            core.counters.lost_updates = meta.get("lost_updates", 0)
            for w, c in meta["clocks"].items():
                policy.clocks[int(w)] = c
                leases.add(int(w), meta["hosts"].get(w, ""), now)
            self.claims.restored(served.version, policy.clocks)
            self.last = str(Path(self.directory) / checkpoint_files.MANIFEST)
            self.written_version = served.version
            clocks = sorted(policy.clocks.values())
            log.warning(
                "shard %d restored its checkpoint at version %d (%s; worker clocks %s)",
                core.config.shard_index,
                served.version,
                f"{policy.closed_rounds} rounds closed" if policy.accumulates else core.config.mode,
                f"{clocks[0]}..{clocks[-1]}" if clocks else "none",
            )
            return True

    def _restore_round(self, round_: int, worker: int, grad: np.ndarray) -> None:
        """Hold ``grad`` (a pooled buffer) as ``worker``'s gradient for open round ``round_`` (call under ``cond``)."""
        self.round_grads.setdefault(round_, {})[worker] = grad
        self.core.policy.round_pushers.setdefault(round_, set()).add(worker)
