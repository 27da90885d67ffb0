"""``psctl launch --resume DIR``: continue a stopped job from its shards' checkpoints.

Before any process starts, the launcher reads every shard's latest checkpoint (its manifest
and metadata, not its arrays) and checks that they belong together: the same model, mode
and shard count, and either every shard has one or none has (a job stopped before its
shards had weights starts from the beginning). Shards that checkpointed at different
moments (a Ctrl-C lands between their final checkpoints) need nothing more: each worker
starts at the earliest clock any shard has for it, and a shard that is ahead answers the
pushes it already has as duplicates (psserver/client.py, ``join``).

The earlier attempt's files move to ``DIR/attempts/N/`` so the new summary and metrics
describe this attempt alone.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from psgrid.cluster.config import JobConfig
from psgrid.cluster.errors import UsageError
from psgrid.psserver import checkpoint
from psgrid.psserver import files

ATTEMPT_FILES = ("summary.json", "metrics.jsonl", "metrics", "logs", "addr")


@dataclass(frozen=True)
class ShardCheckpoint:
    """What one shard's latest checkpoint holds, read from its metadata."""

    shard: int
    version: int
    mode: str
    spec: str
    clocks: dict[int, int]
    closed_rounds: int

    def where(self) -> str:
        clocks = sorted(self.clocks.values())
        at = f"round {self.closed_rounds}" if self.mode == "sync" else (
            f"worker clocks {clocks[0]}..{clocks[-1]}" if clocks else "no workers")
        return f"shard {self.shard} at version {self.version} ({at})"


def read_checkpoints(job: JobConfig) -> list[ShardCheckpoint | None]:
    """Each shard's latest checkpoint, or None where a shard has none."""
    root = Path(job.server.checkpoint_dir)
    found: list[ShardCheckpoint | None] = []
    for i in range(job.shards):
        directory = checkpoint.shard_dir(root, i, job.shards)
        manifest = checkpoint.read_manifest(directory)
        if manifest is None:
            found.append(None)
            continue
        meta = checkpoint.load_meta(directory / manifest["file"])
        found.append(ShardCheckpoint(shard=i, version=meta["version"], mode=meta["mode"], spec=meta["spec"],
                                     clocks={int(w): c for w, c in meta["clocks"].items()},
                                     closed_rounds=meta["closed_rounds"]))
    return found


def check_resumable(job: JobConfig, out: Path) -> list[ShardCheckpoint]:
    """The shards' checkpoints, once they are known to belong together; raises UsageError naming what does not."""
    if not job.server.checkpoint_dir:
        raise UsageError(f"{out} cannot be resumed: its job ran without checkpoints. Set [server] checkpoint_dir "
                         f"(and checkpoint_every or checkpoint_every_s) to make a job resumable")
    root = Path(job.server.checkpoint_dir)
    others = sorted(p.name for p in root.glob("shard-*-of-*") if not p.name.endswith(f"-of-{job.shards}"))
    if others and not any(checkpoint.shard_dir(root, i, job.shards).exists() for i in range(job.shards)):
        raise UsageError(f"the checkpoints in {root} are for another number of shards ({', '.join(others)}); "
                         f"resume with the shard count they were written by")
    found = read_checkpoints(job)
    present = [c for c in found if c is not None]
    if not present:
        return []
    missing = [i for i, c in enumerate(found) if c is None]
    if missing:
        raise UsageError(f"cannot resume: shard(s) {missing} have no checkpoint in {root} while "
                         f"{'; '.join(c.where() for c in present)}. The shards would not hold one model")
    if len({c.spec for c in present}) > 1:
        raise UsageError(f"cannot resume: the shards' checkpoints in {root} hold different models")
    wrong_mode = [c for c in present if c.mode != job.server.mode]
    if wrong_mode:
        raise UsageError(f"cannot resume: the checkpoints were written in mode {wrong_mode[0].mode!r}, the job "
                         f"says {job.server.mode!r}; resume in the mode it ran in")
    return present


def describe(found: list[ShardCheckpoint]) -> str:
    """One line for the terminal: where each shard resumes, and how differing moments are reconciled."""
    if not found:
        return "no shard had written a checkpoint yet: the job starts from the beginning"
    text = "resuming from checkpoints: " + "; ".join(c.where() for c in found)
    starts = {w: min(c.clocks.get(w, 0) for c in found) for c in found for w in c.clocks}
    if any(c.clocks.get(w) != start for c in found for w, start in starts.items()):
        text += (". The shards checkpointed at different moments: each worker resumes at the earliest clock "
                 "a shard has for it, and shards that are ahead take those steps as duplicates")
    return text


def archive_attempt(out: Path) -> Path | None:
    """Move the files of the previous attempt in ``out`` to ``out/attempts/N``; returns that folder."""
    present = [name for name in ATTEMPT_FILES if (out / name).exists()]
    if not present:
        return None
    attempts = out / "attempts"
    n = 1 + max((int(p.name) for p in attempts.glob("*") if p.name.isdigit()), default=0)
    target = attempts / str(n)
    files.make_dirs(target)
    for name in present:
        shutil.move(str(out / name), str(target / name))
    return target
