"""Requests that do not parse are refused by name (security.ParseGuard): INVALID_ARGUMENT naming the
method, on unary calls, response streams and request streams (read by iteration or by
``context.read()``), where grpc.aio alone answered UNKNOWN ("Unexpected DecodeError"). A request
that parses is served as before."""

from __future__ import annotations

import grpc
import pytest

from ringserve import Coordinator, CoordinatorConfig
from ringserve._proto import coordinator_pb2 as pb

pytestmark = pytest.mark.timeout(60)

TOKEN = "parse-guard-token"
GARBAGE = b"\x0a\xff\xff\xff\xff\x0f"  # a length-delimited field that claims more than it holds
METADATA = (("authorization", f"Bearer {TOKEN}"),)


def identity(b: bytes) -> bytes:
    return b


@pytest.mark.parametrize(("method", "kind"), [("Status", "unary"), ("Join", "unary"), ("WatchView", "unary_stream"),
                                              ("PutParams", "stream_unary"), ("Heartbeats", "stream_stream")])
async def test_bytes_that_do_not_parse_are_refused_by_name_on_every_kind_of_call(method: str, kind: str) -> None:
    async with Coordinator(CoordinatorConfig(token=TOKEN)) as coord, grpc.aio.insecure_channel(coord.address) as channel:
        path = f"/ringserve.v1.Coordinator/{method}"
        make = getattr(channel, "unary_unary" if kind == "unary" else kind)(
            path, request_serializer=identity, response_deserializer=identity)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            if kind == "unary":
                await make(GARBAGE, metadata=METADATA, timeout=10)
            elif kind == "unary_stream":
                async for _ in make(GARBAGE, metadata=METADATA, timeout=10):
                    pass
            elif kind == "stream_unary":
                await make(iter([GARBAGE]), metadata=METADATA, timeout=10)
            else:
                async for _ in make(iter([GARBAGE]), metadata=METADATA, timeout=10):
                    pass
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value
        assert method in (caught.value.details() or "") and "does not parse" in (caught.value.details() or "")
        if kind == "unary":  # without the token the bytes are never parsed: refused as unauthenticated first
            with pytest.raises(grpc.aio.AioRpcError) as stranger:
                await make(GARBAGE, timeout=10)
            assert stranger.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # And a request that parses is served.
        status = await channel.unary_unary("/ringserve.v1.Coordinator/Status", request_serializer=identity,
                                           response_deserializer=pb.StatusResponse.FromString)(
            pb.StatusRequest().SerializeToString(), metadata=METADATA, timeout=10)
        assert status.min_workers == coord.config.min_workers
