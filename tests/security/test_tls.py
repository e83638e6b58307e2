"""TLS and mTLS on the coordinator, the peer servers and every channel, with certificates made at
test time: a job runs under mTLS, and a plaintext client, a client of another CA, an expired
certificate on either side and a missing client certificate are all refused."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from _secure import TOKEN, Pki, client

from ringserve import Coordinator, TLSHandshakeError, Worker, cli, healthcheck
from ringserve._proto import coordinator_pb2 as pb
from ringserve._proto import coordinator_pb2_grpc as pb_grpc
from ringserve.security import Security

pytestmark = pytest.mark.timeout(60)


async def status_code(security: Security, address: str) -> grpc.StatusCode:
    """The code a Status call through ``security`` gets: OK, or why it failed."""
    async with security.channel(address) as channel:
        try:
            await pb_grpc.CoordinatorStub(channel).Status(pb.StatusRequest(), timeout=3)
        except grpc.aio.AioRpcError as exc:
            return exc.code()
    return grpc.StatusCode.OK


async def test_a_job_under_mtls_and_a_token_runs_collectives_and_answers_health_and_status(pki: Pki, world_factory, capsys) -> None:
    settings = pki.settings(token=TOKEN)
    world = await world_factory(3, coordinator=settings, **settings)
    outs = await world.each(lambda w: w.allreduce(np.full(1000, w.rank + 1.0), op="sum"))
    assert all(np.array_equal(o, np.full(1000, 6.0)) for o in outs)
    assert await world.each(lambda w: w.broadcast_object({"from": w.rank}, root=2)) == [{"from": 2}] * 3
    coord = world.coordinator.address
    trusted = client(ca=pki.node.ca, cert=pki.node, token=TOKEN)
    assert await status_code(trusted, coord) == grpc.StatusCode.OK
    for address in (coord, world.workers[0].address):
        serving, message = await asyncio.to_thread(healthcheck.check, address, security=trusted)
        assert serving, message
    args = ["status", "--coordinator", coord, "--json", "--tls-ca", pki.node.ca,
            "--tls-cert", pki.node.cert, "--tls-key", pki.node.key]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("RINGSERVE_TOKEN", TOKEN)
        assert await asyncio.to_thread(cli.main, args) == 0
    assert f'"address": "{world.workers[1].address}"' in capsys.readouterr().out


async def test_a_plaintext_client_is_refused_by_a_tls_coordinator_and_a_tls_peer_server(pki: Pki, world_factory) -> None:
    world = await world_factory(2, coordinator=pki.settings(), **pki.settings())
    for address in (world.coordinator.address, world.workers[0].address):
        async with grpc.aio.insecure_channel(address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await channel.unary_unary("/grpc.health.v1.Health/Check")(b"", timeout=3)
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    serving, message = await asyncio.to_thread(healthcheck.check, world.coordinator.address)
    assert not serving and "UNAVAILABLE" in message


async def test_a_client_that_trusts_another_ca_refuses_the_server(pki: Pki, make_coordinator_config) -> None:
    async with Coordinator(make_coordinator_config(**pki.settings(mtls=False))) as coord:
        assert await status_code(client(ca=pki.other.ca), coord.address) == grpc.StatusCode.UNAVAILABLE
        assert await status_code(client(ca=pki.node.ca), coord.address) == grpc.StatusCode.OK


async def test_a_worker_that_trusts_another_ca_cannot_join_and_says_why(pki: Pki, make_coordinator_config, make_worker_config) -> None:
    async with Coordinator(make_coordinator_config(**pki.settings())) as coord:
        settings = {**pki.settings(), "tls_ca": pki.other.ca}
        worker = Worker(config=make_worker_config(coord.address, connect_timeout_s=1.0, **settings))
        with pytest.raises(TLSHandshakeError, match=f"The TLS handshake with {coord.address} failed, refused by the client"):
            await worker.start()
        assert coord.service.view.view_id == 0
        assert (await coord.service.Status(pb.StatusRequest(), None)).pending_workers == 0


async def test_an_expired_server_certificate_is_refused(pki: Pki, make_coordinator_config) -> None:
    async with Coordinator(make_coordinator_config(**pki.settings(pki.expired, mtls=False))) as coord:
        assert await status_code(client(ca=pki.node.ca), coord.address) == grpc.StatusCode.UNAVAILABLE


async def test_an_expired_client_certificate_is_refused_under_mtls(pki: Pki, make_coordinator_config) -> None:
    async with Coordinator(make_coordinator_config(**pki.settings())) as coord:
        expired = client(ca=pki.node.ca, cert=pki.expired)
        assert await status_code(expired, coord.address) == grpc.StatusCode.UNAVAILABLE
        assert await status_code(client(ca=pki.node.ca, cert=pki.node), coord.address) == grpc.StatusCode.OK


async def test_a_client_certificate_of_another_ca_is_refused_under_mtls(pki: Pki, make_coordinator_config) -> None:
    async with Coordinator(make_coordinator_config(**pki.settings())) as coord:
        stranger = client(ca=pki.node.ca, cert=pki.other)
        assert await status_code(stranger, coord.address) == grpc.StatusCode.UNAVAILABLE


async def test_a_missing_client_certificate_is_refused_only_when_one_is_required(pki: Pki, make_coordinator_config) -> None:
    anonymous = client(ca=pki.node.ca)
    async with Coordinator(make_coordinator_config(**pki.settings(mtls=True))) as coord:
        assert await status_code(anonymous, coord.address) == grpc.StatusCode.UNAVAILABLE
    async with Coordinator(make_coordinator_config(**pki.settings(mtls=False))) as coord:
        assert await status_code(anonymous, coord.address) == grpc.StatusCode.OK


async def test_the_coordinator_probes_a_suspect_worker_over_mtls_and_keeps_a_live_one(pki: Pki, world_factory) -> None:
    settings = pki.settings(token=TOKEN)
    world = await world_factory(2, coordinator=settings, **settings)
    view = world.coordinator.service.view.view_id
    suspect = world.workers[1].worker_id
    answer = await world.coordinator.service.ReportFailure(
        pb.ReportFailureRequest(reporter_id=world.workers[0].worker_id, view_id=view, suspect_rank=1, reason="test"),
        None,
    )
    assert answer == pb.ReportFailureResponse()
    async with asyncio.timeout(10):
        while world.coordinator.service.prober.running:
            await asyncio.sleep(0.02)
    # A live suspect stays: the ring is re-formed in a view of the same members (a bump).
    assert world.coordinator.service.view.view_id <= view + 1
    assert [m.worker_id for m in world.coordinator.service.view.members] == [w.worker_id for w in world.workers]
    assert suspect in [m.worker_id for m in world.coordinator.service.view.members]


async def test_tls_settings_that_cannot_work_are_refused_when_the_config_is_made(pki: Pki, tmp_path) -> None:
    from ringserve import CoordinatorConfig, InvalidArgumentError, WorkerConfig

    with pytest.raises(InvalidArgumentError, match=r"tls_cert .* and tls_key .* must be given together"):
        WorkerConfig(tls_cert=pki.node.cert)
    with pytest.raises(InvalidArgumentError, match=r"tls_require_client_auth needs tls_ca"):
        CoordinatorConfig(tls_cert=pki.node.cert, tls_key=pki.node.key, tls_require_client_auth=True)
    with pytest.raises(InvalidArgumentError, match=r"could not be read"):
        Security.load(WorkerConfig(tls_cert=str(tmp_path / "missing.pem"), tls_key=pki.node.key))
    with pytest.raises(InvalidArgumentError, match=r"needs a certificate and key"):
        Security.load(WorkerConfig(tls_ca=pki.node.ca)).add_port(grpc.aio.server(), "127.0.0.1:0")
