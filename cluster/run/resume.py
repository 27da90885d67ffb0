"""``psctl launch --resume DIR``: continue a stopped job from its shards' checkpoints.

Before any process starts, the launcher reads every shard's latest checkpoint (its manifest
and metadata, not its arrays) and checks that they belong together: the same model, mode
and shard count, and either every shard has one or none has (a job stopped before its
shards had weights starts from the beginning).

Shards checkpoint at different moments (a Ctrl-C lands between their final checkpoints,
a shard could not write its last one). In sync the weights of one round belong together,
so the shards that are ahead go back to the round where the slowest stopped, from the older
checkpoints they keep (:func:`align`; a shard keeps ``checkpoint_keep``): their newer
checkpoints move aside, into the earlier attempt's folder. Where one of them did not keep
that round, each shard resumes at its latest and the launcher says why in one line. In
async and ssp, and in that case, each worker starts at the earliest clock any shard has for
it, and a shard that is ahead answers the pushes it already has as duplicates
(psserver/client/client.py, ``join`` and ``push``).

The earlier attempt's files move to ``DIR/attempts/N/`` so the new summary and metrics
describe this attempt alone; a copy of its ``job.toml`` goes with them. The job is read from
``DIR/job.toml``, which is written whole (cluster/job/records.py); one found damaged all the
same (empty, cut short, not TOML: by a psgrid that rewrote it in place, or by a disk) is
taken from the latest attempt's copy instead (:func:`job_file_to_resume`).
"""

from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from psgrid.cluster.errors import UsageError
from psgrid.cluster.job.config import JobConfig, apply_overrides, load_job, tomllib
from psgrid.cluster.job.outdir import LOCK_FILE
from psgrid.cluster.job.records import JOB_FILE, copy_job_file, signals_held
from psgrid.psserver import files
from psgrid.psserver.protocol import mode_rules
from psgrid.psserver.state import checkpoint_files as checkpoint

SUPERSEDED = "superseded-checkpoints"  # checkpoints newer than the round the shards resume at (sync)
ATTEMPT_FILES = ("summary.json", "metrics.jsonl", "metrics", "logs", "addr", SUPERSEDED)


@dataclass(frozen=True)
class ShardCheckpoint:
    """What one shard's latest checkpoint holds, read from its metadata."""

    shard: int
    version: int
    mode: str
    spec: str
    clocks: dict[int, int]
    closed_rounds: int
    file: str = ""  # its file in the shard's checkpoint folder
    departed: dict[int, int] = field(default_factory=dict)  # the clock each worker that left had

    def clock_of(self, worker: int) -> int:
        """Where ``worker`` was on this shard: live, or when it left (0: never seen)."""
        return self.clocks.get(worker, self.departed.get(worker, 0))

    def where(self) -> str:
        clocks = sorted(self.clocks.values())
        at = (
            f"round {self.closed_rounds}"
            if mode_rules(self.mode).accumulates
            else (f"worker clocks {clocks[0]}..{clocks[-1]}" if clocks else "no workers")
        )
        return f"shard {self.shard} at version {self.version} ({at})"


def _shard_dir(job: JobConfig, shard: int) -> Path:
    return checkpoint.shard_dir(job.server.checkpoint_dir, shard, job.shards)


def _read(shard: int, path: Path) -> ShardCheckpoint:
    meta = checkpoint.load_meta(path)
    return ShardCheckpoint(
        shard=shard,
        version=meta["version"],
        mode=meta["mode"],
        spec=meta["spec"],
        clocks={int(w): c for w, c in meta["clocks"].items()},
        closed_rounds=meta["closed_rounds"],
        file=path.name,
        departed={int(w): c for w, c in meta.get("departed", {}).items()},
    )


def read_checkpoints(job: JobConfig) -> list[ShardCheckpoint | None]:
    """Each shard's latest checkpoint, or None where a shard has none."""
    found: list[ShardCheckpoint | None] = []
    for i in range(job.shards):
        directory = _shard_dir(job, i)
        manifest = checkpoint.read_manifest(directory)
        found.append(None if manifest is None else _read(i, directory / manifest["file"]))
    return found


def kept_checkpoints(job: JobConfig, shard: int) -> list[ShardCheckpoint]:
    """Every checkpoint shard ``shard`` keeps that a restore may use, newest first."""
    return [_read(shard, path) for path in checkpoint.kept(_shard_dir(job, shard))]


@dataclass(frozen=True)
class Alignment:
    """What each shard restores, and how that was reconciled with where each had stopped."""

    restore: list[ShardCheckpoint]  # per shard, the checkpoint it restores
    latest: list[ShardCheckpoint]  # per shard, its latest checkpoint
    apart: str = ""  # sync shards left rounds apart: why they could not be brought together

    @property
    def rewound(self) -> list[ShardCheckpoint]:
        """The shards that go back to an older checkpoint than their latest."""
        return [r for r, latest in zip(self.restore, self.latest) if r.file != latest.file]


