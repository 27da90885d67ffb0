"""A shard's checkpoints: captured under its lock, written outside it, restored at start.

A mixin of :class:`~psgrid.psserver.state.shard.Shard`; the file format (atomic writes, the
manifest) is :mod:`~psgrid.psserver.state.checkpoint`'s. State is copied under ``cond``
(:meth:`Checkpointing._capture`) and written by the thread whose update made a checkpoint due,
before that update is answered (:meth:`Checkpointing._flush_capture`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from psgrid.psserver.exceptions import CheckpointFailed
from psgrid.psserver.protocol import Reason
from psgrid.psserver.spec import ModelSpec
from psgrid.psserver.state import checkpoint

log = logging.getLogger("psgrid.shard")


class Checkpointing:
    """When a checkpoint is due, what it holds, writing it, and loading the latest back."""

    def _checkpoint_due(self) -> bool:
        every, every_s = self.config.checkpoint_every, self.config.checkpoint_every_s
        return bool(self.config.checkpoint_dir and self.initialized and self.updates_since_checkpoint and (
            (every and self.updates_since_checkpoint >= every)
            or (every_s and self.now() - self.last_checkpoint_time >= every_s)))

    def checkpoint_if_due(self) -> None:
        with self.apply_lock, self.cond:      # never while an async update changes the optimizer's state
            if self._checkpoint_due():
                self.pending_capture = self._capture()
        self._flush_capture()

    def _flush_capture(self) -> None:
        """Write the checkpoint captured under the lock, if any (call without the lock held).

        Peeked at first without the lock, as every push ends here: a thread that captures one
        calls this itself afterwards, and sees its own store.
        """
        if self.pending_capture is None:
            return
        with self.cond:
            capture, self.pending_capture = self.pending_capture, None
        if capture is not None:
            self._write_logged(*capture)

    def checkpoint(self) -> tuple[str, int]:
        """Write a checkpoint of this moment and return its path once it is on disk."""
        with self.apply_lock, self.cond:
            self._require_initialized()       # also while stopping: that is when the final one is written
            if not self.config.checkpoint_dir:
                raise CheckpointFailed("this shard was started without a checkpoint directory "
                                       "(psctl server --checkpoint-dir)", Reason.NO_CHECKPOINT_DIR)
            arrays, meta = self._capture()
        try:
            return self._write(arrays, meta), meta["version"]
        except OSError as exc:
            raise CheckpointFailed(f"shard {self.config.shard_index} could not write its checkpoint: {exc}") from exc

    def _write_logged(self, arrays: dict, meta: dict) -> None:
        try:
            self._write(arrays, meta)
        except Exception:  # noqa: BLE001 - a full disk must not stop training; the last good one stays
            log.exception("shard %d: checkpoint failed; training goes on", self.config.shard_index)

    def _write(self, arrays: dict, meta: dict) -> str:
        # Serialized, and never behind: a capture overtaken by a newer write is dropped, so the
        # manifest only moves forward.
        with self.write_lock:
            if meta["version"] < self.written_version:
                return self.last_checkpoint
            path = str(checkpoint.save(self._checkpoint_dir(), arrays, meta, keep=self.config.checkpoint_keep))
            self.written_version = meta["version"]
            with self.cond:
                self.last_checkpoint = path
            return path

    def _capture(self) -> tuple[dict, dict]:
        """Copies of everything a checkpoint holds, taken atomically (call under the lock)."""
        arrays = {"weights": self.arrays.download(self.weights)}     # a copy (from the GPU on a device shard)
        for key, value in self.optimizer.state_dict().items():     # state_dict returns copies
            arrays[f"opt.{key}"] = np.asarray(value)
        # Gradients held for open sync rounds: their pushers' clocks have moved past them.
        for round_, grads in self.round_grads.items():
            for worker, grad in grads.items():
                arrays[f"round.{round_}.{worker}"] = self.arrays.download(grad)
        meta = {
            "version": self.version, "spec": self.spec.to_json(), "begin": self.begin, "end": self.end,
            "shard_index": self.config.shard_index, "num_shards": self.config.num_shards,
            "mode": self.config.mode, "clocks": {str(w): c for w, c in self.policy.clocks.items()},
            "closed_rounds": self.policy.closed_rounds, "next_id": self.leases.next_id,
            "hosts": {str(w): m.host for w, m in self.leases.members.items()},
            "departed": {str(w): c for w, c in self.policy.departed.items()},
            # A restarted process starts its counters afresh: the job's losses so far go on with it.
            "lost_updates": self.counters.lost_updates,
        }
        self.updates_since_checkpoint = 0
        self.last_checkpoint_time = self.now()
        return arrays, meta

    def _checkpoint_dir(self) -> str:
        return str(checkpoint.shard_dir(self.config.checkpoint_dir, self.config.shard_index, self.config.num_shards))

    def begin_restore(self) -> None:
        """Refuse every call as UNAVAILABLE (reason ``restoring``) until :meth:`restore` has run."""
        with self.cond:
            self.restoring = True

    def restore(self) -> bool:
        """Load the latest complete checkpoint, if any; members get a fresh lease to come back."""
        try:
            return self._restore()
        finally:
            with self.cond:
                self.restoring = False
                self.cond.notify_all()

    def _restore(self) -> bool:
        found = checkpoint.load_latest(self._checkpoint_dir())   # read outside the lock: calls meanwhile are refused
        if found is None:
            return False
        with self.cond:
            arrays, meta = found
            spec = ModelSpec.from_json(meta["spec"])
            opt_state = {k[4:]: (v if v.ndim else v.item()) for k, v in arrays.items() if k.startswith("opt.")}
            self._take_on(spec, meta["begin"], meta["end"], arrays["weights"], meta["version"], opt_state)
            for key, value in arrays.items():
                if key.startswith("round."):
                    _, round_, worker = key.split(".")
                    held = self.pool.take()       # the round gives it back to the pool when it closes
                    self.arrays.upload(held, np.ascontiguousarray(value, np.float32))
                    self.round_grads.setdefault(int(round_), {})[int(worker)] = held
                    self.policy.round_pushers.setdefault(int(round_), set()).add(int(worker))
            self.version = meta["version"]
            self.policy.closed_rounds = meta["closed_rounds"]
            self.leases.next_id = meta["next_id"]
            now = self.now()
            self.policy.departed = {int(w): c for w, c in meta.get("departed", {}).items()}
            self.counters.lost_updates = meta.get("lost_updates", 0)
            for w, c in meta["clocks"].items():
                self.policy.clocks[int(w)] = c
                self.leases.add(int(w), meta["hosts"].get(w, ""), now)
            self.restored_clocks = dict(self.policy.clocks)
            self.last_checkpoint = str(Path(self._checkpoint_dir()) / checkpoint.MANIFEST)
            self.restored_version = self.written_version = self.version
            clocks = sorted(self.policy.clocks.values())
            log.warning("shard %d restored its checkpoint at version %d (%s; worker clocks %s)",
                        self.config.shard_index, self.version,
                        f"{self.policy.closed_rounds} rounds closed" if self.policy.accumulates else self.config.mode,
                        f"{clocks[0]}..{clocks[-1]}" if clocks else "none")
            return True
