"""``psctl status``: every shard's clocks, members and counters, as a table or JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from psgrid.cluster.errors import UsageError
from psgrid.psserver.protocol import parse_address_file

COLUMNS = [  # (header, stats key, format)
    ("shard", "shard_index", "{}"),
    ("address", "address", "{}"),
    ("mode", "mode", "{}"),
    ("version", "version", "{}"),
    ("members", "n_members", "{}"),
    ("clock min/max", "clocks", "{}"),
    ("pushes", "pushes", "{}"),
    ("pulls", "pulls", "{}"),
    ("applied", "applied_updates", "{}"),
    ("dropped late", "dropped_late", "{}"),
    ("dups", "duplicates", "{}"),
    ("evicted", "evictions", "{}"),
    ("rejected", "rejected", "{}"),
    ("staleness mean/max", "staleness", "{}"),
    ("wait s", "wait_s_total", "{:.1f}"),
    ("MB in/out", "mb", "{}"),
]


def addresses_from_dir(path: str | Path) -> list[str]:
    """Shard addresses published by ``psctl launch`` in ``OUT/addr/shard-I`` (give OUT or OUT/addr)."""
    path = Path(path)
    if (path / "addr").is_dir():
        path = path / "addr"
    files = sorted(path.glob("shard-*"), key=lambda p: int(p.name.split("-")[1]) if p.name.split("-")[1].isdigit()
                   else 0)
    if not files:
        raise UsageError(f"no shard-I address files in {path}")
    return [parse_address_file(f.read_text())[0] for f in files]


def token_of_dir(path: str | Path) -> str | None:
    """The job's token that ``psctl launch`` keeps in ``OUT/token`` (readable by its owner only)."""
    from psgrid.cluster.credentials import read_token_file

    path = Path(path)
    return read_token_file(path.parent if path.name == "addr" else path)


def fetch(addresses: list[str], timeout_s: float = 5.0, **security) -> list[dict]:
    """Every shard's stats, with its address added; ``security`` is token / tls_ca / tls_cert / tls_key."""
    from psgrid.psserver.admin import Admin

    with Admin(addresses, deadline_s=timeout_s, retry_s=timeout_s, **security) as admin:
        return admin.stats()


def _row(s: dict) -> dict[str, Any]:
    row = dict(s)
    row["n_members"] = len(s.get("members", []))
    row["clocks"] = f"{s.get('min_clock', '-')}/{s.get('max_clock', '-')}"
    mean, mx = s.get("mean_staleness"), s.get("max_staleness")
    row["staleness"] = f"{mean:.2f}/{mx}" if isinstance(mean, (int, float)) else f"-/{mx}"
    row["mb"] = f"{s.get('bytes_in', 0) / 1e6:.1f}/{s.get('bytes_out', 0) / 1e6:.1f}"
    return row


def _table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def format_table(stats: list[dict]) -> str:
    """The shards table, then one members table (worker, clock, idle, host) per shard."""
    rows = []
    for s in stats:
        r = _row(s)
        cells = []
        for _, key, fmt in COLUMNS:
            v = r.get(key)
            cells.append("-" if v is None else (fmt.format(v) if not isinstance(v, str) else v))
        rows.append(cells)
    parts = [_table([h for h, _, _ in COLUMNS], rows)]
    for s in stats:
        members = s.get("members", [])
        parts.append(f"\nshard {s.get('shard_index')} members ({len(members)}):")
        if members:
            parts.append(_table(
                ["worker", "clock", "idle s", "host"],
                [[str(m.get("worker_id")), str(m.get("clock")), f"{m.get('idle_s', 0):.1f}", str(m.get("host", ""))]
                 for m in members]))
        else:
            parts.append("  (none)")
    return "\n".join(parts)


def status(addresses: list[str], *, as_json: bool = False, timeout_s: float = 5.0, **security) -> str:
    stats = fetch(addresses, timeout_s=timeout_s, **security)
    return json.dumps(stats, indent=2, default=str) if as_json else format_table(stats)
