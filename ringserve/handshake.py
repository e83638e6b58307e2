"""Why a TLS connection fails, found by a handshake of our own.

gRPC reports a refused handshake badly: a server that refuses a client certificate, or that
speaks TLS to a plaintext client, just closes the socket ("Socket closed"), and a call made with
``wait_for_ready`` (the worker's Join) says nothing at all until its deadline, as if the host were
down. So when a channel fails to connect, ``diagnose`` dials the server once more with Python's
``ssl`` module, within a second, with the same CA, certificate and server name, and names what it
finds as a ``TLSHandshakeError``: which side refused and the likely cause. It returns None when the
failure is not a TLS one (nothing listens there, the host is unreachable), or when its own
handshake goes through.

What it tells apart:

- a plaintext client and a server that speaks TLS (refused by the server);
- a TLS client and a plaintext server (refused by the client: the answer is not TLS);
- a server certificate the client does not trust: another CA, expired, not naming the host
  (refused by the client, with OpenSSL's reason);
- a server that requires a client certificate and got none, or refused the one it got (another
  CA, expired), from the TLS alert it sends (refused by the server).
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import tempfile
from collections.abc import Iterator

from ringserve.errors import TLSHandshakeError
from ringserve.security import Security

# The probe's deadline: a handshake on a reachable host takes milliseconds, and the caller is
# waiting to learn why its connection failed.
PROBE_TIMEOUT_S = 1.0

# The HTTP/2 client preface and an empty SETTINGS frame: once TLS is up, a gRPC server answers it
# with its own SETTINGS, and a server that refused our certificate under TLS 1.3 says so instead.
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"

# Alerts a server sends about the client's certificate, by OpenSSL's reason code.
_CLIENT_CERT_ALERTS = {
    "TLSV13_ALERT_CERTIFICATE_REQUIRED": "it requires a client certificate",
    "SSLV3_ALERT_HANDSHAKE_FAILURE": "it requires a client certificate",
    "TLSV1_ALERT_UNKNOWN_CA": "it does not trust the CA that signed the client certificate",
    "SSLV3_ALERT_BAD_CERTIFICATE": "it found the client certificate bad",
    "SSLV3_ALERT_CERTIFICATE_EXPIRED": "the client certificate has expired",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "it could not verify the client certificate",
    "TLSV1_ALERT_DECRYPT_ERROR": "the client certificate does not match its key",
}


def _split(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host.strip("[]"), int(port)


@contextlib.contextmanager
def pem_file(data: bytes) -> Iterator[str]:
    """A path holding data for ssl's load_cert_chain, which reads only files: an anonymous memory
    file where there is one (the key never touches a disk), else a private temporary file."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("ringserve-probe", os.MFD_CLOEXEC)
        try:
            os.write(fd, data)
            yield f"/proc/self/fd/{fd}"
        finally:
            os.close(fd)
        return
    with tempfile.NamedTemporaryFile(suffix=".pem") as f:  # created 0600
        f.write(data)
        f.flush()
        yield f.name


def _context(security: Security) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.set_alpn_protocols(["h2"])
    if not security.tls:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
        return ctx
    if security.ca is not None:
        ctx.load_verify_locations(cadata=security.ca.decode())
    else:
        ctx.load_default_certs()
    if security.cert is not None and security.key is not None:
        with pem_file(security.cert + b"\n" + security.key) as path:
            ctx.load_cert_chain(path)
    return ctx


def _reason(exc: ssl.SSLError) -> str:
    return str(exc.reason or exc.__class__.__name__)


def diagnose(address: str, security: Security, timeout_s: float = PROBE_TIMEOUT_S) -> TLSHandshakeError | None:
    """Dials address with security's TLS settings and says why the handshake fails, if it does.

    Args:
        address: host:port of the server that a channel could not connect to.
        security: the TLS material the channel uses (plaintext when it has none).
        timeout_s: deadline of the whole probe.

    Returns:
        The TLS failure, named; None when the server cannot be reached at all or the handshake
        goes through (the failure is something else).
    """
    try:
        host, port = _split(address)
        raw = socket.create_connection((host, port), timeout=timeout_s)
    except (OSError, ValueError):
        return None  # not a TLS question: nothing listens, or the name does not resolve
    try:
        return _handshake(raw, address, host, security)
    finally:
        raw.close()


