"""The certificates of one job's mutual TLS: a CA, a shard certificate and a client certificate.

Made with the ``cryptography`` package (ECDSA P-256, SHA-256). The shard's certificate names
the hosts and addresses clients dial (subjectAltName), and is for server authentication only;
the client's is for client authentication only; both are signed by the CA, which signs
nothing else. Private keys are created with mode 0600 (opened with that mode, never chmod-ed
after), and nothing is overwritten unless asked.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from pathlib import Path

from psgrid.cluster.errors import UsageError
from psgrid.psserver import files

FILES = ("ca.pem", "ca.key", "shard.pem", "shard.key", "client.pem", "client.key")


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(hosts: list[str]):
    from cryptography import x509

    names = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    return x509.SubjectAlternativeName(names)


def _certificate(subject: str, key, issuer_name, issuer_key, days: int, *, ca: bool, usage=None, hosts=None):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    now = dt.datetime.now(dt.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer_name or _name(subject))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=0 if ca else None), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=False,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
    else:
        builder = (
            builder.add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
        )
    if hosts:
        builder = builder.add_extension(_san(hosts), critical=False)
    return builder.sign(issuer_key or key, hashes.SHA256())


def _write(path: Path, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def make_certs(directory: str | Path, hosts: list[str], days: int = 365, force: bool = False) -> dict[str, Path]:
    """Write the CA, the shard's and the client's certificate and key into ``directory``; returns the paths."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.x509.oid import ExtendedKeyUsageOID

    directory = Path(directory)
    existing = [name for name in FILES if (directory / name).exists()]
    if existing and not force:
        raise UsageError(f"{directory} already holds {', '.join(existing)}; choose another folder or add --force")
    if not hosts:
        raise UsageError("the shard certificate needs at least one --host")
    if days < 1:
        raise UsageError(f"--days must be at least 1, got {days}")
    files.make_dirs(directory, 0o700)
    ca_key, shard_key, client_key = _key(), _key(), _key()
    ca = _certificate("psgrid job CA", ca_key, None, None, days, ca=True)
    shard = _certificate(
        hosts[0], shard_key, ca.subject, ca_key, days, ca=False, usage=ExtendedKeyUsageOID.SERVER_AUTH, hosts=hosts
    )
    client = _certificate(
        "psgrid worker", client_key, ca.subject, ca_key, days, ca=False, usage=ExtendedKeyUsageOID.CLIENT_AUTH
    )
    pem = serialization.Encoding.PEM
    paths = {}
    for name, cert, key in (("ca", ca, ca_key), ("shard", shard, shard_key), ("client", client, client_key)):
        for path in (directory / f"{name}.key", directory / f"{name}.pem"):
            path.unlink(missing_ok=True)  # so that the mode given below is the file's
        _write(
            directory / f"{name}.key",
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
            0o600,
        )
        _write(directory / f"{name}.pem", cert.public_bytes(pem), 0o644)
        paths[f"{name}_cert"], paths[f"{name}_key"] = directory / f"{name}.pem", directory / f"{name}.key"
    return paths


def job_lines(paths: dict[str, Path]) -> str:
    """The job-file lines that turn mutual TLS on with these files."""
    return (
        f'[server]\ntls_cert = "{paths["shard_cert"]}"\ntls_key = "{paths["shard_key"]}"\n'
        f'tls_ca = "{paths["ca_cert"]}"\n'
        f'[train]\ntls_ca = "{paths["ca_cert"]}"\ntls_cert = "{paths["client_cert"]}"\n'
        f'tls_key = "{paths["client_key"]}"\n'
    )
