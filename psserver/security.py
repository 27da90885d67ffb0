"""TLS material and bearer tokens, read and checked in one place for every transport and both ends."""

from __future__ import annotations

import hmac
import os
import ssl
from pathlib import Path

# What the written copies of a job hold in place of its token (cluster/job/credentials.py).
REDACTED_TOKEN = "<redacted>"
# The variable a job's token travels in: launchers hand it to their children there, never in argv.
TOKEN_ENV = "PSGRID_TOKEN"


def job_token(given: str | None = None, *, token_file: str | os.PathLike | None = None) -> str | None:
    """The job's bearer token, by the one rule of every entry point.

    ``psctl server`` (with or without a job file), ``psctl status``, :class:`~psgrid.Client`,
    :class:`~psgrid.Admin` and ``psgrid.init`` all ask here, so a token set once reaches
    both ends alike: a shard started by hand and its workers agree on it.

    Parameters
    ----------
    given : str, optional
        A token given to this entry point (a flag, an argument, a job file's key); empty is
        not given.
    token_file : path, optional
        The job's token file, where the entry point knows its job's folder (``OUT/token`` of
        ``psctl launch``, read by ``psctl status --address-dir OUT``); a missing file is skipped.

    Returns
    -------
    str or None
        ``given``, else the token file's, else :data:`TOKEN_ENV`'s, else None (no token).
    """
    if given:
        return given
    if token_file is not None:
        try:
            text = Path(token_file).read_text().strip()
        except FileNotFoundError:
            text = ""
        if text:
            return text
    return os.environ.get(TOKEN_ENV) or None


def check_token(token: str | None) -> None:
    """Refuse the redacted placeholder as a token: it means the real one was not passed along."""
    if token == REDACTED_TOKEN:
        from psgrid.psserver.exceptions import InvalidArgument

        raise InvalidArgument(
            "the token is the placeholder of a redacted job file; pass the job's real token (PSGRID_TOKEN)"
        )


def read_pem(path: str | None) -> bytes | None:
    """The bytes of a PEM file, or None when no path is given."""
    return Path(path).read_bytes() if path else None


def token_matches(given: bytes | str, expected: str) -> bool:
    """Constant-time comparison, so a wrong token's timing says nothing about the right one."""
    if isinstance(given, str):
        given = given.encode()
    return hmac.compare_digest(given, expected.encode())


def bearer(token: str) -> str:
    """The ``authorization`` metadata value a gRPC call carries."""
    return f"Bearer {token}"


def server_ssl_context(cert: str, key: str, ca: str | None) -> ssl.SSLContext:
    """The shard's TLS context; with ``ca``, clients must present a certificate it signed (mutual TLS)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    if ca:
        context.load_verify_locations(ca)
        context.verify_mode = ssl.CERT_REQUIRED
    return context


def client_ssl_context(ca: str | None, cert: str | None, key: str | None) -> ssl.SSLContext:
    """A client's TLS context: trust ``ca`` (or the system's roots), present ``cert`` when given."""
    context = ssl.create_default_context(cafile=ca)
    if cert:
        context.load_cert_chain(cert, key)
    return context
