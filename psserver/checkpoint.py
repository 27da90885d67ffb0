"""Atomic shard checkpoints: write to a temp file, fsync, rename, manifest last.

A reader trusts only the manifest: a crash at any point leaves either the old
checkpoint or the new one complete, never a torn file that looks valid.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np

MANIFEST = "latest.json"
KEEP = 2


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save(directory: str | Path, arrays: dict[str, np.ndarray], meta: dict) -> Path:
    """Write one checkpoint and point the manifest at it; returns the checkpoint's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    name = f"ckpt-{meta['version']:012d}.npz"
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-", suffix=".npz")
    with os.fdopen(fd, "wb") as f:
        np.savez(f, **arrays, __meta__=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / name)
    manifest_tmp = directory / (MANIFEST + ".tmp")
    with open(manifest_tmp, "w") as f:
        json.dump({"file": name, "version": meta["version"]}, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(manifest_tmp, directory / MANIFEST)
    _fsync_dir(directory)
    _prune(directory, keep_name=name)
    return directory / name


def _prune(directory: Path, keep_name: str) -> None:
    old = sorted(p for p in directory.glob("ckpt-*.npz") if p.name != keep_name)
    for path in old[: max(0, len(old) - (KEEP - 1))]:
        path.unlink(missing_ok=True)


def load_latest(directory: str | Path) -> tuple[dict[str, np.ndarray], dict] | None:
    """The latest complete checkpoint as (arrays, meta), or None when there is none."""
    directory = Path(directory)
    manifest = directory / MANIFEST
    if not manifest.exists():
        return None
    name = json.loads(manifest.read_text())["file"]
    with np.load(directory / name) as data:
        arrays = {k: data[k].copy() for k in data.files if k != "__meta__"}
        meta = json.loads(bytes(data["__meta__"]).decode())
    return arrays, meta