def align(job: JobConfig, found: list[ShardCheckpoint]) -> Alignment:
    """sync: the shards that are ahead go back to the round of the slowest, where they kept a checkpoint of it.

    A sync round's weights are one model only together with the same round of the other shards:
    a shard that resumed ahead would serve weights of a later round while the others replay the
    rounds in between (it would take them as duplicates). Going back costs no step: the workers
    make those rounds anyway. Going back further than the slowest shard would redo rounds the job
    has; then, and where no round is kept by all, each shard resumes at its latest and ``apart``
    says why.
    """
    if not mode_rules(job.server.mode).accumulates or len({c.closed_rounds for c in found}) <= 1:
        return Alignment(found, found)
    slowest = min(c.closed_rounds for c in found)
    # Per shard, its kept checkpoints by round (the newest of a round: one may hold pushes of the open round).
    by_round = [{k.closed_rounds: k for k in reversed(kept_checkpoints(job, c.shard))} for c in found]
    common = set.intersection(*(set(rounds) for rounds in by_round))
    if slowest in common:
        return Alignment([rounds[slowest] for rounds in by_round], found)
    lacking = [c.shard for c, rounds in zip(found, by_round) if slowest not in rounds]
    kept = "; ".join(f"shard {c.shard}: {', '.join(map(str, sorted(rounds)))}" for c, rounds in zip(found, by_round))
    why = f"shard(s) {lacking} keep no checkpoint of round {slowest} (rounds kept: {kept})" + (
        f", and going back to round {max(common)}, the latest all of them kept, would redo "
        f"{slowest - max(common)} round(s)"
        if common
        else ", and no round is kept by all of them"
    )
    return Alignment(found, found, why)


def rewind(job: JobConfig, alignment: Alignment, out: Path) -> None:
    """Make each shard's chosen checkpoint its latest; the newer ones move to ``out/superseded-checkpoints``."""
    for chosen in alignment.rewound:
        directory = _shard_dir(job, chosen.shard)
        checkpoint.rewind(directory, chosen.version, out / SUPERSEDED / directory.name)


def check_resumable(job: JobConfig, out: Path) -> list[ShardCheckpoint]:
    """The shards' checkpoints, once they are known to belong together; raises UsageError naming what does not."""
    if not job.server.checkpoint_dir:
        raise UsageError(
            f"{out} cannot be resumed: its job ran without checkpoints. Set [server] checkpoint_dir "
            f"(and checkpoint_every or checkpoint_every_s) to make a job resumable"
        )
    root = Path(job.server.checkpoint_dir)
    others = sorted(p.name for p in root.glob("shard-*-of-*") if not p.name.endswith(f"-of-{job.shards}"))
    if others and not any(checkpoint.shard_dir(root, i, job.shards).exists() for i in range(job.shards)):
        raise UsageError(
            f"the checkpoints in {root} are for another number of shards ({', '.join(others)}); "
            f"resume with the shard count they were written by"
        )
    found = read_checkpoints(job)
    present = [c for c in found if c is not None]
    if not present:
        return []
    missing = [i for i, c in enumerate(found) if c is None]
    if missing and all(c.version == 0 for c in present):
        # Stopped in its first moments: some shards had their initial weights (a final checkpoint at
        # version 0), the others not yet. Nothing was learned: the job starts from the beginning.
        return []
    if missing:
        raise UsageError(
            f"cannot resume: shard(s) {missing} have no checkpoint in {root} while "
            f"{'; '.join(c.where() for c in present)}. The shards would not hold one model"
        )
    if len({c.spec for c in present}) > 1:
        raise UsageError(f"cannot resume: the shards' checkpoints in {root} hold different models")
    wrong_mode = [c for c in present if c.mode != job.server.mode]
    if wrong_mode:
        raise UsageError(
            f"cannot resume: the checkpoints were written in mode {wrong_mode[0].mode!r}, the job "
            f"says {job.server.mode!r}; resume in the mode it ran in"
        )
    return present


def refuse_completed(job: JobConfig, restore: list[ShardCheckpoint]) -> None:
    """Refuse to resume a built-in job whose every worker is at its last step on every shard: nothing is left.

    Resumed, it started its shards, made no step, and put a summary of 0 steps in place of the real
    one. (A script's length is its own: a script job resumed runs its command again.)
    """
    if not restore or job.train.epochs:
        return
    steps = job.train.steps
    if all(c.clock_of(rank) >= steps for c in restore for rank in range(job.workers)):
        raise UsageError(
            f"--resume {job.out}: every worker is at the job's last step ({steps}) in the shards' checkpoints, "
            f"so nothing is left to train; to train on from them, give a larger total (--steps N)"
        )


