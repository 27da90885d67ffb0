"""TLS material and bearer tokens, read and checked in one place for every transport and both ends."""

from __future__ import annotations

import hmac
import ssl
from pathlib import Path


# What the written copies of a job hold in place of its token (cluster/credentials.py).
REDACTED_TOKEN = "<redacted>"


def check_token(token: str | None) -> None:
    """Refuse the redacted placeholder as a token: it means the real one was not passed along."""
    if token == REDACTED_TOKEN:
        from psgrid.psserver.exceptions import InvalidArgument

        raise InvalidArgument("the token is the placeholder of a redacted job file; pass the job's real token "
                              "(PSGRID_TOKEN)")


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
