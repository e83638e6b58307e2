"""A TLS handshake that fails is named as one, within a second or two, with the side that refused
and the likely cause: on a worker's start, on `ringserve status` and on the health probe, never a
wait until the connect deadline and an "unreachable" as if the host were down."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from _secure import Pki

from ringserve import Coordinator, TLSHandshakeError, Worker, WorkerConfig, cli, healthcheck
from ringserve._proto import coordinator_pb2 as pb
from ringserve.security import Security

pytestmark = pytest.mark.timeout(30)

# A bound well under the connect deadline (10 s here), with room for a loaded machine.
FAST_S = 2.0


def cases(pki: Pki) -> dict[str, tuple[dict[str, Any], dict[str, Any], str, str]]:
    """name: (coordinator settings, client settings, the side that refuses, words of the cause)."""
    return {
        "client-cert-of-another-ca": (
            pki.settings(), {**pki.settings(pki.other), "tls_ca": pki.node.ca}, "server",
            "refused this client's certificate, which this client's own tls_ca does not accept either "
            "(unable to get local issuer certificate)",
        ),
        "missing-client-cert": (
            pki.settings(), {"tls_ca": pki.node.ca}, "server",
            "it requires a client certificate (mTLS) and this client has none",
        ),
        "plaintext-client-tls-server": (
            pki.settings(), {}, "server", "the server speaks TLS and this client plaintext",
        ),
        "tls-client-plaintext-server": (
            {}, pki.settings(), "client", "the server does not speak TLS",
        ),
        "untrusted-server-cert": (
            pki.settings(mtls=False), {**pki.settings(mtls=False), "tls_ca": pki.other.ca}, "client",
            "this client does not trust the server's certificate (unable to get local issuer certificate)",
        ),
    }


CASES = ["client-cert-of-another-ca", "missing-client-cert", "plaintext-client-tls-server",
         "tls-client-plaintext-server", "untrusted-server-cert"]


def expected(address: str, side: str) -> str:
    return f"The TLS handshake with {address} failed, refused by the {side}: "


@pytest.mark.parametrize("case", [c for c in CASES if c != "missing-client-cert"])  # a worker serves: it has a cert
async def test_a_worker_whose_tls_does_not_match_the_coordinators_fails_start_at_once_naming_the_cause(
    pki: Pki, make_coordinator_config, make_worker_config, case: str
) -> None:
    server, settings, side, cause = cases(pki)[case]
    async with Coordinator(make_coordinator_config(**server)) as coord:
        worker = Worker(config=make_worker_config(coord.address, connect_timeout_s=10.0, **settings))
        started = time.monotonic()
        with pytest.raises(TLSHandshakeError) as info:
            await worker.start()
        assert time.monotonic() - started < FAST_S
        assert info.value.refused_by == side
        assert str(info.value).startswith(expected(coord.address, side)) and cause in str(info.value)
        assert (await coord.service.Status(pb.StatusRequest(), None)).pending_workers == 0


@pytest.mark.parametrize("case", CASES)
async def test_ringserve_status_names_a_failed_tls_handshake_at_once(pki: Pki, make_coordinator_config, capsys, case: str) -> None:
    server, settings, side, cause = cases(pki)[case]
    async with Coordinator(make_coordinator_config(**server)) as coord:
        flags = [f"--{name.replace('_', '-')}={settings[name]}" for name in ("tls_ca", "tls_cert", "tls_key") if name in settings]
        started = time.monotonic()
        code = await asyncio.to_thread(cli.main, ["status", "--coordinator", coord.address, "--timeout", "10", *flags])
        assert time.monotonic() - started < FAST_S
        assert code == 2
        err = capsys.readouterr().err
        assert f"ringserve status: {expected(coord.address, side)}" in err and cause in err, err


@pytest.mark.parametrize("case", CASES)
async def test_the_health_probe_names_a_failed_tls_handshake_at_once(pki: Pki, make_coordinator_config, case: str) -> None:
    server, settings, side, cause = cases(pki)[case]
    async with Coordinator(make_coordinator_config(**server)) as coord:
        security = Security.load(WorkerConfig(**{k: v for k, v in settings.items() if k != "tls_require_client_auth"}))
        started = time.monotonic()
        serving, message = await asyncio.to_thread(healthcheck.check, coord.address, timeout_s=10.0, security=security)
        assert time.monotonic() - started < FAST_S
        assert not serving
        assert expected(coord.address, side) in message and cause in message, message


async def test_a_matching_tls_setup_is_not_taken_for_a_failed_handshake_when_the_coordinator_is_simply_down(pki: Pki) -> None:
    from worlds import free_port

    address = f"127.0.0.1:{free_port()}"
    security = Security.load(WorkerConfig(**pki.settings()))
    serving, message = await asyncio.to_thread(healthcheck.check, address, timeout_s=1.0, security=security)
    assert not serving and "TLS" not in message and "UNAVAILABLE" in message, message


async def test_ringserve_init_of_a_plaintext_worker_against_a_tls_coordinator_names_the_handshake(pki: Pki, make_coordinator_config) -> None:
    import ringserve

    async with Coordinator(make_coordinator_config(**pki.settings())) as coord:
        started = time.monotonic()
        with pytest.raises(TLSHandshakeError, match=r"the server speaks TLS and this client plaintext"):
            await asyncio.to_thread(ringserve.init, coord.address, connect_timeout_s=10.0, use_uvloop=False)
        assert time.monotonic() - started < FAST_S
        assert not ringserve.is_initialized()


def test_a_server_that_accepts_and_says_nothing_is_not_taken_for_a_plaintext_one(pki: Pki) -> None:
    import socket

    from ringserve.handshake import diagnose

    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel accepts; nobody answers
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        assert diagnose(address, Security.load(WorkerConfig(**pki.settings())), timeout_s=0.5) is None
        assert time.monotonic() - started < FAST_S
