"""Finding and reading a job file: a path, or the name of a packaged example; UTF-8 TOML, or one line saying why not."""

from __future__ import annotations

import stat
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from psgrid.cluster.errors import ConfigError

# The job files of examples/ (psgrid/examples in the wheel, the repository's examples/ in a checkout).
EXAMPLES_DIR = Path(__file__).resolve().parents[2] / "examples"


def resolve_config_path(spec: str | Path) -> Path:
    """A job file path, or the name of a packaged example (``mnist`` -> ``examples/mnist.toml``)."""
    path = Path(spec)
    if path.is_file():
        return path
    name = path.name[:-5] if path.name.endswith(".toml") else path.name
    packaged = EXAMPLES_DIR / f"{name}.toml"
    if path.parent == Path(".") or path.parent.name == "examples":
        if packaged.is_file():
            return packaged
    what = _not_a_file(path)
    if what:
        raise ConfigError(
            f"job file {str(spec)!r} is {what}, not a file; give a path to a .toml file or one of the "
            f"packaged examples: {', '.join(example_names())}"
        )
    raise ConfigError(
        f"job file {str(spec)!r} not found; give a path to a .toml file or one of the "
        f"packaged examples: {', '.join(example_names())}"
    )


def _not_a_file(path: Path) -> str | None:
    """What ``path`` is where it exists but is no regular file (``a directory``, ``a character device``), else None."""
    try:
        mode = path.stat().st_mode
    except (OSError, ValueError):
        return None
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((words for test, words in kinds if test(mode)), None)


def example_names() -> list[str]:
    return sorted(p.stem for p in EXAMPLES_DIR.glob("*.toml"))


def read_job_file(spec: str | Path) -> tuple[Path, dict]:
    path = resolve_config_path(spec)
    try:
        return path, tomllib.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        line = e.object[: e.start].count(b"\n") + 1
        raise ConfigError(
            f"{path}: not UTF-8 (byte 0x{e.object[e.start]:02x} on line {line}): a job file must be "
            f"UTF-8 TOML; save it as UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read: {e.strerror}") from None
