"""Write README.md's tables of job-file keys from the settings' schema (run from anywhere).

Usage: python scripts/gen_settings_tables.py [--check]

Each of the [job], [server] and [train] tables sits between a marker line naming it and an end
marker; everything between them is replaced by one row per key of the schema (psserver/settings.py:
name, default, meaning and bounds), in the order the settings class declares them. With --check
nothing is written and the exit status is 1 when README.md differs from what would be written
(tests/test_settings.py checks the same, so the tables cannot drift from the code).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

BEGIN = "<!-- settings table: {section} (scripts/gen_settings_tables.py writes it: edit the schema, not here) -->"
END = "<!-- end of settings table -->"


def rows(section: str) -> list[str]:
    """The markdown table of one job-file table's keys: header, rule and one row per key."""
    from psgrid.cluster.job.config import SERVER_PER_PROCESS, JobConfig
    from psgrid.psserver.config import ServerConfig
    from psgrid.psserver.settings import keys, meaning, shown_default
    from psgrid.worker.config import TrainConfig

    cls = {"job": JobConfig, "server": ServerConfig, "train": TrainConfig}[section]
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for key in keys(cls):
        if section == "server" and key.name in SERVER_PER_PROCESS:
            continue  # flags of psctl server only: a job file cannot set them
        cells = (f"`{key.name}`", shown_default(key), meaning(key))
        lines.append("| " + " | ".join(cell.replace("|", r"\|") for cell in cells) + " |")
    return lines


def updated(text: str) -> str:
    """``text`` (README.md's) with every settings table written anew; a missing marker is an error."""
    for section in ("job", "server", "train"):
        begin = BEGIN.format(section=section)
        found = re.search(re.escape(begin) + r"\n(.*?)" + re.escape(END), text, re.S)
        if not found:
            raise SystemExit(f"README.md lacks the lines {begin!r} ... {END!r} around the [{section}] table")
        table = "\n".join(rows(section)) + "\n"
        text = text[: found.start(1)] + table + text[found.end(1) :]
    return text


def main(argv: list[str]) -> int:
    text = README.read_text()
    new = updated(text)
    if "--check" in argv:
        if new != text:
            print(
                "README.md's settings tables differ from the schema: run python scripts/gen_settings_tables.py",
                file=sys.stderr,
            )
            return 1
        return 0
    if new != text:
        README.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
