"""What a launcher learns from the shards while a job trains, without blocking its own loop.

A thread reads every shard's membership every ``interval`` seconds (Admin.stats, as an
observer: it never joins, never waits) and runs the launcher's reports: a worker that died
before it joined is reported gone (Admin.report_gone), so the others stop waiting for it.
The launcher asks :meth:`absent_since` to find a worker the shards evicted while its process
lives on (hung with a live heartbeat): that one it stops.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

log = logging.getLogger("psgrid.launch")


class ShardWatch:
    """Polls the shards' members in a thread; ``make_admin()`` builds the Admin it uses."""

    def __init__(self, make_admin, interval: float = 1.0):
        self.make_admin = make_admin
        self.interval = interval
        self.lock = threading.Lock()
        self.members: set[int] | None = None  # live on at least one shard, at the last poll
        self.seen: dict[int, float] = {}  # worker -> last time a shard counted it a member
        self.stalled_evictions = 0
        self.last_stats: list[dict] = []  # every shard's counters at the last poll
        self.reports: queue.Queue = queue.Queue()
        self.stop_event = threading.Event()
        self.thread = threading.Thread(target=self._run, name="psctl-shard-watch", daemon=True)

    def start(self) -> ShardWatch:
        self.thread.start()
        return self

    def report_gone(self, rank: int) -> None:
        """Tell the shards (from the watch thread) that worker ``rank`` will not join."""
        self.reports.put(rank)

    def absent_since(self, rank: int, started: float) -> float | None:
        """How long the shards have not counted ``rank`` a member (None: counted now, or not known yet)."""
        with self.lock:
            if self.members is None or rank in self.members:
                return None
            return time.monotonic() - max(self.seen.get(rank, started), started)

    def close(self) -> None:
        self.stop_event.set()
        self.thread.join(timeout=15)

    def _run(self) -> None:
        admin = None
        try:
            admin = self.make_admin()
            while not self.stop_event.is_set():
                self._send_reports(admin)
                self._poll(admin)
                self.stop_event.wait(self.interval)
        except Exception:  # noqa: BLE001 - watching is best effort; the job goes on without it
            log.exception("watching the shards failed")
        finally:
            if admin is not None:
                admin.close()

    def _send_reports(self, admin) -> None:
        while True:
            try:
                rank = self.reports.get_nowait()
            except queue.Empty:
                return
            try:
                admin.report_gone(rank)
            except Exception as exc:  # noqa: BLE001
                log.warning("could not report worker %d gone to the shards: %s", rank, exc)

    def _poll(self, admin) -> None:
        try:
            stats = admin.stats()
        except Exception:  # noqa: BLE001 - a shard restarting: try again at the next poll
            return
        now = time.monotonic()
        members = {m["worker_id"] for s in stats for m in s["members"]}
        with self.lock:
            self.members = members
            for worker in members:
                self.seen[worker] = now
            self.stalled_evictions = sum(s.get("stalled_evictions", 0) for s in stats)
            self.last_stats = stats
