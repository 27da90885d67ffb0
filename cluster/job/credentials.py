"""A job's credentials: its bearer token (a secret) and its job id (a name, not a secret).

``psctl launch`` and ``psctl mpi`` make both per job unless the job gives them (other users
of an HPC node reach its loopback too, so a job is closed to strangers by default). The
token travels to the children in the environment (:data:`TOKEN_ENV`), never on a command
line (``ps`` shows those to every user) and never in a file others can read: the copies of
the job that are written (``OUT/job.toml``, ``summary.json``) hold :data:`REDACTED` in its
place. The job id is given to every shard, which refuses a Shutdown that does not name it:
garbage, or another job's ``psctl``, cannot stop it.
"""

from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path
from typing import Any

from psgrid.cluster.job.records import write_whole
from psgrid.psserver.files import SECRET_MODE
from psgrid.psserver.security import REDACTED_TOKEN as REDACTED  # noqa: F401 - re-exported for the cluster
from psgrid.psserver.security import TOKEN_ENV, job_token


def new_token() -> str:
    return secrets.token_urlsafe(32)


def new_job_id() -> str:
    return secrets.token_hex(6)


def secure(job, token: str | None = None, job_id: str | None = None):
    """``job`` with a token and a job id: the ones it gives, else these, else new ones (``job`` is not changed)."""
    token = job.server.token or job.train.token or token or new_token()
    job_id = job.server.job_id or job_id or new_job_id()
    server = dataclasses.replace(job.server, token=token, job_id=job_id)
    train = dataclasses.replace(job.train, token=token)
    return dataclasses.replace(job, server=server, train=train)


def child_env(job) -> dict[str, str]:
    """What a child needs in its environment to use the job's token (nothing when it has none)."""
    return {TOKEN_ENV: job.server.token} if job.server.token else {}


TOKEN_FILE = "token"


def write_token_file(out, job) -> None:
    """``OUT/token``, readable by its owner alone, so that ``psctl status OUT`` can reach the job.

    Replaced whole (cluster/job/records.py) by a file made private: never readable by others, not even briefly.
    """
    if job.server.token:
        write_whole(Path(out) / TOKEN_FILE, job.server.token + "\n", SECRET_MODE)


def token_file_of(out) -> Path:
    """Where ``psctl launch`` keeps the token of the job whose output folder is ``out`` (or its ``addr/``)."""
    out = Path(out)
    return (out.parent if out.name == "addr" else out) / TOKEN_FILE


def redact(tables: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """A copy of a job's tables fit to be written where others may read it: the token replaced."""
    return {
        section: {k: (REDACTED if k == "token" and v else v) for k, v in values.items()}
        for section, values in tables.items()
    }


def resolve_token(value: str | None, where: str, *, redacted_ok: bool = False) -> str | None:
    """The token a job file's setting stands for (:func:`~psgrid.psserver.security.job_token`'s rule).

    A setting with no token takes the environment's, so ``PSGRID_TOKEN=... psctl server``
    works without the token on its command line; a redacted one is the environment's too.
    With ``redacted_ok`` (a launcher rereading a job it wrote, which makes a new token
    anyway) a redacted token without the variable is None.
    """
    from psgrid.cluster.errors import ConfigError

    if value != REDACTED:
        return job_token(value)
    env = job_token()
    if env is None and not redacted_ok:
        raise ConfigError(
            f"{where}: the token in this file is redacted; its job's launcher hands the real one to "
            f"its processes in {TOKEN_ENV}. Set {TOKEN_ENV}, or give token = ... (not on a command line)"
        )
    return env
