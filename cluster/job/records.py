"""A job's records in its output folder (``job.toml``, ``token``), each written whole or not at all.

This module is the one writer of ``job.toml`` (:func:`write_job_file`, :func:`copy_job_file`): every
launcher, resume and experiment goes through it, so every copy is whole and says what ran it.

``psctl launch --resume OUT`` takes the job from ``OUT/job.toml``, and every resume rewrites it.
Rewritten in place (an open with ``O_TRUNC``, then the write) it is left empty by a death in
between (SIGKILL, the OOM killer, a Ctrl-C whose exception lands there), and every later resume
read an empty job: "its job ran without checkpoints", while the checkpoints were intact. So a
record is written to a temporary file beside it, flushed to the disk, renamed over the old one
(a rename within a folder is atomic: a reader sees the old record or the new one) and the folder
flushed (so the rename outlives a power cut too). Ctrl-C and SIGTERM are held meanwhile and
delivered once the record is in place: an interrupted launcher leaves no temporary file behind.
One killed (SIGKILL) does: the next job in the folder sweeps it (:func:`sweep_temporaries`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

from psgrid.psserver import files

JOB_FILE = "job.toml"
COMMAND_FILE = "command.json"  # a script job's command, where it ran: what ``--resume`` runs again
TMP_SUFFIX = ".tmp"  # a temporary file is .NAME.PID.tmp
HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold Ctrl-C and SIGTERM until the block ends, then deliver them to whatever handled them before.

    Unlike :func:`~psgrid.cluster.run.interrupts.deferred_signals` this serves any handler
    (``psctl``'s first-line one, the launcher's, the default that ends the process). Signals
    are not masked: a mask would be inherited by children started meanwhile. Off the main
    thread, where no Python handler runs, there is nothing to hold.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    heard: list[int] = []
    before = {sig: signal.getsignal(sig) for sig in HELD_SIGNALS}
    held = [sig for sig, handler in before.items() if handler is not None]  # None: set outside Python, kept
    for sig in held:
        signal.signal(sig, lambda signum, frame: heard.append(signum))
    try:
        yield
    finally:
        for sig in held:
            signal.signal(sig, before[sig])
        if heard:
            signal.raise_signal(heard[0])  # its handler runs now: raises, records, or ends the process


def write_whole(path: str | os.PathLike, text: str, perms: int = files.FILE_MODE) -> None:
    """Write ``text`` to ``path`` so that it holds the old text or the new, never a part (see above).

    The file gets ``perms`` (at most: the umask applies), as :func:`~psgrid.psserver.files.write_text`
    gives it; the temporary file is private to this process, so writers of one path never collide.
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}{TMP_SUFFIX}")
    with signals_held():
        try:
            tmp.unlink(missing_ok=True)  # one of a dead process whose pid this one has: made afresh
            with files.open_new(tmp, "x", perms, encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        _fsync_folder(path.parent)


def sweep_temporaries(folder: str | os.PathLike) -> None:
    """Remove the temporary files that writers killed in the middle of :func:`write_whole` left in ``folder``.

    Only for the holder of the folder's lock (cluster/job/outdir.py), when no other writer is at work there.
    """
    for tmp in Path(folder).glob(f".*.[0-9]*{TMP_SUFFIX}"):
        tmp.unlink(missing_ok=True)


def _fsync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno != errno.EINVAL:  # a file system that cannot flush a folder: the rename is done
            raise
    finally:
        os.close(fd)


def write_job_file(out: str | os.PathLike, job, by: str) -> Path:
    """``OUT/job.toml``: the resolved job as it runs (its token redacted), which every child reads.

    ``by`` says what ran it, for the file's first line ("by psctl launch", "on emulated hosts", ...).
    Returns the file's path.
    """
    path = Path(out) / JOB_FILE
    redacted = " (token redacted)" if job.server.token or job.train.token else ""
    write_whole(path, f"# resolved job, as run {by}{redacted}\n{job.to_toml()}")
    return path


def copy_job_file(out: str | os.PathLike, folder: str | os.PathLike) -> Path:
    """``folder/job.toml``: a whole copy of ``out/job.toml`` (an attempt's record of the job it ran)."""
    path = Path(folder) / JOB_FILE
    write_whole(path, (Path(out) / JOB_FILE).read_text(encoding="utf-8"))
    return path


def write_command_file(out: str | os.PathLike, command: list[str], cwd: str | os.PathLike) -> Path:
    """``OUT/command.json``: the command each worker of a script job runs, and the folder it runs in."""
    import json

    path = Path(out) / COMMAND_FILE
    write_whole(path, json.dumps({"command": list(command), "cwd": str(cwd)}) + "\n")
    return path


def read_command_file(out: str | os.PathLike) -> tuple[list[str], str] | None:
    """The command and folder :func:`write_command_file` recorded in ``out``; None where it recorded none."""
    import json

    try:
        record = json.loads((Path(out) / COMMAND_FILE).read_text(encoding="utf-8"))
        command, cwd = record["command"], record["cwd"]
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        return None  # damaged: said by the caller as "no command recorded"
    if not (isinstance(command, list) and command and all(isinstance(a, str) for a in command)):
        return None
    return command, str(cwd)
