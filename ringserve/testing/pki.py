"""Throwaway certificate authorities and certificates, for tests and benchmarks.

Needs the ``cryptography`` package (the ``dev`` extra); nothing in ringserve imports this module.

Example:
    ```python
    ca = CertificateAuthority("job CA")
    paths = ca.issue_files(tmp_path, "node")       # node.pem, node.key; ca.pem written too
    WorkerConfig(tls_cert=paths.cert, tls_key=paths.key, tls_ca=paths.ca)
    ```
"""

from __future__ import annotations

import datetime
import ipaddress
import pathlib
from dataclasses import dataclass
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK_NAMES = ("127.0.0.1", "localhost")


@dataclass(frozen=True)
class CertFiles:
    """Where a certificate, its key and the CA that signed it were written."""

    cert: str
    key: str
    ca: str


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _pem_key(key: Any) -> bytes:
    return bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ))


class CertificateAuthority:
    """A self-signed CA (EC P-256) that issues leaf certificates for both server and client use."""

    def __init__(self, common_name: str = "ringserve test CA") -> None:
        now = datetime.datetime.now(datetime.UTC)
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(_name(common_name))
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                encipher_only=False, decipher_only=False,
            ), critical=True)
            .sign(self.key, hashes.SHA256())
        )

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def issue(
        self, common_name: str, *, names: tuple[str, ...] = LOOPBACK_NAMES, expired: bool = False
    ) -> tuple[bytes, bytes]:
        """A leaf certificate for ``names`` (IP addresses or DNS names); returns (cert PEM, key PEM).

        With ``expired`` its validity ended an hour ago.
        """
        now = datetime.datetime.now(datetime.UTC)
        start, end = (now - datetime.timedelta(days=2), now - datetime.timedelta(hours=1)) if expired else (
            now - datetime.timedelta(hours=1), now + datetime.timedelta(days=7))
        sans: list[x509.GeneralName] = []
        for n in names:
            try:
                sans.append(x509.IPAddress(ipaddress.ip_address(n)))
            except ValueError:
                sans.append(x509.DNSName(n))
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(common_name))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(start)
            .not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName(sans), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            # Every ringserve process is a server (its peer server) and a client (its channels).
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .sign(self.key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM), _pem_key(key)

    def issue_files(
        self, directory: pathlib.Path, stem: str, *, names: tuple[str, ...] = LOOPBACK_NAMES, expired: bool = False
    ) -> CertFiles:
        """Writes ``<stem>.pem``, ``<stem>.key`` and this CA as ``<stem>-ca.pem`` into directory."""
        cert, key = self.issue(stem, names=names, expired=expired)
        directory.mkdir(parents=True, exist_ok=True)
        paths = CertFiles(str(directory / f"{stem}.pem"), str(directory / f"{stem}.key"), str(directory / f"{stem}-ca.pem"))
        pathlib.Path(paths.cert).write_bytes(cert)
        pathlib.Path(paths.key).write_bytes(key)
        pathlib.Path(paths.key).chmod(0o600)
        pathlib.Path(paths.ca).write_bytes(self.pem)
        return paths
