"""What a worker records: one JSON line per event (start, step, eval, done), and what a step moves.

Both the built-in trainer (worker/loop.py) and a script's session (worker/api.py) write these
records, so the launcher's progress bar and summary read them alike; kept apart from the trainer
so that ``psgrid.init`` loads none of its models and data sets.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from psgrid.psserver import files
from psgrid.psserver.protocol import ITEMSIZE


class MetricsWriter:
    """Appends one JSON object per line and flushes it, so a reader tailing the file sees whole lines."""

    def __init__(self, path: str | os.PathLike | None):
        self.file = None
        self.lock = threading.Lock()
        if path:
            files.make_dirs(Path(path).parent)
            self.file = files.open_new(path, "a", buffering=1)

    def write(self, **record) -> None:
        if self.file is None:
            return
        record.setdefault("time", time.time())
        line = json.dumps(record, default=float)
        with self.lock:
            self.file.write(line + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def bytes_per_step(exchange, params: int) -> int:
    """What one step sends and receives: the pull (float32) and the push, or the exchange's own figure."""
    if hasattr(exchange, "bytes_per_step"):
        return exchange.bytes_per_step(params)
    return params * (4 + ITEMSIZE[exchange.wire_dtype])