def describe(alignment: Alignment) -> str:
    """One line for the terminal: where each shard resumes, and how differing moments are reconciled."""
    found = alignment.restore
    if not found:
        return "no shard had written a checkpoint yet: the job starts from the beginning"
    text = "resuming from checkpoints: " + "; ".join(c.where() for c in found)
    if alignment.rewound:
        stopped = ", ".join(f"shard {c.shard} at round {c.closed_rounds}" for c in alignment.latest)
        text += (
            f". The shards had stopped rounds apart ({stopped}): every shard resumes at round "
            f"{found[0].closed_rounds}, where the slowest stopped; the newer checkpoints of those ahead move "
            f"to {SUPERSEDED}/ in the earlier attempt's folder"
        )
    elif alignment.apart:
        rounds = [c.closed_rounds for c in found]
        text += (
            f". The shards stopped rounds apart and cannot resume at one round: {alignment.apart} (a larger "
            f"checkpoint_keep keeps more). Each resumes at its latest, the workers at round {min(rounds)}; "
            f"until round {max(rounds)} the shards that are ahead take the pushes as duplicates while the "
            f"others apply them, so those steps see weights of different rounds"
        )
    elif _apart(found):
        text += (
            ". The shards checkpointed at different moments: each worker resumes at the earliest clock "
            "a shard has for it, and shards that are ahead take those steps as duplicates"
        )
    return text


def _apart(found: list[ShardCheckpoint]) -> bool:
    starts = {w: min(c.clocks.get(w, 0) for c in found) for c in found for w in c.clocks}
    return any(c.clocks.get(w) != start for c in found for w, start in starts.items())


def archive_attempt(out: Path) -> Path | None:
    """Move the files of the previous attempt in ``out`` to ``out/attempts/N``, with a copy of its job; returns that folder.

    Ctrl-C and SIGTERM wait until it is done, so an attempt's files are not left split between two folders.
    """
    present = [name for name in ATTEMPT_FILES if (out / name).exists()]
    if not present:
        return None
    with signals_held():
        target = files.make_dirs(out / "attempts" / str(1 + max(_attempts(out), default=0)))
        for name in present:
            shutil.move(str(out / name), str(target / name))
        if _damage(out / JOB_FILE) is None:
            copy_job_file(out, target)
    return target


def _attempts(out: Path) -> list[int]:
    """The numbers of the attempts archived in ``out/attempts``."""
    return [int(p.name) for p in (out / "attempts").glob("*") if p.name.isdigit()]


def job_to_resume(job_file: Path) -> JobConfig:
    """The job in ``job_file`` as it ran: one recorded before ``synthetic_seed`` trained on its seed's task, and keeps it."""
    job = load_job(str(job_file), redacted_ok=True)  # its token is redacted there: the resumed job gets a new one
    recorded = tomllib.loads(job_file.read_text()).get("train", {})
    if job.train.dataset == "synthetic" and "synthetic_seed" not in recorded:
        job = apply_overrides(job, {"train.synthetic_seed": job.train.seed})
    return job


def job_file_to_resume(out: Path) -> Path:
    """The job file ``psctl launch --resume out`` runs: ``out/job.toml``, or if that is damaged the latest whole copy.

    Raises
    ------
    UsageError
        There is none to read, saying what to do.
    """
    path = out / JOB_FILE
    damage = _damage(path)
    if damage is None:
        return path
    for n in sorted(_attempts(out), reverse=True):
        copy = out / "attempts" / str(n) / JOB_FILE
        if _damage(copy) is None:
            print(
                f"psctl launch: {path} is {damage}: resuming the job as attempt {n} ran it, from {copy} "
                f"(this run writes {path} whole again)",
                file=sys.stderr,
                flush=True,
            )
            return copy
    if damage == "missing":
        began = (
            " (a launch stopped before it wrote its job has nothing to resume: launch it again with "
            f"--out {out} --overwrite)"
            if (out / LOCK_FILE).exists()
            else ""
        )
        raise UsageError(
            f"--resume {out}: no job.toml there; give the folder of an earlier psctl launch (its --out){began}"
        )
    raise UsageError(
        f"--resume {out}: {path} is {damage} and no earlier attempt in {out / 'attempts'} kept a "
        f"copy: put the job back in {path} (the job file it was launched with, its --set values "
        f"written in) and resume again"
    )


def _damage(path: Path) -> str | None:
    """What makes ``path`` no job file a resume can take (missing, empty, not TOML), or None when it is whole."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return "missing"
    except (OSError, UnicodeDecodeError) as e:
        return f"unreadable ({getattr(e, 'strerror', None) or e})"
    try:
        tables = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        return f"not valid TOML ({e})"
    return None if tables else f"empty ({len(text)} bytes, no table)"
