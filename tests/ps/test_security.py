"""The job token and TLS on the parameter server, as on every other ringserve server.

A shard with a token answers UNAUTHENTICATED to any call without it, before the call touches its
state; with TLS (mutual here) it refuses plaintext clients and clients whose certificate another
CA signed; a client with the job's certificate and token trains as usual.
"""

from __future__ import annotations

import pathlib

import grpc
import numpy as np
import pytest
from lsq import START
from psworlds import PSWorld, start_ps_world

from ringserve._proto import ps_pb2 as pb
from ringserve._proto import ps_pb2_grpc as pb_grpc
from ringserve.ps import Optimizer
from ringserve.security import Security
from ringserve.testing.pki import CertFiles, CertificateAuthority

pytestmark = pytest.mark.timeout(60)

TOKEN = "ps-token-51b2"


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[CertFiles, CertFiles]:
    directory = tmp_path_factory.mktemp("ps-pki")
    return (CertificateAuthority("job CA").issue_files(directory, "node"),
            CertificateAuthority("another CA").issue_files(directory, "other"))


def tls(files: CertFiles, ca: str) -> dict[str, object]:
    return dict(tls_cert=files.cert, tls_key=files.key, tls_ca=ca, tls_require_client_auth=True)


async def secure_world(node: CertFiles) -> PSWorld:
    settings = {**tls(node, node.ca), "token": TOKEN}
    return await start_ps_world(2, 2, coordinator=settings, shard=settings, client=settings, **settings)


async def info(address: str, security: Security) -> pb.InfoResponse:
    async with security.channel(address) as channel:
        answer = await pb_grpc.ParameterServerStub(channel).Info(pb.InfoRequest(), timeout=5)
    assert isinstance(answer, pb.InfoResponse)
    return answer


def read(path: str) -> bytes:
    return pathlib.Path(path).read_bytes()


async def test_workers_with_the_jobs_certificate_and_token_train_through_tls_shards(
        certs: tuple[CertFiles, CertFiles]) -> None:
    node, _ = certs
    ps = await secure_world(node)
    try:
        await ps.each(lambda r, c: c.init(START, mode="sync", optimizer=Optimizer(kind="sgd", lr=1.0), seed=r == 0))
        await ps.each(lambda r, c: c.pull())
        await ps.each(lambda r, c: c.push({"w": np.ones_like(START["w"])}))
        values = await ps.each(lambda r, c: c.pull())
        np.testing.assert_array_equal(values[0]["w"], -1.0)
    finally:
        await ps.close()


async def test_a_call_without_the_token_is_refused_unauthenticated_and_changes_nothing(
        certs: tuple[CertFiles, CertFiles]) -> None:
    node, _ = certs
    ps = await secure_world(node)
    try:
        await ps.clients[0].init(START, mode="async", optimizer=Optimizer(kind="sgd", lr=1.0))
        address = ps.shards[0].address
        no_token = Security(cert=read(node.cert), key=read(node.key), ca=read(node.ca))
        wrong = Security(cert=read(node.cert), key=read(node.key), ca=read(node.ca), token="guess")
        for security in (no_token, wrong):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await info(address, security)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED

            async def push():  # type: ignore[no-untyped-def]
                yield pb.PushMessage(header=pb.PushHeader(worker_id="intruder"))

            async with security.channel(address) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await pb_grpc.ParameterServerStub(channel).Push(push(), timeout=5)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        right = Security(cert=read(node.cert), key=read(node.key), ca=read(node.ca), token=TOKEN)
        state = await info(address, right)
        assert (state.version, state.pushes_applied, state.pushes_refused) == (0, 0, 0)
    finally:
        await ps.close()


async def test_tls_shards_refuse_plaintext_clients_and_certificates_of_another_ca(
        certs: tuple[CertFiles, CertFiles]) -> None:
    node, other = certs
    ps = await secure_world(node)
    try:
        address = ps.shards[0].address
        plaintext = Security(token=TOKEN)
        strangers = Security(cert=read(other.cert), key=read(other.key), ca=read(node.ca), token=TOKEN)
        for security in (plaintext, strangers):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await info(address, security)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await ps.close()


async def test_the_coordinators_directory_needs_the_token_too(certs: tuple[CertFiles, CertFiles]) -> None:
    from ringserve._proto import coordinator_pb2 as cpb
    from ringserve._proto import coordinator_pb2_grpc as cpb_grpc

    node, _ = certs
    ps = await secure_world(node)
    try:
        no_token = Security(cert=read(node.cert), key=read(node.key), ca=read(node.ca))
        async with no_token.channel(ps.address) as channel:
            stub = cpb_grpc.CoordinatorStub(channel)
            for call in (stub.ListShards(cpb.ListShardsRequest(), timeout=5),
                         stub.RegisterShard(cpb.RegisterShardRequest(shard_id="x", address="h:1", shards=2), timeout=5)):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await ps.close()