def _handshake(raw: socket.socket, address: str, host: str, security: Security) -> TLSHandshakeError | None:
    ctx = _context(security)
    name = security.server_name or host
    try:
        conn = ctx.wrap_socket(raw, server_hostname=name, do_handshake_on_connect=False)
    except (ssl.SSLError, OSError):
        return None
    try:
        conn.do_handshake()
    except ssl.SSLCertVerificationError as exc:
        return TLSHandshakeError(address, "client", (
            f"this client does not trust the server's certificate ({exc.verify_message}): tls_ca must hold "
            f"the CA that signed it, and it must be valid and name {name!r} (or set tls_server_name)."
        ))
    except ssl.SSLError as exc:
        reason = _reason(exc)
        if not security.tls:  # an alert is TLS; anything else means the server is not TLS either
            return _plaintext_client(address) if "ALERT" in reason else None
        if reason in _CLIENT_CERT_ALERTS:
            return _refused_client_cert(address, security, reason)
        return TLSHandshakeError(address, "client", (
            f"the server does not speak TLS ({reason}) and this client does: the server has no "
            "certificate (tls_cert/tls_key), or this client should not set tls_ca/tls_cert."
        ))
    except TimeoutError:
        return None  # a slow server tells nothing about TLS
    except OSError:  # closed or reset on our hello
        if security.tls:
            return TLSHandshakeError(address, "client", (
                "the server closed the connection on this client's TLS hello: it does not speak TLS; give it a "
                "certificate (tls_cert/tls_key), or do not set tls_ca/tls_cert on this client."
            ))
        return None
    if not security.tls:
        return _plaintext_client(address)
    # The handshake went through on our side; under TLS 1.3 the server checks our certificate
    # after that and answers the first bytes with its verdict.
    try:
        conn.sendall(_H2_PREFACE)
        if conn.recv(64):
            return None
    except ssl.SSLError as exc:
        reason = _reason(exc)
        if reason in _CLIENT_CERT_ALERTS:
            return _refused_client_cert(address, security, reason)
        return TLSHandshakeError(address, "server", f"it ended the TLS session ({reason}).")
    except (OSError, TimeoutError):
        return None
    return _refused_client_cert(address, security, "")


def _plaintext_client(address: str) -> TLSHandshakeError:
    return TLSHandshakeError(address, "server", (
        "the server speaks TLS and this client plaintext: set tls_ca (and tls_cert/tls_key where the "
        "server requires client certificates)."
    ))


def _refused_client_cert(address: str, security: Security, reason: str) -> TLSHandshakeError:
    """The server ended the session over the client's certificate: with an alert that says why
    (``reason``), or, as gRPC's servers do, by closing the connection without one ("")."""
    said = f" ({reason})" if reason else ""
    if security.cert is None or security.key is None:
        return TLSHandshakeError(address, "server", (
            f"it requires a client certificate (mTLS) and this client has none{said}: set tls_cert and tls_key."
        ))
    problem = _own_certificate_problem(security.cert, security.key, security.ca)
    if problem is not None:
        return TLSHandshakeError(address, "server", (
            f"it refused this client's certificate{said}, which this client's own tls_ca does not accept either "
            f"({problem}): it must be signed by the job's CA and be valid."
        ))
    why = _CLIENT_CERT_ALERTS.get(reason, "it refused this client's certificate")
    return TLSHandshakeError(address, "server", (
        f"{why}{said}: the client certificate (tls_cert) must be signed by a CA in the server's tls_ca."
    ))


def _own_certificate_problem(cert: bytes, key: bytes, ca: bytes | None) -> str | None:
    """Why this process's certificate fails verification against its own CA, if it does.

    A handshake between two in-memory TLS endpoints, one serving the certificate and the other
    trusting ``ca``: OpenSSL's verdict ("certificate has expired", "unable to get local issuer
    certificate") is the likely reason a server of the same job refused it. None if it passes,
    or if the question cannot be asked (no CA, a certificate that cannot serve).
    """
    if ca is None:
        return None
    serving = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    checking = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    checking.check_hostname = False
    try:
        with pem_file(cert + b"\n" + key) as path:
            serving.load_cert_chain(path)
        checking.load_verify_locations(cadata=ca.decode())
    except (ssl.SSLError, OSError, ValueError):
        return None
    to_server, from_server, to_client, from_client = (ssl.MemoryBIO() for _ in range(4))
    server = serving.wrap_bio(to_server, from_server, server_side=True)
    client = checking.wrap_bio(to_client, from_client)
    done = {id(server): False, id(client): False}
    for _ in range(8):  # a TLS 1.3 handshake takes two round trips; this is room to spare
        for side in (client, server):
            if done[id(side)]:
                continue
            try:
                side.do_handshake()
                done[id(side)] = True
            except ssl.SSLWantReadError:
                pass
            except ssl.SSLCertVerificationError as exc:
                return str(exc.verify_message)
            except ssl.SSLError:
                return None
        if all(done.values()):
            return None
        to_server.write(from_client.read())
        to_client.write(from_server.read())
    return None
