"""Files and folders a job writes, each made with its mode said here rather than left to the umask.

Under ``umask 000`` Python's ``open(path, "w")`` makes a file anyone may write, and ``mkdir`` a
folder anyone may write into: a stranger could then rewrite an address file (workers send the
job's token to the server it names), a checkpoint or a summary. So everything a job writes is
made through these functions: folders :data:`DIR_MODE`, files :data:`FILE_MODE`, secrets
:data:`SECRET_MODE`. A stricter umask still applies (the modes are what a file may have at most).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import IO

DIR_MODE = 0o755
FILE_MODE = 0o644
SECRET_MODE = 0o600
_FLAGS = {"w": os.O_TRUNC, "a": os.O_APPEND, "x": os.O_EXCL}


def make_dirs(path: str | os.PathLike, mode: int = DIR_MODE) -> Path:
    """``mkdir -p path``, every folder it makes with ``mode`` (``Path.mkdir`` gives the parents the umask's).

    Returns ``path`` as a :class:`~pathlib.Path`; folders that exist are left as they are.
    """
    path = Path(path)
    missing = []
    folder = path
    while not folder.is_dir():
        missing.append(folder)
        if folder.parent == folder:
            break
        folder = folder.parent
    for folder in reversed(missing):
        try:
            folder.mkdir(mode=mode)
        except FileExistsError:  # made meanwhile by another process (or a file in the way: said below)
            if not folder.is_dir():
                raise
    return path


def open_new(path: str | os.PathLike, mode: str = "w", perms: int = FILE_MODE, **kwargs) -> IO:
    """``open(path, mode)`` for writing (``w``, ``a`` or ``x``, text or ``b``), creating the file with ``perms``.

    A file that exists keeps its mode. ``kwargs`` go to :func:`open` (``buffering``, ``newline``, ...).
    """
    kind = next((c for c in mode if c in _FLAGS), None)
    if kind is None or "+" in mode or "r" in mode:
        raise ValueError(f"open_new writes files: mode must hold one of w, a, x (and no r or +), got {mode!r}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | _FLAGS[kind], perms)
    try:
        return os.fdopen(fd, mode.replace("x", "w"), **kwargs)
    except BaseException:
        # io.open closes the fd itself when it fails after wrapping it (a Ctrl-C landing inside the
        # text layer's setup): a second close would raise EBADF and hide the first exception.
        with contextlib.suppress(OSError):
            os.close(fd)
        raise


def write_text(path: str | os.PathLike, text: str, perms: int = FILE_MODE) -> None:
    """``Path(path).write_text(text)``, a new file made with ``perms``."""
    with open_new(path, "w", perms, encoding="utf-8") as f:
        f.write(text)


@contextlib.contextmanager
def replacing(path: str | os.PathLike, mode: str = "w", perms: int = FILE_MODE, **kwargs) -> Iterator[IO]:
    """A file to write that takes the place of ``path`` once complete (``PATH.tmp``, then a rename).

    A reader sees the old file or the new one, never half of one. ``kwargs`` go to :func:`open`.
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)  # one left by a crash keeps its mode: made afresh, it has ``perms``
    with open_new(tmp, mode, perms, **kwargs) as f:
        yield f
    os.replace(tmp, path)


def replace_text(path: str | os.PathLike, text: str, perms: int = FILE_MODE) -> None:
    """Write ``text`` to ``path`` atomically (see :func:`replacing`)."""
    with replacing(path, "w", perms, encoding="utf-8") as f:
        f.write(text)
