"""Job files written back: ``job.toml``, which every child of a job reads and which records what ran.

TOML's standard library reads but does not write; a job holds scalars and flat lists only, so this
is all the writer it needs.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any


def dump_toml(tables: Mapping[str, Mapping[str, Any]]) -> str:
    """Write ``{table: {key: value}}`` as TOML (scalars and flat lists only, which is all a job has)."""
    lines: list[str] = []
    for table, values in tables.items():
        lines.append(f"[{table}]")
        for key, value in values.items():
            if value is not None:
                lines.append(f"{key} = {toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value, ensure_ascii=False)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")
