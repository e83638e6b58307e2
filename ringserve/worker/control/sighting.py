"""Whether a holder of the job's last commit, dropped from the view, is still where it was.

A sync that finds no member holding the job's mark asks, before it declares the state lost, what
became of each holder (``ringserve.commits.judge_holders`` decides from the answers). Two looks at
the holder's advertised address, each within the deadline given:

1. A TCP connect. Refused means nothing listens there any more: the process is gone (a killed
   process's sockets are closed by the kernel at once). This is the only proof of absence. A
   stopped or starved process still completes the handshake (its kernel answers for its
   listening socket), so a connect that succeeds proves nothing yet; one that times out or finds
   no route (a host down, a partition) leaves the holder SILENT, to be waited for within the bound.
2. Its peer server's ``Latest``, which answers with the worker's id: the holder's own id means it
   is alive (it rejoins at its next heartbeat); another id means a new process took its port, so
   the holder is gone. No answer within the deadline (stopped, starved) is SILENT.

Each look opens and closes its own connection: a cached channel to the address may sit in gRPC's
reconnect backoff and fail at once without trying, which would pass for an absence.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc

from ringserve._proto import peer_pb2
from ringserve.commits import Seen
from ringserve.worker.control.exclusion import LATEST_METHOD


async def sight(worker_id: str, address: str, channel: Callable[[str], grpc.aio.Channel], timeout_s: float) -> Seen:
    """What is at ``address``, where the worker ``worker_id`` advertised its peer server: ALIVE,
    SILENT or GONE (see the module's docstring). ``channel`` makes a new channel to an address;
    it is closed here."""
    host, _, port = address.rpartition(":")
    try:
        async with asyncio.timeout(timeout_s):
            _, writer = await asyncio.open_connection(host.strip("[]"), int(port))
    except ConnectionRefusedError:
        return Seen.GONE
    except (OSError, TimeoutError, ValueError):  # no route, a name that does not resolve, no answer
        return Seen.SILENT
    writer.transport.abort()  # only the handshake mattered; nothing to flush
    ch = channel(address)
    try:
        method = ch.unary_unary(
            LATEST_METHOD,
            request_serializer=peer_pb2.LatestRequest.SerializeToString,
            response_deserializer=peer_pb2.LatestView.FromString,
        )
        answer = await method(peer_pb2.LatestRequest(), timeout=timeout_s)
    except grpc.aio.AioRpcError:
        return Seen.SILENT
    finally:
        await ch.close()
    # An empty id: a peer too old to say who it is; it listens, so count it alive.
    return Seen.ALIVE if answer.worker_id in (worker_id, "") else Seen.GONE
