"""Stragglers for experiments: a worker made slower in a stated, recorded way.

Two kinds, written ``RANK:...``:

- ``K:F`` (F >= 1): worker K is F times slower than itself. After each step's compute it
  sleeps (F - 1) x that step's measured compute time, so the slowdown follows the worker's
  own speed on any hardware (3x stays 3x on a GPU).
- ``K:exp:MEAN_MS``: worker K sleeps a random time per step, exponentially distributed
  with mean MEAN_MS milliseconds (a noisy neighbour, a shared network); seeded by the job's
  seed and the rank, so a repeat sees the same delays.

Each step's injected delay is recorded in the worker's metrics (``delay_s``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Straggler:
    rank: int
    factor: float | None = None  # K:F
    mean_ms: float | None = None  # K:exp:MEAN_MS

    def __str__(self) -> str:
        if self.factor is not None:
            return f"{self.rank}:{self.factor:g}"
        return f"{self.rank}:exp:{self.mean_ms:g}"


def parse_straggler(text: str) -> Straggler:
    """``"3:3"`` -> 3x slower worker 3; ``"1:exp:20"`` -> worker 1 sleeps Exp(mean 20 ms) per step."""
    text = text.strip()
    if m := re.fullmatch(r"(\d+):([^:]+)", text):
        factor = _number(m.group(2), text)
        if not factor >= 1.0:
            raise ValueError(f"{text!r}: the slowdown factor F in K:F must be >= 1 (1 is no slowdown)")
        return Straggler(int(m.group(1)), factor=factor)
    if m := re.fullmatch(r"(\d+):exp:([^:]+)", text):
        mean = _number(m.group(2), text)
        if not mean > 0:
            raise ValueError(f"{text!r}: the mean delay in K:exp:MEAN_MS must be > 0 milliseconds")
        return Straggler(int(m.group(1)), mean_ms=mean)
    raise ValueError(
        f"{text!r} is not a straggler: write K:F (worker K F times slower, e.g. 3:3) "
        f"or K:exp:MEAN_MS (a random delay per step, e.g. 1:exp:20)"
    )


def _number(s: str, text: str) -> float:
    try:
        value = float(s)
    except ValueError:
        raise ValueError(f"{text!r}: {s!r} is not a number") from None
    if not math.isfinite(value):
        raise ValueError(f"{text!r}: {s!r} is not a finite number")
    return value


def parse_stragglers(items: Iterable[str]) -> list[Straggler]:
    """Several specs; a rank named twice is refused."""
    stragglers = [parse_straggler(t) for t in items if t.strip()]
    ranks = [s.rank for s in stragglers]
    if len(set(ranks)) != len(ranks):
        raise ValueError(f"a worker is named twice in {', '.join(map(str, stragglers))}")
    return stragglers


class Delay:
    """The sleep one worker adds after each step's compute (none unless it is a straggler)."""

    def __init__(self, stragglers: Iterable[str], rank: int, seed: int):
        mine = [s for s in parse_stragglers(stragglers) if s.rank == rank]
        self.straggler = mine[0] if mine else None
        self._rng = np.random.default_rng([seed, rank, 0x57A6])

    def seconds(self, compute_s: float) -> float:
        """The delay for a step whose compute took ``compute_s``."""
        s = self.straggler
        if s is None:
            return 0.0
        if s.factor is not None:
            return (s.factor - 1.0) * compute_s
        return float(self._rng.exponential(s.mean_ms / 1000.0))
