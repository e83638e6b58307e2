"""A gRPC health probe: ``python -m ringserve.healthcheck host:port [--service NAME]``.

It asks the standard health service (``grpc.health.v1.Health/Check``) that the coordinator and
every worker serve, and exits 0 when the answer is SERVING, 1 otherwise, printing why. It is the
compose file's health check, so an image needs no separate ``grpc_health_probe`` binary.

The health service needs no job token (probes cannot send one), but a server that requires client
certificates (mTLS) refuses a probe without one: pass ``--tls-ca``, ``--tls-cert`` and ``--tls-key``
(or set RINGSERVE_TLS_CA, ...). With a token set (``--token-file``, RINGSERVE_TOKEN) it is sent too.

Example:
    ```python
    python -m ringserve.healthcheck 127.0.0.1:50051 --service ringserve.v1.Coordinator
    ```
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ringserve.config import WorkerConfig
from ringserve.errors import RingserveError
from ringserve.handshake import diagnose
from ringserve.security import Security


def check(address: str, *, service: str = "", timeout_s: float = 3.0, security: Security | None = None) -> tuple[bool, str]:
    """Asks the health service at address about service.

    Args:
        address: host:port of a ringserve coordinator or worker.
        service: the service name to ask about; "" is the server as a whole.
        timeout_s: deadline of the call, connection included.
        security: TLS material and token to dial with; plaintext without a token when None.

    Returns:
        (serving, a sentence saying what was found; a failed TLS handshake is named as one, with
        the side that refused and the likely cause).
    """
    with (security or Security()).sync_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError as e:
            code = e.code() if isinstance(e, grpc.Call) else None
            detail = e.details() if isinstance(e, grpc.Call) else str(e)
            name = code.name if code is not None else "an error"
            message = f"The health check of {address} (service {service!r}) failed with {name}"
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                # "Socket closed" says nothing of a refused TLS handshake: name it if it was one.
                found = diagnose(address, security or Security(), min(1.0, timeout_s))
                if found is not None:
                    return False, f"{message}: {found}"
            return False, f"{message}: {detail}" if detail else message + "."
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, f"{address} (service {service!r}) is {status}."


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringserve.healthcheck", description="Asks a ringserve server's gRPC health service; exits 0 when SERVING.")
    parser.add_argument("address", help="host:port of the server to probe")
    parser.add_argument("--service", default="", help='service to ask about (default "": the whole server)')
    parser.add_argument("--timeout", type=float, default=3.0, help="deadline in seconds (default 3)")
    parser.add_argument("--tls-ca", default=None, help="PEM CA bundle to verify the server with (TLS on)")
    parser.add_argument("--tls-cert", default=None, help="PEM client certificate, for servers that require one")
    parser.add_argument("--tls-key", default=None, help="PEM key of --tls-cert")
    parser.add_argument("--tls-server-name", default=None, help="name to check the server's certificate against")
    parser.add_argument("--token-file", default=None, help="file holding the job token (health needs none)")
    ns = parser.parse_args(argv)
    names = ("tls_ca", "tls_cert", "tls_key", "tls_server_name", "token_file")
    env = {k: v for k, v in os.environ.items() if k in {f"RINGSERVE_{n.upper()}" for n in (*names, "token")}}
    try:
        config = WorkerConfig.from_env(env, **{n: getattr(ns, n) for n in names})
        security = Security.load(config)
    except RingserveError as exc:
        print(f"The health check of {ns.address} could not start: {exc}", file=sys.stderr)
        return 1
    serving, message = check(ns.address, service=ns.service, timeout_s=ns.timeout, security=security)
    print(message, file=sys.stdout if serving else sys.stderr)
    return 0 if serving else 1


if __name__ == "__main__":
    sys.exit(main())
