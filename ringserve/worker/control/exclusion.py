"""Whether a worker that lost the coordinator must stop: no split brain, ever.

A worker that cannot reach the coordinator keeps training while its peers do: the coordinator may
just be restarting, and the ring does not need it. But once the coordinator has declared the worker
dead (it has been silent for a heartbeat timeout) and published a view without it, the peers move
on, and the worker must not go on as a second world, nor wait out the elastic timeout for a view it
can never hear of. It asks the peers of its last view which view they are in (``Peer/Latest``,
answered from their memory, no coordinator involved): a newer view than any it heard of is the
proof that the world went on without it, unless the coordinator is reachable again: then it rejoins
(the worker's loops dial the coordinator on a new connection before they give up, see
``ControlClient.redial``). Before a heartbeat timeout has passed, nothing is asked:
the coordinator cannot have declared it dead yet. If every peer is as cut off as it is, none has a
newer view, and they all keep waiting for the coordinator together, which is the restart case.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence

import grpc

from ringserve._proto import peer_pb2

LATEST_METHOD = "/ringserve.v1.Peer/Latest"


def must_ask(silent_s: float, heartbeat_timeout_s: float) -> bool:
    """Whether the coordinator may have declared a worker silent for ``silent_s`` dead."""
    return silent_s >= heartbeat_timeout_s


def excluded(own_view: int, peer_views: Sequence[int]) -> int:
    """The newer view the peers went on to without us (0: none, keep going)."""
    newest = max(peer_views, default=0)
    return newest if newest > own_view else 0


async def peer_views(
    addresses: Sequence[str], channel: Callable[[str], grpc.aio.Channel], timeout_s: float
) -> list[int]:
    """Each peer's newest view (0 for a peer that did not answer within timeout_s)."""

    async def ask(address: str) -> int:
        method = channel(address).unary_unary(
            LATEST_METHOD,
            request_serializer=peer_pb2.LatestRequest.SerializeToString,
            response_deserializer=peer_pb2.LatestView.FromString,
        )
        try:
            answer = await method(peer_pb2.LatestRequest(), timeout=timeout_s)
        except (grpc.aio.AioRpcError, grpc.aio.UsageError):  # unreachable, or its channel just closed
            return 0
        return int(answer.view_id)

    return list(await asyncio.gather(*(ask(a) for a in addresses)))
