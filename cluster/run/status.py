"""``psctl status``: every shard's clocks, members and counters, as a table or JSON.

The default table fits an 80-column terminal (a long address is shortened in the middle);
``wide`` shows every counter. A finished job's folder holds ``summary.json`` with its shards'
final counters, which is read instead of shards that are gone.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from psgrid.cluster.errors import UsageError
from psgrid.psserver.protocol import parse_address_file

WIDTH = 80
# The default columns: what a person watching a job looks at first; the rest are in --wide and --json.
# (The mode, the same on every shard, heads the table instead of taking a column.)
NARROW = ("shard", "address", "version", "members", "clocks", "applied", "late", "stale")
COLUMNS = [  # (header, stats key, format)
    ("shard", "shard_index", "{}"),
    ("address", "address", "{}"),
    ("mode", "mode", "{}"),
    ("version", "version", "{}"),
    ("members", "n_members", "{}"),
    ("clocks", "clocks", "{}"),
    ("pushes", "pushes", "{}"),
    ("pulls", "pulls", "{}"),
    ("applied", "applied_updates", "{}"),
    ("late", "dropped_late", "{}"),
    ("dups", "duplicates", "{}"),
    ("evicted", "evictions", "{}"),
    ("rejected", "rejected", "{}"),
    ("stale", "staleness", "{}"),
    ("wait s", "wait_s_total", "{:.1f}"),
    ("MB in/out", "mb", "{}"),
]


def addresses_from_dir(path: str | Path) -> list[str]:
    """Shard addresses published by ``psctl launch`` in ``OUT/addr/shard-I`` (give OUT or OUT/addr)."""
    path = Path(path)
    if (path / "addr").is_dir():
        path = path / "addr"
    files = sorted(
        path.glob("shard-*"), key=lambda p: int(p.name.split("-")[1]) if p.name.split("-")[1].isdigit() else 0
    )
    if not files:
        raise UsageError(f"no shard-I address files in {path}")
    return [parse_address_file(f.read_text())[0] for f in files]


def fetch(addresses: list[str], timeout_s: float = 5.0, **security) -> list[dict]:
    """Every shard's stats, with its address added; ``security`` is token / tls_ca / tls_cert / tls_key."""
    from psgrid.psserver.client.admin import Admin

    with Admin(addresses, deadline_s=timeout_s, retry_s=timeout_s, **security) as admin:
        return admin.stats()


def _row(s: dict) -> dict[str, Any]:
    row = dict(s)
    members = s.get("members", [])
    row["n_members"] = members if isinstance(members, int) else len(members)  # summary.json keeps the count
    row["clocks"] = f"{s.get('min_clock', '-')}/{s.get('max_clock', '-')}"
    mean, mx = s.get("mean_staleness"), s.get("max_staleness")
    row["staleness"] = f"{mean:.2f}/{mx}" if isinstance(mean, (int, float)) else f"-/{mx}"
    row["mb"] = f"{s.get('bytes_in', 0) / 1e6:.1f}/{s.get('bytes_out', 0) / 1e6:.1f}"
    return row


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def format_table(stats: list[dict], wide: bool = False) -> str:
    """The shards table, then one members table (worker, clock, idle, host) per shard that lists them.

    Without ``wide`` only the :data:`NARROW` columns, and the address shortened to fit :data:`WIDTH`.
    """
    columns = COLUMNS if wide else [c for c in COLUMNS if c[0] in NARROW]
    rows = []
    for s in stats:
        r = _row(s)
        cells = []
        for _, key, fmt in columns:
            v = r.get(key)
            cells.append("-" if v is None else (fmt.format(v) if not isinstance(v, str) else v))
        rows.append(cells)
    headers = [h for h, _, _ in columns]
    parts = [_table(headers, rows)]
    if not wide:
        parts = [_title(stats), _table(headers, _fit(headers, rows, headers.index("address")))]
    for s in stats:
        members = s.get("members", [])
        if isinstance(members, int):
            continue
        parts.append(f"\nshard {s.get('shard_index')} members ({len(members)}):")
        if members:
            parts.append(
                _table(
                    ["worker", "clock", "idle s", "host"],
                    [
                        [
                            str(m.get("worker_id")),
                            str(m.get("clock")),
                            f"{m.get('idle_s', 0):.1f}",
                            str(m.get("host", "")),
                        ]
                        for m in members
                    ],
                )
            )
        else:
            parts.append("  (none)")
    return "\n".join(parts)


def _title(stats: list[dict]) -> str:
    modes = sorted({str(s.get("mode")) for s in stats})
    return (
        f"{len(stats)} shard{'s' if len(stats) != 1 else ''}, mode {'/'.join(modes)}; clocks min/max, stale "
        f"mean/max (--wide: every counter)"
    )


def _fit(headers: list[str], rows: list[list[str]], column: int) -> list[list[str]]:
    """Shorten the cells of ``column`` in the middle until the table is :data:`WIDTH` wide (or they are short)."""
    if not rows:
        return rows
    over = max(len(line) for line in _table(headers, rows).splitlines()) - WIDTH
    if over <= 0:
        return rows
    keep = max(len(headers[column]), max(len(r[column]) for r in rows) - over, 9)
    return [[_elide(c, keep) if i == column else c for i, c in enumerate(r)] for r in rows]


def _elide(text: str, keep: int) -> str:
    if len(text) <= keep:
        return text
    tail = keep // 2
    return text[: keep - tail - 1] + "~" + text[-tail:]


def status(
    addresses: list[str], *, as_json: bool = False, timeout_s: float = 5.0, wide: bool = False, **security
) -> str:
    stats = fetch(addresses, timeout_s=timeout_s, **security)
    return json.dumps(stats, indent=2, default=str) if as_json else format_table(stats, wide=wide)


def finished_job(path: str | Path) -> dict | None:
    """The ``summary.json`` of a finished job in ``path`` (OUT or OUT/addr), or None while it runs."""
    path = Path(path)
    folder = path.parent if path.name == "addr" else path
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and isinstance(summary.get("shard_stats"), list) else None


def summary_status(summary: dict, *, as_json: bool = False, wide: bool = False) -> str:
    """What ``psctl status`` shows of a finished job: its end, then its shards' final counters."""
    stats = summary["shard_stats"]
    if as_json:
        return json.dumps(stats, indent=2, default=str)
    acc = summary.get("test_accuracy")
    ended = "finished" if summary.get("status") == "ok" else "ended"
    head = (
        f"{summary.get('name')} {ended}: status {summary.get('status')}, {summary.get('steps')} steps, "
        f"test accuracy {acc:.4f}"
        if isinstance(acc, (int, float))
        else f"{summary.get('name')} {ended}: status {summary.get('status')}, {summary.get('steps')} steps"
    )
    when = "" if ended == "finished" else "; counters as last seen while it ran"
    if not stats:
        return f"{head}\n(from its summary.json: the shards have stopped, before any counters were read)"
    return f"{head}\n(from its summary.json: the shards have stopped{when})\n" + format_table(stats, wide=wide)


def newest_run(runs: Path = Path("runs")) -> Path:
    """The folder of the newest job under ``runs/`` (psctl launch's and psctl mpi's default output folders).

    Raises
    ------
    UsageError
        There is none here.
    """
    found = (
        [p for p in runs.glob("*") if (p / "addr").is_dir() or (p / "summary.json").is_file()] if runs.is_dir() else []
    )
    if not found:
        raise UsageError(
            f"no job folder in {runs}/ here: give --address-dir DIR (a job's --out) or --addresses HOST:PORT,..."
        )
    return max(found, key=lambda p: p.stat().st_mtime)
