"""Earlier ways of a shard's update, put back for A/Bs against today's, in this process and in the
shard processes a benchmark spawns.

* ``check="blas"``: until 2026-11-26 a plain-SGD update checked each block of the gradient for NaN
  and infinity, just before reading it, with a dot product with zeros (NaN exactly when an element
  is not finite). NumPy sends a dot product to BLAS, which runs it on a pool of threads of its own:
  one a core, in every shard process. Today's check (psserver/kernels/optim.py ``_checked``) takes
  the block's min and max with NumPy's own loops ("numpy").
* ``parts=1``: until then the update's threads each took one fixed chunk of the range; today they
  take parts of it in turn (psserver/kernels/parallel.py, ``PARTS_PER_THREAD`` a thread). The fixed
  split is put back here (``_one_chunk_a_thread``); other values set how many parts a thread takes.

A benchmark that spawns shard processes calls ``use(...)`` first and ``install_if_asked()`` at the
top of its module: a spawned process imports its parent's main module again, so the shards get it.
"""

from __future__ import annotations

import math
import os

import numpy as np

from psgrid.psserver.kernels import optim, parallel

ENV = "PSGRID_BENCH_SHARD_VARIANT"
CHECKS = ("numpy", "blas")  # today's, the one before
_NUMPY_CHECK = optim._checked
_PARTS = parallel.PARTS_PER_THREAD
_SPLIT = parallel.Chunks.split


def _one_chunk_a_thread(self, size: int) -> list[tuple[int, int]]:
    """The split before parts were taken in turn: one fixed chunk a thread."""
    if self.threads == 1 or size < 2 * parallel.MIN_CHUNK:
        return [(0, size)]
    count = min(self.threads, size // parallel.MIN_CHUNK)
    return [(size * i // count, size * (i + 1) // count) for i in range(count)]


def _dot_checked(blocks, grad: np.ndarray):
    zeros = np.zeros(optim.BLOCK, np.float32)
    with np.errstate(invalid="ignore"):
        for block in blocks:
            part = grad[block[0]]
            if math.isnan(float(np.dot(part, zeros[: len(part)]))):
                raise optim.NON_FINITE()
            yield block


def _apply(check: str, parts: int) -> None:
    if check not in CHECKS:
        raise SystemExit(f"unknown check {check!r}; choose from {', '.join(CHECKS)}")
    optim._checked = _dot_checked if check == "blas" else _NUMPY_CHECK
    parallel.Chunks.split = _one_chunk_a_thread if parts == 1 else _SPLIT
    parallel.PARTS_PER_THREAD = parts


def use(check: str = "numpy", parts: int | None = None) -> None:
    """Make this process, and shard processes spawned from now on, update with ``check`` and ``parts``
    (None: today's parts a thread)."""
    parts = _PARTS if parts is None else parts
    _apply(check, parts)
    os.environ[ENV] = f"{check},{parts}"


def install_if_asked() -> None:
    if os.environ.get(ENV):
        check, parts = os.environ[ENV].split(",")
        _apply(check, int(parts))


def describe(check: str = "numpy", parts: int | None = None) -> str:
    """What a row's setting adds for a variant other than today's."""
    said = [f"the shards' {check} check for NaN (before)"] if check != "numpy" else []
    if parts is not None and parts != _PARTS:
        said.append(f"{parts} part(s) a thread")
    return "".join(f", {s}" for s in said)
