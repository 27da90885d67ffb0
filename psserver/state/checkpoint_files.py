"""Checkpoint files on disk, written atomically: a temp file, fsync, rename, the manifest last.

When a shard takes one and what it holds is shard_checkpoints.py's; this module is the files alone.

A reader trusts only the manifest: a crash at any point leaves either the old
checkpoint or the new one complete, never a torn file that looks valid. What a crash
can leave behind is a temporary file (``.tmp-*``); :func:`remove_leftovers` deletes
them when a shard starts, and a write that fails deletes its own.

A shard keeps its newest ``keep`` checkpoints; :func:`rewind` makes an older one of them the
latest again (``psctl launch --resume`` brings the shards of a sync job that are ahead back
to the round of the slowest).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np

from psgrid.psserver import files

MANIFEST = "latest.json"
DEFAULT_KEEP = 3
TMP_PREFIX = ".tmp-"

log = logging.getLogger("psgrid.checkpoint")


def shard_dir(root: str | Path, shard_index: int, num_shards: int) -> Path:
    """Where shard ``shard_index`` of ``num_shards`` keeps its checkpoints under a job's ``checkpoint_dir``."""
    return Path(root) / f"shard-{shard_index}-of-{num_shards}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory: str | Path, arrays: dict[str, np.ndarray], meta: dict, keep: int = DEFAULT_KEEP) -> Path:
    """Write one checkpoint, point the manifest at it and keep the newest ``keep``; returns its path."""
    directory = files.make_dirs(directory)
    name = file_name(meta["version"])
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=TMP_PREFIX, suffix=".npz")
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays, __meta__=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / name)
        _write_manifest(directory, name, meta["version"])
    except BaseException:
        # A full disk or a crash in the middle must not leave its half-written file forever.
        Path(tmp).unlink(missing_ok=True)
        raise
    _fsync_dir(directory)
    _prune(directory, keep_name=name, keep=keep)
    return directory / name


def file_name(version: int) -> str:
    return f"ckpt-{version:012d}.npz"


def _version_of(path: Path) -> int:
    return int(path.name[len("ckpt-") : -len(".npz")])


def _checkpoint_files(directory: Path) -> list[Path]:
    """This folder's checkpoint files (named by :func:`file_name`), oldest first."""
    found = [p for p in directory.glob("ckpt-*.npz") if p.name[len("ckpt-") : -len(".npz")].isdigit()]
    return sorted(found, key=_version_of)


def _write_manifest(directory: Path, name: str, version: int) -> None:
    manifest_tmp = directory / (MANIFEST + ".tmp")
    try:
        manifest_tmp.unlink(missing_ok=True)  # one left by a crash keeps its mode
        with files.open_new(manifest_tmp, "w") as f:
            json.dump({"file": name, "version": version}, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(manifest_tmp, directory / MANIFEST)
    except BaseException:
        manifest_tmp.unlink(missing_ok=True)
        raise


def _prune(directory: Path, keep_name: str, keep: int) -> None:
    old = sorted(p for p in directory.glob("ckpt-*.npz") if p.name != keep_name)
    for path in old[: max(0, len(old) - (max(1, keep) - 1))]:
        path.unlink(missing_ok=True)


def remove_leftovers(directory: str | Path) -> list[str]:
    """Delete temporary files a crashed write left behind; returns their names."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for path in [*directory.glob(TMP_PREFIX + "*"), directory / (MANIFEST + ".tmp")]:
        if path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path.name)
    if removed:
        log.info("removed %d leftover temporary checkpoint file(s) in %s", len(removed), directory)
    return removed


def read_manifest(directory: str | Path) -> dict | None:
    """The manifest ``{"file", "version"}``, or None when there is no complete checkpoint."""
    manifest = Path(directory) / MANIFEST
    if not manifest.exists():
        return None
    return json.loads(manifest.read_text())


def load(path: str | Path) -> tuple[dict[str, np.ndarray], dict]:
    """One checkpoint file as (arrays, meta)."""
    with np.load(path) as data:
        arrays = {k: data[k].copy() for k in data.files if k != "__meta__"}
        meta = json.loads(bytes(data["__meta__"]).decode())
    return arrays, meta


def load_meta(path: str | Path) -> dict:
    """Only the metadata of one checkpoint file (the arrays stay on disk)."""
    with np.load(path) as data:
        return json.loads(bytes(data["__meta__"]).decode())


def load_latest(directory: str | Path) -> tuple[dict[str, np.ndarray], dict] | None:
    """The latest complete checkpoint as (arrays, meta), or None when there is none."""
    manifest = read_manifest(directory)
    if manifest is None:
        return None
    return load(Path(directory) / manifest["file"])


def kept(directory: str | Path) -> list[Path]:
    """The checkpoint files a restore may use, newest first: the manifest's and the older ones kept.

    A file newer than the manifest's is none of them: a crash came between it and the manifest,
    or :func:`rewind` went back past it.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest is None:
        return []
    return [p for p in reversed(_checkpoint_files(directory)) if _version_of(p) <= manifest["version"]]


def rewind(directory: str | Path, version: int, aside: str | Path) -> list[Path]:
    """Make the kept checkpoint of ``version`` the latest; newer ones move to ``aside``. Returns their new paths.

    The manifest moves first, so a crash in between leaves the rewound state with newer files
    beside it, which :func:`kept` ignores (and a later rewind moves).
    """
    directory, aside = Path(directory), Path(aside)
    name = file_name(version)
    if not (directory / name).is_file():
        raise FileNotFoundError(f"{directory} keeps no checkpoint of version {version}")
    _write_manifest(directory, name, version)
    _fsync_dir(directory)
    moved = []
    for path in _checkpoint_files(directory):
        if _version_of(path) > version:
            files.make_dirs(aside)
            moved.append(Path(shutil.move(str(path), str(aside / path.name))))
    return moved
