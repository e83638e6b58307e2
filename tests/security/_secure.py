"""Certificates made at test time, and helpers to dial the servers under test with raw clients.

Every process of a job shares one certificate here (``node``), valid for 127.0.0.1 and localhost,
signed by the job's CA; ``other`` is signed by an unrelated CA, ``expired`` by the job's CA but no
longer valid.
"""

from __future__ import annotations

import pathlib
from dataclasses import dataclass
from typing import Any

from ringserve.security import Security
from ringserve.testing.pki import CertFiles, CertificateAuthority

TOKEN = "job-token-7f3c"


@dataclass(frozen=True)
class Pki:
    node: CertFiles
    expired: CertFiles
    other: CertFiles

    def settings(self, files: CertFiles | None = None, *, mtls: bool = True, **extra: Any) -> dict[str, Any]:
        """Config fields for a process holding ``files`` (the node certificate by default)."""
        files = files or self.node
        return dict(tls_cert=files.cert, tls_key=files.key, tls_ca=self.node.ca, tls_require_client_auth=mtls, **extra)


def make_pki(directory: pathlib.Path) -> Pki:
    job = CertificateAuthority("job CA")
    return Pki(
        node=job.issue_files(directory, "node"),
        expired=job.issue_files(directory, "expired", expired=True),
        other=CertificateAuthority("another CA").issue_files(directory, "other"),
    )


def client(*, ca: str | None = None, cert: CertFiles | None = None, token: str = "") -> Security:
    """A client's Security: trusting ``ca`` (TLS on when given), presenting ``cert``, sending ``token``."""
    read = lambda path: pathlib.Path(path).read_bytes()  # noqa: E731
    return Security(
        ca=read(ca) if ca else None,
        cert=read(cert.cert) if cert else None,
        key=read(cert.key) if cert else None,
        token=token,
    )
